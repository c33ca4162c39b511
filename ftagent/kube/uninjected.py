"""Training pods in opted-in namespaces that run without the agent: injection that failed
open, made visible.

The webhook's ``failurePolicy: Ignore`` keeps pods starting when the webhook is down, slow
or its certificate broken, and the webhook skips pods it cannot wrap (no command, several
containers): in both cases the pod trains without fault tolerance and nothing fails. The
arbiter (``--kube``) watches the namespaces labelled ``ftagent.io/inject=true`` and the
Running pods of those namespaces only, and exports at scrape time

    ftagent_training_pods_without_agent{namespace, reason}

for Running pods of a training job kind (``identity.identify``: not a plain batch Job) or
labelled ``ftagent.io/inject=true``, not opted out, in an opted-in namespace, where
``reason`` is

* ``not reviewed``: no ``ftagent.io/injected`` annotation: the webhook never answered for
  this pod (down, timed out, TLS failing), and the API server let it through;
* ``skipped``: the webhook saw it and left it alone (its annotation says why);
* ``agent not connected``: injected with an arbiter to report to, Running for longer than
  ``AGENT_GRACE``, and no agent of that pod holds a stream to this (leading) arbiter:
  typically the agent could not start in the training image and the entry shim ran the
  trainer alone (it says why on the pod's stderr), or the agent cannot reach or
  authenticate to the arbiter. Counted only while this arbiter leads (followers have no
  streams).

Pure at the core (:func:`without_agent` takes a pod, returns a reason or None); the
informers (``informer.py``) list only what they need -- Running pods of opted-in
namespaces, one informer per such namespace (:class:`OptedInPods`), projected page by page
-- and keep one small projection per pod; the collector counts them when Prometheus
scrapes, as client_python's custom collectors do. Memory follows the opted-in namespaces'
running pods, never the cluster's.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ftagent.kube.identity import annotations_of, identify, labels_of

OPT_IN = "ftagent.io/inject"
INJECTED = "ftagent.io/injected"
METRIC = "ftagent_training_pods_without_agent"
NOT_REVIEWED, SKIPPED, NOT_CONNECTED = "not reviewed", "skipped", "agent not connected"
REASONS = (NOT_REVIEWED, SKIPPED, NOT_CONNECTED)
INJECTED_OK = ""  # injected, with an arbiter its agent should be connected to
AGENT_GRACE = 120.0  # seconds Running before an injected pod's agent must have connected


@dataclass(frozen=True)
class PodView:
    """What the informer keeps of a running training pod (None for every other pod)."""

    namespace: str
    name: str
    reason: str  # one of REASONS, or INJECTED_OK
    since: float | None = None  # status.startTime (epoch seconds) when INJECTED_OK
    uid: str = ""  # metadata.uid when INJECTED_OK (the Event of kube/skipped.py names it)


def view(pod: Mapping[str, Any]) -> PodView | None:
    """The informer's projection: :func:`without_agent`, and injected pods whose agent
    should connect (a container with a literal ``FTAGENT_ARBITER``)."""
    found = without_agent(pod)
    meta = pod.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if not isinstance(name, str):
        return None
    if found is not None:
        return PodView(found[0], name, found[1])
    namespace = meta.get("namespace") if isinstance(meta, Mapping) else None
    status = pod.get("status")
    if not isinstance(namespace, str) or not isinstance(status, Mapping) or \
            status.get("phase") != "Running" or \
            not annotations_of(pod).get(INJECTED, "").startswith("true"):
        return None
    spec = pod.get("spec")
    containers = spec.get("containers") if isinstance(spec, Mapping) else None
    if not any(_arbitrated(c) for c in _list(containers)):
        return None
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return PodView(namespace, name, INJECTED_OK, _epoch(status.get("startTime")),
                   uid[:128] if isinstance(uid, str) else "")


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _arbitrated(c: Any) -> bool:
    return isinstance(c, Mapping) and any(
        isinstance(e, Mapping) and e.get("name") == "FTAGENT_ARBITER" and bool(e.get("value"))
        for e in _list(c.get("env")))


def _epoch(raw: Any) -> float | None:
    if not isinstance(raw, str) or len(raw) > 40:
        return None
    try:
        return datetime.datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def without_agent(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, reason) for a running training pod that the webhook did not inject,
    else None."""
    status = pod.get("status")
    if not isinstance(status, Mapping) or status.get("phase") != "Running":
        return None
    labels = labels_of(pod)
    opt = labels.get(OPT_IN, "").strip().lower()
    if opt == "false":
        return None
    if opt != "true":
        found = identify(pod, {}, labels=labels)
        if found is None or found.kind == "job" or found.skip:
            return None  # no training pod: not the webhook's to inject
    meta = pod.get("metadata")
    namespace = meta.get("namespace") if isinstance(meta, Mapping) else None
    if not isinstance(namespace, str):
        return None
    note = annotations_of(pod).get(INJECTED)
    if note is None:
        return namespace, NOT_REVIEWED
    if note.startswith("true"):
        return None
    return namespace, SKIPPED


