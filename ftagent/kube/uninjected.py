"""Training pods in opted-in namespaces that run without the agent: injection that failed
open, made visible.

The webhook's ``failurePolicy: Ignore`` keeps pods starting when the webhook is down, slow
or its certificate broken, and the webhook skips pods it cannot wrap (no command, several
containers): in both cases the pod trains without fault tolerance and nothing fails. The
arbiter (``--kube``) watches every pod and the namespaces labelled
``ftagent.io/inject=true``, and exports at scrape time

    ftagent_training_pods_without_agent{namespace, reason}

for Running pods of a training job kind (``identity.identify``: not a plain batch Job) or
labelled ``ftagent.io/inject=true``, not opted out, in an opted-in namespace, where
``reason`` is

* ``not reviewed``: no ``ftagent.io/injected`` annotation: the webhook never answered for
  this pod (down, timed out, TLS failing), and the API server let it through;
* ``skipped``: the webhook saw it and left it alone (its annotation says why).

(A pod whose agent could not start in its image, and fell back to running the trainer
alone, is injected as far as the API server knows: the shim says so on its stderr.)

Pure at the core (:func:`without_agent` takes a pod, returns a reason or None); the
informers (``informer.py``) keep one small projection per pod, and the collector counts
them when Prometheus scrapes, as client_python's custom collectors do.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from ftagent.kube.identity import annotations_of, identify, labels_of

OPT_IN = "ftagent.io/inject"
INJECTED = "ftagent.io/injected"
METRIC = "ftagent_training_pods_without_agent"
NOT_REVIEWED, SKIPPED = "not reviewed", "skipped"


def without_agent(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, reason) for a running training pod without the agent, else None."""
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


def count(pods: list[tuple[str, Any]], opted_in: set[str]) -> Counter[tuple[str, str]]:
    """Pods without the agent per (namespace, reason), opted-in namespaces only."""
    return Counter(p for _, p in pods if p is not None and p[0] in opted_in)


class UninjectedCollector:
    """The gauge, read from the two informers' caches at each scrape (thread-safe: the
    caches are)."""

    def __init__(self, pods: Any, namespaces: Any) -> None:
        self.pods, self.namespaces = pods, namespaces

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            METRIC, "Running training pods in namespaces labelled ftagent.io/inject=true "
            "that have no agent, by namespace and why (not reviewed: the webhook never "
            "answered for it; skipped: the webhook left it alone).",
            labels=["namespace", "reason"])
        opted_in = {name for _, name in self.namespaces.items()}
        by = count(self.pods.items(), opted_in)
        for ns in sorted(opted_in):  # a zero for every opted-in namespace: alerts see 0
            for reason in (NOT_REVIEWED, SKIPPED):
                family.add_metric([ns, reason], by.get((ns, reason), 0))
        yield family


def watch_uninjected(api_client: Any, loop: asyncio.AbstractEventLoop | None,
                     registry: Any) -> list[Any]:
    """Start the pod and namespace informers and register the gauge in ``registry``
    (needs list/watch on pods and namespaces). Returns the informers (``stop()`` them)."""
    from kubernetes import client

    from ftagent.kube.informer import Informer, pod_informer

    pods = pod_informer(api_client, project=without_agent, loop=loop)
    namespaces = Informer(client.CoreV1Api(api_client).list_namespace, name="namespaces",
                          label_selector=f"{OPT_IN}=true", loop=loop,
                          project=lambda o: str(o["metadata"]["name"]))
    for inf in (pods, namespaces):
        inf.start()
    registry.register(UninjectedCollector(pods, namespaces))
    return [pods, namespaces]
