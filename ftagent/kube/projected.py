"""Projected ServiceAccount tokens verified here, without an API call per token.

The API server publishes its service-account issuer's public keys: OIDC discovery at
``/.well-known/openid-configuration`` (the ``issuer``) and the key set at
``/openid/v1/jwks`` (RBAC: the ``system:service-account-issuer-discovery`` ClusterRole's
``nonResourceURLs``). A pod-bound token is a JWT signed with one of those keys (RS256 or
ES256) whose claims carry ``iss``, ``aud``, ``exp``, ``nbf``, ``iat``, ``sub`` and
``kubernetes.io`` → namespace, service account, pod (name, uid) and node. Signature, issuer,
audience and time checked here, and the pod's uid checked against the arbiter's own pod
watch, give what a TokenReview gives for such tokens, at no API cost: a junk token costs a
signature check and nothing else, and 10,000 agents reconnecting after a failover cost no
review at all.

* :class:`IssuerKeys` holds the issuer and its keys, fetched through the arbiter's
  ``kubernetes`` client; a token naming a key it does not know refreshes them, at most once
  per ``min_refresh`` seconds whatever the callers send (junk ``kid`` values cost one
  fetch per window, not one per token).
* :func:`verify` is the pure check of one token against those keys and a clock.
* :class:`ProjectedTokens` is the arbiter's ``Authenticator``: a locally verified token of
  a pod the watch holds with that uid is that pod; a pod the watch saw deleted is refused
  (its uid never comes back); a node agent's token (its pods are not in the watch of
  training pods) is confirmed by the TokenReview fallback once per pod uid. Where discovery
  cannot be reached (RBAC, an older or locked-down API server), every token goes to the
  TokenReview fallback (``arbiter.auth.TokenReviews``: bounded queue, per-source limits,
  negative cache keyed on the token's hash).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftagent.arbiter.auth import MAX_TOKEN, Presented, Principal, TokenReviews

log = logging.getLogger("ftagent.kube.projected")

ALGORITHMS = ("RS256", "ES256")  # what the API server signs service-account tokens with
MAX_KEYS = 64  # a key set longer than this is not the API server's
MAX_NAME = 253
SKEW = 60.0  # seconds of clock skew allowed for nbf/iat (the API server allows a minute)
TIMEOUT = 5.0


class KeysUnavailable(Exception):
    """Discovery or the key set could not be read (then the TokenReview fallback decides)."""


@dataclass(frozen=True, slots=True)
class Bound:
    """What a verified pod-bound token says: signature, issuer, audience, time all checked."""

    namespace: str
    service_account: str
    pod: str
    pod_uid: str
    node: str
    expires: float


@dataclass(frozen=True, slots=True)
class Checked:
    """The outcome of :func:`verify`: ``bound`` (verified), or ``problem`` (refused here),
    or ``unknown_key`` (signed with a key not in the set: refresh, then decide)."""

    bound: Bound | None = None
    problem: str = ""
    unknown_key: str = ""
    # signed with the cluster's key but naming another issuer (an API server accepting
    # several --service-account-issuer values during a migration): the API server decides
    other_issuer: bool = False


def _str(v: Any) -> str:
    return v if isinstance(v, str) and 0 < len(v) <= MAX_NAME else ""


def _pair(v: Any) -> tuple[str, str]:
    if not isinstance(v, dict):
        return "", ""
    return _str(v.get("name")), _str(v.get("uid"))


_SEGMENT = re.compile(r"[A-Za-z0-9_-]*\Z")  # unpadded base64url, as the API server writes


def _segment(text: str) -> bytes | None:
    """One JWT segment's bytes (strict unpadded base64url), or None."""
    if len(text) % 4 == 1 or not _SEGMENT.match(text):
        return None
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None


def _object(text: str) -> dict[str, Any] | None:
    """A segment holding a JSON object (the header, the claims), or None."""
    raw = _segment(text)
    if raw is None:
        return None
    try:
        v = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return v if isinstance(v, dict) else None


