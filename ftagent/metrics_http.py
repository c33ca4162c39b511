"""/metrics (and probes) over HTTP that no peer can starve.

prometheus_client's ``start_http_server`` starts a thread for every connection and keeps
it as long as the peer keeps the socket open: any peer that can reach the port could
hold thousands of threads (issue 20). Here:

* at most ``max_connections`` requests are served at once, and at most ``max_per_source``
  from one peer address; a connection past either is answered ``503`` at once and closed
  by the accepting thread;
* every request has a total deadline (``REQUEST_DEADLINE`` from its accept to its last
  header byte), not a per-read timeout: a peer trickling one byte a second loses its slot
  when the deadline passes, however often it sends (issue 33: 32 connections sending a
  byte every 2 s held every slot of the arbiter's old per-read timeout for good);
* the kubelet's probes get a listener of their own (:func:`serve_health`), so that a flood
  of scrapes or of slow peers on ``/metrics`` cannot turn liveness or readiness red.

A scrape takes milliseconds; the slots are there for Prometheus, the kubelet and a person
with curl. The shipped NetworkPolicy decides who may connect at all.
"""

from __future__ import annotations

import io
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

MAX_CONNECTIONS = 32
MAX_PER_SOURCE = 8
REQUEST_DEADLINE = 5.0  # seconds from accept until the request's headers are in
WRITE_TIMEOUT = 10.0  # seconds to send the whole answer (a scrape's body)
IDLE_TIMEOUT = REQUEST_DEADLINE  # the old name (tests and callers that tune it)
_BUSY_BODY = b"busy: too many connections\n"
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
        b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s"
        % (len(_BUSY_BODY), _BUSY_BODY))


class _DeadlineReader(io.RawIOBase):
    """A socket's reading side that gives up at a fixed moment: each ``recv`` waits only
    what is left of the deadline, so trickled bytes do not buy more time."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self.sock.settimeout(left)
        return self.sock.recv_into(buf)


class _Handler(WSGIRequestHandler):
    """wsgiref's handler, silent, with a total deadline on reading the request."""

    deadline = REQUEST_DEADLINE

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain makefile(): replaced by one with a deadline
        self.rfile = io.BufferedReader(
            _DeadlineReader(self.connection, time.monotonic() + self.deadline))

    def parse_request(self) -> bool:
        ok = super().parse_request()  # the headers are in: the answer gets its own time
        self.connection.settimeout(WRITE_TIMEOUT)
        return ok

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's)
        """No access log on stderr (a scrape every few seconds is not news)."""


class BoundedWSGIServer(ThreadingMixIn, WSGIServer):
    """A thread per request, at most ``max_connections`` at once and ``max_per_source``
    from one address."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    max_per_source = MAX_PER_SOURCE
    request_queue_size = 128  # the listen backlog: a burst of scrapes waits, not drops

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._lock = threading.Lock()
        self._per_source: dict[str, int] = {}
        self.refused = 0  # connections answered 503 (all slots, or the source's, taken)

    def _take(self, source: str) -> bool:
        with self._lock:
            if self._per_source.get(source, 0) >= self.max_per_source:
                return False
            if not self._slots.acquire(blocking=False):
                return False
            self._per_source[source] = self._per_source.get(source, 0) + 1
            return True

    def _give(self, source: str) -> None:
        with self._lock:
            n = self._per_source.get(source, 1) - 1
            if n > 0:
                self._per_source[source] = n
            else:
                self._per_source.pop(source, None)
            self._slots.release()

    def process_request(self, request: Any, client_address: Any) -> None:
        source = str(client_address[0])
        if not self._take(source):
            self.refused += 1
            try:
                request.settimeout(0.1)
                request.sendall(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the thread
        except BaseException:
            self._give(source)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give(str(client_address[0]))

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that went quiet or away is routine here: no traceback on stderr."""
        if not isinstance(sys.exc_info()[1], OSError):  # TimeoutError, resets, pipes
            super().handle_error(request, client_address)


def _family(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family of ``addr`` (a name resolves to its first address) and the host
    to bind: what ``prometheus_client`` does, without its private helper."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    return family, str(sockaddr[0])


def serve(port: int, addr: str, app: Any, *,
          max_connections: int = MAX_CONNECTIONS, max_per_source: int = MAX_PER_SOURCE,
          deadline: float | None = None, name: str = "metrics-http") -> BoundedWSGIServer:
    """Serve the WSGI ``app`` on ``addr:port`` in a daemon thread; raises OSError when the
    port cannot be bound. ``shutdown()`` and ``server_close()`` stop it."""

    class Server(BoundedWSGIServer):  # address_family is per class (IPv4 or IPv6)
        pass

    class Handler(_Handler):
        pass

    Handler.deadline = IDLE_TIMEOUT if deadline is None else deadline
    Server.max_connections = max(1, max_connections)
    Server.max_per_source = max(1, max_per_source)
    Server.address_family, host = _family(addr, port)
    httpd = make_server(host, port, app, Server, handler_class=Handler)
    assert isinstance(httpd, BoundedWSGIServer)
    threading.Thread(target=httpd.serve_forever, daemon=True, name=name).start()
    return httpd


def start_http_server(port: int, addr: str = "0.0.0.0",
                      registry: CollectorRegistry | None = None
                      ) -> tuple[BoundedWSGIServer, None]:
    """prometheus_client's ``start_http_server``, with bounded connections: the same
    arguments, the server first in what it returns."""
    from prometheus_client import REGISTRY

    return serve(port, addr, make_wsgi_app(registry or REGISTRY)), None


# --------------------------------------------------------------------------- probes

HEALTH_DEADLINE = 2.0  # a probe's request is a few dozen bytes


def probe_app(ready: Callable[[], bool], not_ready: str = "not ready") -> Any:
    """``/healthz`` and ``/livez`` (alive: 200 while the process answers) and ``/readyz``
    (200 while ``ready()``, else 503 with ``not_ready``); anything else 404."""

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/livez", "/readyz"):
            ok = path != "/readyz" or bool(ready())
            body = b"ok\n" if ok else (not_ready + "\n").encode()
            status = "200 OK" if ok else "503 Service Unavailable"
        else:
            body, status = b"not found\n", "404 Not Found"
        start_response(status, [("Content-Type", "text/plain"),
                                ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve_health(port: int, addr: str, ready: Callable[[], bool] = lambda: True, *,
                 not_ready: str = "not ready") -> BoundedWSGIServer:
    """The probes' own listener (:func:`probe_app`): its slots are not the scrapes', its
    deadline is short, one source holds at most 4 of its 16 slots."""
    return serve(port, addr, probe_app(ready, not_ready), max_connections=16,
                 max_per_source=4, deadline=HEALTH_DEADLINE, name="health-http")
