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

(a) default: stage ``event`` only, in process, as above.

(b) ``--arbiter``: the whole path to the job's decision maker. Per mode it starts a real
``ftagent arbiter`` process and a real ``ftagent run --arbiter ... --nic eth0
--nic-grace G -- sleep`` agent process, both inside namespace A (``ip netns exec``), where
they talk over A's loopback -- a veth outage never cuts the agent off its arbiter, as a
separate control network would not be cut in production. Each of ``--flaps`` outages
holds the link down until the arbiter has received the NIC fault (so every outage is
longer than the grace, and is a fault, not a flap), then brings it up and waits for the
recovery fault, the arbiter's RESTART and the barrier release of the new generation
before the next one; each outage starts after a random 0..``--jitter`` s extra, so that
outages fall at random phases of the agent's periodic timers. Measured per outage, on the
wall clock (one machine, one clock), from the link-down request being sent:

* ``link event (agent)``: the agent saw the netlink event (the fault's ``down_since_wall``);
* ``fault raised (agent)``: the agent raised the NIC fault (its ``--events-file`` entry);
* ``fault at the arbiter``: the arbiter received it (the ``ts`` of the fault's timeline
  entry, as ``ftagent status --follow --json`` streams it; matched by fault id).

Each is given raw and minus the grace (``-grace``): the grace is deliberate debouncing,
so the goal -- p99 <= 100 ms to the arbiter beyond the grace -- reads the ``-grace``
column of the ``arbiter`` row. Bounded by ``--timeout``; processes are stopped and
namespaces removed whatever happens.

    .venv/bin/python bench/nic.py --flaps 60 --modes admin,carrier,carrier-phys
    .venv/bin/python bench/nic.py --arbiter --flaps 60 --grace 0.1 --modes admin,carrier
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ftagent.config import NicConfig  # noqa: E402
from ftagent.model import LinkEvent, Observation  # noqa: E402
from ftagent.sources.nic import NicSource  # noqa: E402
from tests.netns import ip, namespaces, netns_unavailable, veth  # noqa: E402

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


def scrape_model(outages: list[tuple[float, float]],
                 interval: float) -> tuple[float, float, float]:
    """(mean delay, p99 delay, share of outages seen) for a poll every ``interval`` s.

    For each outage of this run (``(down, up)`` times, acknowledged) and each of
    SCRAPE_PHASES evenly spread scrape phases: the delay from the down to the next
    scrape, and whether any scrape fell inside the outage (else the gauge never shows it).
    """
    delays: list[float] = []
    seen = 0
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
        mean, p99, share = scrape_model([(d.acked, u.acked) for d, u in pairs(r.changes)],
                                        interval)
        outage = [(u.acked - d.acked) * ms for d, u in pairs(r.changes)]
        down = [(c.seen["event"] - c.sent) for c in r.changes if not c.up and "event" in c.seen]
        ours = pct(down, 50)
        print(f"{r.mode:<30} {len(outage):>8} {pct(outage, 50):>6.0f}ms {mean:>10.2f}s "
              f"{p99:>7.2f}s {share:>8.2%} | {len(down) / max(1, len(outage)):>8.0%} "
              f"{mean / ours if ours > 0 else float('nan'):>7.0f}x")
    print("\n'caught': share of these outages a scrape of node_network_up/carrier would show "
          "as down;\n'ratio': mean scrape delay / ftagent's median down latency (from sent).\n")


# --------------------------------------------------------------------------- (b) --arbiter

JOB = "nicbench"
NIC_DOWN = "nic (error"  # the arbiter's timeline message of a link-down NIC fault
NIC_BACK = "nic (info"  # ... and of the link's recovery


@dataclass
class Outage:
    """One outage in --arbiter mode; every time is ``time.time()`` (seconds, one clock)."""

    sent: float  # link-down request sent
    acked: float  # ... acknowledged by the kernel
    up_acked: float = 0.0  # link-up request acknowledged
    fault_id: str = ""
    arbiter: float | None = None  # the arbiter's timeline entry of the NIC fault
    event: float | None = None  # the agent saw the link event (evidence down_since_wall)
    raised: float | None = None  # the agent raised the fault (its events-file entry)


@dataclass
class ArbiterResult:
    mode: str
    grace: float
    outages: list[Outage]
    missed: int
    note: str = ""


class TimelineFollower:
    """The job's arbiter timeline as ``ftagent status --follow --json`` streams it."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._new = asyncio.Event()

    async def pump(self, stream: asyncio.StreamReader) -> None:
        async for line in stream:
            with contextlib.suppress(ValueError):
                self.entries.append(json.loads(line))
                self._new.set()

    async def wait(self, pred: Callable[[dict[str, Any]], bool], start: int,
                   timeout: float, what: str) -> dict[str, Any]:
        """The first entry from index ``start`` on that satisfies ``pred``."""
        deadline = time.monotonic() + timeout
        i = start
        while True:
            while i < len(self.entries):
                if pred(self.entries[i]):
                    return self.entries[i]
                i += 1
            self._new.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {what} in the arbiter's timeline after {timeout:g}s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._new.wait(), left)


def _is_fault(prefix: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("kind") == "fault" and str(e.get("message", "")).startswith(prefix)


def _released_after(generation: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: (e.get("action") == "release_barrier"
                      and int(e.get("generation", -1)) > generation)


async def _spawn_in(ns: str, args: list[str], out: Path,
                    stdout_pipe: bool = False) -> asyncio.subprocess.Process:
    """``ip netns exec NS python -m ftagent ARGS`` (``ip`` execs it: same pid)."""
    with out.open("ab") as f:
        return await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, sys.executable, "-m", "ftagent", *args, cwd=ROOT,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if stdout_pipe else f, stderr=f)


async def _stop(proc: asyncio.subprocess.Process, timeout: float = 5.0) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


async def _wait_file(path: Path, needle: str, timeout: float,
                     proc: asyncio.subprocess.Process) -> str:
    """The first line of ``path`` containing ``needle`` (polled; a process start is slow)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if needle in line:
                    return line
        if proc.returncode is not None:
            break
        await asyncio.sleep(0.02)
    tail = path.read_text(errors="replace")[-1500:] if path.exists() else ""
    raise RuntimeError(f"{needle!r} not in {path.name} within {timeout:g}s:\n{tail}")


async def run_arbiter_mode(mode: str, outages: int, grace: float, gap: float, jitter: float,
                           wait: float, tmp: Path, rng: random.Random) -> ArbiterResult:
    """``outages`` link outages seen by a real agent and received by a real arbiter.

    Each outage starts ``gap`` plus a random 0..``jitter`` seconds after the previous
    restart's barrier release: a fixed cadence would phase-lock the outages to the agent's
    periodic timers and measure one phase instead of their spread.
    """
    from pyroute2 import AsyncIPRoute

    logs = tmp / mode
    logs.mkdir()
    events_file = logs / "agent-events.jsonl"
    procs: list[asyncio.subprocess.Process] = []
    pump: asyncio.Task[None] | None = None
    result = ArbiterResult(mode, grace, [], 0)
    with namespaces(2, prefix="ftabench") as (a, b):
        veth(a, "eth0", b, "peer0", same_index=(mode == "carrier-phys"))
        ip("-n", a, "link", "set", "lo", "up")
        ctl_ns, ctl_if = (a, "eth0") if mode == "admin" else (b, "peer0")
        ctl = AsyncIPRoute(netns=ctl_ns, flags=0)
        try:
            arb = await _spawn_in(a, ["arbiter", "--listen", "127.0.0.1:0", "--metrics-port",
                                      "-1", "--max-restarts", "1000000"], logs / "arbiter.log")
            procs.append(arb)
            line = await _wait_file(logs / "arbiter.log", "listening on ", 30, arb)
            address = line.split("listening on ", 1)[1].strip()
            agent = await _spawn_in(a, [
                "run", "--arbiter", address, "--job", JOB, "--rank", "0", "--world-size", "1",
                "--nic", "eth0", "--nic-grace", f"{grace:g}", "--progress", "none",
                "--metrics-port", "-1", "--max-restarts", "1000000", "--stop-timeout", "2",
                "--events-file", str(events_file), "--", "sleep", "3600"], logs / "agent.log")
            procs.append(agent)
            follow = await _spawn_in(a, ["status", "--arbiter", address, JOB, "--follow",
                                         "--json"], logs / "follow.log", stdout_pipe=True)
            procs.append(follow)
            assert follow.stdout is not None
            tl = TimelineFollower()
            pump = asyncio.create_task(tl.pump(follow.stdout))
            # ready: the agent watches eth0 (its first dump is done) and was released
            await _wait_file(logs / "agent.log", "watching links eth0", 30, agent)
            rel = await tl.wait(_released_after(-1), 0, 30, "barrier release of generation 0")
            generation = int(rel["generation"])
            (index,) = await ctl.link_lookup(ifname=ctl_if)
            for _ in range(outages):
                start = len(tl.entries)
                sent = time.time()
                await ctl.link("set", index=index, state="down")
                o = Outage(sent, time.time())
                try:
                    e = await tl.wait(_is_fault(NIC_DOWN), start, wait + grace,
                                      "link-down NIC fault")
                except TimeoutError as err:
                    result.missed += 1
                    result.note = f"stopped after a miss: {err}"
                    break
                o.arbiter, o.fault_id = float(e["ts"]), str(e["fault_id"])
                start = len(tl.entries)
                await ctl.link("set", index=index, state="up")
                o.up_acked = time.time()
                result.outages.append(o)
                await tl.wait(_is_fault(NIC_BACK), start, wait, "recovery NIC fault")
                rel = await tl.wait(_released_after(generation), start, wait,
                                    "barrier release after the restart")
                generation = int(rel["generation"])
                await asyncio.sleep(gap + rng.uniform(0.0, jitter))
        finally:
            ctl.close()
            for p in reversed(procs):
                await _stop(p)
            if pump is not None:
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
    # the agent's side of each outage, matched by fault id
    agent_side: dict[str, dict[str, Any]] = {}
    if events_file.exists():
        for line in events_file.read_text().splitlines():
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if ev.get("event") == "fault" and ev.get("kind") == "nic":
                    agent_side[str(ev.get("fault_id"))] = ev
    for o in result.outages:
        ev = agent_side.get(o.fault_id)
        if ev is not None:
            o.raised = float(ev["ts"])
            if isinstance(ev.get("down_since_wall"), (int, float)):
                o.event = float(ev["down_since_wall"])
    return result


def report_arbiter(results: list[ArbiterResult], interval: float, command: str) -> None:
    """Per mode and stage: latency from the link-down request, raw and minus the grace;
    the goal check; then the same outages seen through a node_exporter scrape."""
    ms = 1000.0
    grace = results[0].grace if results else 0.0
    print(f"\ncommand: {command}")
    print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs. (b) NIC fault to the arbiter: "
          f"a real `ftagent run` agent process (--nic eth0 --nic-grace {grace:g}) and a real "
          "`ftagent arbiter`\nprocess in one namespace (over its loopback). Latency in ms on "
          "the wall clock from the link-down request being sent;\n'-grace' subtracts the "
          "deliberate debounce (--nic-grace).\n")
    hdr = (f"{'mode: stage':<36} {'n':>4} {'miss':>4} | {'raw p50':>9} {'p99':>9} {'max':>9} | "
           f"{'-grace p50':>10} {'p99':>9} {'max':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        n = len(r.outages) + r.missed
        stages: list[tuple[str, Callable[[Outage], float | None], bool]] = [
            ("link event (agent)", lambda o: o.event, False),
            ("fault raised (agent)", lambda o: o.raised, True),
            ("fault at the arbiter", lambda o: o.arbiter, True),
        ]
        for label, get, minus in stages:
            xs = [(t - o.sent) * ms for o in r.outages if (t := get(o)) is not None]
            less = [x - r.grace * ms for x in xs] if minus else []
            print(f"{r.mode + ': ' + label:<36} {n:>4} {n - len(xs):>4} | {summary(xs)} | "
                  f"{summary(less):>30}")
        acks = [(o.acked - o.sent) * ms for o in r.outages]
        print(f"{r.mode + ': (request -> ack)':<36} {len(acks):>4} {'':>4} | {summary(acks)} |")
        if r.note:
            print(f"  {r.mode}: {r.note}")
    print()
    for r in results:
        beyond = [(o.arbiter - o.sent - r.grace) * ms for o in r.outages
                  if o.arbiter is not None]
        p99 = pct(beyond, 99)
        verdict = "met" if beyond and not r.missed and p99 <= 100 else "NOT met"
        print(f"goal p99 <= 100 ms to the arbiter beyond the grace, {r.mode}: p99 {p99:.1f} ms "
              f"over {len(beyond)} outages: {verdict}")
    print()
    print(f"{'same outages, ' + f'{interval:g}s scrape':<30} {'outages':>8} {'median':>8} "
          f"{'delay mean':>11} {'p99':>8} {'caught':>8} | {'arbiter p50':>11} {'ratio':>7}")
    for r in results:
        spans = [(o.acked, o.up_acked) for o in r.outages]
        mean, p99, share = scrape_model(spans, interval)
        length = [(u - d) * ms for d, u in spans]
        ours = pct([o.arbiter - o.sent for o in r.outages if o.arbiter is not None], 50)
        print(f"{r.mode:<30} {len(spans):>8} {pct(length, 50):>6.0f}ms {mean:>10.2f}s "
              f"{p99:>7.2f}s {share:>8.2%} | {ours * ms:>9.0f}ms "
              f"{mean / ours if ours > 0 else float('nan'):>6.0f}x")
    print("\nscrape columns: delay from the link down to the next scrape of node_network_up/"
          "carrier (before any\nalert rule evaluation, `for:` or Alertmanager); 'caught': share "
          "of these outages a scrape would show at all;\n'ratio': mean scrape delay / ftagent's "
          "median raw latency to the arbiter (grace included).\n")


def _sigterm_handler(main_pid: int) -> Callable[[int, Any], None]:
    """SIGTERM unwinds the benchmark like Ctrl-C -- in this process only.

    pyroute2 opens a socket in another namespace from a forked child and then terminates
    that child with SIGTERM; the child inherits this handler, and raising there would run
    a second copy of the benchmark (and its cleanup) from the fork point. A child dies as
    SIGTERM's default would have it.
    """
    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            os._exit(128 + signum)
        raise KeyboardInterrupt

    return handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flaps", type=int, default=60, help="down/up cycles per mode (>= 50)")
    ap.add_argument("--modes", default="admin,carrier",
                    help="comma list of admin, carrier, carrier-phys")
    ap.add_argument("--gap", type=float, default=0.02, help="seconds between changes")
    ap.add_argument("--wait", type=float, default=3.0, help="seconds to wait for an event")
    ap.add_argument("--scrape-interval", type=float, default=15.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="whole-run bound")
    ap.add_argument("--arbiter", action="store_true",
                    help="(b): time the NIC fault to a real arbiter process, from a real "
                    "`ftagent run` agent process (both started here, in a namespace)")
    ap.add_argument("--grace", type=float, default=0.1,
                    help="--nic-grace of the agent in --arbiter mode (seconds)")
    ap.add_argument("--jitter", type=float, default=0.3,
                    help="--arbiter mode: random extra 0..JITTER s before each outage, so "
                    "outages fall at random phases of the agent's timers")
    ap.add_argument("--seed", type=int, default=1, help="seed of the jitter")
    args = ap.parse_args(argv)
    command = shlex.join([os.path.relpath(sys.executable), "bench/nic.py",
                          *(argv if argv is not None else sys.argv[1:])])
    reason = netns_unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = set(modes) - {"admin", "carrier", "carrier-phys"}
    if bad:
        ap.error(f"unknown mode(s): {', '.join(sorted(bad))}")
    if args.grace < 0:
        ap.error("--grace must be >= 0")
    # SIGTERM unwinds like Ctrl-C, so the namespaces' finally blocks still run
    signal.signal(signal.SIGTERM, _sigterm_handler(os.getpid()))

    async def all_modes() -> list[ModeResult]:
        out = []
        for m in modes:
            print(f"mode {m}: {args.flaps} flaps ...", file=sys.stderr, flush=True)
            out.append(await run_mode(m, args.flaps, args.gap, args.wait))
        return out

    async def all_arbiter_modes(tmp: Path) -> list[ArbiterResult]:
        rng = random.Random(args.seed)
        out = []
        for m in modes:
            print(f"mode {m}: {args.flaps} outages to the arbiter ...", file=sys.stderr,
                  flush=True)
            out.append(await run_arbiter_mode(m, args.flaps, args.grace, args.gap,
                                              args.jitter, args.wait, tmp, rng))
        return out

    with tempfile.TemporaryDirectory(prefix="ftagent-nicbench-") as tmp:
        try:
            if args.arbiter:
                got: Any = asyncio.run(asyncio.wait_for(all_arbiter_modes(Path(tmp)),
                                                        args.timeout))
            else:
                got = asyncio.run(asyncio.wait_for(all_modes(), args.timeout))
        except asyncio.TimeoutError:
            print(f"gave up after --timeout {args.timeout:g}s", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted (processes stopped, namespaces removed)", file=sys.stderr)
            return 130
        except (RuntimeError, TimeoutError) as e:
            print(f"failed: {e}", file=sys.stderr)
            for log in sorted(Path(tmp).glob("*/*.log")):
                tail = log.read_text(errors="replace")[-1500:]
                print(f"--- {log.relative_to(tmp)} (tail)\n{tail}", file=sys.stderr)
            return 1
    if args.arbiter:
        report_arbiter(got, args.scrape_interval, command)
        return 0 if all(not r.missed for r in got) else 1
    report(got, args.scrape_interval, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
