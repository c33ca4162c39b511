"""Issue 24: phases the trainer did not declare but the agent learned (an undeclared long
phase: a stall its hang verification found alive, agent/verify.py) leave ``productive``
like declared ones: a save's stack -> ``checkpoint``, anything else -> ``other_phases``.
The verifier tells the arbiter link's TrainerSays of each (its ``learned``: cmd/run.py
wires it), whose seconds ride in the ProgressSummary to the ledger."""

from __future__ import annotations

import asyncio

import pytest

from ftagent.agent.reporter import TrainerSays
from ftagent.arbiter.ledger import Ledger
from ftagent.detect.liveness import Frame
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import fill_resume_and_phases
from tests.unit.test_liveness import MAIN, Rig, busy_eval, proc, thread


def save_stacks(n: int = 5) -> list[list[object]]:
    """A trainer busy writing a checkpoint it never declared (its stack moves, CPU runs)."""
    frames = [(Frame("write_record", "serialization.py", 600 + i % 3),
               Frame("save_checkpoint", "train.py", 250), *MAIN) for i in range(n)]
    return [[proc(0, i * 0.4, [thread(f)])] for i, f in enumerate(frames)]


def learned_by_the_agent(stacks: list[list[object]]) -> tuple[float, float, list[str]]:
    """A real Verifier (tests/unit/test_liveness.Rig: injected clock, scripted stacks)
    through an undeclared phase; what its TrainerSays holds once steps resume."""
    says = TrainerSays()

    async def go() -> list[str]:
        r = Rig(stacks)  # type: ignore[arg-type]
        r.v.learned = says.learned  # as cmd/run.py wires it with --arbiter
        assert await r.run_until(r.now[0] + 8.0) == []  # alive: no fault
        r.progress(0.2)
        return r.kinds("phase")

    kinds = asyncio.run(go())
    ckpt, other = says.phase_seconds(0.0)
    return ckpt, other, kinds


def test_an_undeclared_evaluation_the_agent_learned_is_other_phase_time() -> None:
    ckpt, other, kinds = learned_by_the_agent(busy_eval())  # type: ignore[arg-type]
    assert kinds == ["undeclared"]
    assert ckpt == 0.0 and 8.0 <= other <= 8.5


def test_an_undeclared_save_the_agent_learned_is_checkpoint_time() -> None:
    ckpt, other, kinds = learned_by_the_agent(save_stacks())
    assert kinds == ["undeclared"]
    assert other == 0.0 and 8.0 <= ckpt <= 8.5


def test_learned_phase_time_reaches_the_ledger_through_the_summary() -> None:
    """The agent's TrainerSays, its summary's fields, the ledger: 3 s learned in a save and
    2 s in an eval move out of 20 s of training."""
    says = TrainerSays()
    says.learned(3.0, "save_checkpoint (train.py:250)")
    says.learned(2.0, "evaluate (train.py:88)")
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        says.learned(bad, "evaluate")
    p = pb.ProgressSummary(step=20)
    fill_resume_and_phases(p, says.resumed, *says.phase_seconds(0.0))
    led = Ledger(0.0, world_size=1)
    for s in range(1, 21):
        led.progress(0, 0, s, 10.0 + s)
    led.phases(0, 0, (p.checkpoint_seconds, p.other_phase_seconds), 30.0)
    b = led.breakdown(30.0)
    assert b.seconds["checkpoint"] == pytest.approx(3.0)
    assert b.seconds["other_phases"] == pytest.approx(2.0)
    assert b.seconds["productive"] == pytest.approx(19.0 - 5.0)
    says.reset()  # a new generation's trainer has learned nothing yet
    assert says.phase_seconds(0.0) == (0.0, 0.0)
