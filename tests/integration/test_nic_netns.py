"""NicSource + NicDetector against real kernel link events in network namespaces.

Each test gets two fresh namespaces joined by a veth (``eth0`` in ``a``, ``peer0`` in
``b``), runs the source on a real asyncio loop watching ``a``, flips links with ``ip``,
and waits on conditions with deadlines. Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from ftagent.config import NicConfig
from ftagent.detect.nic import NicDetector
from ftagent.model import Fault, LinkEvent, Observation, Severity
from ftagent.sources.nic import NicSource
from tests.conftest import until
from tests.netns import aip, ip, namespaces, require_netns, veth

pytestmark = [pytest.mark.netns, pytest.mark.timeout(60)]


@pytest.fixture
def pair() -> Iterator[tuple[str, str]]:
    require_netns()
    with namespaces(2) as (a, b):
        veth(a, "eth0", b, "peer0")
        yield a, b


class Watch:
    """A miniature agent: the source feeds the detector; a ticker expires graces."""

    def __init__(self, ns: str, grace: float, *, environ: dict[str, str] | None = None,
                 nic: tuple[str, ...] = ()) -> None:
        self.det = NicDetector(grace)
        cfg = NicConfig(nic=nic, nic_grace=grace, nic_poll_interval=0.2)
        self.src = NicSource(cfg, environ or {}, netns=ns, flaps=self.det.flaps)
        self.events: list[LinkEvent] = []
        self.faults: list[Fault] = []
        self._tasks: list[asyncio.Task[None]] = []

    def emit(self, obs: Observation) -> None:
        assert isinstance(obs, LinkEvent)
        self.events.append(obs)
        self.faults += self.det.observe(obs)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            self.faults += self.det.tick(time.monotonic())

    async def __aenter__(self) -> Watch:
        self._tasks = [asyncio.create_task(self.src.run(self.emit)),
                       asyncio.create_task(self._ticker())]
        await until(self.src.ready.is_set, what="initial dump")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for r in results:  # the source must not have died on its own
            assert isinstance(r, asyncio.CancelledError), r

    def last(self, dev: str = "eth0") -> LinkEvent | None:
        evs = [e for e in self.events if e.ifname == dev]
        return evs[-1] if evs else None

    def errors(self) -> list[Fault]:
        return [f for f in self.faults if f.severity == Severity.ERROR]

    def recoveries(self) -> list[Fault]:
        return [f for f in self.faults if f.evidence.get("recovered")]


def test_admin_down_long_outage_faults_then_recovers(pair: tuple[str, str]) -> None:
    a, _ = pair

    async def main() -> None:
        async with Watch(a, grace=0.3) as w:
            assert w.src.watched() == ["eth0"]  # the only non-loopback link up at start
            assert w.last() is not None and w.last().up  # type: ignore[union-attr]
            down_at = time.monotonic()
            await aip("-n", a, "link", "set", "eth0", "down")
            ev = await until(lambda: (e := w.last()) and not e.admin_up and e, what="down")
            assert not ev.carrier and ev.operstate == "DOWN"
            assert ev.ts - down_at < 1.0
            (f,) = await until(w.errors, what="NIC fault")
            assert f.evidence["reason"] == "admin_down" and f.evidence["device"] == "eth0"
            assert f.evidence["detection_latency_seconds"] >= 0.3
            await aip("-n", a, "link", "set", "eth0", "up")
            (r,) = await until(w.recoveries, what="recovery")
            assert r.severity == Severity.INFO
            assert r.evidence["outage_seconds"] >= 0.3
            assert w.det.flaps("eth0") == 0

    asyncio.run(main())


def test_peer_down_in_other_namespace_is_carrier_loss(pair: tuple[str, str]) -> None:
    a, b = pair

    async def main() -> None:
        async with Watch(a, grace=0.3) as w:
            await aip("-n", b, "link", "set", "peer0", "down")
            ev = await until(lambda: (e := w.last()) and not e.carrier and e, what="no carrier")
            assert ev.admin_up  # our side is still administratively up
            assert ev.operstate in ("DOWN", "LOWERLAYERDOWN")
            (f,) = await until(w.errors, what="NIC fault")
            assert f.evidence["reason"] == "carrier_lost" and "lost carrier" in f.message
            await aip("-n", b, "link", "set", "peer0", "up")
            (r,) = await until(w.recoveries, what="recovery")
            assert r.evidence["reason"] == "carrier_lost"

    asyncio.run(main())


def test_flap_shorter_than_grace_is_counted_not_a_fault(pair: tuple[str, str]) -> None:
    a, b = pair

    async def main() -> None:
        async with Watch(a, grace=1.0) as w:
            await aip("-n", a, "link", "set", "eth0", "down")
            await aip("-n", a, "link", "set", "eth0", "up")
            await until(lambda: w.det.flaps("eth0") == 1, what="admin flap counted")
            await aip("-n", b, "link", "set", "peer0", "down")
            await aip("-n", b, "link", "set", "peer0", "up")
            await until(lambda: w.det.flaps("eth0") == 2, what="carrier flap counted")
            (stats,) = w.src.snapshot()
            assert stats.device == "eth0" and stats.flaps == 2 and stats.up and stats.carrier
            # nothing pending: the grace of both flaps is over without a fault
            assert w.det.next_deadline() is None
            assert w.faults == []

    asyncio.run(main())


def test_deleted_and_renamed_links_are_reported_not_a_crash(pair: tuple[str, str]) -> None:
    a, b = pair
    veth(a, "eth1", b, "peer1")  # a second watched link (--nic glob)

    async def main() -> None:
        async with Watch(a, grace=0.2, nic=("eth*",)) as w:
            assert w.src.watched() == ["eth0", "eth1"]
            await aip("-n", a, "link", "set", "eth1", "name", "xeth1")
            ev = await until(lambda: (e := w.last("eth1")) and e.deleted and e, what="rename")
            assert "renamed to xeth1" in ev.operstate
            await aip("-n", a, "link", "del", "eth0")
            await until(lambda: (e := w.last("eth0")) and e.deleted, what="delete")
            faults = await until(lambda: len(w.errors()) == 2 and w.errors(), what="2 faults")
            assert {f.evidence["device"] for f in faults} == {"eth0", "eth1"}
            assert {f.evidence["reason"] for f in faults} == {"deleted"}
            assert w.src.snapshot() == []  # xeth1 is not watched, eth0 is gone
            # a link re-created under a watched name is picked up again and recovers
            veth(a, "eth0", b, "peer2")
            await until(w.recoveries, what="recovery of the re-created eth0")

    asyncio.run(main())


def test_selection_from_nccl_socket_ifname_and_counters(pair: tuple[str, str]) -> None:
    a, b = pair
    veth(a, "eth1", b, "peer1")
    ip("-n", a, "addr", "add", "10.77.0.1/24", "dev", "eth0")
    ip("-n", b, "addr", "add", "10.77.0.2/24", "dev", "peer0")

    async def main() -> None:
        async with Watch(a, grace=0.2, environ={"NCCL_SOCKET_IFNAME": "=eth0"}) as w:
            assert w.src.watched() == ["eth0"]
            await aip("-n", a, "link", "set", "eth1", "down")  # not watched: no event
            before = w.src.snapshot()[0].transmit_bytes
            # 2 MB of UDP from a to b, inside the namespaces
            await aip("netns", "exec", a, "python3", "-c",
                      "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                      "for _ in range(2000): s.sendto(b'x' * 1000, ('10.77.0.2', 9))")
            (st,) = await until(lambda: (s := w.src.snapshot()) and
                                s[0].transmit_bytes >= before + 2_000_000 and s,
                                what="counters")
            await until(lambda: w.src.snapshot()[0].transmit_bps > 0, what="rate")
            assert st.receive_bytes >= 0
            assert all(e.ifname == "eth0" for e in w.events)

    asyncio.run(main())


def test_missing_namespace_is_a_setup_error() -> None:
    require_netns()
    src = NicSource(NicConfig(), {}, netns="ftagent-no-such-namespace")

    async def main() -> None:
        with pytest.raises(Exception):  # noqa: B017 - whatever pyroute2 raises
            await asyncio.wait_for(src.run(lambda _: None), 10)

    asyncio.run(main())
    assert "ftagent-no-such-namespace" not in ip("netns", "list")
