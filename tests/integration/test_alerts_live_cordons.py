"""The last five shipped alerts, live (issue 32.4): each fires and resolves under a real
Prometheus scraping a real arbiter on loopback, with the test copy of the rules of
test_alerts_live.py (every ``for:`` 2 s, every window and ``offset`` 20 s, 10 s for the
cordon alerts; nothing else shortened here), so each resolves by time once its window has
passed.

* FtagentStraggler: a real arbiter (``--straggler-window 2``) and two real agents whose
  trainers log steps at different rates (no collectives: compute is the whole step time);
  the slow one speeds up and the alert resolves.
* FtagentNodeCordoned, FtagentManyCordons, FtagentCordonBreakerOpen,
  FtagentArbiterActionsFailing: ``ftagent arbiter --kube`` against the fake API server,
  four nodes each running a one-rank job (a gRPC link with its pod's projected token, as
  the agent presents it) and a real node agent (``ftagent node`` with the simulated GPU
  backend) reporting a fatal Xid 79 with its node's own token: node-scope evidence. n1-n3
  are cordoned (three cordons: NodeCordoned per node, ManyCordons' ``>= 3``); the fake API
  server answers 500 (the real API server's Status body) to the deletion of n1's pod, so
  that action fails after the actuator's retries (ActionsFailing, action=delete_pod); with
  ``--max-confirmed-cordons 3`` the breaker then refuses n4's cordon (CordonBreakerOpen).
  (A failed *cordon* would do for ActionsFailing too, but the breaker counts a cordon it
  allowed for 60 s even when its write failed, which would make the breaker's refusal of
  the next node depend on timing; a failed deletion leaves the breaker's count alone.)
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ftagent.arbiter.process import ArbiterProcess
from tests.conftest import PY, free_port, popen, wait_for
from tests.integration.test_alerts_live import Prometheus

pytestmark = pytest.mark.skipif(
    subprocess.run(["sh", "-c", "command -v prometheus"], capture_output=True).returncode != 0,
    reason="prometheus missing: `make deps` installs Debian's prometheus package")

SECRET = "alerts-t0ken-0123456789"
# A trainer that logs a step every N seconds, N read from its file before each step.
PACED = (
    "import sys, time\n"
    "n = 0\n"
    "while True:\n"
    "    n += 1\n"
    "    print(f'step={n} loss=1.0', flush=True)\n"
    "    time.sleep(float(open(sys.argv[1]).read()))\n")


def test_the_straggler_alert_fires_and_resolves_on_a_real_arbiter(tmp_path: Path) -> None:
    """FtagentStraggler: rank 1 steps 4x slower than rank 0 for longer than
    ``--straggler-window`` (2 s): named, the alert fires; it speeds up: no longer slow,
    ``ftagent_rank_straggler`` gone, the alert resolves."""
    metrics = free_port()
    arbiter = ArbiterProcess("--token", SECRET, "--metrics-port", str(metrics),
                             "--metrics-addr", "127.0.0.1", "--straggler-window", "2")
    pace = [tmp_path / "pace0", tmp_path / "pace1"]
    pace[0].write_text("0.05")
    pace[1].write_text("0.2")
    # Prometheus first: its first scrape comes about 5 s after it starts (its target
    # discovery's update period), the arbiter and the agents start meanwhile
    prom = Prometheus(tmp_path, {"ftagent-arbiter": ("ftagent-system", metrics)})
    agents: list[subprocess.Popen[bytes]] = []
    try:
        address = arbiter.start()
        agents += [popen([PY, "-m", "ftagent", "run", "--metrics-port=-1", "--arbiter",
                          address, "--token", SECRET, "--job", "slow", "--rank", str(r),
                          "--world-size", "2", "--node", f"node-{r}", "--", PY, "-c", PACED,
                          str(pace[r])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for r in range(2)]
        wait_for(lambda: "FtagentStraggler" in prom.alerts(), 60,
                 "FtagentStraggler to fire (rank 1 at a quarter of rank 0's rate)")
        got = prom.get("/api/v1/alerts")["alerts"]
        named = {a["labels"]["rank"] for a in got
                 if a["labels"]["alertname"] == "FtagentStraggler"}
        assert named == {"1"}, got
        pace[1].write_text("0.05")
        wait_for(lambda: "FtagentStraggler" not in prom.active(), 60,
                 "FtagentStraggler to resolve (rank 1 as fast as rank 0)")
        assert all(a.poll() is None for a in agents)
    finally:
        prom.stop()
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)
                a.wait(timeout=30)
        arbiter.stop()


CORDONS = ("FtagentNodeCordoned", "FtagentManyCordons", "FtagentCordonBreakerOpen",
           "FtagentArbiterActionsFailing")


def test_the_cordon_alerts_fire_and_resolve_on_a_real_kube_arbiter(tmp_path: Path) -> None:
    pytest.importorskip("kubernetes")
    from ftagent.agent.reporter import ArbiterLink
    from ftagent.config import ArbiterClientConfig, IdentityConfig
    from tests.arbiter_helpers import wait_until
    from tests.integration.test_arbiter_kube_identity import ARBITER_NS, NS, _pod
    from tests.kube_fake import FakeKube

    nodes = [f"n{i}" for i in range(1, 5)]
    metrics = free_port()
    gpu = tmp_path / "gpu.txt"
    gpu.write_text("gpus 2\nt=1s gpu=1 xid=79\n")
    with FakeKube() as fake:
        for n in nodes:
            fake.add_node(n)
            _pod(fake, f"{n}-job-0", f"{n}-job", n, rank=0, world=1)
            fake.add_pod(ARBITER_NS, f"node-agent-{n}", node=n)
        # the deletion of n1's pod fails as a broken API server answers (a Status, 500)
        fake.fail("delete", "pods", 500, times=None, namespace=NS, name="n1-job-0")
        arbiter = ArbiterProcess("--kube", "--kube-api", fake.url, "--token", SECRET,
                                 "--metrics-port", str(metrics), "--metrics-addr", "127.0.0.1",
                                 "--max-cordon-fraction", "1", "--max-confirmed-cordons", "3",
                                 env={"POD_NAMESPACE": ARBITER_NS})
        # 10 s windows: the three cordons come within a few seconds of each other;
        # Prometheus first (its first scrape comes ~5 s after its start), then the arbiter
        prom = Prometheus(tmp_path, {"ftagent-arbiter": (ARBITER_NS, metrics)}, window="10s")
        address = ""  # once started, below
        node_agents: list[subprocess.Popen[bytes]] = []

        def node_agent(n: str) -> None:
            tok = fake.token_file(tmp_path / f"node-{n}", ARBITER_NS, f"node-agent-{n}",
                                  service_account="ftagent-node")
            node_agents.append(popen(
                [PY, "-m", "ftagent", "node", "--metrics-port", "-1", "--node", n,
                 "--arbiter", address, "--token-file", str(tok),
                 "--gpu-backend", f"simulated:{gpu}", "--nic", "none",
                 "--report-interval", "0.5"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def node(n: str) -> dict[str, Any]:
            return dict(fake.get("nodes", n) or {})

        def cordoned(n: str) -> bool:
            return bool((node(n).get("spec") or {}).get("unschedulable"))

        def counter(name: str) -> float:
            got = prom.get(f"/api/v1/query?query=sum({name})")
            return float(got["result"][0]["value"][1]) if got and got["result"] else -1.0

        async def body() -> None:
            links = []
            for n in nodes:
                path = fake.token_file(tmp_path / f"pod-{n}", NS, f"{n}-job-0",
                                       service_account="trainer")
                links.append(ArbiterLink(
                    ArbiterClientConfig(arbiter=address, token_file=str(path)),
                    IdentityConfig(job=f"{n}-job", namespace=NS, rank=0, world_size=1,
                                   pod=f"{n}-job-0", node=n)))
            tasks = [asyncio.create_task(link.run()) for link in links]
            try:
                await wait_until(lambda: all(link.connected for link in links), 60,
                                 "every rank registered with its pod's token")
                await wait_until(lambda: counter("ftagent_arbiter_cordons_skipped_total") == 0,
                                 60, "Prometheus scraping the arbiter's cordon counters")
                assert not prom.active() & set(CORDONS), prom.active()
                for n in nodes[:3]:
                    node_agent(n)
                await wait_until(lambda: all(cordoned(n) for n in nodes[:3]), 60,
                                 "n1, n2, n3 cordoned on their node agents' Xid 79")
                await wait_until(lambda: {"FtagentNodeCordoned", "FtagentManyCordons",
                                          "FtagentArbiterActionsFailing"} <= prom.alerts(),
                                 60, "NodeCordoned, ManyCordons and ActionsFailing to fire",
                                 interval=0.5)
                got = prom.get("/api/v1/alerts")["alerts"]
                assert {a["labels"]["node"] for a in got
                        if a["labels"]["alertname"] == "FtagentNodeCordoned"} \
                    == set(nodes[:3]), got
                assert {a["labels"]["action"] for a in got
                        if a["labels"]["alertname"] == "FtagentArbiterActionsFailing"} \
                    == {"delete_pod"}, got
                assert any(q.code == 500 and q.verb == "delete" and q.name == "n1-job-0"
                           for q in fake.requests)
                node_agent("n4")  # three held: the breaker is full
                await wait_until(lambda: "FtagentCordonBreakerOpen" in prom.alerts(), 60,
                                 "FtagentCordonBreakerOpen to fire (n4's cordon skipped)",
                                 interval=0.5)
                assert not cordoned("n4")
                await wait_until(lambda: not prom.active() & set(CORDONS), 90,
                                 "the cordon alerts to resolve (their windows passed)",
                                 interval=0.5)
            finally:
                for link in links:
                    await link.close()
                await asyncio.gather(*tasks, return_exceptions=True)

        try:
            address = arbiter.start()
            asyncio.run(body())
        finally:
            prom.stop()
            for p in node_agents:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
            arbiter.stop()


def test_every_shipped_alert_is_driven_by_a_live_test() -> None:
    """Issue 32's Done-when kept: an alert added to the shipped rules without a live test
    (its name, quoted, in one of the live test files) fails here, and docs/alerts.md's
    table names every alert."""
    import yaml

    from tests.integration.test_alerts_live import ROOT, RULES

    rules = yaml.safe_load(RULES.read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    here = Path(__file__).parent
    text = "".join((here / f).read_text() for f in (
        "test_alerts_live.py", "test_alerts_live_more.py", "test_alerts_live_cordons.py"))
    assert not {n for n in names if f'"{n}"' not in text}, "alerts with no live test"
    doc = (ROOT / "docs" / "alerts.md").read_text()
    table = doc.split("**Live, under a real Prometheus.**", 1)[1].split("**The first", 1)[0]
    assert not {n for n in names if n not in table}, "alerts missing from the live table"
