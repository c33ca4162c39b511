"""Byte counters -> rates, and the sysfs counter readers the NIC sources share.

Kernel and HCA byte counters only ever grow, except when they do not: a driver reload,
a link re-created under the same name or a port reset start them again from zero. A
counter that goes backwards is therefore read as a reset (the new value is what was
counted since the reset), never as a negative rate -- the same rule Prometheus'
``rate()`` applies. Everything here takes the time as an argument, so tests drive it
with a fake clock.

Where counters come from:

* links in the agent's own network namespace: ``/sys/class/net/<if>/statistics`` or,
  equally, ``IFLA_STATS64`` in netlink link messages. ``/sys/class/net`` shows only the
  namespace sysfs was mounted in, so :class:`~ftagent.sources.nic.NicSource` reads the
  netlink counters (right in any namespace) and falls back to sysfs only when a kernel
  omits ``IFLA_STATS64``;
* RDMA ports: ``<root>/<dev>/ports/<n>/counters/port_{xmit,rcv}_data``, in units of
  4 bytes (InfiniBand counts data in 32-bit words).
"""

from __future__ import annotations

import os
from collections import deque

# Prometheus scrapes every 15 s by default: a 10 s window smooths per-poll noise and is
# still fresh at every scrape.
RATE_WINDOW_SECONDS = 10.0

# IB data counters count 4-byte words (IBA PortCounters PortXmitData/PortRcvData).
IB_DATA_WORD_BYTES = 4


class CounterRate:
    """The rate of one monotonically increasing counter over a sliding time window.

    ``update(value, now)`` feeds a raw reading; ``total`` is the sum of increases seen
    (a reset-proof running count) and ``rate`` bytes per second over the last
    ``window`` seconds (0.0 until two readings exist).
    """

    def __init__(self, window: float = RATE_WINDOW_SECONDS) -> None:
        if window <= 0:
            raise ValueError("window must be > 0")
        self.window = window
        self.last_value: int | None = None
        self.total = 0
        self.resets = 0
        # (time, running total); one sample older than the window is kept as the anchor.
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, value: int, now: float) -> float:
        """Record a reading taken at ``now`` (monotonic seconds); return the current rate."""
        if self.last_value is not None:
            if value >= self.last_value:
                self.total += value - self.last_value
            else:  # counter went backwards: it restarted from zero
                self.total += value
                self.resets += 1
        self.last_value = value
        if self._samples and now <= self._samples[-1][0]:
            # same instant (or a clock that did not advance): keep the newest total only
            self._samples[-1] = (self._samples[-1][0], self.total)
        else:
            self._samples.append((now, self.total))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()
        return self.rate

    @property
    def rate(self) -> float:
        """Increase per second between the oldest and newest sample in the window."""
        if len(self._samples) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


class LinkRates:
    """Receive and transmit rates of one link or port."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS) -> None:
        self.receive = CounterRate(window)
        self.transmit = CounterRate(window)

    def update(self, receive_bytes: int, transmit_bytes: int, now: float) -> None:
        self.receive.update(receive_bytes, now)
        self.transmit.update(transmit_bytes, now)


def read_int(path: str) -> int | None:
    """An integer sysfs attribute, or None if the file is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            return int(f.read().strip() or b"0")
    except (OSError, ValueError):
        return None


def read_sysfs_counters(root: str, ifname: str) -> tuple[int, int] | None:
    """(rx_bytes, tx_bytes) of a link from ``<root>/<ifname>/statistics``, or None.

    ``root`` is normally ``/sys/class/net``; tests point it at a tree they build.
    """
    stats = os.path.join(root, ifname, "statistics")
    rx = read_int(os.path.join(stats, "rx_bytes"))
    tx = read_int(os.path.join(stats, "tx_bytes"))
    if rx is None or tx is None:
        return None
    return rx, tx


def read_ib_data_counters(port_dir: str) -> tuple[int, int] | None:
    """(receive_bytes, transmit_bytes) of an RDMA port directory, or None.

    The sysfs values are 4-byte words; this returns bytes.
    """
    counters = os.path.join(port_dir, "counters")
    rcv = read_int(os.path.join(counters, "port_rcv_data"))
    xmit = read_int(os.path.join(counters, "port_xmit_data"))
    if rcv is None or xmit is None:
        return None
    return rcv * IB_DATA_WORD_BYTES, xmit * IB_DATA_WORD_BYTES
