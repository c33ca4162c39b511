"""The pod's one decider: the local group's decisions and barrier, and the arbiter
decider failing open into that group (the node's workers restart together, with or
without an arbiter). No trainer runs: the deciders' own logic on a real event loop."""

from __future__ import annotations

import asyncio
import time

from ftagent.agent.arbiter_decider import ArbiterDecider
from ftagent.agent.decider import Decider, LocalDecider
from ftagent.agent.pod import PodAgent
from ftagent.agent.worker import Worker, WorkerSpec, wait_at_barrier
from ftagent.cmd.run import parse
from ftagent.model import Action, ActionKind, Fault, FaultKind
from tests.conftest import until


def node(n: int, *flags: str, arbiter: bool = False) -> tuple[Decider, list[Worker]]:
    """``n`` workers of one pod sharing its one decider, as cmd/run.py wires them."""
    pod = PodAgent(ArbiterDecider() if arbiter else LocalDecider())
    for _ in range(n):
        pod.add(WorkerSpec(parse([*flags, "--", "true"], {})))
    assert all(w.decider is pod.decider for w in pod.workers)
    return pod.decider, pod.workers


def queued(w: Worker) -> list[Action]:
    """What the deciders wanted of ``w`` (its lifecycle's desired state: the requests and
    the newest decision), taken in, as the worker's comparison would find them."""
    life = w.lifecycle
    out = [*life.requests, *([life.desired] if life.desired is not None else [])]
    for a in out:
        life.dismiss(a)
    return out


def crash(code: int = 3) -> Fault:
    return Fault(FaultKind.CRASH, f"exit {code}", evidence={"exit_status": code})


def test_no_agent_subclass_the_decider_is_a_part() -> None:
    w = Worker(WorkerSpec(parse(["--", "true"], {})))
    assert isinstance(w.decider, LocalDecider) and w.decider.workers == [w]
    assert Worker.__subclasses__() == []


def test_one_arbiter_decider_holds_a_session_per_rank_and_the_pods_local_policy() -> None:
    """One decider per pod (issue 23): under an arbiter the pod's workers share one
    ArbiterDecider, which keeps one link per rank inside it and fails open to one
    LocalDecider, the same for every rank. On the old code each worker held its own
    ArbiterDecider, with its own LocalDecider."""
    d, ws = node(3, "--arbiter", "127.0.0.1:9", arbiter=True)
    assert isinstance(d, ArbiterDecider)
    assert list(d.sessions) == ws
    assert len({id(d.session(w).link) for w in ws}) == 3
    assert d.local.workers == ws


def test_first_failure_of_a_generation_is_the_groups_and_a_second_one_is_answered() -> None:
    d, ws = node(3, "--max-restarts", "2", "--restart-backoff", "0")
    d.decide(ws[2], crash())
    d.decide(ws[0], crash())  # its own crash, caused by the first: already decided
    got = [queued(w) for w in ws]
    # one decision, the group's, for every worker; worker 0 was given it twice (its
    # crash's answer too): its desired state holds it once (no queue to de-duplicate)
    assert [len(a) for a in got] == [1, 1, 1], got
    assert all(a.kind == ActionKind.RESTART and a.generation == 1 for q in got for a in q)
    assert len({a.id for q in got for a in q}) == 1


def test_fail_open_decision_with_local_workers_goes_to_every_worker() -> None:
    """The arbiter unreachable past --arbiter-fail-open-after: a crash of one worker is
    decided by the node's group, not by that worker alone."""
    flags = ("--arbiter", "127.0.0.1:9", "--arbiter-fail-open-after", "0",
             "--max-restarts", "1", "--restart-backoff", "0")
    d, ws = node(4, *flags, arbiter=True)
    assert isinstance(d, ArbiterDecider)
    for w in ws:
        d.session(w).link.offline_since = 0.0  # down since long ago (time.monotonic's origin)
    d.decide(ws[2], crash())
    got = [queued(w) for w in ws]
    assert [[a.kind for a in q] for q in got] == [[ActionKind.RESTART]] * 4
    assert len({q[0].id for q in got}) == 1
    assert d.session(ws[2]).link.pending()  # and the fault waits for the arbiter


def test_group_barrier_counts_a_worker_told_a_higher_generation() -> None:
    async def body() -> None:
        d, ws = node(3)
        assert isinstance(d, LocalDecider)
        for w in ws:
            w.lifecycle.reached(1)
        waiting = asyncio.create_task(wait_at_barrier(d, ws[0]))
        await asyncio.sleep(0)
        assert not waiting.done()
        ws[1].lifecycle.reached(3)  # the arbiter's RESTART: its trainer of 1 is gone too
        d.arrive(ws[1])
        await asyncio.sleep(0)
        assert not waiting.done()  # worker 2 has not arrived
        await d.close(ws[2])  # its supervision ended: no longer counted
        assert await asyncio.wait_for(waiting, 5) is None

    asyncio.run(body())


