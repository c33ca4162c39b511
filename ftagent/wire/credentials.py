"""A client's credentials towards the arbiter: the bearer token and TLS (agent and status).

The token is either a job token (``ftagent token --job NAME``: it speaks for that job
only, what an agent should hold) or the arbiter's secret (the admin: every job). The
client sends both the same way; the arbiter tells them apart.
"""

from __future__ import annotations

from pathlib import Path

import grpc


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
