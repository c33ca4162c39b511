"""``ftagent report JOB``: one self-contained HTML page about a job, for the incident review.

From the arbiter's history (``GetJob`` with its whole timeline: live jobs and past ones
alike, ``--arbiter``) or from agents' events files (``--events-file``, JSON lines, one
per rank, repeatable), it draws with matplotlib, as inline SVG (the page needs nothing
else, it opens offline and can be attached to a ticket):

* steps over time per rank, with faults (red) and decisions (blue) on the same time axis;
* downtime per fault: from the fault to every rank training again (the next barrier
  release, or the trainer running again in an events file);
* goodput: the share of the covered time that was not downtime;
* the phase breakdown: the job's time training / down after a fault, and where a step's
  time goes (compute, collectives, data) when the agents reported it.

Steps over time come from ``progress`` records of an events file
(``{"event": "progress", "ts": ..., "step": N, "rank": R}``, optionally with
``step_seconds``, ``collective_seconds``, ``data_seconds``); the arbiter keeps no step
history, so from it each rank's last step is one point at the time of the report.
matplotlib is an optional extra: ``pip install 'ftagent[report]'``.
"""

from __future__ import annotations

import html
import io
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ftagent.config import (
    CONNECTION_FIELDS,
    ArbiterClientConfig,
    ConfigError,
    HelpFormatter,
    OneLineParser,
    add_group,
    name,
    resolve_group,
    shown,
)
from ftagent.wire.limits import printable

PROG = "ftagent report"
MAX_RECORDS = 1_000_000  # lines read from events files, in all (a bigger file is cut)
MAX_LINE = 64 * 1024  # a longer line is not an ftagent record: skipped
RESTARTING = ("restart", "replace")  # decisions that take the job down until a release


@dataclass(frozen=True)
class Mark:
    """A fault or a decision on the time axis."""

    ts: float
    rank: int | None
    kind: str  # fault kind, or decision action
    message: str
    fault_id: str = ""


@dataclass(frozen=True)
class IncidentRow:
    """One restart of the ledger: seconds to detect, decide, restart (None: not over) and
    recompute, and the steps redone (None: unknown or not over)."""

    generation: int
    kind: str
    detect: float
    decide: float | None
    restart: float | None
    recompute: float
    steps: int | None
    resumed: int | None
    source: str
    no_restart: bool = False  # a link outage the job resumed from by itself


INCIDENTS_SHOWN = 64  # rows of the per-incident table (the arbiter keeps the newest 64)


@dataclass
class ReportData:
    job: str
    source: str
    steps: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    faults: list[Mark] = field(default_factory=list)
    decisions: list[Mark] = field(default_factory=list)
    releases: list[float] = field(default_factory=list)  # every rank training again
    step_parts: dict[str, float] = field(default_factory=dict)  # compute/collectives/data
    skipped: int = 0  # lines that were not records
    # The arbiter's goodput ledger (JobInfo.goodput): seconds per category, its wall time,
    # ratio and recomputed steps (None: unknown); empty from events files.
    ledger: dict[str, float] = field(default_factory=dict)
    ledger_wall: float = 0.0
    ledger_ratio: float = 0.0
    recomputed_steps: int | None = None
    # Each restart the ledger placed (Goodput.per_incident), its stages in seconds.
    incidents: list[IncidentRow] = field(default_factory=list)

    def span(self) -> tuple[float, float]:
        ts = [t for pts in self.steps.values() for t, _ in pts]
        ts += [m.ts for m in self.faults + self.decisions] + self.releases
        return (min(ts), max(ts)) if ts else (0.0, 0.0)


@dataclass(frozen=True)
class Downtime:
    fault: Mark
    seconds: float  # to the next release (or to the end of the data: still down)
    recovered: bool


