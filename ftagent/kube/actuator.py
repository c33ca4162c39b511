"""Kubernetes actions of the arbiter's decisions: cordon and taint a node, delete a pod,
force-delete one stuck Terminating, annotate pods with their ftagent state.

Every call here blocks (HTTP through the ``kubernetes`` client) and so runs in a worker
thread, never on the arbiter's event loop (``cluster.py`` submits them). Objects travel
as JSON dicts (``_preload_content=False``), so a field the client's models do not know
is kept, not dropped, when a node is written back.

What the API server answers:

* 409 Conflict on a write: read the fresh object and apply the change again (a few times);
* 403 Forbidden: one log line per verb and resource naming the missing RBAC permission,
  then that action is skipped; the arbiter keeps deciding through its agents;
* 429 / 5xx / a dropped connection: retried with exponential backoff and jitter,
  ``Retry-After`` honoured, then given up with one log line;
* 404 on a delete (or a uid precondition that no longer holds: 409): the pod is already
  gone or replaced, which is what was wanted.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ftagent.kube.client import path_of, send

log = logging.getLogger("ftagent.kube.actuator")

TAINT_KEY = "ftagent.io/fault"
ANNOTATIONS = "ftagent.io/"
CORDONED_LABEL = "ftagent.io/cordoned"
STATE_ANNOTATION = "ftagent.io/state"
# on what the cordon stands: "node-agent", "node-condition" or "corroborated" (breaker.py)
EVIDENCE_ANNOTATION = "ftagent.io/cordon-evidence"
CORDON_ANNOTATIONS = ("cordoned-by", "cordoned-at", "fault-kind", "fault-id", "fault-job",
                      "fault", "cordon-evidence")
T = TypeVar("T")
_RETRIED = {429, 500, 502, 503, 504}


class Forbidden(Exception):
    """RBAC refused the call (already logged once)."""


class GaveUp(Exception):
    """The API server kept failing; the action was not done (already logged)."""


def rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(e: BaseException) -> int | None:
    s = getattr(e, "status", None)
    return s if isinstance(s, int) else None


def _retry_after(e: BaseException) -> float | None:
    """What the API server asks to wait, by the one parser (kube.client), at most 60 s."""
    from ftagent.kube.client import retry_after

    return retry_after(e, 60.0)


class Actuator:
    """The API calls behind REPLACE and the pod annotations (blocking: call in a worker)."""

    def __init__(self, api_client: Any, *, attempts: int = 6, backoff: float = 0.2,
                 max_backoff: float = 10.0, timeout: float = 10.0,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.time) -> None:
        self.api_client = api_client  # requests: kube.client.send (no CoreV1Api to import)
        self.attempts, self.backoff, self.max_backoff = attempts, backoff, max_backoff
        self.timeout = timeout
        self.sleep, self.clock = sleep, clock
        self._forbidden: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ calls

    def call(self, verb: str, resource: str, fn: Callable[[], T], doing: str) -> T:
        """``fn()`` with the rules above. Raises Forbidden, GaveUp, or the ApiException
        for any other status (404, 409, 422: the caller decides)."""
        from kubernetes.client.rest import ApiException
        from urllib3.exceptions import HTTPError

        last = ""
        for attempt in range(self.attempts):
            try:
                return fn()
            except ApiException as e:
                code = _status(e)
                if code == 403:
                    self.forbidden(verb, resource, doing)
                    raise Forbidden(f"{verb} {resource}") from None
                if code not in _RETRIED:
                    raise
                last, wait = f"{code} {e.reason or ''}".strip(), _retry_after(e)
            except (HTTPError, OSError) as e:
                last, wait = f"{type(e).__name__}: {e}"[:200], None
            if attempt + 1 < self.attempts:
                base = min(self.max_backoff, self.backoff * 2 ** attempt)
                self.sleep(wait if wait is not None else base * random.uniform(0.5, 1.0))
        log.warning("gave up %s after %d attempts (the API server said %s); the arbiter "
                    "keeps deciding through its agents", doing, self.attempts, last)
        raise GaveUp(doing)

    def forbidden(self, verb: str, resource: str, doing: str) -> None:
        with self._lock:
            if (verb, resource) in self._forbidden:
                return
            self._forbidden.add((verb, resource))
        log.error("Kubernetes refused to %s %s (403 Forbidden) while %s: the arbiter's "
                  "service account lacks RBAC permission '%s' on '%s' (see "
                  "deploy/components/arbiter/rbac.yaml); this action is skipped from now on, "
                  "the arbiter keeps deciding through its agents", verb, resource, doing, verb,
                  resource)

    def _json(self, resp: Any) -> dict[str, Any]:
        obj = json.loads(resp.data)
        if not isinstance(obj, dict):
            raise ValueError("the API server sent something that is not an object")
        return obj

    # ------------------------------------------------------------------ actions

    def cordon(self, node: str, kind: str, reason: str, fault_id: str, job: str,
               now: float | None = None, evidence: str = "") -> bool:
        """Cordon ``node`` and taint it ``ftagent.io/fault=KIND:NoSchedule`` with
        annotations saying which fault, which job and when. True when written (or the node
        was already so); False when the node is gone; Forbidden / GaveUp otherwise."""
        from kubernetes.client.rest import ApiException

        at = rfc3339(self.clock() if now is None else now)
        for _ in range(5):
            try:
                obj = self._json(self.call("get", "nodes", lambda: send(
                    self.api_client, "GET", path_of("nodes", node), timeout=self.timeout),
                    f"reading node {node}"))
            except ApiException as e:
                if _status(e) == 404:
                    log.info("node %s is gone: nothing to cordon", node)
                    return False
                raise
            if not _mark(obj, kind, reason[:1000], fault_id, job, at, evidence):
                return True
            try:
                self.call("update", "nodes", lambda o=obj: send(  # type: ignore[misc]
                    self.api_client, "PUT", path_of("nodes", node), o, timeout=self.timeout),
                    f"cordoning node {node}")
                log.info("cordoned and tainted node %s (%s=%s:NoSchedule) for job %s: %s",
                         node, TAINT_KEY, kind, job, reason[:200])
                return True
            except ApiException as e:
                if _status(e) == 409:
                    continue  # changed since we read it: again, with the fresh object
                if _status(e) == 404:
                    return False
                raise
        log.warning("cordoning node %s: 5 conflicts in a row, given up", node)
        raise GaveUp(f"cordoning node {node}")

    def uncordon(self, node: str, why: str) -> bool:
        """Undo ftagent's own cordon of ``node``: unschedulable off, the
        ``ftagent.io/fault`` taint and the cordon annotations removed. Only a node that
        carries ftagent's cordon annotation is touched (an operator's own cordon stays).
        True when written; False when the node is gone or not ftagent's cordon."""
        from kubernetes.client.rest import ApiException

        for _ in range(5):
            try:
                obj = self._json(self.call("get", "nodes", lambda: send(
                    self.api_client, "GET", path_of("nodes", node), timeout=self.timeout),
                    f"reading node {node}"))
            except ApiException as e:
                if _status(e) == 404:
                    return False
                raise
            if not _unmark(obj):
                return False
            try:
                self.call("update", "nodes", lambda o=obj: send(  # type: ignore[misc]
                    self.api_client, "PUT", path_of("nodes", node), o, timeout=self.timeout),
                    f"uncordoning node {node}")
                log.info("uncordoned node %s (ftagent's cordon): %s", node, why[:200])
                return True
            except ApiException as e:
                if _status(e) == 409:
                    continue
                if _status(e) == 404:
                    return False
                raise
        raise GaveUp(f"uncordoning node {node}")

    def delete_pod(self, namespace: str, name: str, uid: str = "",
                   grace: int | None = None) -> bool:
        """Delete the pod (its controller recreates it); ``uid`` guards against deleting
        a replacement of the same name. True when deleted, False when already gone."""
        from kubernetes.client.rest import ApiException

        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            body["preconditions"] = {"uid": uid}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        how = "force-deleting" if grace == 0 else "deleting"
        try:
            self.call("delete", "pods", lambda: send(
                self.api_client, "DELETE", path_of("namespaces", namespace, "pods", name),
                body, query=[] if grace is None else [("gracePeriodSeconds", grace)],
                timeout=self.timeout),
                f"{how} pod {namespace}/{name}")
        except ApiException as e:
            if _status(e) in (404, 409):  # gone, or already replaced by a new pod
                return False
            raise
        log.info("%s pod %s/%s", how.replace("ing", "ed"), namespace, name)
        return True

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> bool:
        """Merge-patch the pod's annotations (False when the pod is gone)."""
        from kubernetes.client.rest import ApiException

        body = {"metadata": {"annotations": annotations}}
        try:
            self.call("patch", "pods", lambda: send(
                self.api_client, "PATCH", path_of("namespaces", namespace, "pods", name),
                body, content_type="application/merge-patch+json", timeout=self.timeout),
                f"annotating pod {namespace}/{name}")
        except ApiException as e:
            if _status(e) == 404:
                return False
            raise
        return True


