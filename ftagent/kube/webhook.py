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
a pod with no containers / no command        200 allowed, only the ``ftagent.io/injected``
                                             annotation, with a warning
an invalid job name                          200 denied with the reason (the one denial)
a TLS handshake never finished, a client     dropped after ``handshake_timeout`` /
silent mid-request                           ``idle_timeout``; other clients unaffected
===========================================  ============================================
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftagent.kube.inject import Mutation, Settings, mutate

log = logging.getLogger("ftagent.webhook")

MAX_HEADER = 16 * 1024
API_VERSIONS = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")


@dataclass
class Counters:
    """What the webhook did, by outcome (served on /metrics as plain text)."""

    reviews: dict[str, int] = field(default_factory=dict)

    def count(self, outcome: str) -> None:
        self.reviews[outcome] = self.reviews.get(outcome, 0) + 1


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def review(body: bytes, settings: Settings, counters: Counters | None = None
           ) -> tuple[int, bytes]:
    """(HTTP status, response body) for one AdmissionReview request body."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        return _count(counters, "malformed", 400, _error(f"not JSON: {str(e)[:200]}"))
    request = doc.get("request") if isinstance(doc, dict) else None
    if not isinstance(request, dict) or doc.get("kind") != "AdmissionReview":
        return _count(counters, "malformed", 400, _error("not an AdmissionReview request"))
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        return _count(counters, "malformed", 400, _error("AdmissionReview request without uid"))
    version = doc.get("apiVersion") if doc.get("apiVersion") in API_VERSIONS else API_VERSIONS[0]
    kind = request.get("kind")
    kind_name = kind.get("kind") if isinstance(kind, dict) else None
    raw_ns = request.get("namespace")
    namespace = raw_ns if isinstance(raw_ns, str) else ""
    if kind_name != "Pod" or request.get("subResource"):
        outcome, m = "ignored", Mutation(status=f"not a pod ({str(kind_name)[:60]})")
    elif request.get("operation", "CREATE") != "CREATE":
        outcome, m = "ignored", Mutation(status=f"operation {str(request.get('operation'))[:20]}")
    else:
        try:
            m = mutate(request.get("object"), namespace, settings)
        except Exception as e:  # a bug must never stop pods: allowed unchanged, and logged
            log.exception("mutation failed for %s", uid)
            m = Mutation(status=f"internal error: {type(e).__name__}")
            outcome = "error"
        else:
            outcome = "denied" if m.denied else "patched" if m.patch else "unchanged"
    return _count(counters, outcome, 200, _response(version, uid, m))


def _count(counters: Counters | None, outcome: str, status: int,
           body: bytes) -> tuple[int, bytes]:
    if counters is not None:
        counters.count(outcome)
    return status, body


def _response(version: str, uid: str, m: Mutation) -> bytes:
    resp: dict[str, Any] = {"uid": uid, "allowed": not m.denied}
    if m.denied:
        resp["status"] = {"code": 403, "reason": "Forbidden", "message": m.denied}
    elif m.patch:
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
            431: "Request Header Fields Too Large"}


class WebhookServer:
    """``POST /mutate`` (AdmissionReview), ``GET /healthz``, ``GET /metrics``."""

    def __init__(self, settings: Settings, *, max_body: int = 4 * 1024 * 1024,
                 handshake_timeout: float = 5.0, idle_timeout: float = 60.0,
                 request_timeout: float = 10.0,  # for the body once the headers are in
                 handle: Callable[[bytes], tuple[int, bytes]] | None = None) -> None:
        self.settings = settings
        self.max_body = max_body
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        self.counters = Counters()
        self.handle = handle or (lambda body: review(body, self.settings, self.counters))
        self.server: asyncio.Server | None = None
        self.started = time.time()

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        """Listen; returns the port bound (for port 0)."""
        self.server = await asyncio.start_server(
            self._connection, host, port, ssl=tls, limit=MAX_HEADER,
            ssl_handshake_timeout=self.handshake_timeout if tls else None, backlog=1024)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError,
                asyncio.LimitOverrunError, OSError):
            pass
        except Exception:
            log.exception("webhook connection failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False to close the connection."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_timeout)
        except asyncio.LimitOverrunError:
            return self._send(writer, 431, _error("headers over 16 KiB"), close=True)
        except asyncio.IncompleteReadError:
            return False
        first, _, head = head.partition(b"\r\n")
        parts = first.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return self._send(writer, 400, _error("not an HTTP/1.x request"), close=True)
        method, path, proto = parts
        headers: dict[str, str] = {}
        for line in head.decode("latin-1").split("\r\n"):
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        keep = headers.get("connection", "").lower() != "close" and proto == "HTTP/1.1"
        if "transfer-encoding" in headers:
            return self._send(writer, 411, _error("chunked bodies are not accepted"), close=True)
        raw_len = headers.get("content-length", "0")
        if not raw_len.isdigit() or len(raw_len) > 12:
            return self._send(writer, 400, _error("bad Content-Length"), close=True)
        length = int(raw_len)
        if length > self.max_body:
            return self._send(writer, 413, _error(f"body of {length} bytes is over the limit "
                                                  f"of {self.max_body}"), close=True)
        body = await asyncio.wait_for(reader.readexactly(length), self.request_timeout) \
            if length else b""
        route = path.split("?", 1)[0]
        if route == "/mutate":
            if method != "POST":
                return self._send(writer, 405, _error("POST an AdmissionReview"), close=not keep)
            status, payload = self.handle(body)
        elif route in ("/healthz", "/readyz") and method == "GET":
            status, payload = 200, b'{"ok":true}'
        elif route == "/metrics" and method == "GET":
            status, payload = 200, self._metrics()
        else:
            status, payload = 404, _error(f"no {route[:80]}")
        ok = self._send(writer, status, payload, close=not keep)
        await writer.drain()
        return ok

    def _send(self, writer: asyncio.StreamWriter, status: int, payload: bytes, *,
              close: bool) -> bool:
        ctype = "text/plain; version=0.0.4" if payload[:1] == b"#" else "application/json"
        writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            status, _REASONS.get(status, "").encode(), ctype.encode(), len(payload),
            b"Connection: close\r\n" if close else b"") + payload)
        return not close

    def _metrics(self) -> bytes:
        lines = ["# HELP ftagent_webhook_reviews_total AdmissionReviews answered, by outcome",
                 "# TYPE ftagent_webhook_reviews_total counter"]
        lines += [f'ftagent_webhook_reviews_total{{outcome="{k}"}} {v}'
                  for k, v in sorted(self.counters.reviews.items())]
        return ("\n".join(lines) + "\n").encode()


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
