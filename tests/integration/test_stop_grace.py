"""The stop grace belongs to the trainer's handler, not to the interpreter's teardown after
it (agent/stop_grace.py): real ``ftagent run`` agents, real trainers, real signals."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time
from pathlib import Path

from tests.conftest import PY, ftagent_cmd, popen, wait_for

# A trainer whose SIGTERM handler asks for a stop at the next step, whose code then ends,
# and whose finalization takes 20 s (a cycle freed by the last garbage collection, as
# DDP and a process group are): the shape of a torch trainer stopped for a restart.
SLOW_TEARDOWN = """
    import os, signal, time
    asked = []
    signal.signal(signal.SIGTERM, lambda *a: asked.append(1))
    class Teardown:
        def __del__(self, time=time):
            t = time.monotonic()
            while time.monotonic() - t < 20:
                pass
    cycle = [Teardown()]
    cycle.append(cycle)
    open(os.environ["READY"], "w").close()
    while not asked:
        time.sleep(0.01)
"""

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


def _start(tmp_path: Path, code: str, **env: str) -> subprocess.Popen[bytes]:
    ready = tmp_path / "ready"
    proc = popen(ftagent_cmd("--stop-timeout", "30", cmd=[PY, "-c", textwrap.dedent(code)]),
                 stderr=subprocess.PIPE, env={"READY": str(ready), **env})
    wait_for(ready.exists, 30, "trainer ready")
    return proc


def test_teardown_after_the_handler_does_not_hold_the_stop(tmp_path: Path) -> None:
    proc = _start(tmp_path, SLOW_TEARDOWN)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=40)
    took = time.monotonic() - t0
    # before: the stop waited out the 20 s teardown (then exit 0); now the SIGTERM is
    # delivered again once the handler is gone, and the teardown ends by it
    assert took < 10, f"the stop took {took:.1f}s"
    assert code == 128 + signal.SIGTERM


def test_a_handler_still_saving_keeps_its_grace(tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    proc = _start(tmp_path, EMERGENCY_SAVE, SAVED=str(saved))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=40) == 7  # its own exit: never signalled again while saving
    assert saved.exists()