def downtimes(d: ReportData) -> list[Downtime]:
    """Each fault a restart/replace answered, and the seconds until training again."""
    out: list[Downtime] = []
    faults = sorted(d.faults, key=lambda m: m.ts)
    by_id = {f.fault_id: f for f in faults if f.fault_id}
    seen: set[int] = set()
    end = d.span()[1]
    for dec in sorted(d.decisions, key=lambda m: m.ts):
        if dec.kind not in RESTARTING:
            continue
        f = by_id.get(dec.fault_id) if dec.fault_id else None
        if f is None:  # no id (an events file): the latest fault before the decision
            before = [x for x in faults if x.ts <= dec.ts]
            f = before[-1] if before else Mark(dec.ts, dec.rank, dec.kind, dec.message)
        if id(f) in seen:
            continue
        seen.add(id(f))
        after = [r for r in d.releases if r >= dec.ts]
        if after:
            out.append(Downtime(f, after[0] - f.ts, True))
        else:
            out.append(Downtime(f, max(0.0, end - f.ts), False))
    return out


def goodput(d: ReportData, down: Iterable[Downtime]) -> float | None:
    start, end = d.span()
    if end <= start:
        return None
    lost = sum(x.seconds for x in down)
    return max(0.0, 1.0 - lost / (end - start))


# --------------------------------------------------------------------------- sources


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) < 1e18:
        return float(v)
    return None


def from_events(job: str, paths: Iterable[str]) -> ReportData:
    """Records of ``job`` in agents' events files (every job when a record has none).
    Raises ConfigError for a file that cannot be read; skips lines that are not records."""
    d = ReportData(job, "events file " + ", ".join(paths))
    parts: dict[str, float] = {"compute": 0.0, "collectives": 0.0, "data": 0.0}
    n = 0
    for path in paths:
        try:
            fh = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError as e:
            raise ConfigError(f"cannot read events file {path}: {e.strerror}") from None
        with fh:
            for line in fh:
                n += 1
                if n > MAX_RECORDS:
                    break
                rec = _record(line)
                if rec is None:
                    d.skipped += 1
                    continue
                if rec.get("job") not in (None, job):
                    continue
                _take(d, rec, parts)
    if any(parts.values()):
        d.step_parts = parts
    return d


def _record(line: str) -> dict[str, Any] | None:
    if len(line) > MAX_LINE or not line.strip():
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or _num(rec.get("ts")) is None:
        return None
    return rec


def _take(d: ReportData, rec: Mapping[str, Any], parts: dict[str, float]) -> None:
    ts = float(rec["ts"])
    rank = _int(rec.get("rank"))
    event, kind = str(rec.get("event", "")), printable(str(rec.get("kind", ""))[:64])
    message = printable(str(rec.get("message", ""))[:500])
    if event == "progress":
        step = _int(rec.get("step"))
        if step is not None:
            d.steps.setdefault(rank if rank is not None else 0, []).append((ts, step))
        step_s = _num(rec.get("step_seconds")) or 0.0
        coll = min(_num(rec.get("collective_seconds")) or 0.0, step_s)
        data = min(_num(rec.get("data_seconds")) or 0.0, step_s - coll)
        parts["collectives"] += coll
        parts["data"] += data
        parts["compute"] += max(0.0, step_s - coll - data)
    elif event == "fault":
        d.faults.append(Mark(ts, rank, kind, message, str(rec.get("fault_id", ""))))
    elif event == "action":
        d.decisions.append(Mark(ts, rank, kind, message, str(rec.get("fault_id", "") or "")))
    elif event == "state" and kind in ("running", "released"):
        d.releases.append(ts)


def from_job_info(info: Mapping[str, Any], now: float) -> ReportData:
    """The arbiter's ``GetJob`` answer (``status_view.to_dict`` of a JobInfo)."""
    d = ReportData(str(info.get("job", "")), "arbiter history")
    for e in info.get("timeline", []):
        ts = _num(e.get("ts"))
        if ts is None:
            continue
        rank = _int(e.get("rank"))
        kind, action = str(e.get("kind", "")), str(e.get("action", ""))
        msg = printable(str(e.get("message", ""))[:500])
        if kind == "fault":
            fk = msg.split(" ", 1)[0] if msg else "fault"
            d.faults.append(Mark(ts, rank, fk, msg, str(e.get("fault_id", ""))))
        elif kind == "decision" and action:
            d.decisions.append(Mark(ts, rank, action, msg, str(e.get("fault_id", ""))))
        elif kind == "barrier" and action == "release_barrier":
            d.releases.append(ts)
    for r in info.get("ranks", []):
        step, rank = _int(r.get("step")), _int(r.get("rank"))
        if step is not None and step >= 0 and rank is not None:
            d.steps[rank] = [(now, step)]
    g = info.get("goodput")
    if isinstance(g, Mapping) and isinstance(g.get("seconds"), Mapping):
        for k, raw in list(g["seconds"].items())[:32]:
            v = _num(raw)
            if v is not None and v >= 0:
                d.ledger[str(k)[:32]] = v
        d.ledger_wall = _num(g.get("wall_seconds")) or 0.0
        d.ledger_ratio = _num(g.get("ratio")) or 0.0
        d.recomputed_steps = _int(g.get("recomputed_steps"))
        raw_incidents = g.get("per_incident")
        for i in raw_incidents[:INCIDENTS_SHOWN] if isinstance(raw_incidents, list) else ():
            row = _incident_row(i)
            if row is not None:
                d.incidents.append(row)
    return d


