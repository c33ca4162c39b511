"""Who hung, where and why, from the ranks' flight-recorder summaries. Pure: no I/O.

Input: ``{rank: summary or None}`` for every rank of the job (the summaries of
``ftagent/agent/fr_summary.py``, untrusted: each value is checked and bounded here; None
is a rank that sent no dump). Per process group, innermost (fewest ranks) first:

* **behind**: a rank whose last enqueued collective is below the group's highest, N,
  never reached collective #N (NVRx's rule). A rank behind in an outer group that is
  itself waiting inside an inner group's collective is *waiting*, not a culprit: the
  inner group names who it waits for.
* **mismatch**: ranks at the same sequence number, not yet all complete, with different
  op, sizes or dtypes: a program error; both calls are named.
* **stall**: everyone in the group inside the same collective, no one behind: the fault
  is below the program (network, GPU, the backend).
* **unresponsive**: a rank with no dump while a rank that sent one waits inside a
  collective: its agent answered without one (the trainer stopped -- SIGSTOP, a
  debugger --, or its trigger thread starved by a main thread holding the GIL in C code),
  or it sent nothing at all (dead, or its whole pod frozen: a node gone dark keeps its
  peers' sockets open, so they wait instead of failing). Without a silent rank's dump no
  group can be said to have "no one behind": then no group is called a stall.

The first of mismatch, behind, unresponsive, stall found is the verdict's kind (rows R1-R4
of ``detect/stall.py``'s table; R0: none); the verdict is the stall policy's one
``Verdict`` type, its culprits the rows' ranks, every finding kept for the reason.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftagent.detect.stall import FR_KINDS, Act, Finding, State, Verdict

_ROW = {kind: row for row, kind in FR_KINDS.items()}

MAX_RANKS = 1 << 16
MAX_GROUPS = 64  # groups one rank's summary lists
MAX_JOB_GROUPS = 1 << 14  # distinct groups over a job's ranks
MAX_ENTRIES = 8
MAX_TEXT = 160


@dataclass(frozen=True)
class Call:
    """One rank's collective #seq in one group."""

    rank: int
    seq: int
    op: str
    in_sizes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    frame: str = ""

    def signature(self) -> tuple[Any, ...]:
        return self.op, self.in_sizes, self.dtypes

    def describe(self) -> str:
        sizes = ",".join("x".join(map(str, s)) or "scalar" for s in self.in_sizes)
        where = f" at {self.frame}" if self.frame else ""
        return f"rank {self.rank} {self.op}([{sizes}] {'/'.join(self.dtypes)}){where}"


@dataclass
class _Rank:
    enqueued: int
    completed: int
    calls: dict[int, Call]



def _int(v: Any, default: int = -1) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _text(v: Any) -> str:
    return v[:MAX_TEXT] if isinstance(v, str) else ""


def _call(rank: int, e: Any) -> Call | None:
    if not isinstance(e, Mapping):
        return None
    sizes = e.get("in_sizes")
    dtypes = e.get("dtypes")
    frames = e.get("frames")
    return Call(rank, _int(e.get("seq")), _text(e.get("op")),
                tuple(tuple(_int(d, 0) for d in s[:8]) for s in sizes[:8]
                      if isinstance(s, list)) if isinstance(sizes, list) else (),
                tuple(_text(d) for d in dtypes[:8]) if isinstance(dtypes, list) else (),
                _text(frames[0]) if isinstance(frames, list) and frames else "")


@dataclass(frozen=True)
class Summary:
    """One rank's summary, checked, bounded and parsed once, when its answer arrives
    (``read``): the verdict over 1,024 ranks then compares positions, not 16,000 raw
    entries (parsing every summary at decision time took 0.6 s of the 1 s budget there,
    bench/verdict_scale.py). ``silent``: the rank's agent answered without a dump."""

    groups: tuple[tuple[str, _Rank], ...]
    silent: bool = False


def read(s: Any, rank: int) -> Summary | None:
    """``s``, rank ``rank``'s summary as sent (or already read), as a ``Summary``; None
    for a rank that sent none (not a mapping)."""
    if isinstance(s, Summary):
        return s
    if not isinstance(s, Mapping):
        return None
    listed = s.get("groups")
    if not isinstance(listed, list):
        return Summary((), silent=True)
    out = []
    for g in listed[:MAX_GROUPS]:
        if not isinstance(g, Mapping):
            continue
        entries = g.get("entries")
        if not isinstance(entries, list):
            entries = []
        calls = {c.seq: c for c in (_call(rank, e) for e in entries[:MAX_ENTRIES])
                 if c is not None}
        out.append((_text(g.get("name")), _Rank(_int(g.get("enqueued")),
                                                _int(g.get("completed")), calls)))
    return Summary(tuple(out))


