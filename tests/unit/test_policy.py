"""The arbiter's decision table, barrier and shard choice: pure, no I/O, no sleeps."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ftagent.agent.reporter import BACKOFF_CAP, backoff
from ftagent.arbiter import barrier, convert
from ftagent.arbiter.policy import (
    FaultReport,
    PolicyConfig,
    decide_fault,
    decide_stacks,
    decide_tick,
    name_culprit,
    stack_signature,
)
from ftagent.arbiter.state import Decision, JobPhase, JobState, RankState, Verdict, apply
from ftagent.model import EXIT_REPLACE, ActionKind, Fault, FaultKind, Scope, Severity
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.shard import pick_arbiter

CFG = PolicyConfig(max_restarts=3, barrier_timeout=300, nic_replace_after=300,
                   stacks_timeout=15)
NOW = 1_000_000.0


def job(world: int = 4, *, restarts: int = 0, generation: int = 0, max_restarts: int = 3,
        step_age: float | None = 1.0, steps: list[int] | None = None) -> JobState:
    j = JobState(job="j", world_size=world, generation=generation, restarts=restarts,
                 max_restarts=max_restarts, phase=JobPhase.RUNNING)
    for r in range(world):
        j.ranks[r] = RankState(rank=r, connected=True, generation=generation,
                               step=steps[r] if steps else 10,
                               last_step_at=None if step_age is None else NOW - step_age)
    return j


def fault(kind: FaultKind = FaultKind.CRASH, *, severity: Severity = Severity.ERROR,
          scope: Scope = Scope.PROCESS, evidence: dict | None = None, fid: str = "") -> Fault:
    f = Fault(kind, f"{kind.value} happened", severity=severity, scope=scope,
              evidence=evidence or {})
    return Fault(f.kind, f.message, f.severity, f.scope, f.evidence, id=fid or f.id)


def rep(f: Fault, rank: int = 1, generation: int = 0, exit_status: int | None = None
        ) -> FaultReport:
    return FaultReport(f, rank, generation, exit_status)


def run(j: JobState, ds: list[Decision], now: float = NOW) -> list[Decision]:
    for d in ds:
        apply(j, d, now)
    return ds


def only(ds: list[Decision]) -> Decision:
    assert len(ds) == 1, ds
    return ds[0]


# --------------------------------------------------------------------------- crash and budget


def test_crash_restarts_every_rank_at_next_generation() -> None:
    j = job()
    d = only(run(j, decide_fault(j, rep(fault(), exit_status=3), NOW, CFG)))
    assert d.verdict is Verdict.RESTART and d.generation == 1 and d.targets == ()
    assert d.rank == 1 and "restart 1/3" in d.reason
    assert j.generation == 1 and j.restarts == 1 and j.phase is JobPhase.RESTARTING
    assert j.barrier is not None and j.barrier.generation == 1 and not j.barrier.arrived


def test_budget_is_per_job_then_stop_with_the_faulting_exit_code() -> None:
    j = job(max_restarts=2)
    for g in range(2):
        d = only(run(j, decide_fault(j, rep(fault(), rank=g, generation=g), NOW, CFG)))
        assert d.verdict is Verdict.RESTART and d.generation == g + 1
    d = only(run(j, decide_fault(j, rep(fault(), rank=3, generation=2, exit_status=7),
                                 NOW, CFG)))
    assert d.verdict is Verdict.STOP and d.exit_code == 7 and d.targets == ()
    assert "budget spent (2/2)" in d.reason and j.phase is JobPhase.STOPPED
    # nothing more happens to a stopped job
    assert only(decide_fault(j, rep(fault(), generation=2), NOW, CFG)).verdict is Verdict.IGNORE


def test_stop_without_an_exit_status_uses_1_and_job_hang_stacks_come_first() -> None:
    assert only(decide_fault(job(max_restarts=0), rep(fault()), NOW, CFG)).exit_code == 1
    j = job(max_restarts=0, step_age=60)  # a job hang: evidence before stopping
    d = only(run(j, decide_fault(j, rep(fault(FaultKind.HANG)), NOW, CFG)))
    assert d.verdict is Verdict.DUMP_STACKS
    d = only(decide_tick(j, NOW + 15, CFG))
    assert d.verdict is Verdict.STOP and d.exit_code == 1


def test_duplicate_fault_id_is_ignored() -> None:
    j = job()
    f = fault()
    run(j, decide_fault(j, rep(f), NOW, CFG))
    j.remember_fault(f.id)
    assert decide_fault(j, rep(f, generation=1), NOW, CFG) == []


def test_fault_of_an_older_generation_does_not_restart_twice() -> None:
    j = job()
    run(j, decide_fault(j, rep(fault(), rank=0), NOW, CFG))
    d = only(decide_fault(j, rep(fault(), rank=2, generation=0), NOW, CFG))
    assert d.verdict is Verdict.IGNORE and "generation 0" in d.reason
    assert j.generation == 1 and j.restarts == 1


def test_alert_only_job_is_never_touched() -> None:
    j = job()
    j.alert_only = True
    for k in (FaultKind.CRASH, FaultKind.HANG, FaultKind.GPU):
        d = only(decide_fault(j, rep(fault(k, severity=Severity.FATAL)), NOW, CFG))
        assert d.verdict is Verdict.ALERT_ONLY
    assert decide_tick(j, NOW + 10_000, CFG) == []


def test_info_and_warning_and_agent_faults_only_alert() -> None:
    j = job()
    assert only(decide_fault(j, rep(fault(FaultKind.GPU, severity=Severity.WARNING)), NOW,
                             CFG)).verdict is Verdict.ALERT_ONLY
    assert only(decide_fault(j, rep(fault(FaultKind.AGENT)), NOW, CFG)).verdict \
        is Verdict.ALERT_ONLY


# --------------------------------------------------------------------------- hardware


def test_fatal_gpu_replaces_the_rank_and_restarts_the_others() -> None:
    j = job()
    d = only(run(j, decide_fault(j, rep(fault(FaultKind.GPU, severity=Severity.FATAL),
                                        rank=2), NOW, CFG)))
    assert d.verdict is Verdict.REPLACE and d.rank == 2 and d.generation == 1
    assert j.restarts == 1
    target = convert.command_for(d, "c", replace=True).command
    other = convert.command_for(d, "c").command
    assert target.kind == pb.COMMAND_KIND_REPLACE and target.exit_code == EXIT_REPLACE
    assert other.kind == pb.COMMAND_KIND_RESTART and other.generation == 1
    action = convert.command_to_action(target)
    assert action is not None and action.kind is ActionKind.REPLACE
    assert action.exit_code == EXIT_REPLACE and action.target_rank == 2


def test_node_scope_and_node_faults_replace() -> None:
    for f in (fault(FaultKind.GPU, scope=Scope.NODE), fault(FaultKind.NODE)):
        assert only(decide_fault(job(), rep(f), NOW, CFG)).verdict is Verdict.REPLACE


def test_application_gpu_error_restarts() -> None:
    assert only(decide_fault(job(), rep(fault(FaultKind.GPU)), NOW, CFG)).verdict \
        is Verdict.RESTART


def test_nic_down_waits_then_restarts_when_back() -> None:
    j = job()
    down = fault(FaultKind.NIC)
    d = only(run(j, decide_fault(j, rep(down, rank=3), NOW, CFG)))
    assert d.verdict is Verdict.WAIT and d.until == NOW + 300 and 3 in j.nic_outages
    j.remember_fault(down.id)
    # the trainer crashes meanwhile: deferred, no restart into a dead link
    d = only(decide_fault(j, rep(fault(), rank=0), NOW + 5, CFG))
    assert d.verdict is Verdict.IGNORE and "deferred" in d.reason
    assert only(decide_fault(j, rep(fault(FaultKind.NIC), rank=3), NOW, CFG)).verdict \
        is Verdict.IGNORE
    assert decide_tick(j, NOW + 10, CFG) == []
    back = fault(FaultKind.NIC, severity=Severity.INFO,
                 evidence={"recovered": True, "outage_seconds": 12.5})
    d = only(run(j, decide_fault(j, rep(back, rank=3), NOW + 12, CFG), NOW + 12))
    # the job may resume by itself: the outage's length plus 5 s for every step to advance
    assert d.verdict is Verdict.LINK_BACK and "link back after 12.5s" in d.reason
    assert d.until == NOW + 12 + 17.5 and d.pending and not j.nic_outages
    assert decide_tick(j, NOW + 20, CFG) == []
    j.ranks[3].step = 11  # one rank moved, rank 0-2 did not: still waiting
    assert decide_tick(j, NOW + 29, CFG) == []
    d = only(run(j, decide_tick(j, NOW + 29.5, CFG), NOW + 29.5))
    assert d.verdict is Verdict.RESTART and "rank 0, 1, 2 did not advance in 18s" in d.reason
    assert j.nic_resume is None and j.generation == 1


def _link_back(cfg: PolicyConfig = CFG) -> tuple[JobState, list[Decision]]:
    """A job whose rank 3 lost its link for 10 s and got it back at NOW + 10."""
    j = job()
    down = fault(FaultKind.NIC)
    run(j, decide_fault(j, rep(down, rank=3), NOW, cfg))
    j.remember_fault(down.id)
    back = fault(FaultKind.NIC, severity=Severity.INFO,
                 evidence={"recovered": True, "outage_seconds": 10.0})
    return j, run(j, decide_fault(j, rep(back, rank=3), NOW + 10, cfg), NOW + 10)


def test_nic_link_back_and_every_rank_steps_again_is_no_restart() -> None:
    j, ds = _link_back()
    assert only(ds).verdict is Verdict.LINK_BACK and j.nic_resume is not None
    # a hang the agents verify while TCP retransmits is deferred, not a restart
    d = only(decide_fault(j, rep(fault(FaultKind.HANG), rank=0), NOW + 11, CFG))
    assert d.verdict is Verdict.IGNORE and "deferred" in d.reason and d.pending
    for r in j.ranks.values():
        r.step = 11  # TCP resumed the all-reduce: every rank's step advanced
    d = only(run(j, decide_tick(j, NOW + 13.5, CFG), NOW + 13.5))
    assert d.verdict is Verdict.ALERT_ONLY and "no restart" in d.reason
    assert "3.5s later" in d.reason and d.fault_id and not d.pending
    assert j.nic_resume is None and j.generation == 0 and j.restarts == 0
    assert decide_tick(j, NOW + 60, CFG) == []  # the deadline passes: nothing


def test_nic_crash_while_waiting_for_the_resume_restarts_at_once() -> None:
    j, _ = _link_back()
    d = only(run(j, decide_fault(j, rep(fault(), rank=0), NOW + 11, CFG), NOW + 11))
    assert d.verdict is Verdict.RESTART and j.nic_resume is None and j.generation == 1


def test_nic_resume_timeout_zero_restarts_when_the_link_is_back() -> None:
    j, ds = _link_back(PolicyConfig(nic_resume_timeout=0))
    assert only(ds).verdict is Verdict.RESTART and j.nic_resume is None


def test_nic_resume_budget_is_capped() -> None:
    j, ds = _link_back(PolicyConfig(nic_resume_timeout=8))
    assert only(ds).until == NOW + 10 + 8


def test_nic_down_too_long_replaces_the_rank() -> None:
    j = job()
    run(j, decide_fault(j, rep(fault(FaultKind.NIC), rank=1), NOW, CFG))
    d = only(run(j, decide_tick(j, NOW + 301, CFG), NOW + 301))
    assert d.verdict is Verdict.REPLACE and d.rank == 1 and "still down" in d.reason


def test_nic_warning_opens_no_outage_and_a_crash_after_it_restarts_at_once() -> None:
    """The agent's WARNING for a link the job did not name, deleted while another is up
    (detect/nic.py: another tenant's veth on a shared host) is recorded only: no WAIT, so
    the job's next crash is not deferred (bench/restart.py's stuck warm restarts)."""
    j = job()
    gone = fault(FaultKind.NIC, severity=Severity.WARNING,
                 evidence={"device": "fl1d0", "reason": "deleted", "guessed": True,
                           "others_up": ["eth0"]})
    d = only(run(j, decide_fault(j, rep(gone, rank=0), NOW, CFG)))
    assert d.verdict is Verdict.ALERT_ONLY and not j.nic_outages
    j.remember_fault(gone.id)
    d = only(decide_fault(j, rep(fault(), rank=0), NOW + 1, CFG))
    assert d.verdict is Verdict.RESTART


def test_nic_recovery_without_outage_only_alerts() -> None:
    back = fault(FaultKind.NIC, severity=Severity.INFO, evidence={"recovered": True})
    assert only(decide_fault(job(), rep(back), NOW, CFG)).verdict is Verdict.ALERT_ONLY


# --------------------------------------------------------------------------- hangs


def test_single_hung_rank_while_others_progress_is_the_culprit() -> None:
    j = job(step_age=0.5)
    j.ranks[2].last_step_at = NOW - 60
    j.ranks[2].hung = True
    d = only(decide_fault(j, rep(fault(FaultKind.HANG), rank=2), NOW, CFG))
    assert d.verdict is Verdict.RESTART and d.rank == 2 and "other ranks progress" in d.reason


def test_job_hang_collects_stacks_then_names_the_odd_rank() -> None:
    j = job(step_age=60)
    f = fault(FaultKind.HANG)
    d = only(run(j, decide_fault(j, rep(f, rank=0), NOW, CFG)))
    assert d.verdict is Verdict.DUMP_STACKS and d.until == NOW + 15 and d.targets == ()
    assert j.hang_probe is not None
    j.remember_fault(f.id)
    # another rank's hang report while stacks are collected changes nothing
    assert only(decide_fault(j, rep(fault(FaultKind.HANG), rank=1), NOW, CFG)).verdict \
        is Verdict.IGNORE
    for r in range(4):
        assert decide_stacks(j, NOW + 1, CFG) == []
        # none in communication: the odd one out of the majority is named
        j.ranks[r].stack = "forward (model.py:10)" if r != 3 else "dataloader (data.py:5)"
    d = only(run(j, decide_stacks(j, NOW + 1, CFG)))
    assert d.verdict is Verdict.RESTART and d.rank == 3 and "rank 3 stack differs" in d.reason
    assert d.fault_id == f.id and j.hang_probe is None


def test_job_hang_restarts_at_the_deadline_with_the_stacks_it_has() -> None:
    j = job(step_age=60, steps=[10, 10, 9, 10])
    run(j, decide_fault(j, rep(fault(FaultKind.HANG), rank=0), NOW, CFG))
    assert decide_tick(j, NOW + 14, CFG) == []
    d = only(decide_tick(j, NOW + 15, CFG))
    assert d.verdict is Verdict.RESTART and d.rank == 2 and "step 9, behind" in d.reason
    assert "stacks from 0/4" in d.reason


def test_single_rank_job_hang_restarts_directly() -> None:
    d = only(decide_fault(job(1), rep(fault(FaultKind.HANG), rank=0), NOW, CFG))
    assert d.verdict is Verdict.RESTART


def test_name_culprit() -> None:
    assert name_culprit({0: 5, 1: 4, 2: 5, 3: 5}, {}) == ([1], name_culprit(
        {0: 5, 1: 4, 2: 5, 3: 5}, {})[1])
    ranks, why = name_culprit({0: 5, 1: 5, 2: 5}, {0: "a", 1: "b", 2: "a"})
    assert ranks == [1] and "differs from the other 2" in why
    assert name_culprit({0: 5, 1: 5}, {0: "a", 1: "a"})[0] == []
    assert name_culprit({0: 4, 1: 4, 2: 5}, {})[0] == []  # a majority behind: no culprit


def test_a_stalled_loader_or_an_idle_helper_thread_is_not_waiting_in_a_collective() -> None:
    """``wait`` names count as communication only in torch.distributed's files: a rank in
    its loader's ``wait_for_data`` beside a pin-memory thread in ``wait (threading.py)`` is
    the culprit while its peer waits in the backward's all-reduce."""
    helper = "wait (threading.py:320) < get (queue.py:171) < _pin_memory_loop (pin_memory.py:49)"
    stalled = ("live=hung where=wait_for_data (train.py:168) :: "
               "wait_for_data (train.py:168) < main (train.py:375) | " + helper)
    victim = ("live=hung where=_engine_run_backward (graph.py:829) :: _engine_run_backward "
              "(graph.py:829) < backward (__init__.py:353) < main (train.py:397) | " + helper)
    ranks, why = name_culprit({0: 41, 1: 41}, {0: stalled, 1: victim})
    assert ranks == [0] and "rank 0 is not in a collective (in wait_for_data (train.py:168))" \
        in why, why
    # where the agent's verdict says, not the thread py-spy happened to list first
    helper_first = stalled.replace(" :: ", " :: " + helper + " | ", 1)
    assert "(in wait_for_data (train.py:168))" in name_culprit(
        {0: 41, 1: 41}, {0: helper_first, 1: victim})[1]
    async_wait = "wait (distributed_c10d.py:2890) < step (train.py:70)"
    assert name_culprit({0: 5, 1: 5}, {0: "spin (train.py:200)", 1: async_wait})[0] == [0]


