"""Operators read jobs with their own Kubernetes credentials; the cluster's RBAC decides.

No shared secret is handed to people. An operator's bearer token (from their kubeconfig:
an OIDC id token, ``kubectl create token``, ...) is checked with a TokenReview for the API
server's own audience (``operators``: a ``TokenReviews`` whose principal is the user it
names), and each read asks a SubjectAccessReview whether that user may do it to the virtual
resource ``ftagentjobs`` in group ``ftagent.io``:

============================  =========================================================
call                          asked (namespace, name)
============================  =========================================================
``GetJob JOB -n NS``          ``get ftagentjobs`` in NS, name JOB
``WatchEvents [JOB] -n NS``   ``watch ftagentjobs`` in NS (name JOB when given)
``ListJobs``                  ``list ftagentjobs`` cluster-wide; else in each namespace
                              that has jobs (at most ``max_namespaces``)
============================  =========================================================

so a Role like ``{apiGroups: [ftagent.io], resources: [ftagentjobs], verbs: [get, list,
watch]}`` bound in a namespace lets its subjects read that namespace's jobs, and a
``resourceNames`` list narrows it to some jobs. An operator never registers ranks nor
reports for nodes. Answers are cached per (user, groups, verb, namespace, name): allowed
for ``ttl`` seconds, denied for ``negative_ttl``; an API server that cannot answer makes
the call UNAVAILABLE (retry), never allowed. The SubjectAccessReview call itself is plugged
in by the composition root (kube/tokenreview.py), so the arbiter never imports kube.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

from ftagent.arbiter.auth import Principal, Reviewed, UserInfo

GROUP, RESOURCE = "ftagent.io", "ftagentjobs"

# (user, verb, namespace, name) -> (allowed, reason); raises ReviewUnavailable
AccessReview = Callable[[UserInfo, str, str, str], Awaitable[tuple[bool, str]]]


def operator_of(r: Reviewed) -> Principal | None:
    """The operator a TokenReview (API server audience) vouches for, or None. A pod's own
    token is no operator: pods speak through their own path (kube/projected.py)."""
    if not r.authenticated or not r.username:
        return None
    if r.one("pod-name") or r.one("pod-uid"):
        return None
    user = UserInfo(r.username, r.uid, tuple(r.groups),
                    tuple(sorted((k, tuple(v)) for k, v in r.extra.items())))
    return Principal(f"operator {r.username}", operator=user)


class OperatorAccess:
    """Grants an operator's call what SubjectAccessReview allows (see the module doc)."""

    def __init__(self, review: AccessReview, *, ttl: float = 60.0, negative_ttl: float = 10.0,
                 max_entries: int = 50_000, max_namespaces: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._review = review
        self.ttl, self.negative_ttl, self.max_entries = ttl, negative_ttl, max_entries
        self.max_namespaces = max_namespaces
        self.clock = clock
        # the namespaces that have jobs now (the server's registry; set by the root)
        self.namespaces: Callable[[], Iterable[str]] = lambda: ()
        self._cache: OrderedDict[tuple[object, ...], tuple[float, bool]] = OrderedDict()
        self.reviews = 0

    async def allowed(self, user: UserInfo, verb: str, namespace: str, name: str) -> bool:
        key = (user, verb, namespace, name)
        now = self.clock()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        self.reviews += 1
        ok, _ = await self._review(user, verb, namespace, name)
        self._cache[key] = (now + (self.ttl if ok else self.negative_ttl), ok)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return ok

    async def grant(self, p: Principal, verb: str, namespace: str, job: str) -> Principal:
        user = p.operator
        if user is None or "\x00" in namespace:
            return p
        readable: set[str] = set()
        if verb == "list" or not namespace:  # every namespace it may see
            cluster_verb = "list" if verb == "list" else verb
            if await self.allowed(user, cluster_verb, "", ""):
                readable.add("*")
            else:
                names = sorted({n for n in self.namespaces() if n})[:self.max_namespaces]
                oks = await asyncio.gather(*(self.allowed(user, "list", n, "") for n in names))
                readable.update(n for n, ok in zip(names, oks, strict=True) if ok)
        elif job:
            if await self.allowed(user, verb, namespace, job):
                readable.add(f"{namespace}/{job}")
        elif await self.allowed(user, verb, namespace, ""):
            readable.add(namespace)
        return dataclasses.replace(p, readable=frozenset(readable))
