"""/metrics over HTTP with a bounded number of connections (and threads).

prometheus_client's ``start_http_server`` starts a thread for every connection and keeps
it as long as the peer keeps the socket open: any peer that can reach the port could
hold thousands of threads (issue 20). Here at most ``MAX_CONNECTIONS`` requests are
served at once; a connection past that is answered ``503`` at once and closed by the
accepting thread, and a socket that sends nothing for ``IDLE_TIMEOUT`` seconds loses its
slot. A scrape takes milliseconds, so the slots are there for Prometheus, the kubelet's
probes and a person with curl; what a peer holding every slot can still do is delay
them by ``IDLE_TIMEOUT`` (the Service's NetworkPolicy decides who may connect at all).
"""

from __future__ import annotations

import sys
import threading
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler

MAX_CONNECTIONS = 32
IDLE_TIMEOUT = 5.0
_BUSY_BODY = b"busy: too many connections\n"
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
        b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s"
        % (len(_BUSY_BODY), _BUSY_BODY))


class BoundedWSGIServer(ThreadingWSGIServer):
    """A thread per request, at most ``max_connections`` at once."""

    max_connections = MAX_CONNECTIONS
    request_queue_size = 128  # the listen backlog: a burst of scrapes waits, not drops

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.refused = 0  # connections answered 503 (all slots taken)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
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
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that went quiet or away is routine here: no traceback on stderr."""
        if not isinstance(sys.exc_info()[1], OSError):  # TimeoutError, resets, pipes
            super().handle_error(request, client_address)


def serve(port: int, addr: str, app: Any, *,
          max_connections: int = MAX_CONNECTIONS) -> BoundedWSGIServer:
    """Serve the WSGI ``app`` on ``addr:port`` in a daemon thread; raises OSError when the
    port cannot be bound. ``shutdown()`` and ``server_close()`` stop it."""

    class Server(BoundedWSGIServer):  # address_family is per class (IPv4 or IPv6)
        pass

    class Handler(_SilentHandler):
        timeout = IDLE_TIMEOUT  # of each read: a peer that sends nothing loses its slot

    Server.max_connections = max(1, max_connections)
    Server.address_family, host = _get_best_family(addr, port)
    httpd = make_server(host, port, app, Server, handler_class=Handler)
    assert isinstance(httpd, BoundedWSGIServer)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics-http").start()
    return httpd


def start_http_server(port: int, addr: str = "0.0.0.0",
                      registry: CollectorRegistry | None = None
                      ) -> tuple[BoundedWSGIServer, None]:
    """prometheus_client's ``start_http_server``, with bounded connections: the same
    arguments, the server first in what it returns."""
    from prometheus_client import REGISTRY

    return serve(port, addr, make_wsgi_app(registry or REGISTRY)), None
