"""The admission webhook: AdmissionReview v1 over HTTPS in, a JSONPatch out.

``review(body, settings)`` is the whole decision (pure, bytes in, status and bytes out);
``WebhookServer`` is a small asyncio HTTPS/1.1 server around it (keep-alive, as the API
server reuses its connections). It never crashes on what a client sends and keeps serving:

===========================================  ============================================
input                                        answer
===========================================  ============================================
not JSON, not an AdmissionReview, no uid     400 with a JSON error (the API server applies
                                             ``failurePolicy: Ignore``: the pod is created
                                             unchanged)
a body over ``max_body`` bytes               413, connection closed (body never read)
headers over 16 KiB, a bad request line      400/431, connection closed
a kind other than Pod, a non-pod object,     200 allowed, no patch, the reason in
an operation other than CREATE               ``auditAnnotations``
a pod with no containers / no command,       200 allowed, only the ``ftagent.io/injected``
``metadata: null``, nesting past any pod     annotation, with a warning where the user
                                             can act
any pod at all                               200 allowed: nothing is ever denied
a TLS handshake never finished, a client     dropped after ``handshake_timeout`` /
silent between requests                      ``idle_timeout``; other clients unaffected
a request trickled a byte at a time          dropped ``request_timeout`` after its first
                                             byte (a total deadline, not per read)
connections past ``max_connections``, or     answered 503 and closed at once: no peer
past ``max_per_source`` from one address     holds every file descriptor
===========================================  ============================================

The kubelet's probes have their own plain-HTTP listener (:class:`ProbeServer`, the same
protocol with a 2 s deadline and 4 connections per source), so no flood on the HTTPS port
turns the webhook's liveness or readiness red.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import mmap
import os
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any

from ftagent.kube.inject import SKIP_REASONS, Mutation, Settings, mutate

log = logging.getLogger("ftagent.webhook")

MAX_HEADER = 16 * 1024
API_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")


RESULTS = ("injected", "skipped", "error", "malformed")
OTHER_REASONS = ("not create",)  # beside inject.SKIP_REASONS
MAX_UID = 128
STARTING_SERIES = (("injected", ""), ("error", ""), ("malformed", ""))


class Counters:
    """What the webhook did, by result and reason (served on /metrics): a bounded set of
    series, so that a pod that runs without the agent is visible and alertable.

    The counts live in shared memory, one row per worker process (``--workers``): any
    worker that answers a scrape sums every row, so the counters a scrape reads never go
    back when the kernel hands it to another worker, and a restarted worker keeps its row."""

    KEYS = tuple((r, why) for r in RESULTS
                 for why in ("", *SKIP_REASONS, *OTHER_REASONS, "other"))
    _INDEX = {k: i for i, k in enumerate(KEYS)}
    _SIZE = struct.calcsize("Q")

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, workers)
        self.slots = mmap.mmap(-1, self._SIZE * len(self.KEYS) * self.workers)  # shared
        self.row = 0  # this process' row (the worker's index)

    def count(self, result: str, reason: str = "") -> None:
        i = self._INDEX.get((result, reason))
        if i is None:
            i = self._INDEX.get((result, "other"), self._INDEX[("error", "other")])
        at = (self.row * len(self.KEYS) + i) * self._SIZE
        (n,) = struct.unpack_from("Q", self.slots, at)
        struct.pack_into("Q", self.slots, at, n + 1)

    @property
    def reviews(self) -> dict[tuple[str, str], int]:
        """Every worker's counts summed, the keys counted at least once."""
        n = len(self.KEYS)
        values = struct.unpack_from(f"{n * self.workers}Q", self.slots, 0)
        totals = [sum(values[w * n + i] for w in range(self.workers)) for i in range(n)]
        return {k: v for k, v in zip(self.KEYS, totals, strict=True) if v}


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def review(body: bytes, settings: Settings, counters: Counters | None = None
           ) -> tuple[int, bytes]:
    """(HTTP status, response body) for one AdmissionReview request body. Every review
    with a uid gets a well-formed AdmissionReview answer that allows the pod: ftagent
    never stands between a job and its pods."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        return _count(counters, "malformed", "", 400, _error(f"not JSON: {str(e)[:200]}"))
    request = doc.get("request") if isinstance(doc, dict) else None
    if not isinstance(request, dict) or doc.get("kind") != "AdmissionReview":
        return _count(counters, "malformed", "", 400,
                      _error("not an AdmissionReview request"))
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid or len(uid) > MAX_UID:
        return _count(counters, "malformed", "", 400,
                      _error("AdmissionReview request without a uid (or one over 128 "
                             "characters)"))
    version = doc.get("apiVersion") if doc.get("apiVersion") in API_VERSIONS else API_VERSIONS[0]
    kind = request.get("kind")
    kind_name = kind.get("kind") if isinstance(kind, dict) else None
    raw_ns = request.get("namespace")
    namespace = raw_ns if isinstance(raw_ns, str) else ""
    if kind_name != "Pod" or request.get("subResource"):
        m = Mutation(status=f"skipped: not a pod ({str(kind_name)[:60]})", reason="not a pod")
    elif request.get("operation", "CREATE") != "CREATE":
        m = Mutation(status=f"skipped: operation {str(request.get('operation'))[:20]}",
                     reason="not create")
    else:
        try:
            m = mutate(request.get("object"), namespace, settings)
        except Exception as e:  # a bug must never stop pods: allowed unchanged, and logged
            log.exception("mutation failed for %s", uid)
            m = Mutation(status=f"internal error: {type(e).__name__}", reason="error",
                         warnings=["ftagent: internal error: the pod runs without ftagent"])
            return _count(counters, "error", "", 200, _response(version, uid, m))
    try:
        answer = _response(version, uid, m)
    except (RecursionError, ValueError):  # a patch nested deeper than JSON encodes
        m = Mutation(status="skipped: unreadable pod (nested too deep)",
                     reason="unreadable pod")
        answer = _response(version, uid, m)
    return _count(counters, "injected" if m.injected else "skipped", m.reason, 200, answer)


def _count(counters: Counters | None, result: str, reason: str, status: int,
           body: bytes) -> tuple[int, bytes]:
    if counters is not None:
        counters.count(result, reason)
    return status, body


def _response(version: str, uid: str, m: Mutation) -> bytes:
    resp: dict[str, Any] = {"uid": uid, "allowed": True}
    if m.patch:
        resp["patchType"] = "JSONPatch"
        resp["patch"] = base64.b64encode(json.dumps(m.patch, separators=(",", ":")).encode()
                                         ).decode()
    if m.warnings:
        resp["warnings"] = m.warnings
    if m.status:
        resp["auditAnnotations"] = {"injected": m.status[:200]}
    return json.dumps({"apiVersion": version, "kind": "AdmissionReview", "response": resp},
                      separators=(",", ":")).encode()


# --------------------------------------------------------------------------- HTTPS


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}
MAX_CONNECTIONS = 4096
MAX_PER_SOURCE = 512  # the API server's own connections come from few addresses
BACKLOG = 256  # also how many connections asyncio accepts in one go (each a descriptor)
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Content-Length: 27\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
         b'{"error":"too many conns"}\n')


def connection_cap(wanted: int, reserve: int = 64 + BACKLOG) -> int:
    """``wanted``, but at most half the file descriptors this process may open (its soft
    limit, raised to the hard one first, as Go's runtime does), so connections past the
    cap are refused by a process that can still accept, log and answer its probes."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return wanted
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (int(soft) - reserve) // 2))


class _Admission:
    """Counts open connections, in all and per peer address."""

    def __init__(self, max_connections: int, max_per_source: int) -> None:
        self.max_connections = max(1, max_connections)
        self.max_per_source = max(1, max_per_source)
        self.open = 0
        self.per_source: dict[str, int] = {}
        self.refused = 0

    def admit(self, source: str) -> bool:
        if self.open >= self.max_connections or \
                self.per_source.get(source, 0) >= self.max_per_source:
            self.refused += 1
            return False
        self.open += 1
        self.per_source[source] = self.per_source.get(source, 0) + 1
        return True

    def release(self, source: str) -> None:
        self.open -= 1
        n = self.per_source.get(source, 1) - 1
        if n > 0:
            self.per_source[source] = n
        else:
            self.per_source.pop(source, None)


class WebhookServer:
    """``POST /mutate`` (AdmissionReview), ``GET /healthz``, ``GET /metrics``.

    A protocol per connection, not asyncio streams: at 200 concurrent reviews the streams'
    ``readuntil``/``wait_for`` tasks cost more CPU than the review itself. Timeouts are one
    timer per connection, re-armed per request (idle between requests, ``request_timeout``
    for a body once its headers are in)."""

    def __init__(self, settings: Settings, *, max_body: int = 4 * 1024 * 1024,
                 handshake_timeout: float = 5.0, idle_timeout: float = 60.0,
                 request_timeout: float = 10.0,  # from a request's first byte to its last
                 handle: Callable[[bytes], tuple[int, bytes]] | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 max_per_source: int = MAX_PER_SOURCE,
                 counters: Counters | None = None) -> None:
        self.settings = settings
        self.admission = _Admission(max_connections, max_per_source)
        self.max_body = max_body
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        self.counters = counters or Counters()
        self.handle = handle or (lambda body: review(body, self.settings, self.counters))
        self.server: asyncio.Server | None = None
        self.started = time.time()

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None, *,
                    reuse_port: bool = False) -> int:
        """Listen; returns the port bound (for port 0). ``reuse_port``: one of several
        worker processes on the same port (SO_REUSEPORT, the kernel spreads connections)."""
        loop = asyncio.get_running_loop()
        # TLS is started by the gate after admission, not by create_server(ssl=...): there a
        # connection is invisible until its handshake ends, so a flood of unfinished
        # handshakes took every file descriptor (accept() then failed with EMFILE).
        self.server = await loop.create_server(
            (lambda: _Gate(self, tls)) if tls is not None else (lambda: _Connection(self)),
            host, port, backlog=BACKLOG, reuse_port=reuse_port or None)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2.0)

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, payload) for one parsed request."""
        route = path.split("?", 1)[0]
        if route == "/mutate":
            if method != "POST":
                return 405, _error("POST an AdmissionReview")
            return self.handle(body)
        if route in ("/healthz", "/readyz") and method == "GET":
            return 200, b'{"ok":true}'
        if route == "/metrics" and method == "GET":
            return 200, self._metrics()
        return 404, _error(f"no {route[:80]}")

    def _metrics(self) -> bytes:
        return render_metrics(self.counters)


class ProbeServer(WebhookServer):
    """``GET /healthz``, ``/livez``, ``/readyz`` in plain HTTP on a port of their own: a
    probe's request is a few dozen bytes, so its deadline is short and one source holds
    at most 4 connections (the kubelet probes one at a time)."""

    def __init__(self, counters: Counters | None = None) -> None:
        """``counters`` given: ``/metrics`` only (the webhook's --metrics-port, which the
        NetworkPolicy opens to the monitoring namespace alone)."""
        super().__init__(Settings(image=""), max_body=0, handshake_timeout=2.0,
                         idle_timeout=10.0, request_timeout=2.0,
                         max_connections=64, max_per_source=4, counters=counters)
        self.metrics_only = counters is not None

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        route = path.split("?", 1)[0]
        if method != "GET":
            return 405, _error("GET only")
        if self.metrics_only:
            if route == "/metrics":
                return 200, self._metrics()
        elif route in ("/healthz", "/livez", "/readyz"):
            return 200, b'{"ok":true}'
        return 404, _error(f"no {route[:80]}")


def render_metrics(counters: Counters) -> bytes:
    """The webhook's ``/metrics``: Prometheus' text format of ``counters``."""
    lines = ["# HELP ftagent_webhook_reviews_total AdmissionReviews answered, by result "
             "(injected, skipped, error, malformed) and the reason a pod was skipped",
             "# TYPE ftagent_webhook_reviews_total counter"]
    # the series an alert reads exist from the start at 0: a counter that first appears
    # at 1 has no earlier sample, and rate() would never see the first error
    seen = {**{k: 0 for k in STARTING_SERIES}, **counters.reviews}
    lines += [f'ftagent_webhook_reviews_total{{result="{r}",reason="{why}"}} {v}'
              for (r, why), v in sorted(seen.items())]
    return ("\n".join(lines) + "\n").encode()


def _http(status: int, payload: bytes, close: bool) -> bytes:
    ctype = b"text/plain; version=0.0.4" if payload[:1] == b"#" else b"application/json"
    return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status, _REASONS.get(status, "").encode(), ctype, len(payload),
        b"Connection: close\r\n" if close else b"", payload)


class _Gate(asyncio.Protocol):
    """A TLS connection's first stage: admitted (or refused) on its peer address while it
    is plain TCP, then upgraded to TLS within ``handshake_timeout``; the HTTP protocol
    (:class:`_Connection`) takes over once the handshake is done."""

    def __init__(self, server: WebhookServer, tls: ssl.SSLContext) -> None:
        self.server, self.tls = server, tls
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # the ClientHello waits for the TLS layer
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self.server.admission.admit(source):
            transport.abort()  # no TLS yet: nothing to say in a language it speaks
            return
        self.task = asyncio.ensure_future(self._upgrade(transport, source))

    async def _upgrade(self, transport: asyncio.Transport, source: str) -> None:
        conn = _Connection(self.server, source)
        try:
            tls_transport = await asyncio.get_running_loop().start_tls(
                transport, conn, self.tls, server_side=True,
                ssl_handshake_timeout=self.server.handshake_timeout)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError):
            transport.abort()
            conn.connection_lost(None)  # gives the admission back
            return
        except BaseException:
            transport.abort()
            conn.connection_lost(None)
            raise
        if tls_transport is None:  # closed during the handshake
            conn.connection_lost(None)
            return
        conn.connection_made(tls_transport)

    def connection_lost(self, exc: Exception | None) -> None:
        """Only before the upgrade (the TLS layer owns the transport after)."""


class _Connection(asyncio.Protocol):
    """One client connection: HTTP/1.1 requests one at a time (as the API server sends
    them), parsed from a buffer that never holds more than the headers' limit plus one
    body of at most ``max_body``."""

    def __init__(self, server: WebhookServer, admitted: str | None = None) -> None:
        self.server = server
        self.admitted = admitted  # the peer address a _Gate already admitted
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.head: tuple[str, str, bool, int] | None = None  # method, path, keep, length
        self.closed = False
        self.source = admitted  # the peer's address, once admitted (released when lost)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.admitted is not None:
            self._arm(self.server.request_timeout if self.buf else self.server.idle_timeout)
            if self.buf:  # bytes that came with the end of the handshake
                self.data_received(b"")
            return
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self.server.admission.admit(source):
            self.closed = True
            transport.write(_BUSY)
            transport.close()
            return
        self.source = source
        self._arm(self.server.idle_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.source is not None:
            self.server.admission.release(self.source)
            self.source = None
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        self.buf = bytearray()

    def pause_writing(self) -> None:  # a client not reading its answers: stop reading too
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def _arm(self, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self.transport is None:  # before connection_made (the TLS layer's last bytes)
            self.buf += data
            return
        if not self.buf and self.head is None and data:  # a request begins: its deadline
            self._arm(self.server.request_timeout)
        self.buf += data
        try:
            while not self.closed and self._step():
                pass
        except Exception:  # never let a bug in parsing take the server down
            log.exception("webhook connection failed")
            self._finish(400, _error("bad request"), True)

    def _step(self) -> bool:
        """Parse and answer what the buffer holds; True when another request may follow."""
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER:
                    self._finish(431, _error("headers over 16 KiB"), True)
                return False
            if end > MAX_HEADER:
                self._finish(431, _error("headers over 16 KiB"), True)
                return False
            raw = bytes(self.buf[:end])
            del self.buf[:end + 4]
            head = self._parse_head(raw)
            if head is None:
                return False
            self.head = head
        method, path, keep, length = self.head
        if len(self.buf) < length:
            return False
        body = bytes(self.buf[:length])
        del self.buf[:length]
        self.head = None
        status, payload = self.server.answer(method, path, body)
        self._finish(status, payload, not keep)
        if not self.closed:  # a pipelined request already begun keeps its own deadline
            self._arm(self.server.request_timeout if self.buf else self.server.idle_timeout)
        return not self.closed

    def _parse_head(self, raw: bytes) -> tuple[str, str, bool, int] | None:
        first, _, rest = raw.partition(b"\r\n")
        parts = first.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._finish(400, _error("not an HTTP/1.x request"), True)
            return None
        method, path, proto = parts
        headers: dict[str, str] = {}
        for line in rest.decode("latin-1").split("\r\n"):
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        keep = headers.get("connection", "").lower() != "close" and proto == "HTTP/1.1"
        if "transfer-encoding" in headers:
            self._finish(411, _error("chunked bodies are not accepted"), True)
            return None
        raw_len = headers.get("content-length", "0")
        if not raw_len.isdigit() or len(raw_len) > 12:
            self._finish(400, _error("bad Content-Length"), True)
            return None
        length = int(raw_len)
        if length > self.server.max_body:
            self._finish(413, _error(f"body of {length} bytes is over the limit "
                                     f"of {self.server.max_body}"), True)
            return None
        return method, path, keep, length

    def _finish(self, status: int, payload: bytes, close: bool) -> None:
        if self.transport is None or self.closed:
            return
        self.transport.write(_http(status, payload, close))
        if close:
            self.closed = True
            if self.timer is not None:
                self.timer.cancel()
            self.transport.close()


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def _stamp(*paths: str) -> tuple[tuple[int, int, int], ...] | None:
    """What changes when a file is rewritten or its kubelet symlink swapped (``..data``)."""
    try:
        return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in map(os.stat, paths))
    except OSError:
        return None


class CertReloader:
    """Keeps a serving context on the certificate files as they are now: cert-manager and
    the kubelet rotate them in place, and a webhook that read them once would fail every
    handshake after a rotation (``failurePolicy: Ignore``: injection stops, unnoticed).

    ``check()`` (every few seconds) loads changed files into the live context: OpenSSL
    copies the context's certificate into each new connection, so new handshakes serve the
    new pair and open connections keep theirs. A pair that does not load (a half-written
    rotation, a key that does not match) is first tried in a scratch context and never
    touches the live one: the old pair stays until a good one appears."""

    def __init__(self, ctx: ssl.SSLContext, cert: str, key: str) -> None:
        self.ctx, self.cert, self.key = ctx, cert, key
        self.seen = _stamp(cert, key)
        self.reloads = 0

    def check(self) -> bool:
        """True when the context now serves a new pair."""
        now = _stamp(self.cert, self.key)
        if now is None or now == self.seen:
            return False
        try:
            tls_context(self.cert, self.key)  # all of it loads, or nothing changes
            self.ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            log.warning("rotated certificate %s does not load yet (%s); still serving the "
                        "previous one", self.cert, e)
            return False
        self.seen = now
        self.reloads += 1
        log.info("serving the rotated certificate %s", self.cert)
        return True


class CaFile:
    """The arbiter's CA bundle that pods get, re-read when its file changes (a mounted
    Secret key is rotated by the kubelet). A missing or unreadable file means no CA (the
    Secret is optional); a file that is not PEM certificates is refused, keeping the last
    good one."""

    MAX = 256 * 1024

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: tuple[tuple[int, int, int], ...] | None = None
        self.pem = ""

    def __call__(self) -> str:
        now = _stamp(self.path)
        if now is None:
            if self.seen is not None:
                log.warning("arbiter CA %s is gone; pods get none", self.path)
            self.seen, self.pem = None, ""
            return ""
        if now != self.seen:
            self.seen = now
            try:
                with open(self.path, "rb") as f:
                    data = f.read(self.MAX + 1)
                text = data.decode("ascii")
            except (OSError, UnicodeDecodeError) as e:
                log.warning("arbiter CA %s unreadable (%s)", self.path, e)
                return self.pem
            if len(data) > self.MAX or "-----BEGIN CERTIFICATE-----" not in text:
                log.warning("arbiter CA %s is not a PEM certificate bundle; kept the "
                            "previous one", self.path)
                return self.pem
            self.pem = text.strip()
        return self.pem
