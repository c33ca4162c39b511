"""Leader election with two real arbiter processes (``--leader-elect``) on one Lease in the
fake API server, real agents (ArbiterLinks) behind a "Service": a TCP proxy that, like
kube-proxy with the endpoints of Ready pods only, sends each new connection to an arbiter
whose /readyz says 200. One acts; the standby is not ready and refuses agents; SIGKILL the
leader and the other takes over within the lease duration, the agents re-register, and a
fault decided afterwards reaches every agent. A leader that cannot renew stops acting."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ftagent.model import ActionKind, Fault, FaultKind
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from tests.arbiter_helpers import ArbiterProcess, running_links, wait_until
from tests.kube_fake import FakeKube

NS = "ftagent-system"


def must(obj: dict[str, Any] | None) -> dict[str, Any]:
    assert obj is not None, "no such object in the fake API server"
    return obj
LEASE = "ftagent-arbiter"
LEASES = "leases.coordination.k8s.io"
# Short settings so the test is quick: take-over within DURATION of the leader's death.
DURATION, DEADLINE, RETRY = 3.0, 2.0, 0.5
_METRICS = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")


def election_args(url: str, duration: float = DURATION, deadline: float = DEADLINE,
                  retry: float = RETRY) -> list[str]:
    return ["--leader-elect", "--kube-api", url, "--leader-elect-namespace", NS,
            "--leader-elect-lease", LEASE, "--leader-elect-lease-duration", str(duration),
            "--leader-elect-renew-deadline", str(deadline),
            "--leader-elect-retry-period", str(retry),
            "--metrics-port", "0", "--metrics-addr", "127.0.0.1"]


def metrics_port(arb: ArbiterProcess) -> int:
    m = _METRICS.search(arb.log_path.read_text(errors="replace"))
    assert m, arb.log_text()
    return int(m.group(1))


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


class Arbiter:
    """One replica: its process, its gRPC and metrics ports."""

    def __init__(self, proc: ArbiterProcess) -> None:
        self.proc = proc
        self.metrics = metrics_port(proc)

    @property
    def address(self) -> str:
        return self.proc.address

    def ready(self) -> bool:
        return self.proc.proc is not None and self.proc.proc.poll() is None \
            and http_status(self.metrics, "/readyz") == 200


class ServiceProxy:
    """A ClusterIP Service on loopback: each new TCP connection goes to a backend that is
    Ready now (/readyz 200), else it is closed (no endpoints), as kube-proxy does."""

    def __init__(self, backends: Sequence[Arbiter]) -> None:
        self.backends = list(backends)
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
        for b in self.backends:
            if await loop.run_in_executor(None, b.ready):
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
def two_arbiters(url: str, **kw: Any) -> Iterator[list[Arbiter]]:
    procs = [ArbiterProcess(*election_args(url, **kw)) for _ in range(2)]
    try:
        for p in procs:
            p.start()
        yield [Arbiter(p) for p in procs]
    except BaseException:
        for p in procs:
            print(p.log_text()[-4000:])
        raise
    finally:
        for p in procs:
            p.stop()


@contextlib.asynccontextmanager
async def service(arbiters: Sequence[Arbiter]) -> AsyncIterator[ServiceProxy]:
    proxy = ServiceProxy(arbiters)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


async def the_leader(arbiters: Sequence[Arbiter], timeout: float) -> Arbiter:
    loop = asyncio.get_running_loop()
    found: list[Arbiter] = []

    async def one() -> bool:
        found[:] = [a for a in arbiters if await loop.run_in_executor(None, a.ready)]
        return len(found) == 1

    await wait_until(one, timeout, "exactly one ready arbiter (the leader)", interval=0.1)
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
    with two_arbiters(fake_kube.url) as arbiters:
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
    assert http_status(standby.metrics, "/readyz") == 503
    assert http_status(standby.metrics, "/healthz") == 200
    # what the "no leader" alert reads: one leader, one standby
    assert [leader_gauge(a.metrics) for a in (leader, standby)] == [1.0, 0.0]


def leader_gauge(port: int) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    m = re.search(r"^ftagent_arbiter_leader (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_sigkill_the_leader_and_the_standby_decides_for_every_agent(
        fake_kube: FakeKube) -> None:
    with two_arbiters(fake_kube.url) as arbiters:
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
        await wait_until(standby.ready, DURATION + RETRY * 1.2 + 5, "the standby to lead",
                         interval=0.05)
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
    with two_arbiters(fake_kube.url) as arbiters:
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
        assert not leader.ready()
        assert grpc_health(leader.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        log = leader.proc.log_text()
        assert "lost lease" in log and "leases.coordination.k8s.io" in log
        fake.clear_faults()
        await the_leader(arbiters, DURATION + 10)  # someone leads again, agents come back
        await wait_until(lambda: all(lk.connected for lk in links), 20, "agents back")
