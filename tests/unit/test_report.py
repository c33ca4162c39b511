"""``ftagent report``: downtime, goodput and the page from events files and an arbiter's
JobInfo (ftagent/report.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ftagent import report

T0 = 1_764_500_000.0


def rec(ts: float, event: str, kind: str = "", message: str = "", **kw: object) -> str:
    return json.dumps({"ts": T0 + ts, "event": event, "kind": kind, "message": message,
                       "job": "llama", **kw})


def events_files(tmp_path: Path) -> list[str]:
    """Two ranks, 0.5 s steps; rank 1 crashes at 30 s, every rank trains again at 40 s."""
    paths = []
    for rank in (0, 1):
        lines = [rec(0, "state", "running", "trainer running", rank=rank)]
        for step in range(60):
            t = step * 0.5 if step * 0.5 < 30 else 40 + (step * 0.5 - 30)
            lines.append(rec(t, "progress", step=step, rank=rank, step_seconds=0.5,
                             collective_seconds=0.1, data_seconds=0.05))
        if rank == 1:
            lines.append(rec(30, "fault", "crash", "exit code 139", rank=1, fault_id="f1"))
        lines.append(rec(30.2, "action", "restart", "every rank restarts", rank=rank))
        lines.append(rec(40, "state", "released", "barrier released", rank=rank))
        lines.append("not json at all")
        lines.append(json.dumps({"event": "fault"}))  # no ts: not a record
        lines.append(rec(50, "fault", "crash", "another job's", job="other"))
        p = tmp_path / f"rank{rank}.jsonl"
        p.write_text("\n".join(lines) + "\n")
        paths.append(str(p))
    return paths


def test_downtime_and_goodput_from_events(tmp_path: Path) -> None:
    d = report.from_events("llama", events_files(tmp_path))
    assert sorted(d.steps) == [0, 1] and len(d.steps[0]) == 60
    assert [f.kind for f in d.faults] == ["crash"]  # the other job's left out
    assert d.skipped == 4
    down = report.downtimes(d)
    assert len(down) == 1  # two ranks' restart actions answer the same fault
    assert down[0].recovered and down[0].seconds == pytest.approx(10.0)
    start, end = d.span()
    assert report.goodput(d, down) == pytest.approx(1 - 10 / (end - start))
    assert d.step_parts["collectives"] == pytest.approx(0.1 * 120)


def test_page_is_self_contained_with_its_pictures(tmp_path: Path) -> None:
    page = report.render(report.from_events("llama", events_files(tmp_path)))
    assert page.count("<svg") == 3
    for fig in ("steps", "downtime", "phases"):
        assert f'<figure id="{fig}"><svg' in page
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from outside
    assert "exit code 139" in page and "Goodput" in page


def test_hostile_text_is_escaped() -> None:
    d = report.ReportData("j<script>", "test")
    d.faults.append(report.Mark(T0, 0, "crash", "<img src=x onerror=alert(1)>"))
    page = report.render(d)
    assert "<img src=x" not in page and "&lt;img src=x" in page
    assert "j<script>" not in page


def test_from_an_arbiters_job_info() -> None:
    info = {"job": "llama", "ranks": [{"rank": 0, "step": 120}, {"rank": 1, "step": -1}],
            "timeline": [
                {"ts": T0, "kind": "barrier", "action": "release_barrier", "message": "go"},
                {"ts": T0 + 5, "kind": "fault", "rank": 1, "fault_id": "a",
                 "message": "crash (error, generation 0): exit 1"},
                {"ts": T0 + 5.1, "kind": "decision", "action": "restart", "fault_id": "a",
                 "rank": 1, "message": "restart"},
                {"ts": T0 + 9, "kind": "barrier", "action": "release_barrier",
                 "message": "go"},
                {"ts": "bad", "kind": "fault"}]}
    d = report.from_job_info(info, now=T0 + 20)
    assert d.steps == {0: [(T0 + 20, 120)]}
    down = report.downtimes(d)
    assert [(x.fault.kind, round(x.seconds, 3)) for x in down] == [("crash", 4.0)]
    assert report.goodput(d, down) == pytest.approx(1 - 4 / 20)


def test_still_down_at_the_end_counts_to_the_end() -> None:
    d = report.ReportData("j", "test")
    d.steps[0] = [(T0, 0), (T0 + 10, 10)]
    d.faults.append(report.Mark(T0 + 10, 0, "hang", "stuck", "h"))
    d.decisions.append(report.Mark(T0 + 11, 0, "restart", "restart", "h"))
    d.decisions.append(report.Mark(T0 + 20, None, "stop", "budget spent"))
    (x,) = report.downtimes(d)
    assert not x.recovered and x.seconds == pytest.approx(10.0)


def test_cli_writes_the_page_and_bad_input_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTAGENT_ARBITER", raising=False)
    out = tmp_path / "r.html"
    files = events_files(tmp_path)
    argv = ["llama", "-o", str(out)] + [a for f in files for a in ("--events-file", f)]
    assert report.main(argv) == 0
    assert out.read_text().count("<svg") == 3
    assert report.main(["llama", "--events-file", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ftagent report: error: cannot read events file")
    assert report.main(["llama"]) == 2  # no source
    assert "no source" in capsys.readouterr().err