def _incident_row(i: Any) -> IncidentRow | None:
    """A ``per_incident`` entry of the status JSON, checked (None: not one)."""
    if not isinstance(i, Mapping):
        return None
    gen, detect = _int(i.get("generation")), _num(i.get("detect_seconds"))
    if gen is None or detect is None:
        return None
    return IncidentRow(gen, str(i.get("kind", ""))[:32], max(0.0, detect),
                       _num(i.get("decide_seconds")), _num(i.get("restart_seconds")),
                       max(0.0, _num(i.get("recompute_seconds")) or 0.0),
                       _int(i.get("recomputed_steps")), _int(i.get("resumed_step")),
                       str(i.get("resume_source", ""))[:16], i.get("no_restart") is True)


def incident_table(d: ReportData) -> str:
    """Each restart (and each link outage the job resumed from by itself, its restart
    "none"): time to detect, decide, restart and recompute ("" without any)."""
    if not d.incidents:
        return ""

    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    rows = "".join(
        f"<tr><td>{i.generation}</td><td>{esc(i.kind)}"
        f"{' (outage, no restart)' if i.no_restart else ''}</td><td>{sec(i.detect)}</td>"
        f"<td>{sec(i.decide)}</td><td>{'none' if i.no_restart else sec(i.restart)}</td>"
        f"<td>{sec(i.recompute)}</td>"
        f"<td>{'unknown' if i.steps is None else i.steps}</td>"
        f"<td>{'-' if i.resumed is None else i.resumed}"
        f"{' (' + esc(i.source) + ')' if i.source and i.resumed is not None else ''}</td></tr>"
        for i in d.incidents)
    return ('<h2>Each restart</h2><table id="incidents"><tr><th>generation</th><th>fault'
            "</th><th>detect (s)</th><th>decide (s)</th><th>restart (s)</th>"
            "<th>recompute (s)</th><th>steps redone</th><th>resumed after step</th></tr>"
            f"{rows}</table>")


def ledger_table(d: ReportData) -> str:
    """The arbiter's ledger as an HTML table ("" without one)."""
    if not d.ledger:
        return ""
    wall = d.ledger_wall or sum(d.ledger.values())
    rows = "".join(
        f"<tr><td>{esc(c)}</td><td>{v:.1f}</td>"
        f"<td>{100 * v / wall if wall > 0 else 0.0:.1f}%</td></tr>"
        for c, v in sorted(d.ledger.items(), key=lambda kv: -kv[1]))
    steps = "unknown" if d.recomputed_steps is None else str(d.recomputed_steps)
    return (f"<h2>Where the wall time went</h2><p>The arbiter's goodput ledger: "
            f"{d.ledger_ratio:.1%} of {wall:.0f} s was kept training progress; "
            f"{esc(steps)} steps recomputed after restarts.</p>"
            f'<table id="ledger"><tr><th>category</th><th>seconds</th><th>share</th></tr>'
            f"{rows}</table>")


def fetch_job(cfg: ArbiterClientConfig, job: str, namespace: str) -> dict[str, Any]:
    """GetJob with every kept timeline entry; raises status_view.StatusError (one line)."""
    from ftagent.arbiter.status_view import _call, _stub, to_dict
    from ftagent.v1 import ftagent_pb2 as pb
    from ftagent.wire.shard import pick_arbiter

    replicas = [a.strip() for a in cfg.arbiter.split(",") if a.strip()]
    address = pick_arbiter(replicas, job)
    info = _call(address, _stub(cfg, address).GetJob,
                 pb.GetJobRequest(job=job, namespace=namespace, timeline_limit=0), cfg.token)
    return to_dict(info)


