"""Projected ServiceAccount tokens and the TokenReview API, as the real API server has them.

The kubelet asks the API server for a pod-bound token (TokenRequest with a ``boundObjectRef``
to the pod) and writes it into the pod's projected volume; whoever receives it checks it with
a TokenReview (``POST /apis/authentication.k8s.io/v1/tokenreviews``). This module is both
sides for the fake:

* :class:`Issuer` mints JWTs (``header.payload.signature``, base64url; the claims the real
  issuer writes: ``aud``, ``exp``, ``iat``, ``nbf``, ``iss``, ``jti``, ``sub`` and
  ``kubernetes.io`` with the namespace, service account, pod and node) and signs them with a
  real key (RS256 with a 2048-bit RSA key, or ES256 with P-256, as the API server's
  ``--service-account-signing-key-file``); the header's ``kid`` is the key's id as the API
  server computes it (unpadded base64url of the SHA-256 of the DER public key). It publishes
  the keys as the API server does: OIDC discovery (:meth:`Issuer.discovery`, served at
  ``/.well-known/openid-configuration``) and the key set (:meth:`Issuer.jwks`, served at
  ``/openid/v1/jwks``, every key it still accepts). :meth:`Issuer.rotate_key` starts signing
  with a new key and keeps the old one published (several ``--service-account-key-file``);
  :meth:`Issuer.retire_key` stops accepting one.
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

Not modelled: ServiceAccount objects (any name is accepted; its uid is stable per name),
legacy (Secret-based) tokens, the 600 s minimum expiry of TokenRequest, ``warnafter``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"
ISSUER = "https://kubernetes.default.svc.cluster.local"
OIDC_ISSUER = "https://oidc.example.com"  # people's tokens (FakeKube.user_token)
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
                 clock: Callable[[], float] = time.time, alg: str = "RS256") -> None:
        self._lookup = lookup
        self.clock = clock
        self.issuer = ISSUER
        self._sa_uids: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self._keys: dict[str, SigningKey] = {}
        self.kid = self.rotate_key(alg)
        self._oidc = SigningKey.generate("RS256")  # a people's identity provider (OIDC)

    def rotate_key(self, alg: str = "RS256") -> str:
        """Sign from now on with a new key (``RS256`` or ``ES256``); the old ones stay
        published and accepted until ``retire_key``. Returns the new key's ``kid``."""
        key = SigningKey.generate(alg)
        with self._lock:
            self._keys[key.kid] = key
            self.kid = key.kid
        return key.kid

    def retire_key(self, kid: str) -> None:
        """Stop publishing and accepting ``kid`` (tokens it signed stop validating)."""
        with self._lock:
            self._keys.pop(kid, None)

    def discovery(self, server_url: str) -> dict[str, Any]:
        """``/.well-known/openid-configuration`` as the API server serves it."""
        return {"issuer": self.issuer, "jwks_uri": f"{server_url}/openid/v1/jwks",
                "response_types_supported": ["id_token"],
                "subject_types_supported": ["public"],
                "id_token_signing_alg_values_supported": sorted(
                    {k.alg for k in list(self._keys.values())})}

    def jwks(self) -> dict[str, Any]:
        """``/openid/v1/jwks``: every public key tokens may be signed with."""
        with self._lock:
            return {"keys": [k.jwk() for k in self._keys.values()]}

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
        return Minted(self.sign(claims), namespace, service_account, tuple(audiences),
                      float(claims["exp"]), jti, pod, pod_uid, node, node_uid)

    def sign(self, claims: dict[str, Any], kid: str | None = None) -> str:
        """A JWT of ``claims`` signed with the current key (or ``kid``'s): for tests that
        need claims the issuer would never write (a token for another issuer, ...)."""
        key = self._keys[kid or self.kid]
        head = _b64(json.dumps({"alg": key.alg, "kid": key.kid},
                               separators=(",", ":")).encode())
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{head}.{body}.{_b64(key.sign(f'{head}.{body}'.encode()))}"

    def user_token(self, username: str, groups: Sequence[str] = (),
                   expiration_seconds: int = 3600) -> str:
        """A person's id token from the cluster's OIDC provider (``--oidc-issuer-url``), as
        ``kubectl`` sends it from a kubeconfig: the API server authenticates it for its own
        audiences only (``spec.audiences`` empty, or naming the API server's)."""
        now = self.clock()
        claims = {"iss": OIDC_ISSUER, "aud": ["kubernetes"], "sub": username,
                  "email": username, "groups": list(groups), "iat": int(now),
                  "exp": int(now + expiration_seconds)}
        key = self._oidc
        head = _b64(json.dumps({"alg": key.alg, "kid": key.kid}).encode())
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{head}.{body}.{_b64(key.sign(f'{head}.{body}'.encode()))}"

    def _user(self, token: str, wanted: list[str]) -> tuple[dict[str, Any], str] | None:
        """TokenReview of an OIDC id token (None: not one of the provider's)."""
        parts = token.split(".")
        if len(parts) != 3:
            return None
        try:
            if not self._oidc.verify(f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2])):
                return None
            claims = json.loads(_unb64(parts[1]))
        except (ValueError, TypeError):
            return None
        if API_AUDIENCE not in wanted:  # audience-agnostic: the API server's audiences
            return {}, (f"token audiences {json.dumps([API_AUDIENCE])} is invalid for the "
                        f"target audiences {json.dumps(wanted)}")
        if self.clock() >= claims["exp"]:
            return {}, "oidc: verify token: oidc: token is expired"
        user = {"username": claims["sub"], "groups": [*claims["groups"],
                                                      "system:authenticated"]}
        return {"authenticated": True, "user": user, "audiences": [API_AUDIENCE]}, ""

    def _claims(self, token: str) -> dict[str, Any] | None:
        parts = token.split(".")
        if len(parts) != 3:
            return None
        try:
            head = json.loads(_unb64(parts[0]))
            key = self._keys.get(head.get("kid")) if isinstance(head, dict) else None
            if key is None or head.get("alg") != key.alg \
                    or not key.verify(f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2])):
                return None
            claims = json.loads(_unb64(parts[1]))
        except (ValueError, TypeError):
            return None
        if not isinstance(claims, dict) or claims.get("iss") != self.issuer:
            return None
        return claims

    def review(self, body: Any) -> dict[str, Any]:
        """The TokenReview answered (the request's object with ``status`` filled in)."""
        spec = (body or {}).get("spec") or {}
        token = spec.get("token") or ""
        wanted = list(spec.get("audiences") or []) or [API_AUDIENCE]
        out = {"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
               "metadata": {"creationTimestamp": None}, "spec": spec}
        try:
            status, problem = self._user(token, wanted) or self._check(token, wanted)
        except (KeyError, TypeError, AttributeError):  # signed, but not claims it writes
            status, problem = {}, "service account token is malformed"
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


