"""No rank's metrics port is one of ftagent's own (issue 32): with hostNetwork, a rank given
the node agent's host port (9432) fits on no node that runs the node agent, so the rank is
never scheduled. The ranks' range (the webhook's defaults) and every default port of the
arbiter, the node agent and the webhook are compared, as the command-line parsers give
them, not as this test restates them."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Any

import jsonpatch

from ftagent.cmd import arbiter, node, webhook
from ftagent.config import split_host_port
from ftagent.kube.inject import (
    MAX_PORT_SPAN,
    OWN_PORTS,
    PORT_NAME,
    Settings,
    clashing_ports,
    metrics_port_for,
    mutate,
)
from tests.conftest import ROOT
from tests.webhook_pods import example_pods


def own_ports() -> set[int]:
    """Every port ftagent's own processes listen on by default."""
    a = arbiter.parse([], {})
    n = node.parse([], {"NODE_NAME": "gpu-1"})
    w = webhook.parse(["--self-signed"], {})
    return {split_host_port(a.listen)[1], a.metrics_port, n.node.metrics_port,
            split_host_port(w.listen)[1]}


def rank_ports(s: Settings) -> set[int]:
    """Every port the webhook can give a rank (hostNetwork or not) before stepping past a
    port the pod's own containers declare."""
    span = max(1, min(s.metrics_port_span, MAX_PORT_SPAN))
    return set(range(s.metrics_port, s.metrics_port + span))


def webhook_settings() -> Settings:
    w = webhook.parse(["--self-signed"], {})
    return Settings(metrics_port=w.metrics_port, metrics_port_span=w.metrics_port_span)


def test_the_ranks_range_holds_none_of_ftagents_own_ports() -> None:
    s = webhook_settings()
    assert s.metrics_port == Settings().metrics_port  # the webhook's flag and the library agree
    own = own_ports()
    assert {9400, 9431, 9432, 8443} <= own  # what docs/deploy.md's port table says
    assert rank_ports(s).isdisjoint(own)
    # the documented block for ftagent's own ports, clear of the ranks' range
    assert own - {8443} <= set(range(9400, 9440)) and min(rank_ports(s)) >= 9440


def test_no_16_rank_job_has_an_unschedulable_rank() -> None:
    """The issue's figure: with the ranks' range over the node agent's host port, about one
    16-rank hostNetwork job in six had a rank on 9432. Now none, for any job name."""
    s = webhook_settings()
    own = own_ports()
    clashing = [j for j in range(3000)
                if own & {metrics_port_for("ml", f"job-{j}", r, s) for r in range(16)}]
    assert clashing == []
    # the old layout (9430-9529), for the record: the figure the issue measured
    old = Settings(metrics_port=9430, metrics_port_span=100)
    old_clashing = [j for j in range(3000)
                    if own & {metrics_port_for("ml", f"job-{j}", r, old) for r in range(16)}]
    # 16 consecutive ports of 100 (mod 100) cover 9431 or 9432 from 17 of 100 starts
    assert 0.13 < len(old_clashing) / 3000 < 0.21


def _declared(pod: dict[str, Any]) -> int:
    return next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]
                if p["name"] == PORT_NAME)


def test_injected_host_network_pods_get_a_port_of_the_range() -> None:
    s = webhook_settings()
    pods = [p for p in example_pods() if p.pod["spec"].get("hostNetwork")]
    assert pods
    own = own_ports()
    for ex in pods:
        m = mutate(copy.deepcopy(ex.pod), "ml", s)
        pod = jsonpatch.apply_patch(ex.pod, m.patch)
        port = _declared(pod)
        assert port in rank_ports(s) and port not in own
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)


def test_own_ports_cover_every_default_and_the_webhook_warns_of_a_clash() -> None:
    """OWN_PORTS (what the webhook warns about) holds every default of the parsers but the
    webhook's HTTPS port (8443: never a host port); the old layout is named a clash."""
    assert own_ports() - {8443} <= set(OWN_PORTS)
    assert clashing_ports(webhook_settings()) == []
    assert clashing_ports(Settings(metrics_port=9430, metrics_port_span=100)) == \
        list(range(9430, 9440))
    proc = subprocess.Popen([sys.executable, "-m", "ftagent", "webhook", "--self-signed",
                             "--listen", "127.0.0.1:0", "--agent-metrics-port", "9430"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # ends at "listening on" (or at exit: then it failed)
            lines.append(line)
            if "listening on" in line:
                break
        warned = [x for x in lines if "warning: --agent-metrics-port 9430" in x]
        assert len(warned) == 1 and "9430-9439" in warned[0], lines
        assert "listening on" in lines[-1], lines  # a warning, the webhook still serves
    finally:
        proc.terminate()
        proc.wait(timeout=30)
