"""SubjectAccessReview, answered as the real API server's RBAC authorizer answers it.

``POST /apis/authorization.k8s.io/v1/subjectaccessreviews`` (create only, never stored)
with ``spec.user``/``spec.groups``/``spec.uid``/``spec.extra`` and ``spec.resourceAttributes``
(``namespace``, ``verb``, ``group``, ``resource``, ``name``) answers 201 with ``status.allowed``
and, when allowed, ``status.reason`` worded as RBAC words it (``RBAC: allowed by
RoleBinding "NAME/NS" of Role "NAME" to User "alice"``); a denial is ``allowed: false`` with
no reason (RBAC says nothing about what would have allowed it). A spec naming neither user
nor groups, or neither resource nor non-resource attributes, is 422 Invalid.

The policy is what the test grants (:meth:`Access.allow`): a *RoleBinding* (``namespace``
given) allows only requests in that namespace; a *ClusterRoleBinding* (no namespace) allows
every namespace and cluster-wide requests (``namespace`` empty). ``names`` is the rule's
``resourceNames``: such a rule allows only requests naming one of them (so never a
``list``/``watch`` of the whole collection). ``*`` matches any verb, resource or group.
Not modelled: aggregation, non-resource URLs, subresources, field/label selectors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .errors import ApiError


@dataclass(frozen=True)
class Grant:
    subject: str  # a user name, or "group:NAME"
    verbs: tuple[str, ...]
    resource: str
    group: str
    namespace: str | None  # None: a ClusterRoleBinding
    names: tuple[str, ...]
    binding: str


class Access:
    """The RBAC rules the fake API server authorizes SubjectAccessReviews with."""

    def __init__(self) -> None:
        self.grants: list[Grant] = []
        self.lock = threading.Lock()

    def allow(self, subject: str, verbs: tuple[str, ...] | str, resource: str = "ftagentjobs",
              group: str = "ftagent.io", namespace: str | None = None,
              names: tuple[str, ...] = (), binding: str = "") -> None:
        verbs = (verbs,) if isinstance(verbs, str) else tuple(verbs)
        with self.lock:
            self.grants.append(Grant(subject, verbs, resource, group, namespace, tuple(names),
                                     binding or f"grant-{len(self.grants)}"))

    def review(self, body: Any) -> dict[str, Any]:
        spec = body.get("spec") if isinstance(body, dict) else None
        if not isinstance(spec, dict):
            raise ApiError(400, "BadRequest", "SubjectAccessReview has no spec")
        user, groups = spec.get("user") or "", list(spec.get("groups") or [])
        attrs = spec.get("resourceAttributes")
        if not user and not groups:
            raise ApiError(422, "Invalid", 'SubjectAccessReview.authorization.k8s.io "" is '
                           "invalid: spec.user: Invalid value: \"\": at least one of user or "
                           "group must be specified")
        if not isinstance(attrs, dict) and not spec.get("nonResourceAttributes"):
            raise ApiError(422, "Invalid", 'SubjectAccessReview.authorization.k8s.io "" is '
                           "invalid: spec.resourceAttributes: Invalid value: \"null\": exactly "
                           "one of nonResourceAttributes or resourceAttributes must be "
                           "specified")
        status: dict[str, Any] = {"allowed": False}
        grant = self._find(user, groups, attrs or {})
        if grant is not None:
            kind = "RoleBinding" if grant.namespace is not None else "ClusterRoleBinding"
            where = f"{grant.binding}/{grant.namespace}" if grant.namespace is not None \
                else grant.binding
            who = (f'Group "{grant.subject[6:]}"' if grant.subject.startswith("group:")
                   else f'User "{grant.subject}"')
            role = "Role" if grant.namespace is not None else "ClusterRole"
            status = {"allowed": True, "reason": f'RBAC: allowed by {kind} "{where}" of '
                      f'{role} "{grant.binding}" to {who}'}
        return {"kind": "SubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}

    def _find(self, user: str, groups: list[str], attrs: dict[str, Any]) -> Grant | None:
        ns, name = attrs.get("namespace") or "", attrs.get("name") or ""
        verb, resource, group = attrs.get("verb"), attrs.get("resource"), \
            attrs.get("group") or ""
        with self.lock:
            grants = list(self.grants)
        for g in grants:
            if g.subject != user and not (g.subject.startswith("group:")
                                          and g.subject[6:] in groups):
                continue
            if not ("*" in g.verbs or verb in g.verbs) or g.resource not in ("*", resource) \
                    or g.group not in ("*", group):
                continue
            if g.namespace is not None and g.namespace != ns:
                continue
            if g.names and name not in g.names:
                continue
            return g
        return None
