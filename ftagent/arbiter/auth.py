"""Who may talk to the arbiter, and for which job.

Authentication turns what a caller presents (a bearer token in the ``authorization``
call metadata, a verified client certificate) into a ``Principal`` through a chain of
``Authenticator``s; authorization is one function, ``authorize(principal, namespace,
job)``, that every handler asks before it touches a job.

Credentials, from the arbiter's ``--token`` (its *secret*):

* a **job token** ``ftj1.<ns>.<job>.<mac>`` (each part unpadded base64url; ``mac`` is
  HMAC-SHA256 keyed with the secret over a versioned, length-prefixed encoding of
  namespace and job) speaks for that one job only: it may Connect as that job, read it
  with GetJob and WatchEvents, and ListJobs shows only it. ``ftagent token --job NAME``
  derives it; the arbiter stores nothing per job and checks it with compare_digest.
* a **node token** ``ftn1.<node>.<mac>`` (same encoding, its own MAC context) speaks for
  one node's agent (``ftagent node``): it may only ReportNode for that node (``*``: for
  every node, the DaemonSet's one shared credential), never register ranks, read a job
  or list jobs. ``ftagent token --node NAME`` derives it.
* the **secret itself** is the admin: every job, every RPC.
* a **client certificate** (mutual TLS, ``--tls-client-ca``) without a token is the
  admin, but only on an arbiter without a secret: with a secret every call needs a token
  (mTLS then only secures the transport), so one pod's certificate cannot act for
  another job. A token presented over mTLS decides the scope.
* with neither a secret nor a client CA every caller is the admin (the arbiter allows
  that only on loopback or with ``--insecure``).

The standard health service is exempt: Kubernetes' gRPC probes cannot send metadata,
and health says nothing about jobs. Rejections are counted in
``ftagent_arbiter_rejected_requests`` (reasons ``unauthenticated``, ``permission_denied``).

A Kubernetes authenticator (the pod's projected service-account token, audience
``ftagent``, checked with a TokenReview) is one more ``Authenticator`` in the chain; it is
asynchronous for that reason.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import logging
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc

from ftagent.metrics import ArbiterMetrics
from ftagent.wire.credentials import read_file

log = logging.getLogger("ftagent.arbiter.auth")

TOKEN_VERSION = "ftj1"
_MAC_CONTEXT = b"ftagent job token v1\x00"
NODE_TOKEN_VERSION = "ftn1"
_NODE_MAC_CONTEXT = b"ftagent node token v1\x00"
ALL_NODES = "*"  # a node token for every node (one Secret for the whole DaemonSet)
MIN_SECRET = 16  # shorter secrets work but are warned about: job tokens are only as strong


# --------------------------------------------------------------------------- principals


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a caller is. ``admin`` acts for every job; otherwise only for ``namespace`` and,
    when ``job`` is set, only that job (``job=None``: every job of the namespace)."""

    name: str  # for logs and messages: "admin", "job ns/train", ...
    admin: bool = False
    namespace: str | None = None
    job: str | None = None
    node: str | None = None  # a node agent's: reports for this node only (ALL_NODES: any)

    def scope(self) -> str:
        if self.admin:
            return "every job"
        if self.node is not None:
            return "every node's reports" if self.node == ALL_NODES else \
                f"the reports of node {self.node!r}"
        if self.job is None:
            return f"the jobs of namespace {self.namespace!r}"
        return f"job {_job_name(self.namespace or '', self.job)}"


ANONYMOUS = Principal("anonymous (the arbiter has no credentials set)", admin=True)


def authorize(p: Principal, namespace: str, job: str) -> bool:
    """May ``p`` act for (read, register as, report for) ``job`` in ``namespace``?"""
    if p.admin:
        return True
    return p.namespace is not None and p.namespace == namespace and (
        p.job is None or p.job == job)


def authorize_node(p: Principal, node: str) -> bool:
    """May ``p`` report node-scoped faults for ``node`` (ReportNode)? The admin and that
    node's token (or the every-node token); a job token never: a pod must not be able to
    fault the node its job shares with others."""
    return p.admin or p.node is not None and p.node in (ALL_NODES, node)


def _job_name(namespace: str, job: str) -> str:
    return f"{namespace}/{job}" if namespace else job