def test_a_worker_that_dropped_the_groups_decision_gets_it_again_for_its_crash() -> None:
    """Worker 0's hang leads the group to RESTART; its trainer then exits by itself, which
    supersedes the hang's decision (the worker drops it). Its crash is answered by the
    decision that stands, delivered again to it alone; a worker that got it twice carries
    it out once. On the old code the crash got no answer: the worker (and its peers at
    the group's barrier) waited forever."""
    d, ws = node(2, "--max-restarts", "2", "--restart-backoff", "0")
    hang = Fault(FaultKind.HANG, "no progress")
    d.decide(ws[0], hang)
    (restart,) = queued(ws[0])  # dropped: superseded by the trainer's own exit
    assert restart.kind == ActionKind.RESTART and restart.fault_id == hang.id
    c = crash()
    d.decide(ws[0], c)
    (again,) = queued(ws[0])
    assert (again.id, again.kind, again.generation, again.fault_id) == \
        (restart.id, ActionKind.RESTART, 1, c.id)
    d.decide(ws[1], crash())  # worker 1's own crash: it holds the decision already
    (first,) = queued(ws[1])  # given twice, desired once (the newest: its crash's)
    assert first.id == restart.id and first.fault_id != restart.fault_id
    ws[1].lifecycle.restart(first)
    assert ws[1].lifecycle.carried_out(restart.id) and ws[1].restarts == 1
    ws[1].lifecycle.want(restart)  # and wanted once more: moot, nothing due
    assert ws[1].lifecycle.due() is None


def test_the_fail_open_clock_starts_when_the_decider_starts_not_when_it_is_built() -> None:
    """The launcher builds all its workers before any link runs; under load that took
    longer than --arbiter-fail-open-after, and local rank 0 (built first) failed open at
    its first start while its peers waited at the job's barrier. The worker's first
    barrier comes right after ``decider.start()``, before the link's task has run at all:
    the clock must be reset there. On the old code the link counts as offline since it
    was built (100 s here)."""
    async def body() -> None:
        decider, ws = node(1, "--arbiter", "127.0.0.1:9", arbiter=True)
        assert isinstance(decider, ArbiterDecider)
        link = decider.session(ws[0]).link
        assert link.offline_since is not None
        link.offline_since -= 100.0  # built long before it runs
        decider.start(ws[0])
        try:
            assert link.offline_for() < 50.0  # no yield: as the worker's first barrier
        finally:
            await decider.close(ws[0])

    asyncio.run(body())


def test_a_restart_decided_alone_is_counted_once_in_the_hello() -> None:
    """One restart count (issue 23), failing open: the hang's local decision, then the
    crash's (the trainer exited by itself: the decision stands and is delivered again),
    are one restart; the Hello says 1, as the lifecycle does. On the old code the link
    counted each local decision (restarted_locally) beside the lifecycle: 2."""
    d, (w,) = node(1, "--arbiter", "127.0.0.1:9", "--arbiter-fail-open-after", "0",
                   "--max-restarts", "3", "--restart-backoff", "0", arbiter=True)
    assert isinstance(d, ArbiterDecider)
    link = d.session(w).link
    link.offline_since = 0.0  # down since long ago: every decision is the local policy's
    d.decide(w, Fault(FaultKind.HANG, "no progress"))
    first = w.lifecycle.desired
    d.decide(w, crash())
    (again,) = queued(w)  # the newest wanted: the same decision, for the crash
    assert first is not None and first.id == again.id and first.kind == ActionKind.RESTART
    w.lifecycle.restart(again)
    assert w.lifecycle.moot(first)  # delivered twice: carried out once
    assert link.proto.hello().restart_count == w.restarts == 1


def test_the_decision_watchdog_wakes_on_the_arbiters_answer_and_fails_open_on_time() -> None:
    """The watchdog waits on events, not a 0.25 s poll (issue 36): the arbiter settling a
    crash without a command for this rank wakes it at once (the local policy restarts the
    dead trainer); a link that went down makes it decide alone --arbiter-fail-open-after
    after the drop, not later."""
    from ftagent.v1 import ftagent_pb2 as pb

    async def body() -> None:
        d, (w,) = node(1, "--arbiter", "127.0.0.1:9", "--arbiter-fail-open-after", "30",
                       "--max-restarts", "3", "--restart-backoff", "0", arbiter=True)
        assert isinstance(d, ArbiterDecider)
        link = d.session(w).link
        link.connected = True  # as if welcomed (no arbiter runs: the stream is not needed)
        link._up.set()  # the core posts while a stream is up
        c = crash()
        d.decide(w, c)
        await asyncio.sleep(0)  # the watchdog waits for the fault to be settled
        assert queued(w) == []
        link.proto.on_message(pb.ArbiterMessage(fault_ack=pb.FaultAck(
            fault_id=c.id, final=True, outcome="alert only")))
        link._settled.set()  # what the link's reader does with a settled fault
        t0 = time.monotonic()
        await until_queued(w, 5.0)
        assert time.monotonic() - t0 < 5.0
        # the link goes down with a new crash undecided: alone after the fail-open time
        d.fail_open_after = 0.6
        c2 = crash()
        w.lifecycle.restart(Action(ActionKind.RESTART, "carried out", generation=1))
        d.decide(w, c2)
        link.connected = False
        link.offline_since = time.monotonic()
        t0 = time.monotonic()
        (got,) = await until_queued(w, 10.0)
        assert got.kind is ActionKind.RESTART and got.fault_id == c2.id
        assert 0.5 <= time.monotonic() - t0 < 5.0  # after the fail-open time, not polls

    asyncio.run(body())


async def until_queued(w: Worker, timeout: float) -> list[Action]:
    """What the decider delivered to ``w``, once it delivered something."""
    await until(lambda: w.lifecycle.due() is not None, timeout, "a decision delivered")
    return queued(w)