class SigningKey:
    """One service-account signing key: RS256 (RSA 2048) or ES256 (P-256)."""

    def __init__(self, alg: str, private: Any) -> None:
        self.alg, self.private = alg, private
        der = private.public_key().public_bytes(serialization.Encoding.DER,
                                                serialization.PublicFormat.SubjectPublicKeyInfo)
        self.kid = _b64(hashlib.sha256(der).digest())  # as the API server's keyIDFromPublicKey

    @classmethod
    def generate(cls, alg: str) -> SigningKey:
        if alg == "RS256":
            return cls(alg, rsa.generate_private_key(public_exponent=65537, key_size=2048))
        if alg == "ES256":
            return cls(alg, ec.generate_private_key(ec.SECP256R1()))
        raise ValueError(f"the fake issuer signs RS256 or ES256, not {alg!r}")

    def sign(self, data: bytes) -> bytes:
        if self.alg == "RS256":
            return bytes(self.private.sign(data, padding.PKCS1v15(), hashes.SHA256()))
        r, s = decode_dss_signature(self.private.sign(data, ec.ECDSA(hashes.SHA256())))
        return r.to_bytes(32, "big") + s.to_bytes(32, "big")  # JWS: r || s, 64 bytes

    def verify(self, data: bytes, sig: bytes) -> bool:
        public = self.private.public_key()
        try:
            if self.alg == "RS256":
                public.verify(sig, data, padding.PKCS1v15(), hashes.SHA256())
            else:
                if len(sig) != 64:
                    return False
                der = encode_dss_signature(int.from_bytes(sig[:32], "big"),
                                           int.from_bytes(sig[32:], "big"))
                public.verify(der, data, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return False
        return True

    def jwk(self) -> dict[str, Any]:
        """The public key as the API server's JWKS lists it."""
        nums = self.private.public_key().public_numbers()
        if self.alg == "RS256":
            n = nums.n.to_bytes((nums.n.bit_length() + 7) // 8, "big")
            e = nums.e.to_bytes((nums.e.bit_length() + 7) // 8, "big")
            return {"use": "sig", "kty": "RSA", "kid": self.kid, "alg": "RS256",
                    "n": _b64(n), "e": _b64(e)}
        return {"use": "sig", "kty": "EC", "kid": self.kid, "crv": "P-256", "alg": "ES256",
                "x": _b64(nums.x.to_bytes(32, "big")), "y": _b64(nums.y.to_bytes(32, "big"))}


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
