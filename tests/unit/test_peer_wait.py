"""Waiting is not hanging (issue 22, items 4 and 5), the agent's side: a rank verified
waiting in a collective raises a WARNING suspicion for the arbiter to decide, records
"waiting on rank r (busy in ...)" when the arbiter answers BUSY, and is no hang while the
wait lasts (at most --hang-phase-timeout); a spinning rank the others wait on gets the
short culprit spin budget. The Verifier on an injected clock (test_liveness's rig)."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from ftagent.agent.peer_wait import (
    PeerWait,
    local_busy_peer,
    local_waiting_text,
    role_of,
    waiting_text,
)
from ftagent.agent.verify import ARBITER_ANSWER_WAIT
from ftagent.metrics import AgentMetrics
from ftagent.model import Action, ActionKind, FaultKind, JobBusy, Severity
from tests.unit.test_liveness import EVAL, MAIN, Rig, busy_eval, parked, proc, thread

SAVE_WHERE = "save (serialization.py:966) from checkpoint (train.py:77)"
IDS = {"job_name": "j", "namespace": "", "pod": "p", "node": "n", "rank": "1"}


def busy(spin_culprits: tuple[int, ...] = (), state: str = "alive",
         where: str = SAVE_WHERE, busy_ranks: tuple[int, ...] = (0,),
         waiting: tuple[int, ...] = (1,)) -> Action:
    return Action(ActionKind.BUSY, "job busy, not hung (stacks from 2/2 ranks): ...",
                  busy=JobBusy(busy_ranks, waiting, where, state, spin_culprits))


def waiting_rig(**cfg: Any) -> tuple[Rig, PeerWait, CollectorRegistry]:
    reg = CollectorRegistry()
    metrics = AgentMetrics(reg, IDS)
    r = Rig(parked(), metrics=metrics, **cfg)
    r.v.ask_arbiter = lambda: True  # an arbiter is connected
    return r, PeerWait(1, r.v, r._record, metrics), reg


def test_a_rank_waiting_in_a_collective_suspects_then_waits_on_the_busy_rank() -> None:
    async def go() -> None:
        r, pw, reg = waiting_rig()
        start = r.now[0]
        (f,) = await r.run_until(start + 8.0)
        # a WARNING suspicion for the arbiter to decide, never an error-level hang
        assert f.kind is FaultKind.HANG and f.severity is Severity.WARNING
        assert f.evidence["waiting_in_collective"] is True
        assert f.message.startswith("waiting in a collective for ")
        assert r.kinds("verify") == ["suspect"] and not r.det.hung
        pw.on_action(busy())
        (w,) = [e for e in r.events if e[:2] == ("peer", "waiting")]
        assert w[2].startswith(f"waiting on rank 0 (busy in {SAVE_WHERE})")
        assert w[3]["stall_open"] is True
        text = generate_latest(reg).decode()
        assert "ftagent_waiting_on_busy_peer{" in text and "} 1.0" in text
        assert 'role="waiting"} 1.0' in text
        # a 150 s save: re-checked every budget, waiting each time, no fault
        assert await r.run_until(start + 150.0) == []
        assert set(r.kinds("verify")[1:]) == {"waiting"} and len(r.kinds("verify")) > 10
        r.progress(0.2)
        pw.observe(r_progress(r))
        (done,) = [e for e in r.events if e[:2] == ("peer", "waited")]
        assert "waited 15" in done[2] and "on rank 0 (busy in save" in done[2]
        (phase,) = [e for e in r.events if e[0] == "phase"]
        assert phase[3]["waited"] and "waited on a rank the arbiter judged busy" in phase[2]
        text = generate_latest(reg).decode()
        assert "ftagent_waiting_on_busy_peer{" in text and "} 0.0" in text

    asyncio.run(go())


def r_progress(r: Rig) -> Any:
    from ftagent.model import Progress

    return Progress(step=r.step, source="log", ts=r.now[0])


def test_a_suspicion_nobody_answers_becomes_the_hang_once_the_arbiter_had_its_time() -> None:
    async def go() -> None:
        r, _, _ = waiting_rig()
        start = r.now[0]
        # the arbiter may wait --stacks-timeout (15 s by default) for every rank's stacks:
        # no error-level hang meanwhile, only "asking" records
        faults = await r.run_until(start + 8.0 + ARBITER_ANSWER_WAIT - 3.0)
        assert [f.severity for f in faults] == [Severity.WARNING]
        assert set(r.kinds("verify")[1:]) == {"asking"}, r.kinds("verify")
        faults = await r.run_until(start + 8.0 + ARBITER_ANSWER_WAIT + 8.0)
        assert [f.severity for f in faults] == [Severity.ERROR]
        assert "verified hung" in faults[0].message
        assert r.kinds("verify")[0] == "suspect" and r.kinds("verify")[-1] == "hung"

    asyncio.run(go())


def test_a_busy_answer_slower_than_one_budget_still_makes_the_stall_a_wait() -> None:
    """Under load the arbiter's BUSY came 3.2 s after the suspicion, where the waiting rank
    re-verified 2 s after it and declared itself hung (an error-level fault for a rank
    that only waited): the answer decides, however late within the arbiter's time."""
    async def go() -> None:
        r, pw, _ = waiting_rig()
        start = r.now[0]
        (f,) = await r.run_until(start + 8.0)
        assert f.severity is Severity.WARNING
        asked = r.now[0]
        assert await r.run_until(asked + 9.0) == []  # past a budget (5 s here), no answer yet
        pw.on_action(busy())
        assert await r.run_until(asked + 60.0) == []
        assert "hung" not in r.kinds("verify")
        assert [e for e in r.events if e[:2] == ("peer", "waiting")]

    asyncio.run(go())


