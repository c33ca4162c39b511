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
  ``ftagent token --ttl SECONDS`` (the default: 30 days) makes an expiring one,
  ``ftj2.<ns>.<job>.<expiry>.<mac>``, the unix expiry inside the MAC: refused from then on.
* **rotation**: ``--previous-token OLD`` beside ``--token NEW`` accepts what either secret
  derived (job and node tokens, the secret as admin) while the agents move to tokens of the
  new one; remove it to end the window.
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

In Kubernetes (``--kube``), ``TokenReviews`` is one more ``Authenticator`` in the chain: a
pod's projected ServiceAccount token (audience ``--token-audience``, bound to the pod) is
checked with a TokenReview, and the caller becomes that *pod* (namespace, name, uid, node:
the review's, never what the caller says). A pod principal may act for its namespace's jobs
only as its own pod: the server checks its Hello against that identity and takes the job and
rank from the pod as the arbiter's watch sees it. A token of the node agents' ServiceAccount
(``ftagent-node`` in the arbiter's namespace) bound to a pod on node N becomes N's node
agent. The review call itself is plugged in by the composition root (``kube/tokenreview.py``):
the arbiter never imports kube. Answers are cached (bounded; never past the token's own
expiry); an API server that cannot answer makes the call UNAVAILABLE (the agent retries),
never anonymous.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc

from ftagent.metrics import ArbiterMetrics
from ftagent.wire.credentials import read_file

log = logging.getLogger("ftagent.arbiter.auth")

TOKEN_VERSION = "ftj1"  # no expiry (``ftagent token --ttl 0``, and tokens made before)
_MAC_CONTEXT = b"ftagent job token v1\x00"
EXPIRING_VERSION = "ftj2"  # ftj2.<ns>.<job>.<expiry>.<mac>: the MAC covers the expiry
_EXPIRING_CONTEXT = b"ftagent job token v2\x00"
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
    # A pod's own credential (TokenReview): the verified pod, its uid and its node. Such a
    # principal registers only as that pod, for the job and rank its labels give.
    pod: str | None = None
    pod_uid: str = ""
    pod_node: str = ""

    def scope(self) -> str:
        if self.admin:
            return "every job"
        if self.node is not None:
            return "every node's reports" if self.node == ALL_NODES else \
                f"the reports of node {self.node!r}"
        if self.pod is not None:
            return f"pod {self.namespace}/{self.pod} (uid {self.pod_uid}) only"
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


def _expiring_mac(secret: str, namespace: str, job: str, expires: int) -> bytes:
    ns, name = namespace.encode(), job.encode()
    msg = (_EXPIRING_CONTEXT + struct.pack(">I", len(ns)) + ns + struct.pack(">I", len(name))
           + name + struct.pack(">Q", expires))
    return hmac.new(secret.encode(), msg, hashlib.sha256).digest()


def job_token(secret: str, namespace: str, job: str, expires: int | None = None) -> str:
    """The token that speaks for ``job`` in ``namespace`` (derived, nothing is stored);
    with ``expires`` (unix seconds) it is refused from then on."""
    if not secret:
        raise ValueError("no secret to derive a job token from")
    if not job:
        raise ValueError("a job token needs a job name")
    if expires is not None:
        if not 0 < expires < 2**63:
            raise ValueError("a token's expiry is a positive unix time")
        return ".".join((EXPIRING_VERSION, _b64(namespace.encode()), _b64(job.encode()),
                         _b64(str(expires).encode()),
                         _b64(_expiring_mac(secret, namespace, job, expires))))
    return ".".join((TOKEN_VERSION, _b64(namespace.encode()), _b64(job.encode()),
                     _b64(_mac(secret, namespace, job))))


def parse_expiring_token(token: str) -> tuple[str, str, int, bytes] | None:
    """(namespace, job, expires, mac) of a well-formed ftj2 token, unverified."""
    parts = token.split(".")
    if len(parts) != 5 or parts[0] != EXPIRING_VERSION:
        return None
    ns, job, exp, mac = (_unb64(p) for p in parts[1:])
    if ns is None or not job or exp is None or mac is None \
            or len(mac) != hashlib.sha256().digest_size:
        return None
    if not 0 < len(exp) <= 19 or not exp.isdigit() or exp.startswith(b"0"):
        return None
    try:
        return ns.decode(), job.decode(), int(exp), mac
    except UnicodeDecodeError:
        return None


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


def _secrets(secret: str | Sequence[str]) -> tuple[str, ...]:
    """The secrets accepted: the current one and, during a rotation, the previous one
    (``--previous-token``): tokens derived from either are valid until it is removed."""
    return (secret,) if isinstance(secret, str) else tuple(s for s in secret if s)


class JobTokens:
    """Job tokens derived from the secret (``job_token``); ftj2 ones until their expiry."""

    def __init__(self, secret: str | Sequence[str],
                 clock: Callable[[], float] = time.time) -> None:
        self._secrets = _secrets(secret)
        self.clock = clock

    async def authenticate(self, presented: Presented) -> Principal | None:
        token = presented.bearer or ""
        expiring = parse_expiring_token(token)
        if expiring is not None:
            namespace, job, expires, mac = expiring
            if not any(hmac.compare_digest(mac, _expiring_mac(s, namespace, job, expires))
                       for s in self._secrets):
                return None
            if self.clock() >= expires:
                log.info("job token for %s expired at %d", _job_name(namespace, job), expires)
                return None
            return Principal(f"job {_job_name(namespace, job)}", namespace=namespace, job=job)
        parsed = parse_job_token(token)
        if parsed is None:
            return None
        namespace, job, mac = parsed
        if not any(hmac.compare_digest(mac, _mac(s, namespace, job)) for s in self._secrets):
            return None
        return Principal(f"job {_job_name(namespace, job)}", namespace=namespace, job=job)


class NodeTokens:
    """Node tokens derived from the secret (``node_token``)."""

    def __init__(self, secret: str | Sequence[str]) -> None:
        self._secrets = _secrets(secret)

    async def authenticate(self, presented: Presented) -> Principal | None:
        parsed = parse_node_token(presented.bearer or "")
        if parsed is None:
            return None
        node, mac = parsed
        if not any(hmac.compare_digest(mac, _node_mac(s, node)) for s in self._secrets):
            return None
        return Principal(f"node {node}", node=node)


class Secret:
    """The arbiter's secret itself (either, during a rotation): the admin."""

    def __init__(self, secret: str | Sequence[str]) -> None:
        self._secrets = tuple(s.encode() for s in _secrets(secret))

    async def authenticate(self, presented: Presented) -> Principal | None:
        if presented.bearer is None:
            return None
        given = presented.bearer.encode()
        if any(hmac.compare_digest(given, s) for s in self._secrets):
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
    """No credentials configured: every caller is the admin. With ``tokenless`` only a
    caller that presents no token at all (behind an authenticator that checks tokens, a
    token it refused must not fall through to here)."""

    def __init__(self, tokenless: bool = False) -> None:
        self.tokenless = tokenless

    async def authenticate(self, presented: Presented) -> Principal | None:
        if self.tokenless and presented.bearer is not None:
            return None
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


# --------------------------------------------------------------------------- TokenReview

EXTRA = "authentication.kubernetes.io/"
MAX_TOKEN = 16 * 1024  # a projected token is ~1 KB; anything far larger is not one


class ReviewUnavailable(Exception):
    """The API server could not review the token (outage, 5xx, 403 for tokenreviews): the
    call is refused UNAVAILABLE (retry), never let through."""


@dataclass(frozen=True, slots=True)
class Reviewed:
    """What a TokenReview said (``status``), flattened; built by kube/tokenreview.py."""

    authenticated: bool
    username: str = ""
    audiences: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    error: str = ""

    def one(self, key: str) -> str:
        """The single value of extra ``authentication.kubernetes.io/<key>`` ("" if not one)."""
        v = self.extra.get(EXTRA + key) or ()
        return v[0] if len(v) == 1 else ""


Review = Callable[[str], Awaitable[Reviewed]]


def token_expiry(token: str) -> float | None:
    """The ``exp`` claim of a JWT-shaped token, unverified (only to bound a cache entry's
    life: the API server alone says whether the token is valid)."""
    parts = token.split(".")
    if len(parts) != 3 or len(parts[1]) > MAX_TOKEN:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, binascii.Error):
        return None
    exp = claims.get("exp") if isinstance(claims, dict) else None
    return float(exp) if isinstance(exp, (int, float)) and not isinstance(exp, bool) else None


def principal_of(r: Reviewed, audience: str, node_namespace: str,
                 node_account: str = "ftagent-node") -> Principal | None:
    """The principal a review vouches for, or None. Only pod-bound ServiceAccount tokens
    for ``audience`` count: a token that names no pod could be anyone's."""
    if not r.authenticated or audience not in r.audiences:
        return None
    prefix, _, rest = r.username.partition("system:serviceaccount:")
    namespace, _, account = rest.partition(":")
    pod, uid, node = r.one("pod-name"), r.one("pod-uid"), r.one("node-name")
    if prefix or not namespace or not account or not pod or not uid:
        return None
    if namespace == node_namespace and account == node_account:
        if not node:
            return None
        return Principal(f"node agent {namespace}/{pod} on node {node}", node=node)
    return Principal(f"pod {namespace}/{pod}", namespace=namespace, pod=pod, pod_uid=uid,
                     pod_node=node)


class TokenReviews:
    """Pod-bound projected ServiceAccount tokens, checked with ``review`` (a TokenReview).

    Answers are cached by the token's SHA-256 for ``ttl`` seconds, never past the token's
    ``exp`` (kubelet-rotated tokens are fresh strings; a deleted pod's token stops working
    within ``ttl``); refusals for ``negative_ttl`` so a flood of bad tokens costs the API
    server one review each per window. At most ``max_entries`` are kept (least recently
    used first out). Concurrent calls with one token share one review."""

    def __init__(self, review: Review, *, audience: str = "ftagent",
                 node_namespace: str = "", node_account: str = "ftagent-node",
                 ttl: float = 60.0, negative_ttl: float = 5.0, max_entries: int = 50_000,
                 clock: Callable[[], float] = time.time) -> None:
        self._review = review
        self.audience, self.node_namespace, self.node_account = (audience, node_namespace,
                                                                 node_account)
        self.ttl, self.negative_ttl, self.max_entries = ttl, negative_ttl, max_entries
        self.clock = clock
        self._cache: OrderedDict[bytes, tuple[float, Principal | None]] = OrderedDict()
        self._inflight: dict[bytes, asyncio.Future[Principal | None]] = {}
        self.reviews = 0  # calls made to the API server (for tests and the bench)

    async def authenticate(self, presented: Presented) -> Principal | None:
        token = presented.bearer
        if not token or len(token) > MAX_TOKEN or token.count(".") != 2 \
                or not token.startswith("eyJ"):  # a JWT's header is base64url of '{"'
            return None  # not a JWT: no review (and no API call for garbage, or ftn1)
        key = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        hit = self._cache.get(key)
        if hit is not None:
            if hit[0] > now:
                self._cache.move_to_end(key)
                return hit[1]
            del self._cache[key]
        pending = self._inflight.get(key)
        if pending is None:  # one review per token at a time, not tied to any one caller
            pending = self._inflight[key] = asyncio.ensure_future(self._ask(token, key, now))
            # an outage's error is read even when every caller went away meanwhile
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(pending)

    async def _ask(self, token: str, key: bytes, now: float) -> Principal | None:
        try:
            self.reviews += 1
            reviewed = await self._review(token)
        finally:
            self._inflight.pop(key, None)
        p = principal_of(reviewed, self.audience, self.node_namespace, self.node_account)
        life = self.ttl if p is not None else self.negative_ttl
        exp = token_expiry(token)
        self._cache[key] = (min(now + life, exp) if exp is not None else now + life, p)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return p


@dataclass(frozen=True, slots=True)
class PodFacts:
    """A pod as the arbiter's pod watch sees it (kube/cluster.py builds it from its labels
    with kube/identity.py): the job and rank it is, where it runs."""

    uid: str
    job: str
    node: str = ""
    rank: int | None = None  # None: its labels do not say (then the Hello's, held by uid)
    world_size: int | None = None  # pods of the job: its controller's spec, else its labels
    local_world: int = 1  # ranks this pod runs (its --nproc-per-node, capped: membership.py)
    not_member: str = ""  # why its controller chain makes it no member of its labelled job


PodLookup = Callable[[str, str], "PodFacts | None"]  # (namespace, pod) -> facts


def identity_problem(p: Principal, namespace: str, pod: str, node: str, job: str, rank: int,
                     world_size: int, facts: PodFacts | None,
                     spare: bool = False) -> tuple[str, bool]:
    """Why a pod principal may not register with this Hello ("" when it may), and whether
    it is worth retrying (the watch has not seen the pod yet). Every value of the Hello is
    compared with the verified identity (the review's) and the pod as the watch sees it;
    with ``spare`` (a warm spare, which claims no rank, or the pod the arbiter's own record
    says owns the rank: a spare it ASSIGNed) all but the rank and world size: it must be a
    pod of the job; the arbiter alone gives it a rank."""
    if p.pod is None:
        return "", False
    said = [("namespace", namespace, p.namespace or ""), ("pod", pod, p.pod)]
    if p.pod_node:
        said.append(("node", node, p.pod_node))
    for what, claimed, verified in said:
        if claimed != verified:
            return (f"Hello says {what} {claimed!r} but these credentials are pod "
                    f"{p.namespace}/{p.pod} on node {p.pod_node or '?'}: {what} mismatch"), False
    if facts is None:
        return (f"pod {p.namespace}/{p.pod} is not (yet) in the arbiter's watch of ftagent "
                "pods (label ftagent.io/job): retry"), True
    if facts.uid != p.pod_uid:
        return (f"pod {p.namespace}/{p.pod} is now uid {facts.uid}, these credentials are "
                f"uid {p.pod_uid}: a replaced pod's token"), facts.uid == ""
    if facts.not_member:
        return (f"pod {p.namespace}/{p.pod} is no member of job {job!r}: "
                f"{facts.not_member}"), False
    if job != facts.job:
        return (f"Hello says job {job!r} but pod {p.namespace}/{p.pod} belongs to job "
                f"{facts.job!r} (its labels): job mismatch"), False
    if spare:
        return "", False
    # The controller's spec (else the labels) counts pods; each pod runs the ranks its
    # own --nproc-per-node says (facts.local_world, capped), pod k the ranks
    # k*per_pod .. (k+1)*per_pod-1 (torchrun's contract): never what dividing a Hello's
    # world size by a label's gives (one pod could otherwise hold every rank).
    per_pod = max(1, facts.local_world)
    if facts.world_size and world_size != facts.world_size * per_pod:
        return (f"Hello says world size {world_size} but job {facts.job!r} has "
                f"{facts.world_size} pods of {per_pod} rank(s) each (pod {p.pod}'s "
                f"controller and --nproc-per-node): world size mismatch"), False
    if facts.rank is not None and rank // per_pod != facts.rank:
        mine = f"rank {facts.rank}" if per_pod == 1 else \
            f"ranks {facts.rank * per_pod}-{(facts.rank + 1) * per_pod - 1}"
        return (f"Hello says rank {rank} but pod {p.namespace}/{p.pod} is {mine} (its "
                "labels): rank mismatch"), False
    return "", False


def authenticator_for(secret: str, client_ca: str, previous: str = "") -> Chain:
    """The chain an arbiter with this ``--token`` (and ``--previous-token`` during a
    rotation) and ``--tls-client-ca`` uses."""
    if secret:
        both = (secret, previous)
        return Chain([JobTokens(both), NodeTokens(both), Secret(both)])
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
        try:
            p = await self.authenticator.authenticate(presented)
        except ReviewUnavailable as e:
            log.warning("cannot authenticate a call from %s: %s", context.peer(), e)
            if self.metrics:
                self.metrics.rejected.labels(reason="unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot check credentials now "
                                f"({e}): retry")
            return None
        if p is None:
            why = presented.problem or ("no token" if presented.bearer is None else
                                        "token not accepted")
            log.info("rejected a call from %s: %s", context.peer(), why)
            if self.metrics:
                self.metrics.rejected.labels(reason="unauthenticated").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{why}: pass the arbiter's --token or a job token from "
                                "`ftagent token --job NAME` (env FTAGENT_TOKEN); in "
                                "Kubernetes the pod's projected token (--token-file)")
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
