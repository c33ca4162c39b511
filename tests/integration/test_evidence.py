"""Hang evidence from real processes: py-spy stacks and psutil state, never an exception."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from types import FrameType

import psutil
import pytest

from ftagent.agent.evidence import capture, find_py_spy
from tests.conftest import wait_for

STUCK = textwrap.dedent("""
    import sys, time
    def stuck_in_allreduce():
        print("ready", flush=True)
        time.sleep(1000)
    stuck_in_allreduce()
""")

pytestmark = pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")


@pytest.fixture
def stuck() -> Iterator[subprocess.Popen[bytes]]:
    """A process blocked in a function with a distinctive name, ready when it says so."""
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"  # it printed after entering the function
    # "ready" comes just before the sleep: on a loaded machine the process may still be
    # running for a moment; the tests want it parked in the sleep
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_SLEEPING, 10,
             "the stuck process to sleep")
    yield proc
    proc.kill()
    proc.wait()


def test_stack_names_the_blocking_function(stuck: subprocess.Popen[bytes]) -> None:
    result = asyncio.run(capture([stuck.pid], deadline_seconds=20))
    json.dumps(result)  # JSON-serialisable as it is
    [entry] = result["processes"]
    assert entry["error"] is None, entry["error"]
    assert "stuck_in_allreduce" in entry["stack"]
    assert entry["pid"] == stuck.pid
    assert entry["status"] == "sleeping"
    assert entry["cmdline"][:2] == [sys.executable, "-c"]
    assert entry["num_threads"] >= 1 and entry["cpu_times"]["user"] >= 0
    assert 0 <= result["seconds"] < 20


def test_dead_pid_is_an_error_entry_not_an_exception() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # exited and reaped: the pid is free
    result = asyncio.run(capture([proc.pid], deadline_seconds=5))
    [entry] = result["processes"]
    assert entry["stack"] is None and "no such process" in entry["error"]


def test_many_pids_concurrently_with_one_dead(stuck: subprocess.Popen[bytes]) -> None:
    other = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE)
    try:
        assert other.stdout is not None and other.stdout.readline() == b"ready\n"
        result = asyncio.run(capture([stuck.pid, 2**22 + 7, other.pid, stuck.pid], 20))
    finally:
        other.kill()
        other.wait()
    entries = {e["pid"]: e for e in result["processes"]}
    assert len(result["processes"]) == 3  # duplicates captured once
    assert "stuck_in_allreduce" in entries[stuck.pid]["stack"]
    assert "stuck_in_allreduce" in entries[other.pid]["stack"]
    assert entries[2**22 + 7]["error"]


def test_missing_py_spy_still_reports_process_state(stuck: subprocess.Popen[bytes]) -> None:
    result = asyncio.run(capture([stuck.pid], 5, py_spy="no-such-py-spy-binary"))
    [entry] = result["processes"]
    assert entry["stack"] is None and "py-spy not found" in entry["error"]
    assert entry["status"] == "sleeping"


def test_deadline_is_respected(stuck: subprocess.Popen[bytes]) -> None:
    result = asyncio.run(capture([stuck.pid], deadline_seconds=0.0))
    [entry] = result["processes"]
    assert entry["stack"] is None and "deadline" in entry["error"]
    assert result["seconds"] < 2.0


def test_works_while_a_sigchld_reaper_steals_exit_statuses(
        stuck: subprocess.Popen[bytes]) -> None:
    """The agent reaps children with waitpid(-1) on SIGCHLD; py-spy's status may vanish."""
    reaped: list[int] = []

    def reaper(signum: int, frame: FrameType | None) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            reaped.append(pid)

    old = signal.signal(signal.SIGCHLD, reaper)
    try:  # a few times: who reaps py-spy first is a race
        results = [asyncio.run(capture([stuck.pid], deadline_seconds=20)) for _ in range(3)]
    finally:
        signal.signal(signal.SIGCHLD, old)
    for result in results:
        [entry] = result["processes"]
        assert entry["error"] is None and "stuck_in_allreduce" in entry["stack"]


def test_no_pids() -> None:
    assert asyncio.run(capture([], 1.0)) == {"processes": [], "seconds": 0.0}
