"""A client's credentials towards the arbiter: the bearer token and TLS (agent and status).

The token is either a job token (``ftagent token --job NAME``: it speaks for that job
only, what an agent should hold), the arbiter's secret (the admin: every job), or in
Kubernetes the pod's projected ServiceAccount token read from ``--token-file`` (it speaks
for that pod only). The client sends them all the same way; the arbiter tells them apart.
The file is read again at every (re)connect: the kubelet rotates it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

log = logging.getLogger("ftagent.credentials")


MAX_TOKEN_FILE = 64 * 1024  # a projected token is ~1 KB


def current_token(token: str, token_file: str) -> str:
    """The token to present now: ``token_file``'s content when given (read fresh: the
    kubelet rotates it; unreadable -> "" and the arbiter refuses, the caller retries),
    else ``token``."""
    if not token_file:
        return token
    try:
        with open(token_file, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE + 1)
    except OSError as e:
        log.warning("--token-file %s: %s: connecting without a token", token_file,
                    e.strerror or e)
        return ""
    if len(raw) > MAX_TOKEN_FILE:
        log.warning("--token-file %s is over %d bytes: not a token", token_file,
                    MAX_TOKEN_FILE)
        return ""
    return raw.decode("ascii", errors="replace").strip()


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries ``token`` (empty when there is none)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel_credentials(ca: str, cert: str, key: str) -> grpc.ChannelCredentials | None:
    """TLS to the arbiter when ``ca`` is given; ``cert``/``key`` add a client certificate."""
    if not ca:
        if cert or key:
            raise ValueError("--tls-cert/--tls-key need --tls-ca (the arbiter's CA)")
        return None
    if bool(cert) != bool(key):
        raise ValueError("mTLS needs both --tls-cert and --tls-key")
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(ca, "--tls-ca"),
        private_key=read_file(key, "--tls-key") if key else None,
        certificate_chain=read_file(cert, "--tls-cert") if cert else None)


def read_file(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
