"""Progress lines in the events file: throttled, with the mean step time between lines."""

from __future__ import annotations

import json
from pathlib import Path

from ftagent.agent.events import EventsFile, ProgressLog
from ftagent.model import Progress


def test_one_line_per_interval_with_the_mean_step_time(tmp_path: Path) -> None:
    now = [100.0]
    events = EventsFile(str(tmp_path / "ev.jsonl"), {"rank": 3})
    log = ProgressLog(events, every=2.0, clock=lambda: now[0])
    for step in range(1, 11):  # a step every 0.5 s: lines at steps 1, 5, 9
        log.observe(Progress(step, loss=float("nan") if step == 5 else 1.0 / step))
        now[0] += 0.5
    events.close()
    lines = [json.loads(x) for x in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert [(x["event"], x["step"], x["rank"]) for x in lines] == \
        [("progress", 1, 3), ("progress", 5, 3), ("progress", 9, 3)]
    assert "step_seconds" not in lines[0] and lines[1]["step_seconds"] == 0.5
    assert "loss" not in lines[1]  # NaN is not JSON: left out (the loss detector reports it)
    assert lines[2]["loss"] == 1.0 / 9


def test_no_events_file_writes_nothing() -> None:
    log = ProgressLog(EventsFile(""), clock=lambda: 0.0)
    log.observe(Progress(1))  # no file: nothing to do, nothing raised


def test_a_transitions_lines_are_written_together_and_readable_at_once(tmp_path: Path) -> None:
    """``write_lines``: an action and the state carrying it out, in order, in one write,
    already in the file when it returns (the durability promise of ``write``)."""
    path = tmp_path / "events.jsonl"
    ev = EventsFile(str(path), {"job": "j"})
    out = ev.write_lines(("action", "restart", "crash", {"action_id": "a1"}),
                         ("state", "restarting", "trainer restarting", {"restarts": 1}))
    lines = [json.loads(x) for x in path.read_text().splitlines()]  # before close: flushed
    assert [(x["event"], x["kind"]) for x in lines] == [("action", "restart"),
                                                        ("state", "restarting")]
    assert lines == out and lines[0]["ts"] == lines[1]["ts"] and lines[0]["job"] == "j"
    assert lines[0]["action_id"] == "a1" and lines[1]["restarts"] == 1
    ev.close()
