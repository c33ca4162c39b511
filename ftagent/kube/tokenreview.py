"""The arbiter's TokenReview call: is this bearer token a pod's projected ServiceAccount
token for our audience, and which pod, uid and node does the API server say it is bound to?
(Or, for ``--operators``, which user is it?) And its SubjectAccessReview call: may that
user read this job (arbiter/operators.py)?

Plugged into ``arbiter.auth.TokenReviews`` by the composition root (cmd/arbiter.py), so the
arbiter never imports kube. The call blocks (the ``kubernetes`` client is synchronous) and
runs on a small thread pool of its own, off the event loop. Anything but an answer (an
outage, a timeout, 403 because the arbiter's ClusterRole lacks ``create`` on
``tokenreviews``) raises ``ReviewUnavailable``: the caller is told to retry, never let in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ftagent.arbiter.auth import Reviewed, ReviewUnavailable, UserInfo

log = logging.getLogger("ftagent.kube.tokenreview")

TIMEOUT = 5.0  # seconds per review: an agent's Connect waits on it


def review_sync(api_client: Any, token: str, audiences: list[str],
                timeout: float = TIMEOUT) -> Reviewed:
    """One TokenReview (POST /apis/authentication.k8s.io/v1/tokenreviews)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    api = client.AuthenticationV1Api(api_client)
    body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token,
                                                             audiences=audiences))
    try:
        out = api.create_token_review(body, _request_timeout=timeout)
    except ApiException as e:
        hint = (": the arbiter's ClusterRole needs create on tokenreviews."
                "authentication.k8s.io" if e.status == 403 else "")
        raise ReviewUnavailable(f"TokenReview failed: HTTP {e.status} {e.reason}{hint}"
                                ) from None
    except Exception as e:  # urllib3 connection errors, timeouts
        raise ReviewUnavailable(f"TokenReview failed: {type(e).__name__}: {e}") from None
    st = out.status
    if st is None:
        return Reviewed(False, error="TokenReview answered without a status")
    user = st.user
    extra = {str(k): tuple(str(x) for x in (v or ())) for k, v in
             ((user.extra if user is not None else None) or {}).items()}
    return Reviewed(bool(st.authenticated), username=(user.username or "") if user else "",
                    audiences=tuple(st.audiences or ()), extra=extra, error=st.error or "",
                    uid=(user.uid or "") if user else "",
                    groups=tuple(str(g) for g in ((user.groups if user else None) or ())))


def reviewer(api_client: Any, audience: str, workers: int = 4
             ) -> Callable[[str], Awaitable[Reviewed]]:
    """An async ``review(token)`` for ``TokenReviews`` (its own threads: a slow API server
    must not take the threads other work runs on). ``audience`` "": the API server's own
    audiences (operators' kubeconfig tokens)."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenreview")
    audiences = [audience] if audience else []

    async def review(token: str) -> Reviewed:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, review_sync, api_client, token, audiences)

    return review


def access_review_sync(api_client: Any, user: UserInfo, verb: str, namespace: str,
                       name: str, timeout: float = TIMEOUT) -> tuple[bool, str]:
    """One SubjectAccessReview (POST /apis/authorization.k8s.io/v1/subjectaccessreviews):
    may ``user`` ``verb`` ftagentjobs.ftagent.io ``name`` in ``namespace``?"""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from ftagent.arbiter.operators import GROUP, RESOURCE

    attrs = client.V1ResourceAttributes(group=GROUP, resource=RESOURCE, verb=verb,
                                        namespace=namespace or None, name=name or None)
    spec = client.V1SubjectAccessReviewSpec(
        user=user.username, uid=user.uid or None, groups=list(user.groups) or None,
        extra={k: list(v) for k, v in user.extra} or None, resource_attributes=attrs)
    try:
        out = client.AuthorizationV1Api(api_client).create_subject_access_review(
            client.V1SubjectAccessReview(spec=spec), _request_timeout=timeout)
    except ApiException as e:
        hint = (": the arbiter's ClusterRole needs create on subjectaccessreviews."
                "authorization.k8s.io" if e.status == 403 else "")
        raise ReviewUnavailable(f"SubjectAccessReview failed: HTTP {e.status} {e.reason}"
                                f"{hint}") from None
    except Exception as e:  # urllib3 connection errors, timeouts
        raise ReviewUnavailable(f"SubjectAccessReview failed: {type(e).__name__}: {e}"
                                ) from None
    st = out.status
    return (bool(st.allowed) and not bool(st.denied), st.reason or "") if st else (False, "")


def access_reviewer(api_client: Any, workers: int = 2
                    ) -> Callable[[UserInfo, str, str, str], Awaitable[tuple[bool, str]]]:
    """An async ``review(user, verb, namespace, name)`` for ``OperatorAccess``."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="accessreview")

    async def review(user: UserInfo, verb: str, namespace: str, name: str
                     ) -> tuple[bool, str]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, access_review_sync, api_client, user, verb,
                                          namespace, name)

    return review
