"""The leader's label on its own pod: how the Service reaches the leader only.

Every arbiter replica is Ready when it can serve (so a rollout with ``maxUnavailable: 0``
completes and the PodDisruptionBudget lets the leader's node drain), and the Service
selects ``ftagent.io/arbiter-leader: "true"`` besides the app label: agents go to the pod
that holds the Lease. The shape is the one several controllers use (CloudNativePG's
``role: primary``, Patroni's ``role: master``):

* a replica that wins the Lease first removes the label from any other pod of its
  Deployment that still carries it (a leader that was SIGKILLed, or a container restarted in
  a pod that kept its labels), then labels its own pod;
* a replica that loses the Lease, stops, or starts, removes the label from its own pod.

The label is advice to kube-proxy, never authority: a standby refuses agents with
UNAVAILABLE whatever its labels say, and the Lease alone decides who acts.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("ftagent.kube.leader_label")

LABEL = "ftagent.io/arbiter-leader"


def _patch(value: str | None) -> dict[str, Any]:
    """A JSON merge patch: the label set to ``value``, or removed (null)."""
    return {"metadata": {"labels": {LABEL: value}}}


class LeaderLabel:
    """Marks ``namespace/pod`` (this replica's pod) as the leader or not. The calls block
    (the kubernetes client): run them off the event loop."""

    def __init__(self, api_client: Any, namespace: str, pod: str,
                 app_selector: str = "app.kubernetes.io/name=ftagent-arbiter",
                 timeout: float = 5.0) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.namespace, self.pod = namespace, pod
        self.app_selector = app_selector
        self.timeout = timeout

    def _set(self, pod: str, value: str | None) -> bool:
        try:
            self.core.patch_namespaced_pod(pod, self.namespace, _patch(value),
                                           _content_type="application/merge-patch+json",
                                           _preload_content=False,
                                           _request_timeout=self.timeout)
            return True
        except Exception as e:  # the label is advice: one line, the next transition retries
            status = getattr(e, "status", None)
            if status == 404:
                return True  # the pod is gone: nothing to label or unlabel
            log.warning("cannot %s the label %s on pod %s/%s (%s)",
                        "set" if value else "remove", LABEL, self.namespace, pod,
                        f"HTTP {status} {getattr(e, 'reason', '')}".strip() if status
                        else type(e).__name__)
            return False

    def others(self) -> list[str]:
        """Other pods of this Deployment that carry the label now."""
        selector = f"{self.app_selector},{LABEL}=true" if self.app_selector else f"{LABEL}=true"
        try:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector,
                                                 _request_timeout=self.timeout)
        except Exception as e:
            log.warning("cannot list pods labelled %s in %s (%s)", LABEL, self.namespace,
                        type(e).__name__)
            return []
        names = [p.metadata.name for p in pods.items or () if p.metadata is not None]
        return [str(n) for n in names if n and n != self.pod]

    def lead(self) -> bool:
        """This pod is the leader: take the label off the others, put it on ours."""
        for other in self.others():
            if self._set(other, None):
                log.info("removed the stale leader label from pod %s", other)
        ok = self._set(self.pod, "true")
        if ok:
            log.info("labelled pod %s/%s %s=true: the Service sends agents here",
                     self.namespace, self.pod, LABEL)
        return ok

    def stand_by(self) -> bool:
        """This pod is not (or no longer) the leader."""
        return self._set(self.pod, None)
