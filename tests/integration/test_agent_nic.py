"""A real agent in a network namespace sees its link lose carrier and come back."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, Collector, popen, read_events, wait_for
from tests.netns import ip, namespaces, require_netns, veth


@pytest.fixture(autouse=True)
def _netns() -> None:
    require_netns()


def nic_faults(events: Path) -> list[dict]:  # type: ignore[type-arg]
    return [e for e in read_events(events) if e["event"] == "fault" and e["kind"] == "nic"]


def test_agent_reports_carrier_loss_and_recovery(tmp_path: Path) -> None:
    events = tmp_path / "ev.jsonl"
    with namespaces(2) as (ns_a, ns_b):
        veth(ns_a, "ftv0", ns_b, "ftv1")
        agent = popen(["ip", "netns", "exec", ns_a, PY, "-m", "ftagent", "run",
                       "--metrics-port=-1", "--nic", "ftv0", "--nic-grace", "0.3",
                       "--events-file", str(events), "--", "sleep", "120"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for(lambda: any(e.get("kind") == "running" for e in read_events(events)),
                     30, "agent running")
            # The watcher dumps links at start; give it the link before taking it down.
            err = Collector(agent.stderr)
            wait_for(lambda: b"watching links ftv0" in err, 30, "agent watching ftv0")
            ip("-n", ns_b, "link", "set", "ftv1", "down")  # peer down: carrier loss
            down = wait_for(lambda: nic_faults(events), 10, "nic fault")[0]
            assert down["device"] == "ftv0" and down["reason"] == "carrier_lost"
            assert down["scope"] == "pod"
            ip("-n", ns_b, "link", "set", "ftv1", "up")
            up = wait_for(lambda: [f for f in nic_faults(events) if f.get("recovered")], 10,
                          "nic recovery")[0]
            assert up["outage_seconds"] >= 0.3
            assert agent.poll() is None, "a NIC fault alone must not stop the trainer"
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=30)


def test_unnamed_link_deleted_beside_another_is_recorded_not_waited_for(
        tmp_path: Path) -> None:
    """No --nic, NCCL_ or GLOO_SOCKET_IFNAME: the agent watches every link up at start,
    another tenant's among them (on a shared host: a test's veth, another pod's). That one
    deleted while the job's link stays up is a WARNING (the arbiter records it and defers
    nothing); before, it was the ERROR whose 300 s wait for the link held the job's next
    crash (bench/restart.py, beside a CI run's lab drills)."""
    events = tmp_path / "ev.jsonl"
    with namespaces(2) as (ns_a, ns_b):
        veth(ns_a, "ftv0", ns_b, "ftv1")
        veth(ns_a, "ftd0", ns_b, "ftd1")  # someone else's link (the lab's, say)
        agent = popen(["ip", "netns", "exec", ns_a, PY, "-m", "ftagent", "run",
                       "--metrics-port=-1", "--nic-grace", "0.3",
                       "--events-file", str(events), "--", "sleep", "120"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            err = Collector(agent.stderr)
            wait_for(lambda: b"watching links ftd0, ftv0" in err, 30, "agent watching both")
            ip("-n", ns_a, "link", "del", "ftd0")
            (gone,) = wait_for(lambda: nic_faults(events), 10, "nic fault")
            assert gone["device"] == "ftd0" and gone["reason"] == "deleted"
            assert gone["severity"] == "warning" and gone["others_up"] == ["ftv0"]
            ip("-n", ns_b, "link", "set", "ftv1", "down")  # now every guessed link is down
            down = wait_for(lambda: [f for f in nic_faults(events)
                                     if f["device"] == "ftv0"], 10, "ftv0 fault")[0]
            assert down["severity"] == "error" and down["reason"] == "carrier_lost"
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=30)
