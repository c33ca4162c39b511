"""``--nproc-per-node N`` under an arbiter that goes away: failing open is the node's.

A worker that fails open decides with the node's local group, as without an arbiter:
its crash stops every local worker, and none starts the next generation before every
local trainer of the failed one has exited (a worker restarted alone would meet peers
still in the old generation's collectives). Real processes: the launcher, four workers,
a real arbiter that is SIGKILLed mid-run (or none listening at all).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
from pathlib import Path

import pytest

from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import PY, ftagent_cmd, read_events, wait_for
from tests.integration.test_launcher import clean_env

# Attempt 0: every worker marks its start and runs until stopped (30 s: only a worker that
# is never told to stop gets to the end); once the test says "go", local rank 2 crashes.
# Its peers take 0.5 s to exit on SIGTERM, so a worker restarted before its peers have
# exited is seen as such. Attempt 1: every worker marks its start and exits 0.
WORKER = r'''
import os, signal, sys, time
lr = int(os.environ["LOCAL_RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
d = os.environ["DUMP_DIR"]
open(os.path.join(d, f"{lr}.{attempt}"), "w").close()
if attempt == 0:
    def slow_exit(sig, frame):
        time.sleep(0.5)
        sys.exit(143)
    signal.signal(signal.SIGTERM, slow_exit)
    for _ in range(600):
        if lr == 2 and os.path.exists(os.path.join(d, "go")):
            sys.stderr.write("worker 2 failed on purpose\n")
            sys.exit(3)
        time.sleep(0.05)
'''


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket closes


@pytest.mark.parametrize("outage", ["arbiter killed mid-run", "no arbiter at all"])
def test_fail_open_with_local_workers_restarts_the_whole_node_together(
        tmp_path: Path, outage: str) -> None:
    dump = tmp_path / "ft"
    dump.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    events = tmp_path / "events.jsonl"
    killed = outage == "arbiter killed mid-run"
    with ArbiterProcess() if killed else contextlib.nullcontext() as arbiter:
        address = arbiter.address if arbiter is not None else f"127.0.0.1:{closed_port()}"
        cmd = ftagent_cmd("--arbiter", address, "--arbiter-fail-open-after", "1",
                          "--job", "failopen", "--nproc-per-node", "4", "--max-restarts", "1",
                          "--restart-backoff", "0", "--progress", "none",
                          "--events-file", str(events), cmd=[PY, str(script)])
        proc = subprocess.Popen(cmd, env=clean_env(DUMP_DIR=str(dump)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: all((dump / f"{i}.0").exists() for i in range(4)), 60,
                     "every worker's first attempt to start")
            if arbiter is not None:
                # the arbiter released the job's barrier: all four started through it
                released = [e for e in read_events(events)
                            if e["event"] == "state" and e["kind"] == "released"]
                assert len(released) == 4, released
                arbiter.kill()
            (dump / "go").touch()
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    ev = read_events(events)
    crashes = [e for e in ev if e["event"] == "fault" and e["kind"] == "crash"]
    assert [(e["local_rank"], e["exit_code"]) for e in crashes] == [(2, 3)]  # peers: stopped
    restarts = [e for e in ev if e["event"] == "action" and e["kind"] == "restart"]
    assert sorted(e["local_rank"] for e in restarts) == [0, 1, 2, 3]
    assert len({e["action_id"] for e in restarts}) == 1  # one decision, the group's
    # every worker ran attempt 1, and none started before all of attempt 0 had exited
    second = [e for e in ev if e["event"] == "state" and e["kind"] == "running"
              and e["attempt"] == 1]
    assert sorted(e["local_rank"] for e in second) == [0, 1, 2, 3]
    first_exits = [e for e in ev if e["event"] == "state" and e["kind"] == "exited"
                   and e["ts"] < min(s["ts"] for s in second)]
    assert sorted(e["local_rank"] for e in first_exits) == [0, 1, 2, 3]
    assert all((dump / f"{i}.1").exists() for i in range(4))
    assert "unreachable" in err or "no arbiter" in err
