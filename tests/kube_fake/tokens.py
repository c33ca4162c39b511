"""Projected ServiceAccount tokens and the TokenReview API, as the real API server has them.

The kubelet asks the API server for a pod-bound token (TokenRequest with a ``boundObjectRef``
to the pod) and writes it into the pod's projected volume; whoever receives it checks it with
a TokenReview (``POST /apis/authentication.k8s.io/v1/tokenreviews``). This module is both
sides for the fake:

* :class:`Issuer` mints JWT-shaped tokens (``header.payload.signature``, base64url; the claims
  the real issuer writes: ``aud``, ``exp``, ``iat``, ``nbf``, ``iss``, ``jti``, ``sub`` and
  ``kubernetes.io`` with the namespace, service account, pod and node) and signs them with its
  own key (HS256 here, RS256 for real: nobody but the issuer verifies the signature, so only
  the shape matters to a client).
* :meth:`Issuer.review` answers a TokenReview as the real server does: ``status.authenticated``,
  ``status.user`` (``username`` ``system:serviceaccount:NS:NAME``, the service account's
  ``uid``, ``groups`` ``system:serviceaccounts``, ``system:serviceaccounts:NS``,
  ``system:authenticated``, and for pod-bound tokens ``extra`` with
  ``authentication.kubernetes.io/pod-name``, ``pod-uid``, ``node-name``, ``node-uid``,
  ``credential-id`` (``JTI=<jti>``), each a list of one string), ``status.audiences`` (the
  intersection of the review's and the token's audiences; an empty ``spec.audiences`` means
  the API server's own). A token that is not one of ours, has the wrong audience, has
  expired, or whose pod was deleted (or replaced: another uid) is ``authenticated: false``
  with ``status.error`` worded as the real union authenticator words it
  (``[invalid bearer token, ...]``); the HTTP answer is still 201 Created.
* :func:`write_projected` writes a token the way the kubelet's atomic writer fills a
  projected volume: ``DIR/..<timestamp>/token``, a ``..data`` symlink to it, and ``token`` ->
  ``..data/token``; a rotation writes a new timestamped directory and swaps ``..data`` in
  one rename.

Not modelled: ServiceAccount objects (any name is accepted; its uid is stable per name), the
signing keys' rotation, legacy (Secret-based) tokens, the 600 s minimum expiry of TokenRequest.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"
ISSUER = "https://kubernetes.default.svc.cluster.local"
EXTRA = "authentication.kubernetes.io/"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Minted:
    """One token's claims as the issuer recorded them."""

    token: str
    namespace: str
    service_account: str
    audiences: tuple[str, ...]
    expires: float
    jti: str
    pod: str | None = None
    pod_uid: str | None = None
    node: str | None = None
    node_uid: str | None = None


