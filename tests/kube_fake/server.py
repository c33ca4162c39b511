"""The HTTP side of the fake API server: routing, Status errors, chunked watch streams."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from .errors import ApiError
from .evictions import evict
from .faults import Faults, Request
from .resources import (
    Kind,
    SelectorError,
    find_kind,
    parse_field_selector,
    parse_label_selector,
)
from .store import Dropped, Store

MAX_BODY = 3 * 1024 * 1024  # the real server's request size limit (3 MiB)
DISCOVERY = ("/.well-known/openid-configuration", "/openid/v1/jwks")


class _Route:
    def __init__(self, kind: Kind, namespace: str | None, name: str | None,
                 sub: str | None) -> None:
        self.kind, self.namespace, self.name, self.sub = kind, namespace, name, sub

    @property
    def resource(self) -> str:
        return self.kind.qualified + (f"/{self.sub}" if self.sub else "")


def route(path: str) -> _Route | None:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    ns = None
    if len(rest) >= 3 and rest[0] == "namespaces" and find_kind(group, version, rest[2]):
        ns, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    kind = find_kind(group, version, rest[0])
    if kind is None or (ns is not None and not kind.namespaced):
        return None
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if sub not in (None, "status") and not (sub == "eviction" and kind.plural == "pods"
                                            and kind.group == ""):
        return None
    return _Route(kind, ns, name, sub)


class FakeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, store: Store, faults: Faults, token: str | None,
                 bookmark_interval: float, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        if tls is not None:  # the handshake happens in the handler's thread, not accept()
            self.socket = tls.wrap_socket(self.socket, server_side=True,
                                          do_handshake_on_connect=False)
        self.store, self.faults, self.token = store, faults, token
        # resources whose CRD is not installed (404, as for any unknown resource), and
        # status fields a CRD's schema does not have (pruned on write, as the real
        # server prunes unknown fields of a structural schema)
        self.absent: set[str] = set()
        self.unknown_status: dict[str, set[str]] = {}
        self.bookmark_interval = bookmark_interval
        self.bookmark_epoch = 0
        self.issuer: Any = None  # tokens.Issuer: answers TokenReviews
        self.access: Any = None  # access.Access: answers SubjectAccessReviews
        self.stopping = threading.Event()
        self.conns: set[socket.socket] = set()
        self.conns_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.conns_lock:
            self.conns.add(request)
        super().process_request(request, client_address)

    def close_all(self) -> None:
        with self.conns_lock:
            conns, self.conns = list(self.conns), set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeHTTPServer

    def setup(self) -> None:
        super().setup()
        # Go's net package sets TCP_NODELAY on every connection; without it Nagle holds
        # each small watch event until the client's delayed ACK (~40 ms)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # the request log is Faults.requests

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    # --------------------------------------------------------------------------
    def _send_json(self, code: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            self._send_json(413, ApiError(413, "RequestEntityTooLarge",
                                          "Request entity too large: limit is 3145728").status())
            return
        raw = self.rfile.read(length) if length else b""
        if url.path in ("/version", "/healthz", "/readyz", "/livez"):
            self._send_json(200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake"}
                            if url.path == "/version" else "ok")
            return
        token = self.server.token
        if token and self.headers.get("Authorization") != f"Bearer {token}":
            self._send_json(401, ApiError(401, "Unauthorized", "Unauthorized").status())
            return
        if url.path in DISCOVERY and self.server.issuer is not None:
            self._discovery(method, url.path, query)
            return
        r = route(url.path)
        if r is None or r.kind.qualified in self.server.absent:
            self._send_json(404, ApiError(404, "NotFound", "the server could not find the "
                                          "requested resource", {}).status())
            return
        watch = query.get("watch") in ("true", "1")
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method) or (
            ("get" if r.name else "watch" if watch else "list") if method == "GET"
            else ("delete" if r.name else "deletecollection"))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        req = Request(verb, r.resource, r.namespace, r.name, query,
                      {k.lower(): v for k, v in self.headers.items()}, body)
        self.server.faults.log(req)
        delay = self.server.faults.delay_for(req)
        if delay > 0:
            time.sleep(delay)  # a loaded API server answering late (FakeKube.slow)
        try:
            injected = self.server.faults.check(req)
            if injected is not None:
                raise injected
            if isinstance(body, str):
                raise ApiError(400, "BadRequest", f"the body of the request could not be "
                               f"decoded: {body[:80]!r}")
            if verb == "watch":
                self.server.faults.answered(req, 200)
                self._watch(r, query)
                return
            code, out = self._verb(verb, r, query, body, self.headers.get("Content-Type", ""))
        except ApiError as e:
            self.server.faults.answered(req, e.code)
            self._send_json(e.code, e.status(), e.headers)
            return
        self.server.faults.answered(req, code)
        self._send_json(code, out)

    def _discovery(self, method: str, path: str, query: dict[str, str]) -> None:
        """The service-account issuer's OIDC discovery and key set (non-resource URLs:
        RBAC's ``nonResourceURLs``, the ``system:service-account-issuer-discovery``
        ClusterRole); logged and fault-injectable as verb ``get`` on the path."""
        req = Request(method.lower(), path, None, None, query,
                      {k.lower(): v for k, v in self.headers.items()}, None)
        self.server.faults.log(req)
        try:
            injected = self.server.faults.check(req)
            if injected is not None:
                raise injected
            if method != "GET":
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this "
                               "method on the requested resource")
        except ApiError as e:
            self.server.faults.answered(req, e.code)
            self._send_json(e.code, e.status(), e.headers)
            return
        self.server.faults.answered(req, 200)
        issuer = self.server.issuer
        if path == DISCOVERY[0]:
            scheme = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
            host = self.headers.get("Host") or "127.0.0.1"
            self._send_json(200, issuer.discovery(f"{scheme}://{host}"))
        else:
            data = json.dumps(issuer.jwks(), separators=(",", ":")).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/jwk-set+json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def _selectors(self, r: _Route, query: dict[str, str]) -> tuple[Any, Any]:
        try:
            return (parse_label_selector(query.get("labelSelector")),
                    parse_field_selector(query.get("fieldSelector"), r.kind))
        except SelectorError as e:
            raise ApiError(400, "BadRequest", str(e)) from e

    def _verb(self, verb: str, r: _Route, query: dict[str, str], body: Any,
              ctype: str) -> tuple[int, Any]:
        store = self.server.store
        if r.kind.plural == "tokenreviews":  # create-only, never stored (as for real)
            if verb != "create" or r.name is not None:
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this "
                               "method on the requested resource")
            if not isinstance(body, dict) or not isinstance(body.get("spec"), dict):
                raise ApiError(400, "BadRequest", "TokenReview has no spec")
            return 201, self.server.issuer.review(body)
        if r.sub == "eviction":  # create-only: PodDisruptionBudget rules (evictions.py)
            if verb != "create":
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this "
                               "method on the requested resource")
            return 201, evict(store, r.namespace or "", r.name or "", body)
        if r.kind.plural == "subjectaccessreviews":  # create-only, never stored
            if verb != "create" or r.name is not None:
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this "
                               "method on the requested resource")
            return 201, self.server.access.review(body)
        if verb == "get":
            return 200, store.get(r.kind, r.namespace, r.name or "")
        if verb == "list":
            labels, fields = self._selectors(r, query)
            limit = int(query["limit"]) if query.get("limit", "").isdigit() else None
            return 200, store.list_objects(r.kind, r.namespace, labels, fields, limit,
                                   query.get("continue") or None, query.get("resourceVersion"),
                                   query.get("resourceVersionMatch"))
        if verb == "create":
            if r.name is not None:
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this method "
                               "on the requested resource")
            return 201, store.create(r.kind, r.namespace, body)
        if verb in ("update", "patch") and isinstance(body, dict) and isinstance(
                body.get("status"), dict):
            for f in self.server.unknown_status.get(r.kind.qualified, ()):
                body["status"].pop(f, None)
        if verb == "update":
            return 200, store.update(r.kind, r.namespace, r.name or "", body, r.sub)
        if verb == "patch":
            return 200, store.patch(r.kind, r.namespace, r.name or "", ctype, body, r.sub)
        if verb == "delete":
            opts = body if isinstance(body, dict) else {}
            grace = opts.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
            return 200, store.delete(r.kind, r.namespace, r.name or "",
                                     None if grace is None else int(grace),
                                     opts.get("preconditions"))
        raise ApiError(405, "MethodNotAllowed", "the fake API server does not implement "
                       f"{verb} (stub)")

    # ------------------------------------------------------------------ watch
    def _chunk(self, obj: Any) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(self, r: _Route, query: dict[str, str]) -> None:
        store = self.server.store
        labels, fields = self._selectors(r, query)
        timeout = query.get("timeoutSeconds")
        deadline = time.monotonic() + (float(timeout) if timeout else 1800.0)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            try:
                w = store.open_watch(r.kind, r.namespace, labels, fields,
                                     query.get("resourceVersion"))
            except ApiError as e:
                self._chunk({"type": "ERROR", "object": e.status()})
                self._end()
                return
            store.register(w)
            try:
                self._stream(w, deadline, bookmarks)
            finally:
                store.unregister(w)
            self._end()
        except (Dropped, BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)  # mid-stream, no final chunk

    def _stream(self, w: Any, deadline: float, bookmarks: bool) -> None:
        srv, store = self.server, self.server.store
        last_bookmark, seen_epoch = time.monotonic(), srv.bookmark_epoch
        while not srv.stopping.is_set():
            now = time.monotonic()
            if now >= deadline:
                break
            if self._client_gone():
                raise Dropped()  # as Go's server cancels the request of a closed connection
            wait = min(deadline - now, 0.2)
            if bookmarks:
                wait = min(wait, max(0.0, srv.bookmark_interval - (now - last_bookmark)))
            try:
                events = store.next_events(w, wait)
            except ApiError as e:
                self._chunk({"type": "ERROR", "object": e.status()})
                break
            for ev in events:
                self._chunk(ev)
            if bookmarks and (time.monotonic() - last_bookmark >= srv.bookmark_interval
                              or seen_epoch != srv.bookmark_epoch):
                self._chunk(store.bookmark(w))
                last_bookmark, seen_epoch = time.monotonic(), srv.bookmark_epoch
        if srv.stopping.is_set():
            raise Dropped()

    def _client_gone(self) -> bool:
        """A watch client sends nothing after its request: readable means closed (for TLS,
        where a peek is not possible, any readable byte is the close_notify)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            if isinstance(self.connection, ssl.SSLSocket):
                return True
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
