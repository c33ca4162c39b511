"""RDMA (InfiniBand / RoCE) ports from sysfs, polled: RDMA netlink has no port-state events.

Each port is ``<root>/<dev>/ports/<n>/`` with ``state`` (``4: ACTIVE``), ``phys_state``
(``5: LinkUp``), ``rate`` (``100 Gb/sec (4X EDR)``) and ``counters/port_{xmit,rcv}_data``
(4-byte words). The root is ``--rdma-sysfs`` so tests point it at a tree they build.

A port becomes a :class:`~ftagent.model.LinkEvent` named ``<dev>/<port>`` (``mlx5_0/1``),
so the same debounce (:mod:`ftagent.detect.nic`) judges NICs and HCAs alike:

* ``admin_up`` is false only for phys_state 3 *Disabled* -- the port was switched off,
  the IB analogue of ``ip link set down``;
* ``carrier`` is logical state ACTIVE (4) with phys_state LinkUp (5). Polling (no cable,
  no peer), a training or error-recovering link, or INIT/ARMED (the subnet manager has
  not configured the port) all mean traffic cannot flow, which is what carrier loss
  means to the job.

The files are tiny, but on real HCAs reading a counter can be a firmware command (ms),
so each poll runs in a worker thread; state is only touched on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ftagent.config import NicConfig
from ftagent.model import IbPortStats, LinkEvent, Observation
from ftagent.sources.netstats import LinkRates, read_ib_data_counters
from ftagent.sources.nic import NameList
from ftagent.timegrid import sleep_on_grid

log = logging.getLogger("ftagent.sources.rdma")

STATE_ACTIVE = 4
PHYS_DISABLED = 3
PHYS_LINK_UP = 5
_RATE = re.compile(r"([0-9.]+)\s*([GM])b/sec")


@dataclass(frozen=True)
class RdmaPort:
    """One port as read from sysfs."""

    device: str
    port: int
    state_id: int
    state: str  # "ACTIVE", "DOWN", "INIT", ...
    phys_state_id: int
    phys_state: str  # "LinkUp", "Polling", "Disabled", ...
    rate_bytes_per_second: float
    receive_bytes: int | None
    transmit_bytes: int | None

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"

    def link_event(self, ts: float) -> LinkEvent:
        return LinkEvent(
            ifname=self.name,
            admin_up=self.phys_state_id != PHYS_DISABLED,
            carrier=self.state_id == STATE_ACTIVE and self.phys_state_id == PHYS_LINK_UP,
            operstate=f"{self.state}/{self.phys_state}",
            index=self.port, ts=ts)


def parse_state(text: str) -> tuple[int, str]:
    """``"4: ACTIVE"`` -> ``(4, "ACTIVE")``; anything unreadable -> ``(0, text)``."""
    num, sep, name = text.strip().partition(":")
    if sep and num.strip().isdigit():
        return int(num), name.strip()
    return 0, text.strip()


def parse_rate(text: str) -> float:
    """``"100 Gb/sec (4X EDR)"`` -> 12.5e9 bytes per second; unreadable -> 0.0."""
    m = _RATE.search(text)
    if not m:
        return 0.0
    bits = float(m.group(1)) * (1e9 if m.group(2) == "G" else 1e6)
    return bits / 8


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def read_port(root: str, device: str, port: int) -> RdmaPort | None:
    """One port's files, or None if the port vanished while being read."""
    d = os.path.join(root, device, "ports", str(port))
    state, phys = _read(os.path.join(d, "state")), _read(os.path.join(d, "phys_state"))
    if state is None or phys is None:
        return None
    state_id, state_name = parse_state(state)
    phys_id, phys_name = parse_state(phys)
    counters = read_ib_data_counters(d)
    return RdmaPort(device, port, state_id, state_name, phys_id, phys_name,
                    parse_rate(_read(os.path.join(d, "rate")) or ""),
                    counters[0] if counters else None, counters[1] if counters else None)


