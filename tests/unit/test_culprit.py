"""Naming the culprit of a job hang from real-shaped stack dumps (py-spy text and JSON)."""

from __future__ import annotations

import json

from ftagent.arbiter.policy import job_busy, liveness_of, name_culprit, stack_signature

VICTIM = """Process 101: python examples/train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 101 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:825)
    backward (torch/autograd/__init__.py:347)
    backward (torch/_tensor.py:648)
    main (train.py:122)
    <module> (train.py:141)
"""
CULPRIT = """Process 202: python examples/train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 202 (idle): "MainThread"
    hang_before_collective (train.py:72)
    main (train.py:117)
    <module> (train.py:141)
"""


def evidence(text: str, pid: int) -> str:
    return json.dumps({"processes": [{"pid": pid, "cpu_times": [1.0, 0.1], "stack": text}],
                       "seconds": 0.02})


def test_signature_of_text_dumps_ignores_pids_and_keeps_innermost_frames() -> None:
    a = stack_signature(evidence(VICTIM, 101))
    b = stack_signature(evidence(VICTIM.replace("101", "999"), 999))
    assert a == b
    assert a.startswith("_engine_run_backward (graph.py:825) < backward (__init__.py:347)")


def test_the_rank_outside_the_collective_is_the_culprit_even_with_two_ranks() -> None:
    stacks = {0: stack_signature(evidence(VICTIM, 101)),
              1: stack_signature(evidence(CULPRIT, 202))}
    culprits, why = name_culprit({0: 19, 1: 19}, stacks)
    assert culprits == [1]
    assert "hang_before_collective" in why


def test_everyone_waiting_in_the_same_collective_names_nobody() -> None:
    stacks = {r: stack_signature(evidence(VICTIM, 100 + r)) for r in range(4)}
    assert name_culprit({r: 7 for r in range(4)}, stacks)[0] == []


def test_step_behind_wins_over_stacks() -> None:
    stacks = {r: stack_signature(evidence(VICTIM, 100 + r)) for r in range(3)}
    assert name_culprit({0: 10, 1: 10, 2: 9}, stacks)[0] == [2]


def test_py_spy_json_frames_are_understood() -> None:
    dump = json.dumps([{"thread_id": 5, "frames": [
        {"name": "allreduce", "filename": "/x/distributed_c10d.py", "line": 10},
        {"name": "step", "filename": "/x/train.py", "line": 3}]}])
    sig = stack_signature(dump)
    assert sig == "allreduce (distributed_c10d.py:10) < step (train.py:3)"


def test_independent_nic_outages_restart_only_when_the_last_link_is_back() -> None:
    from ftagent.arbiter.policy import FaultReport, PolicyConfig, decide_fault
    from ftagent.arbiter.state import JobPhase, JobState, RankState, Verdict, apply
    from ftagent.model import Fault, FaultKind

    cfg = PolicyConfig(max_restarts=3, barrier_timeout=300, nic_replace_after=300,
                       stacks_timeout=15)
    j = JobState(job="j", world_size=3, phase=JobPhase.RUNNING)
    for r in range(3):
        j.ranks[r] = RankState(rank=r, connected=True)

    def report(rank: int, now: float, **evidence: object) -> Verdict:
        f = Fault(FaultKind.NIC, "link", evidence=dict(evidence))
        (d,) = decide_fault(j, FaultReport(f, rank, 0), now, cfg)
        apply(j, d, now)
        return d.verdict

    assert report(0, 1.0, device="eth1") is Verdict.WAIT
    assert report(2, 2.0, device="eth1") is Verdict.WAIT
    assert report(0, 5.0, recovered=True, outage_seconds=4.0) is Verdict.LINK_BACK
    assert j.generation == 0 and set(j.nic_outages) == {2}
    # the last link back: the job may resume by itself before it restarts (policy table)
    assert report(2, 9.0, recovered=True, outage_seconds=7.0) is Verdict.LINK_BACK
    assert j.generation == 0 and not j.nic_outages and j.nic_resume is not None
    assert j.nic_resume.rank == 2 and j.nic_resume.deadline == 9.0 + 7.0 + 5.0


# --------------------------------------------------------------------------- liveness (job view)


def verified(text: str, pid: int, state: str, where: str, declared: bool = False) -> str:
    """The DUMP_STACKS answer of an agent that verifies (agent/verify.py)."""
    return json.dumps({"processes": [{"pid": pid, "stack": text}], "seconds": 2.0,
                       "liveness": {"state": state, "where": where, "declared": declared,
                                    "reason": "...", "processes": [{"pid": pid}]}})


BUSY = """Thread 303 (active): "MainThread"
    Linear.forward (torch/nn/modules/linear.py:134)
    evaluate (train.py:138)
    main (train.py:232)
"""


