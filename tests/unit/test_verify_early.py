"""Detection at the budget: the verification's samples are taken while the budget runs down
(``detect/hang.verify_plan``, pure), so a hang is declared verified when the budget ends,
with the flight-recorder dump of the same window; steps resuming drop the samples unseen.

The flow runs the real Verifier and detector on an injected clock, with a sampler that
replays samples the agent took of real trainers (tests/fixtures/liveness) at the test's
clock; no sleeps."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ftagent.agent.hang_watch import HangWatch
from ftagent.agent.verify import Verifier
from ftagent.config import HangConfig
from ftagent.detect.hang import HangDetector, Sample, verify_plan
from ftagent.detect.liveness import Snapshot, snapshot_from_json
from ftagent.metrics import AgentMetrics
from ftagent.model import FaultKind, Progress, TrainerStart

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "liveness"


# --------------------------------------------------------------------------- the plan (pure)


def test_the_plan_ends_at_the_deadline_cheap_first_stacks_last() -> None:
    plan = verify_plan(deadline=10.0, budget=3.0, window=2.0, samples=5, start_fraction=0.33)
    assert plan == (Sample(8.0, False), Sample(8.5, False), Sample(9.0, True),
                    Sample(9.5, True), Sample(10.0, True))


def test_a_short_budget_keeps_the_window_and_ends_it_past_the_deadline() -> None:
    plan = verify_plan(deadline=10.0, budget=3.0, window=2.0, samples=5, start_fraction=0.5)
    assert [s.at for s in plan] == pytest.approx([8.5, 9.0, 9.5, 10.0, 10.5])
    assert [s.stacks for s in plan] == [False, True, True, True, True]
    two = verify_plan(deadline=10.0, budget=60.0, window=2.0, samples=2, start_fraction=0.33)
    assert two == (Sample(8.0, True), Sample(10.0, True))  # motion needs two stacks
    long = verify_plan(deadline=100.0, budget=60.0, window=2.0, samples=5, start_fraction=0.33)
    assert long[0].at == 98.0 and long[-1].at == 100.0  # a long budget: the window's length


def test_verify_from_one_samples_after_the_deadline_as_before() -> None:
    plan = verify_plan(deadline=10.0, budget=5.0, window=2.0, samples=5, start_fraction=1.0)
    assert plan == tuple(Sample(10.0 + i * 0.5, True) for i in range(5))
    assert verify_plan(10.0, 0.0, 2.0, 5, 0.33)[0] == Sample(10.0, True)  # no budget
    assert len(verify_plan(10.0, 5.0, 2.0, 1, 0.33)) == 2  # never fewer than two


# --------------------------------------------------------------------------- the flow


def recorded(name: str) -> list[Snapshot]:
    return [snapshot_from_json(d) for d in json.loads((FIXTURES / f"{name}.json").read_text())]


class Replay:
    """Real samples replayed in order, stamped with the test clock; ``stacks=False`` strips
    the threads (what a cheap sample reads: CPU, I/O, states)."""

    def __init__(self, clock: list[float], name: str) -> None:
        self.clock = clock
        self.snaps = recorded(name)
        self.calls: list[tuple[float, bool]] = []
        self.given: list[Any] = []  # the pids each sample was told (None: the tree now)

    async def sample(self, stacks: bool = True, pids: Any = None
                     ) -> tuple[Snapshot, list[dict[str, Any]]]:
        src = self.snaps[len(self.calls) % len(self.snaps)]
        self.calls.append((self.clock[0], stacks))
        self.given.append(pids)
        base = src.processes[0].ts if src.processes else 0.0
        procs = tuple(dataclasses.replace(
            p, ts=self.clock[0] + (p.ts - base),
            threads=p.threads if stacks else None) for p in src.processes)
        return Snapshot(self.clock[0], procs, src.gpu, src.errors), [
            {"pid": p.pid, "stack": "..." if stacks else None} for p in procs]


class Rig:
    """A detector in a learned steady state (0.2 s steps, the default floor), the Verifier,
    ticked like HangWatch does: ``prepare`` then the detector's tick."""

    def __init__(self, name: str, **cfg: Any) -> None:
        self.cfg = HangConfig(**cfg)
        self.now = [0.0]
        self.det = HangDetector(self.cfg)
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.sampler = Replay(self.now, name)
        self.raised: list[Any] = []
        self.v = Verifier(self.det, self.cfg, self.sampler, clock=lambda: self.now[0],
                          sleep=self._sleep, record=self._record, emit=self._emit)
        self.dumps: list[float] = []
        self.v.window_dump = self._dump
        self.step = 0
        self.feed(TrainerStart(pid=1, attempt=0, ts=0.0))
        for _ in range(20):
            self.progress(0.2)

    async def _dump(self) -> dict[str, Any]:
        self.dumps.append(self.now[0])
        return {"summaries": [{"rank": 0}], "errors": [], "seconds": 0.1}

    async def _emit(self, fault: Any) -> None:
        self.raised.append((self.now[0], fault))

    async def _sleep(self, seconds: float) -> None:
        until = self.now[0] + seconds
        while self.now[0] < until:
            await asyncio.sleep(0)

    def _record(self, event: str, kind: str, message: str, **fields: Any) -> None:
        self.events.append((event, kind, fields))

    def feed(self, obs: Any) -> None:
        self.v.observe(obs, self.det.observe(obs))

    def progress(self, dt: float) -> None:
        self.now[0] += dt
        self.step += 1
        self.feed(Progress(step=self.step, source="log", ts=self.now[0]))

    async def run_until(self, t: float, dt: float = 0.05, tick: float = 0.5,
                        each: Callable[[], None] | None = None) -> None:
        """The clock in ``dt`` steps; the agent's tick every ``tick`` seconds; ``each``
        after every step (a scrape)."""
        next_tick = self.now[0] + tick
        while self.now[0] < t:
            self.now[0] = round(self.now[0] + dt, 9)
            if self.now[0] >= next_tick:
                next_tick += tick
                self.v.prepare(self.now[0])
                assert self.v.on_faults(self.det.tick(self.now[0]), self.now[0]) == []
            for _ in range(20):
                await asyncio.sleep(0)
            if each is not None:
                each()

    def kinds(self, event: str) -> list[str]:
        return [k for e, k, _ in self.events if e == event]