def scan(root: str, hca: NameList | None = None) -> list[RdmaPort]:
    """Every port under ``root`` that ``hca`` (``NCCL_IB_HCA``) selects, sorted by name."""
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    out: list[RdmaPort] = []
    for dev in devices:
        try:
            ports = sorted(int(p) for p in os.listdir(os.path.join(root, dev, "ports"))
                           if p.isdigit())
        except OSError:
            continue
        for port in ports:
            if hca is not None and not hca.selects(dev, port):
                continue
            p = read_port(root, dev, port)
            if p is not None:
                out.append(p)
    return out


class RdmaSource:
    """Polls RDMA ports every ``--nic-poll-interval``; ``run(emit)`` until cancelled.

    ``poll()`` is one synchronous scan-and-diff returning the LinkEvents it would emit
    (tests call it directly). ``flaps`` gives ``snapshot()`` the detector's counts.
    """

    def __init__(self, cfg: NicConfig, environ: Mapping[str, str], *,
                 root: str | None = None, clock: Callable[[], float] = time.monotonic,
                 flaps: Callable[[str], int] = lambda _: 0) -> None:
        self.cfg = cfg
        self.root = root if root is not None else cfg.rdma_sysfs
        self.clock = clock
        self.flaps = flaps
        spec = environ.get("NCCL_IB_HCA", "").strip()
        self.hca = NameList.parse(spec) if spec else None
        self._ports: dict[str, RdmaPort] = {}
        self._events: dict[str, LinkEvent] = {}
        self._rates: dict[str, LinkRates] = {}
        self._scanned = False

    def poll(self) -> list[LinkEvent]:
        return self._apply(scan(self.root, self.hca))

    async def run(self, emit: Callable[[Observation], None]) -> None:
        if not os.path.isdir(self.root):
            log.info("no RDMA devices (%s does not exist); RDMA port watch off", self.root)
            return
        while True:
            ports = await asyncio.to_thread(scan, self.root, self.hca)
            for ev in self._apply(ports):
                emit(ev)
            await sleep_on_grid(self.cfg.nic_poll_interval)

    def snapshot(self) -> list[IbPortStats]:
        """The ports now, for the scrape-time collector (safe from the metrics thread:
        ``_ports`` is replaced whole by each poll, never changed in place)."""
        rates = self.bandwidth()
        return [IbPortStats(device=p.device, port=str(p.port), state_id=p.state_id,
                            phys_state_id=p.phys_state_id,
                            rate_bytes_per_second=p.rate_bytes_per_second,
                            receive_bytes=p.receive_bytes or 0,
                            transmit_bytes=p.transmit_bytes or 0,
                            receive_bps=rates.get(p.name, (0.0, 0.0))[0],
                            transmit_bps=rates.get(p.name, (0.0, 0.0))[1])
                for p in self._ports.values()]

    def bandwidth(self) -> dict[str, tuple[float, float]]:
        """``{"mlx5_0/1": (receive_bps, transmit_bps)}`` over the rate window."""
        return {n: (r.receive.rate, r.transmit.rate) for n, r in list(self._rates.items())}

    def _apply(self, ports: list[RdmaPort]) -> list[LinkEvent]:
        """Diff a scan against the last one: events for changes, rates for counters."""
        now = self.clock()
        if not self._scanned:
            self._scanned = True
            log.info("watching RDMA ports %s%s", ", ".join(p.name for p in ports) or "(none)",
                     " (NCCL_IB_HCA)" if self.hca else "")
        events: list[LinkEvent] = []
        current = {p.name: p for p in ports}
        for name, p in current.items():
            ev = p.link_event(now)
            old = self._events.get(name)
            if old is None or (old.admin_up, old.carrier, old.operstate) != (
                    ev.admin_up, ev.carrier, ev.operstate):
                events.append(ev)
                self._events[name] = ev
            if p.receive_bytes is not None and p.transmit_bytes is not None:
                self._rates.setdefault(name, LinkRates()).update(
                    p.receive_bytes, p.transmit_bytes, now)
        for name in [n for n in self._events if n not in current]:
            old = self._events.pop(name)
            self._rates.pop(name, None)
            events.append(LinkEvent(ifname=name, admin_up=False, carrier=False,
                                    operstate="deleted", index=old.index, deleted=True,
                                    ts=now))
        self._ports = current
        return events
