"""TLS credentials that follow their files: certificates rotate under running processes.

cert-manager renews a certificate before it expires and the kubelet swaps the mounted
Secret's files (a new ``..data`` symlink); a process that read them once serves an expired
certificate, or trusts a CA that signed nothing any more, until it is restarted.

* The arbiter (:func:`server_credentials`): gRPC's dynamic server credentials ask
  :class:`ServerFiles` for a new configuration before each new connection's handshake; a
  changed pair that loads (checked with OpenSSL first, so a half-written rotation is never
  served) is used from that handshake on, open connections keep theirs.
* Agents (:class:`ChannelFiles`): each new connection to the arbiter is made with the CA
  (and client pair) as the files hold them now.

Files are looked at by their (inode, size, mtime) stamp, at most once a second.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import grpc

log = logging.getLogger("ftagent.tls")

Stamp = tuple[tuple[int, int, int], ...]
CHECK_EVERY = 1.0  # seconds between two looks at the files


def stamp(*paths: str) -> Stamp | None:
    """What changes when a file is rewritten or its kubelet symlink swapped (``..data``)."""
    try:
        return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in map(os.stat, paths))
    except OSError:
        return None


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None


class ServerFiles:
    """The arbiter's certificate, key and (optional) client CA, re-read when they change."""

    def __init__(self, cert: str, key: str, client_ca: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self.clock = clock
        self.paths = tuple(p for p in (cert, key, client_ca) if p)
        self.seen = stamp(*self.paths)
        self.checked = clock()
        self.reloads = 0
        self.initial = self._config()  # ValueError: the files are unusable at start

    def _config(self) -> grpc.ServerCertificateConfiguration:
        pair = (_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))
        ca = _read(self.client_ca, "--tls-client-ca") if self.client_ca else None
        try:  # OpenSSL must accept the pair before gRPC serves it
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--tls-cert/--tls-key do not load: {e}") from None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration when the files changed and load, else
        None (keep serving the current one)."""
        now = self.clock()
        if now - self.checked < CHECK_EVERY:
            return None
        self.checked = now
        current = stamp(*self.paths)
        if current is None or current == self.seen:
            return None
        try:
            config = self._config()
        except ValueError as e:
            log.warning("rotated TLS files do not load yet (%s); still serving the previous "
                        "certificate", e)
            return None
        self.seen = current
        self.reloads += 1
        log.info("serving the rotated certificate %s", self.cert)
        return config


def server_credentials(cert: str, key: str, client_ca: str = ""
                       ) -> grpc.ServerCredentials | None:
    """TLS with ``cert``/``key`` (with ``client_ca``: client certificates required) that
    follows the files; None without TLS. ValueError for files unusable at start."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not cert or not key:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    files = ServerFiles(cert, key, client_ca)
    return grpc.dynamic_ssl_server_credentials(files.initial, files.fetch,
                                               require_client_authentication=bool(client_ca))


class ChannelFiles:
    """An agent's TLS to the arbiter: the CA (and client pair) as the files hold them
    when a connection is made. A file that is gone or unreadable later keeps the last
    good credentials (and one warning)."""

    def __init__(self, ca: str, cert: str = "", key: str = "") -> None:
        if not ca and (cert or key):
            raise ValueError("--tls-cert/--tls-key need --tls-ca (the arbiter's CA)")
        if bool(cert) != bool(key):
            raise ValueError("mTLS needs both --tls-cert and --tls-key")
        self.ca, self.cert, self.key = ca, cert, key
        self.paths = tuple(p for p in (ca, cert, key) if p)
        self.seen = stamp(*self.paths)
        self.reloads = 0
        self.creds = self._build() if ca else None  # ValueError: unusable at start

    def _build(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--tls-ca"),
            private_key=_read(self.key, "--tls-key") if self.key else None,
            certificate_chain=_read(self.cert, "--tls-cert") if self.cert else None)

    def current(self) -> grpc.ChannelCredentials | None:
        """The credentials for a new connection (None: no TLS)."""
        if self.creds is None:
            return None
        now = stamp(*self.paths)
        if now is not None and now != self.seen:
            try:
                self.creds = self._build()
            except ValueError as e:  # tried again at the next connection
                log.warning("rotated TLS files unreadable (%s); using the previous ones", e)
            else:
                self.seen = now
                self.reloads += 1
                log.info("using the rotated CA %s for new connections", self.ca)
        return self.creds
