"""The agent under a flood of output: parsing is sampled (never the trainer slowed), and
the hang detector's clock is the time lines were read, not the time the loop got to them."""

from __future__ import annotations

import dataclasses
import types

from ftagent.agent.line_feed import LineFeed
from ftagent.agent.tee import LineBacklog
from ftagent.config import HangConfig
from ftagent.detect.hang import HangDetector
from ftagent.model import Fault, Progress, TrainerStart
from ftagent.sources.progress import LogProgress, ParseBudget


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def step_lines(first: int, n: int) -> bytes:
    return b"\n".join(b"[rank0] step=%d loss=0.5 noise 1234" % i for i in range(first, first + n))


def test_over_budget_the_freshest_lines_are_parsed_and_the_rest_counted() -> None:
    clock = FakeClock()
    skips: list[tuple[str, int]] = []
    p = LogProgress(budget=ParseBudget(share=0.0, burst=1e-5, clock=clock))  # ~200 bytes
    p.on_skip = lambda reason, n: skips.append((reason, n))
    out = p.parse_blob(step_lines(0, 1000), 1.0)
    steps = [o.step for o in out if isinstance(o, Progress)]
    assert steps and steps[-1] == 999  # the newest line is never the one skipped
    skipped = p.lines_skipped["budget"]
    assert skipped + len(steps) == 1000 and skipped >= 900
    assert skips == [("budget", skipped)]
    # an empty bucket parses only the freshest line (the last thing printed before a
    # quiet spell must be seen: a missed last step would read as a hang) and counts the rest
    p.budget = ParseBudget(share=0.0, burst=0.0, clock=clock)
    assert [o.step for o in p.parse_blob(step_lines(1000, 10), 2.0)
            if isinstance(o, Progress)] == [1009]
    assert p.lines_skipped["budget"] == skipped + 9


def test_within_budget_every_line_is_parsed() -> None:
    p = LogProgress(budget=ParseBudget(share=0.1, burst=1.0, clock=FakeClock()))
    out = p.parse_blob(step_lines(0, 100), 1.0)
    assert [o.step for o in out if isinstance(o, Progress)] == list(range(100))
    assert p.lines_skipped == {}


def test_lines_read_at_t_and_handled_at_t_plus_30_are_no_hang() -> None:
    """The trainer prints a step every 0.5 s; the loop is stuck for 30 s, then catches up.
    Ticked with the backlog's read time as "now", the detector sees no hang; ticked with
    the wall clock (what the agent did before), it declares one. A real stall after the
    backlog is handled is still a hang."""
    cfg = dataclasses.replace(HangConfig(), hang_timeout_min=1.0, hang_warmup_steps=1)
    fixed, naive = HangDetector(cfg), HangDetector(cfg)
    parser = LogProgress(unlimited=True)
    backlog = LineBacklog()
    feed = types.SimpleNamespace(backlog=backlog)
    for d in (fixed, naive):
        d.observe(TrainerStart(pid=1, attempt=0, ts=0.0))
    faults: dict[str, list[Fault]] = {"fixed": [], "naive": []}
    step = 0
    for tick in range(0, 4 * 75):
        wall = tick * 0.25
        if wall <= 60 and tick % 2 == 0:  # read by the pump at `wall`
            backlog.put("stdout", step_lines(step, 1), wall)
            step += 1
        if wall >= 30:  # the loop is back: it handles 3 batches per tick
            for _, blob, ts in backlog.take(3):
                for obs in parser.parse_blob(blob, ts):
                    fixed.observe(obs)
                    naive.observe(obs)
        faults["fixed"] += fixed.tick(LineFeed.now(feed, wall))  # type: ignore[arg-type]
        faults["naive"] += naive.tick(wall)
        if wall == 62.0:
            assert faults["fixed"] == [] and len(backlog) == 0
            assert fixed.last_step == step - 1
    assert faults["naive"], "the test must show the old clock's false hang"
    assert len(faults["fixed"]) == 1  # the real stall: nothing printed after t=60
    assert faults["fixed"][0].evidence["last_step"] == step - 1
