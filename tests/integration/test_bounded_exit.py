"""A stuck agent at exit still exits, within --exit-timeout, with the trainer's status.

Real processes: ``ftagent run`` (the CLI's own ``main``, in a process of its own) with a
watch part registered the way a new source is (watch/registry.py ``FACTORIES``: one
name, one factory) whose source is broken in one of the two ways that kept a finished
pod running:

* ``task``: its ``run`` swallows its cancellation and waits again (the shape of CPython
  gh-86296's lost cancellation, which hung the agent at exit in stop 42): ``Worker.run``
  and ``asyncio.run`` awaited it forever;
* ``thread``: it waits on a blocking call in the loop's default executor that never
  returns (NVML on a wedged GPU): its task ends when cancelled, but ``asyncio.run``'s end
  joins the executor's threads, and so does the interpreter's exit.

On the old code the agent never exits: each test's own deadline (``subprocess.run``'s
timeout) fails it (checked against the stashed code). Now it exits within the bound (plus
a start-up allowance for a loaded machine) with the code the normal path returns (0, 42,
128+15 after SIGTERM, the first failing worker's under the launcher), names what did not
end in one error line, and the events file has the trainer's exit and the agent's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
BOUND = 1.0  # --exit-timeout
DEADLINE = 40.0  # the test's own: an agent that never exits fails here (the old code)

HARNESS = """
import asyncio, sys, threading
from ftagent.watch import registry

class Stubborn:
    async def run(self, emit):
        if sys.argv[1] == "thread":  # a blocking call that never returns
            await asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)
        while True:  # a cancellation swallowed, the wait started again
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

class StuckPart:
    name = "stuck"
    def sources(self): return [Stubborn()]
    def detectors(self): return []
    def collector(self, labels): return None

registry.FACTORIES["stuck"] = lambda ctx: StuckPart()
from ftagent.cli import main
raise SystemExit(main(["run", *sys.argv[2:]]))
"""


def _env(bound: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTAGENT_", "PET_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["FTAGENT_EXIT_TIMEOUT"] = str(bound)  # (ignored by the old code, which then hangs)
    return env


def _agent(tmp: Path, how: str, *flags: str, cmd: str,
           bound: float = BOUND) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", HARNESS, how,  # the bound: FTAGENT_EXIT_TIMEOUT (_env)
            "--events-file", str(tmp / "events.jsonl"), "--metrics-port", "-1",
            "--no-preflight", "--no-warm-restart", "--max-restarts", "0", *flags,
            "--", "sh", "-c", cmd]
    return subprocess.Popen(args, env=_env(bound), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _events(tmp: Path) -> list[dict[str, Any]]:
    p = tmp / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _exited_at(tmp: Path) -> float:
    """When the last trainer's exit was written (the events' wall-clock ``ts``)."""
    return max(e["ts"] for e in _events(tmp) if e.get("kind") == "exited")


def _finish(agent: subprocess.Popen[str]) -> tuple[int, str, float]:
    """The agent's status, its stderr and when it ended (wall clock); killed (with its
    group) when it does not end by the test's deadline: the failure of the old code."""
    try:
        _, err = agent.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        _, err = agent.communicate()
        pytest.fail(f"the agent did not exit within {DEADLINE:.0f}s of its start "
                    f"(--exit-timeout {BOUND}): {err[-1500:]}")
    return agent.returncode, err, time.time()


def _check(tmp: Path, rc: int, err: str, ended: float, status: int, named: str,
           bound: float = BOUND) -> None:
    assert rc == status, err[-2000:]
    lines = [ln for ln in err.splitlines() if "did not end within --exit-timeout" in ln]
    assert len(lines) == 1, err[-2000:]
    assert " ERROR " in lines[0] and f"status {status}" in lines[0] and named in lines[0]
    # within the bound of the trainer's exit (+ the guard's slack and a loaded machine's)
    assert ended - _exited_at(tmp) < bound + 6.0, err[-2000:]
    exits = [e for e in _events(tmp) if e.get("event") == "exit"]
    assert exits and all(e["exit_status"] in (0, status) for e in exits)
    # the trainers' trees went before the agent (their pids: gone, or a zombie of init's)
    for pid in (e["pid"] for e in _events(tmp) if e.get("kind") == "running"):
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


