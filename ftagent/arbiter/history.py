"""Job history: what ``ftagent status`` shows of a job once its agents are gone.

The arbiter is stateless for decisions: a running job is rebuilt from its agents'
Hellos, and nothing here decides anything. History only answers "what happened to my
job last night?": a job whose agents all left is kept as a compact ``JobRecord`` with its
timeline for ``--history-retention`` seconds after its last agent left, and, through a
``HistoryStore``, across arbiter restarts.

``HistoryStore`` is the plug: ``record`` takes timeline entries and job records as they
happen, ``load`` gives back what survived a restart, ``forget`` drops a job. The embedded
store is ``history_file.FileHistory`` (``--state-dir``, JSON lines); a Kubernetes store
(Events plus a compact record on the job object) implements the same three calls.

``History`` owns the past jobs in memory, bounded per namespace (``MAX_PAST_JOBS`` each,
its oldest go first) and in all (``MAX_PAST_JOBS_TOTAL``: then the namespace holding the
most past jobs loses its oldest), so one tenant's churn never deletes another namespace's
history (nor the rank owners its record keeps); ``expired(now)`` takes the registry's
clock, so tests inject one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from ftagent.arbiter.ledger import CATEGORIES, INCIDENTS_KEPT, Incident, Ledger
from ftagent.arbiter.state import JobPhase, JobState
from ftagent.arbiter.timeline import Entry
from ftagent.wire import limits
from ftagent.wire.exit_note import ExitNote

log = logging.getLogger("ftagent.arbiter.history")

RETENTION = 24 * 3600.0
MAX_PAST_JOBS = 500  # past jobs kept per namespace once their agents are gone (oldest go first)
MAX_PAST_JOBS_TOTAL = 20_000  # in all: past it, the namespace holding the most loses its oldest
MAX_REASON = 200
FAULTS_KEPT = 64


CULPRIT_RANKS_KEPT = 64  # per job: ranks with their own culprit counter


class Counters(Protocol):
    """What a job's record is written from besides its state: the counters the journal
    keeps (``journal.JobStats``, their one writer) and its goodput ledger."""

    restarts_by_reason: dict[str, int]
    seconds_lost: float
    ledger: Ledger | None


@dataclass(slots=True)
class JobRecord:
    """A job as history keeps it: its last summary, no ranks, no protocol state."""

    job: str
    namespace: str = ""
    world_size: int = 1
    generation: int = 0
    restarts: int = 0
    max_restarts: int = 0
    alert_only: bool = False
    phase: str = JobPhase.STARTING.value
    stop_reason: str = ""
    last_seen: float = 0.0  # wall time the job was last heard of (its last agent left)
    restarts_by_reason: dict[str, int] = field(default_factory=dict)
    seconds_lost: float = 0.0
    # The goodput ledger's seconds per category as of ``last_seen`` (ledger.CATEGORIES).
    goodput: dict[str, float] = field(default_factory=dict)
    goodput_mode: str = ""  # the category time went to when it was written
    goodput_steps: int | None = None  # recomputed steps (None: unknown or no ledger)
    goodput_restarts: int = 0  # restarts the ledger placed
    # its incidents (the newest ledger.INCIDENTS_KEPT), each as ``incident_json`` writes it
    goodput_incidents: list[list[Any]] = field(default_factory=list)
    # who owns each rank, [rank, pod, uid] each (JobState.owners): an arbiter restart must
    # not let another pod take a rank whose pod still exists (jobs._admit)
    owners: list[list[Any]] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.job)

    @property
    def finished(self) -> bool:
        return self.phase in (JobPhase.STOPPED.value, JobPhase.SUCCEEDED.value)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobRecord:
        """Raises ValueError (or KeyError/TypeError) for a record that is not one."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        rec = cls(**kw)
        if not isinstance(rec.job, str) or not rec.job or not isinstance(rec.namespace, str):
            raise ValueError("no job name")
        for n in ("world_size", "generation", "restarts", "max_restarts"):
            if not isinstance(getattr(rec, n), int):
                raise ValueError(f"{n} is not an integer")
        if rec.phase not in {p.value for p in JobPhase}:
            raise ValueError(f"unknown phase {rec.phase!r}")
        rec.last_seen = float(rec.last_seen)
        rec.seconds_lost = float(rec.seconds_lost)
        rec.stop_reason = str(rec.stop_reason)[:MAX_REASON]
        if not isinstance(rec.restarts_by_reason, dict):
            raise ValueError("restarts_by_reason is not an object")
        rec.restarts_by_reason = {str(k)[:64]: int(v) for k, v in
                                  list(rec.restarts_by_reason.items())[:64]}
        if not isinstance(rec.goodput, dict):
            raise ValueError("goodput is not an object")
        rec.goodput = {c: float(rec.goodput[c]) for c in CATEGORIES if c in rec.goodput}
        if not all(0.0 <= v < 1e12 for v in rec.goodput.values()):
            raise ValueError("goodput seconds out of range")
        if rec.goodput_mode and rec.goodput_mode not in CATEGORIES:
            rec.goodput_mode = "unattributed"
        # incidents are for status only: one that is not one is left out, not the record
        got = rec.goodput_incidents if isinstance(rec.goodput_incidents, list) else []
        rec.goodput_incidents = [incident_json(i) for i in map(incident_or_none,
                                                               got[-INCIDENTS_KEPT:]) if i]
        rec.owners = owners_json(owners_from_json(rec.owners, rec.world_size))
        for n in ("goodput_steps", "goodput_restarts"):
            v = getattr(rec, n)
            if not (v is None and n == "goodput_steps") and not (
                    isinstance(v, int) and 0 <= v <= 10**15):
                raise ValueError(f"{n} is not a count")
        return rec


