"""Deadline-driven detection (issue 36, the agent's hang path): the hang watch says when it
next has something to do (``next_tick``: the budget's end, the verifier's mark and early
sampling, the dead-still watch's next look), the watch loop ticks a detector only then, and
the worker's ticker sleeps until the earliest such time or a wake instead of ticking every
detector every 0.5 s. Detection must not get later: the same samples, the same verdict at
the budget's end, with far fewer ticks.

On the old code none of this exists (no ``next_tick``, no ``WatchLoop.due``, no
``HangParts.wake``): every detector was ticked every 0.5 s, 9 calls a tick on the hang path
(bench/fault_walk.py --agent). Real detector and Verifier on an injected clock, real
samples replayed (tests/fixtures/liveness); no sleeps."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from ftagent.agent.hang_parts import HangParts
from ftagent.agent.hang_watch import HangWatch
from ftagent.agent.verify import LEAD, Verifier
from ftagent.config import HangConfig
from ftagent.detect.hang import HangDetector
from ftagent.model import Fault, FaultKind, Observation, Progress, TrainerStart
from ftagent.watch.loop import WatchLoop
from tests.unit.test_verify_early import Replay, Rig


class Timed:
    """A detector that says its next due time; counts its ticks."""

    def __init__(self, due: float | None) -> None:
        self.due = due
        self.seen: list[float] = []

    def observe(self, obs: Observation) -> list[Fault]:
        return []

    def tick(self, now: float) -> list[Fault]:
        self.seen.append(now)
        return []

    def next_tick(self, now: float) -> float | None:
        return self.due


class Quiet(Timed):
    ticks = False  # its tick never does anything

    def tick(self, now: float) -> list[Fault]:
        raise AssertionError("a detector with ticks = False is never ticked")


class Polled(Timed):
    next_tick = None  # type: ignore[assignment]  # no deadline of its own: every tick


class One:
    def __init__(self, *dets: Any) -> None:
        self.dets = dets
        self.name = "one"

    def sources(self) -> list[Any]:
        return []

    def detectors(self) -> list[Any]:
        return list(self.dets)

    def collector(self, labels: Any) -> None:
        return None


def test_the_loop_ticks_a_deadline_driven_detector_only_when_due() -> None:
    timed, quiet = Timed(10.0), Quiet(None)
    loop = WatchLoop([One(timed, quiet)], lambda f: None, tick_seconds=None)
    assert not loop.polled  # nobody needs the grid
    loop.tick(1.0)  # never asked yet: ticked once, then its due time is known
    assert timed.seen == [1.0] and loop.due == 10.0
    for now in (2.0, 5.0, 9.999):
        loop.tick(now)  # nothing due: nothing called
    assert timed.seen == [1.0]
    loop.tick(10.0)
    assert timed.seen == [1.0, 10.0]
    timed.due = None  # nothing until an observation or a wake
    loop.refresh(11.0)
    assert loop.due == math.inf
    loop.tick(1e9)
    assert timed.seen == [1.0, 10.0]


def test_an_observation_that_moves_the_due_time_earlier_wakes_the_ticker() -> None:
    timed = Timed(50.0)
    wake = asyncio.Event()
    loop = WatchLoop([One(timed)], lambda f: None, tick_seconds=None, wake=wake)
    loop.refresh(0.0)
    loop.emit(Progress(step=1, source="log", ts=1.0))  # same due time: no wake
    assert loop.due == 50.0 and not wake.is_set()
    timed.due = 20.0
    loop.emit(Progress(step=2, source="log", ts=2.0))
    assert loop.due == 20.0 and wake.is_set()


def test_a_detector_without_a_deadline_keeps_the_grid() -> None:
    polled = Polled(None)
    loop = WatchLoop([One(polled, Timed(None))], lambda f: None, tick_seconds=None)
    assert loop.polled
    loop.tick(1.0)
    loop.tick(1.5)
    assert polled.seen == [1.0, 1.5]


async def _deadline_driven(r: Rig, until: float, dt: float = 0.05,
                           dues: list[float | None] | None = None) -> list[float]:
    """The clock in ``dt`` steps; the hang watch ticked (prepare, then the detector's tick,
    as HangWatch does) only when ``next_tick`` says, as the agent's ticker does now.
    Returns the tick times; ``dues`` gets each next due time read while the early
    sampling runs."""
    ticks: list[float] = []
    due = r.v.next_tick(r.now[0])
    while r.now[0] < until:
        r.now[0] = round(r.now[0] + dt, 9)
        if due is not None and r.now[0] > due:
            ticks.append(r.now[0])
            r.v.prepare(r.now[0])
            assert r.v.on_faults(r.det.tick(r.now[0]), r.now[0]) == []
        for _ in range(20):
            await asyncio.sleep(0)
        due = r.v.next_tick(r.now[0])  # after a tick, an observation or a wake
        if dues is not None and r.v._early is not None:
            dues.append(due)
    return ticks


def test_a_hang_is_declared_at_the_budget_with_three_ticks_not_seven() -> None:
    """The same verdict at the same time as with a tick every 0.5 s
    (test_verify_early.py::test_a_hang_is_declared_verified_when_the_budget_ends): the
    same five samples (two cheap, three with stacks) ending at the deadline."""
    async def go() -> None:
        r = Rig("collective_victim")
        start = r.now[0]
        budget = r.det.step_budget()
        assert budget == 3.0
        first = r.v.next_tick(start)
        assert first is not None and first < start + budget  # the mark or the window
        ticks = await _deadline_driven(r, start + budget + 1.0)
        ((at, f),) = r.raised
        assert f.kind is FaultKind.HANG and f.evidence["verdict"] == "hung"
        assert budget < at - start <= budget + 0.1
        plan = [s for _, s in r.sampler.calls]
        assert plan == [False, False, True, True, True]
        assert len(r.dumps) == 1 and r.dumps[0] - start < budget
        # the window's start (LEAD before its first sample) and the budget's end; the
        # old ticker ticked every detector 8 times in these 4 s
        assert len(ticks) <= 3, ticks
        assert ticks[0] - start <= budget - r.cfg.hang_verify_window - LEAD + 0.1

    asyncio.run(go())


def test_healthy_steps_take_no_sample_and_tick_no_more_than_before() -> None:
    """With the 3 s floor and a 2 s window the early sampling begins (its task sleeping
    until the first sample) as soon as a step is seen, as the 0.5 s tick did it: one tick
    per step read at most, and no sample while steps keep coming."""
    async def go() -> None:
        r = Rig("collective_victim")
        ticks: list[float] = []
        for _ in range(5):
            r.progress(0.0)
            ticks += await _deadline_driven(r, r.now[0] + 0.2)
        assert len(ticks) <= 5 and r.sampler.calls == [] and r.raised == []

    asyncio.run(go())

    asyncio.run(go())


def test_an_alive_verdict_defers_the_budget_and_wakes_the_ticker() -> None:
    """A verdict "alive" moves the budget's end (``defer``) outside any observation: the
    ticker is told (HangParts.wake), and the next budget is sampled early too."""
    async def go() -> None:
        cfg = HangConfig()
        now = [0.0]
        det = HangDetector(cfg)
        woken: list[float] = []
        v = Verifier(det, cfg, Replay(now, "eval_busy"), HangParts(
            wake=lambda: woken.append(now[0])), clock=lambda: now[0],
            sleep=_sleeper(now), record=lambda *a, **k: None, emit=_ignore)
        watch = HangWatch(det, verifier=v)
        assert watch.next_tick == v.next_tick  # no hop through the hang watch
        r = _Driver(v, det, now)
        r.feed(TrainerStart(pid=1, attempt=0, ts=0.0))
        for i in range(20):
            now[0] += 0.2
            r.feed(Progress(step=i + 1, source="log", ts=now[0]))
        first = det.deadline()
        await _deadline_driven(r, now[0] + 3.3)  # type: ignore[arg-type]
        assert woken, "the deferred budget was not told to the ticker"
        second = det.deadline()
        assert first is not None and second is not None and second > first
        due = v.next_tick(now[0])
        assert due is not None and now[0] < due < second

    asyncio.run(go())


async def _ignore(fault: Fault) -> None:
    return None


def _sleeper(now: list[float]) -> Any:
    async def sleep(seconds: float) -> None:
        until = now[0] + seconds
        while now[0] < until:
            await asyncio.sleep(0)
    return sleep


class _Driver:
    """The parts of ``Rig`` that ``_deadline_driven`` uses, over a given verifier."""

    def __init__(self, v: Verifier, det: HangDetector, now: list[float]) -> None:
        self.v, self.det, self.now = v, det, now
        self.raised: list[Any] = []

    def feed(self, obs: Observation) -> None:
        self.v.observe(obs, self.det.observe(obs))


def test_a_declared_hang_wakes_the_ticker_for_nothing() -> None:
    """A verdict that declares the hang moves no due time (the budget ran out: nothing is
    due until an observation), so the end of its task wakes nobody; the old verifier woke
    the ticker from every verification task's done callback, for a look that found
    nothing (5 calls on the hang walk)."""
    async def go() -> None:
        cfg = HangConfig()
        now = [0.0]
        det = HangDetector(cfg)
        woken: list[float] = []
        raised: list[Fault] = []

        async def emit(fault: Fault) -> None:
            raised.append(fault)

        v = Verifier(det, cfg, Replay(now, "collective_victim"), HangParts(
            wake=lambda: woken.append(now[0])), clock=lambda: now[0],
            sleep=_sleeper(now), record=lambda *a, **k: None, emit=emit)
        r = _Driver(v, det, now)
        r.feed(TrainerStart(pid=1, attempt=0, ts=0.0))
        for i in range(20):
            now[0] += 0.2
            r.feed(Progress(step=i + 1, source="log", ts=now[0]))
        await _deadline_driven(r, now[0] + 4.0)  # type: ignore[arg-type]
        for _ in range(20):
            await asyncio.sleep(0)  # the emit task's turn
        assert [f.evidence["verdict"] for f in raised] == ["hung"]
        assert woken == []
        assert v.next_tick(now[0]) is None  # hung: nothing due before an observation

    asyncio.run(go())


def test_the_early_sampling_ticks_its_own_budget_end() -> None:
    """While the early sampling runs, the budget's end is its own (``_budget_out`` ticks
    the detector after the last sample): ``next_tick`` leaves the deadline out, and the
    hang is declared at the budget after one tick, the window's start. On the old code
    the ticker woke at the deadline too, ticked the detector, and handed the HANG to the
    task through ``_suspect`` (3 calls on the hang walk for a fault the task asks for)."""
    async def go() -> None:
        r = Rig("collective_victim")
        start = r.now[0]
        budget = r.det.step_budget()
        dues: list[float | None] = []
        ticks = await _deadline_driven(r, start + budget + 1.0, dues=dues)
        ((at, f),) = r.raised
        assert f.kind is FaultKind.HANG and f.evidence["verdict"] == "hung"
        assert budget < at - start <= budget + 0.1  # not later than with the tick
        assert [s for _, s in r.sampler.calls] == [False, False, True, True, True]
        assert len(ticks) == 1, ticks  # the window's start alone
        assert dues and all(d is None for d in dues), dues

    asyncio.run(go())


def test_a_broken_early_sampling_hands_the_budget_end_back_to_the_ticker() -> None:
    """If the early sampling breaks, the ticker is woken and ticks again (the budget's end
    is no longer left out: the sampling starts over, or the deadline is ticked), and the
    hang is still declared. Without the wake the ticker would sleep past the deadline
    that ``next_tick`` left to a task that is gone."""
    async def go() -> None:
        r = Rig("collective_victim")
        woken: list[float] = []
        r.v.wake = lambda: woken.append(r.now[0])
        start = r.now[0]
        budget = r.det.step_budget()
        real = r.sampler.sample
        broke: list[float] = []

        async def sample(stacks: bool = True, pids: Any = None) -> Any:
            if not broke:  # the window's first sample breaks (a bug, not a lost process)
                broke.append(r.now[0])
                raise RuntimeError("broken")
            return await real(stacks, pids)

        r.sampler.sample = sample  # type: ignore[method-assign]
        ticks = await _deadline_driven(r, start + budget + 3.0)
        assert broke and woken and woken[0] == broke[0]
        assert r.v._early is None
        assert any(t >= broke[0] for t in ticks)  # the ticker asked again
        ((_, f),) = r.raised
        assert f.kind is FaultKind.HANG

    asyncio.run(go())


def test_the_loop_reads_the_verifiers_next_due_time_as_a_fact() -> None:
    """The verifier keeps ``next_tick`` as a fact (``next_due``, published after each
    observation, tick and wake); the watch loop reads it through the hang watch's
    ``timing`` and never asks: the same hang at the same time. On the old code the loop
    called ``next_tick`` after every observation and tick (3 calls on the hang walk, one
    per step in training)."""
    async def go() -> None:
        r = Rig("collective_victim")
        woken: list[float] = []
        r.v.wake = lambda: woken.append(r.now[0])
        watch = HangWatch(r.det, verifier=r.v)
        assert watch.timing is r.v
        asked: list[float] = []

        def next_tick(now: float) -> float | None:  # what the loop would have asked
            asked.append(now)
            return r.v.next_tick(now)

        watch.next_tick = next_tick  # type: ignore[method-assign]
        loop = WatchLoop([One(watch)], lambda f: None, tick_seconds=None,
                         clock=lambda: r.now[0])
        budget = r.det.step_budget()
        for _ in range(3):  # steps through the loop: the detector and the verifier see them
            r.now[0] += 0.2
            r.step += 1
            loop.emit(Progress(step=r.step, source="log", ts=r.now[0]))
            assert loop.due == r.v.next_due == r.v.next_tick(r.now[0])
        start = r.now[0]
        while r.now[0] < start + budget + 1.0:
            r.now[0] = round(r.now[0] + 0.05, 9)
            if woken:  # the worker's ticker: a wake refreshes the due times
                woken.clear()
                loop.refresh(r.now[0])
            if loop.due <= r.now[0]:
                loop.tick(r.now[0])
                nd = r.v.next_due
                assert loop.due == (math.inf if nd is None else nd)
            for _ in range(20):
                await asyncio.sleep(0)
        ((at, f),) = r.raised
        assert f.kind is FaultKind.HANG and f.evidence["verdict"] == "hung"
        assert budget < at - start <= budget + 0.1
        assert asked == [], asked  # read, never asked

    asyncio.run(go())


def test_a_next_tick_that_breaks_is_ticked_every_time() -> None:
    """As the loop did with a ``next_tick`` that raised: logged, due at once."""
    r = Rig("collective_victim")

    def broken(now: float) -> float | None:
        raise RuntimeError("broken")

    r.v.next_tick = broken  # type: ignore[method-assign]
    r.v._publish(7.0)
    assert r.v.next_due == 7.0
