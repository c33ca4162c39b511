"""Stragglers: the rank whose compute is slower than the rest of the job, for long enough.

Pure (no I/O, time passed in), in the policy's shape: the registry hands each job's
latest per-rank timings (``RankTiming``, from the agents' ProgressSummary) to
``StragglerWatch.update`` with ``now``, and gets back the ``Straggler`` findings to record;
what the job then does is the policy's (``policy.decide_fault``, kind STRAGGLER).

Why compute time, not step time: in synchronous training (DDP, FSDP, any collective every
step) every rank finishes a step together, so every rank's step time and step rate are the
same; the slow rank is the one that *waits least* in collectives, because the others wait
for it there. A rank's own time per step -- step time minus the time it waits in
collectives -- is what differs: its compute plus its wait for data, split in the evidence
(a rank whose data loading is slow holds the job back as much as a slow GPU; a job whose
ranks all wait for data alike has no straggler)::

    rank 0  |==compute==|......wait in all_reduce......|   step 0.30 s, compute 0.10 s
    rank 1  |=========compute (slow GPU)=========|wait|    step 0.30 s, compute 0.28 s

A rank is *slow* when its speed (1 / own seconds per step) is below
``ratio`` (``--straggler-ratio``, 0.8) of the median of the other ranks' (so that in a
2-rank job the slow rank does not pull the median toward itself); a rank slow in every
assessment for ``window`` seconds (``--straggler-window``, 300) is named once, with its
node and the evidence; still slow for another window it is *persistent* (named again with
``persistent=True``: with ``--straggler-action replace`` the policy replaces it). A rank
that waits long in collectives but computes as fast as the others is a victim, never named.
Without a breakdown (no ``instrument()``, only log lines) compute is the whole step time,
which still names the slow rank of a job whose ranks do not synchronise every step.
Ranks that are hung, not running, or report nothing are left out (the hang detector's
business); a job with fewer than two timed ranks has no median and no straggler.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class StragglerAction(str, enum.Enum):
    """``--straggler-action``: what a persistent straggler leads to."""

    ALERT = "alert"  # record and alert; never restarts (the default)
    REPLACE = "replace"  # replace a persistent straggler's pod (spends a restart)


@dataclass(frozen=True)
class StragglerConfig:
    ratio: float = 0.8  # slow: compute speed below this fraction of the others' median
    window: float = 300.0  # seconds a rank must stay slow before it is named
    action: StragglerAction = StragglerAction.ALERT


@dataclass(frozen=True)
class RankTiming:
    """One rank's latest means per step (seconds), as its agent last summarised them."""

    rank: int
    node: str = ""
    step_seconds: float = 0.0  # 0: not measured
    collective_seconds: float = 0.0
    data_seconds: float = 0.0

    @property
    def own_seconds(self) -> float:
        """Step time not spent waiting for peers in collectives: the rank's own work."""
        return max(0.0, self.step_seconds - self.collective_seconds)

    @property
    def compute_seconds(self) -> float:
        """Own time not spent waiting for the next batch."""
        return max(0.0, self.own_seconds - self.data_seconds)


@dataclass(frozen=True)
class Straggler:
    """A finding: ``rank`` has been slow in compute since ``since`` (wall seconds)."""

    rank: int
    node: str
    since: float
    persistent: bool
    message: str
    evidence: dict[str, Any]


@dataclass
class StragglerWatch:
    """One job's straggler state: since when each rank is slow, who was named."""

    cfg: StragglerConfig = field(default_factory=StragglerConfig)
    slow_since: dict[int, float] = field(default_factory=dict)
    named: dict[int, bool] = field(default_factory=dict)  # rank -> named persistent yet

    @property
    def current(self) -> list[int]:
        """Ranks named a straggler and still slow (for status and the exporter)."""
        return sorted(self.named)

    def reset(self) -> None:
        """A new generation: timings of the previous trainers say nothing of the new ones."""
        self.slow_since.clear()
        self.named.clear()

    def update(self, timings: Iterable[RankTiming], now: float) -> list[Straggler]:
        """Assess ``timings`` at ``now``; return the ranks newly named (or now persistent)."""
        timed = {t.rank: t for t in timings if t.step_seconds > 0}
        slow = assess(timed, self.cfg.ratio)
        for rank in list(self.slow_since):
            if rank not in slow:  # recovered, or no longer reporting: starts over
                del self.slow_since[rank]
                self.named.pop(rank, None)
        found: list[Straggler] = []
        for rank, ev in sorted(slow.items()):
            since = self.slow_since.setdefault(rank, now)
            slow_for = now - since
            persistent = self.named.get(rank)
            if persistent is None and slow_for >= self.cfg.window:
                self.named[rank] = False
                found.append(_finding(timed[rank], since, slow_for, ev, persistent=False))
            elif persistent is False and slow_for >= 2 * self.cfg.window:
                self.named[rank] = True
                found.append(_finding(timed[rank], since, slow_for, ev, persistent=True))
        return found