def test_a_hang_is_declared_verified_when_the_budget_ends() -> None:
    """On the old code the samples began when the budget ran out: declared at budget +
    window (5 + 2 s with the old floor); here at the budget, with the dump of the window."""
    async def go() -> None:
        r = Rig("collective_victim")
        start = r.now[0]
        budget = r.det.step_budget()
        assert budget == HangConfig().hang_timeout_min == 3.0
        await r.run_until(start + budget + 1.0)
        ((at, f),) = r.raised
        assert f.kind is FaultKind.HANG and f.evidence["verdict"] == "hung"
        assert budget < at - start <= budget + 0.1  # not a window later, not a tick later
        assert r.kinds("verify") == ["hung"]
        plan = [(round(t - start, 2), s) for t, s in r.sampler.calls]
        assert plan[0][0] >= budget - 2.0 - 1e-9 and plan[-1][0] <= budget + 0.05
        assert [s for _, s in plan] == [False, False, True, True, True]
        assert f.evidence["verification"]["samples"] == 5
        # the tree listed once, by the window's first sample: the others sample its pids
        first = [p.pid for p in r.sampler.snaps[0].processes]
        assert r.sampler.given == [None] + [first] * 4
        assert len(r.dumps) == 1 and r.dumps[0] - start < budget  # in the window
        # the agent's evidence hook (use_flight_recorder) takes it for the fault, once
        got = await r.v.window_dump_result()
        assert got is not None and got["summaries"] == [{"rank": 0}]
        assert await r.v.window_dump_result() is None

    asyncio.run(go())


def test_steps_resuming_drop_the_early_samples_at_no_cost() -> None:
    async def go() -> None:
        r = Rig("collective_victim")
        start = r.now[0]
        await r.run_until(start + 2.6)  # samples taken, stacks and the dump begun
        assert r.sampler.calls and any(s for _, s in r.sampler.calls) and r.dumps
        r.progress(0.0)
        assert await r.v.window_dump_result() is None  # dropped with the samples
        calls = len(r.sampler.calls)
        await r.run_until(r.now[0] + 1.0)  # within the new budget: nothing more
        assert len(r.sampler.calls) == calls
        assert r.raised == [] and r.events == []  # nothing written, nothing learned

    asyncio.run(go())


def test_an_alive_stall_is_deferred_and_its_next_budget_sampled_early_too() -> None:
    async def go() -> None:
        r = Rig("eval_busy")
        start = r.now[0]
        await r.run_until(start + 3.2)
        assert r.kinds("verify") == ["alive"] and r.raised == [] and r.dumps
        deadline = r.det.deadline()
        assert deadline is not None and deadline > r.now[0]
        calls = len(r.sampler.calls)
        await r.run_until(deadline + 0.2)
        assert r.kinds("verify") == ["alive", "alive"] and r.raised == []
        assert all(t <= deadline + 0.05 for t, _ in r.sampler.calls[calls:])
        r.progress(0.1)
        assert r.kinds("phase") == ["undeclared"]

    asyncio.run(go())


