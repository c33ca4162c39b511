"""One capture of stacks and flight recorder per verification, shared by the agent and the
arbiter (issue 35): the verification's own samples (``Replay``: stacks recorded from real
trainers) and its one flight-recorder dump serve the hang fault's evidence (the agent's
evidence hook, wrapped by ``flight_recorder_parts``) and the arbiter's DUMP_STACKS answer
(the rank's ``RankHooks.stacks``, wrapped the same way). Counted, not assumed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from ftagent.agent.flight_recorder import flight_recorder_parts
from ftagent.agent.hang_watch import HangWatch
from ftagent.agent.worker_evidence import evidence_hook
from ftagent.agent.worker_parts import WorkerParts
from ftagent.config import HangConfig
from ftagent.model import Severity
from tests.unit.test_verify_early import Rig


class Recorder:
    """The flight recorder's surface flight_recorder_parts uses; counts its snapshots."""

    dir = "/nonexistent/fr"

    def __init__(self) -> None:
        self.snapshots = 0

    async def snapshot(self) -> dict[str, Any]:
        self.snapshots += 1
        return {"summaries": [{"rank": 0, "n": self.snapshots}], "errors": []}

    def begin_attempt(self, attempt: int) -> None:
        pass


def wired(rig: Rig) -> tuple[Recorder, WorkerParts, Any]:
    """The verifier of ``rig`` wired as cmd/run.py wires it: the recorder's snapshot is its
    window dump, the evidence hook and the rank's DUMP_STACKS answer (seat.py
    ``RankHooks.stacks``) wrapped by ``flight_recorder_parts``."""
    rec = Recorder()
    rig.v.window_dump = rec.snapshot
    worker = SimpleNamespace(environ={}, restarts=0, tree_pids=lambda: [1])
    parts = WorkerParts(detectors=(HangWatch(rig.det, verifier=rig.v),),
                        evidence=evidence_hook(2.0, lambda: [])).with_(
        stacks=lambda: rig.v.stacks_for_arbiter())
    cfg = SimpleNamespace(hang=HangConfig())
    wrapped = flight_recorder_parts(worker, cfg, "/nonexistent", parts, rec)
    assert wrapped.hooks.stacks is not None
    return rec, wrapped, SimpleNamespace(stack_capture=wrapped.hooks.stacks)


def test_a_declared_hang_is_captured_once_for_its_fault_and_the_arbiter() -> None:
    async def go() -> None:
        r = Rig("collective_victim")  # still in the all-reduce; no arbiter: declared (H1)
        rec, parts, session = wired(r)
        await r.run_until(r.now[0] + r.det.step_budget() + 1.0)
        ((_, fault),) = r.raised
        assert fault.evidence["rule"] == "H1"
        samples = len(r.sampler.calls)
        assert parts.evidence is not None
        listed: list[int] = []  # the verified fault carries its stacks: no tree listed
        out = await parts.evidence(fault, lambda: listed.append(1) or [1])
        assert listed == []
        answer = await session.stack_capture()
        assert rec.snapshots == 1, rec.snapshots  # one dump: the window's
        assert len(r.sampler.calls) == samples  # no stacks taken again
        assert out.evidence["flight_recorder"] == answer["flight_recorder"]
        assert answer["processes"] == fault.evidence["processes"]
        assert answer["liveness"]["declared"] is True

    asyncio.run(go())


def test_a_rank_asking_the_arbiter_is_captured_once_for_its_question_and_the_answer() -> None:
    async def go() -> None:
        r = Rig("collective_victim")
        r.v.ask_arbiter = lambda: True  # an arbiter is connected: row C1 asks it
        rec, parts, session = wired(r)
        await r.run_until(r.now[0] + r.det.step_budget() + 1.0)
        ((_, asked),) = r.raised
        assert asked.severity is Severity.WARNING and asked.evidence["waiting_in_collective"]
        samples = len(r.sampler.calls)
        # the arbiter's DUMP_STACKS may come before or after the question's evidence
        answer = await session.stack_capture()
        assert parts.evidence is not None
        out = await parts.evidence(asked, lambda: [1])
        assert rec.snapshots == 1, rec.snapshots
        assert len(r.sampler.calls) == samples, r.sampler.calls[samples:]
        assert out.evidence["flight_recorder"] == answer["flight_recorder"]
        assert answer["liveness"]["declared"] is False
        assert answer["liveness"]["stall"]["rule"] == "C1"

    asyncio.run(go())


def test_a_rank_not_verifying_samples_for_the_arbiter_once() -> None:
    async def go() -> None:
        r = Rig("collective_victim")
        rec, _, session = wired(r)
        answer = asyncio.ensure_future(session.stack_capture())
        for _ in range(200):  # its window: the rank trains on, the samples come
            if answer.done():
                break
            r.progress(0.2)
            for _ in range(20):
                await asyncio.sleep(0)
        got = await answer
        assert rec.snapshots == 1 and got["flight_recorder"]["summaries"][0]["n"] == 1
        n = HangConfig().hang_verify_samples
        assert len(r.sampler.calls) == max(2, n)  # one window of samples, once

    asyncio.run(go())


def test_a_capture_that_fails_never_loses_the_hang_fault() -> None:
    """``Worker.raise_fault`` awaits the evidence hook itself (no guard function between):
    a hook that raises is logged and the fault goes on as it was, recorded and decided."""
    import os

    from ftagent.agent.worker import Worker, WorkerSpec
    from ftagent.cmd.run import parse
    from ftagent.model import Fault, FaultKind

    async def go() -> None:
        w = Worker(WorkerSpec(parse(["--max-restarts", "0", "--", "true"], {})))
        calls: list[Fault] = []

        async def broken(fault: Fault, pids: Any) -> Fault:
            raise RuntimeError("py-spy broke")

        w.evidence = broken
        alive = asyncio.get_running_loop().create_future()
        w.trainer = SimpleNamespace(pid=os.getpid(), exited=alive)  # type: ignore[assignment]
        w.decider = SimpleNamespace(decide=lambda seat, f: calls.append(f))  # type: ignore[assignment]
        fault = Fault(FaultKind.HANG, "no step progress for 2.0s", evidence={"verdict": "hung"})
        await w.raise_fault(fault)
        assert calls == [fault]

    asyncio.run(go())
