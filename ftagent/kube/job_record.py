"""Job history kept in Kubernetes: one ConfigMap per job, a compact, bounded record.

In a cluster the arbiter has no disk worth keeping (its pods come and go, two replicas
share nothing), so ``ftagent status JOB`` after an arbiter restart or a failover reads a
finished job's timeline back from the API server. This is a ``HistoryStore``
(arbiter/history.py) like ``--state-dir``'s file, with the same three calls:

* ``record`` (on the event loop, never blocks, never raises) updates an in-memory mirror
  and marks the job dirty; a writer thread writes dirty jobs after ``debounce`` seconds,
  so a burst of timeline entries (a barrier of 1,000 ranks) is one write, not 1,000;
* ``load`` (blocking, at start or when this replica becomes leader) lists the records by
  label and gives back every job and its entries; a ConfigMap that is not a record we can
  read is skipped with one log line;
* ``forget`` deletes the job's ConfigMap (its retention is over).

One ConfigMap ``ftagent-job.<namespace>.<job>.<hash>`` (``ftagent-job.<job>.<hash>``
without a namespace; names that are not DNS labels are shown folded to one) in the
arbiter's own namespace: the hash (80 bits of SHA-256 of the exact namespace and job)
makes two jobs' names differ whatever they are called -- the readable part alone did not
(a job named like another job's hashed name took over its record). Records under the
names of earlier releases (no hash) are read back, rewritten under the new name and
removed. Labelled
``ftagent.io/history=job``. Its ``data``: ``record.json`` (the job's ``JobRecord`` plus
``dropped``: how many older entries are no longer in it) and ``timeline.jsonl`` (the
newest entries that fit ``max_bytes``, oldest first, messages clipped). Writes are a full
replace with the resourceVersion last seen; a 409 re-reads it and writes again (this
replica is the only writer: the leader). The API server failing costs nothing but the
record: a failed write is logged once per run of failures and retried with backoff.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ftagent.arbiter.history import JobRecord, Loaded
from ftagent.arbiter.history_file import entry_from_json, entry_json
from ftagent.arbiter.timeline import KEEP_PER_JOB, Entry

log = logging.getLogger("ftagent.kube.job_record")

PREFIX = "ftagent-job"
LABEL = "ftagent.io/history"
LABELS = {LABEL: "job", "app.kubernetes.io/managed-by": "ftagent"}
MAX_BYTES = 128 * 1024  # of one record's data (a ConfigMap may hold 1 MiB)
MAX_MESSAGE = 1000  # characters of one entry's message kept in the record
# The ranks' owners ([rank, pod, uid] each, ~60 bytes) the record keeps on top of
# MAX_BYTES (a ConfigMap may hold 1 MiB): about 13,000 ranks. A job with more keeps none
# (one log line): a restarted arbiter then knows a rank's pod only from its next Hello.
MAX_OWNER_BYTES = 768 * 1024
_OWNERS_TOO_BIG: set[tuple[str, str]] = set()
DEBOUNCE = 1.0
MAX_JOBS = 2000  # records read back at load (the history keeps 500)
PAGE = 200
BACKOFF_CAP = 30.0
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def configmap_name(namespace: str, job: str) -> str:
    """``ftagent-job.<namespace>.<job>.<hash of both>``: distinct for distinct jobs."""
    digest = hashlib.sha256(f"{namespace}\0{job}".encode()).hexdigest()[:20]
    parts = [p for p in (namespace, job) if p]
    if not all(len(p) <= 63 and _NAME.match(p) for p in parts):
        readable = re.sub(r"[^a-z0-9-]+", "-", job.lower()).strip("-")[:40].strip("-")
        parts = [readable] if readable else []
    return ".".join([PREFIX, *parts, digest])


def legacy_configmap_name(namespace: str, job: str) -> str:
    """The name earlier releases gave a job's record (no hash unless the names were not
    DNS labels): read back at load, then replaced by ``configmap_name``."""
    parts = [p for p in (namespace, job) if p]
    name = ".".join([PREFIX, *parts])
    if all(len(p) <= 63 and _NAME.match(p) for p in parts) and len(name) <= 253:
        return name
    digest = hashlib.sha256(f"{namespace}\0{job}".encode()).hexdigest()[:20]
    readable = re.sub(r"[^a-z0-9-]+", "-", job.lower()).strip("-")[:40]
    return f"{PREFIX}.{readable + '-' if readable else ''}{digest}"


@dataclass
class _Job:
    record: JobRecord | None = None
    entries: deque[Entry] = field(default_factory=lambda: deque(maxlen=KEEP_PER_JOB))
    dropped: int = 0  # entries gone from the mirror itself (older than KEEP_PER_JOB)
    last: float = 0.0


def encode(record: JobRecord, entries: Iterable[Entry], dropped: int,
           max_bytes: int = MAX_BYTES) -> tuple[dict[str, str], int]:
    """The ConfigMap's ``data`` for one job: the newest entries that fit ``max_bytes``.
    Returns (data, entries dropped in all)."""
    lines: list[str] = []
    items = list(entries)
    used = 0
    # record.json: a JobRecord is a few hundred bytes, plus its goodput incidents (up to
    # 64 short lists)
    head_room = 1024 + len(json.dumps(record.goodput_incidents, separators=(",", ":")))
    budget = max_bytes - head_room
    owners = record.owners
    if owners and len(json.dumps(owners, separators=(",", ":")).encode()) > MAX_OWNER_BYTES:
        if record.key not in _OWNERS_TOO_BIG:  # one line per job, not per write
            if len(_OWNERS_TOO_BIG) >= 1000:
                _OWNERS_TOO_BIG.clear()
            _OWNERS_TOO_BIG.add(record.key)
            log.warning("job %s/%s: its %d ranks' owners do not fit its history record: "
                        "not kept", record.namespace, record.job, len(owners))
        owners = []
    kept = 0
    for e in reversed(items):
        d = entry_json(e)
        del d["t"]
        if len(d["message"]) > MAX_MESSAGE:
            d["message"] = d["message"][:MAX_MESSAGE - 1] + "…"
        line = json.dumps(d, separators=(",", ":"), ensure_ascii=False)
        size = len(line.encode()) + 1
        if used + size > budget:
            break
        lines.append(line)
        used += size
        kept += 1
    total_dropped = dropped + len(items) - kept
    rec = {**record.to_json(), "owners": owners, "dropped": total_dropped}
    return ({"record.json": json.dumps(rec, separators=(",", ":"), ensure_ascii=False),
             "timeline.jsonl": "\n".join(reversed(lines))}, total_dropped)


def decode(data: Any) -> tuple[JobRecord, list[Entry], int]:
    """A ConfigMap's ``data`` back; raises ValueError (or KeyError/TypeError) if it is not
    a record. Entries of another job than the record's are not taken."""
    if not isinstance(data, dict):
        raise ValueError("no data")
    raw = data.get("record.json")
    if not isinstance(raw, str) or len(raw) > 64 * 1024:
        raise ValueError("no record.json")
    d = json.loads(raw)
    if not isinstance(d, dict):
        raise ValueError("record.json is not an object")
    dropped = d.get("dropped", 0)
    rec = JobRecord.from_json(d)
    entries: list[Entry] = []
    text = data.get("timeline.jsonl", "")
    if not isinstance(text, str):
        raise ValueError("timeline.jsonl is not text")
    for line in text.split("\n")[-KEEP_PER_JOB:]:
        if not line.strip():
            continue
        e = entry_from_json({"t": "e", **json.loads(line)})
        if (e.namespace, e.job) == rec.key:
            entries.append(Entry(e.seq, e.ts, e.job, e.namespace, e.generation, e.kind,
                                 e.message[:MAX_MESSAGE], e.rank, e.fault_id[:128],
                                 e.action[:32], e.culprits))
    return rec, entries, int(dropped) if isinstance(dropped, int) else 0


