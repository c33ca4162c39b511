"""Warm spares: the policy ASSIGNs one on REPLACE, state.apply makes it the rank's owner and,
once it arrives, the rank; the agent's protocol takes the rank it is given."""

from __future__ import annotations

from ftagent.agent.link_protocol import LinkProtocol
from ftagent.arbiter import convert, policy
from ftagent.arbiter.policy import PolicyConfig, decide_fault, decide_tick
from ftagent.arbiter.state import (
    Decision,
    JobPhase,
    JobState,
    Promoted,
    RankState,
    SpareJoined,
    SpareLeft,
    Verdict,
    apply,
)
from ftagent.config import IdentityConfig
from ftagent.model import Fault, FaultKind, Scope, Severity
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.limits import MAX_SPARES

CFG = PolicyConfig(max_restarts=3)
NOW = 1_000_000.0


def job(world: int = 2, spares: tuple[tuple[str, str], ...] = (("s1", "node-9"),),
        restarts: int = 0) -> JobState:
    j = JobState(job="j", world_size=world, phase=JobPhase.RUNNING, restarts=restarts)
    for r in range(world):
        j.ranks[r] = RankState(rank=r, pod=f"pod-{r}", pod_uid=f"uid-{r}", node=f"node-{r}",
                               connected=True, conn=object())
    for instance, node in spares:
        apply(j, SpareJoined(instance, f"spare-{instance}", node, f"uid-{instance}",
                             object()), NOW)
    return j


def xid(rank: int = 1) -> policy.FaultReport:
    return policy.FaultReport(Fault(FaultKind.GPU, "Xid 79", severity=Severity.FATAL),
                              rank, 0)


def decide(j: JobState, rep: policy.FaultReport) -> list[Decision]:
    ds = decide_fault(j, rep, NOW, CFG)
    for d in ds:
        apply(j, d, NOW)
    return ds


def test_replace_assigns_the_spare_and_records_its_pod_as_the_owner() -> None:
    j = job()
    ds = decide(j, xid(1))
    assert [d.verdict for d in ds] == [Verdict.REPLACE, Verdict.ASSIGN]
    a = ds[1]
    assert (a.rank, a.generation, a.spare) == (1, 1, "s1")
    assert j.restarts == 1  # the ASSIGN spends nothing beyond the REPLACE
    assert j.spares["s1"].assigned == 1 and j.owners[1] == ("spare-s1", "uid-s1")
    cmd = convert.command_for(a, "c", restarts=j.restarts).command
    assert cmd.kind == pb.COMMAND_KIND_ASSIGN and cmd.target_rank == 1
    assert cmd.generation == 1 and cmd.restarts == 1
    # the replaced rank's own stream is still rank 1's until the spare arrives
    assert j.ranks[1].pod == "pod-1" and j.ranks[1].state == "replacing"


def test_no_spare_is_the_old_behaviour() -> None:
    j = job(spares=())
    ds = decide(j, xid(1))
    assert [d.verdict for d in ds] == [Verdict.REPLACE]


def test_a_spare_on_the_replaced_ranks_node_is_not_chosen() -> None:
    j = job(spares=(("same", "node-1"), ("other", "node-5")))
    ds = decide(j, xid(1))
    assert ds[-1].verdict is Verdict.ASSIGN and ds[-1].spare == "other"
    j = job(spares=(("same", "node-1"),))
    assert [d.verdict for d in decide(j, xid(1))] == [Verdict.REPLACE]


def test_an_assigned_or_gone_spare_is_not_chosen_twice() -> None:
    j = job(world=3, spares=(("s1", "node-9"), ("s2", "node-8")))
    assert decide(j, xid(1))[-1].spare == "s1"
    j.ranks[0].generation = j.generation
    second = decide(j, policy.FaultReport(Fault(FaultKind.NODE, "node lost"), 2, 1))
    assert second[-1].spare == "s2"
    j = job()
    apply(j, SpareLeft("s1"), NOW)
    assert [d.verdict for d in decide(j, xid(1))] == [Verdict.REPLACE]


def test_spares_per_job_are_bounded() -> None:
    j = job(spares=tuple((f"s{i}", "node-9") for i in range(MAX_SPARES + 5)))
    assert len(j.spares) == MAX_SPARES


