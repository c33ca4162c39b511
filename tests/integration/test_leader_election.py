"""Leader election with real arbiter processes (``--leader-elect``) on one Lease in the fake
API server, each with its own Pod there (POD_NAME), real agents (ArbiterLinks) behind a
"Service": a TCP proxy that, like kube-proxy, sends each new connection to a pod the shipped
Service selects (the app label and the leader's label ``ftagent.io/arbiter-leader``) and
that is Ready (/readyz 200). Every replica is Ready when it can serve; the leader labels its
own pod. One acts; the standby refuses agents; SIGKILL the leader and the other takes over
within the lease duration, the agents re-register, and a fault decided afterwards reaches
every agent. A leader that cannot renew stops acting. A scripted rollout (new replica
Ready, old one SIGTERMed, twice) and a drain of the leader's node (an eviction through the
API with the shipped PodDisruptionBudget) complete, and no job is restarted by them."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import kubernetes
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ftagent.kube.leader_label import LABEL
from ftagent.model import ActionKind, Fault, FaultKind
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from tests.arbiter_helpers import ArbiterProcess, running_links, wait_until
from tests.kube_fake import FakeKube

NS = "ftagent-system"
APP = {"app.kubernetes.io/name": "ftagent-arbiter"}
MANIFEST = Path(__file__).resolve().parents[2] / "deploy/components/arbiter/arbiter.yaml"
LEASE = "ftagent-arbiter"
LEASES = "leases.coordination.k8s.io"
# Short settings so the test is quick: take-over within DURATION of the leader's death.
DURATION, DEADLINE, RETRY = 3.0, 2.0, 0.5


def must(obj: dict[str, Any] | None) -> dict[str, Any]:
    assert obj is not None, "no such object in the fake API server"
    return obj


def shipped(kind: str) -> dict[str, Any]:
    """The arbiter component's object of ``kind`` (the Service, the PDB) as shipped."""
    return next(o for o in yaml.safe_load_all(MANIFEST.read_text()) if o["kind"] == kind)


def election_args(url: str, duration: float = DURATION, deadline: float = DEADLINE,
                  retry: float = RETRY) -> list[str]:
    return ["--leader-elect", "--kube-api", url, "--leader-elect-namespace", NS,
            "--leader-elect-lease", LEASE, "--leader-elect-lease-duration", str(duration),
            "--leader-elect-renew-deadline", str(deadline),
            "--leader-elect-retry-period", str(retry),
            "--metrics-port", "0", "--metrics-addr", "127.0.0.1", "--health-port", "0"]


def port_of(arb: ArbiterProcess, what: str) -> int:
    """The port the arbiter says it serves ``what`` ("metrics", "probes") on."""
    deadline = time.monotonic() + 20
    while True:
        m = re.search(rf"{what} on http://[^:]+:(\d+)/", arb.log_path.read_text(errors="replace"))
        if m:
            return int(m.group(1))
        assert time.monotonic() < deadline, arb.log_text()
        time.sleep(0.02)


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


class Arbiter:
    """One replica: its pod in the fake API server, its process, gRPC, metrics and probe
    ports."""

    def __init__(self, fake: FakeKube, pod: str, *args: str) -> None:
        self.fake, self.pod = fake, pod
        fake.add_pod(NS, pod, labels=dict(APP), node=f"node-{pod}")
        self.proc = ArbiterProcess(*args, env={"POD_NAME": pod, "POD_NAMESPACE": NS})
        self.metrics = self.health = 0

    def start(self) -> Arbiter:
        self.proc.start()
        self.metrics = port_of(self.proc, "metrics")
        self.health = port_of(self.proc, "probes")
        return self

    @property
    def address(self) -> str:
        return self.proc.address

    def running(self) -> bool:
        return self.proc.proc is not None and self.proc.proc.poll() is None

    def ready(self) -> bool:
        """What the kubelet's readiness probe sees (the shipped probe: /readyz, health)."""
        return self.running() and http_status(self.health, "/readyz") == 200

    def labels(self) -> dict[str, str]:
        pod = self.fake.get("pods", self.pod, NS)
        return dict((pod or {}).get("metadata", {}).get("labels") or {})

    def endpoint(self) -> bool:
        """An endpoint of the shipped Service: a pod it selects, not terminating, Ready."""
        pod = self.fake.get("pods", self.pod, NS) or {}
        meta = pod.get("metadata", {})
        selector = shipped("Service")["spec"]["selector"].items()
        return bool(pod) and not meta.get("deletionTimestamp") and \
            selector <= (meta.get("labels") or {}).items() and self.ready()