def test_verify_from_one_is_the_old_behaviour_a_window_after_the_budget() -> None:
    async def go() -> None:
        r = Rig("collective_victim", hang_verify_from=1.0, hang_timeout_min=5.0)
        start = r.now[0]
        await r.run_until(start + 9.0)
        ((at, f),) = r.raised
        assert 7.0 <= at - start <= 7.6 and f.evidence["verdict"] == "hung"
        assert all(s for _, s in r.sampler.calls)

    asyncio.run(go())


def test_the_arbiters_question_is_answered_from_the_window_without_a_new_one() -> None:
    async def go() -> None:
        r = Rig("collective_victim")
        start = r.now[0]
        await r.run_until(start + 2.8)
        calls = len(r.sampler.calls)
        out = await r.v.stacks_for_arbiter([1])  # no clock advance needed: one sample
        assert len(r.sampler.calls) == calls + 1
        assert out["liveness"]["state"] == "hung" and not out["liveness"]["declared"]

    asyncio.run(go())


def test_a_snapshot_asked_while_one_is_under_way_shares_its_answer(tmp_path: Path) -> None:
    """The window's dump and the arbiter's DUMP_STACKS may overlap: one trigger, one answer
    (two would remove each other's answers and time out)."""
    from ftagent.agent.flight_recorder import FlightRecorder

    async def go() -> None:
        fr = FlightRecorder(str(tmp_path), {})
        triggered: list[int] = []
        trigger = fr.trigger
        fr.trigger = lambda: (triggered.append(1), trigger())[1]  # type: ignore[method-assign]
        a, b = await asyncio.gather(fr.snapshot(), fr.snapshot())
        assert triggered == [1] and a == b
        await fr.snapshot()  # none under way: a new one
        assert triggered == [1, 1]

    asyncio.run(go())


# --------------------------------------------------------------------------- the gauges