def test_waiting_is_bounded_by_the_phase_timeout() -> None:
    async def go() -> None:
        r, pw, _ = waiting_rig(hang_phase_timeout=40.0)
        start = r.now[0]
        await r.run_until(start + 8.0)
        pw.on_action(busy())
        faults = await r.run_until(start + 60.0)
        (f,) = faults
        assert f.severity is Severity.ERROR and 40.0 <= f.evidence["stall_seconds"] <= 48.0

    asyncio.run(go())


def test_without_an_arbiter_the_waiting_rank_declares_as_before() -> None:
    async def go() -> None:
        r = Rig(parked())
        (f,) = await r.run_until(r.now[0] + 9.0)
        assert f.severity is Severity.ERROR and "waiting_in_collective" not in f.evidence

    asyncio.run(go())


def spinning(n: int = 5) -> list[list[Any]]:
    return [[proc(0, i * 0.45, [thread((EVAL,) + MAIN)])] for i in range(n)]


def test_a_spinning_culprit_is_declared_after_the_short_budget() -> None:
    async def go() -> None:
        r = Rig(spinning(), hang_spin_timeout=120.0)
        pw = PeerWait(0, r.v, r._record, culprit_spin_timeout=12.0)
        start = r.now[0]
        assert await r.run_until(start + 8.0) == []  # spinning: deferred
        pw.on_action(busy(spin_culprits=(0,), state="spinning", where="evaluate (train.py:88)"))
        (c,) = [e for e in r.events if e[:2] == ("peer", "culprit")]
        assert "--hang-culprit-spin-timeout" in c[2]
        (f,) = await r.run_until(start + 30.0)
        assert f.message.startswith("spinning in evaluate (train.py:88)")
        assert 12.0 <= f.evidence["stall_seconds"] <= 15.0

    asyncio.run(go())


def test_every_rank_busy_names_no_culprit_and_keeps_the_spin_budget() -> None:
    async def go() -> None:
        r = Rig(spinning(), hang_spin_timeout=120.0)
        pw = PeerWait(0, r.v, r._record, culprit_spin_timeout=12.0)
        start = r.now[0]
        await r.run_until(start + 8.0)
        pw.on_action(busy(state="spinning", busy_ranks=(0, 1), waiting=()))
        assert [e[1] for e in r.events if e[0] == "peer"] == ["busy"]
        assert await r.run_until(start + 60.0) == []

    asyncio.run(go())


def test_roles_and_text() -> None:
    b = JobBusy((0, 2), (1,), "evaluate (train.py:88)", "spinning", (2,))
    assert [role_of(r, b) for r in range(4)] == ["busy", "waiting", "culprit", ""]
    assert waiting_text(b) == "ranks 0, 2 (spinning in evaluate (train.py:88))"
    assert waiting_text(JobBusy((0,), (1,))) == "rank 0 (busy in its own code)"