def owners_json(owners: dict[int, tuple[str, str]]) -> list[list[Any]]:
    return [[rank, pod, uid] for rank, (pod, uid) in sorted(owners.items())]


def owners_from_json(v: Any, world_size: int) -> dict[int, tuple[str, str]]:
    """A record's owners, checked where they enter: at most ``world_size`` (itself at most
    limits.MAX_WORLD_SIZE), each a rank of the job with a pod name and uid of bounded
    length. One that is not is left out (that rank is then anyone's whose Hello passes the
    pod checks, as before this record), never the record."""
    if not isinstance(v, list) or not isinstance(world_size, int):
        return {}
    n = max(0, min(world_size, limits.MAX_WORLD_SIZE))
    out: dict[int, tuple[str, str]] = {}
    for o in v[:n]:
        if not (isinstance(o, list) and len(o) == 3):
            continue
        rank, pod, uid = o
        if (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < n
                and isinstance(pod, str) and 0 < len(pod) <= limits.MAX_NAME
                and isinstance(uid, str) and 0 < len(uid) <= limits.MAX_ID):
            out[rank] = (pod, uid)
    return out


def record_of(job: JobState, stats: Counters | None, last_seen: float, *,
              owners: bool = True) -> JobRecord:
    """The job's record; ``owners=False`` leaves the owners out (O(ranks) to copy: only
    a record that is written carries them)."""
    return JobRecord(job=job.job, namespace=job.namespace, world_size=job.world_size,
                     generation=job.generation, restarts=job.restarts,
                     max_restarts=job.max_restarts, alert_only=job.alert_only,
                     phase=job.phase.value, stop_reason=job.stop_reason[:MAX_REASON],
                     last_seen=last_seen,
                     restarts_by_reason=dict(stats.restarts_by_reason) if stats else {},
                     seconds_lost=stats.seconds_lost if stats else 0.0,
                     owners=owners_json(job.owners) if owners else [],
                     **_goodput(stats.ledger if stats else None, last_seen))


def _goodput(led: Ledger | None, at: float) -> dict[str, Any]:
    if led is None:
        return {}
    b = led.breakdown(at)
    return {"goodput": b.seconds, "goodput_mode": led.mode.value,
            "goodput_steps": b.recomputed_steps, "goodput_restarts": b.restarts,
            "goodput_incidents": [incident_json(i) for i in b.incidents]}


# An incident in a record: a list in this order (compact: a record holds up to 64).
INCIDENT_FIELDS = ("generation", "kind", "onset", "detected", "decided", "released",
                   "first_step_at", "reached", "resumed", "resume_source",
                   "recompute_seconds", "superseded", "restarted")
RESUME_SOURCES = ("reported", "first_step", "", "memory", "peer", "disk")
MAX_STEP = limits.MAX_STEP


def incident_json(i: Incident) -> list[Any]:
    return [getattr(i, f) for f in INCIDENT_FIELDS]


