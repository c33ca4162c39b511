"""The arbiter's TokenReview call: is this bearer token a pod's projected ServiceAccount
token for our audience, and which pod, uid and node does the API server say it is bound to?

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

from ftagent.arbiter.auth import Reviewed, ReviewUnavailable

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
                    audiences=tuple(st.audiences or ()), extra=extra, error=st.error or "")


def reviewer(api_client: Any, audience: str, workers: int = 4
             ) -> Callable[[str], Awaitable[Reviewed]]:
    """An async ``review(token)`` for ``TokenReviews`` (its own threads: a slow API server
    must not take the threads other work runs on)."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenreview")

    async def review(token: str) -> Reviewed:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, review_sync, api_client, token, [audience])

    return review
