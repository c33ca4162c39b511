"""Naming the culprit of a job hang from real-shaped stack dumps (py-spy text and JSON)."""

from __future__ import annotations

import json

from ftagent.arbiter.policy import name_culprit, stack_signature

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
    assert report(2, 9.0, recovered=True, outage_seconds=7.0) is Verdict.RESTART
    assert j.generation == 1 and not j.nic_outages
