"""``--state-dir``: job history in an append-only JSON lines file, bounded.

One file, ``DIR/history.jsonl``, one JSON object a line: ``{"t": "e", ...}`` a timeline
entry, ``{"t": "j", ...}`` a job's latest record (a later one replaces an earlier one),
``{"t": "f", "namespace", "job"}`` the job was forgotten. Each line is one ``write`` on
an ``O_APPEND`` descriptor, so a SIGKILLed arbiter loses nothing it wrote and a torn
write leaves at most a truncated last line. Beside it, ``DIR/exits/`` holds the exits
agents could not deliver (``wire/exit_note.py``), read and removed by ``take_exits``.

Bounded: the store mirrors what it keeps in memory (per job the record and the last
``keep_per_job`` entries, as the timeline keeps; at most ``max_jobs`` jobs). When the file
passes ``max_bytes`` it is compacted: the mirror is written to ``history.jsonl.tmp``,
newest jobs first, up to half of ``max_bytes``, and renamed over the file. So the
directory never holds much more than ``max_bytes`` plus one compaction's worth.

A line that cannot be read (a truncated last line after a crash, a corrupt one) is
skipped with one log line for the whole file, and the file is compacted at once so that
the next append does not land after a torn line. Nothing here raises after start-up: a
failed write is logged (once per run of failures) and history goes on in memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import Counter, deque
from pathlib import Path
from typing import Any

from ftagent.arbiter.history import JobRecord, Loaded
from ftagent.arbiter.state import Culprit
from ftagent.arbiter.timeline import KEEP_PER_JOB, MAX_ENTRY_CULPRITS, Entry
from ftagent.wire import exit_note
from ftagent.wire.exit_note import ExitNote
from ftagent.wire.limits import MAX_NAME

log = logging.getLogger("ftagent.arbiter.history")

FILE = "history.jsonl"
MAX_BYTES = 64 * 1024 * 1024
MAX_JOBS = 2000

_ENTRY_FIELDS = ("seq", "ts", "job", "namespace", "generation", "kind", "message", "rank",
                 "fault_id", "action")


def entry_json(e: Entry) -> dict[str, Any]:
    d: dict[str, Any] = {"t": "e"}
    for f in _ENTRY_FIELDS:
        d[f] = getattr(e, f)
    if e.culprits:  # [[rank, pod, node], ...]: absent in entries without (and older files)
        d["culprits"] = [[c.rank, c.pod, c.node] for c in e.culprits]
    return d


def culprits_from_json(v: Any) -> tuple[Culprit, ...]:
    """An entry's culprits as written by ``entry_json``; anything else is none (a file
    is this arbiter's own, but a torn or hand-edited line loses only its culprits)."""
    if not isinstance(v, list):
        return ()
    out = []
    for c in v[:MAX_ENTRY_CULPRITS]:
        if isinstance(c, list) and len(c) == 3 and isinstance(c[0], int) and \
                not isinstance(c[0], bool) and isinstance(c[1], str) and isinstance(c[2], str):
            out.append(Culprit(c[0], c[1][:MAX_NAME], c[2][:MAX_NAME]))
    return tuple(out)


def entry_from_json(d: dict[str, Any]) -> Entry:
    rank = d.get("rank")
    e = Entry(int(d["seq"]), float(d["ts"]), str(d["job"]), str(d.get("namespace", "")),
              int(d["generation"]), str(d["kind"]), str(d["message"]),
              None if rank is None else int(rank), str(d.get("fault_id", "")),
              str(d.get("action", "")), culprits_from_json(d.get("culprits")))
    if not e.job:
        raise ValueError("no job name")
    return e


class _Job:
    __slots__ = ("record", "entries", "last")

    def __init__(self, keep: int) -> None:
        self.record: JobRecord | None = None
        self.entries: deque[Entry] = deque(maxlen=keep)
        self.last = 0.0  # wall time of the latest thing kept, for eviction order


