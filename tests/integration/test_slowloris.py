"""No pod can starve the probes (issue 33.3): slowloris against the real arbiter, webhook and
node agent processes.

The attack: many connections from many peer addresses (loopback has all of 127.0.0.0/8,
so each attacker socket binds its own source address, as pods of one tenant have their own
IPs), each sending one byte of a request every 0.3 s and never finishing it, reconnecting
whenever the server drops it. On the old code the arbiter's 32 metrics slots had a per-read
timeout of 5 s: 32 such connections held every slot and ``/healthz`` and ``/readyz``
answered 503 for the whole hold (the kubelet restarts the arbiter after 60 s). Now the
probes have a listener of their own (``--health-port``), every request a total deadline and
every source a cap: while the attack holds, each probe answers 200 within ``BOUND``
seconds. (On the old code these tests fail at once: there is no ``--health-port``.)
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ftagent.arbiter.process import ArbiterProcess
from tests.conftest import wait_for

BOUND = 2.0  # seconds a probe may take under attack (a loaded 2-core machine)
HOLD = 7.0  # seconds the attack holds: past the metrics server's 5 s request deadline
TRICKLE = 0.3  # seconds between two bytes of an attacker's request
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4096


class Trickle:
    """Slowloris: ``per_source`` connections from each of ``sources`` addresses to
    ``port``, one byte each every TRICKLE seconds, reconnecting when dropped."""

    def __init__(self, port: int, sources: list[str], per_source: int) -> None:
        self.port = port
        self.targets = [s for s in sources for _ in range(per_source)]
        self.socks: list[socket.socket | None] = [None] * len(self.targets)
        self.sent = [0] * len(self.targets)
        self.stop = threading.Event()
        self.held = 0  # connections open after the last round
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _connect(self, i: int) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(0.2)
        try:
            s.bind((self.targets[i], 0))
            s.connect(("127.0.0.1", self.port))
        except OSError:
            s.close()
            return
        self.socks[i], self.sent[i] = s, 0

    def _run(self) -> None:
        while not self.stop.is_set():
            held = 0
            for i in range(len(self.targets)):
                s = self.socks[i]
                if s is None:
                    self._connect(i)
                    continue
                try:
                    s.send(REQUEST[self.sent[i] % len(REQUEST):][:1])
                    self.sent[i] += 1
                    held += 1
                except OSError:
                    s.close()
                    self.socks[i] = None
            self.held = held
            self.stop.wait(TRICKLE)

    def __enter__(self) -> Trickle:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            if s is not None:
                s.close()


def sources(first: int, n: int) -> list[str]:
    return [f"127.0.0.{first + i}" for i in range(n)]


def probe(port: int, path: str, scheme: str = "http") -> tuple[int, float]:
    """(status, seconds) of one GET from 127.0.0.1, as the kubelet's probe."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}{path}", timeout=BOUND) as r:
            status = int(r.status)
    except urllib.error.HTTPError as e:
        status = int(e.code)
    except OSError:
        status = 0
    return status, time.monotonic() - t0


def probes_hold(port: int, paths: tuple[str, ...], seconds: float = HOLD) -> None:
    """Every probe in ``seconds`` answers 200 within BOUND."""
    bad = []
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        for path in paths:
            status, took = probe(port, path)
            n += 1
            if status != 200 or took > BOUND:
                bad.append((path, status, round(took, 2)))
        time.sleep(0.2)  # the kubelet's period is seconds; this is only the probe rate
    assert not bad, f"{len(bad)} of {n} probes failed under attack: {bad[:5]}"


def port_from(text: str, what: str) -> int:
    m = re.search(rf"{what} on http://[^:]+:(\d+)/", text)
    return int(m.group(1)) if m else 0


@pytest.fixture
def arbiter() -> Iterator[tuple[int, int]]:
    """A real arbiter: (metrics port, health port)."""
    with ArbiterProcess("--metrics-port", "0", "--metrics-addr", "127.0.0.1",
                        "--health-port", "0") as arb:
        ports = wait_for(lambda: (port_from(arb.log_text(), "metrics"),
                                  port_from(arb.log_text(), "probes"))
                         if port_from(arb.log_text(), "probes") else None,
                         20, "the arbiter's metrics and probe ports")
        yield ports


