"""The stop grace of a restart belongs to the trainer's handler, not to the interpreter's
teardown after it (agent/stop_grace.py); a stop signal forwarded from outside leaves the
trainer's exit code its own: real ``ftagent run`` agents, real trainers, real signals."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time
from pathlib import Path

from tests.conftest import PY, ftagent_cmd, popen, wait_for

# A trainer whose SIGTERM handler asks for a stop at the next step, whose code then ends,
# and whose finalization takes TEARDOWN s (a cycle freed by the last garbage collection,
# as DDP and a process group are): the shape of a torch trainer stopped for a restart.
SLOW_TEARDOWN = """
    import os, signal, time
    asked = []
    signal.signal(signal.SIGTERM, lambda *a: asked.append(1))
    class Teardown:
        def __del__(self, time=time):
            t = time.monotonic()
            while time.monotonic() - t < float(os.environ["TEARDOWN"]):
                pass
    cycle = [Teardown()]
    cycle.append(cycle)
    open(os.environ["READY"], "w").close()
    while not asked:
        time.sleep(0.01)
"""

# Under the launcher: local rank 1 is that trainer; local rank 0 crashes once rank 1 is
# ready, so the group stops rank 1 (the agent's own SIGTERM) and restarts both; the
# second attempt ends at once.
GROUP = """
    import os, sys, time
    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) > 0:
        sys.exit(0)
    if os.environ["LOCAL_RANK"] == "0":
        while not os.path.exists(os.environ["READY"]):
            time.sleep(0.01)
        sys.exit(3)
""" + SLOW_TEARDOWN  # local rank 1 (rank 0 never gets past the lines above)

# An emergency save: the handler stays installed while it saves, then exits with its code.
EMERGENCY_SAVE = """
    import os, signal, time
    def save(*a):
        time.sleep(0.5)
        open(os.environ["SAVED"], "w").close()
        os._exit(7)
    signal.signal(signal.SIGTERM, save)
    open(os.environ["READY"], "w").close()
    time.sleep(60)
"""


def _start(tmp_path: Path, code: str, *flags: str, **env: str) -> subprocess.Popen[bytes]:
    ready = tmp_path / "ready"
    proc = popen(ftagent_cmd("--stop-timeout", "30", *flags,
                             cmd=[PY, "-c", textwrap.dedent(code)]),
                 stderr=subprocess.PIPE, env={"READY": str(ready), **env})
    wait_for(ready.exists, 30, "trainer ready")
    return proc


def test_a_restarts_stop_does_not_wait_for_the_teardown_after_the_handler(
        tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = _start(tmp_path, GROUP, "--standalone", "--nproc-per-node", "2",
                  "--max-restarts", "1", "--no-warm-restart", TEARDOWN="20")
    code = proc.wait(timeout=60)
    took = time.monotonic() - t0
    # before: the stop waited out the 20 s teardown; now the SIGTERM is delivered again
    # once the handler is gone, and the teardown ends by it
    assert code == 0, proc.stderr.read().decode() if proc.stderr else ""
    assert took < 12, f"the restart took {took:.1f}s"


def test_a_forwarded_stop_leaves_the_trainer_its_teardown_and_its_exit_code(
        tmp_path: Path) -> None:
    proc = _start(tmp_path, SLOW_TEARDOWN, TEARDOWN="1.5")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=40)
    # the pod going: the trainer's handler ended its code, its exit (0, after its
    # teardown) is what the agent exits with, not a signal the agent sent again
    assert code == 0
    assert time.monotonic() - t0 >= 1.5


def test_a_handler_still_saving_keeps_its_grace(tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    proc = _start(tmp_path, EMERGENCY_SAVE, SAVED=str(saved))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=40) == 7  # its own exit: never signalled again while saving
    assert saved.exists()