def test_stack_signature_ignores_ids_and_thread_order() -> None:
    def dump(pid: int, inner: str) -> str:
        return json.dumps([
            {"thread_id": pid * 7, "thread_name": "pt_watchdog", "frames": [
                {"name": "wait", "short_filename": "threading.py", "line": 320}]},
            {"pid": pid, "thread_id": pid, "thread_name": "MainThread", "frames": [
                {"name": inner, "filename": "/x/dist.py", "line": 12},
                {"name": "train", "filename": "/x/train.py", "line": 40}]}])
    assert stack_signature(dump(1, "all_reduce")) == stack_signature(dump(2, "all_reduce"))
    assert stack_signature(dump(1, "all_reduce")) != stack_signature(dump(1, "__next__"))
    assert stack_signature("not json") == "not json"


# --------------------------------------------------------------------------- barrier


def test_barrier_releases_when_every_rank_arrived() -> None:
    j = job(3)
    run(j, decide_fault(j, rep(fault()), NOW, CFG))
    assert barrier.decide_arrival(j, 0, 1, NOW) == []
    assert barrier.decide_arrival(j, 0, 1, NOW) == []  # re-sent arrival
    assert barrier.decide_arrival(j, 1, 0, NOW) == []  # stale generation
    assert barrier.decide_arrival(j, 1, 1, NOW) == []
    d = only(run(j, barrier.decide_arrival(j, 2, 1, NOW)))
    assert d.verdict is Verdict.RELEASE_BARRIER and d.generation == 1 and d.targets == ()
    assert j.phase is JobPhase.RUNNING
    late = only(barrier.decide_arrival(j, 0, 1, NOW))
    assert late.verdict is Verdict.RELEASE_BARRIER and late.targets == (0,)


