"""A job's progress and goodput on its Kubeflow Trainer v2 TrainJob (``status.trainerStatus``).

Kubeflow Trainer's KEP-2779 adds an optional ``status.trainerStatus`` to the TrainJob
(``trainer.kubeflow.org/v1alpha1``, behind a feature gate), the object users look at with
``kubectl get trainjob``::

    status:
      trainerStatus:
        progressPercentage: 45            # 0..100, optional
        estimatedRemainingSeconds: 7956   # optional
        metrics: [{name: loss, value: "0.2347"}, ...]   # name/value strings
        lastUpdatedTime: "2025-01-23T10:30:45Z"

Where a rank's pod belongs to a TrainJob (pod -> batch Job -> JobSet -> TrainJob, the
owner climb of ``cluster.py``), the arbiter merge-patches that status subresource with
what it knows, every ``interval`` seconds per job: metrics ``step``, ``loss``,
``goodput`` (the ledger's effective training time ratio), ``restarts``. The arbiter does
not know the run's last step, so it writes no percentage and no estimate.

Where there is nothing to write to, it stops and says so once: a 404 without an object
name is the CRD not installed; a patch whose answer has no ``trainerStatus`` is a CRD
without the field (the API server pruned it: a Trainer release or feature gate without
progress tracking); a 403 is RBAC (``patch`` on ``trainjobs/status`` in
deploy/components/arbiter). A 404 for one TrainJob (deleted) stops writing to that one.
Blocking: ``write`` runs in a worker thread.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import threading
from typing import Any

log = logging.getLogger("ftagent.kube.trainjob")

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
INTERVAL = 30.0  # seconds between two writes for one TrainJob
KEPT = 10_000  # TrainJobs remembered (last write, gone)


def trainer_status(step: int | None, loss: float | None, goodput: float | None,
                   restarts: int, now: float) -> dict[str, Any]:
    """The ``trainerStatus`` object (pure): metrics as name/value strings, as the CRD
    wants them; unknown values are left out, never written as guesses."""
    metrics: list[dict[str, str]] = []
    if step is not None and step >= 0:
        metrics.append({"name": "step", "value": str(int(step))})
    if loss is not None and math.isfinite(loss):
        metrics.append({"name": "loss", "value": f"{loss:.6g}"})
    if goodput is not None and math.isfinite(goodput):
        metrics.append({"name": "goodput", "value": f"{min(max(goodput, 0.0), 1.0):.4f}"})
    metrics.append({"name": "restarts", "value": str(max(0, int(restarts)))})
    at = dt.datetime.fromtimestamp(now, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metrics": metrics, "lastUpdatedTime": at}


class TrainJobStatus:
    """The writer (see the module docstring). ``off``: why nothing is written any more
    ("" while writing)."""

    def __init__(self, api_client: Any, interval: float = INTERVAL) -> None:
        self.api_client = api_client
        self.interval = interval
        self.off = ""
        self.written = 0
        self._last: dict[tuple[str, str], float] = {}
        self._gone: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def due(self, namespace: str, name: str, now: float) -> bool:
        """True (and noted) when the TrainJob should be written at ``now``."""
        key = (namespace, name)
        with self._lock:
            if self.off or self.interval <= 0 or key in self._gone:
                return False
            if now - self._last.get(key, -math.inf) < self.interval:
                return False
            self._last[key] = now
            if len(self._last) > KEPT:
                self._last.pop(next(iter(self._last)))
            return True

    def write(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch ``status.trainerStatus`` of TrainJob ``namespace/name``."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        body = {"status": {"trainerStatus": status}}
        resp: Any
        try:
            resp = client.CustomObjectsApi(self.api_client).patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, body, _preload_content=False,
                _request_timeout=10)
            got = json.loads(resp.data[:1 << 20])
        except ApiException as e:
            if e.status == 404 and not _names_an_object(e):
                self._stop("the TrainJob CRD (trainjobs.trainer.kubeflow.org) is not "
                           "installed")
            elif e.status == 404:
                with self._lock:
                    self._gone.add((namespace, name))
                    if len(self._gone) > KEPT:
                        self._gone.pop()
            elif e.status == 403:
                self._stop("RBAC forbids patching trainjobs/status (deploy/components/"
                           "arbiter's ClusterRole grants it)")
            else:
                log.debug("TrainJob %s/%s status: %s", namespace, name, e)
            return
        except (ValueError, OSError) as e:
            log.debug("TrainJob %s/%s status: %s", namespace, name, e)
            return
        status_out = got.get("status") if isinstance(got, dict) else None
        if not isinstance(status_out, dict) or "trainerStatus" not in status_out:
            self._stop("this cluster's TrainJob has no status.trainerStatus (a Kubeflow "
                       "Trainer without progress tracking, or its feature gate off)")
            return
        with self._lock:
            self.written += 1

    def _stop(self, why: str) -> None:
        with self._lock:
            if self.off:
                return
            self.off = why
        log.info("TrainJob progress is not written: %s", why)


def _names_an_object(e: Any) -> bool:
    """A 404 Status about a named object (it is gone), not about the resource (no CRD)."""
    try:
        body = json.loads(e.body or "{}")
    except (TypeError, ValueError):
        return False
    details = body.get("details") if isinstance(body, dict) else None
    return isinstance(details, dict) and bool(details.get("name"))