def _mark(obj: dict[str, Any], kind: str, reason: str, fault_id: str, job: str,
          at: str, evidence: str = "") -> bool:
    """Cordon + taint + annotate ``obj`` in place; False when it already says so."""
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else None
    if spec is None:
        spec = obj["spec"] = {}
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else None
    if meta is None:
        meta = obj["metadata"] = {}
    taints: list[Any] = spec["taints"] if isinstance(spec.get("taints"), list) else []
    has_taint = any(isinstance(t, dict) and t.get("key") == TAINT_KEY and
                    t.get("effect") == "NoSchedule" for t in taints)
    if spec.get("unschedulable") is True and has_taint:
        return False
    spec["unschedulable"] = True
    if not has_taint:
        spec["taints"] = [*taints, {"key": TAINT_KEY, "value": kind[:63],
                                    "effect": "NoSchedule", "timeAdded": at}]
    notes: dict[str, Any] = meta["annotations"] if isinstance(meta.get("annotations"),
                                                              dict) else {}
    meta["annotations"] = {**notes, f"{ANNOTATIONS}cordoned-by": "ftagent-arbiter",
                           f"{ANNOTATIONS}cordoned-at": at,
                           f"{ANNOTATIONS}fault-kind": kind, f"{ANNOTATIONS}fault-id": fault_id,
                           f"{ANNOTATIONS}fault-job": job, f"{ANNOTATIONS}fault": reason,
                           EVIDENCE_ANNOTATION: evidence or "corroborated"}
    labels: dict[str, Any] = meta["labels"] if isinstance(meta.get("labels"), dict) else {}
    meta["labels"] = {**labels, CORDONED_LABEL: "true"}
    return True


def _unmark(obj: dict[str, Any]) -> bool:
    """Undo ``_mark`` in place; False when ``obj`` carries no cordon of ftagent's."""
    meta: dict[str, Any] = obj["metadata"] if isinstance(obj.get("metadata"), dict) else {}
    notes: dict[str, Any] = meta["annotations"] if isinstance(meta.get("annotations"),
                                                              dict) else {}
    if notes.get(f"{ANNOTATIONS}cordoned-by") != "ftagent-arbiter":
        return False
    meta["annotations"] = {k: v for k, v in notes.items()
                           if k not in {ANNOTATIONS + n for n in CORDON_ANNOTATIONS}}
    labels = meta.get("labels")
    if isinstance(labels, dict):
        labels.pop(CORDONED_LABEL, None)
    spec: dict[str, Any] = obj["spec"] if isinstance(obj.get("spec"), dict) else {}
    spec.pop("unschedulable", None)
    taints = spec.get("taints")
    if isinstance(taints, list):
        spec["taints"] = [t for t in taints if not (isinstance(t, dict)
                                                   and t.get("key") == TAINT_KEY)]
    return True
