"""The arbiter's control plane while one peer sends its worst legal messages.

    .venv/bin/python bench/hostile.py [--seconds 10] [--stacks-bytes N] [--attacks A,B]

A real arbiter (``python -m ftagent arbiter`` on loopback, /healthz on its metrics port)
and, in this process, a prober that calls ``ListJobs`` and ``GET /healthz`` (a new
connection each time) every ``--interval`` seconds, each with a 2 s deadline (a call past
it counts as 2 s). One quiet 2-rank job is registered so that ListJobs lists something.
First ``--seconds`` idle, then ``--seconds`` while an attacker -- one job token's worth of
peers, in its own process (``--attacker``) -- sends, as fast as the arbiter takes them:

* job hangs, each answered by every rank with a Stacks message of ``--stacks-bytes`` of
  py-spy text made of whitespace lines (the shape that froze the arbiter 2.4-4.4 s in
  issue 20), solicited: the arbiter asked for them;
* the same stacks unsolicited, from another stream of the job;
* faults with the largest legal message (4 KiB) and evidence (256 KiB of JSON);
* Hellos of new jobs of 1,000,000 ranks on fresh streams.

It prints the worst and p99 latency of each call idle and under attack in the same run,
and their ratio; the goal (issue 20) is a worst latency under attack of at most 100 ms.
With ``--lease`` the arbiter runs with ``--leader-elect`` against the project's fake API
server (tests/kube_fake: real HTTP, the real kubernetes client; renewal every 0.5 s) and
the prober also reads the Lease: the longest gap between two renewals in each phase, and
whether the arbiter stayed the holder.
``measure`` is what ``tests/integration/test_hostile_bench.py`` runs, shorter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CONNECT = "/ftagent.v1.Arbiter/Connect"
LIST_JOBS = "/ftagent.v1.Arbiter/ListJobs"
DEADLINE = 2.0  # a call that takes longer counts as this long
MAX_STACKS = 512 * 1024  # ftagent.wire.limits.MAX_STACKS (not imported: the bench runs
# against older trees too, to compare)
GOAL = 0.100
MAX_RANKS_PER_JOB = 100_000  # ftagent.arbiter.registry's (--max-ranks-per-job): the largest
# world a Hello may claim


def whitespace_stacks(size: int) -> str:
    """A Stacks payload of about ``size`` bytes: py-spy text of whitespace lines."""
    return json.dumps({"processes": [{"pid": 1, "stack": " \n" * max(1, (size - 40) // 3)}]})


# --------------------------------------------------------------------------- attacker


ATTACKS = ("hang", "unsolicited", "faults", "hellos")


async def attack(address: str, seconds: float, stacks_bytes: int,
                 attacks: tuple[str, ...] = ATTACKS) -> dict[str, int]:
    """Send the worst legal messages for ``seconds``; returns how many of each were sent."""
    import grpc

    from ftagent.v1 import ftagent_pb2 as pb

    sent = {"stacks_solicited": 0, "stacks_unsolicited": 0, "faults": 0, "hellos": 0}
    stacks = whitespace_stacks(stacks_bytes)
    end = time.monotonic() + seconds
    channel = grpc.aio.insecure_channel(address, options=[
        ("grpc.max_send_message_length", 32 * 1024 * 1024)])

    def hello(job: str, rank: int, world: int) -> bytes:
        return pb.AgentMessage(hello=pb.Hello(
            job=job, rank=rank, world_size=world, agent_instance=f"{job}-{rank}",
            max_restarts=2**31 - 1)).SerializeToString()

    async def hang_loop() -> None:
        """Two ranks of one job: a hang, stacks from both when asked, again."""
        calls = [channel.stream_stream(CONNECT)() for _ in range(2)]
        for r, c in enumerate(calls):
            await c.write(hello("hostile-hang", r, 2))
            await c.read()  # Welcome
        gen, n = 0, 0
        locks = [asyncio.Lock(), asyncio.Lock()]

        async def answer(r: int) -> None:
            nonlocal gen
            c = calls[r]
            while True:
                raw = await c.read()
                if raw is grpc.aio.EOF:
                    return
                m = pb.ArbiterMessage.FromString(raw)
                if m.WhichOneof("body") != "command":
                    continue
                cmd = m.command
                gen = max(gen, cmd.generation)
                async with locks[r]:
                    await c.write(pb.AgentMessage(ack=pb.Ack(command_id=cmd.id))
                                  .SerializeToString())
                    if cmd.kind == pb.COMMAND_KIND_DUMP_STACKS:
                        await c.write(pb.AgentMessage(stacks=pb.Stacks(
                            command_id=cmd.id, json=stacks)).SerializeToString())
                        sent["stacks_solicited"] += 1
                    elif cmd.kind == pb.COMMAND_KIND_RESTART:
                        await c.write(pb.AgentMessage(arrival=pb.BarrierArrival(
                            generation=cmd.generation, previous_trainer_exited=True))
                            .SerializeToString())

        readers = [asyncio.create_task(answer(r)) for r in range(2)]
        try:
            while time.monotonic() < end:
                n += 1
                async with locks[0]:
                    await calls[0].write(pb.AgentMessage(fault=pb.Fault(
                        id=f"hang-{n}", kind=pb.FAULT_KIND_HANG, severity=pb.SEVERITY_ERROR,
                        message="hung", generation=gen)).SerializeToString())
                await asyncio.sleep(0.05)
        finally:
            for t in readers:
                t.cancel()

    async def unsolicited_loop() -> None:
        c = channel.stream_stream(CONNECT)()
        await c.write(hello("hostile-stacks", 0, 1))
        await c.read()
        msg = pb.AgentMessage(stacks=pb.Stacks(command_id="x", json=stacks)).SerializeToString()
        while time.monotonic() < end:
            await c.write(msg)
            sent["stacks_unsolicited"] += 1

    async def fault_loop() -> None:
        c = channel.stream_stream(CONNECT)()
        await c.write(hello("hostile-faults", 0, 1))
        await c.read()
        evidence = json.dumps({"last_lines": ["x" * 1000] * 250})[: 256 * 1024]
        reader = asyncio.create_task(_drain(c, grpc))
        n = 0
        try:
            while time.monotonic() < end:
                n += 1
                await c.write(pb.AgentMessage(fault=pb.Fault(
                    id=f"f-{n}", kind=pb.FAULT_KIND_CRASH, severity=pb.SEVERITY_ERROR,
                    message="\x1b[2J" + "m" * 4090, evidence_json=evidence,
                    exit_status=1)).SerializeToString())
                sent["faults"] += 1
        finally:
            reader.cancel()

    async def hello_loop() -> None:
        n = 0
        while time.monotonic() < end:
            n += 1
            c = channel.stream_stream(CONNECT)()
            await c.write(hello(f"hostile-job-{n}", n % 1000, MAX_RANKS_PER_JOB))
            await c.read()
            sent["hellos"] += 1
            c.cancel()

    loops = {"hang": hang_loop, "unsolicited": unsolicited_loop, "faults": fault_loop,
             "hellos": hello_loop}
    tasks = [asyncio.create_task(loops[a]()) for a in attacks]
    await asyncio.wait(tasks, timeout=seconds + 5)
    for t in tasks:
        t.cancel()
    await channel.close(None)
    return sent


async def _drain(call: Any, grpc: Any) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass


# --------------------------------------------------------------------------- prober


@dataclass
class Latencies:
    list_jobs: list[float] = field(default_factory=list)
    healthz: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)  # failed calls, by what failed
    renewals: list[tuple[float, str]] = field(default_factory=list)  # (seen at, holder)


LEASE_NS, LEASE = "ftagent-system", "ftagent-arbiter"
RETRY = 0.5


def lease_args(url: str) -> tuple[str, ...]:
    return ("--leader-elect", "--kube-api", url, "--leader-elect-namespace", LEASE_NS,
            "--leader-elect-lease", LEASE, "--leader-elect-lease-duration", "3",
            "--leader-elect-renew-deadline", "2", "--leader-elect-retry-period", str(RETRY))


def max_gap(renewals: list[tuple[float, str]], start: float, end: float) -> float:
    """The longest time between renewals seen in [start, end] (edges included)."""
    times = [start] + [t for t, _ in renewals if start <= t <= end] + [end]
    return max(b - a for a, b in zip(times, times[1:], strict=False))


async def probe(address: str, http_port: int, seconds: float, interval: float,
                lease: Any = None) -> Latencies:
    """Calls every ``interval`` for ``seconds``; ``lease()`` -> (renewTime, holder) too."""
    import grpc

    from ftagent.v1 import ftagent_pb2 as pb

    out = Latencies()
    last_renew = ""
    channel = grpc.aio.insecure_channel(address)
    list_jobs = channel.unary_unary(LIST_JOBS)
    request = pb.ListJobsRequest().SerializeToString()
    end = time.monotonic() + seconds

    async def healthz() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", http_port)
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await w.drain()
        status = await r.readline()
        await r.read()
        w.close()
        if b" 200 " not in status:
            raise RuntimeError(f"/healthz answered {status!r}")

    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            await list_jobs(request, timeout=DEADLINE)
            out.list_jobs.append(time.monotonic() - t0)
        except grpc.aio.AioRpcError as e:
            out.list_jobs.append(DEADLINE)
            what = f"ListJobs {e.code().name}"
            out.errors[what] = out.errors.get(what, 0) + 1
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(healthz(), DEADLINE)
            out.healthz.append(time.monotonic() - t0)
        except (asyncio.TimeoutError, OSError, RuntimeError) as e:
            out.healthz.append(DEADLINE)
            what = f"healthz {type(e).__name__}"
            out.errors[what] = out.errors.get(what, 0) + 1
        if lease is not None:
            renew, holder = await asyncio.to_thread(lease)
            if renew != last_renew:
                out.renewals.append((time.monotonic(), holder))
                last_renew = renew
        await asyncio.sleep(interval)
    await channel.close(None)
    return out


async def quiet_job(address: str) -> Any:
    """A 2-rank job that stays connected (something for ListJobs to list)."""
    import grpc

    from ftagent.v1 import ftagent_pb2 as pb

    channel = grpc.aio.insecure_channel(address)
    calls = []
    for r in range(2):
        c = channel.stream_stream(CONNECT)()
        await c.write(pb.AgentMessage(hello=pb.Hello(
            job="quiet", rank=r, world_size=2, agent_instance=f"q{r}")).SerializeToString())
        await c.read()
        calls.append(c)
    return channel, calls


# --------------------------------------------------------------------------- run


@dataclass
class Result:
    idle: Latencies
    hostile: Latencies
    sent: dict[str, int]
    seconds: float = 0.0
    lease: bool = False

    def worst(self, which: str, phase: str) -> float:
        values: list[float] = getattr(getattr(self, phase), which)
        return max(values) if values else float("nan")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else float("nan")


def measure(seconds: float = 10.0, stacks_bytes: int = MAX_STACKS,
            interval: float = 0.02, arbiter_args: tuple[str, ...] = (),
            attacks: tuple[str, ...] = ATTACKS, lease: bool = False) -> Result:
    if not lease:
        return _measure(seconds, stacks_bytes, interval, arbiter_args, attacks, None)
    from tests.kube_fake import FakeKube

    with FakeKube() as fake:
        def read() -> tuple[str, str]:
            spec = (fake.get("leases.coordination.k8s.io", LEASE, LEASE_NS) or {}).get("spec", {})
            return str(spec.get("renewTime", "")), str(spec.get("holderIdentity", ""))

        return _measure(seconds, stacks_bytes, interval, arbiter_args + lease_args(fake.url),
                        attacks, read)


def _measure(seconds: float, stacks_bytes: int, interval: float,
             arbiter_args: tuple[str, ...], attacks: tuple[str, ...], lease: Any) -> Result:
    from ftagent.arbiter.process import ArbiterProcess

    with ArbiterProcess("--metrics-port", "0", "--metrics-addr", "127.0.0.1",
                        *arbiter_args) as arbiter:
        m = re.search(r"metrics on http://[^\s]+:(\d+)", arbiter.log_text())
        if m is None:
            raise RuntimeError(f"no metrics port in the arbiter's log: {arbiter.log_text()}")
        http_port = int(m.group(1))

        async def run() -> Result:
            if lease is not None:  # leading: it serves agents only then
                deadline = time.monotonic() + 30
                while not (await asyncio.to_thread(lease))[1]:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the arbiter never took the Lease")
                    await asyncio.sleep(0.05)
            channel, _calls = await quiet_job(arbiter.address)
            idle = await probe(arbiter.address, http_port, seconds, interval, lease)
            attacker = await asyncio.create_subprocess_exec(
                sys.executable, os.path.abspath(__file__), "--attacker", arbiter.address,
                "--seconds", str(seconds), "--stacks-bytes", str(stacks_bytes),
                "--attacks", ",".join(attacks), stdout=subprocess.PIPE)
            try:
                hostile = await probe(arbiter.address, http_port, seconds, interval, lease)
                out, _ = await asyncio.wait_for(attacker.communicate(), seconds + 30)
            finally:
                if attacker.returncode is None:
                    attacker.kill()
                    await attacker.wait()
            await channel.close(None)
            lines = out.decode().strip().splitlines()
            sent = json.loads(lines[-1]) if lines else {}
            return Result(idle, hostile, sent, seconds, lease is not None)

        return asyncio.run(run())


def report(r: Result) -> str:
    rows = [f"{'call':<10} {'idle p99':>10} {'idle worst':>11} {'hostile p99':>12} "
            f"{'hostile worst':>14} {'ratio (worst)':>14}"]
    for which in ("list_jobs", "healthz"):
        idle, bad = getattr(r.idle, which), getattr(r.hostile, which)
        ratio = max(bad) / max(idle) if idle and bad and max(idle) > 0 else float("nan")
        rows.append(f"{which:<10} {pct(idle, 99) * 1000:>8.1f}ms {max(idle) * 1000:>9.1f}ms "
                    f"{pct(bad, 99) * 1000:>10.1f}ms {max(bad) * 1000:>12.1f}ms "
                    f"{ratio:>13.1f}x")
    if r.lease:
        for phase in ("idle", "hostile"):
            ren = getattr(r, phase).renewals
            span = (ren[0][0], ren[-1][0]) if ren else (0.0, 0.0)
            holders = {h for _, h in ren}
            rows.append(f"lease ({phase}): {len(ren)} renewals seen, longest gap "
                        f"{max_gap(ren, *span):.2f}s (retry period {RETRY}s), holder "
                        f"{'kept' if len(holders) == 1 else 'CHANGED: ' + str(holders)}")
    worst = max(r.worst("list_jobs", "hostile"), r.worst("healthz", "hostile"))
    rows.append(f"samples: idle {len(r.idle.list_jobs)}, hostile {len(r.hostile.list_jobs)}; "
                f"median ListJobs idle {statistics.median(r.idle.list_jobs) * 1000:.1f}ms")
    rows.append(f"attacker sent: {json.dumps(r.sent)}")
    if r.idle.errors or r.hostile.errors:
        rows.append(f"failed calls (counted as {DEADLINE:.0f}s): idle {r.idle.errors}, "
                    f"hostile {r.hostile.errors}")
    rows.append(f"worst control-plane latency under attack: {worst * 1000:.1f}ms "
                f"(goal <= {GOAL * 1000:.0f}ms): {'met' if worst <= GOAL else 'NOT met'}")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="of each phase")
    ap.add_argument("--stacks-bytes", type=int, default=MAX_STACKS,
                    help="size of each Stacks message (default: the largest the arbiter reads)")
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help=f"which, comma-separated (default: all of {','.join(ATTACKS)})")
    ap.add_argument("--lease", action="store_true", help="--leader-elect against the fake "
                    "API server; report the Lease's renewals in each phase")
    ap.add_argument("--attacker", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.attacker:
        sent = asyncio.run(attack(args.attacker, args.seconds, args.stacks_bytes,
                                  tuple(a for a in args.attacks.split(",") if a)))
        print(json.dumps(sent), flush=True)
        return 0
    attacks = tuple(a for a in args.attacks.split(",") if a)
    unknown = sorted(set(attacks) - set(ATTACKS))
    if unknown:
        ap.error(f"unknown attack {unknown[0]!r}: choose from {', '.join(ATTACKS)}")
    r = measure(args.seconds, args.stacks_bytes, args.interval, attacks=attacks,
                lease=args.lease)
    print(report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