class ServiceProxy:
    """A ClusterIP Service on loopback: each new TCP connection goes to an endpoint now (a
    pod the Service selects that is Ready), else it is closed (no endpoints), as
    kube-proxy does."""

    def __init__(self, backends: Sequence[Arbiter]) -> None:
        self.backends = backends
        self.address = ""
        self._server: asyncio.AbstractServer | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def _ready_backend(self) -> Arbiter | None:
        loop = asyncio.get_running_loop()
        for b in list(self.backends):
            if await loop.run_in_executor(None, b.endpoint):
                return b
        return None

    async def _accept(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        backend = await self._ready_backend()
        if backend is None:
            writer.close()
            return
        host, _, port = backend.address.rpartition(":")
        try:
            br, bw = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        for t in (asyncio.create_task(pipe(reader, bw)), asyncio.create_task(pipe(br, writer))):
            self._pipes.add(t)
            t.add_done_callback(self._pipes.discard)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._pipes):
            t.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)


@contextlib.contextmanager
def two_arbiters(fake: FakeKube, **kw: Any) -> Iterator[list[Arbiter]]:
    arbiters = [Arbiter(fake, f"ftagent-arbiter-{i}", *election_args(fake.url, **kw))
                for i in range(2)]
    with replicas(arbiters):
        yield arbiters


@contextlib.contextmanager
def replicas(arbiters: list[Arbiter]) -> Iterator[list[Arbiter]]:
    """Start ``arbiters``; stop them all at the end (any appended meanwhile too)."""
    try:
        for a in list(arbiters):
            a.start()
        yield arbiters
    except BaseException:
        for a in arbiters:
            print(a.proc.log_text()[-4000:])
        raise
    finally:
        for a in arbiters:
            a.proc.stop()


@contextlib.asynccontextmanager
async def service(arbiters: Sequence[Arbiter]) -> AsyncIterator[ServiceProxy]:
    proxy = ServiceProxy(arbiters)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


async def the_leader(arbiters: Sequence[Arbiter], timeout: float) -> Arbiter:
    """The one endpoint, once every other replica has seen the Lease held (so that a
    take-over is timed from the leader's death, not from a slow start of the standby)."""
    loop = asyncio.get_running_loop()
    found: list[Arbiter] = []

    async def one() -> bool:
        found[:] = [a for a in list(arbiters)
                    if await loop.run_in_executor(None, a.endpoint)]
        return len(found) == 1 and all(
            "standing by" in a.proc.log_text() for a in arbiters
            if a is not found[0] and a.running())

    await wait_until(one, timeout, "exactly one endpoint (the labelled leader)", interval=0.1)
    return found[0]


def grpc_health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5).status)


@pytest.fixture
def fake_kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


def test_the_standby_refuses_agents(fake_kube: FakeKube) -> None:
    with two_arbiters(fake_kube) as arbiters:
        asyncio.run(_standby_refuses(fake_kube, arbiters))


