"""How far one arbiter process goes: CPU and memory per agent, fan-out and barrier latency.

    .venv/bin/python bench/arbiter_scale.py [--levels 1000,5000,10000] [--workers 4]
        [--identity none,projected] [--failover]

The arbiter runs in its own process (``python -m ftagent arbiter``); simulated agents
run in ``--workers`` client processes, one gRPC stream each (one TCP connection per
``--agents-per-connection`` agents, default 1 as in a real cluster), sending Hello, then
a ProgressSummary every 5 s, and answering commands like an agent whose trainer exits at
once (Ack, then BarrierArrival for the new generation). Jobs have 1,000 ranks each.

At each level: the arbiter's CPU (% of one core) and RSS over ``--window`` seconds of
steady state; then ``--rounds`` times, one rank of a 1,000-rank job reports a CRASH and
we time fault -> RESTART received by every rank (p50/p99/max) and the barrier (last
arrival sent -> last RELEASE received; first arrival -> last release). Loopback only;
everything stops by itself within ``--max-seconds``.

``--identity projected`` runs the arbiter as in a cluster (``--kube`` against the
project's fake API server, tests/kube_fake, in this process, whose issuer signs with a real
RSA key and serves OIDC discovery): every agent presents its own pod-bound projected token,
verified in the arbiter against the issuer's published keys (kube/projected.py), its Hello
checked against its pod as the arbiter's pod watch sees it. ``--identity none,projected``
runs both, one after the other, and prints their rows side by side; ``kube-admin`` is the
same cluster and pods with every agent presenting the arbiter's secret instead (the
cluster's own work, Events and pod annotations, without the identity checks), to tell
what identity costs from what ``--kube`` costs. (The TokenReview
fallback, where discovery cannot be read, limits reviews per source address: on loopback
every agent is one source, so it is not benched here.)

``--failover``: after the last level the arbiter is killed (SIGKILL) and a new one started
on the same port, cold (with ``--kube`` it lists the pods again); the agents reconnect as
real ones do (backoff with jitter, 0.2 s doubling to 4 s), and we time kill -> every agent
connected again (and from the new arbiter's "listening on"), and count the TokenReviews the
fake API server answered meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

JOB_SIZE = 1000
NAMESPACE = "bench"
NODES = 64
CONNECT = "/ftagent.v1.Arbiter/Connect"
REVIEWS = "tokenreviews.authentication.k8s.io"
ADMIN_SECRET = "bench-admin-secret-0123456789"
BACKOFF_FIRST, BACKOFF_CAP = 0.2, 4.0  # the agent's (ftagent/agent/reporter.py)


# --------------------------------------------------------------------------- client process


def worker_main(address: str, pipe: Connection, per_conn: int, interval: float,
                fresh: bool = False) -> None:
    asyncio.run(Worker(address, pipe, per_conn, interval, fresh).run())


class Worker:
    """Simulated agents in one process, driven by the parent through a pipe."""

    def __init__(self, address: str, pipe: Connection, per_conn: int, interval: float,
                 fresh: bool = False) -> None:
        import grpc

        from ftagent.v1 import ftagent_pb2 as pb

        self.grpc, self.pb = grpc, pb
        self.address, self.pipe, self.per_conn, self.interval = address, pipe, per_conn, interval
        # a fresh channel per attempt, as ftagent's agent opens one per session
        # (reporter.py): no channel-level reconnect backoff on top of the agent's own
        self.fresh = fresh and per_conn == 1
        self.channels: list[Any] = []
        self.agents: dict[tuple[str, int], dict[str, Any]] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.events: list[tuple[str, str, int, int, float]] = []  # kind, job, rank, gen, t
        self.connected = 0
        self.progress = pb.AgentMessage(progress=pb.ProgressSummary(
            step=100, loss=1.5, samples_per_second=800, seconds_since_progress=0.3
        )).SerializeToString()

    def _new_channel(self) -> Any:
        return self.grpc.aio.insecure_channel(self.address, options=[
            # (kept channels) as short a channel-level reconnect backoff as the agent's
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", int(BACKOFF_CAP * 1000))])

    def _channel(self) -> Any:
        if self.fresh:
            return self._new_channel()
        if not self.channels or self.channels[-1][1] >= self.per_conn:
            self.channels.append([self._new_channel(), 0])
        self.channels[-1][1] += 1
        return self.channels[-1][0]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, self.pipe.recv)
            cmd = msg[0]
            if cmd == "add":
                t = time.monotonic()
                for job, rank, pod, node, token in msg[1]:
                    self.tasks.append(asyncio.create_task(self._agent(job, rank, pod, node,
                                                                      token)))
                want = self.connected + len(msg[1])
                while self.connected < want and time.monotonic() - t < 120:
                    await asyncio.sleep(0.05)
                self.pipe.send(("added", self.connected, time.monotonic() - t))
            elif cmd == "fault":
                _, job, rank, gen = msg
                a = self.agents[(job, rank)]
                f = self.pb.Fault(id=f"f-{job}-{gen}", kind=self.pb.FAULT_KIND_CRASH,
                                  severity=self.pb.SEVERITY_ERROR, message="bench crash",
                                  generation=gen, exit_status=1)
                if "lock" not in a:  # that agent never connected (a loaded machine)
                    self.pipe.send(("sent", None))
                    continue
                t0 = time.monotonic()
                async with a["lock"]:
                    await a["call"].write(self.pb.AgentMessage(fault=f).SerializeToString())
                self.pipe.send(("sent", t0))
            elif cmd == "wait":  # until every agent is connected (again), or a timeout
                t = time.monotonic()
                while self.connected < len(self.agents) and time.monotonic() - t < msg[1]:
                    await asyncio.sleep(0.05)
                self.pipe.send(("connected", self.connected, time.monotonic()))
            elif cmd == "events":
                self.pipe.send(("events", self.events))
                self.events = []
            elif cmd == "cpu":
                p = psutil.Process()
                self.pipe.send(("cpu", sum(p.cpu_times()[:2])))
            elif cmd == "stop":
                for task in self.tasks:
                    task.cancel()
                for ch, _ in self.channels:
                    await ch.close(None)
                for a in self.agents.values():
                    if self.fresh and a.get("channel") is not None:
                        with contextlib.suppress(Exception):
                            await a["channel"].close(None)
                self.pipe.send(("stopped",))
                return

    async def _agent(self, job: str, rank: int, pod: str = "", node: str = "",
                     token: str = "") -> None:
        """One agent: connect, serve its stream; when the stream ends (the arbiter died),
        reconnect as a real agent does (backoff with jitter)."""
        import random

        pb = self.pb
        namespace = NAMESPACE if token else ""
        hello = pb.AgentMessage(hello=pb.Hello(job=job, rank=rank, world_size=JOB_SIZE,
                                               max_restarts=1_000_000, namespace=namespace,
                                               pod=pod, node=node))
        channel = self._channel()
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        a: dict[str, Any] = self.agents.setdefault((job, rank), {"gen": 0})
        delay = BACKOFF_FIRST
        while True:
            if self.fresh and a.get("channel") is not None:
                with contextlib.suppress(Exception):
                    await channel.close(None)
                channel = self._channel()
            a["channel"] = channel
            try:
                call = channel.stream_stream(CONNECT)(metadata=metadata)
                await call.write(hello.SerializeToString())
                raw = await call.read()
            except Exception:  # the arbiter is gone: as UNAVAILABLE
                raw = self.grpc.aio.EOF
            if raw is self.grpc.aio.EOF:
                # UNAVAILABLE until the arbiter's pod watch has seen the pod, or while
                # it is down: retry with backoff and jitter
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(BACKOFF_CAP, delay * 2)
                continue
            delay = BACKOFF_FIRST
            first = pb.ArbiterMessage.FromString(raw)
            assert first.WhichOneof("body") == "welcome"
            lock = asyncio.Lock()  # grpc.aio allows one write at a time per call
            a.update(call=call, lock=lock)
            self.connected += 1
            writer = asyncio.create_task(self._progress(call, lock))
            try:
                await self._serve(job, rank, a, call, lock)
            except Exception:
                pass
            finally:
                writer.cancel()
                self.connected -= 1

    async def _serve(self, job: str, rank: int, a: dict[str, Any], call: Any,
                     lock: asyncio.Lock) -> None:
        pb = self.pb
        while True:
            raw = await call.read()
            if raw is self.grpc.aio.EOF:
                return
            t = time.monotonic()
            m = pb.ArbiterMessage.FromString(raw)
            if m.WhichOneof("body") != "command":
                continue
            c = m.command
            async with lock:
                await call.write(pb.AgentMessage(ack=pb.Ack(command_id=c.id))
                                 .SerializeToString())
            if c.kind == pb.COMMAND_KIND_RESTART:
                self.events.append(("restart", job, rank, c.generation, t))
                a["gen"] = c.generation
                ts = time.monotonic()
                async with lock:
                    await call.write(pb.AgentMessage(arrival=pb.BarrierArrival(
                        generation=c.generation, previous_trainer_exited=True))
                        .SerializeToString())
                self.events.append(("arrive", job, rank, c.generation, ts))
            elif c.kind == pb.COMMAND_KIND_RELEASE_BARRIER:
                self.events.append(("release", job, rank, c.generation, t))

    async def _progress(self, call: Any, lock: asyncio.Lock) -> None:
        await asyncio.sleep(self.interval * (hash(id(call)) % 1000) / 1000)  # spread agents
        while True:
            async with lock:
                await call.write(self.progress)
            await asyncio.sleep(self.interval)


# --------------------------------------------------------------------------- parent


def profile(proc: Any, old_pid: int | None, name: str, seconds: float = 40.0) -> None:
    """With $BENCH_PROFILE=DIR: py-spy samples the arbiter process that ``proc()`` returns
    once its pid is not ``old_pid`` (a new one: attach as it starts) for ``seconds``, into
    DIR/NAME.raw (collapsed stacks, one line per stack). For finding where time goes."""
    out = os.environ.get("BENCH_PROFILE", "")
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not out or not os.path.exists(spy):
        return
    import subprocess
    import threading

    def attach() -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            p = proc()
            if p is not None and p.pid != old_pid and p.poll() is None:
                os.makedirs(out, exist_ok=True)
                subprocess.run([spy, "record", "-r", "100", "--nonblocking", "--format", "raw",
                                "-d", str(int(seconds)), "-o", os.path.join(out, f"{name}.raw"),
                                "--pid", str(p.pid)], capture_output=True, check=False)
                return
            time.sleep(0.005)

    threading.Thread(target=attach, daemon=True).start()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


class Bench:
    def __init__(self, args: argparse.Namespace, identity: str = "none") -> None:
        from ftagent.arbiter.process import ArbiterProcess

        self.args, self.identity = args, identity
        self.kube: Any = None
        extra: list[str] = []
        env: dict[str, str] = {}
        if identity in ("projected", "kube-admin"):
            from tests.kube_fake import FakeKube

            self.kube = FakeKube()
            for n in range(NODES):
                self.kube.add_node(f"node-{n}")
            extra = ["--kube", "--kube-api", self.kube.url]
            if identity == "kube-admin":
                extra += ["--token", ADMIN_SECRET]
            env = {"POD_NAMESPACE": "ftagent"}
        if args.bytecode == "cached":  # as an installed package: ftagent's .pyc kept
            env.update(PYTHONDONTWRITEBYTECODE="", PYTHONPYCACHEPREFIX=args.pycache)
        self.arbiter = ArbiterProcess("--log-level", os.environ.get("BENCH_LOG", "warning"),
                                      "--metrics-port", "0", "--metrics-addr", "127.0.0.1",
                                      *extra, env=env, start_timeout=180.0)
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        self.total = 0
        self.generation: dict[str, int] = {}
        self.rows: list[dict[str, Any]] = []
        self.deadline = time.monotonic() + args.max_seconds

    def ask(self, i: int, msg: tuple[Any, ...]) -> Any:
        self.pipes[i].send(msg)
        return self.pipes[i].recv()

    def broadcast(self, msg: tuple[Any, ...]) -> list[Any]:
        for p in self.pipes:
            p.send(msg)
        return [p.recv() for p in self.pipes]

    def start(self) -> None:
        self.arbiter.start()
        ctx = mp.get_context("spawn")
        for _ in range(self.args.workers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(self.arbiter.address, child,
                                                      self.args.agents_per_connection,
                                                      self.args.interval,
                                                      self.args.reconnect == "fresh"),
                               daemon=True)
            p.start()
            self.pipes.append(parent)
            self.procs.append(p)

    def grow(self, n: int) -> float:
        """Add agents up to ``n`` (whole 1,000-rank jobs, ranks spread over workers)."""
        t = time.monotonic()
        new: list[list[tuple[str, int, str, str, str]]] = [[] for _ in self.pipes]
        for j in range(self.total // JOB_SIZE, n // JOB_SIZE):
            for r in range(JOB_SIZE):
                new[r % len(self.pipes)].append((f"job-{j}", r, *self.pod(f"job-{j}", r)))
            self.generation[f"job-{j}"] = 0
        for p, batch in zip(self.pipes, new, strict=True):
            p.send(("add", batch))
        got = [p.recv() for p in self.pipes]
        self.total = sum(g[1] for g in got)
        # initial barriers: nobody arrives at generation 0 in this bench, which is fine
        return time.monotonic() - t

    def pod(self, job: str, rank: int) -> tuple[str, str, str]:
        """(pod, node, token) of a rank: with --identity projected a pod in the fake API
        server, labelled for its job and rank, and its pod-bound token; else nothing."""
        if self.kube is None:
            return "", "", ""
        name, node = f"{job}-{rank}", f"node-{rank % NODES}"
        self.kube.create("pods", {
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "labels": {"ftagent.io/job": job},
                         "annotations": {"ftagent.io/rank": str(rank),
                                         "ftagent.io/world-size": str(JOB_SIZE)}},
            "spec": {"nodeName": node, "containers": [{"name": "trainer", "image": "t"}]},
            "status": {"phase": "Running"}})
        if self.identity == "kube-admin":
            return name, node, ADMIN_SECRET
        token = self.kube.mint_token(NAMESPACE, "trainer", pod=name).token
        return name, node, token

    def measure(self, window: float) -> tuple[float, float, float]:
        proc = psutil.Process(self.arbiter.proc.pid)  # type: ignore[union-attr]
        c0 = sum(proc.cpu_times()[:2])
        w0 = sum(x[1] for x in self.broadcast(("cpu",)))
        t0 = time.monotonic()
        time.sleep(window)
        dt = time.monotonic() - t0
        cpu = (sum(proc.cpu_times()[:2]) - c0) / dt * 100
        wcpu = (sum(x[1] for x in self.broadcast(("cpu",))) - w0) / dt * 100
        return cpu, proc.memory_info().rss / 2**20, wcpu

    def server_fanout(self) -> tuple[float, float]:
        """Sum and count of ftagent_arbiter_fault_to_command_seconds (fault in -> last write)."""
        import re
        import urllib.request

        port = re.search(r"metrics on http://[^:]+:(\d+)/", self.arbiter.log_text())
        if not port:
            return 0.0, 0.0
        text = urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics",
                                      timeout=10).read().decode()
        got = {}
        for key in ("sum", "count"):
            m = re.search(rf"^ftagent_arbiter_fault_to_command_seconds_{key} (\S+)$", text,
                          re.M)
            got[key] = float(m.group(1)) if m else 0.0
        return got["sum"], got["count"]

    def rejected(self) -> dict[str, int]:
        """ftagent_arbiter_rejected_requests by reason (calls turned away: an agent that
        retries after its backoff)."""
        import re
        import urllib.request

        port = re.search(r"metrics on http://[^:]+:(\d+)/", self.arbiter.log_path.read_text(
            errors="replace"))
        if not port:
            return {}
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics",
                                          timeout=10).read().decode()
        except OSError:
            return {}
        return {m.group(1): int(float(m.group(2))) for m in re.finditer(
            r'^ftagent_arbiter_rejected_requests_total\{reason="([^"]+)"\} (\S+)$', text,
            re.M) if float(m.group(2)) > 0}

    def fanout_round(self, job: str = "job-0") -> tuple[list[float], float, float]:
        gen = self.generation[job]
        self.broadcast(("events",))
        t0 = self.ask(0, ("fault", job, 0, gen))[1]
        if t0 is None:
            raise RuntimeError(f"rank 0 of {job} never connected: no round to time")
        want = JOB_SIZE
        events: list[tuple[str, str, int, int, float]] = []
        end = time.monotonic() + 30
        while time.monotonic() < end:
            time.sleep(0.2)
            for got in self.broadcast(("events",)):
                events += got[1]
            if sum(1 for e in events if e[0] == "release" and e[1] == job) >= want:
                break
        g = gen + 1
        self.generation[job] = g
        restart = [e[4] - t0 for e in events if e[0] == "restart" and e[1] == job and e[3] == g]
        arrive = [e[4] for e in events if e[0] == "arrive" and e[1] == job and e[3] == g]
        release = [e[4] for e in events if e[0] == "release" and e[1] == job and e[3] == g]
        if len(restart) < want or len(release) < want:
            raise RuntimeError(f"round incomplete: {len(restart)} restarts, {len(release)} "
                               f"releases of {want}")
        return restart, max(release) - max(arrive), max(release) - min(arrive)

    def run(self) -> None:
        self.start()
        for level in self.args.levels:
            if time.monotonic() > self.deadline - 60:
                print(f"stopping before {level} agents: --max-seconds nearly spent")
                break
            ramp = self.grow(level)
            row: dict[str, Any] = {"agents": self.total, "ramp_s": ramp}
            print(f"{self.total} agents connected in {ramp:.1f}s; measuring ...", flush=True)
            row["cpu"], row["rss"], row["client_cpu"] = self.measure(self.args.window)
            if self.total < level:
                print(f"only {self.total} of {level} agents connected; the arbiter's log "
                      "ends:\n" + "\n".join(self.arbiter.log_text().splitlines()[-15:]))
            lat: list[float] = []
            bar: list[float] = []
            bar_all: list[float] = []
            s0, n0 = self.server_fanout()
            profile(lambda: self.arbiter.proc, None, f"rounds-{self.identity}-{self.total}",
                    seconds=10.0)
            for _ in range(self.args.rounds):
                r, b, ba = self.fanout_round()
                lat += r
                bar.append(b)
                bar_all.append(ba)
            s1, n1 = self.server_fanout()
            row["server"] = (s1 - s0) / (n1 - n0) if n1 > n0 else float("nan")
            row.update(p50=pct(lat, 50), p99=pct(lat, 99), max=max(lat),
                       barrier=statistics.median(bar), barrier_all=statistics.median(bar_all))
            row["identity"] = self.identity
            self.rows.append(row)
            print(self.format_row(row), flush=True)
            if self.total < level:
                print(f"only {self.total} of {level} agents connected; stopping here; the "
                      "arbiter's log ends:\n" + "\n".join(
                          self.arbiter.log_text().splitlines()[-15:]))
                break
        if self.args.failover and self.rows:
            self.failover(self.rows[-1])

    def failover(self, row: dict[str, Any]) -> None:
        """Kill the arbiter, start a new one on the port (cold), time every agent back."""
        reviews = self.kube.count("create", REVIEWS) if self.kube is not None else 0
        t0 = time.monotonic()
        old = self.arbiter.proc.pid if self.arbiter.proc is not None else None
        self.arbiter.kill()
        profile(lambda: self.arbiter.proc, old, f"failover-{self.identity}")
        self.arbiter.start()
        started = time.monotonic() - t0
        proc = psutil.Process(self.arbiter.proc.pid)  # type: ignore[union-attr]
        cpu_listening = sum(proc.cpu_times()[:2])
        got = self.broadcast(("wait", self.args.failover_timeout))
        cpu_back = sum(proc.cpu_times()[:2])
        back = sum(g[1] for g in got)
        # CPU seconds of the new arbiter: what a loaded machine stretches, not what it costs
        row["failover_cpu"] = (cpu_listening, cpu_back)
        turned = self.rejected()
        row["failover_s"] = max(g[2] for g in got) - t0
        row["failover_listening_s"] = row["failover_s"] - started
        row["failover_back"] = back
        row["failover_reviews"] = (self.kube.count("create", REVIEWS) - reviews
                                   if self.kube is not None else 0)
        print(f"failover ({self.identity}): new arbiter listening {started:.1f}s after the "
              f"kill; {back} of {self.total} agents connected again {row['failover_s']:.1f}s "
              f"after the kill ({row['failover_listening_s']:.1f}s after it listened); "
              f"{row['failover_reviews']} TokenReviews meanwhile; the new arbiter's CPU: "
              f"{cpu_listening:.2f}s to listen, {cpu_back:.2f}s to have them all back; calls "
              f"it turned away: {turned or 'none'}", flush=True)

    @staticmethod
    def format_row(r: dict[str, Any]) -> str:
        fo = (f"{r['failover_back']:>6}/{r['failover_listening_s']:>6.1f}s"
              if "failover_s" in r else f"{'-':>14}")
        return (f"{r.get('identity', ''):>10} {fo} {r['agents']:>7} {r['ramp_s']:>8.1f} "
                f"{r['cpu']:>11.1f} {r['rss']:>9.0f} "
                f"{r['client_cpu']:>11.1f} {r['p50'] * 1000:>9.1f} {r['p99'] * 1000:>9.1f} "
                f"{r['max'] * 1000:>9.1f} {r['server'] * 1000:>9.1f} {r['barrier'] * 1000:>11.1f} "
                f"{r['barrier_all'] * 1000:>11.1f}")

    def stop(self) -> None:
        for p in self.pipes:
            try:
                p.send(("stop",))
                if p.poll(10):
                    p.recv()
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        self.arbiter.stop()
        shutil.rmtree(self.arbiter.log_dir, ignore_errors=True)
        if self.kube is not None:
            self.kube.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1000,5000,10000",
                    type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--agents-per-connection", type=int, default=1)
    ap.add_argument("--interval", type=float, default=5.0, help="progress period per agent")
    ap.add_argument("--window", type=float, default=15.0, help="steady-state CPU window")
    ap.add_argument("--rounds", type=int, default=3, help="fault -> restart rounds per level")
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--identity", default="none",
                    type=lambda s: [x for x in s.split(",") if x],
                    help="none, projected, kube-admin, or several (none,projected: run one "
                    "after the other, rows side by side); projected: --kube against the fake "
                    "API server, a pod-bound token per agent, verified in the arbiter (OIDC "
                    "keys); kube-admin: the same cluster and pods, every agent presenting the "
                    "admin secret (no identity check: what --kube costs without it)")
    ap.add_argument("--failover", action="store_true",
                    help="after the last level: kill the arbiter, start a new one, time "
                    "every agent back")
    ap.add_argument("--failover-timeout", type=float, default=120.0)
    ap.add_argument("--reconnect", choices=("fresh", "kept"), default="kept",
                    help="kept: one channel per agent for its life, whose own reconnect "
                    "backoff (0.2 s x1.6 to 4 s) adds to the agent's; fresh: a new channel "
                    "for each attempt, as ftagent's agent does (reporter.py), which on this "
                    "one machine costs the clients' CPU what 10,000 nodes would spend")
    ap.add_argument("--bytecode", choices=("cached", "source"), default="source",
                    help="cached: the arbiter keeps its compiled modules (a cache in a temp "
                    "directory, written at its first start, read at the failover's), as an "
                    "installed package has them; source: as the environment says (with "
                    "PYTHONDONTWRITEBYTECODE=1 a checkout compiles ftagent at every start)")
    args = ap.parse_args()
    import tempfile

    args.pycache = tempfile.mkdtemp(prefix="ftagent-bench-pyc-")
    for identity in args.identity:
        if identity not in ("none", "projected", "kube-admin"):
            ap.error(f"--identity {identity!r}: none, projected or kube-admin")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"agents reconnect with a {args.reconnect} channel per attempt; the arbiter's "
          f"bytecode: {args.bytecode}")
    print(f"machine: {os.cpu_count()} CPUs; arbiter and {args.workers} client processes share "
          f"them (loopback); identity: {','.join(args.identity)}")
    rows: list[dict[str, Any]] = []
    for identity in args.identity:
        bench = Bench(args, identity)
        try:
            bench.run()
        finally:
            bench.stop()
        rows += bench.rows
    shutil.rmtree(args.pycache, ignore_errors=True)
    print()
    print(f"{'identity':>10} {'failover back':>14} {'agents':>7} {'ramp s':>8} "
          f"{'arbiter %':>11} {'RSS MiB':>9} {'clients %':>11} "
          f"{'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'srv ms':>9} {'barrier ms':>11} "
          f"{'1st->rel ms':>11}")
    for r in rows:
        print(Bench.format_row(r))
    print("arbiter % = CPU of the arbiter process, % of one core, steady state (progress "
          f"every {args.interval:g}s per agent); p50/p99/max = fault sent -> RESTART received, "
          f"over every rank of a {JOB_SIZE}-rank job x {args.rounds} rounds; srv = inside the "
          "arbiter, fault received -> RESTART written to the last stream (mean); barrier = last "
          "arrival sent -> last RELEASE received (median of rounds); 1st->rel = first arrival "
          "-> last release; failover back = agents connected again / seconds from the new "
          "arbiter's 'listening on' (--failover; the line above each table row also gives "
          "it from the kill).")
    ratio = side_by_side(rows)
    if ratio:
        print(ratio)
    return 0


def side_by_side(rows: list[dict[str, Any]]) -> str:
    """One line: each identity's figures over those without identity in the same run (on
    a shared machine the ratio is what means something, not the seconds)."""
    base = next((r for r in rows if r.get("identity") == "none"), None)
    if base is None:
        return ""
    out = []
    for r in rows:
        if r is base or r.get("identity") == "none":
            continue
        parts = [f"{r['identity']}/none:"]
        if "failover_s" in r and "failover_s" in base:
            heard, killed = r["failover_listening_s"], r["failover_s"]
            heard0, killed0 = base["failover_listening_s"], base["failover_s"]
            parts.append(f"failover back {heard:.1f}/{heard0:.1f} s after listening "
                         f"(x{heard / max(heard0, 1e-9):.2f}), {killed:.1f}/{killed0:.1f} s "
                         f"after the kill (x{killed / max(killed0, 1e-9):.2f});")
            if "failover_cpu" in r and "failover_cpu" in base:
                (c1, c2), (b1, b2) = r["failover_cpu"], base["failover_cpu"]
                parts.append(f"new arbiter's CPU to listen {c1:.2f}/{b1:.2f} s, to have "
                             f"every agent back {c2:.2f}/{b2:.2f} s;")
        parts.append(f"fault->RESTART p99 {r['p99'] * 1000:.0f}/{base['p99'] * 1000:.0f} ms "
                     f"(x{r['p99'] / max(base['p99'], 1e-9):.2f}); ramp {r['ramp_s']:.1f}/"
                     f"{base['ramp_s']:.1f} s")
        out.append(" ".join(parts))
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