def verify(token: str, keys: dict[str, Any], issuer: str, audience: str,
           now: float) -> Checked:
    """Check one token against ``keys`` (kid -> PyJWK) of ``issuer`` for ``audience`` at
    ``now`` (unix seconds). Linear in the token's length; never raises.

    Each segment is decoded once (C-speed base64 and JSON) and the signature checked with
    the key's own algorithm (PyJWT's, over ``cryptography``): this is what every agent's
    first call to a freshly started arbiter costs, 10,000 times after a failover, so
    nothing is parsed twice and no segment is scanned in Python. The header is read
    before the signature is checked (to pick the key), the claims only after."""
    if not token or len(token) > MAX_TOKEN or token.count(".") != 2:
        return Checked(problem="not a JWT")
    head_b64, body_b64, sig_b64 = token.split(".")
    header = _object(head_b64)
    if header is None:
        return Checked(problem="not a JWT")
    alg, kid = header.get("alg"), header.get("kid")
    if alg not in ALGORITHMS:
        return Checked(problem=f"algorithm {str(alg)[:20]!r} is not RS256/ES256")
    if not isinstance(kid, str) or not 0 < len(kid) <= 128:
        return Checked(problem="no key id")
    key = keys.get(kid)
    if key is None:
        return Checked(unknown_key=kid)
    if getattr(key, "algorithm_name", alg) != alg:
        return Checked(problem="algorithm does not match the key")
    sig = _segment(sig_b64)
    if not sig:
        return Checked(problem="invalid: no signature")
    try:
        good = key.Algorithm.verify(f"{head_b64}.{body_b64}".encode("ascii"), key.key, sig)
    except Exception:  # a malformed signature for this key type
        good = False
    if not good:
        return Checked(problem="invalid: InvalidSignatureError")
    claims = _object(body_b64)
    if claims is None:
        return Checked(problem="invalid: DecodeError")
    if any(c not in claims for c in ("iss", "aud", "exp", "sub")):
        return Checked(problem="invalid: MissingRequiredClaimError")
    aud = claims["aud"]
    auds = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else None
    if auds is None or not all(isinstance(a, str) for a in auds):
        return Checked(problem="invalid: InvalidAudienceError")
    if audience not in auds:
        return Checked(problem="wrong audience")
    if claims["iss"] != issuer:  # signed with the cluster's key, naming another issuer
        return Checked(problem="another issuer", other_issuer=True)
    exp, nbf = claims.get("exp"), claims.get("nbf", claims.get("iat", 0))
    if not isinstance(exp, (int, float)) or isinstance(exp, bool) or now >= exp:
        return Checked(problem="expired")
    if not isinstance(nbf, (int, float)) or isinstance(nbf, bool) or nbf > now + SKEW:
        return Checked(problem="not valid yet")
    k8s = claims.get("kubernetes.io")
    if not isinstance(k8s, dict):
        return Checked(problem="not a service-account token")
    namespace = _str(k8s.get("namespace"))
    account, _ = _pair(k8s.get("serviceaccount"))
    pod, uid = _pair(k8s.get("pod"))
    node, _ = _pair(k8s.get("node"))
    if not namespace or not account:
        return Checked(problem="not a service-account token")
    if claims.get("sub") != f"system:serviceaccount:{namespace}:{account}":
        return Checked(problem="subject does not match its service account")
    if not pod or not uid:
        return Checked(problem="not bound to a pod")
    return Checked(Bound(namespace, account, pod, uid, node, float(exp)))