def slowdown(timed: Mapping[int, RankTiming], ratio: float) -> float:
    """The share of the job's step time spent waiting on a slow rank right now: the
    slowest rank's own seconds per step minus the median of the others', over the step
    time, when that rank is slow by ``assess``'s measure (else 0: jitter is not a
    straggler). In [0, 1); 0 with fewer than two timed ranks. For the goodput ledger.

    0 without a breakdown (no rank measured its waits in collectives or for data: no
    ``instrument()``): then own time is the whole step time, and in synchronous training
    every rank's step time is the same steps' time, so the ranks' means differ only by
    which steps each covered (its last 64 when its summary was sent), not by a slow rank;
    on a loaded machine that difference booked 35.6 s of a ten-minute bench as waiting
    on a straggler where no rank was one (docs/goodput.md: no straggler share without
    step timings). ``assess`` still names a slow rank from step time alone (a job whose
    ranks do not synchronise every step)."""
    timed = {r: t for r, t in timed.items() if t.step_seconds > 0}
    if not any(t.collective_seconds > 0 or t.data_seconds > 0 for t in timed.values()):
        return 0.0
    slow = assess(timed, ratio)
    if not slow:
        return 0.0
    worst = max(slow, key=lambda r: timed[r].own_seconds)
    others = [t.own_seconds for r, t in timed.items() if r != worst]
    step = statistics.median(t.step_seconds for t in timed.values())
    waited = timed[worst].own_seconds - statistics.median(others)
    return min(max(0.0, waited / step), 0.99) if step > 0 else 0.0


def assess(timed: Mapping[int, RankTiming], ratio: float) -> dict[int, dict[str, Any]]:
    """The ranks slow in compute right now, each with its evidence (no memory, no clock).

    Each rank's own seconds per step against the median of the other ranks'; slow when
    ``other_median / own < ratio`` (its speed is below ``ratio`` of theirs).
    """
    if len(timed) < 2:
        return {}
    out: dict[int, dict[str, Any]] = {}
    # Each median of "the other ranks" is read from the job's values sorted once, with
    # the rank's own value left out (``_median_without``: statistics.median's own
    # arithmetic, so the same floats): O(n log n) for the job, where a median of the
    # others per rank was O(n^2 log n) -- and ``slowdown`` runs this on every summary of
    # an instrumented job (1,024 ranks: 72 ms a summary).
    owns = sorted(t.own_seconds for t in timed.values())
    by: dict[str, list[float]] = {}

    def of_others(field: str, mine: float) -> float:
        got = by.get(field)
        if got is None:
            got = by[field] = sorted(getattr(o, field) for o in timed.values())
        return _median_without(got, mine)

    for rank, t in timed.items():
        own = t.own_seconds
        med_own = _median_without(owns, own)
        if own <= 0 or med_own <= 0:
            continue
        speed = med_own / own
        if speed >= ratio:
            continue
        med_compute = of_others("compute_seconds", t.compute_seconds)
        med_step = of_others("step_seconds", t.step_seconds)
        med_wait = of_others("collective_seconds", t.collective_seconds)
        med_data = of_others("data_seconds", t.data_seconds)
        out[rank] = {
            "speed_vs_median": round(speed, 3),
            "own_seconds": round(own, 6), "median_own_seconds": round(med_own, 6),
            "compute_seconds": round(t.compute_seconds, 6),
            "median_compute_seconds": round(med_compute, 6),
            "step_seconds": round(t.step_seconds, 6), "median_step_seconds": round(med_step, 6),
            "collective_seconds": round(t.collective_seconds, 6),
            "median_collective_seconds": round(med_wait, 6),
            "data_seconds": round(t.data_seconds, 6), "median_data_seconds": round(med_data, 6),
            "ranks_compared": len(timed) - 1,
        }
    return out


def _median_without(values: list[float], mine: float) -> float:
    """``statistics.median`` of the sorted ``values`` with one ``mine`` (one of them) left
    out, in O(log n): the same elements, added and halved the same way."""
    i = bisect.bisect_left(values, mine)
    n = len(values) - 1  # what is left

    def at(k: int) -> float:
        return values[k] if k < i else values[k + 1]

    if n % 2 == 1:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2


def _finding(t: RankTiming, since: float, slow_for: float, ev: dict[str, Any], *,
             persistent: bool) -> Straggler:
    node = f" on node {t.node}" if t.node else ""
    waits = ""
    if ev["median_collective_seconds"] > 0 or t.collective_seconds > 0:
        waits = (f"; it waits {t.collective_seconds:.3f}s/step in collectives while the others "
                 f"wait {ev['median_collective_seconds']:.3f}s for it")
    extra_data = t.data_seconds - ev["median_data_seconds"]
    extra_compute = t.compute_seconds - ev["median_compute_seconds"]
    where = "data loading" if extra_data > extra_compute else "compute"
    still = " still" if persistent else ""
    message = (f"rank {t.rank}{node} is{still} a straggler, slow in {where} for "
               f"{slow_for:.0f}s: {t.own_seconds:.3f}s of its own work per step (compute "
               f"{t.compute_seconds:.3f}s, data {t.data_seconds:.3f}s) vs the job's median "
               f"{ev['median_own_seconds']:.3f}s ({ev['speed_vs_median']:.0%} of its speed); "
               f"step {t.step_seconds:.3f}s vs median "
               f"{ev['median_step_seconds']:.3f}s{waits}")
    evidence = dict(ev, rank=t.rank, node=t.node, slow_in=where, slow_for_seconds=round(
        slow_for, 1), persistent=persistent)
    return Straggler(t.rank, t.node, since, persistent, message, evidence)


