"""Every change of a job goes through ``state.apply`` (issue 23): agents' messages too.

Pure: plain values in, plain state out, no clock but the ``now`` given.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ftagent.arbiter import barrier
from ftagent.arbiter.state import (
    Arrived,
    AtBarrier,
    Decision,
    Exited,
    FaultSeen,
    JobPhase,
    JobState,
    Left,
    Registered,
    Settled,
    Verdict,
    apply,
)

NOW = 1000.0
ARBITER = Path(__file__).resolve().parents[2] / "ftagent" / "arbiter"


def hello(rank: int, *, generation: int = 0, restarts: int = 0, instance: str = "a",
          world: int = 2) -> Registered:
    return Registered(rank=rank, pod=f"pod-{rank}", node="n", state="waiting",
                      instance=instance, pod_uid="", gpus=(), generation=generation,
                      released_generation=-1, running=False, restart_count=restarts,
                      world_size=world, alert_only=False, conn=object())


def started(world: int = 2) -> JobState:
    job = JobState(job="j", world_size=world)
    for r in range(world):
        apply(job, hello(r, world=world), NOW)
    return job


def test_the_first_registration_opens_the_barrier_of_generation_0_and_counts_once() -> None:
    job = started()
    assert job.barrier is not None and (job.barrier.generation, job.barrier.opened_at) == (0, NOW)
    assert job.connected == 2
    apply(job, hello(1), NOW + 1)  # the same stream's agent says Hello again
    assert job.connected == 2
    apply(job, Left(1), NOW + 2)
    apply(job, Left(1), NOW + 2)  # idempotent
    assert job.connected == 1 and job.last_seen == NOW + 2


def test_restarts_and_generation_reconcile_upward_from_hellos() -> None:
    job = started()
    job.ranks[0].commanded = 3
    apply(job, hello(0, restarts=2, instance="b"), NOW)  # a new agent process
    assert job.restarts == 2 and job.ranks[0].commanded == -1
    apply(job, hello(1, restarts=1), NOW)
    assert job.restarts == 2  # never down


def test_arrivals_are_counted_by_apply_and_release_once_all_are_in() -> None:
    job = started()
    apply(job, Arrived(0, 0), NOW)  # counted at the barrier of the job's generation
    apply(job, Arrived(0, 0), NOW)  # re-sent: counted once
    assert job.barrier is not None and job.barrier.arrived == {0}
    assert barrier.decide_barrier(job, 0, 0) == []  # pure: it reads, it counts nothing
    assert job.barrier.arrived == {0}
    apply(job, Arrived(1, 0), NOW + 1)
    assert barrier.decide_barrier(job, 1, 0, fresh=False) == []  # a re-sent arrival
    (d,) = barrier.decide_barrier(job, 1, 0)
    assert d.verdict is Verdict.RELEASE_BARRIER and not d.targets
    apply(job, d, NOW + 1)
    assert job.phase is JobPhase.RUNNING
    assert [job.ranks[r].released_generation for r in (0, 1)] == [0, 0]
    assert [job.ranks[r].state for r in (0, 1)] == ["running", "running"]
    apply(job, AtBarrier(0, 7), NOW)  # not the job's generation: nothing counted
    assert job.barrier.arrived == {0, 1}


def test_a_rank_that_waits_for_a_newer_generation_has_restarted_once() -> None:
    job = started()
    job.ranks[0].released_generation = 0
    apply(job, Arrived(0, 1), NOW)
    apply(job, Arrived(0, 1), NOW)  # re-sent after a reconnect
    assert (job.ranks[0].generation, job.ranks[0].restarts) == (1, 1)


def test_every_rank_exiting_0_at_the_jobs_generation_is_success_through_apply() -> None:
    job = started()
    apply(job, Exited(0, 0, 0), NOW)
    assert job.phase is JobPhase.STARTING and job.ranks[0].state == "succeeded"
    apply(job, Exited(1, 0, 1), NOW)
    assert job.phase is JobPhase.STARTING and job.ranks[1].last_exit_status == 1
    apply(job, Exited(1, 0, 0), NOW)
    assert job.phase is JobPhase.SUCCEEDED


def test_an_exit_of_an_older_generation_is_no_success() -> None:
    job = started()
    apply(job, Decision(Verdict.RESTART, "crash", 1), NOW)
    for r in (0, 1):
        apply(job, Exited(r, 0, 0), NOW)
    assert job.phase is JobPhase.RESTARTING


def test_replace_marks_its_rank_replacing_and_the_others_restarting() -> None:
    job = started(3)
    apply(job, Decision(Verdict.REPLACE, "gpu", 1, rank=2), NOW)
    assert [job.ranks[r].state for r in range(3)] == ["restarting", "restarting", "replacing"]
    assert {job.ranks[r].commanded for r in range(3)} == {1}
    assert job.restarts == 1


def test_open_faults_settle_only_with_no_probe_and_no_outage_left() -> None:
    job = started()
    apply(job, FaultSeen("f1", False, 1, "hang: x"), NOW)
    assert job.open_faults == {"f1": 1} and job.seen_faults["f1"] is False
    assert job.ranks[1].last_fault == "hang: x"
    wait = Decision(Verdict.WAIT, "link down", 0, rank=0, until=NOW + 5, fault_id="n")
    assert apply(job, wait, NOW) == [wait]  # nothing derived
    apply(job, Settled(), NOW)
    assert job.open_faults == {"f1": 1}  # a link is still down
    # the decision that ends the last outage settles them: derived, for their final acks
    back = Decision(Verdict.LINK_BACK, "back", 0, rank=0)
    assert apply(job, back, NOW) == [back, Settled((("f1", 1),))]
    assert job.open_faults == {} and job.seen_faults["f1"] is True
    assert apply(job, Settled(), NOW) == [Settled()] and job.open_faults == {}


def test_the_registry_parts_change_no_job_outside_apply() -> None:
    """No assignment to a job's, rank's or barrier's attribute outside state.py (the
    connections' ``pending`` slots are what was sent, not the job: commands.py)."""
    named = {"job", "j", "rs", "r", "b", "rank_state"}
    found = []
    for name in ("registry.py", "jobs.py", "intake.py", "journal.py", "readout.py",
                 "nodemap.py", "commands.py", "barrier.py", "policy.py"):
        tree = ast.parse((ARBITER / name).read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) \
                            and e.value.id in named:
                        found.append(f"{name}:{node.lineno} {e.value.id}.{e.attr}")
    assert found == []


def test_side_effects_observe_applied_changes_nothing_calls_them_to_write() -> None:
    """Issue 36: the journal (timeline, history record, counters, ledger) observes what
    ``state.apply`` applied; no part calls it, the timeline or the ledger to write (38
    calls in 4 files did before), and the cluster writes no timeline entry itself."""
    writers = {"note", "save", "progress", "fault", "succeeded", "decided", "retire",
               "ledger", "add", "observe"}
    found = []
    files = [p for p in ARBITER.glob("*.py") if p.name != "journal.py"]
    files += list((ARBITER.parent / "kube").glob("*.py"))
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else \
                owner.id if isinstance(owner, ast.Name) else ""
            if name in ("journal", "timeline") and node.func.attr in writers:
                found.append(f"{path.name}:{node.lineno} {name}.{node.func.attr}")
    assert found == []
