"""How fast does ftagent see a link change, against a Prometheus scrape of node_exporter?

Creates two network namespaces joined by a veth (``eth0`` <-> ``peer0``), runs the
real :class:`ftagent.sources.nic.NicSource` on this process' event loop watching
``eth0``, and flaps the link N times from the same process through pyroute2. For each
change it takes a timestamp right after the kernel acknowledged the netlink request
and measures the time until the NicSource emits the matching ``LinkEvent``.

Modes (``--modes``, comma-separated):

* ``admin``: ``eth0`` itself set down/up (IFF_UP) -- announced by the kernel at once;
* ``carrier``: ``peer0`` set down/up in the other namespace, so ``eth0`` loses carrier;
  the veth ends have different ifindexes, which the kernel treats as urgent;
* ``carrier-phys``: the same with equal ifindexes, which the kernel's linkwatch treats
  like a physical NIC: non-urgent carrier work runs at most once a second, so this shows
  the kernel's own floor for real NICs (slow: up to ~1 s per change).

The comparison is what users have today: node_exporter scraped every 15 s (Prometheus'
default). From this run's own down/up timestamps it computes, over every scrape phase,
the delay until the next scrape and the share of outages a scrape of
``node_network_up``/``node_network_carrier`` would catch at all.

Stages: ``event`` (NicSource's LinkEvent) is measured now; ``--arbiter HOST:PORT``
(fault received by the arbiter) is reserved for when the arbiter lands -- add a probe
in ``STAGES`` that returns its receipt time. Bounded by ``--timeout``; namespaces are
always removed.

    .venv/bin/python bench/nic.py --flaps 60 --modes admin,carrier,carrier-phys
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ftagent.config import NicConfig  # noqa: E402
from ftagent.model import LinkEvent, Observation  # noqa: E402
from ftagent.sources.nic import NicSource  # noqa: E402
from tests.netns import namespaces, netns_unavailable, veth  # noqa: E402

SCRAPE_PHASES = 1000  # scrape phases averaged over for the polling comparison


@dataclass
class Change:
    """One link change: when it was requested/acknowledged, and when each stage saw it."""

    up: bool
    sent: float
    acked: float
    seen: dict[str, float] = field(default_factory=dict)


@dataclass
class ModeResult:
    mode: str
    changes: list[Change]
    missed: int


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


class EventProbe:
    """Stage ``event``: the NicSource's LinkEvent for eth0 reaching the up state wanted."""

    def __init__(self) -> None:
        self.want: tuple[bool, asyncio.Future[float]] | None = None

    def emit(self, obs: Observation) -> None:
        if not isinstance(obs, LinkEvent) or obs.ifname != "eth0" or self.want is None:
            return
        up, fut = self.want
        if obs.up == up and not fut.done():
            fut.set_result(obs.ts)

    def expect(self, up: bool) -> asyncio.Future[float]:
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.want = (up, fut)
        return fut


async def run_mode(mode: str, flaps: int, gap: float, wait: float) -> ModeResult:
    from pyroute2 import AsyncIPRoute

    with namespaces(2, prefix="ftabench") as (a, b):
        veth(a, "eth0", b, "peer0", same_index=(mode == "carrier-phys"))
        probe = EventProbe()
        src = NicSource(NicConfig(nic=("eth0",), nic_poll_interval=1.0), {}, netns=a)
        task = asyncio.create_task(src.run(probe.emit))
        ctl_ns, ctl_if = (a, "eth0") if mode == "admin" else (b, "peer0")
        ctl = AsyncIPRoute(netns=ctl_ns, flags=0)
        try:
            await asyncio.wait_for(src.ready.wait(), 10)
            (index,) = await ctl.link_lookup(ifname=ctl_if)
            changes: list[Change] = []
            missed = 0
            for _ in range(flaps):
                for up in (False, True):
                    fut = probe.expect(up)
                    sent = time.monotonic()
                    await ctl.link("set", index=index, state="up" if up else "down")
                    ch = Change(up, sent, time.monotonic())
                    try:
                        ch.seen["event"] = await asyncio.wait_for(fut, wait)
                    except asyncio.TimeoutError:
                        missed += 1
                    changes.append(ch)
                    await asyncio.sleep(gap)
            return ModeResult(mode, changes, missed)
        finally:
            ctl.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def pairs(changes: list[Change]) -> list[tuple[Change, Change]]:
    """(down, up) of each flap; changes alternate down, up."""
    return list(zip(changes[::2], changes[1::2], strict=True))


