"""/metrics and /healthz servers hold a bounded number of connections and threads."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from ftagent import metrics_http
from ftagent.cmd.arbiter import _http_app, _serve_http
from tests.conftest import wait_for

IDLE = 150  # idle connections a peer opens: a thread each before


def arbiter_http(registry: CollectorRegistry) -> Any:
    return _serve_http(0, "127.0.0.1", _http_app(registry, lambda: True))


def agent_http(registry: CollectorRegistry) -> Any:
    return metrics_http.start_http_server(0, "127.0.0.1", registry=registry)[0]


@pytest.mark.parametrize("start", [arbiter_http, agent_http], ids=["arbiter", "agent"])
def test_idle_connections_cannot_start_a_thread_each(
        start: Callable[[CollectorRegistry], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20: every connection to /metrics started a thread that lived as long as the
    peer kept the socket open (150 idle sockets: 150 threads). Now at most
    MAX_CONNECTIONS are served; the rest are answered 503 and closed at once."""
    # the idle ones keep their slots for the test (a slot is freed after IDLE_TIMEOUT)
    monkeypatch.setattr(metrics_http, "IDLE_TIMEOUT", 60.0)
    registry = CollectorRegistry()
    Counter("ftagent_test_total", "a series", registry=registry).inc()
    before = threading.active_count()
    httpd = start(registry)
    port = httpd.server_port
    socks = []
    try:
        for _ in range(IDLE):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        wait_for(lambda: httpd.refused >= IDLE - metrics_http.MAX_CONNECTIONS, 30,
                 "the connections past the bound to be refused")
        threads = threading.active_count() - before
        assert threads <= metrics_http.MAX_CONNECTIONS + 2, threads
        refused = socks[-1].recv(200)
        assert refused.startswith(b"HTTP/1.1 503"), refused
        with pytest.raises(urllib.error.HTTPError) as e:  # every slot is held
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert e.value.code == 503
        for s in socks:
            s.close()
        socks.clear()

        def scraped() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=5) as r:
                    return b"ftagent_test_total 1.0" in r.read()
            except urllib.error.HTTPError:
                return False  # slots still being released

        wait_for(scraped, 10, "a scrape once the idle peers left")
    finally:
        for s in socks:
            s.close()
        httpd.shutdown()
        httpd.server_close()