def incident_or_none(v: Any) -> Incident | None:
    """``incident_from_json``, or None for one that is not (left out, never raised)."""
    try:
        return incident_from_json(v)
    except (ValueError, TypeError):
        return None


def incident_from_json(v: Any) -> Incident:
    """An incident from a record (``incident_json``'s list); raises ValueError for one
    that is not: times finite, steps counts, the kind a short string. A record written
    before outages were incidents has no ``restarted``: every incident then was a restart."""
    if isinstance(v, list) and len(v) == len(INCIDENT_FIELDS) - 1:
        v = [*v, True]
    if not isinstance(v, list) or len(v) != len(INCIDENT_FIELDS):
        raise ValueError("an incident is not a list of its fields")
    d = dict(zip(INCIDENT_FIELDS, v, strict=True))
    for n in ("onset", "detected", "decided", "released", "first_step_at",
              "recompute_seconds"):
        t = d[n]
        if t is None and n in ("released", "first_step_at"):
            continue
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 1e12:
            raise ValueError(f"incident {n} is not a time")
        d[n] = float(t)
    for n in ("generation", "reached", "resumed"):
        c = d[n]
        if not (c is None and n != "generation") and not (
                isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_STEP):
            raise ValueError(f"incident {n} is not a count")
    if not isinstance(d["kind"], str) or d["resume_source"] not in RESUME_SOURCES \
            or not isinstance(d["superseded"], bool) or not isinstance(d["restarted"], bool):
        raise ValueError("incident kind, resume source, superseded or restarted is not one")
    d["kind"] = d["kind"][:32]
    return Incident(**d)


def shown_state(phase: str, stop_reason: str, gone_for: float) -> str:
    """The state ``ftagent status`` shows for a job none of whose agents is connected."""
    if phase == JobPhase.SUCCEEDED.value:
        return "succeeded"
    if phase == JobPhase.STOPPED.value:
        return f"stopped: {stop_reason}" if stop_reason else "stopped"
    return f"gone: no agent for {max(0.0, gone_for):.0f}s (was {phase})"


@dataclass
class Loaded:
    """What a store gives back after a restart."""

    jobs: list[JobRecord] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)


class HistoryStore(Protocol):
    def record(self, item: Entry | JobRecord) -> None:
        """Keep a timeline entry or a job's latest record. Never raises."""

    def load(self) -> Loaded:
        """What was kept before this process started (bounded like the timeline)."""

    def forget(self, namespace: str, job: str) -> None:
        """Drop the job and its entries (retention over). Never raises."""

    def close(self) -> None: ...


class NoStore:
    """History in memory only: it outlives the job, not the arbiter."""

    def record(self, item: Entry | JobRecord) -> None:
        pass

    def load(self) -> Loaded:
        return Loaded()

    def forget(self, namespace: str, job: str) -> None:
        pass

    def close(self) -> None:
        pass


def evictions(past: Iterable[tuple[tuple[str, str], float]], namespace: str,
              per_namespace: int, total: int) -> list[tuple[str, str]]:
    """Which past jobs ((namespace, job), last seen) to drop after ``namespace`` gained
    one, oldest first: ``namespace``'s over ``per_namespace``, then, while over
    ``total``, the oldest of whichever namespace holds the most. Pure."""
    by_ns: dict[str, list[tuple[float, tuple[str, str]]]] = {}
    for key, last in past:
        by_ns.setdefault(key[0], []).append((last, key))
    out: list[tuple[str, str]] = []
    mine = sorted(by_ns.get(namespace, []))
    while len(mine) > max(per_namespace, 0):
        out.append(mine.pop(0)[1])
    if mine:
        by_ns[namespace] = mine
    count = sum(len(v) for v in by_ns.values())
    while count > max(total, 0):
        biggest = max(by_ns, key=lambda n: len(by_ns[n]))
        jobs = by_ns[biggest]
        jobs.sort()
        out.append(jobs.pop(0)[1])
        if not jobs:
            del by_ns[biggest]
        count -= 1
    return out


