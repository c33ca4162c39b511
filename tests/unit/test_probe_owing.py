"""A job hang probe's answers cost O(1) each: who still owes stacks is kept, not scanned.

``state.apply`` keeps ``HangProbe.owing`` (the connected ranks that have not answered the
probe) from its first answer on; ``policy.decide_stacks`` reads its size. Before it, every
answer scanned every rank (``any(r.stack is None for r in connected)``): 16,384 answers
cost about 1.3e8 rank reads on the arbiter's one loop (bench/probe_scale.py). The checks
here count the ranks an answer reads (the old code fails them without any timing), and
compare the kept set with a recount, and the decisions with the policy's full scan,
through answers, departures, reconnections, a new agent process, a spare's promotion, an
arbiter restart and the deadline's ``force``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from ftagent.arbiter.policy import PolicyConfig, decide_stacks, decide_tick
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.state import (
    Decision,
    JobState,
    Left,
    Promoted,
    RankState,
    Registered,
    Revived,
    SpareJoined,
    StacksIn,
    Verdict,
    apply,
    owing,
)
from ftagent.arbiter.timeline import Timeline
from ftagent.v1 import ftagent_pb2 as pb

NOW = 1000.0
CFG = PolicyConfig(stacks_timeout=15.0)
WAITING = "wait (distributed_c10d.py:4000) < all_reduce (distributed_c10d.py:2800)"


class CountingRanks(dict[int, RankState]):
    """``JobState.ranks`` that counts the RankStates read out of it."""

    reads = 0

    def __getitem__(self, k: int) -> RankState:
        CountingRanks.reads += 1
        return super().__getitem__(k)

    def get(self, k: int, default: Any = None) -> Any:  # type: ignore[override]
        CountingRanks.reads += 1
        return super().get(k, default)

    def values(self) -> Iterator[RankState]:  # type: ignore[override]
        for v in super().values():
            CountingRanks.reads += 1
            yield v

    def items(self) -> Iterator[tuple[int, RankState]]:  # type: ignore[override]
        for kv in super().items():
            CountingRanks.reads += 1
            yield kv


def asked(conn: Connection) -> str:
    """The id of the last DUMP_STACKS queued on ``conn`` ("" none; its outbox drained):
    what the agent's answer carries (arbiter_decider: ``report_stacks(action.id, ...)``)."""
    got = ""
    while not conn.outbox.empty():
        item = conn.outbox.get_nowait()
        if isinstance(item, tuple):
            m = pb.ArbiterMessage.FromString(item[0])
            if m.WhichOneof("body") == "command" and \
                    m.command.kind == pb.COMMAND_KIND_DUMP_STACKS:
                got = m.command.id
    return got


def hello(rank: int, world: int, instance: str = "a") -> Registered:
    return Registered(rank=rank, pod=f"pod-{rank}", node="n", state="running",
                      instance=f"{instance}{rank}", pod_uid="", gpus=(), generation=0,
                      released_generation=0, running=True, restart_count=0,
                      world_size=world, alert_only=False, conn=object())


def dump(job: JobState, fault_id: str = "hang-1") -> Decision:
    return Decision(Verdict.DUMP_STACKS, "job hang", job.generation, rank=0,
                    fault_id=fault_id, until=NOW + CFG.stacks_timeout, pending=True)


def probed(world: int) -> JobState:
    job = JobState(job="j", world_size=world)
    for r in range(world):
        apply(job, hello(r, world), NOW)
    apply(job, dump(job), NOW)
    return job


def scanned(job: JobState, now: float, force: bool = False) -> list[Decision]:
    """What the policy decides by its full scan of the ranks (no kept set)."""
    probe = job.hang_probe
    kept = probe.owing if probe is not None else None
    if probe is not None:
        probe.owing = None
    try:
        return decide_stacks(job, now, CFG, force=force)
    finally:
        if probe is not None:
            probe.owing = kept


