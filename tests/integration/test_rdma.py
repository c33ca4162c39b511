"""RdmaSource against a sysfs tree built in tmp_path: states, counters, filter, debounce."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from ftagent.config import NicConfig
from ftagent.detect.nic import NicDetector
from ftagent.model import Fault, LinkEvent, Observation
from ftagent.sources.rdma import RdmaSource, parse_rate, parse_state, scan


def make_port(root: Path, dev: str, port: int, *, state: str = "4: ACTIVE",
              phys: str = "5: LinkUp", rate: str = "100 Gb/sec (4X EDR)",
              rcv: int = 0, xmit: int = 0) -> Path:
    d = root / dev / "ports" / str(port)
    (d / "counters").mkdir(parents=True)
    (d / "state").write_text(state + "\n")
    (d / "phys_state").write_text(phys + "\n")
    (d / "rate").write_text(rate + "\n")
    (d / "counters" / "port_rcv_data").write_text(f"{rcv}\n")
    (d / "counters" / "port_xmit_data").write_text(f"{xmit}\n")
    return d


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_parsers() -> None:
    assert parse_state("4: ACTIVE\n") == (4, "ACTIVE")
    assert parse_state("5: LinkUp") == (5, "LinkUp")
    assert parse_state("weird") == (0, "weird")
    assert parse_rate("100 Gb/sec (4X EDR)") == 12.5e9
    assert parse_rate("2.5 Gb/sec (1X SDR)") == pytest.approx(2.5e9 / 8)
    assert parse_rate("") == 0.0


def test_state_changes_become_link_events(tmp_path: Path) -> None:
    p1 = make_port(tmp_path, "mlx5_0", 1, rcv=1000, xmit=250)
    make_port(tmp_path, "mlx5_1", 1)
    clock = Clock()
    src = RdmaSource(NicConfig(), {}, root=str(tmp_path), clock=clock)
    first = src.poll()
    assert [e.ifname for e in first] == ["mlx5_0/1", "mlx5_1/1"]
    assert all(e.up for e in first)
    assert src.poll() == []  # nothing changed

    (p1 / "state").write_text("1: DOWN\n")
    (p1 / "phys_state").write_text("2: Polling\n")
    (ev,) = src.poll()
    assert ev.ifname == "mlx5_0/1" and ev.admin_up and not ev.carrier
    assert ev.operstate == "DOWN/Polling" and ev.index == 1

    (p1 / "phys_state").write_text("3: Disabled\n")
    (ev,) = src.poll()
    assert not ev.admin_up  # switched off: the IB analogue of admin down

    (p1 / "state").write_text("2: INIT\n")
    (p1 / "phys_state").write_text("5: LinkUp\n")
    (ev,) = src.poll()
    assert ev.admin_up and not ev.carrier  # link trained, subnet manager not done yet


def test_counters_are_bytes_with_rates(tmp_path: Path) -> None:
    p = make_port(tmp_path, "mlx5_0", 1, rcv=1000, xmit=250)
    clock = Clock()
    src = RdmaSource(NicConfig(), {}, root=str(tmp_path), clock=clock)
    src.poll()
    (st,) = src.snapshot()
    assert (st.device, st.port, st.state_id, st.phys_state_id) == ("mlx5_0", "1", 4, 5)
    assert (st.receive_bytes, st.transmit_bytes) == (4000, 1000)
    assert st.rate_bytes_per_second == 12.5e9
    clock.now += 2.0
    (p / "counters" / "port_rcv_data").write_text("3000\n")
    (p / "counters" / "port_xmit_data").write_text("10\n")  # went backwards: reset
    src.poll()
    rx_bps, tx_bps = src.bandwidth()["mlx5_0/1"]
    assert rx_bps == pytest.approx((12000 - 4000) / 2)
    assert tx_bps == pytest.approx(40 / 2)
    (st,) = src.snapshot()  # the collector exports the same rates
    assert (st.receive_bps, st.transmit_bps) == (rx_bps, tx_bps)


def test_nccl_ib_hca_filters_devices_and_ports(tmp_path: Path) -> None:
    make_port(tmp_path, "mlx5_0", 1)
    make_port(tmp_path, "mlx5_0", 2)
    make_port(tmp_path, "mlx5_1", 1)
    make_port(tmp_path, "bnxt_re0", 1)
    src = RdmaSource(NicConfig(), {"NCCL_IB_HCA": "mlx5_0:1,mlx5_1"}, root=str(tmp_path))
    assert [e.ifname for e in src.poll()] == ["mlx5_0/1", "mlx5_1/1"]
    excl = scan(str(tmp_path), None)
    assert len(excl) == 4


def test_vanished_port_is_deleted_and_missing_root_is_quiet(tmp_path: Path) -> None:
    make_port(tmp_path, "mlx5_0", 1)
    src = RdmaSource(NicConfig(), {}, root=str(tmp_path))
    src.poll()
    shutil.rmtree(tmp_path / "mlx5_0")
    (ev,) = src.poll()
    assert ev.deleted and ev.ifname == "mlx5_0/1"
    assert src.snapshot() == []
    none = RdmaSource(NicConfig(), {}, root=str(tmp_path / "absent"))
    assert none.poll() == []
    asyncio.run(asyncio.wait_for(none.run(lambda _: None), 5))  # returns at once


def test_run_polls_on_the_loop_and_debounce_applies(tmp_path: Path) -> None:
    p = make_port(tmp_path, "mlx5_0", 1)
    det = NicDetector(grace=0.2)
    src = RdmaSource(NicConfig(nic_poll_interval=0.02), {}, root=str(tmp_path),
                     flaps=det.flaps)
    events: list[LinkEvent] = []
    faults: list[Fault] = []

    def emit(obs: Observation) -> None:
        assert isinstance(obs, LinkEvent)
        events.append(obs)
        faults.extend(det.observe(obs))

    async def until(cond: object, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():  # type: ignore[operator]
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)
            faults.extend(det.tick(time.monotonic()))

    async def main() -> None:
        task = asyncio.create_task(src.run(emit))
        try:
            await until(lambda: events)
            (p / "state").write_text("1: DOWN\n")
            await until(lambda: events[-1].carrier is False)
            await until(lambda: faults)
            assert faults[0].evidence == faults[0].evidence | {
                "device": "mlx5_0/1", "reason": "carrier_lost"}
            (p / "state").write_text("4: ACTIVE\n")
            await until(lambda: len(faults) == 2)
            assert faults[1].evidence["recovered"] is True
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert src.snapshot()[0].state_id == 4
