"""What ``ftagent status``, ``ftagent report`` and ``ftagent demo`` show of the arbiter's
read API: the client call (one-line errors), the proto as plain JSON, and the text tables.

No flags and no printing here: the command (``ftagent/cmd/status.py``) wires these.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.message import Message

from ftagent.config import ArbiterClientConfig
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.wire.credentials import bearer, channel_credentials
from ftagent.wire.limits import printable

TIMEOUT = 10.0


class StatusError(Exception):
    """One line for the user, exit code 1."""


def _stub(cfg: ArbiterClientConfig, address: str) -> pb_grpc.ArbiterStub:
    creds = channel_credentials(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
    ch = grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)
    return pb_grpc.ArbiterStub(ch)


def _call(address: str, fn: Any, req: Any, token: str) -> Any:
    try:
        return fn(req, metadata=bearer(token), timeout=TIMEOUT)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise StatusError(f"arbiter {address} unreachable ({code.name}): is `ftagent "
                              "arbiter` running there? (--arbiter / FTAGENT_ARBITER)") from None
        details = e.details() if hasattr(e, "details") else str(e)
        raise StatusError(f"{address}: {code.name if code else 'error'}: {details}") from None


def to_dict(m: Message) -> dict[str, Any]:
    """Every field by its proto name, numbers as numbers (proto3 JSON turns int64 into
    strings and leaves out zeros, which is awkward in jq); unset optional fields are null."""
    out: dict[str, Any] = {}
    for f in m.DESCRIPTOR.fields:
        value = getattr(m, f.name)
        if f.has_presence and f.message_type is None and not m.HasField(f.name):
            out[f.name] = None
        elif f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = dict(value)
        elif f.message_type is not None and not _repeated(f) and not m.HasField(f.name):
            out[f.name] = None  # a message field that is not there (JobInfo.goodput)
        elif f.message_type is not None:
            out[f.name] = [to_dict(v) for v in value] if _repeated(f) else to_dict(value)
        else:
            out[f.name] = list(value) if _repeated(f) else value
    return out


def _repeated(f: Any) -> bool:
    rep = getattr(f, "is_repeated", None)  # protobuf >= 6; older versions only have label
    return bool(rep if rep is not None else getattr(f, "label", 0) == 3)


def _age(seconds: float) -> str:
    if seconds < 0:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _duration(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s // 60:.0f}m{s % 60:02.0f}s"
    return f"{s // 3600:.0f}h{s % 3600 // 60:02.0f}m"


def _table(rows: list[list[str]]) -> str:
    rows = [[printable(c) for c in r] for r in rows]  # a peer's text moves no cursor
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
    return "\n".join(line.rstrip() for line in lines)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def format_jobs(jobs: list[pb.JobInfo]) -> str:
    if not jobs:
        return "no jobs (agents register when `ftagent run --arbiter ...` starts)"
    rows = [["JOB", "NAMESPACE", "STATE", "GENERATION", "RESTARTS", "CONNECTED", "GOODPUT",
             "BARRIER"]]
    for j in jobs:
        state = _clip(j.state, 60) + (" (alert only)" if j.alert_only else "")
        gp = f"{100 * j.goodput.ratio:.1f}%" if j.HasField("goodput") else "-"
        rows.append([j.job, j.namespace or "-", state, str(j.generation),
                     f"{j.restarts}/{j.max_restarts}", f"{j.connected}/{j.world_size}", gp,
                     j.barrier or "-"])
    return _table(rows)


def entry_kind(e: pb.TimelineEntry) -> str:
    """What a timeline entry shows as its kind: a decision by its action (restart, ...)."""
    return e.action if e.kind == "decision" and e.action else e.kind


def format_entry(e: pb.TimelineEntry) -> str:
    ts = time.strftime("%H:%M:%S", time.localtime(e.ts)) + f".{int(e.ts % 1 * 1000):03d}"
    who = f"rank {e.rank}" if e.HasField("rank") else ""
    kind = entry_kind(e)
    return f"{ts}  g{e.generation:<3} {who:<9} {printable(kind):<12} {printable(e.message)}"


GOODPUT_ORDER = ("productive", "startup", "recomputed", "detection", "decision", "restart",
                 "outage", "checkpoint", "other_phases", "straggler", "capacity",
                 "preflight", "unattributed")


def format_goodput(g: pb.Goodput) -> str:
    """``goodput: 93.1% of 2h03m`` and one line per category with time in it."""
    out = [f"goodput: {100 * g.ratio:.1f}% of {_duration(g.wall_seconds)} wall time"
           f" ({g.incidents} restart{'' if g.incidents == 1 else 's'}"
           + (f", {g.recomputed_steps} steps recomputed)" if g.HasField("recomputed_steps")
              else ", recomputed steps unknown)")]
    names = [c for c in GOODPUT_ORDER if c in g.seconds] + \
        sorted(c for c in g.seconds if c not in GOODPUT_ORDER)
    for c in names:
        v = g.seconds[c]
        if v > 0 or c == "productive":
            share = 100 * v / g.wall_seconds if g.wall_seconds > 0 else 0.0
            name = "".join(ch if ch.isprintable() else "?" for ch in c[:32])
            out.append(f"  {name:<13} {_duration(v):>8}  {share:5.1f}%")
    if g.per_incident:
        out += ["", format_incidents(g.per_incident)]
    return "\n".join(out)


def format_incidents(incidents: Iterable[pb.GoodputIncident]) -> str:
    """One row per restart: how long detection, decision, restart and the redone training
    took, and where the resume step came from ("-": that stage is not over yet); a link
    outage the job resumed from by itself has a row too, its restart "none"."""
    rows = [["INCIDENT", "KIND", "DETECT", "DECIDE", "RESTART", "RECOMPUTE", "STEPS REDONE",
             "RESUMED AFTER"]]
    def opt(i: pb.GoodputIncident, name: str) -> str:
        return _duration(getattr(i, name)) if i.HasField(name) else "-"

    for i in incidents:
        redone = str(i.recomputed_steps) if i.HasField("recomputed_steps") else (
            "unknown" if i.HasField("restart_seconds") else "-")
        how = i.resume_source if i.resume_source in ("reported", "memory", "peer", "disk") \
            else "first step"
        resumed = f"{i.resumed_step} ({how})" if i.HasField("resumed_step") else "-"
        rows.append([f"g{i.generation}", i.kind[:16], _duration(i.detect_seconds),
                     opt(i, "decide_seconds"),
                     "none" if i.no_restart else opt(i, "restart_seconds"),
                     _duration(i.recompute_seconds), redone, resumed])
    return _table(rows)


def format_job(j: pb.JobInfo) -> str:
    head = printable(f"job {j.job}" + (f" (namespace {j.namespace})" if j.namespace else "")
                     + f": {j.state}")
    out = [head + f", generation {j.generation}, restarts {j.restarts}/{j.max_restarts}, "
           f"{j.connected}/{j.world_size} ranks connected" +
           (", alert only" if j.alert_only else "")]
    if j.barrier:
        out.append(f"barrier: {printable(j.barrier)}")
    if j.busy:  # the arbiter's "job busy, no restart" verdict, while it holds
        out.append(f"busy: {printable(j.busy)}")
    if j.spares:  # warm spares (ftagent run --spare)
        out.append(f"spares: {printable(', '.join(j.spares))}")
    if j.HasField("snapshot_step"):  # ftagent.checkpoint: the step a restart resumes at
        out.append(f"snapshot: newest complete on every rank: step {j.snapshot_step} "
                   "(memory)")
    if j.replicas:  # the peer replicas' ring (arbiter/replica_ring.py)
        out.append(f"replicas: {printable(j.replicas)}")
    if j.HasField("goodput"):
        out += ["", format_goodput(j.goodput)]
    rows = [["RANK", "POD", "NODE", "STATE", "STEP", "LOSS", "LAST STEP", "RESTARTS", "GEN",
             "LAST FAULT"]]
    for r in j.ranks:
        state = (r.state or "-") + ("" if r.connected else " (disconnected)") + \
            (" HUNG" if r.hung else "")
        rows.append([str(r.rank), r.pod or "-", r.node or "-", state,
                     str(r.step) if r.step >= 0 else "-",
                     f"{r.loss:.4g}" if r.HasField("loss") else "-",
                     _age(r.progress_age_seconds), str(r.restarts), str(r.generation),
                     r.last_fault[:60] or "-"])
    if j.ranks:
        out += ["", _table(rows)]
    if j.ranks_omitted:
        out += [f"... and {j.ranks_omitted} more ranks, running (the ranks worth a look are "
                "shown first)"]
    elif j.connected == 0:
        out += ["", "no ranks: every agent has left (kept in the arbiter's history)"]
    out += ["", "timeline:"]
    out += [format_entry(e) for e in j.timeline] or ["(empty)"]
    return "\n".join(out)