def count(pods: list[tuple[str, PodView | None]], opted_in: set[str],
          connected: set[tuple[str, str]] | None, now: float,
          grace: float = AGENT_GRACE, term_since: float | None = None
          ) -> Counter[tuple[str, str]]:
    """Pods without the agent per (namespace, reason), opted-in namespaces only.
    ``connected``: (namespace, pod) of every agent with a stream, None when not leading;
    ``term_since``: when this arbiter began leading (the grace runs from then too: a new
    leader's agents are still reconnecting)."""
    out: Counter[tuple[str, str]] = Counter()
    for _, v in pods:
        if v is None or v.namespace not in opted_in:
            continue
        if v.reason != INJECTED_OK:
            out[(v.namespace, v.reason)] += 1
        elif connected is not None and v.since is not None \
                and now - max(v.since, v.since if term_since is None else term_since) > grace \
                and (v.namespace, v.name) not in connected:
            out[(v.namespace, NOT_CONNECTED)] += 1
    return out


class UninjectedCollector:
    """The gauge, read from the two informers' caches at each scrape (thread-safe: the
    caches are). ``connected``: the (namespace, pod) of every agent with a stream to this
    arbiter, None while it does not lead."""

    def __init__(self, pods: Any, namespaces: Any,
                 connected: Callable[[], set[tuple[str, str]] | None] = lambda: None,
                 clock: Callable[[], float] = time.time, grace: float = AGENT_GRACE,
                 term: Any = None) -> None:
        self.pods, self.namespaces = pods, namespaces
        self.connected, self.clock, self.grace = connected, clock, grace
        self.term = term  # a kube.skipped.Term: the grace also runs from the term's start

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            METRIC, "Running training pods in namespaces labelled ftagent.io/inject=true "
            "without a working agent, by namespace and why (not reviewed: the webhook never "
            "answered for it; skipped: the webhook left it alone; agent not connected: "
            "injected, but no agent of the pod reports to the leading arbiter).",
            labels=["namespace", "reason"])
        opted_in = {name for _, name in self.namespaces.items()}
        now = self.clock()
        connected, since = self.term.observe(now) if self.term is not None else \
            (self.connected(), None)
        by = count(self.pods.items(), opted_in, connected, now, self.grace, since)
        for ns in sorted(opted_in):  # a zero for every opted-in namespace: alerts see 0
            for reason in REASONS:
                family.add_metric([ns, reason], by.get((ns, reason), 0))
        yield family