def _groups(summaries: Mapping[int, Summary | None]) -> dict[str, dict[int, _Rank]]:
    """name -> {rank: its state}, from the summaries read; bounded (each rank lists at
    most MAX_GROUPS; a job has at most MAX_JOB_GROUPS distinct ones: 1,024 ranks in
    tensor-parallel groups of 8 have 128, plus their data- and pipeline-parallel ones)."""
    out: dict[str, dict[int, _Rank]] = {}
    for rank, s in summaries.items():
        if s is None:
            continue
        for name, st in s.groups:
            if name not in out and len(out) >= MAX_JOB_GROUPS:
                continue
            out.setdefault(name, {})[rank] = st
    return out


def _describe_op(members: Mapping[int, _Rank], seq: int) -> str:
    for r in members.values():
        if seq in r.calls:
            return r.calls[seq].op
    return ""


def decide(summaries: Mapping[int, Any], world: int | None = None) -> Verdict:
    """The verdict over ``summaries`` (rank -> summary, ``{}`` for an agent that answered
    without its rank's dump, or None); ``world``: the job's rank count, so a rank absent
    from ``summaries`` (it sent nothing at all) is unresponsive too."""
    ranks = set(list(summaries)[:MAX_RANKS])
    read_in = {r: read(summaries[r], r) for r in ranks if r in summaries}
    if world is not None:
        ranks |= set(range(min(world, MAX_RANKS)))
    silent = sorted(r for r in ranks if (p := read_in.get(r)) is None or p.silent)
    absent = [r for r in silent if read_in.get(r) is None]
    groups = _groups(read_in)
    order = sorted(groups, key=lambda n: (len(groups[n]), n))
    findings: list[Finding] = []
    waiting: dict[int, str] = {}  # rank -> the inner group it waits in
    culprits: dict[str, list[int]] = {"mismatch": [], "behind": [], "stall": []}
    for name in order:
        members = groups[name]
        top = max(r.enqueued for r in members.values())
        if top <= 0:
            continue
        low_done = min(r.completed for r in members.values())
        found = _mismatch(name, members, low_done)
        if found is not None:
            findings.append(found)
            culprits["mismatch"].extend(found.ranks)
        behind = sorted(r for r, st in members.items() if st.enqueued < top)
        op = _describe_op(members, top)
        if behind:
            named = [r for r in behind if r not in waiting]
            for r in behind:
                if r in waiting:
                    findings.append(Finding(
                        "waiting", name, (r,), top, op,
                        f"rank {r} is behind in group {name} (at #{members[r].enqueued}) "
                        f"because it waits in group {waiting[r]}"))
            if named:
                where = ", ".join(f"rank {r} at #{members[r].enqueued}" for r in named)
                findings.append(Finding(
                    "behind", name, tuple(named), top, op,
                    f"{where} never reached collective #{top} ({op}) of process group "
                    f"{name}; {_waiters(r for r in members if r not in behind)}"))
                culprits["behind"].extend(named)
        inside = [r for r, st in members.items() if st.enqueued == top and st.completed < top]
        for r in inside:
            waiting.setdefault(r, name)
        if not behind and found is None and inside and len(inside) == len(members) \
                and not silent:
            findings.append(Finding(
                "stall", name, tuple(sorted(inside)), top, op,
                f"all ranks of group {name} ({_list(inside)}) are inside collective #{top} "
                f"({op}) and none is behind: the collective itself stalls (network, GPU, "
                "backend)"))
            culprits["stall"].extend(inside)
    if silent:
        findings.append(Finding("unresponsive", "", tuple(silent),
                                message=_unresponsive(silent, absent, groups, waiting)))
    for kind, rs in (("mismatch", culprits["mismatch"]), ("behind", culprits["behind"]),
                     ("unresponsive", silent), ("stall", culprits["stall"])):
        if rs:
            lead = [f for f in findings if f.kind == kind]
            key = f"{lead[0].group}#{lead[0].seq}: {lead[0].message}" \
                if kind == "mismatch" else ""
            return Verdict(State.HUNG, Act.DECLARE, _ROW[kind],
                           "; ".join(f.message for f in lead[:4]),
                           culprits=tuple(sorted(set(rs))), findings=tuple(findings), key=key)
    return Verdict(State.UNDECIDED, Act.NONE, "R0",
                   "the flight recorder shows no rank stuck in a collective",
                   findings=tuple(findings))