class ConfigMaps:
    """The calls on ConfigMaps in one namespace, through the real ``kubernetes`` client."""

    def __init__(self, api_client: Any, namespace: str, timeout: float = 10.0) -> None:
        from kubernetes import client

        self.api: Any = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.timeout = timeout

    def list(self) -> list[dict[str, Any]]:
        """Every record's ConfigMap (label-selected, paged, at most MAX_JOBS)."""
        out: list[dict[str, Any]] = []
        cont = ""
        while len(out) < MAX_JOBS:
            kw: dict[str, Any] = {"label_selector": f"{LABEL}=job", "limit": PAGE}
            if cont:
                kw["_continue"] = cont
            resp = self.api.list_namespaced_config_map(
                self.namespace, _preload_content=False, _request_timeout=self.timeout, **kw)
            body = json.loads(resp.data)
            items = body.get("items") if isinstance(body, dict) else None
            if not isinstance(items, list):
                raise ValueError("the ConfigMap list has no items")
            out.extend(i for i in items if isinstance(i, dict))
            meta = body.get("metadata")
            cont = meta.get("continue", "") if isinstance(meta, dict) else ""
            if not cont or not isinstance(cont, str):
                break
        return out[:MAX_JOBS]

    def version(self, name: str) -> str | None:
        """The ConfigMap's resourceVersion, None when it does not exist."""
        from kubernetes.client.rest import ApiException

        try:
            resp = self.api.read_namespaced_config_map(
                name, self.namespace, _preload_content=False, _request_timeout=self.timeout)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        meta = json.loads(resp.data).get("metadata") or {}
        return str(meta.get("resourceVersion", ""))

    def put(self, name: str, data: dict[str, str], annotations: dict[str, str],
            version: str | None) -> str:
        """Create (``version`` None) or replace; returns the new resourceVersion. Raises
        ApiException (409 when someone wrote it since ``version``, or it exists)."""
        body: dict[str, Any] = {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": self.namespace, "labels": dict(LABELS),
                         "annotations": annotations},
            "data": data}
        if version is None:
            resp = self.api.create_namespaced_config_map(
                self.namespace, body, _preload_content=False, _request_timeout=self.timeout)
        else:
            body["metadata"]["resourceVersion"] = version
            resp = self.api.replace_namespaced_config_map(
                name, self.namespace, body, _preload_content=False,
                _request_timeout=self.timeout)
        meta = json.loads(resp.data).get("metadata") or {}
        return str(meta.get("resourceVersion", ""))

    def delete(self, name: str) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.api.delete_namespaced_config_map(name, self.namespace,
                                                  _request_timeout=self.timeout)
        except ApiException as e:
            if e.status != 404:
                raise