@pytest.mark.parametrize("world", [64, 1024])
def test_an_answer_reads_no_rank_while_others_still_owe_one(world: int) -> None:
    """The old policy read every rank on every answer (``world`` reads, O(n^2) a probe)."""
    job = probed(world)
    for r in range(world // 2):
        apply(job, StacksIn(r, WAITING, None), NOW)
    job.ranks = CountingRanks(job.ranks)
    CountingRanks.reads = 0
    for r in range(world // 2, world - 1):
        apply(job, StacksIn(r, WAITING, None), NOW)
        assert decide_stacks(job, NOW, CFG) == []
    per_answer = CountingRanks.reads / (world - 1 - world // 2)
    assert per_answer <= 3, f"{per_answer:.0f} rank reads per answer at {world} ranks"
    apply(job, StacksIn(world - 1, WAITING, None), NOW)
    (d,) = decide_stacks(job, NOW, CFG)  # the last answer decides (one pass, once)
    assert d.verdict is Verdict.RESTART and f"stacks from {world}/{world} ranks" in d.reason


def test_an_answer_through_the_registry_reads_a_bounded_number_of_ranks() -> None:
    """The message path end to end (``Registry.handle``: check, parse, apply, decide)."""
    world = 512
    reg = registry([NOW])
    conns = [Connection(f"p{r}") for r in range(world)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=world, agent_instance=f"a{r}"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    job = reg.jobs[("", "j")]
    reg.handle(conns[0], pb.AgentMessage(fault=pb.Fault(
        id="hang-1", kind=pb.FAULT_KIND_HANG, severity=pb.SEVERITY_ERROR,
        message="no progress", generation=0)), 0.0)
    assert job.hang_probe is not None
    answer = pb.AgentMessage(stacks=pb.Stacks(command_id=asked(conns[0]), json=json.dumps(
        {"processes": [{"stack": "Thread 1 (idle)\n    all_reduce (c10d.py:1)\n"}]})))
    reg.handle(conns[0], answer, 0.0)  # the first answer: who owes one (the one pass)
    job.ranks = CountingRanks(job.ranks)
    CountingRanks.reads = 0
    for c in conns[1:-1]:
        reg.handle(c, answer, 0.0)
    per_answer = CountingRanks.reads / (world - 2)
    assert per_answer <= 4, f"{per_answer:.0f} rank reads per answer at {world} ranks"
    reg.handle(conns[-1], answer, 0.0)
    assert job.hang_probe is None and job.generation == 1  # decided: RESTART


def test_the_owed_set_follows_departures_reconnections_and_new_agents() -> None:
    job = probed(4)
    assert job.hang_probe is not None and job.hang_probe.owing is None  # no answer yet
    apply(job, StacksIn(0, WAITING, None), NOW)
    probe = job.hang_probe
    assert probe.owing == {1, 2, 3}  # built at the first answer
    apply(job, Left(1), NOW)  # left without answering: it owes nothing now
    assert probe.owing == {2, 3}
    apply(job, StacksIn(2, WAITING, None), NOW)
    assert probe.owing == {3} and decide_stacks(job, NOW, CFG) == []
    apply(job, hello(1, 4), NOW)  # back mid-probe (its DUMP_STACKS is re-sent): owes again
    assert probe.owing == {1, 3}
    apply(job, Left(0), NOW)
    apply(job, hello(0, 4), NOW)  # answered, then reconnected: its answer still counts
    apply(job, hello(2, 4, instance="new"), NOW)  # a new agent process: the same
    assert probe.owing == {1, 3} and job.ranks[0].stack == job.ranks[2].stack == WAITING
    for r in (3, 1):
        assert decide_stacks(job, NOW, CFG) == []
        apply(job, StacksIn(r, WAITING, None), NOW)
    assert probe.owing == set()
    (d,) = decide_stacks(job, NOW, CFG)
    assert d == scanned(job, NOW)[0] and "stacks from 4/4 ranks" in d.reason
    apply(job, d, NOW)
    assert job.hang_probe is None


def test_a_promoted_spare_owes_an_answer_for_its_rank() -> None:
    job = probed(3)
    apply(job, StacksIn(0, WAITING, None), NOW)
    apply(job, SpareJoined("s1", "spare-pod", "n2", "", object(), "spare-pod"), NOW)
    apply(job, Decision(Verdict.ASSIGN, "spare takes rank 2", job.generation, rank=2,
                        spare="s1"), NOW)
    apply(job, StacksIn(2, WAITING, None), NOW)
    assert job.hang_probe is not None and job.hang_probe.owing == {1}
    apply(job, Promoted("s1", 2), NOW)  # a fresh RankState for the rank: no answer yet
    assert job.hang_probe.owing == {1, 2} == owing(job)


def test_the_deadline_decides_with_the_same_text_as_the_scan() -> None:
    job = probed(6)
    for r in (0, 2, 5):
        apply(job, StacksIn(r, WAITING, None), NOW)
    apply(job, Left(4), NOW)
    assert decide_tick(job, NOW + 14.9, CFG) == []
    (d,) = decide_tick(job, NOW + 15, CFG)
    assert d == scanned(job, NOW + 15, force=True)[0]
    assert "stacks from 3/6 ranks (none from rank 1, 3, 4)" in d.reason


def test_an_arbiter_restart_rebuilds_the_probe_from_the_reports() -> None:
    """Nothing of a probe outlives its arbiter (the job's record keeps owners, not
    stacks): after a restart the agents' Hellos and the reporter's open fault, re-sent,
    start a new probe, whose answers are counted from nothing."""
    clock = [NOW]

    def arbiter() -> tuple[Registry, list[Connection]]:
        reg = registry(clock)
        conns = [Connection(f"p{r}") for r in range(4)]
        for r, c in enumerate(conns):
            reg.hello(c, pb.Hello(job="j", rank=r, world_size=4, agent_instance=f"a{r}",
                                  generation=0, released_generation=0,
                                  trainer_running=True))
        return reg, conns

    fault = pb.AgentMessage(fault=pb.Fault(id="hang-1", kind=pb.FAULT_KIND_HANG,
                                           severity=pb.SEVERITY_ERROR, message="stalled",
                                           generation=0))
    def answer(cid: str) -> pb.AgentMessage:
        return pb.AgentMessage(stacks=pb.Stacks(command_id=cid, json="{}"))

    first, conns = arbiter()
    first.handle(conns[1], fault, 0.0)
    old = asked(conns[0])
    first.handle(conns[0], answer(old), 0.0)
    assert first.jobs[("", "j")].hang_probe.owing == {1, 2, 3}  # type: ignore[union-attr]
    second, conns = arbiter()  # the first one died; the agents reconnect to this one
    job = second.jobs[("", "j")]
    assert job.hang_probe is None and job.ranks[0].stack is None
    second.handle(conns[1], fault, 0.0)  # its decision was open: the agent sends it again
    cid = asked(conns[0])
    assert cid and cid != old
    second.handle(conns[0], answer(old), 0.0)  # kept by its agent across the reconnect
    assert job.ranks[0].stack is None  # the dead arbiter's probe's: unread
    for r in (3, 0, 2):
        second.handle(conns[r], answer(cid), 0.0)
        assert job.hang_probe is not None and job.hang_probe.owing == owing(job)
    assert job.hang_probe.owing == {1}
    second.handle(conns[1], answer(cid), 0.0)
    assert job.hang_probe is None and job.generation == 1


def test_a_second_answer_of_a_rank_is_unread_and_a_reconnected_rank_is_asked_again() -> None:
    clock = [NOW]
    reg = registry(clock)
    conns = [Connection(f"p{r}") for r in range(3)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=3, agent_instance=f"a{r}"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    job = reg.jobs[("", "j")]
    reg.handle(conns[0], pb.AgentMessage(fault=pb.Fault(
        id="hang-1", kind=pb.FAULT_KIND_HANG, severity=pb.SEVERITY_ERROR,
        message="no progress", generation=0)), 0.0)
    cid = asked(conns[0])
    first = pb.AgentMessage(stacks=pb.Stacks(command_id=cid, json=json.dumps(
        {"processes": [{"stack": "Thread 1 (idle)\n    all_reduce (c10d.py:1)\n"}]})))
    reg.handle(conns[0], first, 0.0)
    kept = job.ranks[0].stack
    reg.handle(conns[0], pb.AgentMessage(stacks=pb.Stacks(command_id=cid, json="{}")), 0.0)
    assert job.ranks[0].stack == kept  # unread: the first answer stands
    reg.disconnect(conns[1])  # gone without answering
    assert job.hang_probe is not None and job.hang_probe.owing == {2}
    again = Connection("p1-again")
    reg.hello(again, pb.Hello(job="j", rank=1, world_size=3, agent_instance="a1"))
    assert job.hang_probe.owing == {1, 2}
    assert asked(again) == cid  # asked again (the same command): it can answer
    for c in (again, conns[2]):
        reg.handle(c, first, 0.0)
    assert job.hang_probe is None and job.generation == 1


@pytest.mark.parametrize("seed", range(40))
def test_the_kept_set_matches_a_recount_and_decides_as_the_scan(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 8)
    job = JobState(job="j", world_size=world)
    for _ in range(120):
        r = rng.randrange(world)
        roll = rng.random()
        probe = job.hang_probe
        if roll < 0.25:
            change: Any = hello(r, world, instance=rng.choice("ab"))
        elif roll < 0.4:
            change = Left(r)
        elif roll < 0.7 and r in job.ranks:
            change = StacksIn(r, rng.choice((WAITING, "forward (m.py:1)")), None)
        elif roll < 0.8 and probe is None:
            change = dump(job, f"hang-{rng.random()}")
        elif roll < 0.85:
            change = Revived(job.generation + rng.randint(0, 1))
        elif roll < 0.9 and job.ranks:
            change = Decision(Verdict.RELEASE_BARRIER, "release", job.generation)
        else:
            change = None
        if change is not None:
            apply(job, change, NOW)
        probe = job.hang_probe
        if probe is not None and probe.owing is not None:
            assert probe.owing == owing(job)
        for force in (False, True):
            got = decide_stacks(job, NOW, CFG, force=force)
            assert got == scanned(job, NOW, force=force)
            if got and rng.random() < 0.5:
                apply(job, got[0], NOW)
                break


# ---------------------------------------------------------------- the probe's own command

HANG = pb.AgentMessage(fault=pb.Fault(id="hang-1", kind=pb.FAULT_KIND_HANG,
                                      severity=pb.SEVERITY_ERROR, message="stalled",
                                      generation=0))
WAIT_DOC = json.dumps({"processes": [{"stack": "Thread 1 (idle)\n    all_reduce (c10d.py:1)\n"}]})
OUT_DOC = json.dumps({"processes": [{"stack": "Thread 1 (idle)\n    hang_before (train.py:72)\n"}]})


def stacks(cid: str, doc: str = WAIT_DOC) -> pb.AgentMessage:
    """An agent's answer to the DUMP_STACKS whose id is ``cid`` (it echoes the id:
    arbiter_decider.on_minor_action, ``report_stacks(action.id, ...)``)."""
    return pb.AgentMessage(stacks=pb.Stacks(command_id=cid, json=doc))


def registry(clock: list[float], timeout: float = 60.0) -> Registry:
    return Registry(PolicyConfig(max_restarts=5, stacks_timeout=timeout), Timeline(), None,
                    "arb", clock=lambda: clock[0])


def running(reg: Registry, rank: int, world: int, instance: str = "a") -> Connection:
    """Rank ``rank``'s agent says Hello with its trainer of generation 0 running (as to
    an arbiter that restarted: the job is rebuilt from the Hellos)."""
    conn = Connection(f"p{rank}-{instance}")
    reg.hello(conn, pb.Hello(job="j", rank=rank, world_size=world,
                             agent_instance=f"{instance}{rank}", generation=0,
                             released_generation=0, trainer_running=True))
    return conn


def test_a_rank_first_heard_of_during_a_probe_is_sent_its_dump_stacks() -> None:
    """An arbiter restarted mid-probe: ranks 0 and 1 are back when rank 1's agent sends
    its open hang fault again (a new probe, DUMP_STACKS to both); ranks 2 and 3 come back
    after. They owe the probe an answer, and before they were never asked: the probe
    waited its whole --stacks-timeout (60 s here) to decide the job hang. Now each is
    sent the probe's own DUMP_STACKS at its Hello, and the last answer decides at once,
    on every rank's stacks."""
    clock = [NOW]
    reg = registry(clock)
    conns = {r: running(reg, r, 4) for r in (0, 1)}
    reg.handle(conns[1], HANG, 0.0)
    job = reg.jobs[("", "j")]
    cid = asked(conns[0])
    assert cid and asked(conns[1]) == cid
    reg.handle(conns[0], stacks(cid), 0.0)
    for r in (2, 3):  # a late agent (or one slower to reconnect): first heard of now
        conns[r] = running(reg, r, 4)
        assert asked(conns[r]) == cid  # the probe's command: its answer counts
    assert job.hang_probe is not None and job.hang_probe.owing == {1, 2, 3}
    for r, doc in ((1, WAIT_DOC), (2, OUT_DOC), (3, WAIT_DOC)):
        reg.handle(conns[r], stacks(cid, doc), 0.0)
    assert job.hang_probe is None and job.generation == 1  # decided, no time passed
    (d,) = [e for e in reg.timeline.entries("j", "") if e.action == "restart"]
    assert "stacks from 4/4 ranks" in d.message and [c.rank for c in d.culprits] == [2]


def test_a_rank_whose_new_agent_never_answered_is_asked_again() -> None:
    """Its agent acknowledged the DUMP_STACKS (the rank's slot is emptied: nothing to
    re-send), then died before answering; the pod's new agent process says Hello during
    the probe. Before it was never asked again (the probe waited for its deadline)."""
    clock = [NOW]
    reg = registry(clock)
    conns = [running(reg, r, 3) for r in range(3)]
    reg.handle(conns[0], HANG, 0.0)
    cid = asked(conns[2])
    reg.handle(conns[2], pb.AgentMessage(ack=pb.Ack(command_id=cid)), 0.0)
    reg.disconnect(conns[2])
    again = running(reg, 2, 3, instance="new")
    assert asked(again) == cid
    for c in (conns[0], conns[1], again):
        reg.handle(c, stacks(cid), 0.0)
    assert reg.jobs[("", "j")].generation == 1


def test_an_answer_to_an_earlier_probe_does_not_count_for_the_next() -> None:
    """Rank 2 is slow to answer probe A (SIGSTOPped, its node loaded): A is decided at
    its deadline (a RESTART), the job runs generation 1, and rank 1 reports a hang:
    probe B. Rank 2's answer to A arrives now. Before, it was taken as its answer to B
    (no answer was matched to its DUMP_STACKS), and B decided on stacks of the previous
    generation as soon as ranks 0 and 1 answered. Now it is unread, as an unsolicited
    answer: B waits for rank 2's answer to B."""
    clock = [NOW]
    reg = registry(clock, timeout=15.0)
    conns = [Connection(f"p{r}") for r in range(3)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=3, agent_instance=f"a{r}"))
    for g in (0, 1):
        for c in conns:
            reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=g)), 0.0)
        if g == 0:
            reg.handle(conns[0], HANG, 0.0)
            first = asked(conns[0])
            for c in conns[:2]:
                reg.handle(c, stacks(first), 0.0)
            clock[0] += 16.0
            reg.tick()  # A's deadline: decided without rank 2's stacks
    job = reg.jobs[("", "j")]
    assert job.generation == 1 and job.barrier is not None and job.barrier.released
    reg.handle(conns[1], pb.AgentMessage(fault=pb.Fault(
        id="hang-2", kind=pb.FAULT_KIND_HANG, severity=pb.SEVERITY_ERROR,
        message="stalled", generation=1)), 0.0)
    probe = job.hang_probe
    second = asked(conns[2])
    assert probe is not None and second and second != first
    assert asked(conns[0]) == asked(conns[1]) == second  # every rank: the same command
    reg.handle(conns[2], stacks(first, OUT_DOC), 0.0)  # late: probe A's answer
    assert job.ranks[2].stack is None
    for c in conns[:2]:
        reg.handle(c, stacks(second), 0.0)
    assert job.hang_probe is probe and probe.owing == {2}  # rank 2 still owes B
    reg.handle(conns[2], stacks(second), 0.0)
    assert job.hang_probe is None and job.generation == 2
