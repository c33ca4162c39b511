"""Who may talk to the arbiter: a shared token, optionally TLS or mutual TLS.

The token travels as ``authorization: Bearer <token>`` call metadata and is checked by
a server interceptor before any handler runs, so no service can forget it. The standard
health service is exempt: Kubernetes' gRPC probes cannot send metadata, and health says
nothing about jobs. Rejections are counted in ``ftagent_arbiter_rejected_requests``.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from ftagent.metrics import ArbiterMetrics
from ftagent.wire.credentials import read_file

log = logging.getLogger("ftagent.arbiter.auth")

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _aborting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
              details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that fails every call with ``code``."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries the shared token."""

    def __init__(self, token: str, metrics: ArbiterMetrics | None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        got = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value if isinstance(value, str) else value.decode(errors="replace")
        if hmac.compare_digest(got.encode(), self._expected):
            return handler
        if self._metrics:
            self._metrics.rejected.labels(reason="unauthenticated").inc()
        why = "no token" if not got else "wrong token"
        log.info("rejected %s: %s", details.method, why)
        return _aborting(handler, grpc.StatusCode.UNAUTHENTICATED,
                         f"{why}: pass the arbiter's --token (env FTAGENT_TOKEN)")


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials | None:
    """TLS with ``cert``/``key``; with ``client_ca`` also require client certificates."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not cert or not key:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    pair = (read_file(key, "--tls-key"), read_file(cert, "--tls-cert"))
    ca = read_file(client_ca, "--tls-client-ca") if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                       require_client_auth=ca is not None)