class IssuerKeys:
    """The API server's service-account issuer and public keys (OIDC discovery).

    ``fetch()`` reads both (blocking: call it off the loop); ``refresh()`` is the async,
    rate-limited form: at most one fetch per ``min_refresh`` seconds, concurrent callers
    share it, a failure keeps the keys already held."""

    def __init__(self, api_client: Any, *, min_refresh: float = 10.0,
                 clock: Callable[[], float] = time.monotonic,
                 fetcher: Callable[[], tuple[str, dict[str, Any]]] | None = None) -> None:
        self.api_client = api_client
        self.min_refresh, self.clock = min_refresh, clock
        self._fetcher = fetcher or self._read
        self.issuer = ""
        self.keys: dict[str, Any] = {}
        self.fetches = 0
        self._last = -1e18
        self._pending: asyncio.Future[None] | None = None

    @property
    def loaded(self) -> bool:
        return bool(self.issuer and self.keys)

    def _read(self) -> tuple[str, dict[str, Any]]:
        from kubernetes import client

        try:
            conf = client.WellKnownApi(self.api_client) \
                .get_service_account_issuer_open_id_configuration(
                    _preload_content=False, _request_timeout=TIMEOUT)
            doc = json.loads(getattr(conf, "data", b""))
            jwks = client.OpenidApi(self.api_client).get_service_account_issuer_open_id_keyset(
                _preload_content=False, _request_timeout=TIMEOUT)
            keyset = json.loads(getattr(jwks, "data", b""))
        except Exception as e:  # ApiException (403: RBAC), urllib3 errors, bad JSON
            status = getattr(e, "status", None)
            hint = (": the arbiter needs the system:service-account-issuer-discovery "
                    "ClusterRole" if status in (401, 403) else "")
            raise KeysUnavailable(f"OIDC discovery failed: {type(e).__name__}"
                                  f"{f' HTTP {status}' if status else ''}{hint}") from None
        return parse_discovery(doc, keyset)

    def fetch(self) -> None:
        """Read discovery and the key set now (blocking); raises KeysUnavailable."""
        self._last = self.clock()
        self.fetches += 1
        self.issuer, self.keys = self._fetcher()

    async def refresh(self) -> None:
        """Fetch again unless one did within ``min_refresh`` (then nothing): rate-limited,
        whatever ``kid`` values callers present. Never raises."""
        if self._pending is not None:
            await asyncio.shield(self._pending)
            return
        if self.clock() - self._last < self.min_refresh:
            return
        loop = asyncio.get_running_loop()
        self._pending = fut = loop.run_in_executor(None, self._fetch_quietly)
        try:
            await asyncio.shield(fut)
        finally:
            self._pending = None

    def _fetch_quietly(self) -> None:
        try:
            self.fetch()
        except KeysUnavailable as e:
            log.warning("%s: tokens are checked with TokenReview meanwhile", e)


def parse_discovery(doc: Any, keyset: Any) -> tuple[str, dict[str, Any]]:
    """(issuer, kid -> PyJWK) from the discovery document and the key set; keys of other
    algorithms or uses are skipped; raises KeysUnavailable when nothing usable is there."""
    import jwt

    issuer = doc.get("issuer") if isinstance(doc, dict) else None
    entries = keyset.get("keys") if isinstance(keyset, dict) else None
    if not isinstance(issuer, str) or not issuer or not isinstance(entries, list):
        raise KeysUnavailable("OIDC discovery answered without an issuer or a key set")
    keys: dict[str, Any] = {}
    for k in entries[:MAX_KEYS]:
        if not isinstance(k, dict) or k.get("use", "sig") != "sig":
            continue
        kid, alg = k.get("kid"), k.get("alg")
        if alg is None:
            alg = {"RSA": "RS256", "EC": "ES256"}.get(str(k.get("kty")))
        if not isinstance(kid, str) or alg not in ALGORITHMS:
            continue
        try:
            keys[kid] = jwt.PyJWK(k, algorithm=alg)
        except jwt.PyJWTError:
            continue
    if not keys:
        raise KeysUnavailable("the issuer's key set has no RS256/ES256 signing key")
    return issuer, keys


PodUid = Callable[[str, str], "str | None"]  # (namespace, pod) -> uid in the watch, or None