# --------------------------------------------------------------------------- the page

COLORS = {"fault": "#c0392b", "decision": "#2c6fbb", "down": "#f5b7b1"}


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # no XML prolog inside HTML


def render(d: ReportData) -> str:
    """The HTML page (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    down = downtimes(d)
    gp = goodput(d, down)
    start, end = d.span()
    rel = (lambda t: t - start)  # seconds since the first record
    figures: list[tuple[str, str]] = []

    fig, ax = plt.subplots(figsize=(10, 3.6))
    for rank in sorted(d.steps):
        pts = sorted(d.steps[rank])
        ax.plot([rel(t) for t, _ in pts], [s for _, s in pts], marker="." if len(pts) < 3
                else None, label=f"rank {rank}")
    for x in down:
        ax.axvspan(rel(x.fault.ts), rel(x.fault.ts + x.seconds), color=COLORS["down"],
                   alpha=0.6, lw=0)
    for m in d.faults:
        ax.axvline(rel(m.ts), color=COLORS["fault"], lw=1.2)
    for m in d.decisions:
        ax.axvline(rel(m.ts), color=COLORS["decision"], lw=0.8, ls="--")
    ax.set_xlabel("seconds since the first record")
    ax.set_ylabel("step")
    ax.set_title("Steps per rank; faults (red), decisions (blue dashed), downtime (shaded)")
    if d.steps:
        ax.legend(loc="upper left", fontsize="small", ncol=min(4, len(d.steps)))
    figures.append(("steps", _svg(fig)))

    fig, ax = plt.subplots(figsize=(10, max(1.8, 0.45 * len(down) + 1)))
    if down:
        labels = [f"{x.fault.kind} (rank {x.fault.rank})" if x.fault.rank is not None
                  else x.fault.kind for x in down]
        ax.barh(range(len(down)), [x.seconds for x in down], color=[
            COLORS["fault"] if x.recovered else "#7f8c8d" for x in down])
        ax.set_yticks(range(len(down)), labels)
        ax.invert_yaxis()
    else:
        ax.text(0.5, 0.5, "no fault took the job down", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("seconds until every rank trained again")
    ax.set_title("Downtime per fault")
    figures.append(("downtime", _svg(fig)))

    fig, axes = plt.subplots(1, 2, figsize=(10, 2.4))
    span = max(0.0, end - start)
    lost = sum(x.seconds for x in down)
    axes[0].barh([0], [max(0.0, span - lost)], color="#27ae60", label="training")
    axes[0].barh([0], [min(lost, span)], left=[max(0.0, span - lost)], color=COLORS["fault"],
                 label="down after a fault")
    axes[0].set_yticks([])
    axes[0].set_xlabel("seconds")
    axes[0].set_title(f"Goodput {gp:.1%}" if gp is not None else "Goodput: no data")
    axes[0].legend(loc="lower right", fontsize="small")
    parts = {k: v for k, v in d.step_parts.items() if v > 0}
    if parts:
        axes[1].pie(list(parts.values()), labels=list(parts), autopct="%1.0f%%",
                    colors=["#27ae60", "#2c6fbb", "#f39c12"][:len(parts)])
        axes[1].set_title("Where a step's time goes")
    else:
        axes[1].axis("off")
        axes[1].text(0.5, 0.5, "no step timings reported\n(ftagent.torch.instrument())",
                     ha="center", va="center", transform=axes[1].transAxes)
    figures.append(("phases", _svg(fig)))

    rows = "".join(
        f"<tr><td>{esc(utc(m.ts))}</td><td>{'fault' if m in d.faults else 'decision'}</td>"
        f"<td>{esc(m.rank if m.rank is not None else '-')}</td><td>{esc(m.kind)}</td>"
        f"<td>{esc(m.message)}</td></tr>"
        for m in sorted(d.faults + d.decisions, key=lambda m: m.ts))
    summary = (f"<li>covered: {esc(utc(start))} to {esc(utc(end))} ({span:.0f} s)</li>"
               f"<li>faults: {len(d.faults)}, restarts or replacements: {len(down)}, "
               f"downtime: {lost:.1f} s</li>"
               f"<li>goodput: {esc(f'{gp:.1%}' if gp is not None else 'no data')}</li>"
               f"<li>ranks with steps: {len(d.steps)}</li>") if d.span() != (0.0, 0.0) else \
        "<li>no records for this job</li>"
    pictures = "".join(f'<figure id="{k}">{svg}</figure>' for k, svg in figures)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ftagent report: {esc(d.job)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}figure{{margin:1em 0}}
figure svg{{max-width:100%;height:auto}}table{{border-collapse:collapse;font-size:90%}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}}</style>
</head><body>
<h1>Job {esc(d.job)}</h1>
<p>From the {esc(d.source)}, made {esc(utc(time.time()))} by <code>ftagent report</code>.</p>
<ul id="summary">{summary}</ul>
{pictures}
{ledger_table(d)}
{incident_table(d)}
<h2>Faults and decisions</h2>
<table id="timeline"><tr><th>time</th><th>what</th><th>rank</th><th>kind</th><th>message</th>
</tr>{rows}</table>
</body></html>
"""


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG, description=__doc__.splitlines()[0], formatter_class=HelpFormatter,
        epilog="exit status: 0; 1 when the arbiter cannot be reached or refuses; 2 for a "
               "bad flag, value or unreadable file; 3 when matplotlib is missing.\n\n"
               "examples:\n"
               "  ftagent report llama --arbiter arbiter:9400 -o llama.html\n"
               "  ftagent report llama --events-file rank0.jsonl --events-file rank1.jsonl")
    parser.add_argument("job", metavar="JOB", help="the job to report on")
    parser.add_argument("-o", "--output", default="report.html", metavar="FILE",
                        help="where to write the HTML page (default: report.html; - for "
                             "stdout)")
    parser.add_argument("--events-file", action="append", default=[], metavar="FILE",
                        help="an agent's events file (JSON lines); repeat for each rank. "
                             "Without it the job comes from --arbiter")
    parser.add_argument("--namespace", default=os.environ.get("FTAGENT_NAMESPACE", ""),
                        metavar="NAMESPACE", help="the job's namespace at the arbiter "
                        "[env FTAGENT_NAMESPACE]")
    add_group(parser, "arbiter connection", ArbiterClientConfig, only=CONNECTION_FIELDS)
    return parser