class History:
    """Past jobs (no agent left, live state dropped) and retention over them.

    ``on_forget(namespace, job)`` is called when a job leaves history for good (the
    registry drops its timeline then).
    """

    def __init__(self, store: HistoryStore | None = None, retention: float = RETENTION,
                 max_jobs: int = MAX_PAST_JOBS_TOTAL,
                 per_namespace: int = MAX_PAST_JOBS) -> None:
        self.store: HistoryStore = store or NoStore()
        # Does a store keep what is written (--state-dir, the cluster's records)? In memory
        # only, records are not built on the way (the live job is what status reads).
        self.durable = not isinstance(self.store, NoStore)
        self.retention = retention
        self.max_jobs = max_jobs
        self.per_namespace = per_namespace
        self.past: dict[tuple[str, str], JobRecord] = {}
        self._written: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._owners: dict[tuple[str, str], tuple[JobRecord, dict[int, tuple[str, str]]]] = {}
        self.on_forget: Callable[[str, str], None] = lambda namespace, job: None

    def load(self) -> list[Entry]:
        """Records into ``past`` (to be superseded by live jobs); returns the entries."""
        got = self.store.load()
        for rec in sorted(got.jobs, key=lambda r: r.last_seen):
            self.past[rec.key] = rec
        last_ts: dict[tuple[str, str], float] = {}
        for e in got.entries:
            k = (e.namespace, e.job)
            last_ts[k] = max(last_ts.get(k, 0.0), e.ts)
        for k, rec in self.past.items():  # a running job's record may predate its last entry
            rec.last_seen = max(rec.last_seen, last_ts.get(k, 0.0))
        return [e for e in got.entries if (e.namespace, e.job) in self.past]

    def take_exits(self) -> list[ExitNote]:
        """Exit notes agents left in the store's directory (wire/exit_note.py), each once;
        [] for a store that has none."""
        take = getattr(self.store, "take_exits", None)
        return take() if callable(take) else []

    def entry(self, e: Entry) -> None:
        self.store.record(e)

    def update(self, job: JobState, stats: Counters | None, now: float) -> None:
        """Write the job's record when its summary changed since the last write."""
        rec = record_of(job, stats, now, owners=False)
        summary = (len(job.owners), job.owners_print,
                   rec.world_size, rec.generation, rec.restarts, rec.max_restarts,
                   rec.alert_only, rec.phase, rec.stop_reason, job.connected == 0,
                   tuple(sorted(rec.restarts_by_reason.items())), round(rec.seconds_lost, 3),
                   rec.goodput_mode, rec.goodput_steps, rec.goodput_restarts,
                   str(rec.goodput_incidents[-1:]))
        if self._written.get(rec.key) != summary:
            self._written[rec.key] = summary
            rec.owners = owners_json(job.owners)
            self.store.record(rec)

    def retire(self, job: JobState, stats: Counters | None) -> None:
        """The job's live state is dropped: keep its record, or forget it if expired."""
        rec = record_of(job, stats, job.last_seen)
        self.past[rec.key] = rec
        self.store.record(rec)
        self._bound(rec.namespace)

    def _bound(self, namespace: str) -> None:
        """Past jobs within the per-namespace and total bounds: a namespace over its own
        bound loses its oldest; over the total, the namespace with the most past jobs
        does (never the one with few: one tenant's churn costs only its own history)."""
        for key in evictions(((k, r.last_seen) for k, r in self.past.items()), namespace,
                             self.per_namespace, self.max_jobs):
            self.drop(*key)

    def owners(self, key: tuple[str, str]) -> dict[int, tuple[str, str]]:
        """The ranks' owners a past job's record kept, if it did not finish (the same run,
        after an arbiter restart; a finished one's next Hello starts a new run)."""
        rec = self.past.get(key)
        if rec is None or rec.finished:
            return {}
        got = self._owners.get(key)
        if got is None or got[0] is not rec:  # parsed once per record, not per Hello
            got = self._owners[key] = (rec, owners_from_json(rec.owners, rec.world_size))
        return got[1]

    def superseded(self, key: tuple[str, str]) -> JobRecord | None:
        """A live job has this key again: it is no longer a past job."""
        self._owners.pop(key, None)
        return self.past.pop(key, None)

    def expired(self, now: float) -> list[tuple[str, str]]:
        return [k for k, r in self.past.items() if now - r.last_seen > self.retention]

    def drop(self, namespace: str, job: str) -> None:
        self.past.pop((namespace, job), None)
        self._owners.pop((namespace, job), None)
        self._written.pop((namespace, job), None)
        self.store.forget(namespace, job)
        self.on_forget(namespace, job)

    def records(self) -> Iterable[JobRecord]:
        return self.past.values()

    def close(self) -> None:
        self.store.close()