def test_restart_and_stop_assign_nothing() -> None:
    j = job()
    ds = decide(j, policy.FaultReport(Fault(FaultKind.CRASH, "exit 1"), 1, 0))
    assert [d.verdict for d in ds] == [Verdict.RESTART]
    j = job(restarts=3)
    ds = decide(j, xid(1))
    assert [d.verdict for d in ds] == [Verdict.STOP] and j.spares["s1"].assigned is None


def test_node_scope_gpu_and_nic_replacement_assign_too() -> None:
    j = job()
    f = Fault(FaultKind.GPU, "NVLink", severity=Severity.ERROR, scope=Scope.NODE)
    assert decide(j, policy.FaultReport(f, 0, 0))[-1].verdict is Verdict.ASSIGN
    j = job()
    j.ranks[0].node = "node-9"  # the spare shares rank 0's node: fine for rank 1
    ds = decide(j, policy.FaultReport(Fault(FaultKind.NIC, "link down"), 1, 0))
    assert ds[0].verdict is Verdict.WAIT
    ds = decide_tick(j, NOW + CFG.nic_replace_after + 1, CFG)
    assert [d.verdict for d in ds] == [Verdict.REPLACE, Verdict.ASSIGN]


def test_the_spare_becomes_the_rank_once_promoted() -> None:
    j = job()
    decide(j, xid(1))
    conn = j.spares["s1"].conn
    apply(j, Promoted("s1", 1), NOW)
    rs = j.ranks[1]
    assert (rs.pod, rs.node, rs.conn, rs.from_spare) == ("spare-s1", "node-9", conn, True)
    assert rs.generation == 1 and rs.commanded == 1 and "s1" not in j.spares
    assert j.owners[1] == ("spare-s1", "uid-s1")
    # a spare that was not assigned this rank takes nothing
    j = job()
    apply(j, Promoted("s1", 1), NOW)
    assert j.ranks[1].pod == "pod-1" and "s1" in j.spares


def _proto(spare: bool = True) -> LinkProtocol:
    return LinkProtocol(IdentityConfig(job="j", rank=0, world_size=2, spare=spare))


def _command(kind: int, **kw: object) -> pb.ArbiterMessage:
    return pb.ArbiterMessage(command=pb.Command(id=str(kind), kind=kind, **kw))  # type: ignore[arg-type]


def test_a_spare_says_so_and_takes_the_rank_it_is_assigned() -> None:
    p = _proto()
    assert p.hello().spare
    got = p.on_message(_command(pb.COMMAND_KIND_ASSIGN, target_rank=1, generation=3,
                                restarts=2))
    assert got.assigned and p.assignment == (1, 3, 2)
    h = p.hello()
    assert (h.rank, h.spare) == (1, False)
    # a second ASSIGN, an ASSIGN to a rank agent or out of range: ignored
    assert not p.on_message(_command(pb.COMMAND_KIND_ASSIGN, target_rank=0)).assigned
    assert not _proto(False).on_message(_command(pb.COMMAND_KIND_ASSIGN, target_rank=1)
                                        ).assigned
    assert not _proto().on_message(_command(pb.COMMAND_KIND_ASSIGN, target_rank=2)).assigned


def test_an_agent_told_spare_becomes_one_unless_its_trainer_runs() -> None:
    p = _proto(False)
    assert p.on_message(_command(pb.COMMAND_KIND_SPARE)).assigned and p.hello().spare
    p = _proto(False)
    p.lifecycle.running(1)  # its trainer runs: the lifecycle says so (the worker moves it)
    p.started(0, released=True)
    assert not p.on_message(_command(pb.COMMAND_KIND_SPARE)).assigned
    assert not p.hello().spare


def test_spare_needs_an_arbiter_and_a_single_worker_pod(capsys: object) -> None:
    from ftagent.cmd import run

    assert run.main(["--spare", "--", "true"]) == 2
    assert run.main(["--spare", "--arbiter", "127.0.0.1:1", "--nproc-per-node", "2", "--",
                     "true"]) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "--spare is for single-worker pods under an arbiter" in err
    assert "not with no --arbiter" in err and "not with --nproc-per-node" in err


