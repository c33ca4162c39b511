"""The worker's lifecycle (agent/lifecycle.py): the one owner of generation, restarts,
trainer state and who decided. Pure: events in, steps out, a clock passed in."""

from __future__ import annotations

from ftagent.agent.lifecycle import Lifecycle, exit_status_of
from ftagent.agent.local_policy import decide
from ftagent.model import (
    EXIT_REPLACE,
    Action,
    ActionKind,
    Fault,
    FaultKind,
    Origin,
    ProcessExit,
    TrainerState,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def restart(generation: int = 0, origin: Origin = Origin.ARBITER) -> Action:
    return Action(ActionKind.RESTART, "crash", generation=generation, origin=origin)


def test_one_attempt_walks_the_states_with_the_clocks_time() -> None:
    clock = Clock()
    lc = Lifecycle(clock)
    assert lc.state is TrainerState.INIT and lc.attempt == (0, 0)
    step = lc.waiting()
    assert (step.state, step.generation, step.restarts, step.at) == \
        (TrainerState.WAITING, 0, 0, 100.0)
    clock.t = 101.5
    step = lc.running(pid=42)
    assert step.state is TrainerState.RUNNING and step.fields == {"pid": 42, "attempt": 0}
    assert lc.since == 101.5 and lc.state is TrainerState.RUNNING
    assert lc.succeeded().fields == {"exit_status": 0}


def test_the_trainers_exit_is_kept_until_the_next_one_without_a_state_change() -> None:
    """Whether a trainer runs and how the last one exited: the metrics read them here."""
    lc = Lifecycle(Clock())
    assert not lc.trainer_running and lc.trainer_exit is None and not lc.trainer_ended
    lc.running(pid=7)
    assert lc.trainer_running and lc.trainer_pid == 7 and not lc.trainer_ended
    crash = ProcessExit(7, None, signal=9, ts=3.0)
    lc.exited(crash)
    # the attempt stays RUNNING until the exit's decision; its trainer does not
    assert lc.state is TrainerState.RUNNING and not lc.trainer_running
    assert lc.trainer_exit is crash and lc.trainer_exit.exit_status == 137
    lc.restart(restart(origin=Origin.LOCAL))
    assert lc.trainer_ended  # exited, none started since (its last lines go at once)
    lc.running(pid=8)
    assert lc.trainer_running and lc.trainer_exit is crash  # the last exit, until the next
    assert not lc.trainer_ended


def test_a_restart_is_counted_once_into_the_next_or_the_named_generation() -> None:
    lc = Lifecycle(Clock())
    lc.running(1)
    step = lc.restart(restart(origin=Origin.LOCAL))  # a local restart counts up
    assert (step.state, step.generation, step.restarts) == (TrainerState.RESTARTING, 1, 1)
    assert lc.decided_by is Origin.LOCAL
    lc.restart(restart(generation=5))  # the arbiter names the job's generation
    assert lc.attempt == (5, 2) and lc.decided_by is Origin.ARBITER
    lc.restart(restart(generation=3))  # a lower one never moves it down
    assert lc.attempt == (6, 3)


def test_the_barrier_moves_the_generation_up_only_and_counts_no_restart() -> None:
    lc = Lifecycle(Clock())
    lc.reached(4)
    lc.reached(2)
    assert lc.attempt == (4, 0)
    assert lc.next_generation(ActionKind.RESTART) == 5
    assert lc.next_generation(ActionKind.STOP) == 4


def test_who_decided_sets_the_exit_status() -> None:
    crashed = ProcessExit(pid=1, code=9)
    kw = {"exit_replace": EXIT_REPLACE, "exit_stop": 86}
    stop = Action(ActionKind.STOP, "budget", exit_code=9)
    assert exit_status_of(stop, crashed, **kw) == 86  # the arbiter's STOP
    local = decide(Fault(FaultKind.CRASH, "exit 9", evidence={"exit_status": 9}),
                   restarts_done=3, max_restarts=3, backoff_base=0, backoff_cap=0)
    assert local.kind is ActionKind.STOP and local.origin is Origin.LOCAL
    assert exit_status_of(local, crashed, **kw) == 9  # alone: the trainer's own status
    assert exit_status_of(stop, crashed, exit_replace=215, exit_stop=-1) == 9
    assert exit_status_of(Action(ActionKind.REPLACE, "gpu"), crashed, **kw) == EXIT_REPLACE
    assert exit_status_of(Action(ActionKind.STOP, "x"), None, exit_replace=1,
                          exit_stop=-1) == 1
    lc = Lifecycle(Clock())
    code, step = lc.failed(local, crashed, **kw)
    assert code == 9 and step.state is TrainerState.FAILED
    assert step.fields == {"reason": local.reason, "exit_status": 9}
    assert lc.decided_by is Origin.LOCAL


def test_the_agent_reads_its_facts_from_the_lifecycle_only() -> None:
    """The worker keeps no copy: generation and restarts are read-only views."""
    from ftagent.agent.worker import Worker, WorkerSpec
    from ftagent.cmd.run import parse

    a = Worker(WorkerSpec(parse(["--", "true"], {})))
    a.lifecycle.reached(3)
    a.lifecycle.restart(restart())
    assert (a.generation, a.restarts, a.state) == (4, 1, TrainerState.RESTARTING)
    try:
        a.generation = 7  # type: ignore[misc]
    except AttributeError:
        pass
    else:
        raise AssertionError("the worker's generation is writable outside the lifecycle")


def test_the_arbiters_count_is_adopted_and_a_rejoin_is_no_new_restart() -> None:
    """One restart count (issue 23): the lifecycle's is the job's as this worker knows
    it. A local restart counts one; an arbiter's RESTART carries the job's count (a
    rejoin into a generation the job restarted into already: no new one), adopted and
    never lowered. On the old code the lifecycle counted every RESTART carried out (2
    here) while the link kept the arbiter's count (1) beside it."""
    lc = Lifecycle(Clock())
    lc.restart(restart(origin=Origin.LOCAL))  # alone, the arbiter away: gen 1, 1 restart
    rejoin = Action(ActionKind.RESTART, "rejoin", generation=2, restarts=1)
    lc.restart(rejoin)
    assert lc.attempt == (2, 1)
    lc.restart(Action(ActionKind.RESTART, "old arbiter", generation=3, restarts=0))
    assert lc.attempt == (3, 1)  # never lowered
    lc.reached(6, restarts=4)  # named at the barrier: generation and count adopted
    assert lc.attempt == (6, 4)


def test_a_stale_or_repeated_arbiter_restart_is_moot() -> None:
    """The one RESTART dedup (the link keeps no count or generation of its own for it):
    a second rejoin into generation 1, delivered while the first was being carried out,
    is moot once the worker is there; a local decision is moot only by its id."""
    lc = Lifecycle(Clock())
    first = Action(ActionKind.RESTART, "rejoin", generation=1, restarts=1)
    second = Action(ActionKind.RESTART, "rejoin again", generation=1, restarts=1)
    assert not lc.moot(first) and not lc.moot(second)
    lc.restart(first)
    assert lc.moot(first) and lc.moot(second)
    assert not lc.moot(Action(ActionKind.RESTART, "next", generation=2))
    local = restart(generation=1, origin=Origin.LOCAL)
    assert not lc.moot(local)
    lc.restart(local)
    assert lc.moot(local)


def test_a_trainer_of_the_generation_runs_until_it_exits_or_the_arbiter_restarts_past_it(
) -> None:
    """``runs_generation`` (the link's Hello says it as ``trainer_running``) is derived
    from the facts kept here -- the trainer's pid and the desired decision -- not kept: an
    arbiter's RESTART into a later generation, delivered while the trainer is still being
    stopped, says "not running" at once; the local policy's restart or a stale rejoin
    do not."""
    lc = Lifecycle(Clock())
    assert not lc.runs_generation  # no trainer yet
    lc.running(pid=42)
    assert lc.runs_generation and not lc.restart_wanted
    lc.want(restart(generation=0))  # a stale rejoin (moot): the trainer stays
    assert lc.runs_generation
    lc.want(restart(origin=Origin.LOCAL))  # the local policy's: not the arbiter's word
    assert lc.runs_generation
    ahead = restart(generation=1)
    lc.want(ahead)
    assert lc.restart_wanted and lc.trainer_running and not lc.runs_generation
    lc.exited(ProcessExit(pid=42, code=None, signal=15))
    lc.restart(ahead)  # carried out: no longer wanted, the generation moved
    assert not lc.restart_wanted and not lc.runs_generation and lc.generation == 1
    lc.running(pid=43)
    assert lc.runs_generation
