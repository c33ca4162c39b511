"""The bounded exit's pure parts (agent/shutdown.py): its deadline, the status it exits
with (the normal path's), and the one line that names what did not end. No sleeps: the
clock is a number; tasks and threads are looked at where they wait. The exit itself, with
real processes: tests/integration/test_bounded_exit.py."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from ftagent.agent import shutdown
from ftagent.agent.pod import PodAgent, RunResult, WorkerFailure
from ftagent.agent.shutdown import (
    FLOOR,
    MAX_NAMED,
    Stuck,
    cleanup_deadline,
    goodbye_deadline,
    stuck_line,
    stuck_task,
    stuck_thread,
)
from ftagent.agent.worker_spec import WorkerSpec
from ftagent.cmd.run import exit_deadline, parse
from ftagent.model import TrainerState
from tests.conftest import wait_for


def test_the_cleanup_gets_its_bound_from_the_trainers_exit() -> None:
    assert cleanup_deadline(100.0, 10.0) == 110.0
    assert cleanup_deadline(100.0, 0.0) == 100.0


@pytest.mark.parametrize(("stop_deadline", "want"), [
    (200.0, 110.0),  # the signal's grace ends long after: the bound
    (105.0, 105.0),  # the kubelet's SIGKILL comes first: no later than it
    (99.0, 100.0 + FLOOR),  # the trainer used all of it: a moment for the normal cleanup
])
def test_after_a_stop_signal_the_cleanup_ends_by_the_signals_grace(
        stop_deadline: float, want: float) -> None:
    assert cleanup_deadline(100.0, 10.0, stop_deadline) == want
    assert cleanup_deadline(100.0, 0.5, 99.0) == 100.5  # never past the bound itself


def test_the_goodbye_to_an_arbiter_that_is_away_keeps_its_fail_open_wait() -> None:
    assert goodbye_deadline(100.0, 110.0, 15.0) == 100.0 + 15.0 + shutdown.GOODBYE_SLACK
    assert goodbye_deadline(100.0, 110.0, 0.0) == 110.0  # no arbiter: the bound
    assert goodbye_deadline(100.0, 99.0, 0.0) == 99.0  # (one the stuck tasks used up)
    assert goodbye_deadline(100.0, 101.0, 15.0, stop_deadline=105.0) == 105.0
    assert goodbye_deadline(100.0, 101.0, 15.0, stop_deadline=90.0) == 101.0


@pytest.mark.parametrize(("codes", "status"), [
    ({0: 0}, 0),
    ({0: 42}, 42),
    ({0: 128 + 15}, 128 + 15),  # SIGTERM: forwarded, the trainer died of it
    ({0: 0, 1: 42, 2: 7}, 42),  # the launcher: the first failing local rank's
    ({0: 215, 1: 0}, 215),  # --exit-replace
])
def test_the_bounded_exit_returns_the_normal_paths_status(
        codes: dict[int, int], status: int) -> None:
    """cmd/run.py exits with ``RunResult.exit_status`` on both paths: the bound changes
    when, never with what."""
    failures = {r: WorkerFailure(r, c, TrainerState.FAILED) for r, c in codes.items() if c}
    values = {r: c for r, c in codes.items() if not c}
    assert RunResult(TrainerState.FAILED, values, failures).exit_status == status


def test_the_pods_deadline_is_its_last_workers() -> None:
    cfg = parse(["--exit-timeout", "3", "--", "true"], {})
    pod = PodAgent()
    workers = [pod.add(WorkerSpec(cfg, {}, local_rank=i)) for i in range(3)]
    workers[0].exit_deadline, workers[1].exit_deadline = 50.0, 70.0  # worker 2: broke early
    assert exit_deadline(cfg, pod) == 70.0
    assert exit_deadline(cfg, PodAgent()) > 3.0  # none set: --exit-timeout from now


def test_the_line_names_each_stuck_task_and_where() -> None:
    line = stuck_line([Stuck("watch", ("ftagent/watch/loop.py:230 in WatchLoop.run",)),
                       Stuck("Task-8 (WatchLoop._guard)", ("a.py:1 in f", "b.py:2 in g")),
                       Stuck("loop.shutdown_asyncgens")], 42, 10.0)
    assert "\n" not in line
    assert line.startswith("the agent's cleanup did not end within --exit-timeout 10s")
    assert "exiting with status 42 all the same" in line
    assert "'watch' at ftagent/watch/loop.py:230 in WatchLoop.run" in line
    assert "'Task-8 (WatchLoop._guard)' at a.py:1 in f -> b.py:2 in g" in line
    assert "'loop.shutdown_asyncgens' at (no frame)" in line
    assert "stop signal" not in line
    signalled = stuck_line([Stuck("watch")], 143, 10.0, signalled=True)
    assert "of the trainer's exit (after a stop signal: by --stop-timeout's end at the " \
        "latest): exiting with status 143" in signalled


def test_the_line_is_bounded() -> None:
    many = [Stuck(f"t{i}", ("x.py:1 in f",)) for i in range(MAX_NAMED + 5)]
    line = stuck_line(many, 0, 2.0)
    assert f"'t{MAX_NAMED - 1}'" in line and f"'t{MAX_NAMED}'" not in line
    assert line.endswith("and 5 more")


def test_a_stuck_task_is_named_where_it_is_suspended() -> None:
    async def inner(ev: asyncio.Event) -> None:
        await ev.wait()

    async def outer(ev: asyncio.Event) -> None:
        await inner(ev)

    async def main() -> tuple[Stuck, Stuck]:
        ev = asyncio.Event()
        named = asyncio.create_task(outer(ev), name="ticker")
        unnamed = asyncio.create_task(inner(ev))
        for _ in range(3):
            await asyncio.sleep(0)  # a loop step: both reach their wait
        got = stuck_task(named), stuck_task(unnamed)
        ev.set()
        await asyncio.gather(named, unnamed)
        return got

    named, unnamed = asyncio.run(main())
    assert named.name == "ticker"
    here = "tests/unit/test_shutdown.py"
    assert named.where[0].startswith(here) and named.where[0].endswith("in " + (
        "test_a_stuck_task_is_named_where_it_is_suspended.<locals>.outer"))
    assert named.where[1].endswith("<locals>.inner")
    assert named.where[-1].endswith("in Event.wait")  # asyncio's own, innermost
    assert unnamed.name.startswith("Task-") and unnamed.name.endswith("<locals>.inner)")


def test_a_stuck_thread_is_named_at_its_innermost_frames() -> None:
    release = threading.Event()
    parked = threading.Event()

    def blocked() -> None:
        parked.set()
        release.wait()

    t = threading.Thread(target=blocked, name="nvml-poll")
    t.start()
    try:
        assert parked.wait(10)
        assert t in shutdown.blocking_threads()

        def waiting() -> Stuck | None:
            s = stuck_thread(t)
            return s if any(w.endswith("in Event.wait") for w in s.where) else None

        got = wait_for(waiting, what="the thread in its wait")
    finally:
        release.set()
        t.join(10)
    assert got.name == "nvml-poll"
    assert len(got.where) <= shutdown.MAX_FRAMES
    assert got.where[-1].endswith("in Condition.wait")  # the innermost, then Event.wait


def test_the_flag_and_its_variable() -> None:
    from ftagent.config import ConfigError

    assert parse(["--", "true"], {}).supervisor.exit_timeout == 10.0
    assert parse(["--", "true"], {"FTAGENT_EXIT_TIMEOUT": "4"}).supervisor.exit_timeout == 4.0
    with pytest.raises(ConfigError, match="--exit-timeout: '0.5' must be in"):
        parse(["--exit-timeout", "0.5", "--", "true"], {})  # a normal cleanup needs a moment


def test_settle_leaves_a_task_that_does_not_end_and_takes_the_others_exceptions() -> None:
    async def main() -> tuple[list[str], bool]:
        async def stubborn() -> None:
            while True:
                with contextlib.suppress(asyncio.CancelledError):  # the bug: swallowed
                    await asyncio.Event().wait()

        async def broken() -> None:
            raise RuntimeError("a source's bug")

        tasks = [asyncio.create_task(stubborn(), name="stubborn"),
                 asyncio.create_task(broken(), name="broken"),
                 asyncio.create_task(asyncio.Event().wait(), name="polite")]
        await asyncio.sleep(0)  # a loop step: each reaches its wait (broken: raised)
        for t in tasks:
            t.cancel()
        left = await shutdown.settle(tasks, deadline=0.0)  # past: one look, no wait
        left += await shutdown.settle(left, deadline=0.0)
        polite = tasks[2].cancelled()
        ok, got = await shutdown.within(asyncio.sleep(0, "said"), 0.0, "goodbye")
        assert (ok, got) == (True, "said")
        with pytest.raises(RuntimeError):
            await shutdown.within(broken(), 0.0, "close")
        tasks[0].get_coro().close()  # (its frame ends here: the loop can close)
        return [t.get_name() for t in left], polite

    left, polite = asyncio.run(main())
    assert "stubborn" in left and "broken" not in left
    assert polite
