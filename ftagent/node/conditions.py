"""Node conditions, node-problem-detector style: ``FtagentGPUHealthy``, ``FtagentNICHealthy``.

Other schedulers and tools (``kubectl describe node``, a descheduler, NPD-aware
autoscalers) read them from the Node's ``status.conditions``; the arbiter does not need
them (it gets the faults over the wire). One condition per problem area, status ``True``
when healthy, ``False`` with a CamelCase reason and a message in words when not; a
condition is only written for an area the agent watches (no GPU seen: no GPU condition).

Bounded writes: ``NodeConditions`` (pure, clock passed in) says when a patch is due -- on a
transition (status, reason or message changed) and otherwise every ``heartbeat`` seconds
(NPD's ``lastHeartbeatTime`` contract) -- so a flapping source costs one patch per change,
never one per observation. The patch is a strategic merge of ``status.conditions`` (merge
key ``type``), through the ``nodes/status`` subresource, so conditions the kubelet and
others own are left alone. ``KubeNodeStatus`` writes it with the ``kubernetes`` client; a
write that fails is retried at the next tick and never stops the agent: RBAC forbidden is
one log line naming the missing permission (``patch nodes/status``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

log = logging.getLogger("ftagent.node.conditions")

GPU_CONDITION = "FtagentGPUHealthy"
NIC_CONDITION = "FtagentNICHealthy"
HEARTBEAT = 60.0
MAX_CONDITION_MESSAGE = 1024  # the kubelet's own messages are one line; keep ours short


@dataclass(frozen=True)
class Health:
    """What one problem area says now: the condition's type, status, reason and message."""

    type: str
    healthy: bool
    reason: str  # CamelCase, no spaces (Kubernetes' convention for reasons)
    message: str


def reason_of(text: str, fallback: str = "Unhealthy") -> str:
    """A CamelCase reason from words: ``"Xid 79"`` -> ``Xid79``, ``"carrier_lost"`` ->
    ``CarrierLost``, ``"ecc dbe"`` -> ``EccDbe``."""
    words = re.findall(r"[A-Za-z0-9]+", text)
    out = "".join(w[:1].upper() + w[1:] for w in words)[:64]
    return out if out and out[0].isalpha() else fallback


def rfc3339(wall: float) -> str:
    return datetime.fromtimestamp(wall, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeConditions:
    """When to patch which conditions (pure; ``now`` is the wall clock, passed in).

    ``plan(states, now)`` returns the conditions to write (every watched area, so one
    patch carries them all with fresh heartbeats) or None when nothing is due;
    ``written(conditions, now)`` records a successful write. Until then the same plan is
    due again, so a failed write is retried at the next call.
    """

    def __init__(self, heartbeat: float = HEARTBEAT) -> None:
        self.heartbeat = heartbeat
        self._since: dict[str, tuple[bool, float]] = {}  # type -> (healthy, transition)
        self._written: dict[str, Health] = {}
        self._written_at: float | None = None

    def plan(self, states: Iterable[Health], now: float) -> list[dict[str, Any]] | None:
        states = list(states)
        for h in states:
            known = self._since.get(h.type)
            if known is None or known[0] != h.healthy:
                self._since[h.type] = (h.healthy, now)
        if not states:
            return None
        changed = any(self._written.get(h.type) != h for h in states)
        due = self._written_at is None or now - self._written_at >= self.heartbeat
        if not changed and not due:
            return None
        return [{
            "type": h.type,
            "status": "True" if h.healthy else "False",
            "reason": h.reason,
            "message": h.message[:MAX_CONDITION_MESSAGE],
            "lastHeartbeatTime": rfc3339(now),
            "lastTransitionTime": rfc3339(self._since[h.type][1]),
        } for h in states]

    def written(self, states: Iterable[Health], now: float) -> None:
        for h in states:
            self._written[h.type] = h
        self._written_at = now

    def changed(self, states: Iterable[Health]) -> bool:
        """Whether a write of ``states`` would be a transition (not only a heartbeat)."""
        return any(self._written.get(h.type) != h for h in states)


class WriteError(Exception):
    """A conditions write that failed; the message says what to do about it."""


class NodeStatusWriter(Protocol):
    """Writes conditions into a Node's status (KubeNodeStatus; tests may pass their own)."""

    def patch_conditions(self, node: str, conditions: list[dict[str, Any]],
                         timeout: float) -> None: ...


def api_client(url: str) -> Any:
    """A ``kubernetes`` ApiClient for ``--kube-api URL`` (``in-cluster``: the pod's service
    account, as every in-cluster client; else the URL, e.g. a ``kubectl proxy``)."""
    from kubernetes import client, config

    if url == "in-cluster":
        try:
            config.load_incluster_config()
        except config.ConfigException as e:
            raise ValueError(f"--kube-api in-cluster: {e} (not in a pod? pass the API "
                             "server's URL)") from None
        return client.ApiClient()
    cfg = client.Configuration()
    cfg.host = url.rstrip("/")
    return client.ApiClient(cfg)


class KubeNodeStatus:
    """``patch nodes/status`` with a strategic merge of ``status.conditions``."""

    def __init__(self, api: Any) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api)

    def patch_conditions(self, node: str, conditions: list[dict[str, Any]],
                         timeout: float) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.core.patch_node_status(node, {"status": {"conditions": conditions}},
                                        _request_timeout=timeout)
        except ApiException as e:
            raise WriteError(describe(e.status, node, e.reason)) from None
        except Exception as e:  # noqa: BLE001 - connection refused, timeouts, TLS
            raise WriteError(f"cannot reach the API server: {type(e).__name__}: "
                             f"{str(e)[:200]}") from None


def describe(status: int | None, node: str, reason: str | None = "") -> str:
    """One line for a failed write, naming what to fix."""
    if status == 403:
        return (f"forbidden: the service account may not patch nodes/status (node {node}); "
                "grant verbs [get, patch] on resources [nodes/status] (deploy/components/node)")
    if status == 404:
        return f"node {node} does not exist: check --node (default $NODE_NAME)"
    if status == 401:
        return "unauthorized: the API server does not accept the service account's token"
    return f"the API server answered {status} {reason or ''}".rstrip()