class FileHistory:
    def __init__(self, directory: str, *, keep_per_job: int = KEEP_PER_JOB,
                 max_bytes: int = MAX_BYTES, max_jobs: int = MAX_JOBS) -> None:
        """Creates ``directory``; raises OSError when it cannot be created or written."""
        self.dir = Path(directory)
        self.path = self.dir / FILE
        self.keep = keep_per_job
        self.max_bytes = max_bytes
        self.max_jobs = max_jobs
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._failing = False
        self.dir.mkdir(parents=True, exist_ok=True)
        bad, first_bad, lines, torn = self._read()
        self.size = self.path.stat().st_size if self.path.exists() else 0
        if bad:
            log.warning("history %s: skipped %d unreadable line%s (first at line %d of %d%s)",
                        self.path, bad, "" if bad == 1 else "s", first_bad, lines,
                        ", a truncated last line" if torn else "")
        if bad or torn or self.size > max_bytes:
            self._compact()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.size = os.fstat(self._fd).st_size

    # ------------------------------------------------------------------ reading

    def _read(self) -> tuple[int, int, int, bool]:
        """Fill the mirror from the file: (bad lines, first bad line, lines, torn end)."""
        if not self.path.exists():
            return 0, 0, 0, False
        data = self.path.read_bytes()
        torn = bool(data) and not data.endswith(b"\n")
        bad = first_bad = n = 0
        for n, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                self._apply(json.loads(raw))
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
                bad += 1
                first_bad = first_bad or n
        return bad, first_bad, n, torn

    def _apply(self, d: Any) -> None:
        t = d["t"]
        if t == "e":
            self._keep_entry(entry_from_json(d))
        elif t == "j":
            self._keep_record(JobRecord.from_json(d))
        elif t == "f":
            self._jobs.pop((str(d["namespace"]), str(d["job"])), None)
        else:
            raise ValueError(f"unknown line type {t!r}")

    def _slot(self, key: tuple[str, str]) -> _Job:
        j = self._jobs.get(key)
        if j is None:
            j = self._jobs[key] = _Job(self.keep)
            if len(self._jobs) > self.max_jobs:  # the namespace holding the most pays
                counts = Counter(ns for ns, _ in self._jobs)
                biggest = max(counts, key=lambda n: counts[n])
                oldest = min((k for k in self._jobs if k[0] == biggest),
                             key=lambda k: self._jobs[k].last)
                if oldest != key:
                    del self._jobs[oldest]
        return j

    def _keep_entry(self, e: Entry) -> None:
        j = self._slot((e.namespace, e.job))
        j.entries.append(e)
        j.last = max(j.last, e.ts)

    def _keep_record(self, r: JobRecord) -> None:
        j = self._slot(r.key)
        j.record = r
        j.last = max(j.last, r.last_seen)

    def load(self) -> Loaded:
        out = Loaded()
        for j in self._jobs.values():
            if j.record is not None:
                out.jobs.append(j.record)
            out.entries.extend(j.entries)
        out.entries.sort(key=lambda e: e.seq)
        return out

    # ------------------------------------------------------------------ writing

    def record(self, item: Entry | JobRecord) -> None:
        if isinstance(item, Entry):
            self._keep_entry(item)
            d = entry_json(item)
        else:
            self._keep_record(item)
            d = {"t": "j", **item.to_json()}
        self._write(d)

    def forget(self, namespace: str, job: str) -> None:
        if self._jobs.pop((namespace, job), None) is not None:
            self._write({"t": "f", "namespace": namespace, "job": job})

    def _write(self, d: dict[str, Any]) -> None:
        line = (json.dumps(d, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
        try:
            os.write(self._fd, line)
            self.size += len(line)
            if self.size > self.max_bytes:
                self._compact()
                os.close(self._fd)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                self.size = os.fstat(self._fd).st_size
            if self._failing:
                log.info("history %s: writing again", self.path)
                self._failing = False
        except OSError as e:
            if not self._failing:
                log.warning("history %s: cannot write (%s): history goes on in memory "
                            "until it can", self.path, e.strerror or e)
                self._failing = True

    def _compact(self) -> None:
        """Rewrite the file from the mirror, newest jobs first, up to max_bytes / 2."""
        budget = self.max_bytes // 2
        blocks: list[bytes] = []
        used = 0
        for key in sorted(self._jobs, key=lambda k: self._jobs[k].last, reverse=True):
            j = self._jobs[key]
            lines = []
            if j.record is not None:
                lines.append({"t": "j", **j.record.to_json()})
            lines += [entry_json(e) for e in j.entries]
            block = b"".join((json.dumps(x, separators=(",", ":"), ensure_ascii=False)
                              + "\n").encode() for x in lines)
            if used + len(block) > budget:
                del self._jobs[key]  # older than what fits: dropped from the file for good
                continue
            blocks.append(block)
            used += len(block)
        tmp = self.path.with_name(FILE + ".tmp")
        with open(tmp, "wb") as f:
            for b in reversed(blocks):
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.size = used

    def take_exits(self) -> list[ExitNote]:
        """Exits agents could not deliver, left in ``DIR/exits/`` (wire/exit_note.py):
        read and removed."""
        return exit_note.take(str(self.dir))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
