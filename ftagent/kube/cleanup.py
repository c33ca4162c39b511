"""What ftagent leaves on nodes, and taking it off after an uninstall (``ftagent cleanup``).

``kubectl delete -k deploy/`` deletes the objects it created; it cannot take back what
ftagent wrote onto Nodes it did not create:

* the arbiter's cordon of a faulty node (``actuator.py``): the taint
  ``ftagent.io/fault=KIND:NoSchedule``, the label ``ftagent.io/cordoned``, the annotations
  ``ftagent.io/cordoned-by|cordoned-at|fault-kind|fault-id|fault-job|fault`` and
  ``spec.unschedulable``;
* the node agent's conditions in ``status.conditions`` (``FtagentGPUHealthy``,
  ``FtagentNICHealthy``: the types are passed in, ``kube`` does not import ``node``), stale
  once the agent is gone.

:func:`marks` reads them off a Node (pure); :func:`without_marks` is the Node without them
(pure: written back with its ``resourceVersion``, so a concurrent change is a 409 and read
again, never overwritten; ``spec.taints`` is an atomic list, so a patch could not remove one
taint alone); :func:`condition_patch` deletes the conditions through ``nodes/status`` (a
strategic merge ``$patch: delete`` by the merge key ``type``, leaving the kubelet's own).

The cordon itself (``spec.unschedulable``) is left unless asked (``uncordon``), and then
only on a node ftagent cordoned (its ``cordoned-by`` annotation): a node ftagent cordoned
had node-scope evidence against it, so by default it stays out of scheduling and the
report says why, since the annotations that said so are gone after the cleanup.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ftagent.kube.actuator import ANNOTATIONS, TAINT_KEY

PREFIX = ANNOTATIONS  # "ftagent.io/": every label and annotation key ftagent writes on a Node
CORDONED_BY = f"{ANNOTATIONS}cordoned-by"
ARBITER = "ftagent-arbiter"  # the value the arbiter writes there
# ftagent's own pods: their presence means an uninstall is not finished (they would write
# the marks again)
RUNNING_SELECTOR = "app.kubernetes.io/name in (ftagent-arbiter,ftagent-node)"


@dataclass(frozen=True)
class NodeMarks:
    """What ftagent left on one Node."""

    node: str
    taints: int = 0  # ftagent.io/fault taints
    labels: tuple[str, ...] = ()
    annotations: tuple[str, ...] = ()
    conditions: tuple[str, ...] = ()
    cordoned_by_ftagent: bool = False  # unschedulable, and ftagent says it cordoned it
    why: str = ""  # the cordon's annotations in words ("" when none)

    @property
    def empty(self) -> bool:
        return not (self.taints or self.labels or self.annotations or self.conditions)

    def describe(self, uncordon: bool) -> str:
        """One line for the operator."""
        parts = []
        if self.taints:
            parts.append(f"taint {TAINT_KEY}")
        if self.labels:
            parts.append("label " + ", ".join(self.labels))
        if self.annotations:
            parts.append(f"{len(self.annotations)} annotation(s) {PREFIX}*")
        if self.conditions:
            parts.append("condition " + ", ".join(self.conditions))
        line = f"node {self.node}: " + "; ".join(parts)
        if self.cordoned_by_ftagent:
            line += (" -- uncordoned" if uncordon else
                     " -- stays cordoned (`kubectl uncordon` after a look, or --uncordon)")
            if self.why:
                line += f"; ftagent cordoned it: {self.why}"
        return line


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _ours(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(PREFIX)


def _is_fault_taint(t: Any) -> bool:
    return isinstance(t, dict) and t.get("key") == TAINT_KEY


def marks(node: Mapping[str, Any], conditions: Collection[str]) -> NodeMarks:
    """What of ftagent is on ``node`` (a Node as JSON); ``conditions``: the node agent's
    condition types."""
    meta, spec, status = (_dict(node.get(k)) for k in ("metadata", "spec", "status"))
    notes = _dict(meta.get("annotations"))
    labels = sorted(k for k in _dict(meta.get("labels")) if _ours(k))
    annotations = sorted(k for k in notes if _ours(k))
    found = [c.get("type") for c in _list(status.get("conditions"))
             if isinstance(c, dict) and c.get("type") in conditions]
    taints = sum(1 for t in _list(spec.get("taints")) if _is_fault_taint(t))
    by_ftagent = spec.get("unschedulable") is True and notes.get(CORDONED_BY) == ARBITER
    why = ""
    if by_ftagent:
        bits = [f"{k} {str(notes[f'{PREFIX}{k}'])[:200]}" for k in
                ("cordoned-at", "fault-kind", "fault-job", "fault") if f"{PREFIX}{k}" in notes]
        why = ", ".join(bits)
    return NodeMarks(str(meta.get("name", "")), taints, tuple(labels), tuple(annotations),
                     tuple(str(c) for c in found), by_ftagent, why)


def without_marks(node: dict[str, Any], uncordon: bool) -> dict[str, Any]:
    """``node`` (as read, with its resourceVersion) without ftagent's taints, labels and
    annotations, and uncordoned when ``uncordon`` and ftagent cordoned it. Conditions
    live in ``status``, which an update of the Node ignores: :func:`condition_patch`."""
    out = dict(node)
    meta = out["metadata"] = dict(_dict(node.get("metadata")))
    by_ftagent = _dict(node.get("spec")).get("unschedulable") is True and \
        _dict(meta.get("annotations")).get(CORDONED_BY) == ARBITER
    for key in ("labels", "annotations"):
        if isinstance(meta.get(key), dict):
            meta[key] = {k: v for k, v in meta[key].items() if not _ours(k)}
    spec = out["spec"] = dict(_dict(node.get("spec")))
    if "taints" in spec:
        kept = [t for t in _list(spec["taints"]) if not _is_fault_taint(t)]
        if kept:
            spec["taints"] = kept
        else:
            del spec["taints"]
    if uncordon and by_ftagent:
        spec.pop("unschedulable", None)
    return out


def condition_patch(types: Collection[str]) -> dict[str, Any]:
    """A strategic merge patch of ``nodes/status`` that deletes these conditions only."""
    return {"status": {"conditions": [{"type": t, "$patch": "delete"} for t in types]}}


class Cleaner:
    """The API calls (blocking): list nodes, write each back without ftagent's marks."""

    def __init__(self, api_client: Any, conditions: Collection[str], *,
                 attempts: int = 5, timeout: float = 30.0) -> None:
        from kubernetes import client

        self.core: Any = client.CoreV1Api(api_client)
        self.conditions = tuple(conditions)
        self.attempts, self.timeout = attempts, timeout

    def running(self) -> list[str]:
        """ftagent's own pods still there ("namespace/name"), any namespace."""
        import json

        resp = self.core.list_pod_for_all_namespaces(
            label_selector=RUNNING_SELECTOR, _preload_content=False,
            _request_timeout=self.timeout)
        items = _list(_dict(json.loads(resp.data)).get("items"))
        return sorted(f"{_dict(p.get('metadata')).get('namespace')}/"
                      f"{_dict(p.get('metadata')).get('name')}" for p in items
                      if isinstance(p, dict))

    def nodes(self) -> list[dict[str, Any]]:
        import json

        out: list[dict[str, Any]] = []
        cont = None
        while True:
            resp = self.core.list_node(limit=500, _continue=cont, _preload_content=False,
                                       _request_timeout=self.timeout)
            page = _dict(json.loads(resp.data))
            out += [n for n in _list(page.get("items")) if isinstance(n, dict)]
            cont = _dict(page.get("metadata")).get("continue")
            if not cont:
                return out

    def clean(self, name: str, uncordon: bool,
              report: Callable[[NodeMarks], None]) -> NodeMarks | None:
        """Take ftagent's marks off node ``name`` (read, modify, update; again on 409).
        Returns what was there (None: the node is gone)."""
        import json

        from kubernetes.client.rest import ApiException

        for _ in range(self.attempts):
            try:
                node = _dict(json.loads(self.core.read_node(
                    name, _preload_content=False, _request_timeout=self.timeout).data))
            except ApiException as e:
                if e.status == 404:
                    return None
                raise
            found = marks(node, self.conditions)
            if found.empty:
                return found
            if found.taints or found.labels or found.annotations:
                try:
                    self.core.replace_node(name, without_marks(node, uncordon),
                                           _preload_content=False,
                                           _request_timeout=self.timeout)
                except ApiException as e:
                    if e.status == 409:
                        continue  # changed since read: again, with the fresh node
                    if e.status == 404:
                        return None
                    raise
            if found.conditions:
                try:
                    self.core.patch_node_status(
                        name, condition_patch(found.conditions), _preload_content=False,
                        _request_timeout=self.timeout,
                        _content_type="application/strategic-merge-patch+json")
                except ApiException as e:
                    if e.status != 404:
                        raise
            report(found)
            return found
        raise RuntimeError(f"node {name} kept changing under us ({self.attempts} conflicts in "
                           "a row); run ftagent cleanup again")