# --------------------------------------------------------------------------- job tokens


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes | None:
    """Strict unpadded base64url: None unless ``text`` is the canonical encoding."""
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
    return data if _b64(data) == text else None


def _mac(secret: str, namespace: str, job: str) -> bytes:
    ns, name = namespace.encode(), job.encode()
    msg = _MAC_CONTEXT + struct.pack(">I", len(ns)) + ns + struct.pack(">I", len(name)) + name
    return hmac.new(secret.encode(), msg, hashlib.sha256).digest()


def job_token(secret: str, namespace: str, job: str) -> str:
    """The token that speaks for ``job`` in ``namespace`` (derived, nothing is stored)."""
    if not secret:
        raise ValueError("no secret to derive a job token from")
    if not job:
        raise ValueError("a job token needs a job name")
    return ".".join((TOKEN_VERSION, _b64(namespace.encode()), _b64(job.encode()),
                     _b64(_mac(secret, namespace, job))))


def parse_job_token(token: str) -> tuple[str, str, bytes] | None:
    """(namespace, job, mac) of a well-formed job token, unverified; None otherwise."""
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != TOKEN_VERSION:
        return None
    ns, job, mac = (_unb64(p) for p in parts[1:])
    if ns is None or not job or mac is None or len(mac) != hashlib.sha256().digest_size:
        return None
    try:
        return ns.decode(), job.decode(), mac
    except UnicodeDecodeError:
        return None


def _node_mac(secret: str, node: str) -> bytes:
    name = node.encode()
    return hmac.new(secret.encode(), _NODE_MAC_CONTEXT + struct.pack(">I", len(name)) + name,
                    hashlib.sha256).digest()


def node_token(secret: str, node: str) -> str:
    """The token that speaks for the node agent of ``node`` (``ALL_NODES``: any node)."""
    if not secret:
        raise ValueError("no secret to derive a node token from")
    if not node:
        raise ValueError("a node token needs a node name (or * for every node)")
    return ".".join((NODE_TOKEN_VERSION, _b64(node.encode()), _b64(_node_mac(secret, node))))


def parse_node_token(token: str) -> tuple[str, bytes] | None:
    """(node, mac) of a well-formed node token, unverified; None otherwise."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != NODE_TOKEN_VERSION:
        return None
    node, mac = (_unb64(p) for p in parts[1:])
    if not node or mac is None or len(mac) != hashlib.sha256().digest_size:
        return None
    try:
        return node.decode(), mac
    except UnicodeDecodeError:
        return None


# --------------------------------------------------------------------------- authenticators


@dataclass(frozen=True, slots=True)
class Presented:
    """What one call presented: its bearer token and its verified client certificate."""

    bearer: str | None = None  # None: no authorization metadata at all
    certificate: str = ""  # identity of a verified client certificate ("" without mTLS)
    problem: str = ""  # why the authorization metadata cannot be used (then refused)

    @classmethod
    def from_call(cls, metadata: Sequence[tuple[str, Any]] | None,
                  identities: Sequence[bytes] | None = None) -> Presented:
        values = [v if isinstance(v, str) else bytes(v).decode(errors="replace")
                  for k, v in metadata or () if k == "authorization"]
        cert = b", ".join(identities or ()).decode(errors="replace")
        if not values:
            return cls(None, cert)
        if len(values) > 1:
            return cls(None, cert, "more than one authorization header")
        scheme, _, token = values[0].partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return cls(None, cert, "authorization is not `Bearer <token>`")
        return cls(token.strip(), cert)


class Authenticator(Protocol):
    """Turns what a call presented into a Principal, or None when it does not vouch for it."""

    async def authenticate(self, presented: Presented) -> Principal | None: ...


class JobTokens:
    """Job tokens derived from the secret (``job_token``)."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def authenticate(self, presented: Presented) -> Principal | None:
        parsed = parse_job_token(presented.bearer or "")
        if parsed is None:
            return None
        namespace, job, mac = parsed
        if not hmac.compare_digest(mac, _mac(self._secret, namespace, job)):
            return None
        return Principal(f"job {_job_name(namespace, job)}", namespace=namespace, job=job)