class OptedInPods:
    """Running pods of the namespaces that opted in, one pod informer per such namespace
    (``fieldSelector=status.phase=Running``, projected per page by ``view``), started and
    stopped as the namespace informer sees namespaces gain or lose ``ftagent.io/inject=true``.
    Pods of other namespaces are never listed: they cannot grow the arbiter's memory.
    ``items()`` is the union of their caches (thread-safe, as the collector reads it)."""

    def __init__(self, api_client: Any, max_namespaces: int = 10_000) -> None:
        self.api_client = api_client
        self.max_namespaces = max_namespaces
        self._lock = threading.Lock()
        self._informers: dict[str, Any] = {}
        self._stopped = False

    def on_namespace(self, change: Any) -> None:
        """The namespace informer's handler (its thread, or the loop)."""
        from ftagent.kube.informer import DELETED, pod_informer

        name = change.key
        with self._lock:
            if self._stopped:
                return
            if change.type == DELETED:
                gone = self._informers.pop(name, None)
                if gone is not None:  # stop off this thread: a join must not block a loop
                    threading.Thread(target=gone.stop, daemon=True,
                                     name=f"ftagent-stop-pods-{name[:40]}").start()
                return
            if name in self._informers or len(self._informers) >= self.max_namespaces:
                return
            inf = pod_informer(self.api_client, namespace=name, project=view,
                               field_selector="status.phase=Running")
            self._informers[name] = inf
        inf.start()

    def items(self) -> list[tuple[str, PodView | None]]:
        with self._lock:
            informers = list(self._informers.values())
        return [kv for inf in informers for kv in inf.items()]

    def __len__(self) -> int:
        with self._lock:
            informers = list(self._informers.values())
        return sum(len(inf) for inf in informers)

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stopped = True
            informers, self._informers = list(self._informers.values()), {}
        for inf in informers:
            inf.stop(timeout)


class Term:
    """When this arbiter's current term as leader began, as seen by whoever asks:
    ``connected()`` is None while it does not lead (followers have no streams)."""

    def __init__(self, connected: Callable[[], set[tuple[str, str]] | None]) -> None:
        self._connected = connected
        self._since: float | None = None
        self._lock = threading.Lock()

    def observe(self, now: float) -> tuple[set[tuple[str, str]] | None, float | None]:
        """(the connected (namespace, pod) set or None, the term's start or None)."""
        got = self._connected()
        with self._lock:
            if got is None:
                self._since = None
            elif self._since is None:
                self._since = now
            return got, self._since


def watch_uninjected(api_client: Any, loop: asyncio.AbstractEventLoop | None,
                     registry: Any,
                     connected: Callable[[], set[tuple[str, str]] | None] = lambda: None,
                     announce: Callable[[OptedInPods, Any, Term], Any] | None = None,
                     grace: float = AGENT_GRACE,
                     clock: Callable[[], float] = time.time) -> list[Any]:
    """Start the namespace informer (namespaces labelled ``ftagent.io/inject=true``) and,
    per such namespace, an informer of its Running pods; register the gauge in
    ``registry`` (needs list/watch on pods and namespaces). With ``announce``
    (``kube/skipped.start_announcing``, wired by cmd/arbiter.py), injected pods whose
    agent never connected also
    get one Warning Event each (``kube/skipped.py``; needs create on events). Returns what
    to ``stop()``."""
    from ftagent.kube.informer import Informer, collection

    pods = OptedInPods(api_client)
    # the handler runs in the namespace informer's own thread (loop=None): it only starts
    # and stops informers, never touches the arbiter's state
    namespaces = Informer(collection(api_client, "/api/v1/namespaces"), name="namespaces",
                          label_selector=f"{OPT_IN}=true", handler=pods.on_namespace,
                          project=lambda o: str(o["metadata"]["name"]))
    namespaces.start()
    term = Term(connected)
    registry.register(UninjectedCollector(pods, namespaces, connected, clock, grace, term))
    out: list[Any] = [namespaces, pods]
    if announce is not None:  # kube/skipped.py's Events, wired by cmd/arbiter.py
        out.append(announce(pods, namespaces, term))
    return out

