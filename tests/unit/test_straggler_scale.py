"""The straggler comparison at scale: each rank against the median of the others, read
from the job's values sorted once (``straggler.assess``), gives the same findings and the
same floats as a median of the others computed per rank; and its cost per rank does not
grow with the job. ``slowdown`` runs ``assess`` on every summary of an instrumented job:
with a median per rank, a 1,024-rank job's summary cost 72 ms of the arbiter's loop
(bench/probe_scale.py's notes), O(n^3) a reporting round."""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping
from typing import Any

import pytest

from ftagent.arbiter import straggler
from ftagent.arbiter.straggler import (
    STALE_AFTER,
    JobTimings,
    RankTiming,
    StragglerConfig,
    StragglerWatch,
    assess,
    slowdown,
)


def assess_per_rank(timed: Mapping[int, RankTiming], ratio: float) -> dict[int, dict[str, Any]]:
    """The comparison as it was written: a median of the other ranks for each rank."""
    if len(timed) < 2:
        return {}
    out: dict[int, dict[str, Any]] = {}
    for rank, t in timed.items():
        others = [o for r, o in timed.items() if r != rank]
        med_own = statistics.median(o.own_seconds for o in others)
        own = t.own_seconds
        if own <= 0 or med_own <= 0:
            continue
        speed = med_own / own
        if speed >= ratio:
            continue
        med_compute = statistics.median(o.compute_seconds for o in others)
        med_step = statistics.median(o.step_seconds for o in others)
        med_wait = statistics.median(o.collective_seconds for o in others)
        med_data = statistics.median(o.data_seconds for o in others)
        out[rank] = {
            "speed_vs_median": round(speed, 3),
            "own_seconds": round(own, 6), "median_own_seconds": round(med_own, 6),
            "compute_seconds": round(t.compute_seconds, 6),
            "median_compute_seconds": round(med_compute, 6),
            "step_seconds": round(t.step_seconds, 6), "median_step_seconds": round(med_step, 6),
            "collective_seconds": round(t.collective_seconds, 6),
            "median_collective_seconds": round(med_wait, 6),
            "data_seconds": round(t.data_seconds, 6), "median_data_seconds": round(med_data, 6),
            "ranks_compared": len(others),
        }
    return out


def timings(rng: random.Random, n: int) -> dict[int, RankTiming]:
    """Ranks with few distinct values (ties, zeros) and some slow ones."""
    out = {}
    for r in rng.sample(range(4 * n), n):
        step = rng.choice((0.5, 1.0, 1.0, 1.0, 2.0, 0.0))
        coll = rng.choice((0.0, 0.2, 0.4, 0.9, step))
        out[r] = RankTiming(r, f"n{r % 3}", step, coll, rng.choice((0.0, 0.05, 0.3)))
    return out


@pytest.mark.parametrize("seed", range(200))
def test_the_sorted_medians_find_what_a_median_per_rank_found(seed: int) -> None:
    rng = random.Random(seed)
    timed = timings(rng, rng.randint(0, 12))
    ratio = rng.choice((0.5, 0.8, 0.95))
    assert assess(timed, ratio) == assess_per_rank(timed, ratio)


def test_the_median_without_one_value_is_statistics_median() -> None:
    rng = random.Random(7)
    for n in range(2, 40):
        values = sorted(rng.choice((0.0, 0.1, 0.3, 1.0, 2.5, rng.random())) for _ in range(n))
        for i, v in enumerate(values):
            rest = values[:i] + values[i + 1:]
            assert straggler._median_without(values, v) == statistics.median(rest)


def test_a_big_job_is_compared_in_one_sort_per_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-rank median sorted the other n-1 ranks' values for each rank: n sorts of
    n values (4,096 ranks: 16.8 million values sorted for one summary)."""
    sorted_values = [0]
    real = sorted

    def counting(values: Any, *a: Any, **kw: Any) -> list[Any]:
        got = real(values, *a, **kw)
        sorted_values[0] += len(got)
        return got

    monkeypatch.setattr(statistics, "sorted", counting, raising=False)
    monkeypatch.setattr(straggler, "sorted", counting, raising=False)
    rng = random.Random(1)
    n = 4096
    timed = {r: RankTiming(r, "", 1.0, 0.4 + rng.random() * 0.1, 0.05) for r in range(n)}
    timed[17] = RankTiming(17, "", 1.0, 0.0, 0.05)  # computes the whole step: slow
    assert set(assess(timed, 0.8)) == {17}
    assert sorted_values[0] <= 5 * n
    assert slowdown(timed, 0.8) > 0
    assert sorted_values[0] <= 12 * n


def recomputed(jt: JobTimings, now: float) -> float:
    """The share as it was computed on every summary: from every rank's latest timing."""
    fresh = {r: t for r, (at, t) in jt.latest.items() if now - at <= STALE_AFTER}
    return slowdown(fresh, jt.watch.cfg.ratio)


@pytest.mark.parametrize("seed", range(150))
def test_the_kept_share_is_the_share_recomputed_from_every_rank(seed: int) -> None:
    rng = random.Random(seed)
    jt = JobTimings(StragglerWatch(StragglerConfig(ratio=rng.choice((0.5, 0.8, 0.95)))))
    now, world = 1000.0, rng.randint(1, 10)
    for _ in range(150):
        roll = rng.random()
        if roll < 0.6:
            r = rng.randrange(world)
            step = rng.choice((0.0, 0.5, 1.0, 1.0, 2.0))
            jt.note(RankTiming(r, "", step, rng.choice((0.0, 0.2, 0.4, 0.9, step)),
                               rng.choice((0.0, 0.0, 0.05, 0.3))), now)
        elif roll < 0.85:
            now += rng.choice((0.0, 0.5, 3.0, 12.0, STALE_AFTER))
        elif roll < 0.9:
            now -= rng.choice((1.0, 20.0, 40.0))  # the wall clock set back
        elif roll < 0.95:
            jt.assess_job(jt.generation + rng.randint(0, 1), range(world), now)
        assert jt.slowdown(now) == recomputed(jt, now)


def test_a_summary_of_a_big_job_reads_no_other_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each summary recomputed the share from every rank's timing (the O(n) dict of the
    fresh ones at least, then the comparison); kept, a summary reads none."""
    n = 4096
    jt = JobTimings(StragglerWatch(StragglerConfig()))
    for r in range(n):
        jt.note(RankTiming(r, "", 1.0, 0.4, 0.05), 1000.0)
    jt.note(RankTiming(17, "", 1.0, 0.0, 0.05), 1000.0)  # computes the whole step: slow
    expected = recomputed(jt, 1001.0)
    assert expected > 0
    calls = [0]
    real = straggler.assess

    def counted(timed: Mapping[int, RankTiming], ratio: float) -> dict[int, dict[str, Any]]:
        calls[0] += len(timed)
        return real(timed, ratio)

    monkeypatch.setattr(straggler, "assess", counted)
    for r in range(100):
        jt.note(RankTiming(r + 100, "", 1.0, 0.4, 0.05), 1001.0)
        assert jt.slowdown(1001.0) == expected
    assert calls[0] == 0