def test_a_spare_pod_is_checked_as_a_pod_of_the_job_but_claims_no_rank() -> None:
    from ftagent.arbiter.auth import PodFacts, Principal, identity_problem

    p = Principal("pod team/s", namespace="team", pod="s", pod_uid="u", pod_node="n9")
    facts = PodFacts(uid="u", job="alpha", node="n9", rank=2, world_size=3)
    assert identity_problem(p, "team", "s", "n9", "alpha", 0, 2, facts, spare=True) == \
        ("", False)
    assert "rank mismatch" in identity_problem(p, "team", "s", "n9", "alpha", 0, 3, facts)[0]
    assert "job mismatch" in identity_problem(p, "team", "s", "n9", "beta", 0, 2, facts,
                                              spare=True)[0]


def test_the_registry_bounds_spares_and_refuses_what_cannot_serve() -> None:
    import asyncio

    import grpc
    import pytest

    from ftagent.arbiter.connection import Connection
    from ftagent.arbiter.registry import Registry
    from ftagent.arbiter.timeline import Timeline
    from ftagent.wire.checks import Refused

    def hello(rank: int, instance: str, **kw: object) -> pb.Hello:
        return pb.Hello(job="j", rank=rank, world_size=2, pod=f"p-{instance}",
                        node=f"n-{instance}", agent_instance=instance, **kw)  # type: ignore[arg-type]

    async def main() -> None:
        reg = Registry(CFG, Timeline(), None, "arb")
        with pytest.raises(Refused) as e:  # no job yet: the spare retries
            reg.hello(Connection("s"), hello(0, "s0", spare=True))
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        for r in (0, 1):
            reg.hello(Connection(f"r{r}"), hello(r, f"r{r}"))
        for i in range(MAX_SPARES):
            reg.hello(Connection(f"s{i}"), hello(0, f"s{i}", spare=True))
        job = reg.jobs[("", "j")]
        assert len(job.spares) == MAX_SPARES and job.connected == 2
        with pytest.raises(Refused) as e:
            reg.hello(Connection("x"), hello(0, "extra", spare=True))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # a spare says nothing for a rank before it is assigned one
        spare = next(iter(job.spares.values())).conn
        assert isinstance(spare, Connection)
        reg.handle(spare, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
        assert job.ranks[0].conn is not spare
        reg.disconnect(spare)
        assert len(job.spares) == MAX_SPARES - 1

    asyncio.run(main())


def test_status_shows_the_spares() -> None:
    from ftagent.arbiter.status_view import format_job

    text = format_job(pb.JobInfo(job="j", world_size=2, spares=["s-pod on node-9"]))
    assert "spares: s-pod on node-9" in text
    assert "spares" not in format_job(pb.JobInfo(job="j", world_size=2))


def test_a_spares_own_fatal_fault_retires_it() -> None:
    from ftagent.model import EXIT_REPLACE

    j = job()
    sp = j.spares["s1"]
    warn = Fault(FaultKind.GPU, "throttled", severity=Severity.WARNING)
    assert [d.verdict for d in policy.decide_spare_fault(j, sp, warn)] == [Verdict.ALERT_ONLY]
    ds = policy.decide_spare_fault(j, sp, Fault(FaultKind.GPU, "Xid 79",
                                                severity=Severity.FATAL))
    assert [(d.verdict, d.spare) for d in ds] == [(Verdict.RETIRE_SPARE, "s1")]
    for d in ds:
        apply(j, d, NOW)
    assert j.generation == 0 and j.restarts == 0 and sp.assigned == -1
    assert policy.pick_spare(j, 1) is None
    assert [d.verdict for d in decide(j, xid(1))] == [Verdict.REPLACE]
    cmd = convert.command_for(ds[0], "c").command
    assert cmd.kind == pb.COMMAND_KIND_REPLACE and cmd.exit_code == EXIT_REPLACE


def test_the_owner_of_an_assigned_rank_is_the_arbiters_record() -> None:
    from ftagent.arbiter.registry import Registry
    from ftagent.arbiter.timeline import Timeline

    reg = Registry(CFG, Timeline(), None, "arb")
    j = reg.jobs[("", "j")] = job()
    assert reg.owner_of("", "j", 1) is None
    decide(j, xid(1))
    assert reg.owner_of("", "j", 1) == ("spare-s1", "uid-s1")
    assert reg.owner_of("", "other", 1) is None
