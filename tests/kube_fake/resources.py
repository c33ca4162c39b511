"""The resource kinds the fake serves, and label/field selectors as the API server parses them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kind:
    """One REST resource: where it lives and how it behaves."""

    group: str  # "" for core
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status: bool = False  # has a /status subresource (main writes keep the old status)
    custom: bool = False  # a custom resource: no strategic merge patch (415)
    fields: tuple[str, ...] = ("metadata.name", "metadata.namespace")

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """The name in messages: ``pods``, ``leases.coordination.k8s.io``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def store_key(self) -> str:
        """Kinds that share storage (core/v1 and events.k8s.io/v1 events) share this."""
        return "events" if self.plural == "events" and self.group in ("", "events.k8s.io") \
            else f"{self.group}/{self.plural}"


_POD_FIELDS = ("metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy",
               "spec.schedulerName", "spec.serviceAccountName", "spec.hostNetwork",
               "status.phase", "status.podIP", "status.nominatedNodeName")
_EVENT_FIELDS = ("metadata.name", "metadata.namespace", "involvedObject.kind",
                 "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
                 "involvedObject.apiVersion", "involvedObject.resourceVersion",
                 "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type")

_JOB_KINDS = [
    ("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"),
    ("kubeflow.org", "v1", "tfjobs", "TFJob"),
    ("kubeflow.org", "v1", "mpijobs", "MPIJob"),
    ("kubeflow.org", "v1", "paddlejobs", "PaddleJob"),
    ("kubeflow.org", "v1", "mxjobs", "MXJob"),
    ("kubeflow.org", "v1", "xgboostjobs", "XGBoostJob"),
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"),
    ("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet"),
    ("batch.volcano.sh", "v1alpha1", "jobs", "Job"),
]

KINDS: list[Kind] = [
    Kind("", "v1", "pods", "Pod", status=True, fields=_POD_FIELDS),
    Kind("", "v1", "nodes", "Node", namespaced=False, status=True,
         fields=("metadata.name", "spec.unschedulable")),
    Kind("", "v1", "events", "Event", fields=_EVENT_FIELDS),
    Kind("", "v1", "configmaps", "ConfigMap"),
    Kind("", "v1", "secrets", "Secret", fields=("metadata.name", "metadata.namespace", "type")),
    Kind("", "v1", "namespaces", "Namespace", namespaced=False, status=True,
         fields=("metadata.name", "status.phase")),
    Kind("", "v1", "services", "Service", status=True),
    Kind("events.k8s.io", "v1", "events", "Event", fields=_EVENT_FIELDS),
    Kind("coordination.k8s.io", "v1", "leases", "Lease"),
    Kind("batch", "v1", "jobs", "Job", status=True),
    Kind("apps", "v1", "deployments", "Deployment", status=True),
    Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", status=True),
    Kind("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations",
         "MutatingWebhookConfiguration", namespaced=False),
    *[Kind(g, v, p, k, status=True, custom=True) for g, v, p, k in _JOB_KINDS],
    # DRA (resource.k8s.io/v1): slices the drivers publish, taint rules (KEP-5055)
    Kind("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", namespaced=False,
         fields=("metadata.name", "spec.nodeName", "spec.driver")),
    Kind("resource.k8s.io", "v1", "devicetaintrules", "DeviceTaintRule", namespaced=False,
         status=True),
    # a pod's claims: the scheduler's allocation and reservedFor in their status
    Kind("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", status=True),
    # create-only, never stored: answered by tokens.Issuer (server.py routes it there)
    Kind("authentication.k8s.io", "v1", "tokenreviews", "TokenReview", namespaced=False),
    Kind("authorization.k8s.io", "v1", "subjectaccessreviews", "SubjectAccessReview",
         namespaced=False),
]


def find_kind(group: str, version: str, plural: str) -> Kind | None:
    for k in KINDS:
        if k.group == group and k.version == version and k.plural == plural:
            return k
    return None


def kind_for(resource: str) -> Kind:
    """``"pods"``, ``"leases.coordination.k8s.io"`` or ``"coordination.k8s.io/leases"``."""
    if "/" in resource:
        group, plural = resource.split("/", 1)
    elif "." in resource:
        plural, group = resource.split(".", 1)
    else:
        group, plural = "", resource
    for k in KINDS:
        if k.group == group and k.plural == plural:
            return k
    raise KeyError(f"fake API server serves no resource {resource!r}")


class SelectorError(ValueError):
    """Unparseable selector (the server answers 400 BadRequest)."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # exists, !exists, =, !=, in, notin
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        has = self.key in labels
        if self.op == "exists":
            return has
        if self.op == "!exists":
            return not has
        if self.op in ("=", "in"):
            return has and labels[self.key] in self.values
        # != and notin match objects without the key, as the real server does
        return not has or labels[self.key] not in self.values


_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VAL = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"


def _split_terms(text: str) -> list[str]:
    terms, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    return [t.strip() for t in terms if t.strip()]


def parse_label_selector(text: str | None) -> list[Requirement]:
    """``a``, ``!a``, ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``, comma = and."""
    if not text:
        return []
    out = []
    for term in _split_terms(text):
        m = re.fullmatch(rf"({_KEY})\s+(in|notin)\s+\(([^)]*)\)", term)
        if m:
            vals = tuple(v.strip() for v in m.group(4).split(",") if v.strip())
            out.append(Requirement(m.group(1), m.group(3), vals))
            continue
        m = re.fullmatch(rf"({_KEY})\s*(==|!=|=)\s*({_VAL})", term)
        if m:
            op = "!=" if m.group(3) == "!=" else "="
            out.append(Requirement(m.group(1), op, (m.group(4),)))
            continue
        m = re.fullmatch(rf"(!?)\s*({_KEY})", term)
        if m:
            out.append(Requirement(m.group(2), "!exists" if m.group(1) else "exists"))
            continue
        raise SelectorError(f"unable to parse requirement: found '{term}', expected: "
                            f"identifier, '!', 'in', 'notin', '=', '==' or '!='")
    return out


def parse_field_selector(text: str | None, kind: Kind) -> list[tuple[str, str, str]]:
    """``path=value`` / ``path==value`` / ``path!=value`` terms, only the kind's fields."""
    if not text:
        return []
    out = []
    for term in _split_terms(text):
        m = re.fullmatch(r"([A-Za-z.]+)\s*(==|!=|=)\s*(.*)", term)
        if not m:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
        if m.group(1) not in kind.fields:
            raise SelectorError(f'field label not supported: {m.group(1)}')
        out.append((m.group(1), "!=" if m.group(2) == "!=" else "=", m.group(3)))
    return out


def field_value(obj: dict[str, Any], path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    if isinstance(cur, dict) and path == "source":
        return str(cur.get("component", ""))
    return str(cur)


def selected(obj: dict[str, Any], labels: list[Requirement],
             fields: list[tuple[str, str, str]]) -> bool:
    lab = (obj.get("metadata") or {}).get("labels") or {}
    if not all(r.matches(lab) for r in labels):
        return False
    return all((field_value(obj, path) == value) == (op == "=") for path, op, value in fields)