def test_barrier_timeout_stops_and_names_the_missing_ranks() -> None:
    j = job(4)
    run(j, decide_fault(j, rep(fault()), NOW, CFG))
    for r in (0, 1, 3):
        barrier.decide_arrival(j, r, 1, NOW + 1)
    assert decide_tick(j, NOW + 299, CFG) == []
    d = only(run(j, decide_tick(j, NOW + 300, CFG), NOW + 300))
    assert d.verdict is Verdict.STOP and d.rank == 2 and "missing rank 2" in d.reason
    assert "3/4 ranks arrived" in d.reason and j.phase is JobPhase.STOPPED
    assert only(barrier.decide_arrival(j, 2, 1, NOW)).verdict is Verdict.STOP


# --------------------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(FaultKind)), st.sampled_from(list(Severity)),
                          st.integers(0, 3), st.integers(-1, 1), st.booleans()),
                max_size=30),
       st.integers(0, 4))
def test_budget_and_generations_hold_for_any_fault_sequence(
        events: list[tuple[FaultKind, Severity, int, int, bool]], budget: int) -> None:
    j = job(4, max_restarts=budget, step_age=60)
    now = NOW
    seen: list[Fault] = []
    for kind, sev, rank, gen_delta, repeat in events:
        now += 1
        f = seen[-1] if repeat and seen else fault(kind, severity=sev)
        before = (j.generation, j.restarts)
        ds = decide_fault(j, rep(f, rank=rank, generation=max(0, j.generation + gen_delta)),
                          now, CFG)
        if f.id in j.seen_faults:
            assert ds == []
        run(j, ds, now)
        j.remember_fault(f.id)
        seen.append(f)
        run(j, decide_tick(j, now + 1000, CFG), now + 1000)
        assert j.restarts <= budget
        assert j.generation - before[0] == j.restarts - before[1]
    assert j.generation == j.restarts


def test_pick_arbiter_is_stable_and_spreads_jobs() -> None:
    replicas = "a:1, b:2,c:3"
    assert pick_arbiter(replicas, "llama") == pick_arbiter(["a:1", "b:2", "c:3"], "llama")
    assert pick_arbiter("only:1", "x") == "only:1"
    # sha256 is fixed forever: this value must never change between releases
    assert pick_arbiter(replicas, "job-0") == "a:1"
    counts = {r: 0 for r in ("a:1", "b:2", "c:3")}
    for i in range(3000):
        counts[pick_arbiter(replicas, f"job-{i}")] += 1
    assert min(counts.values()) > 800


def test_backoff_is_jittered_doubling_and_capped() -> None:
    rng = random.Random(1)
    values = [backoff(a, rng) for a in range(30)]
    assert all(0 < v <= BACKOFF_CAP for v in values)
    assert values[0] <= 0.2 and max(values) > BACKOFF_CAP / 2