async def _standby_refuses(fake: FakeKube, arbiters: list[Arbiter]) -> None:
    leader = await the_leader(arbiters, 20)
    standby = next(a for a in arbiters if a is not leader)
    lease = fake.get(LEASES, LEASE, NS)
    assert lease is not None
    spec = lease["spec"]
    assert spec["leaseDurationSeconds"] == 3 and spec["holderIdentity"]
    assert spec["acquireTime"] and spec["renewTime"] and spec["leaseTransitions"] == 0
    assert grpc_health(leader.address) == health_pb2.HealthCheckResponse.SERVING
    # an agent that reaches the standby directly is refused (UNAVAILABLE) and retries
    with pytest.raises(AssertionError, match="to connect"):
        async with running_links(standby.address, "direct", 1, connect_timeout=1.5):
            pass
    assert grpc_health(standby.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    # Ready (issue 32.3: a rollout and a drain need it), but not the Service's endpoint
    for port in (standby.health, standby.metrics):
        assert http_status(port, "/readyz") == 200 and http_status(port, "/healthz") == 200
    assert LABEL not in standby.labels() and leader.labels()[LABEL] == "true"
    assert not standby.endpoint()
    # what the "no leader" alert reads: one leader, one standby
    assert [leader_gauge(a.metrics) for a in (leader, standby)] == [1.0, 0.0]


def leader_gauge(port: int) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    m = re.search(r"^ftagent_arbiter_leader (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_sigkill_the_leader_and_the_standby_decides_for_every_agent(
        fake_kube: FakeKube) -> None:
    with two_arbiters(fake_kube) as arbiters:
        asyncio.run(_takeover(fake_kube, arbiters))


async def _takeover(fake: FakeKube, arbiters: list[Arbiter]) -> None:
    leader = await the_leader(arbiters, 20)
    standby = next(a for a in arbiters if a is not leader)
    first = must(fake.get(LEASES, LEASE, NS))["spec"]
    async with service(arbiters) as svc, running_links(svc.address, "llama", 3) as links:
        ids = {lk.arbiter_id for lk in links}
        assert len(ids) == 1
        leader.proc.kill()
        killed = time.monotonic()
        await wait_until(standby.endpoint, DURATION + RETRY * 1.2 + 5,
                         "the standby to lead", interval=0.05)
        took = time.monotonic() - killed
        assert took < DURATION + 2 * RETRY + 2, took  # within the lease duration (+ a try)
        await wait_until(lambda: all(lk.connected and lk.arbiter_id not in ids
                                     for lk in links), 20, "every agent on the new leader")
        spec = must(fake.get(LEASES, LEASE, NS))["spec"]
        assert spec["holderIdentity"] != first["holderIdentity"]
        assert spec["leaseTransitions"] == first["leaseTransitions"] + 1
        # a fault decided by the new leader reaches every agent
        links[1].report_fault(Fault(FaultKind.CRASH, "segfault"), exit_status=139)
        for lk in links:
            cmd = await asyncio.wait_for(lk.commands.get(), 10)
            assert cmd.kind is ActionKind.RESTART and cmd.generation == 1


def test_a_leader_that_cannot_renew_stops_acting(fake_kube: FakeKube) -> None:
    with two_arbiters(fake_kube) as arbiters:
        asyncio.run(_cannot_renew(fake_kube, arbiters))


async def _cannot_renew(fake: FakeKube, arbiters: list[Arbiter]) -> None:
    leader = await the_leader(arbiters, 20)
    async with running_links(leader.address, "llama", 2) as links, \
            grpc.aio.insecure_channel(leader.address) as ch:
        watch = pb_grpc.ArbiterStub(ch).WatchEvents(pb.WatchEventsRequest(job="llama"))
        fake.forbid("update", LEASES)  # every renewal (and take-over) now gets 403
        fake.forbid("create", LEASES)
        await wait_until(lambda: not any(lk.connected for lk in links), DEADLINE + 10,
                         "the leader to close every agent stream", interval=0.05)

        async def follow() -> None:
            async for _ in watch:
                pass
        # a follower of the timeline is told too, not left waiting on a standby forever
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(follow(), 10)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
        assert "lost the leader lease" in str(ended.value.details()), ended.value
        await wait_until(lambda: not leader.endpoint(), 5, "the label off the old leader")
        assert grpc_health(leader.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        log = leader.proc.log_text()
        assert "lost lease" in log and "leases.coordination.k8s.io" in log
        fake.clear_faults()
        await the_leader(arbiters, DURATION + 10)  # someone leads again, agents come back
        await wait_until(lambda: all(lk.connected for lk in links), 20, "agents back")


# --------------------------------------------------------------------------- 32.3


class Kubelet:
    """Writes each running replica's Ready condition from its readiness probe, as the
    kubelet does (what the PodDisruptionBudget and the Deployment count)."""

    def __init__(self, fake: FakeKube, arbiters: list[Arbiter]) -> None:
        self.fake, self.arbiters = fake, arbiters

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            for a in list(self.arbiters):
                if self.fake.get("pods", a.pod, NS) is None:
                    continue
                ready = await loop.run_in_executor(None, a.ready)
                with contextlib.suppress(Exception):  # deleted meanwhile
                    self.fake.set_pod_condition(NS, a.pod, "Ready",
                                                "True" if ready else "False")
            await asyncio.sleep(0.2)  # the probe's period (a loop, not a synchronization)

    def pod_ready(self, a: Arbiter) -> bool:
        pod = self.fake.get("pods", a.pod, NS) or {}
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in pod.get("status", {}).get("conditions") or [])


def test_a_rollout_and_a_drain_of_the_leaders_node_complete_and_restart_no_job(
        fake_kube: FakeKube) -> None:
    """Issue 32.3: only the leader was Ready, so with maxUnavailable 0 a rollout never
    went on (the new replica, a standby, never became Ready) and the PDB refused to evict
    the leader (one healthy pod of the two). Now: a rollout replaces both replicas, leader
    first (a new one Ready, then SIGTERM to an old one, as the Deployment controller does),
    the leader's pod is evicted through the API with the shipped PDB, and through all of
    it the agents follow the leader and no job is restarted."""
    pdb = shipped("PodDisruptionBudget")
    pdb["metadata"]["namespace"] = NS
    fake_kube.create("poddisruptionbudgets.policy", pdb)
    arbiters = [Arbiter(fake_kube, f"ftagent-arbiter-old-{i}", *election_args(fake_kube.url))
                for i in range(2)]
    with replicas(arbiters):
        asyncio.run(_rollout_and_drain(fake_kube, arbiters))


async def _rollout_and_drain(fake: FakeKube, arbiters: list[Arbiter]) -> None:
    kubelet = Kubelet(fake, arbiters)
    probes = asyncio.create_task(kubelet.run())
    core = kubernetes.client.CoreV1Api(fake.client())
    loop = asyncio.get_running_loop()

    async def surge(name: str) -> Arbiter:
        """The Deployment's maxSurge: a new replica, waited for until Ready."""
        new = Arbiter(fake, name, *election_args(fake.url))
        arbiters.append(new)
        await loop.run_in_executor(None, new.start)
        await wait_until(lambda: kubelet.pod_ready(new), 20, f"{name} to be Ready")
        return new

    async def terminate(old: Arbiter) -> None:
        """The pod deleted: the kubelet sends SIGTERM; the process exits cleanly."""
        fake.delete("pods", old.pod, NS, grace=30)  # Terminating (or already, if evicted)
        assert await loop.run_in_executor(None, old.proc.stop) == 0, old.proc.log_text()
        fake.finish_termination(NS, old.pod)

    try:
        leader = await the_leader(arbiters, 20)
        async with service(arbiters) as svc, running_links(svc.address, "llama", 3) as links:
            served_by = {lk.arbiter_id for lk in links}

            async def followed(step: str) -> None:
                """Every agent on the (new) leader, no command sent to any of them."""
                now = await the_leader([a for a in arbiters if a.running()], 20)
                await wait_until(lambda: all(lk.connected for lk in links), 30,
                                 f"every agent connected again after {step}")
                ids = {lk.arbiter_id for lk in links}
                assert len(ids) == 1, (step, ids)
                assert now.running()
                for lk in links:
                    assert lk.commands.empty(), (step, lk.commands.get_nowait())
                served_by.update(ids)

            # the rollout: maxSurge 1, maxUnavailable 0; the leader's pod goes first
            for i, old in enumerate(sorted(arbiters[:2], key=lambda a: a is not leader)):
                await surge(f"ftagent-arbiter-new-{i}")
                await terminate(old)
                await followed(f"rolling {old.pod}")
            assert len(served_by) >= 2  # the leadership moved (at least once)
            # the drain: the leader's node is drained, its pod evicted through the API
            leader = await the_leader([a for a in arbiters if a.running()], 20)
            await wait_until(lambda: all(kubelet.pod_ready(a) for a in arbiters
                                         if a.running()), 20, "both replicas Ready")
            body = {"apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {"name": leader.pod, "namespace": NS}}
            await loop.run_in_executor(None, lambda: core.create_namespaced_pod_eviction(
                leader.pod, NS, body))  # type: ignore[arg-type]  # 429: the PDB refuses
            await terminate(leader)
            await followed(f"evicting the leader {leader.pod}")
            await surge("ftagent-arbiter-new-2")  # the ReplicaSet replaces the evicted pod
            # the job is whole on the last leader: a fault is decided once, for every rank
            links[1].report_fault(Fault(FaultKind.CRASH, "segfault"), exit_status=139)
            for lk in links:
                cmd = await asyncio.wait_for(lk.commands.get(), 10)
                assert cmd.kind is ActionKind.RESTART and cmd.generation == 1
    finally:
        probes.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probes
