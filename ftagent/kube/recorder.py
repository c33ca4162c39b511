"""Kubernetes Events for faults and decisions, aggregated as client-go's recorder does.

One Event series per (object, reason): the first occurrence creates an Event, later ones
patch its ``count``, ``lastTimestamp`` and ``message`` (the latest), so ``kubectl describe``
shows ``(x12 over 3m)`` rather than twelve lines. Writes are rate-limited by a token bucket
(``rate`` per second, ``burst``): when it is empty a series waits, its count still growing,
and is written at the next ``flush`` -- never a flood, and no occurrence lost from the
count. Events go on the pod and on the job object found through ownerReferences
(``job_owner``): PyTorchJob, TFJob, MPIJob, PaddleJob, MXJob, XGBoostJob, TrainJob, JobSet,
Volcano Job, batch Job.

``record`` is called on the arbiter's loop and only updates memory; ``flush`` (blocking)
runs in a worker thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ftagent.kube.actuator import Actuator, Forbidden, GaveUp, _status, rfc3339
from ftagent.kube.client import path_of, send

log = logging.getLogger("ftagent.kube.recorder")

SERIES_KEPT = 5000  # series remembered (oldest forgotten: a new Event starts then)
MAX_MESSAGE = 1024  # the API server's limit on an Event message

# Controller kinds an Event may name as "the job", by (apiVersion's group, kind).
JOB_KINDS = {("kubeflow.org", k) for k in ("PyTorchJob", "TFJob", "MPIJob", "PaddleJob",
                                           "MXJob", "XGBoostJob", "JAXJob")}
JOB_KINDS |= {("trainer.kubeflow.org", "TrainJob"), ("jobset.x-k8s.io", "JobSet"),
              ("batch.volcano.sh", "Job"), ("batch", "Job")}
# Kinds that may themselves be owned by a job kind above (Job <- JobSet <- TrainJob).
_OWNED = {("batch", "Job"), ("jobset.x-k8s.io", "JobSet")}


@dataclass(frozen=True)
class ObjectRef:
    """The involvedObject of an Event."""

    api_version: str
    kind: str
    name: str
    namespace: str
    uid: str = ""

    def body(self) -> dict[str, str]:
        d = {"apiVersion": self.api_version, "kind": self.kind, "name": self.name,
             "namespace": self.namespace}
        if self.uid:
            d["uid"] = self.uid
        return d

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]


def pod_ref(pod: Mapping[str, Any]) -> ObjectRef | None:
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str):
        return None
    return ObjectRef("v1", "Pod", meta["name"], str(meta.get("namespace") or ""),
                     str(meta.get("uid") or ""))


def controller_of(obj: Mapping[str, Any], namespace: str) -> ObjectRef | None:
    """The ownerReference with controller=true (else the only one), as an ObjectRef."""
    meta = obj.get("metadata")
    refs = meta.get("ownerReferences") if isinstance(meta, Mapping) else None
    if not isinstance(refs, list):
        return None
    good = [r for r in refs if isinstance(r, Mapping) and isinstance(r.get("kind"), str)
            and isinstance(r.get("name"), str) and isinstance(r.get("apiVersion"), str)]
    ctl = [r for r in good if r.get("controller") is True] or (good if len(good) == 1 else [])
    if not ctl:
        return None
    r = ctl[0]
    return ObjectRef(r["apiVersion"], r["kind"], r["name"], namespace, str(r.get("uid") or ""))


def job_owner(pod: Mapping[str, Any],
              fetch: Callable[[ObjectRef], Mapping[str, Any] | None]) -> ObjectRef | None:
    """The job object a pod belongs to: its controller if of a known job kind, climbing
    batch Job -> JobSet -> TrainJob through ``fetch`` (None when it cannot be read)."""
    ns = str((pod.get("metadata") or {}).get("namespace") or "")
    ref = controller_of(pod, ns)
    best = ref if ref is not None and (ref.group, ref.kind) in JOB_KINDS else None
    for _ in range(3):
        if ref is None or (ref.group, ref.kind) not in _OWNED:
            break
        obj = fetch(ref)
        up = controller_of(obj, ns) if obj is not None else None
        if up is None or (up.group, up.kind) not in JOB_KINDS:
            break
        best = ref = up
    return best


@dataclass
class _Series:
    ref: ObjectRef
    reason: str
    type: str
    message: str
    count: int
    first: float
    last: float
    name: str = ""  # the Event's name once created
    written: int = 0  # count the API server has
    busy: bool = False
    # the Event's metadata.annotations (the latest occurrence's): the culprit as data
    annotations: dict[str, str] = field(default_factory=dict)


class Recorder:
    def __init__(self, api_client: Any, actuator: Actuator, *,
                 component: str = "ftagent-arbiter", instance: str = "",
                 rate: float = 5.0, burst: int = 50,
                 clock: Callable[[], float] = time.time) -> None:
        self.api_client = api_client
        self.actuator = actuator
        self.component, self.instance = component, instance
        self.rate, self.burst = rate, float(burst)
        self.clock = clock
        self._tokens = float(burst)
        self._filled = time.monotonic()
        self._series: OrderedDict[tuple[str, str, str, str], _Series] = OrderedDict()
        self._lock = threading.Lock()
        self.off = False  # events are forbidden (403): nothing more is attempted
        self.written = 0  # API writes made (create + patch), for tests and the bench

    def record(self, ref: ObjectRef, reason: str, message: str, type_: str = "Normal",
               now: float | None = None,
               annotations: Mapping[str, str] | None = None) -> None:
        """Count one occurrence (on the loop: memory only; ``flush`` writes).
        ``annotations`` go on the Event object (the latest occurrence's replace the
        series' earlier ones, as its message does): structured facts such as the
        culprit ranks a decision named, for tools that read Events."""
        if self.off:
            return
        now = self.clock() if now is None else now
        key = (ref.namespace, ref.kind, ref.uid or ref.name, reason)
        message = message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 3] + "..."
        with self._lock:
            s = self._series.get(key)
            if s is None:
                s = self._series[key] = _Series(ref, reason, type_, message, 0, now, now)
                while len(self._series) > SERIES_KEPT:
                    self._series.popitem(last=False)
            s.count += 1
            s.last, s.message = now, message
            if annotations is not None:
                s.annotations = dict(annotations)
            if type_ == "Warning":
                s.type = type_

    def dirty(self) -> bool:
        with self._lock:
            return any(s.count > s.written and not s.busy for s in self._series.values())

    def flush(self) -> int:
        """Write every series whose count grew, as the rate allows (blocking); returns the
        number written. Safe to call from several threads."""
        n = 0
        while not self.off:
            with self._lock:
                todo = next((s for s in self._series.values()
                             if s.count > s.written and not s.busy), None)
                if todo is None or not self._take():
                    return n
                todo.busy = True
                count, message, last = todo.count, todo.message, todo.last
                notes = dict(todo.annotations)
            try:
                self._write(todo, count, message, last, notes)
                n += 1
            except Forbidden:
                self.off = True
            except GaveUp:
                return n
            except Exception as e:  # a bad answer for one series must not stop the others
                log.warning("event %s on %s %s not written: %s", todo.reason, todo.ref.kind,
                            todo.ref.name, e)
                todo.written = count
            finally:
                todo.busy = False
        return n

    def _take(self) -> bool:
        t = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (t - self._filled) * self.rate)
        self._filled = t
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _write(self, s: _Series, count: int, message: str, last: float,
               notes: Mapping[str, str] | None = None) -> None:
        from kubernetes.client.rest import ApiException

        ns = s.ref.namespace or "default"
        if s.name:
            body: dict[str, Any] = {"count": count, "lastTimestamp": rfc3339(last),
                                    "message": message, "type": s.type}
            if notes:  # merge patch: the keys given replace theirs, others stay
                body["metadata"] = {"annotations": dict(notes)}
            try:
                self.actuator.call("patch", "events", lambda: send(
                    self.api_client, "PATCH", path_of("namespaces", ns, "events", s.name),
                    body, content_type="application/merge-patch+json",
                    timeout=self.actuator.timeout),
                    f"updating event {s.reason} on {s.ref.kind} {s.ref.name}")
                s.written = count
                self.written += 1
                return
            except ApiException as e:
                if _status(e) != 404:
                    raise
                s.name = ""  # expired (events live an hour): a new series starts
        name = f"{s.ref.name[:200]}.{uuid.uuid4().hex[:16]}"
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"name": name, "namespace": ns,
                              **({"annotations": dict(notes)} if notes else {})},
                 "involvedObject": s.ref.body(), "reason": s.reason, "message": message,
                 "type": s.type, "count": count, "firstTimestamp": rfc3339(s.first),
                 "lastTimestamp": rfc3339(last), "source": {"component": self.component},
                 "reportingComponent": self.component,
                 "reportingInstance": self.instance or self.component}
        self.actuator.call("create", "events", lambda: send(
            self.api_client, "POST", path_of("namespaces", ns, "events"), event,
            timeout=self.actuator.timeout),
            f"recording event {s.reason} on {s.ref.kind} {s.ref.name}")
        s.name, s.written = name, count
        self.written += 1
