"""The agent's decider: the local group's decisions and barrier, and the arbiter decider
failing open into that group (the node's workers restart together, with or without an
arbiter). No trainer runs: the deciders' own logic on a real event loop."""

from __future__ import annotations

import asyncio

from ftagent.agent.arbiter_decider import ArbiterDecider
from ftagent.agent.decider import LocalDecider, WorkerGroup
from ftagent.agent.pod import PodAgent
from ftagent.agent.worker import Worker, WorkerSpec
from ftagent.cmd.run import parse
from ftagent.model import Action, ActionKind, Fault, FaultKind


def node(n: int, *flags: str, arbiter: bool = False) -> tuple[WorkerGroup, list[Worker]]:
    """``n`` workers of one node sharing a group, as cmd/run.py build_workers wires them."""
    pod = PodAgent()
    for _ in range(n):
        pod.add(WorkerSpec(parse([*flags, "--", "true"], {})),
                arbiter=ArbiterDecider if arbiter else None)
    return pod.group, pod.workers


def queued(w: Worker) -> list[Action]:
    out = []
    while not w.actions.empty():
        out.append(w.actions.get_nowait())
    return out


def crash(code: int = 3) -> Fault:
    return Fault(FaultKind.CRASH, f"exit {code}", evidence={"exit_status": code})


def test_no_agent_subclass_the_decider_is_a_part() -> None:
    w = Worker(WorkerSpec(parse(["--", "true"], {})))
    assert isinstance(w.decider, LocalDecider) and w.decider.group is None
    assert Worker.__subclasses__() == []


def test_first_failure_of_a_generation_is_the_groups_and_a_second_one_is_answered() -> None:
    _, ws = node(3, "--max-restarts", "2", "--restart-backoff", "0")
    ws[2].decider.decide(crash())
    ws[0].decider.decide(crash())  # its own crash, caused by the first: already decided
    got = [queued(w) for w in ws]
    assert all(len(a) == 1 and a[0].kind == ActionKind.RESTART for a in got), got
    assert len({a[0].id for a in got}) == 1 and got[0][0].generation == 1


def test_fail_open_decision_with_local_workers_goes_to_every_worker() -> None:
    """The arbiter unreachable past --arbiter-fail-open-after: a crash of one worker is
    decided by the node's group, not by that worker alone."""
    flags = ("--arbiter", "127.0.0.1:9", "--arbiter-fail-open-after", "0",
             "--max-restarts", "1", "--restart-backoff", "0")
    _, ws = node(4, *flags, arbiter=True)
    for w in ws:
        assert isinstance(w.decider, ArbiterDecider)
        w.decider.link.offline_since = 0.0  # down since long ago (time.monotonic's origin)
    ws[2].decider.decide(crash())
    got = [queued(w) for w in ws]
    assert [[a.kind for a in q] for q in got] == [[ActionKind.RESTART]] * 4
    assert len({q[0].id for q in got}) == 1
    assert ws[2].decider.link.pending()  # and the fault waits for the arbiter


def test_group_barrier_counts_a_worker_told_a_higher_generation() -> None:
    async def body() -> None:
        _, ws = node(3)
        for w in ws:
            w.lifecycle.reached(1)
        waiting = asyncio.create_task(ws[0].decider.before_start())
        await asyncio.sleep(0)
        assert not waiting.done()
        ws[1].lifecycle.reached(3)  # the arbiter's RESTART: its trainer of 1 is gone too
        assert isinstance(ws[1].decider, LocalDecider)
        ws[1].decider.arrived()
        await asyncio.sleep(0)
        assert not waiting.done()  # worker 2 has not arrived
        await ws[2].decider.close()  # its supervision ended: no longer counted
        assert await asyncio.wait_for(waiting, 5) is None

    asyncio.run(body())