@pytest.mark.parametrize("status", [0, 42])
def test_a_task_that_swallows_its_cancellation_does_not_hold_the_exit(
        tmp_path: Path, status: int) -> None:
    agent = _agent(tmp_path, "task", cmd=f"echo trained; exit {status}")
    rc, err, ended = _finish(agent)
    # the source's task, suspended in the stubborn source (file:line of the harness's)
    _check(tmp_path, rc, err, ended, status, "Stubborn.run")
    assert "(WatchLoop._guard)" in err
    (exit_,) = [e for e in _events(tmp_path) if e.get("event") == "exit"]
    assert exit_["exit_status"] == status and exit_["stuck"] == ["watch"]


def test_a_thread_that_never_returns_does_not_hold_the_exit_of_the_launcher(
        tmp_path: Path) -> None:
    """Two workers (--nproc-per-node 2): local rank 1's trainer exits 42, rank 0's 0: the
    agent's status is the first failing worker's, as on the normal path. The default
    executor's thread blocks the interpreter's exit: the exit guard names it and ends the
    process."""
    agent = _agent(tmp_path, "thread", "--nproc-per-node", "2", "--standalone",
                   cmd="exit $((LOCAL_RANK * 42))")
    rc, err, ended = _finish(agent)
    _check(tmp_path, rc, err, ended, 42, "in Event.wait")  # the executor thread's


def test_after_sigterm_the_status_is_the_signals(tmp_path: Path) -> None:
    """SIGTERM to the agent: forwarded, the trainer dies of it (128+15), the stuck task is
    left behind within the bound (after a signal: no later than --stop-timeout from it)."""
    agent = _agent(tmp_path, "task", cmd="echo up; exec sleep 60")
    wait_for(lambda: any(e.get("kind") == "running" for e in _events(tmp_path)),
             timeout=30, what="the trainer running")
    os.kill(agent.pid, signal.SIGTERM)
    rc, err, ended = _finish(agent)
    _check(tmp_path, rc, err, ended, 128 + signal.SIGTERM, "Stubborn.run")


def test_after_sigterm_the_bound_ends_with_the_signals_grace(tmp_path: Path) -> None:
    """--stop-timeout is the pod's terminationGracePeriodSeconds: the kubelet SIGKILLs
    the agent then, and its exit code is lost. A trainer whose handler takes 1 s of its
    3 s exits 7; the agent's cleanup, stuck, would have --exit-timeout 10 s after that,
    but ends by the signal's grace (3 s from it), with the trainer's 7."""
    ready = tmp_path / "ready"
    agent = _agent(tmp_path, "task", "--stop-timeout", "3", bound=10.0,
                   cmd=f"trap 'sleep 1; exit 7' TERM; touch {ready}; while :; do sleep 0.1; done")
    wait_for(ready.exists, timeout=30, what="the trainer's handler installed")
    signalled = time.time()
    os.kill(agent.pid, signal.SIGTERM)
    rc, err, ended = _finish(agent)
    _check(tmp_path, rc, err, ended, 7, "Stubborn.run", bound=10.0)
    assert "(after a stop signal: by --stop-timeout's end at the latest)" in err
    assert ended - signalled < 3.0 + 3.0, err[-2000:]  # not 1 + 10 (a loaded machine's 3)


def test_the_arbiter_hears_the_exit_of_an_agent_stuck_at_exit(tmp_path: Path) -> None:
    """Under an arbiter: the trainer's exit goes to it as it happens and the goodbye (the
    decider's close) is its own step, bounded apart from the stuck task: the job reads
    succeeded at the arbiter, and the agent exits 0 within the bound."""
    import asyncio

    from tests.arbiter_helpers import ArbiterProcess, wait_until
    from tests.integration.test_exit_reaches_arbiter import get_job

    with ArbiterProcess(log_dir=str(tmp_path)) as arbiter:
        agent = _agent(tmp_path, "task", "--arbiter", arbiter.address, "--job", "stuckexit",
                       "--rank", "0", "--world-size", "1", cmd="echo trained; exit 0")
        rc, err, ended = _finish(agent)
        _check(tmp_path, rc, err, ended, 0, "Stubborn.run")

        async def succeeded() -> bool:
            info = await get_job(arbiter.address, "stuckexit")
            return info is not None and info.state == "succeeded"

        asyncio.run(wait_until(succeeded, 20, "the job succeeded at the arbiter",
                               interval=0.05))
