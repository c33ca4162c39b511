"""A SIGSTOPped trainer's sample is quick: py-spy cannot attach to a stopped process, and
retrying until the deadline only delayed the agent's answer to the arbiter (issue 22's
SIGSTOP job: each of 5 verification samples took the whole 2 s dump deadline)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ftagent.agent.evidence import find_py_spy, sample_process
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")


def test_a_stopped_process_is_sampled_once_and_said_to_be_stopped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 10,
                 "the process stopped", interval=0.02)
        sample, entry = sample_process(proc.pid, find_py_spy(), time.monotonic() + 10)
    finally:
        proc.kill()
        proc.wait()
    assert entry["status"] == "stopped" and entry["stack"] is None, entry
    # one py-spy run, no retries (the old code: "... (8 attempts)", ~2 s of them)
    assert "(the process is stopped: SIGSTOP)" in entry["error"], entry["error"]
    assert "attempts" not in entry["error"], entry["error"]
