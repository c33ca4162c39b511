"""A capture while another tracer holds the trainer: py-spy's attach is retried.

Why: ``test_job_hang_dumps_stacks_names_the_culprit_and_restarts`` sometimes got a capture
with no frames for rank 1. A process has one ptrace tracer at a time; two py-spy dumps of
one pid started together fail one of them at once with ``Failed to suspend process: EPERM``
(about 1 in 7 here), and the agent's verification sampler and its DUMP_STACKS answer, or
an operator's py-spy, do overlap. These tests hold the trainer with a real tracer (a
helper that PTRACE_ATTACHes to it) and start real concurrent dumps.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from ftagent.agent.evidence import capture, find_py_spy, py_spy_error, sample_process
from ftagent.detect.liveness import ProcessSample
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")

STUCK = textwrap.dedent("""
    import time
    def stuck_in_allreduce():
        print("ready", flush=True)
        time.sleep(1000)
    stuck_in_allreduce()
""")

# Attach to PID with ptrace (as py-spy or gdb do), say so, hold it until stdin closes or
# HOLD seconds pass, detach.
TRACER = textwrap.dedent("""
    import ctypes, os, select, sys
    pid, hold = int(sys.argv[1]), float(sys.argv[2])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
        print("attach failed", ctypes.get_errno(), flush=True); sys.exit(1)
    os.waitpid(pid, 0x40000000)  # __WALL: the stop of the attach
    print("attached", flush=True)
    select.select([sys.stdin], [], [], hold)
    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
""")


def tracer_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("TracerPid:"))


@pytest.fixture
def stuck() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_SLEEPING, 10,
             "the stuck process to sleep")
    yield proc
    proc.kill()
    proc.wait()


def hold(pid: int, seconds: float) -> subprocess.Popen[bytes]:
    t = subprocess.Popen([sys.executable, "-c", TRACER, str(pid), str(seconds)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert t.stdout is not None
    line = t.stdout.readline()
    if line != b"attached\n":
        t.kill()
        pytest.skip(f"cannot ptrace here: {line!r}")
    assert tracer_of(pid) == t.pid
    return t


def test_dump_while_another_tracer_holds_the_process_succeeds_after_it_lets_go(
        stuck: subprocess.Popen[bytes]) -> None:
    tracer = hold(stuck.pid, 0.2)
    try:
        # the first attach must fail: the process is traced right now
        result = asyncio.run(capture([stuck.pid], deadline_seconds=20))
    finally:
        tracer.kill()
        tracer.wait()
    [entry] = result["processes"]
    assert entry["error"] is None, entry["error"]
    assert "stuck_in_allreduce" in entry["stack"]


def test_a_tracer_that_never_lets_go_is_named_in_words(
        stuck: subprocess.Popen[bytes]) -> None:
    tracer = hold(stuck.pid, 60)
    try:
        # deadlines long enough for every retry on a loaded machine (the tracer holds 60 s)
        result = asyncio.run(capture([stuck.pid], deadline_seconds=6.0))
        sample, entry = sample_process(stuck.pid, find_py_spy(), deadline=_in(6.0))
    finally:
        tracer.kill()
        tracer.wait()
    for err in (result["processes"][0]["error"], entry["error"]):
        assert "Failed to suspend process" in err and "attempts" in err, err
        assert "9: main" not in err and "SYS_PTRACE" not in err  # not a missing capability
    assert sample.threads is None


def _in(seconds: float) -> float:
    import time

    return time.monotonic() + seconds


def test_two_concurrent_dumps_of_one_process_both_get_frames(
        stuck: subprocess.Popen[bytes]) -> None:
    """What the verification sampler and a DUMP_STACKS answer do at the same moment; each
    pair failed one dump about 1 time in 7 before the retry."""
    exe = find_py_spy()
    for _ in range(15):
        got: list[tuple[ProcessSample, dict[str, Any]]] = []
        start = threading.Barrier(2)
        t = threading.Thread(target=lambda b=start, g=got: (
            b.wait(), g.append(sample_process(stuck.pid, exe, _in(20)))))
        t.start()
        start.wait()
        result = asyncio.run(capture([stuck.pid], deadline_seconds=20))
        t.join()
        [entry] = result["processes"]
        assert entry["error"] is None and "stuck_in_allreduce" in entry["stack"], entry
        [(sample, sentry)] = got
        assert sentry["error"] is None and sample.threads, sentry


def test_py_spy_error_reads_the_cause_not_the_backtrace() -> None:
    stderr = ("Error: Failed to get stack traces\n\nCaused by:\n    0: Failed to suspend "
              "process\n    1: EPERM: Operation not permitted\n    2: EPERM: Operation not "
              "permitted\n\nStack backtrace:\n   0: <E as anyhow::context::ext::StdError>\n"
              "   9: main\n")
    assert py_spy_error(stderr) == ("Failed to get stack traces: Failed to suspend process: "
                                    "EPERM: Operation not permitted")
    denied = "Permission Denied: Try running again with elevated permissions by going 'sudo'"
    assert "SYS_PTRACE" in py_spy_error(denied)
    assert py_spy_error("") == "no output"