def test_the_arbiter_decider_hands_busy_over_and_never_has_an_alert_probed() -> None:
    """BUSY reaches PeerWait through the decider's minor actions; with --hang-action
    alert a hang is only recorded at the arbiter, so the suspicion's marker is dropped."""
    import json

    from ftagent.agent.arbiter_decider import ArbiterDecider
    from ftagent.agent.pod import PodAgent
    from ftagent.agent.worker_parts import WorkerParts
    from ftagent.agent.worker_spec import WorkerSpec
    from ftagent.cmd.run import parse
    from ftagent.model import Fault
    from ftagent.v1 import ftagent_pb2 as pb

    got: list[Action] = []
    d = ArbiterDecider()
    w = PodAgent(d).add(  # the hook is given with the seat (seat.py RankHooks)
        WorkerSpec(parse(["--arbiter", "127.0.0.1:9", "--hang-action", "alert", "--",
                          "true"], {})),
        parts=lambda w: WorkerParts().with_(on_busy=got.append))
    a = busy()
    asyncio.run(d.on_minor_action(w, a))
    assert got == [a]
    d.decide(w, Fault(FaultKind.HANG, "waiting", severity=Severity.WARNING,
                   evidence={"waiting_in_collective": True, "where": "all_reduce"}))
    (msg,) = d.session(w).link.proto.faults.values()
    assert msg.severity == pb.SEVERITY_WARNING
    assert json.loads(msg.evidence_json) == {"where": "all_reduce"}


def test_busy_before_this_ranks_budget_ran_out_is_adopted_by_its_stall() -> None:
    """Another rank's suspicion made the arbiter answer BUSY before this rank's own
    budget ran out: its stall is that wait from the start, no suspicion of its own."""

    async def go() -> None:
        r, pw, _ = waiting_rig()
        start = r.now[0]
        await r.run_until(start + 2.0)
        pw.on_action(busy())
        (w,) = [e for e in r.events if e[:2] == ("peer", "waiting")]
        assert w[3]["stall_open"] is False
        assert await r.run_until(start + 30.0) == []
        assert set(r.kinds("verify")) == {"waiting"}

    asyncio.run(go())


# --------------------------------------------------------------------------- no arbiter:
# launcher mode, the pod's local peers (cmd/run.py wires Verifier.local_peers)


def test_the_local_peer_a_rank_waits_on_is_a_busy_one() -> None:
    alive = {"state": "alive", "where": "evaluate (train.py:88)", "declared": False}
    spin = {"state": "spinning", "where": "spin (train.py:213)", "declared": False}
    hung = {"state": "hung", "where": "allreduce (c10d.py:1)", "declared": False}
    assert local_busy_peer({}) is None
    assert local_busy_peer({2: hung, 3: {"state": "unknown"}}) is None
    assert local_busy_peer({2: {**alive, "declared": True}}) is None  # its own hang
    assert local_busy_peer({3: spin, 2: hung}) == (3, "spinning", "spin (train.py:213)")
    assert local_busy_peer({3: spin, 5: alive, 4: alive}) == (4, "alive",
                                                              "evaluate (train.py:88)")
    assert local_busy_peer({1: {"state": "alive"}}) == (1, "alive", "its own code")
    assert local_waiting_text(4, "alive", "evaluate (train.py:88)") == \
        "local rank 4 (busy in evaluate (train.py:88))"


async def verified(stacks: list[list[Any]], t: float = 7.5, **cfg: Any) -> Rig:
    """A local peer whose own budget ran out and was verified (alive, spinning); its clock
    stays there, so the waiting rank's question is answered from its last window."""
    peer = Rig(stacks, **cfg)
    await peer.run_until(peer.now[0] + t)
    assert peer.v.stall is not None and peer.v.stall.verdict is not None
    return peer