class NodeTokens:
    """Node tokens derived from the secret (``node_token``)."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def authenticate(self, presented: Presented) -> Principal | None:
        parsed = parse_node_token(presented.bearer or "")
        if parsed is None:
            return None
        node, mac = parsed
        if not hmac.compare_digest(mac, _node_mac(self._secret, node)):
            return None
        return Principal(f"node {node}", node=node)


class Secret:
    """The arbiter's secret itself: the admin."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    async def authenticate(self, presented: Presented) -> Principal | None:
        if presented.bearer is None:
            return None
        if hmac.compare_digest(presented.bearer.encode(), self._secret):
            return Principal("admin (the arbiter's secret)", admin=True)
        return None


class ClientCertificate:
    """A verified client certificate and no token: the admin (only on arbiters without a
    secret: see the module's docstring)."""

    async def authenticate(self, presented: Presented) -> Principal | None:
        if presented.bearer is not None or not presented.certificate:
            return None
        return Principal(f"admin (client certificate {presented.certificate})", admin=True)


class Anyone:
    """No credentials configured: every caller is the admin."""

    async def authenticate(self, presented: Presented) -> Principal | None:
        return ANONYMOUS


class Chain:
    """The first authenticator that vouches for the call decides."""

    def __init__(self, authenticators: Sequence[Authenticator]) -> None:
        self.authenticators = tuple(authenticators)

    async def authenticate(self, presented: Presented) -> Principal | None:
        if presented.problem:
            return None
        for a in self.authenticators:
            p = await a.authenticate(presented)
            if p is not None:
                return p
        return None


def authenticator_for(secret: str, client_ca: str) -> Chain:
    """The chain an arbiter with this ``--token`` and ``--tls-client-ca`` uses."""
    if secret:
        return Chain([JobTokens(secret), NodeTokens(secret), Secret(secret)])
    if client_ca:
        return Chain([ClientCertificate()])
    return Chain([Anyone()])


def has_credentials(secret: str, client_ca: str) -> bool:
    """Does an arbiter with these settings authenticate its callers at all?"""
    return bool(secret or client_ca)


def listens_on_loopback(listen: str) -> bool:
    """Is HOST:PORT reachable from this machine only?"""
    host = listen.rpartition(":")[0].strip("[]")
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a name: not resolved, what it means may change
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


# --------------------------------------------------------------------------- the guard

R = TypeVar("R")
Handler = Callable[[Any, grpc.aio.ServicerContext, Principal], Awaitable[R]]


class Guard:
    """Authenticates every call before its handler runs and hands it the Principal.

    Handlers are written as ``handler(request, context, principal)`` and registered as
    ``guard(handler)``: a handler cannot be served without the principal it must ask
    ``authorize`` with, so none can forget authentication.
    """

    def __init__(self, authenticator: Authenticator, metrics: ArbiterMetrics | None) -> None:
        self.authenticator = authenticator
        self.metrics = metrics

    async def principal(self, context: grpc.aio.ServicerContext) -> Principal | None:
        presented = Presented.from_call(context.invocation_metadata(),
                                        context.peer_identities())
        p = await self.authenticator.authenticate(presented)
        if p is None:
            why = presented.problem or ("no token" if presented.bearer is None else
                                        "token not accepted")
            log.info("rejected a call from %s: %s", context.peer(), why)
            if self.metrics:
                self.metrics.rejected.labels(reason="unauthenticated").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{why}: pass the arbiter's --token or a job token from "
                                "`ftagent token --job NAME` (env FTAGENT_TOKEN)")
        return p

    async def deny(self, context: grpc.aio.ServicerContext, p: Principal, namespace: str,
                   job: str, what: str) -> None:
        """End the call with PERMISSION_DENIED: ``p`` may not ``what`` ``job``."""
        if self.metrics:
            self.metrics.rejected.labels(reason="permission_denied").inc()
        log.info("denied %s (%s) to %s %s", context.peer(), p.name, what,
                 _job_name(namespace, job))
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"these credentials ({p.name}) speak for {p.scope()}, not for "
                            f"job {_job_name(namespace, job)!r}")

    def __call__(self, handler: Handler[R]) -> Callable[[Any, grpc.aio.ServicerContext],
                                                        Awaitable[R | None]]:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> R | None:
            p = await self.principal(context)
            if p is None:  # abort raised already; for type checkers
                return None
            return await handler(request, context, p)

        return guarded


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