def waits_on_silent(v: Verdict) -> bool:
    """An unresponsive verdict some rank's dump backs: a rank that sent one waits inside
    a collective (else every rank is silent -- torch without a recorder -- or no one
    waits on the silent ones, and their silence names no culprit)."""
    return v.kind == "unresponsive" and any(
        f.kind == "unresponsive" and " waits in " in f.message for f in v.findings)


def _unresponsive(silent: list[int], absent: list[int], groups: Mapping[str, Any],
                  waiting: Mapping[int, str]) -> str:
    """Who gave no dump, how (an agent that answered without one, or no answer at all),
    and the collective the others wait in meanwhile (innermost group first)."""
    parts = []
    quiet = [r for r in silent if r not in absent]
    if quiet:
        parts.append(f"rank {_list(quiet)} gave no flight-recorder dump (its agent answered, "
                     "its trainer did not: stopped, or a main thread holding the GIL)")
    if absent:
        parts.append(f"rank {_list(absent)} sent nothing (dead, or its pod unresponsive)")
    text = " and ".join(parts)
    for r, name in sorted(waiting.items(), key=lambda kv: (len(groups[kv[1]]), kv[0])):
        top = groups[name][r].enqueued
        who = sorted(w for w, g in waiting.items() if g == name)
        text += (f" while {_waiters(who).removesuffix(' in it')} in collective #{top} "
                 f"({_describe_op(groups[name], top)}) of process group {name}")
        break
    return text


def _mismatch(name: str, members: Mapping[int, _Rank], low_done: int) -> Finding | None:
    """The first not-yet-complete sequence number whose calls differ between ranks."""
    seqs = sorted({s for st in members.values() for s in st.calls if s > low_done})
    for seq in seqs:
        calls = [st.calls[seq] for _, st in sorted(members.items()) if seq in st.calls]
        first = calls[0]
        other = next((c for c in calls[1:] if c.signature() != first.signature()), None)
        if other is not None:
            what = "op" if other.op != first.op else \
                "sizes" if other.in_sizes != first.in_sizes else "dtypes"
            return Finding("mismatch", name, (first.rank, other.rank), seq, first.op,
                           f"collective mismatch ({what}) at #{seq} of process group {name}: "
                           f"{first.describe()} but {other.describe()}")
    return None


def _waiters(ranks: Any) -> str:
    rs = sorted(ranks)
    return f"rank {rs[0]} waits in it" if len(rs) == 1 else f"ranks {_list(rs)} wait in it"


def _list(ranks: Any) -> str:
    rs = sorted(ranks)
    return ", ".join(map(str, rs[:16])) + (f" and {len(rs) - 16} more" if len(rs) > 16 else "")


def summary_of(stacks_json: str, rank: int) -> dict[str, Any] | None:
    """The ``flight_recorder`` part of a rank's DUMP_STACKS answer (agent/flight_recorder.py)
    as the summary of ``rank`` itself: None when the agent sent none (recorder off, an old
    agent), ``{}`` when it sent the key but no dump of its own rank came. A summary that
    claims another rank is not taken: one agent speaks for its own rank only."""
    try:
        data = json.loads(stacks_json)
    except (ValueError, TypeError, RecursionError):
        return None
    return summary_in(data, rank)


def reading(data: Any, rank: int) -> Summary | None:
    """Rank ``rank``'s summary in an answer already parsed, read (``summary_in`` then
    ``read``): what the arbiter keeps for the flight recorder's verdict, in one call."""
    return read(summary_in(data, rank), rank)


def summary_in(data: Any, rank: int) -> dict[str, Any] | None:
    """``summary_of`` for an answer already parsed (the registry parses it once)."""
    fr = data.get("flight_recorder") if isinstance(data, dict) else None
    if not isinstance(fr, dict):
        return None
    listed = fr.get("summaries")
    for s in listed[:64] if isinstance(listed, list) else []:
        if isinstance(s, dict) and _int(s.get("rank")) == rank:
            return s
    return {}