def scraped(r: Rig) -> tuple[Callable[[], None], list[tuple[float, float, float]]]:
    """The agent's hang gauges on a real registry, read after every clock step:
    (time, ftagent_hang, ftagent_hang_suspected)."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    m = AgentMetrics(reg, {"job_name": "j", "namespace": "", "pod": "p", "node": "n",
                           "rank": "0"})
    HangWatch(r.det, m, clock=lambda: r.now[0], verifier=r.v)
    seen: list[tuple[float, float, float]] = []

    def read() -> None:
        labels = {"job_name": "j", "namespace": "", "pod": "p", "node": "n", "rank": "0"}
        seen.append((r.now[0], reg.get_sample_value("ftagent_hang", labels) or 0.0,
                     reg.get_sample_value("ftagent_hang_suspected", labels) or 0.0))
    return read, seen


@pytest.mark.parametrize("verify_from", [0.33, 1.0])
def test_ftagent_hang_is_never_1_for_a_suspicion_verified_alive(verify_from: float) -> None:
    """The old gauge was the detector's ``hung``: 1 from the budget running out until the
    verdict (the whole 2 s window with --hang-verify-from 1, a sample's time at least by
    default), so the ``for: 0m`` FtagentTrainingHung alert could fire on an evaluation
    that was then verified alive. Now that is ftagent_hang_suspected."""
    async def go() -> None:
        r = Rig("eval_busy", hang_verify_from=verify_from)
        read, seen = scraped(r)
        start = r.now[0]
        await r.run_until(start + 12.0, each=read)
        assert "alive" in r.kinds("verify") and r.raised == []
        assert all(hang == 0.0 for _, hang, _ in seen)
        if verify_from >= 1:  # the window after the budget: suspected all through it
            suspected = [t - start for t, _, s in seen if s == 1.0]
            assert suspected and max(suspected) - min(suspected) >= 1.5
        r.progress(0.1)
        read()
        assert seen[-1][1:] == (0.0, 0.0)

    asyncio.run(go())


def test_ftagent_hang_is_1_once_the_hang_is_declared() -> None:
    async def go() -> None:
        r = Rig("collective_victim", hang_verify_from=1.0)
        read, seen = scraped(r)
        start = r.now[0]
        await r.run_until(start + 9.0, each=read)
        ((at, f),) = r.raised
        assert f.evidence["verdict"] == "hung"
        before = [(h, s) for t, h, s in seen if t < at]
        after = [(h, s) for t, h, s in seen if t >= at]
        assert all(h == 0.0 for h, _ in before) and (0.0, 1.0) in before
        assert after and all(x == (1.0, 0.0) for x in after)

    asyncio.run(go())


def test_without_verification_the_budget_is_the_declaration() -> None:
    async def go() -> None:
        r = Rig("collective_victim", hang_verify_window=0.0)
        read, seen = scraped(r)
        r.now[0] += 3.1
        (f,) = r.v.on_faults(r.det.tick(r.now[0]), r.now[0])  # raised as it is
        read()
        assert f.kind is FaultKind.HANG and seen[-1][1:] == (1.0, 0.0)

    asyncio.run(go())


# --------------------------------------------------------------------------- the mark


@pytest.mark.parametrize(("name", "state"), [("collective_victim", "hung"),
                                             ("eval_busy", "alive")])
def test_asked_before_its_own_window_a_rank_answers_in_a_sample_period(
        name: str, state: str) -> None:
    """A peer's budget ran out first (3 s) and the arbiter asks this rank (budget 5 s: its
    window begins at 3 s) for its stacks. The old code sampled a window from scratch, 2 s,
    and the restart came 2 s later (the corpus's 5.1 s hangs); now one cheap sample a
    second into the stall (the mark) and two stacked samples a sample period apart judge
    it: 0.5 s, the same verdict (a busy rank is still alive)."""
    async def go() -> None:
        r = Rig(name, hang_timeout_min=5.0)
        r.v.ask_arbiter = lambda: True
        start = r.now[0]
        await r.run_until(start + 2.9)
        assert [(round(t - start, 1), s) for t, s in r.sampler.calls] == [(1.0, False)]
        asked = r.now[0]
        task = asyncio.get_running_loop().create_task(r.v.stacks_for_arbiter([1]))
        while not task.done():
            r.now[0] = round(r.now[0] + 0.05, 9)
            for _ in range(20):
                await asyncio.sleep(0)
        out = task.result()
        assert r.now[0] - asked <= 0.6, "a window from scratch takes 2 s"
        assert [s for _, s in r.sampler.calls].count(True) == 2  # (and the window's cheap)
        assert out["liveness"]["state"] == state
        assert out["liveness"]["window_seconds"] >= 1.5  # CPU since the mark

    asyncio.run(go())


def test_healthy_steps_take_no_mark() -> None:
    async def go() -> None:
        r = Rig("eval_busy", hang_timeout_min=5.0)
        r.v.ask_arbiter = lambda: True
        for _ in range(30):
            r.progress(0.2)
            await r.run_until(r.now[0] + 0.0001)
        await r.run_until(r.now[0] + 0.9)  # a stall under a second: nothing sampled
        assert r.sampler.calls == [] and r.v._mark is None

    asyncio.run(go())


def test_a_sample_of_given_pids_does_not_list_the_tree() -> None:
    """``TreeSampler.sample(pids=...)``: the window's processes, no tree read (the early
    sampling read the whole tree per sample: 5 per window, supervisor.tree on the hang
    walk)."""
    import os

    from ftagent.agent.verify import TreeSampler

    listed: list[int] = []

    def tree() -> list[Any]:
        listed.append(1)
        return []

    async def go() -> Any:
        s = TreeSampler(tree=tree, py_spy="/nonexistent/py-spy")
        return await s.sample(stacks=False, pids=[os.getpid()])

    snap, _ = asyncio.run(go())
    assert listed == [] and [p.pid for p in snap.processes] == [os.getpid()]


def test_nothing_learned_asks_no_book(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first stall (nothing learned yet): no stacks read for the phase book, no book
    asked for a match or a spin budget (2-3 calls into detect/liveness per verdict on the
    hang walk); the verdict is the same."""
    from ftagent.agent import verify as verify_module
    from ftagent.detect.liveness import PhaseBook

    asked: list[str] = []
    monkeypatch.setattr(verify_module, "stacks_of",
                        lambda snap: asked.append("stacks_of") or [])
    monkeypatch.setattr(PhaseBook, "match", lambda self, st: asked.append("match"))
    monkeypatch.setattr(PhaseBook, "at", lambda self, place: asked.append("at"))

    async def go() -> Any:
        r = Rig("collective_victim")
        await r.run_until(r.now[0] + r.det.step_budget() + 1.0)
        return r.raised

    ((_, f),) = asyncio.run(go())
    assert f.evidence["verdict"] == "hung" and asked == []