STALE_AFTER = 30.0  # seconds: a rank whose last timed summary is older is left out


@dataclass
class JobTimings:
    """One job's latest timings per rank (from its ProgressSummaries) and its watch; the
    registry holds one per job and assesses it every few seconds (``assess_job``).

    ``slowdown`` runs on every timed summary, so it is kept, not recomputed: the fresh
    timings' own and step seconds sorted (a summary replaces its rank's values: a
    bisection and a move of the list, in C), how many carry waits, and a heap of when
    each was received (a timing is dropped once ``STALE_AFTER`` old). Then the share is
    read in O(1) (``_share``). Recomputed from every rank, it cost each summary O(n) in
    the job's ranks (1,024 ranks: 0.27 ms, 16,384 ranks: several ms), O(n^2) a round."""

    watch: StragglerWatch
    generation: int = 0
    latest: dict[int, tuple[float, RankTiming]] = field(default_factory=dict)
    # what ``_share`` reads: the timings counted (fresh, step measured), their own and
    # step seconds sorted, how many of them measured waits; when each was received
    _counted: dict[int, RankTiming] = field(default_factory=dict)
    _own: list[float] = field(default_factory=list)
    _step: list[float] = field(default_factory=list)
    _waits: int = 0
    _received: list[tuple[float, int]] = field(default_factory=list)  # a heap
    _now: float = -math.inf  # the last ``now`` asked: a clock set back recounts

    def note(self, timing: RankTiming, received: float) -> None:
        self.latest[timing.rank] = (received, timing)
        self._uncount(timing.rank)
        if timing.step_seconds > 0:
            self._count(timing)
            heapq.heappush(self._received, (received, timing.rank))

    def slowdown(self, now: float) -> float:
        """``slowdown`` of the fresh timings (the goodput ledger's straggler share):
        the same value, read from what is kept (``_share``)."""
        if now < self._now:  # the clock went back: a dropped timing may be fresh again
            self._recount(now)
        self._now = now
        heap = self._received
        while heap and now - heap[0][0] > STALE_AFTER:
            at, rank = heapq.heappop(heap)
            got = self.latest.get(rank)
            if got is not None and got[0] == at:  # its rank's latest timing is stale
                self._uncount(rank)
        return self._share(self.watch.cfg.ratio)

    def _share(self, ratio: float) -> float:
        """``slowdown(fresh, ratio)`` from the sorted values: the rank with the most own
        time is slow whenever any rank is (the others' median without it is the lowest
        such median, and 0 for every rank when 0 for it), so it is ``worst``, and the
        others' median is the sorted values' without it (``_median_without``)."""
        own = self._own
        if len(own) < 2 or not self._waits:
            return 0.0
        top = own[-1]
        med = _median_without(own, top)
        if top <= 0 or med <= 0 or med / top >= ratio:
            return 0.0  # nobody is slow
        n = len(self._step)
        step = self._step[n // 2] if n % 2 == 1 else \
            (self._step[n // 2 - 1] + self._step[n // 2]) / 2  # statistics.median's
        return min(max(0.0, (top - med) / step), 0.99) if step > 0 else 0.0

    def _count(self, t: RankTiming) -> None:
        self._counted[t.rank] = t
        bisect.insort(self._own, t.own_seconds)
        bisect.insort(self._step, t.step_seconds)
        self._waits += t.collective_seconds > 0 or t.data_seconds > 0

    def _uncount(self, rank: int) -> None:
        t = self._counted.pop(rank, None)
        if t is None:
            return
        del self._own[bisect.bisect_left(self._own, t.own_seconds)]
        del self._step[bisect.bisect_left(self._step, t.step_seconds)]
        self._waits -= t.collective_seconds > 0 or t.data_seconds > 0

    def _recount(self, now: float) -> None:
        """Everything kept, again from ``latest`` as of ``now`` (the clock went back)."""
        self._counted.clear()
        self._own.clear()
        self._step.clear()
        self._waits = 0
        self._received = [(at, r) for r, (at, t) in self.latest.items()
                          if t.step_seconds > 0 and now - at <= STALE_AFTER]
        heapq.heapify(self._received)
        for _, r in self._received:
            self._count(self.latest[r][1])

    def assess_job(self, generation: int, ranks: Iterable[int], now: float) -> list[Straggler]:
        """Findings among ``ranks`` (connected, training, not hung: the registry's choice)
        at the job's ``generation``; a new generation starts every rank over."""
        if generation != self.generation:
            self.generation = generation
            self.watch.reset()
            self.latest.clear()
            self._recount(now)
            return []
        fresh = []
        for rank in ranks:
            got = self.latest.get(rank)
            if got is not None and now - got[0] <= STALE_AFTER:
                fresh.append(got[1])
        return self.watch.update(fresh, now)