def test_without_an_arbiter_a_rank_waiting_on_a_busy_local_peer_is_not_hung() -> None:
    """On the old code (no local peers asked) this is test_without_an_arbiter_the_waiting_
    rank_declares_as_before: an error-level hang at the budget, and the local policy
    restarts a job whose rank 0 is only evaluating."""
    async def go() -> None:
        peer = await verified(busy_eval())
        assert peer.kinds("verify") == ["alive"]
        r = Rig(parked())
        r.v.local_peers = lambda: [(0, peer.v), (1, r.v)]
        calls = peer.sampler.calls
        start = r.now[0]
        assert await r.run_until(start + 60.0) == []
        assert peer.sampler.calls == calls  # its last window answered: no new sample
        (w,) = [e for e in r.events if e[:2] == ("peer", "waiting")]
        assert w[2].startswith("waiting on local rank 0 (busy in evaluate (train.py:")
        assert w[3]["local"] is True and w[3]["busy_ranks"] == [0]
        assert set(r.kinds("verify")) == {"waiting"} and len(r.kinds("verify")) >= 5
        r.progress(0.2)
        (done,) = [e for e in r.events if e[:2] == ("peer", "waited")]
        assert "waited" in done[2] and "local rank 0" in done[2]

    asyncio.run(go())


def test_without_an_arbiter_a_spinning_local_peer_gets_the_culprit_budget() -> None:
    async def go() -> None:
        # 16 samples: the scripted CPU keeps rising through the peer's windows
        peer = await verified(spinning(16), hang_spin_timeout=120.0,
                              hang_culprit_spin_timeout=12.0)
        assert peer.kinds("verify") == ["spinning"]
        r = Rig(parked(), hang_culprit_spin_timeout=12.0)
        r.v.local_peers = lambda: [(0, peer.v)]
        assert await r.run_until(r.now[0] + 8.0) == []
        (w,) = [e for e in r.events if e[:2] == ("peer", "waiting")]
        assert w[3]["culprit_spin_budget_seconds"] == 12.0 and w[3]["state"] == "spinning"
        # the spinning peer is declared at the culprit budget, not its 120 s spin budget
        (f,) = await peer.run_until(peer.now[0] + 10.0)
        assert f.message.startswith("spinning in evaluate (train.py:88)")
        assert 12.0 <= f.evidence["stall_seconds"] <= 15.0

    asyncio.run(go())


def test_without_an_arbiter_local_peers_all_waiting_declare_the_hang() -> None:
    async def go() -> None:
        peer = await verified(parked())  # itself waiting in the collective: hung
        r = Rig(parked())
        r.v.local_peers = lambda: [(0, peer.v)]
        (f,) = await r.run_until(r.now[0] + 9.0)
        assert f.severity is Severity.ERROR and f.evidence["verdict"] == "hung"
        assert not [e for e in r.events if e[0] == "peer"]

    asyncio.run(go())


def test_the_launcher_hands_each_workers_verifier_its_local_peers(tmp_path: Any) -> None:
    """cmd/run.py's build_workers, as `ftagent run --nproc-per-node 2` builds them (nothing
    started): every worker's verification can ask the other's."""
    import os

    from ftagent.agent.hang_watch import HangWatch
    from ftagent.cmd.run import build_workers, parse

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cfg = parse(["--nproc-per-node", "2", "--standalone", "--metrics-port", "-1", "--nic",
                 "lo", "--", "python", "x.py"], env)
    pod = build_workers(cfg, env, str(tmp_path))
    verifiers = [d.verifier for w in pod.workers for d in w.detectors
                 if isinstance(d, HangWatch)]
    assert len(verifiers) == 2 and all(v is not None for v in verifiers)
    for v in verifiers:
        assert v is not None and v.local_peers is not None
        assert [(r, p) for r, p in v.local_peers()] == [(0, verifiers[0]), (1, verifiers[1])]


def test_the_watch_loop_hands_it_only_what_ends_a_wait() -> None:
    """Steps and a new trainer end a wait; the loop routes only those to it
    (``observes``): a trainer's exit, a phase or a GPU event no longer call it."""
    from ftagent.model import PhaseMarker, ProcessExit, Progress, TrainerStart
    from ftagent.watch.loop import _route

    pw = PeerWait(0, None, None)
    assert _route([pw.observe], Progress(step=1, source="log", ts=1.0)) == (pw.observe,)
    assert _route([pw.observe], TrainerStart(pid=1, attempt=0, ts=0.0)) == (pw.observe,)
    assert _route([pw.observe], ProcessExit(pid=1, code=1, ts=2.0)) == ()
    assert _route([pw.observe], PhaseMarker(phase="eval", begin=True, ts=3.0)) == ()
