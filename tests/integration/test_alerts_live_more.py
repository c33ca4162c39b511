"""More of the shipped alerts, live (issue 32.4): the NIC alerts, under a real Prometheus
scraping a real agent that watches a real link.

The agent runs in a network namespace of its own with one end of a veth pair; the test
takes the other end down and up. Prometheus runs in the same namespace (it scrapes the
agent on that namespace's loopback) and the test reads its API with ``curl`` run there.
The rules are the test copy of test_alerts_live.py (every ``for:`` 2 s, every window 20 s).
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, Collector, free_port, popen, wait_for
from tests.integration.test_alerts_live import Prometheus
from tests.netns import ip, namespaces, require_netns, veth

pytestmark = pytest.mark.skipif(
    subprocess.run(["sh", "-c", "command -v prometheus && command -v curl"],
                   capture_output=True).returncode != 0,
    reason="prometheus or curl missing: `make deps` installs them")

NIC = ("FtagentNicDown", "FtagentNicFlapping")


def test_the_nic_alerts_fire_and_resolve_on_a_real_link(tmp_path: Path) -> None:
    require_netns()
    with namespaces(2) as (ns_a, ns_b):
        veth(ns_a, "ftv0", ns_b, "ftv1")
        ip("-n", ns_a, "link", "set", "lo", "up")
        port = free_port()
        agent = popen(["ip", "netns", "exec", ns_a, PY, "-m", "ftagent", "run",
                       "--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
                       "--job", "nic", "--rank", "0", "--world-size", "1",
                       "--nic", "ftv0", "--nic-grace", "1", "--nic-poll-interval", "0.2",
                       "--", "sleep", "300"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        prom = Prometheus(tmp_path, {"ftagent-agents": ("default", port)}, netns=ns_a)
        try:
            err = Collector(agent.stderr)
            wait_for(lambda: b"watching links ftv0" in err, 60, "the agent watching ftv0")

            def up() -> bool:
                got = prom.get("/api/v1/query?query=ftagent_nic_up")
                return bool(got and got["result"])

            wait_for(up, 60, "Prometheus scraping the agent's NIC series")
            assert not prom.active() & set(NIC), prom.active()

            ip("-n", ns_b, "link", "set", "ftv1", "down")  # the peer: carrier lost
            wait_for(lambda: "FtagentNicDown" in prom.alerts(), 30, "FtagentNicDown to fire")
            ip("-n", ns_b, "link", "set", "ftv1", "up")
            wait_for(lambda: "FtagentNicDown" not in prom.active(), 30,
                     "FtagentNicDown to resolve")

            for n in range(1, 8):  # down/up, each shorter than --nic-grace: a flap
                ip("-n", ns_b, "link", "set", "ftv1", "down")
                ip("-n", ns_b, "link", "set", "ftv1", "up")
                wait_for(lambda n=n: f", flap {n}\n".encode() in err, 30, f"flap {n}")
            wait_for(lambda: "FtagentNicFlapping" in prom.alerts(), 30,
                     "FtagentNicFlapping to fire")
            wait_for(lambda: not prom.active() & set(NIC), 60,
                     "the NIC alerts to resolve (the flaps leave the window)")
            assert agent.poll() is None
        finally:
            prom.stop()
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=30)