def main(argv: list[str]) -> int:
    from ftagent.arbiter.status_view import StatusError

    try:
        ns = build_parser().parse_args(argv)
        job = str(ns.job)
        try:
            name(job)
        except ConfigError as e:
            raise ConfigError(f"JOB {shown(job)} {e}") from None
        if ns.events_file:
            data = from_events(job, ns.events_file)
        else:
            cfg = resolve_group(ns, ArbiterClientConfig, os.environ, only=CONNECTION_FIELDS)
            if not cfg.arbiter:
                raise ConfigError("no source: pass --events-file FILE or --arbiter HOST:PORT "
                                  "(or set FTAGENT_ARBITER)")
            data = from_job_info(fetch_job(cfg, job, ns.namespace), time.time())
        try:
            page = render(data)
        except ImportError:
            sys.stderr.write(f"{PROG}: error: matplotlib is missing: pip install "
                             "'ftagent[report]'\n")
            return 3
        if ns.output == "-":
            sys.stdout.write(page)
        else:
            Path(ns.output).write_text(page, encoding="utf-8")
            sys.stderr.write(f"{PROG}: wrote {ns.output} ({len(page) // 1024} KiB)\n")
        return 0
    except (ConfigError, ValueError) as e:
        sys.stderr.write(f"{PROG}: error: {e} (see {PROG} --help)\n")
        return 2
    except StatusError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 1
    except OSError as e:
        sys.stderr.write(f"{PROG}: error: cannot write {ns.output}: {e.strerror}\n")
        return 2


def utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def esc(text: object) -> str:
    """HTML-escaped, and control characters written as escapes (``limits.printable``)."""
    return html.escape(printable(str(text)), quote=True)