def test_arbiter_probes_answer_while_many_pods_trickle_into_metrics(
        arbiter: tuple[int, int]) -> None:
    """40 sources x 2 slow connections hold every /metrics slot: the probes, on their own
    listener, answer 200 within BOUND for the whole hold."""
    metrics, health = arbiter
    with Trickle(metrics, sources(2, 40), 2) as attack:
        wait_for(lambda: attack.held >= 32, 10, "the attack to hold the metrics slots")
        probes_hold(health, ("/healthz", "/readyz"))


def test_arbiter_probes_and_metrics_survive_one_source_trickling(
        arbiter: tuple[int, int]) -> None:
    """One source (one pod) with 40 slow connections to each port holds at most its share:
    a scrape from another address and every probe still answer 200."""
    metrics, health = arbiter
    with Trickle(metrics, ["127.0.0.2"], 40) as a, Trickle(health, ["127.0.0.3"], 40) as b:
        wait_for(lambda: a.held and b.held, 10, "both attacks to hold connections")
        probes_hold(health, ("/healthz", "/readyz"), 3.0)
        probes_hold(metrics, ("/metrics",), 3.0)


def test_a_trickled_request_loses_its_slot_at_the_deadline(
        arbiter: tuple[int, int]) -> None:
    """A request trickled a byte every 0.3 s is cut at the total deadline (5 s), not kept
    alive by each byte (the old timeout was per read)."""
    metrics, _ = arbiter
    s = socket.create_connection(("127.0.0.1", metrics), timeout=1)
    t0 = time.monotonic()
    try:
        for i in range(100):
            try:
                s.send(REQUEST[i:i + 1])
                if s.recv(1, socket.MSG_DONTWAIT) == b"":
                    break
            except BlockingIOError:
                pass
            except OSError:
                break
            time.sleep(TRICKLE)
    finally:
        s.close()
    took = time.monotonic() - t0
    assert took < 10, f"a trickling request was held {took:.1f}s (deadline 5 s)"


# --------------------------------------------------------------------------- webhook


@contextmanager
def webhook(tmp: Path, nofile: int) -> Iterator[tuple[int, int]]:
    """A real ``ftagent webhook`` with at most ``nofile`` file descriptors: (HTTPS port,
    probe port)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [sys.executable, "-m", "ftagent", "webhook", "--self-signed", "--listen",
         "127.0.0.1:0", "--health-port", "0", "--image", "ftagent:test",
         "--handshake-timeout", "5"],
        stderr=subprocess.PIPE, text=True, preexec_fn=limit)
    assert proc.stderr is not None
    try:
        text = ""
        while "listening on " not in text:
            line = proc.stderr.readline()
            assert line, text
            text += line
        yield int(text.rsplit(":", 1)[1]), port_from(text, "probes")
    finally:
        proc.terminate()
        proc.wait(10)


def test_webhook_probes_answer_while_its_port_is_flooded(tmp_path: Path) -> None:
    """320 slow connections from 40 sources against a webhook that may open 512 files:
    before, every descriptor went to the attack (accept() failed with EMFILE and nothing
    was answered, /healthz included); now the HTTPS port holds at most half the
    descriptors and the probes' own port answers 200 within BOUND."""
    with webhook(tmp_path, 512) as (https, health), Trickle(https, sources(2, 40), 8) as attack:
        wait_for(lambda: attack.held >= 50, 10, "the attack to hold connections")
        probes_hold(health, ("/healthz", "/readyz"))


# --------------------------------------------------------------------------- node agent


def test_node_agent_probe_answers_while_many_pods_trickle_into_metrics() -> None:
    """The node agent's port had the arbiter's shape (hostNetwork: any pod reaches it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftagent", "node", "--node", "node-1", "--gpu-backend",
         "none", "--nic", "none", "--metrics-port", "0", "--metrics-addr", "127.0.0.1",
         "--health-port", "0"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        text = ""
        while not (port_from(text, "probes") and port_from(text, "metrics")):
            line = proc.stderr.readline()
            assert line, text
            text += line
        metrics, health = port_from(text, "metrics"), port_from(text, "probes")
        with Trickle(metrics, sources(2, 40), 2) as attack:
            wait_for(lambda: attack.held >= 32, 10, "the attack to hold the metrics slots")
            probes_hold(health, ("/healthz",))
    finally:
        proc.terminate()
        proc.wait(10)
