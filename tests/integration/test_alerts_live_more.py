"""More of the shipped alerts, live (issue 32.4), each under a real Prometheus scraping
real processes on loopback, with the test copy of the rules of test_alerts_live.py (every
``for:`` 2 s, every window and ``offset`` 20 s; 10 s for the job alerts, whose counts come
in bursts).

* The NIC alerts: a real agent watches one end of a veth pair in a network namespace of
  its own; the test takes the other end down and up. Prometheus runs in that namespace (it
  scrapes the agent on the namespace's loopback) and the test reads its API with ``curl``
  run there.
* The job alerts: a real arbiter and real agents (a job waiting for a rank, a job stopped
  by a crash with no restart left, a crash and a restart, calls with a wrong token).
* Training pods without an agent: ``ftagent arbiter --kube`` against the fake API server.
"""

from __future__ import annotations

import contextlib
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


def flap(ns: str, link: str, err: Collector, line: bytes) -> None:
    """Down and up at once, until the agent has seen it. The kernel's linkwatch folds a
    peer's carrier changes (it runs them at most once a second), so a down/up pair can
    reach the other end as no change at all: one in 7 did on a loaded machine. Another
    pair is then flapped; the agent counting one flap per pair it saw is what is tested."""
    for _ in range(5):
        ip("-n", ns, "link", "set", link, "down")
        ip("-n", ns, "link", "set", link, "up")
        with contextlib.suppress(AssertionError):
            wait_for(lambda: line in err, 6, line.decode().strip())
            return
    raise AssertionError(f"timed out waiting for {line.decode().strip()!r} (5 down/up pairs)")


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
                flap(ns_b, "ftv1", err, f", flap {n}\n".encode())
            wait_for(lambda: "FtagentNicFlapping" in prom.alerts(), 30,
                     "FtagentNicFlapping to fire")
            wait_for(lambda: not prom.active() & set(NIC), 60,
                     "the NIC alerts to resolve (the flaps leave the window)")
            assert agent.poll() is None
        finally:
            prom.stop()
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=30)


SECRET = "alerts-t0ken-0123456789"
JOBS = ("FtagentJobNotTraining", "FtagentJobStopped", "FtagentArbiterRejectingRequests",
        "FtagentTimeLostToFaults")
# A trainer that steps until its file says "exit" (then exits 0), exits 2 at once when
# it says "crash", and once (its first start) when it says "crash-once".
STEPPER = (
    "import os, sys, time\n"
    "while True:\n"
    "    m = open(sys.argv[1]).read().strip()\n"
    "    if m == 'crash' or m == 'crash-once' and not os.path.exists(sys.argv[1] + '.1'):\n"
    "        open(sys.argv[1] + '.1', 'w').close()\n"
    "        sys.exit(2)\n"
    "    if m == 'exit':\n"
    "        sys.exit(0)\n"
    "    print('step=1 loss=1.0', flush=True)\n"
    "    time.sleep(0.2)\n")