class Issuer:
    """Mints and reviews tokens (thread-safe). ``lookup(resource, name, namespace)`` reads the
    fake's store (the pod a token is bound to must still exist with the same uid)."""

    def __init__(self, lookup: Callable[[str, str, str | None], dict[str, Any] | None],
                 clock: Callable[[], float] = time.time) -> None:
        self._key = os.urandom(32)
        self._lookup = lookup
        self.clock = clock
        self._sa_uids: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def _sa_uid(self, namespace: str, name: str) -> str:
        with self._lock:
            return self._sa_uids.setdefault((namespace, name), str(uuid.uuid4()))

    def mint(self, namespace: str, service_account: str = "default", *, pod: str | None = None,
             audiences: Sequence[str] = ("ftagent",), expiration_seconds: int = 3600) -> Minted:
        """A token for ``service_account``; with ``pod`` bound to that pod (which must exist:
        the real TokenRequest refuses a missing one) and to its node."""
        pod_uid = node = node_uid = None
        if pod is not None:
            obj = self._lookup("pods", pod, namespace)
            if obj is None:
                raise KeyError(f'pods "{pod}" not found in namespace {namespace!r}')
            pod_uid = obj["metadata"]["uid"]
            node = (obj.get("spec") or {}).get("nodeName") or None
            if node:
                n = self._lookup("nodes", node, None)
                node_uid = n["metadata"]["uid"] if n else None
        now = self.clock()
        jti = str(uuid.uuid4())
        claims: dict[str, Any] = {
            "aud": list(audiences), "exp": int(now + expiration_seconds), "iat": int(now),
            "nbf": int(now), "iss": ISSUER, "jti": jti,
            "sub": f"system:serviceaccount:{namespace}:{service_account}",
            "kubernetes.io": {"namespace": namespace, "serviceaccount": {
                "name": service_account, "uid": self._sa_uid(namespace, service_account)}}}
        if pod is not None:
            claims["kubernetes.io"]["pod"] = {"name": pod, "uid": pod_uid}
            if node:
                claims["kubernetes.io"]["node"] = {"name": node, "uid": node_uid}
        head = _b64(json.dumps({"alg": "HS256", "kid": "fake"}).encode())
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        sig = _b64(hmac.new(self._key, f"{head}.{body}".encode(), hashlib.sha256).digest())
        return Minted(f"{head}.{body}.{sig}", namespace, service_account, tuple(audiences),
                      float(claims["exp"]), jti, pod, pod_uid, node, node_uid)

    def _claims(self, token: str) -> dict[str, Any] | None:
        parts = token.split(".")
        if len(parts) != 3:
            return None
        want = _b64(hmac.new(self._key, f"{parts[0]}.{parts[1]}".encode(),
                             hashlib.sha256).digest())
        if not hmac.compare_digest(want, parts[2]):
            return None
        try:
            claims = json.loads(_unb64(parts[1]))
        except ValueError:
            return None
        return claims if isinstance(claims, dict) else None

    def review(self, body: Any) -> dict[str, Any]:
        """The TokenReview answered (the request's object with ``status`` filled in)."""
        spec = (body or {}).get("spec") or {}
        token = spec.get("token") or ""
        wanted = list(spec.get("audiences") or []) or [API_AUDIENCE]
        out = {"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
               "metadata": {"creationTimestamp": None}, "spec": spec}
        status, problem = self._check(token, wanted)
        if problem:
            status = {"user": {}, "error": f"[invalid bearer token, {problem}]"}
        out["status"] = status
        return out

    def _check(self, token: str, wanted: list[str]) -> tuple[dict[str, Any], str]:
        claims = self._claims(token) if token else None
        if claims is None:
            return {}, "square/go-jose: error in cryptographic primitive"
        auds = [a for a in claims.get("aud") or [] if a in wanted]
        if not auds:
            return {}, (f"token audiences {json.dumps(claims.get('aud') or [])} is invalid "
                        f"for the target audiences {json.dumps(wanted)}")
        if self.clock() >= claims["exp"]:
            return {}, "service account token has expired"
        k8s = claims["kubernetes.io"]
        ns, sa = k8s["namespace"], k8s["serviceaccount"]
        extra: dict[str, list[str]] = {}
        pod = k8s.get("pod")
        if pod is not None:
            live = self._lookup("pods", pod["name"], ns)
            if live is None or live["metadata"]["uid"] != pod["uid"]:
                return {}, "service account token has been invalidated"
            extra[EXTRA + "pod-name"] = [pod["name"]]
            extra[EXTRA + "pod-uid"] = [pod["uid"]]
            node = k8s.get("node")
            if node is not None:
                extra[EXTRA + "node-name"] = [node["name"]]
                if node.get("uid"):
                    extra[EXTRA + "node-uid"] = [node["uid"]]
        extra[EXTRA + "credential-id"] = [f"JTI={claims['jti']}"]
        user = {"username": f"system:serviceaccount:{ns}:{sa['name']}", "uid": sa["uid"],
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{ns}",
                           "system:authenticated"],
                "extra": extra}
        return {"authenticated": True, "user": user, "audiences": auds}, ""


def write_projected(directory: str | os.PathLike[str], token: str) -> Path:
    """Write ``token`` into ``directory`` as the kubelet fills a projected volume (atomic
    writer: timestamped dir, ``..data`` symlink swapped by rename); returns the ``token`` path.
    Call again to rotate."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stamp = d / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{uuid.uuid4().hex[:8]}"
    stamp.mkdir()
    (stamp / "token").write_text(token)
    old = os.readlink(d / "..data") if (d / "..data").is_symlink() else None
    tmp = d / "..data_tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(stamp.name)
    os.replace(tmp, d / "..data")
    if not (d / "token").is_symlink():
        (d / "token").symlink_to("..data/token")
    if old is not None:
        for f in (d / old).iterdir():
            f.unlink()
        (d / old).rmdir()
    return d / "token"
