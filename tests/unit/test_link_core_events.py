"""The link's core takes the trainer's events whole and posts what they say (issue 36,
lane crash7): the worker and the decider call ``LinkProtocol`` once per event, its shell
(reporter.py) only writes the outbox. Pure: no stream, no loop; ``is_up`` and ``wake``
are the shell's, injected."""

from __future__ import annotations

from ftagent.agent.lifecycle import Lifecycle
from ftagent.agent.link_protocol import LinkProtocol
from ftagent.config import IdentityConfig
from ftagent.model import Fault, FaultKind, ProcessExit, Progress, TrainerState
from ftagent.v1 import ftagent_pb2 as pb


def core(up: list[bool], woken: list[int]) -> LinkProtocol:
    return LinkProtocol(IdentityConfig(job="j", rank=1, world_size=2),
                        lifecycle=Lifecycle(rank=1), is_up=lambda: up[0],
                        wake=lambda: woken.append(1), clock=lambda: 100.0)


def kinds(msgs: object) -> list[str]:
    return [m.WhichOneof("body") for m in msgs]  # type: ignore[attr-defined]


def test_an_exit_says_the_snapshots_and_last_progress_first_and_wakes_the_writer() -> None:
    up, woken = [True], []
    c = core(up, woken)
    c.observe(Progress(step=7, loss=1.0))  # not the core's: the shell's (observes)
    assert not c.out
    c.progress_summary = c.progress(Progress(step=7, loss=1.0), 0.0, False, 1.0)
    c.progress_new = True
    c.snapshots, c.snapshots_due = (5,), True
    c.lifecycle.running(3)
    c.lifecycle.exited(ProcessExit(pid=3, code=3, signal=None))  # the worker's, first
    c.observe(ProcessExit(pid=3, code=3, signal=None))
    assert kinds(c.out) == ["snapshots", "progress", "exit"]
    assert woken and not c.progress_new and c.last_exit is c.out[-1]


def test_offline_what_must_not_be_lost_is_kept_for_the_next_stream() -> None:
    up, woken = [False], []
    c = core(up, woken)
    c.report_fault(Fault(FaultKind.CRASH, "exited 3", evidence={"exit_status": 3}))
    c.report_exit(ProcessExit(pid=3, code=3, signal=None), 0)
    c.report_arrival(1)
    assert not c.out and not woken
    assert kinds(c.later) == ["exit"]  # the fault and the arrival are kept by the core
    assert list(c.faults) and c.arrival is not None and c.arrival.generation == 1
    assert kinds(c.on_welcome(pb.Welcome(arbiter_id="a"))) == ["fault", "arrival", "exit"]


def test_a_start_is_told_once_with_the_barrier_said_by_the_decider() -> None:
    up, woken = [True], []
    c = core(up, woken)
    c.lifecycle.running(2)
    c.lifecycle.exited(ProcessExit(pid=2, code=1))  # a trainer ended before this one
    assert c.lifecycle.trainer_ended
    c.released_start = False  # failing open: the arrival is dropped, the Hello says why
    c.report_arrival(0)
    c.on_state(TrainerState.WAITING, 0)  # not a step the core acts on
    assert c.starts == 0 and c.arrival is not None
    c.lifecycle.running(3)  # the worker moves its lifecycle, then tells its observers
    c.on_state(TrainerState.RUNNING, 0)
    assert c.starts == 1 and c.first_step_due and not c.lifecycle.trainer_ended
    assert c.arrival is None  # started without the barrier
    assert c.hello().trainer_running  # read from the lifecycle