def test_the_job_alerts_fire_and_resolve_on_a_real_arbiter(tmp_path: Path) -> None:
    """FtagentJobNotTraining (a job whose second rank has not come: "starting"),
    FtagentJobStopped (a crash with no restart left: the arbiter stops the job; a new run
    resolves it), FtagentTimeLostToFaults (a crash and a restart; its budget of an hour a
    day at 0 s in the test copy: THRESHOLDS) and FtagentArbiterRejectingRequests (calls
    with a wrong token), from a real arbiter and real agents."""
    import grpc

    from ftagent.arbiter.process import ArbiterProcess
    from ftagent.v1 import ftagent_pb2 as pb
    from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
    from ftagent.wire.credentials import bearer

    metrics = free_port()
    arbiter = ArbiterProcess("--token", SECRET, "--metrics-port", str(metrics),
                             "--metrics-addr", "127.0.0.1")
    address = ""  # once started, below
    agents: list[subprocess.Popen[bytes]] = []

    def agent(job: str, rank: int, world: int, mode: Path, *flags: str) -> None:
        agents.append(popen([PY, "-m", "ftagent", "run", "--metrics-port=-1",
                             "--arbiter", address, "--token", SECRET, "--job", job,
                             "--rank", str(rank), "--world-size", str(world), *flags,
                             "--", PY, "-c", STEPPER, str(mode)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    # 10 s windows: the 8 rejections come in a burst, the time lost at one crash.
    # Prometheus first: its first scrape comes about 5 s after it starts (its target
    # discovery's update period), the arbiter starts meanwhile
    prom = Prometheus(tmp_path, {"ftagent-arbiter": ("ftagent-system", metrics)},
                      window="10s")
    try:
        address = arbiter.start()
        wait_for(lambda: (prom.get("/api/v1/query?query=up") or {}).get("result"), 60,
                 "the arbiter scraped")
        steps = tmp_path / "steps"
        steps.write_text("run")
        agent("nt", 0, 2, steps)  # rank 1 of 2 does not come yet
        wait_for(lambda: "FtagentJobNotTraining" in prom.alerts(), 60,
                 "FtagentJobNotTraining to fire (starting)")
        agent("nt", 1, 2, steps)
        wait_for(lambda: "FtagentJobNotTraining" not in prom.active(), 60,
                 "FtagentJobNotTraining to resolve (running)")

        crash = tmp_path / "crash"
        crash.write_text("crash")
        agent("st", 0, 1, crash, "--max-restarts", "0")
        wait_for(lambda: "FtagentJobStopped" in prom.alerts(), 60,
                 "FtagentJobStopped to fire")
        wait_for(lambda: agents[-1].poll() is not None, 30, "the stopped run's agent gone")
        agent("st", 0, 1, steps)  # a new run of the job
        wait_for(lambda: "FtagentJobStopped" not in prom.active(), 60,
                 "FtagentJobStopped to resolve (a new run)")

        lost = tmp_path / "lost"
        lost.write_text("run")
        agent("tl", 0, 1, lost, "--max-restarts", "3")
        wait_for(lambda: (prom.get('/api/v1/query?query=ftagent_job_seconds_lost_to_faults_total'
                                   '{job_name="tl"}') or {}).get("result"), 60,
                 "the job's time lost scraped before its crash")
        lost.write_text("crash-once")
        wait_for(lambda: "FtagentTimeLostToFaults" in prom.alerts(), 60,
                 "FtagentTimeLostToFaults to fire")
        lost.write_text("run")

        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ArbiterStub(ch)
            for _ in range(8):
                with pytest.raises(grpc.RpcError):
                    stub.ListJobs(pb.ListJobsRequest(), metadata=bearer("wrong"), timeout=5)
        wait_for(lambda: "FtagentArbiterRejectingRequests" in prom.alerts(), 60,
                 "FtagentArbiterRejectingRequests to fire")
        steps.write_text("exit")  # every run ends well: succeeded
        lost.write_text("exit")
        wait_for(lambda: all(a.poll() is not None for a in agents), 60, "the agents done")
        wait_for(lambda: not prom.active() & set(JOBS), 60,
                 "the job alerts to resolve (the rejections leave the window)")
    finally:
        prom.stop()
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)
                a.wait(timeout=30)
        arbiter.stop()


def test_pods_without_agent_fires_and_resolves_on_a_real_arbiter(tmp_path: Path) -> None:
    """FtagentTrainingPodsWithoutAgent: ``ftagent arbiter --kube`` against the fake API
    server; an injected, running training pod whose agent never connects (its image could
    not start it) is counted after ``--agent-connect-grace``; the alert resolves once the
    pod is gone."""
    pytest.importorskip("kubernetes")
    from ftagent.arbiter.process import ArbiterProcess
    from tests.integration.test_kube_agent_skipped import ENV, _injected
    from tests.kube_fake import FakeKube

    ns, metrics = "team", free_port()
    with FakeKube() as fake:
        fake.create("namespaces", {"metadata": {"name": ns, "labels": {
            "ftagent.io/inject": "true"}}})
        fake.add_node("n1")
        _injected(fake, ns, "lonely-0", node="n1", labels={"ftagent.io/inject": "true"},
                  containers=[{"name": "pytorch", "image": "t", "env": list(ENV)}])
        arbiter = ArbiterProcess("--kube", "--kube-api", fake.url, "--token", SECRET,
                                 "--metrics-port", str(metrics), "--metrics-addr", "127.0.0.1",
                                 "--agent-connect-grace", "2",
                                 env={"POD_NAMESPACE": "ftagent-system"})
        arbiter.start()
        prom = Prometheus(tmp_path, {"ftagent-arbiter": ("ftagent-system", metrics)})
        try:
            wait_for(lambda: "FtagentTrainingPodsWithoutAgent" in prom.alerts(), 90,
                     "FtagentTrainingPodsWithoutAgent to fire")
            fake.delete("pods", "lonely-0", ns)
            wait_for(lambda: "FtagentTrainingPodsWithoutAgent" not in prom.active(), 90,
                     "FtagentTrainingPodsWithoutAgent to resolve (the pod gone)")
        finally:
            prom.stop()
            arbiter.stop()
