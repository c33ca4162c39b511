"""agent/stall_window.py: the policy's view of a window of samples (pure)."""

from __future__ import annotations

from ftagent.agent.stall_window import window_of
from ftagent.detect.liveness import Frame, ProcessSample, Snapshot, ThreadSample, judge
from ftagent.detect.stall import Blocked, Budget, State, decide

OPEN = Frame("save", "train.py", 12)


def snap(ts: float, *, status: str = "sleeping", cpu: float = 1.0, io: int = 0,
         stacks: bool = True, tid: int = 11, state: str = "S",
         frame: Frame = OPEN) -> Snapshot:
    threads = (ThreadSample(tid, "MainThread", False, (frame,), cpu=cpu, state=state),) \
        if stacks else None
    return Snapshot(ts, (ProcessSample(10, ts, cpu, io, threads, status),))


def test_stopped_in_every_sample_is_frozen_without_stacks() -> None:
    snaps = [snap(t, status="stopped", stacks=False, state="T") for t in (0.0, 1.0, 2.0)]
    w = window_of(judge(snaps), snaps)
    assert w.stopped and decide(Budget(4.0, 3.0, rank=1), w).state is State.FROZEN


def test_stopped_in_one_sample_only_is_not_frozen() -> None:
    snaps = [snap(0.0), snap(1.0, status="stopped"), snap(2.0)]
    assert not window_of(judge(snaps), snaps).stopped


def test_counters_going_backwards_are_a_contradiction_not_a_verdict() -> None:
    snaps = [snap(0.0, cpu=5.0), snap(1.0, cpu=2.0), snap(2.0, cpu=2.0)]
    w = window_of(judge(snaps), snaps)
    assert w.errors and decide(Budget(4.0, 3.0), w).state is State.UNDECIDED


def test_stacks_that_say_running_while_proc_says_stopped_are_a_contradiction() -> None:
    lying = ThreadSample(11, "MainThread", True, (OPEN,), cpu=1.0, state="T")
    snaps = [Snapshot(t, (ProcessSample(10, t, 1.0, 0, (lying,), "stopped"),))
             for t in (0.0, 1.0)]
    w = window_of(judge(snaps), snaps)
    assert w.errors and decide(Budget(4.0, 3.0), w).state is State.UNDECIDED


def test_only_python_threads_blocked_on_io_count() -> None:
    snaps = [snap(t) for t in (0.0, 1.0, 2.0)]
    native = Blocked(10, 99, "epoll_pwait", "remote", "tcp 127.0.0.1:4000")  # gloo's loop
    mine = Blocked(10, 11, "recvfrom", "remote", "tcp 127.0.0.1:9000")
    assert window_of(judge(snaps), snaps, [native]).blocked == ()
    assert window_of(judge(snaps), snaps, [native, mine]).blocked == (mine,)


def test_a_still_open_with_nothing_moving_is_all_blocked_dead_still_shape() -> None:
    snaps = [snap(t * 20.0) for t in range(4)]
    w = window_of(judge(snaps), snaps)
    assert w.all_blocked and w.moved is False and w.cpu_seconds == 0.0 and w.io_bytes == 0
    assert not w.waits_on_peer and not w.timed_wait


def test_a_rendezvous_or_a_sleep_is_not_dead_still() -> None:
    for frame, attr in ((Frame("_create_c10d_store", "rendezvous.py", 3), "waits_on_peer"),
                        (Frame("sleep", "time.py", 1), "timed_wait")):
        snaps = [snap(t * 20.0, frame=frame) for t in range(4)]
        assert getattr(window_of(judge(snaps), snaps), attr), frame


def test_waiting_in_a_collective_is_judged_with_the_motion_and_read_by_the_window() -> None:
    """``judge`` says whether a hung verdict's still thread waits in a collective (a field
    of the verdict, ``in_collective`` of liveness.py); the window reads it, no question
    per verdict. Recorded samples: a victim in all_reduce, a deadlock on a lock."""
    from ftagent.detect.liveness import in_collective
    from tests.unit.test_verify_early import recorded

    for name, want in (("collective_victim", True), ("deadlock", False)):
        snaps = recorded(name)
        motion = judge(snaps)
        assert motion.state.value == "hung", name
        assert motion.in_collective is want is in_collective(motion), name
        assert window_of(motion, snaps).in_collective is want, name
    alive = judge(recorded("eval_busy"))
    assert alive.state.value == "alive" and alive.in_collective is False
