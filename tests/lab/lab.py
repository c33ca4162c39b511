"""A lab of simulated nodes running one real job: ``Lab``.

Each node is a network namespace (tests/lab/net.py) running ``ftagent run`` around
examples/train.py -- real PyTorch DDP over gloo on CPU, ``GLOO_SOCKET_IFNAME=eth0`` on the
node's own data link, checkpoints in a shared directory (rank 0 writes, every rank
resumes), faults triggered by files (``FAULT_TRIGGER_DIR``). One arbiter in the root
namespace on the control bridge serves every node; ``ftagent status --follow --json``
streams its timeline into a file; a real Prometheus (``prometheus=True``) scrapes every
agent and the arbiter each second.

``spares=N`` adds N nodes after the job's, each running a warm spare (``ftagent run
--spare``, slot ``world + i``: its logs and events are read like a rank's under that
number). A rank's agent is a "pod": ``kill_agent(r)`` SIGKILLs it (as a node dying or an OOM kill
of the agent would), and ``start_rank(r)`` starts a new one for that rank, as a controller
replaces a pod. ``close()`` kills every process it made and removes every namespace and
link, and the guard (tests/lab/guard.py) calls it whatever ends the test process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.lab import guard
from tests.lab.net import Network

ROOT = Path(__file__).resolve().parent.parent.parent
PY = sys.executable
TRAIN = str(ROOT / "examples" / "train.py")
AGENT_METRICS_PORT = 9430  # fresh namespaces: free on every node
MASTER_PORT = 29500
_LISTENING = re.compile(r"^listening on (\S+:\d+)$", re.M)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# what a drill wants quickly: short steps, a short learned hang floor, a short NIC grace
FAST_ENV = {"TRAIN_STEP_SLEEP": "0.05", "TRAIN_PG_TIMEOUT": "60", "PYTHONUNBUFFERED": "1"}


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _clean_env() -> dict[str, str]:
    """The test's environment without proxies (the lab's addresses are private) and
    without a rank identity of its own."""
    drop = ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy", "RANK", "WORLD_SIZE",
            "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k.lower() not in drop and k not in drop}


class Lab:
    def __init__(self, tmp: Path, nodes: int = 2, *, job: str = "lab",
                 arbiter_args: Sequence[str] = (), prometheus: bool = False,
                 arbiter: bool = True, stamp: bool = False, spares: int = 0) -> None:
        self.tmp = tmp
        self.job = job
        self.world = nodes
        self.spares = spares
        self.net = Network(nodes + spares)
        self.arbiter_args = list(arbiter_args)
        self.want_prometheus = prometheus
        self.want_arbiter = arbiter
        self.stamp = stamp  # prefix every output line with its arrival time (benchmarks)
        self._pumps: list[threading.Thread] = []
        self.arbiter: subprocess.Popen[bytes] | None = None
        self.arbiter_starts = 0
        self.address = ""
        self.arbiter_metrics_port = 0
        self.prometheus: subprocess.Popen[bytes] | None = None
        self.prometheus_port = 0
        self.follower: subprocess.Popen[bytes] | None = None
        self.followers = 0
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        self.incarnation: dict[int, int] = {}
        self.others: list[subprocess.Popen[bytes]] = []
        self.ckpt_dir = tmp / "ckpt"
        self.triggers = tmp / "triggers"
        self.env: dict[str, str] = {}
        self.flags: list[str] = []
        self.closed = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Lab:
        guard.register(self)
        try:
            self.net.create()
            self.triggers.mkdir(parents=True, exist_ok=True)
            if self.want_arbiter:
                self.start_arbiter()
            if self.want_prometheus:
                self.start_prometheus()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill what the lab started, remove its network; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        procs = [*self.agents.values(), *self.others, self.follower, self.prometheus,
                 self.arbiter]
        for p in procs:
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            if p is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
        self.net.close()  # SIGKILLs whatever still runs inside the namespaces
        guard.unregister(self)

    def _spawn(self, cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
               stamp: bool = False) -> subprocess.Popen[bytes]:
        full_env = {**_clean_env(), **(env or {})}
        if stamp:  # "UNIX_TIME line": when each line reached us (the trainer's clock aside)
            p = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=full_env, start_new_session=True)
            t = threading.Thread(target=_pump, args=(p, log), daemon=True)
            t.start()
            self._pumps.append(t)
            return p
        with log.open("ab") as out:
            return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=full_env,
                                    start_new_session=True)  # one group to kill

    # ------------------------------------------------------------------ the arbiter

    def start_arbiter(self) -> str:
        """(Re)start the arbiter on the control bridge, on its previous ports if any."""
        host = self.net.host_ip
        port = int(self.address.rpartition(":")[2]) if self.address else 0
        if not self.arbiter_metrics_port:
            self.arbiter_metrics_port = _free_port(host)
        self.arbiter_starts += 1
        log = self.tmp / f"arbiter-{self.arbiter_starts}.log"
        self.arbiter = self._spawn(
            [PY, "-m", "ftagent", "arbiter", "--listen", f"{host}:{port}", "--insecure",
             "--metrics-port", str(self.arbiter_metrics_port), "--metrics-addr", host,
             *self.arbiter_args], log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = _LISTENING.search(log.read_text(errors="replace"))
            if m:
                self.address = m.group(1)
                break
            if self.arbiter.poll() is not None:
                raise RuntimeError(f"arbiter exited: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        else:
            raise RuntimeError(f"arbiter did not listen: {log.read_text()[-2000:]}")
        self.follow()
        return self.address

    def kill_arbiter(self) -> None:
        """SIGKILL, as a node or OOM kill would: no goodbye to the agents."""
        if self.arbiter is not None and self.arbiter.poll() is None:
            os.killpg(self.arbiter.pid, signal.SIGKILL)
            self.arbiter.wait(10)
        if self.follower is not None and self.follower.poll() is None:
            os.killpg(self.follower.pid, signal.SIGKILL)
            self.follower.wait(10)

    def follow(self) -> None:
        """``ftagent status JOB --follow --json`` into follow-N.jsonl (the live timeline)."""
        if self.follower is not None and self.follower.poll() is None:
            os.killpg(self.follower.pid, signal.SIGKILL)
            self.follower.wait(10)
        self.followers += 1
        out = self.tmp / f"follow-{self.followers}.jsonl"
        with out.open("wb") as f, (self.tmp / "follow.err").open("ab") as err:
            self.follower = subprocess.Popen(
                [PY, "-m", "ftagent", "status", "--arbiter", self.address, self.job,
                 "--follow", "--json", "--timeline", "0"], stdout=f, stderr=err,
                env=_clean_env(), start_new_session=True)

    def timeline(self) -> list[dict[str, Any]]:
        """Every timeline entry streamed so far (from every arbiter run), in order."""
        out: list[dict[str, Any]] = []
        for n in range(1, self.followers + 1):
            p = self.tmp / f"follow-{n}.jsonl"
            if not p.exists():
                continue
            for line in p.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line still being written
                    break
        return out

    def status(self) -> dict[str, Any]:
        r = subprocess.run([PY, "-m", "ftagent", "status", "--arbiter", self.address,
                            self.job, "--json", "--timeline", "0"], capture_output=True,
                           text=True, timeout=60, env=_clean_env())
        if r.returncode != 0:
            raise AssertionError(f"ftagent status failed: {r.stderr[-1000:]}")
        return dict(json.loads(r.stdout))

    def connected(self) -> int:
        try:
            return int(self.status().get("connected", 0))
        except (AssertionError, ValueError, subprocess.TimeoutExpired):
            return 0

    # ------------------------------------------------------------------ the job

    def start_job(self, env: Mapping[str, str] | None = None, flags: Sequence[str] = ()
                  ) -> None:
        """One agent per node for ranks 0..N-1 (node i runs rank i), then the spares."""
        self.env = {**FAST_ENV, **(env or {})}
        self.flags = list(flags)
        for r in range(self.world):
            self.start_rank(r)
        for i in range(self.spares):
            self.start_rank(self.world + i, spare=True)

    def start_rank(self, r: int, extra: Sequence[str] = (),
                   launcher: Callable[[int], list[str]] | None = None, *,
                   spare: bool = False) -> subprocess.Popen[bytes]:
        """Start (or, after ``kill_agent``, replace) the agent of rank ``r`` on node ``r``;
        ``extra`` flags for this agent only (a simulated GPU timeline, say). ``launcher``
        (benchmarks): the command in front of ``python train.py`` instead of ftagent's,
        e.g. torchrun's, or [] for the bare trainer. ``spare``: slot ``r`` (past the
        job's ranks) runs a warm spare: no RANK, ``--spare``, pod ``JOB-spare-R``."""
        n = self.incarnation.get(r, -1) + 1
        self.incarnation[r] = n
        ns = self.net.namespaces[r]
        env = {"RANK": str(r), "WORLD_SIZE": str(self.world),
               "MASTER_ADDR": self.net.data_ip(0), "MASTER_PORT": str(MASTER_PORT),
               "GLOO_SOCKET_IFNAME": "eth0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "CHECKPOINT_DIR": str(self.ckpt_dir), "FAULT_TRIGGER_DIR": str(self.triggers),
               **self.env}
        if spare:
            del env["RANK"]  # the arbiter gives it one
        who = ["--spare"] if spare else ["--rank", str(r)]
        cmd = ["ip", "netns", "exec", ns, PY, "-m", "ftagent", "run",
               "--metrics-port", str(AGENT_METRICS_PORT), "--metrics-addr", self.net.ctl_ip(r),
               "--events-file", str(self.events_path(r, n)), *who,
               "--world-size", str(self.world), "--arbiter", self.address, "--job", self.job,
               "--pod", f"{self.job}-{'spare' if spare else 'worker'}-{r}",
               "--node", f"node-{r}", "--nic", "eth0",
               *self.flags, *extra, "--", PY, TRAIN]
        if launcher is not None:
            cmd = ["ip", "netns", "exec", ns, *launcher(r), TRAIN]
        p = self._spawn(cmd, self.log_path(r, n), env, stamp=self.stamp)
        self.agents[r] = p
        return p

    def events_path(self, r: int, n: int | None = None) -> Path:
        return self.tmp / f"rank{r}.{self.incarnation.get(r, 0) if n is None else n}.jsonl"

    def log_path(self, r: int, n: int | None = None) -> Path:
        return self.tmp / f"rank{r}.{self.incarnation.get(r, 0) if n is None else n}.out"

    def log(self, r: int) -> str:
        """Rank ``r``'s output over every incarnation of its agent."""
        return "".join(p.read_text(errors="replace")
                       for p in sorted(self.tmp.glob(f"rank{r}.*.out")))

    def events(self, r: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for p in sorted(self.tmp.glob(f"rank{r}.*.jsonl")):
            for line in p.read_text().splitlines():
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        break
        return out

    def _attempt(self, r: int) -> tuple[str, int]:
        """Rank ``r``'s current attempt: its output since the attempt's first line and the
        step it started from. The first line is ``resumed from checkpoint`` where there is a
        checkpoint (it comes before ``started:``), else ``started:``; cutting at ``started:``
        alone would read a resumed attempt that has not printed it yet as the dead one."""
        text = self.log(r)
        resumed, started = text.rfind("] resumed from checkpoint at step "), \
            text.rfind("] started: ")
        cut = max(resumed, started)
        if cut < 0:
            return "", 0
        m = re.search(r"(?:resumed from checkpoint at step |from_step=)(\d+)", text[cut:])
        return text[cut:], int(m.group(1)) if m else 0

    def steps(self, r: int) -> int:
        """The last step rank ``r``'s current attempt logged, so a restarted attempt that
        has not stepped yet reads as the step it resumed from, never as the dead attempt's
        last step (0 before any)."""
        text, start = self._attempt(r)
        found = re.findall(r"\] step=(\d+)/", text)
        return int(found[-1]) if found else start

    def attempt_steps(self, r: int) -> int:
        """Steps rank ``r``'s current attempt has made since it started (or resumed)."""
        text, start = self._attempt(r)
        found = re.findall(r"\] step=(\d+)/", text)
        return int(found[-1]) - start if found else 0

    def settled(self, steps: int = 8, timeout: float = 180) -> None:
        """Wait until every rank's current attempt is ``steps`` steps in: past the hang
        detector's warm-up (--hang-warmup-steps 5), so the next drill starts from a
        training job whatever the previous drill left (a failed drill does not cascade)."""
        wait(lambda: all(self.attempt_steps(r) >= steps for r in range(self.world)), timeout,
             f"every rank {steps} steps into its attempt", self)

    def trigger(self, kind: str, rank: int, value: str = "") -> None:
        """Inject ``kind`` (crash, hang, stall, slow) on ``rank`` at its next step."""
        tmp = self.triggers / f".{kind}.{rank}.tmp"
        tmp.write_text(value)
        tmp.rename(self.triggers / f"{kind}.{rank}")

    def clear_trigger(self, kind: str, rank: int) -> None:
        (self.triggers / f"{kind}.{rank}").unlink(missing_ok=True)

    def metrics(self, r: int) -> str:
        """Rank ``r``'s agent's /metrics text ('' while it does not answer)."""
        url = f"http://{self.net.ctl_ip(r)}:{AGENT_METRICS_PORT}/metrics"
        try:
            with _NO_PROXY.open(url, timeout=5) as resp:
                return str(resp.read().decode())
        except OSError:
            return ""

    def sample(self, r: int, name: str) -> float | None:
        """The first sample of ``name`` (a full series name, labels ignored) on rank ``r``."""
        for line in self.metrics(r).splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def kill_agent(self, r: int) -> None:
        """SIGKILL the agent of rank ``r`` (the pod dies): its trainer dies with it."""
        p = self.agents[r]
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def signal_agents(self, sig: int) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                p.send_signal(sig)

    def wait_agents(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for r in range(self.world):
            try:
                codes.append(self.agents[r].wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    # ------------------------------------------------------------------ the network

    def link_down(self, node: int) -> None:
        """Node ``node`` loses its carrier on eth0 (its switch port goes down)."""
        subprocess.run(["ip", "link", "set", self.net.data_link(node), "down"], check=True,
                       timeout=30)

    def link_up(self, node: int) -> None:
        subprocess.run(["ip", "link", "set", self.net.data_link(node), "up"], check=True,
                       timeout=30)

    # ------------------------------------------------------------------ Prometheus

    def start_prometheus(self) -> None:
        if shutil.which("prometheus") is None:
            raise RuntimeError("prometheus missing: `make deps` installs Debian's package")
        host = self.net.host_ip
        self.prometheus_port = _free_port(host)
        agents = [f'"{self.net.ctl_ip(i)}:{AGENT_METRICS_PORT}"' for i in range(self.world)]
        cfg = self.tmp / "prometheus.yml"
        cfg.write_text(textwrap.dedent(f"""
            global:
              scrape_interval: 1s
              evaluation_interval: 1s
            scrape_configs:
              - job_name: agents
                static_configs:
                  - targets: [{", ".join(agents)}]
              - job_name: arbiter
                static_configs:
                  - targets: ["{host}:{self.arbiter_metrics_port}"]
        """))
        self.prometheus = self._spawn(
            ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={self.tmp / 'tsdb'}",
             f"--web.listen-address={host}:{self.prometheus_port}", "--log.level=warn"],
            self.tmp / "prometheus.log")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query; [] while Prometheus is not up or has no such series."""
        url = (f"http://{self.net.host_ip}:{self.prometheus_port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expr}))
        try:
            with _NO_PROXY.open(url, timeout=5) as r:
                return list(json.load(r)["data"]["result"])
        except (OSError, ValueError, KeyError):
            return []

    def value(self, expr: str) -> float | None:
        got = self.query(expr)
        return float(got[0]["value"][1]) if got else None

    # ------------------------------------------------------------------ reports

    def dump(self) -> str:
        """The tails of every log, for a failing drill's message."""
        parts = []
        for p in sorted(self.tmp.glob("*.out")) + sorted(self.tmp.glob("arbiter-*.log")):
            parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}")
        tl = "\n".join(line_of(e) for e in self.timeline()[-40:])
        return "\n".join(parts) + f"\n--- timeline\n{tl}"


def _pump(p: subprocess.Popen[bytes], log: Path) -> None:
    assert p.stdout is not None
    with log.open("ab") as out:
        for line in p.stdout:
            out.write(f"{time.time():.3f} ".encode() + line)
            out.flush()


def line_of(e: Mapping[str, Any]) -> str:
    return (f"{e.get('kind', ''):9} {e.get('action', ''):16} g{e.get('generation', '-')} "
            f"r{e.get('rank', '-')} {str(e.get('message', ''))[:160]}")


def wait(pred: Callable[[], Any], timeout: float, what: str, lab: Lab | None = None,
         interval: float = 0.1) -> Any:
    """Poll ``pred`` until truthy; on timeout fail with the lab's logs."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                                 + (f"\n{lab.dump()}" if lab is not None else ""))
        time.sleep(interval)