class ProjectedTokens:
    """Pod-bound projected tokens verified locally; TokenReview (``fallback``) only where
    the keys cannot be had, and once per node agent pod. See the module docstring."""

    def __init__(self, keys: IssuerKeys, fallback: TokenReviews, *, audience: str = "ftagent",
                 node_namespace: str = "", node_account: str = "ftagent-node",
                 clock: Callable[[], float] = time.time, max_gone: int = 100_000,
                 max_cached: int = 50_000, confirm_ttl: float = 300.0) -> None:
        self.keys, self.fallback = keys, fallback
        self.audience, self.node_namespace, self.node_account = (audience, node_namespace,
                                                                 node_account)
        self.clock = clock
        self.pod_uid: PodUid = lambda namespace, pod: None  # the pod watch (attach_cluster)
        self._gone: OrderedDict[str, None] = OrderedDict()  # uids the watch saw deleted
        self.max_gone, self.max_cached = max_gone, max_cached
        self._verified: OrderedDict[bytes, Bound] = OrderedDict()  # token hash -> claims
        self.confirm_ttl = confirm_ttl
        self._confirmed: OrderedDict[str, float] = OrderedDict()  # node agent pod uid -> until
        self.local = 0  # tokens decided here (tests and the bench count them)
        self.refused = 0

    def pod_deleted(self, namespace: str, pod: str, uid: str) -> None:
        """The pod watch saw ``uid`` deleted: its tokens are refused from now on."""
        if uid:
            self._gone[uid] = None
            while len(self._gone) > self.max_gone:
                self._gone.popitem(last=False)

    async def authenticate(self, presented: Presented) -> Principal | None:
        token = presented.bearer
        if not token or len(token) > MAX_TOKEN or token.count(".") != 2 \
                or not token.startswith("eyJ"):
            return None  # not a JWT (an ftj/ftn token, garbage): not ours to judge
        if not self.keys.loaded:
            await self.keys.refresh()  # rate-limited; the first call after start
            if not self.keys.loaded:
                return await self.fallback.authenticate(presented)
        now = self.clock()
        key = hashlib.sha256(token.encode()).digest()
        bound = self._verified.get(key)
        if bound is None or bound.expires <= now:
            checked = verify(token, self.keys.keys, self.keys.issuer, self.audience, now)
            if checked.unknown_key:  # a rotated key, or junk: refresh at most once a window
                await self.keys.refresh()
                checked = verify(token, self.keys.keys, self.keys.issuer, self.audience, now)
            if checked.other_issuer:  # the cluster signed it: its API server decides
                return await self.fallback.authenticate(presented)
            if checked.bound is None:
                self.refused += 1
                log.debug("refused a token from %s: %s", presented.source or "?",
                          checked.problem or f"unknown key {checked.unknown_key[:40]!r}")
                return None
            bound = checked.bound
            self._verified[key] = bound
            while len(self._verified) > self.max_cached:
                self._verified.popitem(last=False)
        return await self._principal(bound, presented)

    async def _principal(self, b: Bound, presented: Presented) -> Principal | None:
        if b.pod_uid in self._gone:
            self.refused += 1
            return None  # the watch saw this pod deleted: its token is dead
        if b.namespace == self.node_namespace and b.service_account == self.node_account:
            if not b.node:
                return None
            return await self._node_agent(b, presented)
        # In the watch with this uid, or not seen yet, or the name is another pod's now:
        # the server asks the watch again before the pod may do anything (its Hello, its
        # reads: "not (yet) in the watch: retry", "a replaced pod's token"), so nothing
        # rests on this alone; a uid the watch saw deleted was refused above.
        self.local += 1
        return Principal(f"pod {b.namespace}/{b.pod}", namespace=b.namespace, pod=b.pod,
                         pod_uid=b.pod_uid, pod_node=b.node)

    async def _node_agent(self, b: Bound, presented: Presented) -> Principal | None:
        """A node agent's token, verified here; its pod (not in the watch of training pods)
        is confirmed live by one TokenReview per pod uid per ``confirm_ttl``."""
        now = self.clock()
        p = Principal(f"node agent {b.namespace}/{b.pod} on node {b.node}", node=b.node)
        if self.pod_uid(b.namespace, b.pod) == b.pod_uid \
                or self._confirmed.get(b.pod_uid, 0.0) > now:
            self.local += 1
            return p
        reviewed = await self.fallback.authenticate(presented)
        if reviewed is None or reviewed.node != b.node:
            return None
        self._confirmed[b.pod_uid] = now + self.confirm_ttl
        while len(self._confirmed) > self.max_cached:
            self._confirmed.popitem(last=False)
        return p
