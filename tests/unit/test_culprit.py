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