def scrape_model(changes: list[Change], interval: float) -> tuple[float, float, float]:
    """(mean delay, p99 delay, share of outages seen) for a poll every ``interval`` s.

    For each outage of this run (acknowledged down -> acknowledged up) and each of
    SCRAPE_PHASES evenly spread scrape phases: the delay from the down to the next
    scrape, and whether any scrape fell inside the outage (else the gauge never shows it).
    """
    delays: list[float] = []
    seen = 0
    outages = [(d.acked, u.acked) for d, u in pairs(changes)]
    for down, up in outages:
        for k in range(SCRAPE_PHASES):
            phase = interval * k / SCRAPE_PHASES
            nxt = down + ((phase - down) % interval)  # first scrape at or after the down
            delays.append(nxt - down)
            seen += nxt <= up
    total = len(outages) * SCRAPE_PHASES
    return (statistics.fmean(delays) if delays else float("nan"), pct(delays, 99),
            seen / total if total else float("nan"))


def summary(xs: list[float]) -> str:
    if not xs:
        return f"{'-':>9} {'-':>9} {'-':>9}"
    return f"{pct(xs, 50):>9.2f} {pct(xs, 99):>9.2f} {max(xs):>9.2f}"


def report(results: list[ModeResult], interval: float, command: str) -> None:
    """The table: per mode and direction, latency to the LinkEvent; then the scrape model."""
    ms = 1000.0
    print(f"\ncommand: {command}")
    print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs. Latency in ms to the "
          f"NicSource's LinkEvent, from the netlink request being sent / acknowledged\n"
          f"(negative from-ack: the event was handled before the requester saw its ack)\n")
    hdr = (f"{'path':<30} {'n':>4} {'miss':>4} | {'sent p50':>9} {'p99':>9} {'max':>9} | "
           f"{'ack p50':>9} {'p99':>9} {'max':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        for label, want_up in (("down", False), ("up", True)):
            cs = [c for c in r.changes if c.up == want_up]
            seen = [c for c in cs if "event" in c.seen]
            sent = [(c.seen["event"] - c.sent) * ms for c in seen]
            ack = [(c.seen["event"] - c.acked) * ms for c in seen]
            print(f"{'ftagent, ' + r.mode + ' ' + label:<30} {len(cs):>4} "
                  f"{len(cs) - len(seen):>4} | {summary(sent)} | {summary(ack)}")
    print()
    print(f"{'same outages, ' + f'{interval:g}s scrape':<30} {'outages':>8} {'median':>8} "
          f"{'delay mean':>11} {'p99':>8} {'caught':>8} | {'ftagent':>8} {'ratio':>8}")
    for r in results:
        mean, p99, share = scrape_model(r.changes, interval)
        outage = [(u.acked - d.acked) * ms for d, u in pairs(r.changes)]
        down = [(c.seen["event"] - c.sent) for c in r.changes if not c.up and "event" in c.seen]
        ours = pct(down, 50)
        print(f"{r.mode:<30} {len(outage):>8} {pct(outage, 50):>6.0f}ms {mean:>10.2f}s "
              f"{p99:>7.2f}s {share:>8.2%} | {len(down) / max(1, len(outage)):>8.0%} "
              f"{mean / ours if ours > 0 else float('nan'):>7.0f}x")
    print("\n'caught': share of these outages a scrape of node_network_up/carrier would show "
          "as down;\n'ratio': mean scrape delay / ftagent's median down latency (from sent).\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flaps", type=int, default=60, help="down/up cycles per mode (>= 50)")
    ap.add_argument("--modes", default="admin,carrier",
                    help="comma list of admin, carrier, carrier-phys")
    ap.add_argument("--gap", type=float, default=0.02, help="seconds between changes")
    ap.add_argument("--wait", type=float, default=3.0, help="seconds to wait for an event")
    ap.add_argument("--scrape-interval", type=float, default=15.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="whole-run bound")
    ap.add_argument("--arbiter", default="", metavar="HOST:PORT",
                    help="also time the arbiter's receipt of the fault (not available yet)")
    args = ap.parse_args(argv)
    command = shlex.join([os.path.relpath(sys.executable), "bench/nic.py",
                          *(argv if argv is not None else sys.argv[1:])])
    if args.arbiter:
        print("--arbiter: the arbiter stage is not implemented yet (stage 'event' only)",
              file=sys.stderr)
        return 2
    reason = netns_unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = set(modes) - {"admin", "carrier", "carrier-phys"}
    if bad:
        ap.error(f"unknown mode(s): {', '.join(sorted(bad))}")
    # SIGTERM unwinds like Ctrl-C, so the namespaces' finally blocks still run
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

    async def all_modes() -> list[ModeResult]:
        out = []
        for m in modes:
            print(f"mode {m}: {args.flaps} flaps ...", file=sys.stderr, flush=True)
            out.append(await run_mode(m, args.flaps, args.gap, args.wait))
        return out

    try:
        results: Any = asyncio.run(asyncio.wait_for(all_modes(), args.timeout))
    except asyncio.TimeoutError:
        print(f"gave up after --timeout {args.timeout:g}s", file=sys.stderr)
        return 1
    report(results, args.scrape_interval, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