def test_liveness_travels_as_a_tag_and_is_not_compared() -> None:
    sig = stack_signature(verified(VICTIM, 101, "hung", "_engine_run_backward"))
    assert liveness_of(sig)[:2] == ("hung", "_engine_run_backward")
    assert liveness_of(sig)[2] == stack_signature(evidence(VICTIM, 101))
    declared = stack_signature(verified(CULPRIT, 5, "spinning", "spin (x.py:1)", True))
    assert liveness_of(declared)[0] == "hung"  # its agent declared it: no longer busy


def test_every_rank_busy_in_the_same_phase_is_a_job_wide_undeclared_phase() -> None:
    stacks = {r: stack_signature(verified(BUSY, 300 + r, "alive", "evaluate (train.py:138)"))
              for r in range(4)}
    busy = job_busy(stacks)
    assert busy is not None and busy[0] == [0, 1, 2, 3]
    assert "every rank is busy (the same place" in busy[1] and "evaluate" in busy[1]


def test_one_rank_busy_while_the_others_wait_in_the_collective_is_not_a_hang() -> None:
    stacks = {0: stack_signature(verified(BUSY, 300, "alive", "evaluate (train.py:138)")),
              1: stack_signature(verified(VICTIM, 101, "hung", "_engine_run_backward"))}
    busy = job_busy(stacks)
    assert busy is not None and busy[0] == [0]
    assert "rank 0 busy in evaluate (train.py:138) while rank 1 wait(s) for it" in busy[1]


def test_all_waiting_is_a_job_hang_and_the_rank_not_waiting_is_named_as_before() -> None:
    stacks = {0: stack_signature(verified(VICTIM, 101, "hung", "_engine_run_backward")),
              1: stack_signature(verified(CULPRIT, 202, "hung", "hang_before_collective"))}
    assert job_busy(stacks) is None
    culprits, why = name_culprit({0: 19, 1: 19}, stacks)
    assert culprits == [1] and "hang_before_collective" in why


def test_decide_stacks_leaves_a_busy_job_running_and_ends_the_probe() -> None:
    from ftagent.arbiter.policy import PolicyConfig, decide_stacks
    from ftagent.arbiter.state import HangProbe, JobPhase, JobState, RankState, Verdict, apply

    j = JobState(job="j", world_size=2, phase=JobPhase.RUNNING)
    j.hang_probe = HangProbe(fault_id="f1", rank=1, deadline=100.0)
    j.ranks[0] = RankState(rank=0, connected=True, step=40,
                           stack=stack_signature(verified(BUSY, 1, "alive", "evaluate")))
    j.ranks[1] = RankState(rank=1, connected=True, step=40,
                           stack=stack_signature(verified(VICTIM, 2, "hung", "backward")))
    (d,) = decide_stacks(j, 10.0, PolicyConfig())
    # BUSY (issue 22): no restart, and every rank is told who is busy and who waits
    assert d.verdict is Verdict.BUSY and d.generation == 0 and d.fault_id == "f1"
    assert "job busy, not hung" in d.reason and "no restart" in d.reason
    assert d.busy is not None and d.busy.busy_ranks == (0,) and d.busy.waiting_ranks == (1,)
    assert d.busy.state == "alive" and d.busy.spin_culprits == () and not d.targets
    apply(j, d, 10.0)
    assert j.hang_probe is None and j.restarts == 0 and j.busy == d.reason


def failed_capture(pid: int, error: str) -> str:
    return json.dumps({"processes": [{"pid": pid, "cpu_times": None, "stack": None,
                                      "error": error}], "seconds": 3.0})


def test_a_capture_without_frames_says_why_in_words_never_raw_json() -> None:
    sig = stack_signature(failed_capture(202, "py-spy dump timed out after 3.0s"))
    assert sig == "no stack: py-spy dump timed out after 3.0s"
    assert "{" not in sig


def test_a_rank_without_a_stack_while_the_others_wait_is_named_with_the_reason() -> None:
    stacks = {0: stack_signature(evidence(VICTIM, 101)),
              1: stack_signature(failed_capture(202, "py-spy dump timed out after 3.0s"))}
    culprits, why = name_culprit({0: 15, 1: 15}, stacks)
    assert culprits == [1]
    assert why == ("rank 1 gave no stack (py-spy dump timed out after 3.0s) while 1 other "
                   "rank(s) wait in a collective")


def test_no_stack_anywhere_names_nobody_and_says_why() -> None:
    stacks = {r: stack_signature(failed_capture(r, "no such process (it exited)")) for r in (0, 1)}
    culprits, why = name_culprit({0: 15, 1: 15}, stacks)
    assert culprits == []
    assert why == "no single culprit: rank 0, 1 gave no stack (no such process (it exited))"