def _why(e: BaseException) -> str:
    status = getattr(e, "status", None)
    if status == 403:
        return ("forbidden (403): the arbiter's service account needs get, list, create, "
                "update and delete on configmaps in its namespace")
    if status:
        return f"HTTP {status} {getattr(e, 'reason', '') or ''}".strip()
    return f"{type(e).__name__}: {e}"[:300]


class JobRecords:
    """The Kubernetes ``HistoryStore``: see the module docstring."""

    def __init__(self, api: ConfigMaps, *, debounce: float = DEBOUNCE,
                 max_bytes: int = MAX_BYTES, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.api = api
        self.debounce = debounce
        self.max_bytes = max_bytes
        self.clock = clock
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._deletes: set[str] = set()
        self._versions: dict[str, str] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._urgent = False  # flush() asked: write now
        self._busy = False  # a write is in flight
        self._failing = ""
        self._retry_at = 0.0
        self._fails = 0
        self.writes = 0  # ConfigMap writes made (for tests and the bench)
        self._thread = threading.Thread(target=self._run, name="job-records", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ HistoryStore

    def load(self) -> Loaded:
        """List the records (blocking). An unreachable API server is one log line and an
        empty history: the arbiter still starts and decides."""
        out = Loaded()
        try:
            items = self.api.list()
        except Exception as e:
            log.warning("job records in namespace %s cannot be read (%s): history starts "
                        "empty", self.api.namespace, _why(e))
            return out
        bad: list[str] = []
        jobs: dict[tuple[str, str], _Job] = {}
        versions: dict[str, str] = {}
        moved: dict[str, tuple[str, str]] = {}  # an earlier release's name -> its job
        for item in items:
            got = item.get("metadata")
            meta: dict[str, Any] = got if isinstance(got, dict) else {}
            name = str(meta.get("name", "?"))[:253]
            try:
                rec, entries, dropped = decode(item.get("data"))
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
                bad.append(name)
                continue
            current = configmap_name(*rec.key)
            if name != current:
                if name != legacy_configmap_name(*rec.key):
                    bad.append(name)  # not where this release or an earlier one puts it
                    continue
                moved[name] = rec.key
            old = jobs.get(rec.key)
            if old is not None:  # under both names (moved, then a restart): the newer
                if old.last >= rec.last_seen:
                    continue
                out.jobs.remove(old.record)  # type: ignore[arg-type]
            jobs[rec.key] = _Job(rec, deque(entries, maxlen=KEEP_PER_JOB), dropped,
                                 rec.last_seen)
            if name == current:
                versions[current] = str(meta.get("resourceVersion", ""))
            out.jobs.append(rec)
        for j in jobs.values():
            out.entries.extend(j.entries)
        if bad:
            log.warning("job records: skipped %d ConfigMap%s that are not records we can "
                        "read (first: %s)", len(bad), "" if len(bad) == 1 else "s", bad[0])
        with self._cond:
            self._jobs = jobs
            self._versions = versions
            self._dirty.clear()
            # a record under an earlier release's name: written under its own, then removed
            self._dirty.update(k for k in moved.values() if k in jobs)
            self._deletes.update(moved)
            if moved:
                self._cond.notify()
        out.entries.sort(key=lambda e: e.seq)
        return out

    def record(self, item: Entry | JobRecord) -> None:
        key = (item.namespace, item.job)
        with self._cond:
            j = self._jobs.get(key)
            if j is None:
                j = self._jobs[key] = _Job()
            if isinstance(item, Entry):
                if len(j.entries) == j.entries.maxlen:
                    j.dropped += 1
                j.entries.append(item)
                j.last = max(j.last, item.ts)
            else:
                j.record = item
                j.last = max(j.last, item.last_seen)
            if j.record is not None:  # entries alone (before the first record) wait
                self._dirty.add(key)
                self._deletes.discard(configmap_name(*key))
                self._cond.notify()

    def forget(self, namespace: str, job: str) -> None:
        with self._cond:
            self._jobs.pop((namespace, job), None)
            self._dirty.discard((namespace, job))
            self._deletes.add(configmap_name(namespace, job))
            self._cond.notify()

    def discard_pending(self) -> None:
        """Drop writes not yet made (this replica stopped leading: the next leader writes)."""
        with self._cond:
            self._dirty.clear()
            self._deletes.clear()
            self._versions.clear()

    def flush(self, timeout: float = 5.0) -> bool:
        """Write what is dirty now (blocking, bounded); True when nothing is left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._dirty or self._deletes or self._busy) \
                    and time.monotonic() < deadline:
                self._urgent = True
                self._retry_at = 0.0
                self._cond.notify_all()
                self._cond.wait(0.05)
            return not (self._dirty or self._deletes or self._busy)

    def close(self) -> None:
        self.flush(5.0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5.0)

    # ------------------------------------------------------------------ writer

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._dirty or self._deletes):
                    self._cond.wait()
                if self._closed:
                    return
                # debounce: let a burst gather (flush() cuts it short; failures back off)
                due = max(self.clock() + self.debounce, self._retry_at)
                while not self._closed and not self._urgent:
                    left = due - self.clock()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self._urgent = False
                work = self._take()
                self._busy = True
            try:
                self._write(*work)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _take(self) -> tuple[list[tuple[str, dict[str, str], dict[str, str]]], list[str]]:
        puts = []
        for key in list(self._dirty):
            j = self._jobs.get(key)
            if j is None or j.record is None:
                continue
            data, _ = encode(j.record, j.entries, j.dropped, self.max_bytes)
            ann = {"ftagent.io/job": key[1], "ftagent.io/namespace": key[0]}
            puts.append((configmap_name(*key), data, ann))
        self._dirty.clear()
        deletes = list(self._deletes)
        self._deletes.clear()
        return puts, deletes

    def _write(self, puts: list[tuple[str, dict[str, str], dict[str, str]]],
               deletes: list[str]) -> None:
        from kubernetes.client.rest import ApiException

        failed_puts: list[str] = []
        failed_deletes: list[str] = []
        error: BaseException | None = None
        for name, data, ann in puts:
            try:
                for _ in range(3):
                    try:
                        version = self._versions.get(name)
                        self._versions[name] = self.api.put(name, data, ann, version)
                        self.writes += 1
                        break
                    except ApiException as e:
                        if e.status == 409:  # exists, or written since: re-read, again
                            got = self.api.version(name)
                            if got is None:
                                self._versions.pop(name, None)
                            else:
                                self._versions[name] = got
                        elif e.status == 404:  # deleted under us: create it
                            self._versions.pop(name, None)
                        else:
                            raise
                else:
                    raise RuntimeError("conflicts on every try")
            except Exception as e:
                failed_puts.append(name)
                error = e
        for name in deletes:
            try:
                self.api.delete(name)
                self._versions.pop(name, None)
            except Exception as e:
                failed_deletes.append(name)
                error = e
        with self._cond:
            if error is None:
                if self._failing:
                    log.info("job records: writing again")
                self._failing = ""
                self._fails = 0
            else:
                why = _why(error)
                if why != self._failing:
                    log.warning("job records: cannot write to namespace %s (%s): kept in "
                                "memory, retried", self.api.namespace, why)
                self._failing = why
                self._fails += 1
                self._retry_at = self.clock() + min(BACKOFF_CAP, self.debounce * 2 **
                                                    min(self._fails, 8))
                by_name = {configmap_name(*k): k for k in self._jobs}
                self._dirty.update(by_name[n] for n in failed_puts if n in by_name)
                self._deletes.update(failed_deletes)
            self._cond.notify_all()
