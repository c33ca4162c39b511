"""NIC debounce (detect/nic.py) and link selection/flag rules (sources/nic.py): pure, no sleeps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from ftagent.config import NicConfig
from ftagent.detect.nic import NicDetector, down_reason
from ftagent.model import FaultKind, LinkEvent, Observation, Progress, Scope, Severity
from ftagent.sources import nic as nic_source
from ftagent.sources.nic import (
    IFF_LOWER_UP,
    InitialLink,
    NameList,
    NicSource,
    link_event,
    select_links,
)
from tests.conftest import until

UP = (True, True)  # (admin_up, carrier)
ADMIN_DOWN = (False, False)
NO_CARRIER = (True, False)


def ev(ts: float, state: tuple[bool, bool], dev: str = "eth0") -> LinkEvent:
    return LinkEvent(ifname=dev, admin_up=state[0], carrier=state[1], ts=ts, operstate="X",
                     index=2)


def detector(grace: float = 2.0, scope: Scope = Scope.POD) -> NicDetector:
    # fixed clocks: wall = monotonic + 1000, so evidence walltimes are predictable
    return NicDetector(grace, scope=scope, wall=lambda: 1100.0, monotonic=lambda: 100.0)


# --------------------------------------------------------------------------- debounce


def test_short_outage_is_a_flap_not_a_fault() -> None:
    d = detector(2.0)
    assert d.observe(ev(0.0, UP)) == []
    assert d.observe(ev(10.0, NO_CARRIER)) == []
    assert d.next_deadline() == 12.0
    assert d.tick(11.9) == []
    assert d.observe(ev(11.5, UP)) == []
    assert d.flaps("eth0") == 1
    assert d.next_deadline() is None
    assert d.tick(100.0) == []
    st = d.state("eth0")
    assert st is not None and st.up and st.outages == 0


def test_long_outage_faults_once_then_recovers_with_its_length() -> None:
    d = detector(2.0)
    d.observe(ev(0.0, UP))
    d.observe(ev(10.0, ADMIN_DOWN))
    (f,) = d.tick(12.25)
    assert f.kind == FaultKind.NIC and f.severity == Severity.ERROR and f.scope == Scope.POD
    assert "eth0" in f.message and "administratively down" in f.message
    assert f.evidence["reason"] == "admin_down"
    assert f.evidence["down_since"] == 10.0 and f.evidence["detected"] == 12.25
    assert f.evidence["detection_latency_seconds"] == pytest.approx(2.25)
    assert f.evidence["down_since_wall"] == pytest.approx(1010.0)
    assert "recovered" not in f.evidence
    assert d.tick(13.0) == [] and d.tick(50.0) == []  # once per outage
    assert d.observe(ev(14.0, ADMIN_DOWN)) == []  # repeated down message: nothing new
    (r,) = d.observe(ev(15.5, UP))
    assert r.kind == FaultKind.NIC and r.severity == Severity.INFO
    assert r.evidence["recovered"] is True and r.evidence["device"] == "eth0"
    assert r.evidence["outage_seconds"] == pytest.approx(5.5)
    assert d.flaps("eth0") == 0
    assert d.state("eth0").outages == 1  # type: ignore[union-attr]


def test_carrier_loss_is_named_as_such() -> None:
    d = detector(1.0)
    d.observe(ev(0.0, UP))
    d.observe(ev(1.0, NO_CARRIER))
    (f,) = d.tick(2.0)
    assert f.evidence["reason"] == "carrier_lost" and "lost carrier" in f.message


def test_outage_past_grace_without_a_tick_is_still_reported() -> None:
    """The recovery event itself notices the missed expiry: fault, then recovery."""
    d = detector(2.0)
    d.observe(ev(0.0, UP))
    d.observe(ev(1.0, NO_CARRIER))
    down, up = d.observe(ev(9.0, UP))
    assert down.severity == Severity.ERROR and up.evidence["recovered"] is True
    assert up.evidence["outage_seconds"] == pytest.approx(8.0)


def test_deleted_link_faults_and_recreation_recovers() -> None:
    d = detector(0.5)
    d.observe(ev(0.0, UP))
    d.observe(LinkEvent("eth0", admin_up=False, carrier=False, deleted=True, ts=1.0))
    (f,) = d.tick(1.5)
    assert f.evidence["reason"] == "deleted" and "deleted" in f.message
    d.observe(ev(2.0, ADMIN_DOWN))  # re-created, still down: same outage
    assert d.state("eth0").reason == "admin_down"  # type: ignore[union-attr]
    (r,) = d.observe(ev(3.0, UP))
    assert r.evidence["outage_seconds"] == pytest.approx(2.0)


def test_guessed_link_deleted_while_another_is_up_is_a_warning_only() -> None:
    """The job named no link, so every link up at start is watched (the fallback). A host's
    other tenants' links are among them (a test's veth and bridge, another pod's veth on a
    hostNetwork node): one deleted while eth0 is still up is recorded as a WARNING, which
    the arbiter only records, and its recovery is not reported. Before, it was an ERROR: the
    arbiter waited --nic-replace-after (300 s) for the link and deferred the job's crash
    meanwhile (bench/restart.py's warm restarts that never trained again beside a CI run)."""
    guessed = {"eth0", "flw8a", "flw8b"}
    d = NicDetector(0.5, wall=lambda: 1100.0, monotonic=lambda: 100.0,
                    guessed=guessed.__contains__)
    for dev in ("eth0", "flw8a", "ib0"):
        d.observe(ev(0.0, UP, dev))
    d.observe(LinkEvent("flw8a", admin_up=False, carrier=False, deleted=True, ts=1.0))
    (f,) = d.tick(1.5)
    assert f.severity == Severity.WARNING and f.evidence["reason"] == "deleted"
    assert f.evidence["guessed"] is True and f.evidence["others_up"] == ["eth0"]
    assert "eth0 still up" in f.message  # ib0 (an RDMA port, say) was named: not counted
    assert d.observe(ev(2.0, UP, "flw8a")) == []  # re-created: nobody waited for it
    assert d.tick(10.0) == []


def test_guessed_link_down_with_no_other_guessed_link_up_is_an_error() -> None:
    """Every guessed link down: the job's path is down whichever it was (ERROR, and its
    recovery reported); a link the job named (ib0 here) is judged alone, as before."""
    guessed = {"eth0", "eth1"}
    d = NicDetector(0.5, guessed=guessed.__contains__)
    for dev in ("eth0", "eth1", "ib0"):
        d.observe(ev(0.0, UP, dev))
    d.observe(ev(1.0, NO_CARRIER, "eth1"))
    d.observe(ev(1.2, NO_CARRIER, "eth0"))
    first, last = d.tick(1.5)[0], d.tick(1.7)[0]
    assert first.evidence["device"] == "eth1" and first.severity == Severity.ERROR
    assert last.evidence["device"] == "eth0" and last.severity == Severity.ERROR
    (r,) = d.observe(ev(3.0, UP, "eth0"))
    assert r.evidence["recovered"] is True
    d.observe(ev(4.0, NO_CARRIER, "ib0"))  # eth0 and eth1 are up, but ib0 was named
    (named,) = d.tick(4.5)
    assert named.severity == Severity.ERROR and "guessed" not in named.evidence


def test_select_fallback_is_marked_guessed() -> None:
    assert select_links((), {}, HOST).guessed
    assert not select_links(("eth0",), {}, HOST).guessed
    assert not select_links((), {"GLOO_SOCKET_IFNAME": "eth1"}, HOST).guessed
    assert not select_links((), {"NCCL_SOCKET_IFNAME": "^docker"}, HOST).guessed


def test_link_never_up_is_not_judged() -> None:
    d = detector(0.5)
    assert d.observe(ev(0.0, ADMIN_DOWN)) == []
    assert d.next_deadline() is None and d.tick(100.0) == []
    assert d.observe(ev(101.0, UP)) == []  # first up: now judged, no recovery, no flap
    assert d.flaps("eth0") == 0
    d.observe(ev(102.0, NO_CARRIER))
    assert len(d.tick(103.0)) == 1


def test_zero_grace_faults_on_the_event() -> None:
    d = detector(0.0)
    d.observe(ev(0.0, UP))
    (f,) = d.observe(ev(1.0, NO_CARRIER))
    assert f.evidence["detection_latency_seconds"] == 0.0


def test_devices_are_independent_and_deadline_is_the_earliest() -> None:
    d = detector(2.0, scope=Scope.NODE)
    for dev in ("eth0", "mlx5_0/1"):
        d.observe(ev(0.0, UP, dev))
    d.observe(ev(5.0, NO_CARRIER, "mlx5_0/1"))
    d.observe(ev(4.0, NO_CARRIER, "eth0"))
    assert d.next_deadline() == 6.0
    (f,) = d.tick(6.0)
    assert f.evidence["device"] == "eth0" and f.scope == Scope.NODE
    assert d.next_deadline() == 7.0
    d.observe(ev(6.5, UP, "mlx5_0/1"))
    assert d.flaps("mlx5_0/1") == 1 and d.flaps("eth0") == 0 and d.flaps("nope") == 0
    assert d.devices() == ["eth0", "mlx5_0/1"]


def test_other_observations_are_ignored() -> None:
    assert detector().observe(Progress(step=1)) == []


def test_down_reason_precedence() -> None:
    assert down_reason(LinkEvent("x", True, True)) is None
    assert down_reason(LinkEvent("x", True, False)) == "carrier_lost"
    assert down_reason(LinkEvent("x", False, False)) == "admin_down"
    assert down_reason(LinkEvent("x", True, True, deleted=True)) == "deleted"


# --------------------------------------------------------------------------- flags


@pytest.mark.parametrize("flags, carrier_attr, admin_up, carrier", [
    (0x1002, 0, False, False),  # admin down: IFF_UP clear
    (0x1003, 0, True, False),  # peer down in another netns: operstate DOWN, carrier 0
    (0x11043, 1, True, True),  # up, LOWER_UP, RUNNING
    (0x11003, 1, True, True),  # LOWER_UP before RUNNING (operstate still DOWN): up
    (0x11043, 0, True, False),  # IFLA_CARRIER 0 wins
    (0x11043, None, True, True),  # no IFLA_CARRIER attribute: flags decide
    (IFF_LOWER_UP, 1, False, False),  # carrier without IFF_UP is still admin down
])
def test_link_event_from_flags(flags: int, carrier_attr: int | None, admin_up: bool,
                               carrier: bool) -> None:
    e = link_event("eth0", flags, carrier=carrier_attr, operstate="DOWN", index=3, ts=1.5)
    assert (e.admin_up, e.carrier) == (admin_up, carrier)
    assert e.ifname == "eth0" and e.index == 3 and e.ts == 1.5 and not e.deleted


# --------------------------------------------------------------------------- which links


def links(*spec: tuple[str, bool]) -> list[InitialLink]:
    return [InitialLink("lo", True, loopback=True)] + [InitialLink(n, up) for n, up in spec]


HOST = links(("eth0", True), ("eth1", True), ("ib0", True), ("docker0", True),
             ("eth2", False))


def test_nccl_list_syntax() -> None:
    nl = NameList.parse("eth,ib")
    assert nl.selects("eth0") and nl.selects("ib1") and not nl.selects("docker0")
    exact = NameList.parse("=eth0")
    assert exact.selects("eth0") and not exact.selects("eth01")
    excl = NameList.parse("^docker,lo")
    assert excl.exclude and not excl.selects("docker0") and excl.selects("eth0")
    excl_exact = NameList.parse("^=docker0")
    assert excl_exact.selects("docker01") and not excl_exact.selects("docker0")
    hca = NameList.parse("mlx5_0:1,mlx5_1")
    assert hca.selects("mlx5_0", 1) and not hca.selects("mlx5_0", 2)
    assert hca.selects("mlx5_1", 2) and not hca.selects("mlx5_2", 1)
    assert NameList.parse(" , ").items == ()


def test_select_nic_flag_globs_win() -> None:
    sel = select_links(("eth[01]", "ib*"), {"NCCL_SOCKET_IFNAME": "eth2"}, HOST)
    assert [n for n in ("eth0", "eth1", "eth2", "ib0", "ib7") if sel.watches(n)] == [
        "eth0", "eth1", "ib0", "ib7"]
    assert "--nic" in sel.why


def test_select_from_nccl_prefix_also_matches_later_links() -> None:
    sel = select_links((), {"NCCL_SOCKET_IFNAME": "eth"}, HOST)
    assert sel.watches("eth0") and sel.watches("eth2") and sel.watches("eth9")
    assert not sel.watches("ib0") and not sel.watches("lo")
    assert "NCCL_SOCKET_IFNAME=eth" in sel.why


def test_select_from_nccl_exclusion_is_fixed_to_links_up_at_start() -> None:
    sel = select_links((), {"NCCL_SOCKET_IFNAME": "^docker,lo"}, HOST)
    assert {n for n in ("eth0", "eth1", "ib0", "docker0", "eth2", "lo", "veth9")
            if sel.watches(n)} == {"eth0", "eth1", "ib0"}


def test_select_from_gloo_exact_names_and_union_with_nccl() -> None:
    sel = select_links((), {"GLOO_SOCKET_IFNAME": "eth1, eth2"}, HOST)
    assert sel.watches("eth1") and sel.watches("eth2") and not sel.watches("eth10")
    both = select_links((), {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=ib0"},
                        HOST)
    assert both.watches("eth1") and both.watches("ib0") and not both.watches("eth0")


def test_select_fallback_every_non_loopback_link_up_at_start() -> None:
    sel = select_links((), {"NCCL_SOCKET_IFNAME": "  "}, HOST)
    assert sel.why == "links up at start"
    assert sel.fixed == {"eth0", "eth1", "ib0", "docker0"}


# --------------------------------------------------------------------------- source bookkeeping
# NicSource against an in-memory stand-in for pyroute2's AsyncIPRoute: the races and
# failures a real kernel produces only by chance (tests/integration has the real thing).


class FakeMsg(dict[str, Any]):
    def __init__(self, event: str, ifname: str, index: int, flags: int,
                 rx: int = 0, tx: int = 0) -> None:
        super().__init__(event=event, index=index, flags=flags, ifindex=index)
        self.attrs = {"IFLA_IFNAME": ifname, "IFLA_OPERSTATE": "X",
                      "IFLA_STATS64": {"rx_bytes": rx, "tx_bytes": tx},
                      "IFLA_STATS_LINK_64": {"rx_bytes": rx, "tx_bytes": tx}}

    def get_attr(self, name: str) -> object:
        return self.attrs.get(name)


UPF, DOWNF = 0x11043, 0x1002


class FakeKernel:
    """Links by index; ``events`` is what a bound socket would receive."""

    def __init__(self) -> None:
        self.links: dict[int, FakeMsg] = {}
        self.events: asyncio.Queue[FakeMsg | Exception] = asyncio.Queue()
        self.during_dump: Callable[[], None] | None = None
        self.opened = 0

    def set(self, index: int, name: str, flags: int, *, announce: bool = True,
            rx: int = 0, tx: int = 0) -> None:
        self.links[index] = FakeMsg("RTM_NEWLINK", name, index, flags, rx, tx)
        if announce:
            self.events.put_nowait(self.links[index])

    def open(self) -> FakeIPRoute:
        self.opened += 1
        return FakeIPRoute(self)


class FakeIPRoute:
    def __init__(self, kernel: FakeKernel) -> None:
        self.k = kernel

    async def bind(self) -> None:
        pass

    async def link(self, command: str) -> AsyncIterator[FakeMsg]:
        snapshot = list(self.k.links.values())

        async def gen() -> AsyncIterator[FakeMsg]:
            if self.k.during_dump is not None:
                hook, self.k.during_dump = self.k.during_dump, None
                hook()
                await asyncio.sleep(0)
            for m in snapshot:
                yield m
        return gen()

    async def stats(self, command: str, filter_mask: int) -> AsyncIterator[FakeMsg]:
        return await self.link("dump")

    async def get(self) -> AsyncIterator[FakeMsg]:
        item = await self.k.events.get()
        if isinstance(item, Exception):
            raise item
        yield item

    def close(self) -> None:
        pass


class Events(list[LinkEvent]):
    def emit(self, obs: Observation) -> None:
        assert isinstance(obs, LinkEvent)
        self.append(obs)


async def started(kernel: FakeKernel, sysfs_net: str = "/nonexistent", **cfg: Any
                  ) -> tuple[NicSource, Events, asyncio.Task[None]]:
    src = NicSource(NicConfig(**cfg), {}, clock=time.monotonic, sysfs_net=sysfs_net)
    src._open = kernel.open  # type: ignore[method-assign]
    events = Events()
    task = asyncio.create_task(src.run(events.emit))
    await asyncio.wait_for(src.ready.wait(), 5)
    return src, events, task


def test_source_dump_then_events_rename_and_delete() -> None:
    async def main() -> None:
        k = FakeKernel()
        k.set(1, "lo", 0x49, announce=False)
        k.set(2, "eth0", UPF, announce=False)
        k.set(3, "eth1", DOWNF, announce=False)  # down at start: not selected
        src, events, task = await started(k)
        assert src.watched() == ["eth0"] and [e.ifname for e in events] == ["eth0"]
        k.set(2, "eth0", DOWNF)
        await until(lambda: not events[-1].admin_up)
        k.set(3, "eth1", UPF)  # not watched: nothing
        k.set(2, "eth9", DOWNF)  # renamed
        await until(lambda: events[-1].deleted)
        assert events[-1].ifname == "eth0" and events[-1].operstate == "renamed to eth9"
        assert len(events) == 3
        task.cancel()

    asyncio.run(main())


def test_reconcile_corrects_a_missed_event_but_not_a_newer_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nic_source, "RECONCILE_SECONDS", 0.01)

    async def main() -> None:
        k = FakeKernel()
        k.set(2, "eth0", UPF, announce=False)
        src, events, task = await started(k, nic_poll_interval=0.01)
        k.set(2, "eth0", DOWNF, announce=False)  # the event was lost
        await until(lambda: not events[-1].up)
        # an event newer than the dump's view must win: the dump says down, the event up
        k.during_dump = lambda: src._on_message(FakeMsg("RTM_NEWLINK", "eth0", 2, UPF),
                                                events.emit)
        await until(lambda: k.during_dump is None)
        await until(lambda: events[-1].up)
        k.set(2, "eth0", UPF, announce=False)  # the kernel agrees afterwards
        n = len(events)
        await asyncio.sleep(0.1)  # several reconciles: no spurious down in between
        assert len(events) == n
        task.cancel()

    asyncio.run(main())


def test_socket_failure_reconnects_and_redumps() -> None:
    async def main() -> None:
        k = FakeKernel()
        k.set(2, "eth0", UPF, announce=False, tx=100)
        src, events, task = await started(k)
        k.events.put_nowait(OSError(105, "No buffer space available"))
        # changed while the socket was broken
        k.set(2, "eth0", DOWNF, announce=False, tx=200)
        await until(lambda: k.opened == 2 and not events[-1].up)
        assert not task.done()
        assert src.snapshot()[0].transmit_bytes == 200
        task.cancel()

    asyncio.run(main())


def _sysfs_link(root: Path, name: str, index: int, rx: int, tx: int) -> None:
    stats = root / name / "statistics"
    stats.mkdir(parents=True, exist_ok=True)
    (root / name / "ifindex").write_text(f"{index}\n")
    (stats / "rx_bytes").write_text(f"{rx}\n")
    (stats / "tx_bytes").write_text(f"{tx}\n")


async def eth0_with_sysfs(root: Path, sysfs_ifindex: int) -> tuple[
        FakeKernel, NicSource, asyncio.Task[None]]:
    """eth0 (index 2; netlink counters 1 and 2) and a sysfs tree at ``root`` naming it
    with ``sysfs_ifindex`` (counters 10 and 20), watched by a started source."""
    k = FakeKernel()
    k.set(2, "eth0", UPF, announce=False, rx=1, tx=2)
    _sysfs_link(root, "eth0", sysfs_ifindex, 10, 20)
    src, _, task = await started(k, sysfs_net=str(root), nic_poll_interval=0.01)
    return k, src, task


def test_counters_come_from_sysfs_where_it_shows_this_namespace(tmp_path: Path) -> None:
    async def main() -> None:
        _, src, task = await eth0_with_sysfs(tmp_path, 2)
        _sysfs_link(tmp_path, "eth0", 2, 1000, 2000)  # netlink still says 1 and 2
        await until(lambda: src.snapshot()[0].transmit_bytes == 2000)
        assert src.snapshot()[0].receive_bytes == 1000
        task.cancel()

    asyncio.run(main())


def test_sysfs_of_another_namespace_is_not_used_for_counters(tmp_path: Path) -> None:
    """A /sys whose eth0 has another ifindex (the host's, mounted into a pod) must not
    stand in for this namespace's eth0: the counters stay netlink's."""
    async def main() -> None:
        k, src, task = await eth0_with_sysfs(tmp_path, 7)
        k.set(2, "eth0", UPF, announce=False, rx=3, tx=4)  # the kernel's counters move
        await until(lambda: src.snapshot()[0].transmit_bytes == 4)
        assert not src._sysfs_counters
        task.cancel()

    asyncio.run(main())


def test_unreadable_sysfs_counters_fall_back_to_netlink(tmp_path: Path) -> None:
    async def main() -> None:
        k, src, task = await eth0_with_sysfs(tmp_path, 2)
        await until(lambda: src._sysfs_counters)
        (tmp_path / "eth0" / "statistics" / "tx_bytes").unlink()
        k.set(2, "eth0", UPF, announce=False, rx=5, tx=6)
        await until(lambda: src.snapshot()[0].transmit_bytes == 6)
        task.cancel()

    asyncio.run(main())
