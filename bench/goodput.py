"""Goodput side by side: the same job and the same fault schedule under each launcher.

The job: examples/train.py, PyTorch DDP over gloo on CPU, 2 ranks on 2 simulated nodes
(tests/lab: network namespaces on a bridge, gloo on each node's own eth0), checkpoints
every ``--ckpt-every`` steps (every launcher resumes from the last one: the trainer does
it, not the launcher). The schedule (``--faults``), the same for every launcher: after
``--warmup`` seconds of training, rank 1 crashes; once training is back (and ``--gap``
seconds later) rank 1 hangs before an all-reduce; once back again, rank 1's link loses its
carrier for ``--outage`` seconds; then, ``--xid-at`` seconds after the launch, rank 1's GPU
raises a fatal Xid (79, fallen off the bus); the run ends ``--minutes`` after training
first started (or when the last fault is recovered plus ``--gap``, if that is later).
Faults are trigger files the trainer reads at its next step (FAULT_TRIGGER_DIR), so they
land at the same point of the job under every launcher.

**The Xid**: ftagent watches a simulated GPU (``--gpu-backend simulated:FILE``, a timeline
whose Xid comes ``--xid-at`` seconds after the agent's start); the arbiter replaces rank 1
(its agent exits with the replace status, as its pod would be deleted) and the bench plays
Kubernetes: it starts the new pod's agent at once, on a healthy GPU (a real cluster adds
scheduling and container start). The other launchers watch no GPU: for them the Xid is a
crash of rank 1 at the same time after the launch (on a real GPU their restart would land
on the same broken GPU; here it trains again). With ``--spares N`` (default 1) ftagent's
job also has N warm spares (``ftagent run --spare``, one more lab node each): the arbiter
ASSIGNs rank 1 to a spare, which starts it from its warm standby at once; the new pod's
agent the bench starts then serves as the job's next spare.

**The random schedule** (``--schedule random``, issue 34): the trainer's disk checkpoint
every ``--ckpt-seconds`` (300: twice in a ten-minute job; made steps with
``--step-estimate``, the interval actually run is printed), and each fault (crash, hang,
Xid; ``--faults`` to change) at a uniformly random point of its own slot of the window
(the window less ``--warmup`` and ``--tail``, cut into one slot per fault; the draws from
``--seed``, the same for every launcher), so each lands at a random point of the disk
interval. Printed per fault: where it landed (steps since the disk checkpoint) and the
work it redid (the furthest step before the restart less the step resumed from), and, for
``ftagent-snapshots``, whether that stayed within one snapshot interval. ``--json FILE``
writes the runs' figures (bench/goodput_projection.py --from reads them).

Launchers (one lab each, alternated over ``--rounds``):

* **ftagent-snapshots**: ftagent as below, and the trainer snapshots its state every
  ``--snapshot-every`` steps (``ftagent.checkpoint``, SNAPSHOT_EVERY), each node's own
  memory root under /dev/shm (a replaced pod gets a new, empty one), replicas in a ring
  (``--replica-listen``/``--replica-peer``, keyed by a job token), and ``--spares`` warm
  spares as ftagent's (each with a memory root of its own, copying to node 0): after the
  Xid the arbiter ASSIGNs rank 1 to a spare, whose agent fetches rank 1's replica from
  rank 0's agent before its trainer starts (with ``--spares 0``: the replacement pod's
  agent does, once the bench has started it).

* **ftagent**: one ``ftagent run`` per node, a real arbiter, warm restarts as by default,
  ``--hang-timeout-min 2``, ``--nic-grace 2``, and ``--spares`` warm spares on nodes of
  their own (0: none).
* **torchrun**: ``torchrun --nnodes 2 --nproc-per-node 1 --max-restarts 5`` per node
  (c10d rendezvous on node 0), ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its best
  chance: without it restarts fail, see below) and the trainer's own process-group timeout
  ``--pg-timeout`` (30 s): torchrun notices a hang only when gloo's timeout kills a rank.
  The favourable baseline ("vs torchrun").
* **torchrun-default**: the same with the process-group timeout a torchrun user gets who
  sets none: torch's default for gloo (``torch.distributed.constants.default_pg_timeout``,
  30 min; NCCL's is 10 min). A hang then outlasts a ten-minute window: the wait for
  training again ends with the window, and the rest of the window is lost.
* **ft_launcher** (nvidia-resiliency-ext) and **dlrover-run** (DLRover), each from its own
  virtualenv under ``.bench-venvs/`` (``bash bench/peers.sh``; ``BENCH_VENVS`` to move
  it), so the project's torch is untouched. ft_launcher: torchrun's flags plus its rank
  monitors' ``--ft-rank-heartbeat-timeout`` (``--peer-hang-timeout``, 5 s) with the
  trainer sending a heartbeat per step (its documented integration,
  TRAIN_NVRX_HEARTBEAT=1). dlrover-run: ``--max-restarts 5 --network-check`` with a
  DLRover job master (``--platform local``, hang detection with fault tolerance, its
  shortest downtime: 1 minute) on the control network, as the arbiter is. A peer whose
  venv is missing is left out with a one-line reason.

Per fault class: **detect** = injection -> the launcher's first sign (ftagent: the fault
on the arbiter's timeline; others: their agent's first log line about the failure),
**training again** = injection -> the first step line of the attempt that follows (or, when
nothing restarts, the first step after the outage), **lost steps** = the furthest step
before the restart minus the step resumed from. **Goodput** = the wall time the kept steps
took (each step number's last run: the gap between its line's stamp and the previous step
line's in the same attempt, less any part of it inside the link's outage up to training
again -- after the link is up the stalled all-reduce still waits for TCP's backed-off
retransmission, and no step completes; ``kept_wall_seconds``) / the run's training window
(rank 0's first step to the end); it cannot exceed the window. Printed beside it, for
one release: the old figure from the durations the trainer prints
(``kept_printed_seconds``, less the link's down time only: on a loaded machine they
summed to more than the wall time there was, 118.3 s for 112.0 s in one run), and
"median-based" (steps kept x the median healthy step: it also counts every step slower
than the median as lost, which on a shared machine is load, not a fault). For ftagent
the **ledger** (``ftagent status JOB --json``, its goodput block, read at the window's
end) is printed beside it: productive / (wall - startup) is the same
window (the ledger's wall starts at the first registration).

Also: the **default torchrun restart failure rate** (``--default-trials`` restarts
without TORCH_DISABLE_SHARE_RDZV_TCP_STORE, each a crash after a few steps: a restart that
does not train again within 60 s fails), and **overhead** on a healthy job of
``--overhead-steps`` steps: median step time under ftagent (SDK on, NIC watch, hang
verification, Prometheus scraping the agents every second) vs the bare trainer, and the
launcher's own CPU and PSS (ftagent agent vs torchrun agent).

Needs root (network namespaces). Not run in CI. Do not edit examples/train.py while it
runs: ftagent's warm standby then (rightly) starts the next attempt cold.

    sudo .venv/bin/python bench/goodput.py --minutes 10 --default-trials 0 --no-overhead
    sudo .venv/bin/python bench/goodput.py --schedule random --minutes 10 \
        --launchers ftagent-snapshots,ftagent --default-trials 0 --no-overhead --json g.json
    bash bench/peers.sh && sudo .venv/bin/python bench/goodput.py --minutes 10 \
        --launchers ftagent,torchrun,ft_launcher,dlrover-run --default-trials 0 --no-overhead
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from tests.lab import FAST_ENV, Lab  # noqa: E402
from tests.lab.lab import MASTER_PORT, PY, _free_port  # noqa: E402
from tests.netns import netns_unavailable  # noqa: E402

# the rate is a number: an agent's line can follow it on the same line (the two writers
# share the output), "samples_per_second=70.2[ftagent rank0 ...] INFO ..."
STEP = re.compile(r"^(\d+\.\d+) \[rank(\d)\] step=(\d+)/\d+ loss=\S+ "
                  r"samples_per_second=(\d+(?:\.\d+)?)")
STARTED = re.compile(r"^(\d+\.\d+) \[rank(\d)\] started: .* from_step=(\d+)")
BATCH = 16  # examples/train.py's batch: step seconds = BATCH / samples_per_second
SETTLE = 6.0  # seconds after training resumes before it counts (a restart may follow)


@dataclass
class Fault:
    kind: str
    at: float  # wall time injected
    before: int  # last step rank 0 logged before it
    detect: float | None = None
    back: float | None = None
    resumed: int | None = None
    end: float | None = None  # outage: when the link came back
    decided: float | None = None  # ftagent: the arbiter's restart/replace decision
    released: float | None = None  # ftagent: the new generation's barrier released

    @property
    def lost(self) -> int:
        return 0 if self.resumed is None else max(0, self.before - self.resumed)


@dataclass
class Run:
    launcher: str
    faults: list[Fault] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    kept: int = 0
    step_seconds: float = 0.0
    kept_seconds: float = 0.0  # wall time the kept steps took, the outage cut out
    kept_printed_seconds: float = 0.0  # the old measure: their printed durations
    notes: list[str] = field(default_factory=list)
    ledger: dict[str, Any] | None = None  # ftagent: the arbiter's goodput block at the end
    ledger_at: float = 0.0
    load: float = 0.0  # the machine's mean 1-minute load average over the window
    ckpt_every: int = 0  # the trainer's disk checkpoint interval, steps
    snapshot_every: int = 0  # ftagent-snapshots: steps between two snapshots (0: none)

    @property
    def goodput(self) -> float:
        """The share of the window that became kept training (time-based, as the ledger)."""
        window = self.end - self.start
        return self.kept_seconds / window if window > 0 else 0.0

    @property
    def goodput_printed(self) -> float:
        """The old outside figure: the kept steps' printed durations / the window (one
        release, beside ``goodput``: it can exceed the wall time there was)."""
        window = self.end - self.start
        return self.kept_printed_seconds / window if window > 0 else 0.0

    @property
    def goodput_median(self) -> float:
        """Steps kept x the median healthy step / the window: also counts every step slower
        than the median as lost (on a shared machine, load: not a fault's cost)."""
        window = self.end - self.start
        return self.kept * self.step_seconds / window if window > 0 else 0.0


# ---------------------------------------------------------------------- reading the logs


def lines(lab: Lab, r: int) -> list[str]:
    return lab.log(r).splitlines()


def steps(lab: Lab, r: int = 0) -> list[tuple[float, int, float]]:
    """(arrival time, step, step seconds) of rank ``r``'s step lines."""
    out = []
    for ln in lines(lab, r):
        m = STEP.match(ln)
        if m:
            sps = float(m.group(4))
            out.append((float(m.group(1)), int(m.group(3)), BATCH / sps if sps > 0 else 0.0))
    return out


def kept_wall_seconds(log: list[str], windows: list[tuple[float, float]], start: float,
                      end: float) -> float:
    """Wall-clock seconds of kept training in rank 0's stamped lines (``log``), inside the
    window ``[start, end]``; never more than the window.

    An attempt begins at each "started:" line (or where a step does not go past the
    previous one). A step's time is the gap between its line's stamp and the previous
    step line's stamp in the same attempt; kept are each step number's last run (a step
    run again after a restart replaces the first run, which was lost), less any part of
    its gap inside a stall in ``windows`` (a link outage until training again: no
    progress). Each gap
    lies between two lines of one attempt, so gaps never overlap and sum to at most the
    window, however the lines are batched (a batch's first line carries the wait since
    the previous batch, its others none: their sum is the same).

    The first step of an attempt counts its printed duration, capped at the gap from the
    attempt's "started:" line: the gap from the start alone would count the trainer's
    start-up (imports, process group, checkpoint load) as training -- that is the
    restart's cost, which the ledger books as ``restart`` -- while the trainer's own
    timing of that step is the training in it. The run's first step line opens the
    window, so it adds nothing."""
    last: dict[int, tuple[float, float]] = {}  # step -> (interval start, stamp): last run
    began: float | None = None  # this attempt's "started:" stamp
    prev: tuple[float, int] | None = None  # this attempt's previous step line
    for ln in log:
        st = STARTED.match(ln)
        if st and st.group(2) == "0":
            began, prev = float(st.group(1)), None
            continue
        m = STEP.match(ln)
        if not m or m.group(2) != "0":
            continue
        t, step, sps = float(m.group(1)), int(m.group(3)), float(m.group(4))
        if prev is not None and step <= prev[1]:  # a new attempt without its line
            began, prev = None, None
        if prev is not None:
            lo = prev[0]
        else:
            printed = BATCH / sps if sps > 0 else 0.0
            lo = t - (printed if began is None else min(printed, max(0.0, t - began)))
        last[step] = (lo, t)
        prev = (t, step)
    total = 0.0
    for lo, hi in last.values():
        lo, hi = max(lo, start), min(hi, end)
        if hi <= lo:
            continue
        cut = sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in windows)
        total += max(0.0, hi - lo - cut)
    return min(total, max(0.0, end - start))


def kept_printed_seconds(all_steps: list[tuple[float, int, float]],
                         windows: list[tuple[float, float]]) -> float:
    """The old outside measure, printed beside ``kept_wall_seconds`` for one release:
    seconds of kept training in rank 0's step lines: each step number's last run (a
    step run again after a restart replaces the first run, which was lost), from the
    second step line on (the window starts at the first), each step's own duration
    ``[arrival - seconds, arrival]`` as the trainer printed it, less what falls in a
    fault window. The printed durations are the trainer's own timing, which on a loaded
    machine add up to more than the wall time there was (118.3 s for 112.0 s in one
    run): ``kept_wall_seconds`` replaces it."""
    last: dict[int, tuple[float, float]] = {}
    for t, s, dt in all_steps:
        last[s] = (t, dt)
    if not all_steps:
        return 0.0
    first = all_steps[0][1]
    total = 0.0
    for s, (t, dt) in last.items():
        if s <= first or s > all_steps[-1][1]:
            continue
        lo = t - dt
        cut = sum(max(0.0, min(t, b) - max(lo, a)) for a, b in windows)
        total += max(0.0, dt - cut)
    return total


def last_step(lab: Lab) -> int:
    s = steps(lab)
    return s[-1][1] if s else 0


def wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def training_again(lab: Lab, f: Fault) -> bool:
    """Fill ``f.back``/``f.resumed`` once rank 0 trains again after ``f``: the first step of
    an attempt started after the fault (a restart), else -- nothing restarted -- the first
    step after a stall (a gap of over 1 s or 10 median steps) that began after the fault
    (the link back, a hang that resolved). A step or two that ranks finish after the
    injection, before the fault bites, are not "training again"."""
    started = [(float(m.group(1)), int(m.group(3))) for ln in lines(lab, 0)
               if (m := STARTED.match(ln)) and float(m.group(1)) > f.at]
    all_steps = steps(lab)
    if started:
        after = [(t, s) for t, s, _ in all_steps if t > started[-1][0] and s > started[-1][1]]
        if after:
            f.back, f.resumed = after[0][0], started[-1][1]
            # the furthest step reached before the restart (the lines of a stamped run
            # can arrive after the injection: output is batched)
            f.before = max([s for t, s, _ in all_steps if t < started[-1][0]] or [f.before])
            return True
        return False
    dts = sorted(dt for _, _, dt in all_steps[-200:] if dt > 0)
    stall = max(1.0, 10 * dts[len(dts) // 2]) if dts else 1.0
    prev = None
    for t, _, _ in all_steps:
        if prev is not None and prev >= f.at - stall and t > (f.end or f.at) \
                and t - prev > stall:
            f.back = t
            return True
        prev = t
    return False


def ftagent_detect(lab: Lab, f: Fault) -> float | None:
    words = {"crash": "crash ", "hang": "hang ", "nic": "nic (", "xid": "gpu ("}[f.kind]
    ts = [float(e["ts"]) for e in lab.timeline() if e["kind"] == "fault"
          and str(e["message"]).startswith(words) and float(e["ts"]) >= f.at]
    return min(ts) if ts else None


TORCHRUN_FAILED = re.compile(r"failed|FAILED|exitcode|Restarting|Rendezvous|SignalException"
                             r"|Timed out|Connection")


def launcher_detect(lab: Lab, f: Fault) -> float | None:
    """The first launcher (not trainer) line after the injection that is about a failure."""
    first = None
    for r in (0, 1):
        for ln in lines(lab, r):
            t_s, _, rest = ln.partition(" ")
            try:
                t = float(t_s)
            except ValueError:
                continue
            if t < f.at or rest.startswith("[rank"):
                continue
            if TORCHRUN_FAILED.search(rest) and (first is None or t < first):
                first = t
                break
    return first


# ---------------------------------------------------------------------- the random schedule


def fault_times(n: int, window: float, warmup: float, tail: float,
                rng: random.Random) -> list[float]:
    """Seconds after training first started at which ``n`` faults land: the span between
    ``warmup`` and ``window - tail`` cut into ``n`` equal slots, one fault at a uniformly
    random point of each (the same draws for every launcher of a run: one ``rng``). A
    random point of the window is a random point of the disk checkpoint's interval."""
    span = max(0.0, window - tail - warmup)
    return [warmup + (j + rng.random()) * span / n for j in range(n)]


def disk_interval_steps(ckpt_seconds: float, step_seconds: float) -> int:
    """The trainer's CHECKPOINT_EVERY for a disk checkpoint every ``ckpt_seconds`` of
    training at ``step_seconds`` a step (at least 1)."""
    return max(1, round(ckpt_seconds / step_seconds)) if step_seconds > 0 else 1


def redone(faults: list[Fault], step_seconds: float, interval: int) -> dict[str, Any]:
    """The work each fault redid (steps from the step resumed to the furthest step before
    the restart: ``Fault.lost``), in steps and seconds, with where the fault landed in the
    disk checkpoint's ``interval`` (steps since the last disk checkpoint)."""
    rows = [{"kind": f.kind, "lost_steps": f.lost, "lost_seconds": f.lost * step_seconds,
             "since_disk_checkpoint": f.before % interval if interval > 0 else None}
            for f in faults if f.back is not None]
    lost = [r["lost_steps"] for r in rows]
    return {"faults": rows, "mean_steps": statistics.mean(lost) if lost else None,
            "max_steps": max(lost) if lost else None,
            "mean_seconds": statistics.mean(lost) * step_seconds if lost else None}


# ---------------------------------------------------------------------- launchers


def torchrun(lab: Lab, max_restarts: int = 5) -> Any:
    def cmd(r: int) -> list[str]:
        # c10d rendezvous, as torchrun recommends for several nodes (the static one
        # ignores TORCH_DISABLE_SHARE_RDZV_TCP_STORE); node 0 hosts it
        return [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(r), "--rdzv-backend", "c10d", "--rdzv-id", "goodput",
                "--rdzv-endpoint", f"{lab.net.data_ip(0)}:{MASTER_PORT + 1}",
                # node 0 hosts the store: torchrun guesses it from the hostname, which a
                # namespace shares with every other node of the lab
                "--rdzv-conf", f"is_host={'true' if r == 0 else 'false'}",
                "--local-addr", lab.net.data_ip(r),  # else the workers' store is the hostname's
                "--max-restarts", str(max_restarts), "--monitor-interval", "0.1"]
    return cmd


VENVS = Path(os.environ.get("BENCH_VENVS", ROOT / ".bench-venvs"))
# launcher -> (its venv under VENVS, its executable, the module it imports, the package)
PEERS = {"ft_launcher": ("nvrx", "ft_launcher", "nvidia_resiliency_ext",
                         "nvidia-resiliency-ext"),
         "dlrover-run": ("dlrover", "dlrover-run", "dlrover", "dlrover[torch]")}


def peer_exe(name: str) -> Path:
    venv, exe, _, _ = PEERS[name]
    return VENVS / venv / "bin" / exe


def peer_missing(name: str) -> str:
    """Why peer ``name`` cannot run here ('' if it can)."""
    venv, _, module, pkg = PEERS[name]
    py = VENVS / venv / "bin" / "python"
    if not py.exists() or not peer_exe(name).exists():
        return f"no venv at {VENVS / venv} (bash bench/peers.sh installs {pkg})"
    r = subprocess.run([str(py), "-c", f"import {module}"], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        return f"{module} does not import in {VENVS / venv}: {r.stderr.strip()[-200:]}"
    return ""


def ft_launcher(lab: Lab, args: argparse.Namespace) -> Any:
    """nvidia-resiliency-ext's ft_launcher: torchrun's flags (c10d on node 0, as above)
    plus its rank monitors' heartbeat timeouts (hang detection: the trainer sends a
    heartbeat per step, TRAIN_NVRX_HEARTBEAT=1, its documented integration); the first
    heartbeat may take the cold start."""
    base = torchrun(lab)

    def cmd(r: int) -> list[str]:
        return [str(peer_exe("ft_launcher")), *base(r)[3:],
                "--ft-initial-rank-heartbeat-timeout", "120",
                "--ft-rank-heartbeat-timeout", str(args.peer_hang_timeout)]
    return cmd


def dlrover_run(lab: Lab, args: argparse.Namespace) -> Any:
    """DLRover's dlrover-run on each node, with the job master it needs beside it (on
    Kubernetes the ElasticJob operator starts one; here ``dlrover.python.master.main
    --platform local`` on the control network, as the arbiter is): ``--max-restarts``,
    ``--network-check`` (a check of every node before training resumes), and the master's
    hang detection with fault tolerance (``--hang_detection 2``; ``--hang_downtime`` is
    in whole minutes, 1 at least)."""
    venv = VENVS / PEERS["dlrover-run"][0]
    port = _free_port(lab.net.host_ip)
    lab.others.append(lab._spawn(
        [str(venv / "bin" / "python"), "-m", "dlrover.python.master.main", "--port",
         str(port), "--node_num", str(lab.world), "--job_name", lab.job, "--platform",
         "local", "--hang_detection", "2", "--hang_downtime", "1"],
        lab.tmp / "dlrover-master.log", {"PYTHONUNBUFFERED": "1"}))
    lab.env["DLROVER_MASTER_ADDR"] = f"{lab.net.host_ip}:{port}"

    def cmd(r: int) -> list[str]:
        # NODE_ID and NODE_NUM as DLRover's operator sets them on each pod (without a
        # NODE_ID every node is node 0, and the network check never completes); POD_IP as
        # its pods get it from the downward API: without it DLRover resolves the hostname,
        # which the lab's namespaces share, and node 0's store is 127.0.0.1 to rank 1
        return ["env", f"NODE_RANK={r}", f"NODE_ID={r}", f"NODE_NUM={lab.world}",
                f"POD_IP={lab.net.data_ip(r)}",
                str(peer_exe("dlrover-run")), "--nnodes",
                str(lab.world), "--nproc_per_node", "1", "--node_rank", str(r),
                "--max-restarts", "5", "--network-check"]
    return cmd


def bare(lab: Lab) -> Any:
    return lambda r: [PY]


FTAGENT_FLAGS = ["--hang-timeout-min", "2", "--nic-grace", "2", "--max-restarts", "10"]
XID = 79  # "GPU has fallen off the bus": fatal, the node must go (detect/gpu.py's table)


def gpu_timeline(tmp: Path, xid_at: float | None) -> tuple[Path, Path]:
    """(rank 1's first timeline, a clean one): ``--gpu-backend simulated:FILE`` files. The
    simulated GPU of rank 1 raises Xid ``XID`` ``xid_at`` seconds after its agent's
    ``nvmlInit`` (the agent's start); the replacement rank 1 and rank 0 get healthy GPUs."""
    clean = tmp / "gpus-clean.txt"
    clean.write_text("gpus 1\n")
    fatal = tmp / "gpus-rank1.txt"
    fatal.write_text("gpus 1\n" + ("" if xid_at is None else
                                   f"t={xid_at:.1f}s rank=1 gpu=0 xid={XID}\n"))
    return fatal, clean


def gpu_flags(timeline: Path) -> list[str]:
    return ["--gpu-backend", f"simulated:{timeline}"]


REPLICA_PORT = 29700
SNAPSHOT_TOKEN = "goodput-bench-job-token"  # the replica channel's key is derived from it


def snapshot_flags(lab: Lab, name: str, r: int) -> list[str]:
    """ftagent-snapshots: each node's own memory root (a new pod: a new, empty one, under
    /dev/shm as a memory-backed emptyDir would be), and the peer replica in a ring (node
    r's agent keeps node 1-r's replica), keyed by the job token. A warm spare's node
    (``r`` past the job's two) copies to node 0, the holder of rank 1's replica: the rank
    the schedule's Xid moves to it, whose shard it fetches from there before its trainer
    starts."""
    if name != "ftagent-snapshots":
        return []
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else lab.tmp
    root = base / f"ftagent-goodput-{lab.tmp.name}-{os.getpid()}" / \
        f"node{r}.{lab.incarnation.get(r, -1) + 1}"
    SNAPSHOT_ROOTS.append(root.parent)
    peer = 1 - r if r < 2 else 0
    return ["--snapshot-dir", str(root), "--token", SNAPSHOT_TOKEN,
            "--replica-listen", f"{lab.net.data_ip(r)}:{REPLICA_PORT}",
            "--replica-peer", f"{lab.net.data_ip(peer)}:{REPLICA_PORT}"]


SNAPSHOT_ROOTS: list[Path] = []  # removed at the end of each run, whatever ends it


def drop_snapshot_roots() -> None:
    for root in SNAPSHOT_ROOTS:
        shutil.rmtree(root, ignore_errors=True)
    SNAPSHOT_ROOTS.clear()


def launch(lab: Lab, name: str, env: dict[str, str], args: argparse.Namespace,
           gpus: tuple[Path, Path] | None = None) -> None:
    if name in ("ftagent", "ftagent-snapshots"):
        flags = [*FTAGENT_FLAGS, *shlex.split(args.ftagent_flags)]
        if name == "ftagent-snapshots":
            env = {**env, "SNAPSHOT_EVERY": str(args.snapshot_every)}
        if gpus is None and name == "ftagent":
            lab.start_job(env, flags)
        else:  # start_job with one GPU timeline (and snapshot memory) per rank
            lab.env = {**FAST_ENV, **env}
            lab.flags = flags
            for r in range(lab.world):
                gpu = [] if gpus is None else gpu_flags(gpus[0] if r == 1 else gpus[1])
                lab.start_rank(r, extra=[*gpu, *snapshot_flags(lab, name, r)])
            for i in range(lab.spares):  # a spare's GPU is healthy
                lab.start_rank(lab.world + i, spare=True, extra=[
                    *gpu_flags(gpus[1]), *snapshot_flags(lab, name, lab.world + i)])
    elif name in ("torchrun", "torchrun-default"):
        lab.env = {**FAST_ENV, **env}  # the trainer's knobs exactly as ftagent's run has them
        for r in range(lab.world):
            lab.start_rank(r, launcher=torchrun(lab))
    elif name == "ft_launcher":
        lab.env = {**FAST_ENV, **env, "TRAIN_NVRX_HEARTBEAT": "1"}
        for r in range(lab.world):
            lab.start_rank(r, launcher=ft_launcher(lab, args))
    elif name == "dlrover-run":
        lab.env = {**FAST_ENV, **env}
        launcher = dlrover_run(lab, args)
        for r in range(lab.world):
            lab.start_rank(r, launcher=launcher)
    elif name == "bare":
        lab.env = {**FAST_ENV, **env}
        for r in range(lab.world):
            lab.start_rank(r, launcher=bare(lab))
    else:
        raise ValueError(name)


# ---------------------------------------------------------------------- one scheduled run


KINDS = ("crash", "hang", "nic", "xid")


def xid_seen(lab: Lab) -> float | None:
    """When rank 1's agent saw the simulated Xid (its events file), if it did."""
    ts = [float(e["ts"]) for e in lab.events(1) if e.get("event") == "fault"
          and e.get("kind") == "gpu"]
    return min(ts) if ts else None


def phases(timeline: list[dict[str, Any]], faults: list[Fault]) -> None:
    """Fill each fault's ``decided`` (the arbiter's restart or replace after it) and
    ``released`` (the next barrier released after that) from the arbiter's timeline; a
    fault that restarted nothing before the next one (a link back and the steps went on)
    has neither."""
    for i, f in enumerate(faults):
        nxt = faults[i + 1].at if i + 1 < len(faults) else float("inf")
        ds = [float(e["ts"]) for e in timeline if e.get("kind") == "decision"
              and e.get("action") in ("restart", "replace") and f.at <= float(e["ts"]) < nxt]
        if ds:
            f.decided = min(ds)
            rs = [float(e["ts"]) for e in timeline if e.get("kind") == "barrier"
                  and float(e["ts"]) >= f.decided]
            f.released = min(rs) if rs else None


def read_ledger(lab: Lab) -> dict[str, Any] | None:
    """The arbiter's goodput block (``ftagent status JOB --json``), or None."""
    try:
        g = lab.status().get("goodput")
    except (AssertionError, ValueError, OSError) as e:
        return {"error": str(e)[:200]}
    return dict(g) if isinstance(g, dict) else None


def torch_default_pg_timeout() -> float:
    """Seconds of torch's own process-group timeout for gloo (what a torchrun user gets
    who passes none: ``torch.distributed.constants.default_pg_timeout``, 30 min; NCCL's
    is 10 min)."""
    r = subprocess.run([PY, "-c", "import torch.distributed.constants as c; "
                        "print(c.default_pg_timeout.total_seconds())"],
                       capture_output=True, text=True, timeout=120, check=True)
    return float(r.stdout.strip())


def pg_timeout(name: str, args: argparse.Namespace) -> float:
    """The trainer's process-group timeout under launcher ``name``: torch's default for
    ``torchrun-default``, else ``--pg-timeout`` (30 s: tuned for torchrun, its best case)."""
    return torch_default_pg_timeout() if name == "torchrun-default" else args.pg_timeout


def run_schedule(name: str, args: argparse.Namespace, tmp: Path) -> Run:
    run = Run(name)
    LOADS.clear()
    timeout = pg_timeout(name, args)
    run.notes.append(f"the trainer's process-group timeout: {timeout:.0f} s")
    env = {"TRAIN_STEPS": "100000000", "CHECKPOINT_EVERY": str(args.ckpt_every),
           "TRAIN_STEP_SLEEP": str(args.step_sleep), "TRAIN_PG_TIMEOUT": str(timeout),
           "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    arbiter_args = ["--max-restarts", "10", "--nic-replace-after", "600"]
    kinds = [k for k in KINDS if k in args.faults.split(",")]
    xid_at = args.xid_at if args.xid_at > 0 else max(200.0, args.minutes * 30 + 30)
    slot_at: dict[str, float] = {}  # the random schedule: seconds after the first step
    if args.schedule == "random":
        env["CHECKPOINT_EVERY"] = str(args.ckpt_every)
        slot_at = dict(zip(kinds, fault_times(len(kinds), args.minutes * 60, args.warmup,
                                         args.tail, random.Random(args.seed)), strict=True))
        if "xid" in kinds:  # its GPU timeline counts from the agent's start
            xid_at = slot_at["xid"] + args.startup_estimate
        when = ", ".join(f"{k} {t:.0f}" for k, t in slot_at.items())
        run.notes.append(f"random schedule (seed {args.seed}): {when} s after the first "
                         f"step; disk checkpoint every {args.ckpt_every} steps")
    gpus = gpu_timeline(tmp, xid_at if "xid" in kinds else None)
    ftagent_like = name in ("ftagent", "ftagent-snapshots")
    # with snapshots, the spare given the Xid's rank fetches that rank's shard from its
    # replica holder before its trainer starts (tests/e2e/test_replica_ring.py)
    spares = args.spares if ftagent_like else 0
    if ftagent_like:
        run.notes.append(f"warm spares: {spares} (--spares)" + (
            "" if name == "ftagent" else f"; a snapshot every {args.snapshot_every} steps, "
            "replicas in a ring, the rank's new pod (a spare, else its replacement) fetches "
            "its replica"))
    with Lab(tmp, 2, job="goodput", arbiter=ftagent_like, arbiter_args=arbiter_args,
             stamp=True, spares=spares) as lab:
        launched = time.time()
        launch(lab, name, env, args, gpus)
        wait(lambda: steps(lab, 0) and steps(lab, 1), 180, f"{name}: first steps")
        run.start = steps(lab, 0)[0][0]
        deadline = run.start + args.minutes * 60
        wait_until(run.start + args.warmup)
        replaced: list[int | None] = []

        def replace_rank1() -> None:
            """The bench plays Kubernetes after a fatal Xid: rank 1's agent exits with the
            replace status (its pod goes), and a new pod's agent starts at once on a
            healthy GPU (a real cluster adds scheduling and container start)."""
            if ftagent_like and not replaced and lab.agents[1].poll() is not None:
                replaced.append(lab.agents[1].returncode)
                lab.start_rank(1, extra=[*gpu_flags(gpus[1]), *snapshot_flags(lab, name, 1)])

        for kind in kinds:
            if kind in slot_at and kind != "xid":
                late = time.time() - run.start - slot_at[kind]
                if late > 0:
                    run.notes.append(f"the {kind} came {late:.0f} s late: the previous fault "
                                     "was not over")
                wait_until(run.start + slot_at[kind])
            if kind == "xid":
                if time.time() > launched + xid_at:
                    run.notes.append(f"the Xid came {time.time() - launched - xid_at:.0f} s "
                                     "before the previous fault was over: raise --xid-at")
                wait_until(launched + xid_at)
            f = Fault(kind, time.time(), last_step(lab))
            if kind == "nic":
                lab.link_down(1)
                time.sleep(args.outage)
                lab.link_up(1)
                f.end = time.time()
            elif kind == "xid" and not ftagent_like:
                lab.trigger("crash", 1)  # no GPU watch: a fatal Xid is a crash of the rank
            elif kind != "xid":  # ftagent's simulated GPU raises the Xid by itself
                lab.trigger(kind, 1)
            run.faults.append(f)

            def back(f: Fault = f) -> bool:
                replace_rank1()
                return training_again(lab, f)
            try:
                # at most until the window's end: with torch's default timeout (30 min) a
                # hang outlasts the window, and the rest of the window is what it lost
                wait(back, min(timeout * 3 + 120, max(30.0, deadline - time.time())),
                     f"{name}: training again after the {kind}")
                # a restart may still follow steps that resumed by themselves (ftagent
                # restarts every rank once a link is back, gloo's pairs recovered or not):
                # training is "again" only after the last disruption, once steps have
                # gone on for SETTLE seconds with the same answer
                settle_by = time.monotonic() + 180
                while True:
                    seen, at = f.back, last_step(lab)
                    time.sleep(SETTLE)
                    f.back = f.resumed = None
                    wait(back, 120, f"{name}: settled")
                    if f.back == seen and last_step(lab) > at:
                        break
                    if time.monotonic() > settle_by:
                        raise TimeoutError(f"{name}: training did not settle after the {kind}")
            except TimeoutError as e:
                run.notes.append(str(e))
                break
            if kind == "xid" and ftagent_like:
                seen = xid_seen(lab)
                if seen is not None:  # the Xid's onset: when the simulated GPU raised it
                    f.at = seen
                run.notes.append(f"xid: rank 1's agent exited with status {replaced}; the "
                                 "bench started its replacement at once" if replaced else
                                 "xid: rank 1's agent did not exit (no replacement)")
                took = [e for e in lab.timeline() if e.get("action") == "assign"]
                if spares:
                    run.notes.append(f"xid: {took[-1]['message']}" if took else
                                     "xid: no spare took rank 1 over")
            f.detect = (ftagent_detect if ftagent_like else launcher_detect)(lab, f)
            wait_until(time.time() + args.gap)
        wait_until(max(deadline, time.time()))
        run.end = time.time()
        run.load = statistics.mean(LOADS) if LOADS else os.getloadavg()[0]
        if ftagent_like:
            phases(lab.timeline(), run.faults)
            run.ledger = read_ledger(lab)
            run.ledger_at = time.time()
            with contextlib.suppress(AssertionError, ValueError, OSError,
                                     subprocess.TimeoutExpired):
                (tmp / "status.json").write_text(json.dumps(lab.status(), indent=1))
        all_steps = steps(lab, 0)
        run.kept = all_steps[-1][1] - all_steps[0][1] if all_steps else 0
        healthy = [dt for t, _, dt in all_steps if dt > 0 and not any(
            f.at - 1 <= t <= (f.back or run.end) + 1 for f in run.faults)]
        run.step_seconds = statistics.median(healthy) if healthy else 0.0
        # a kept step that spans the link's outage made no progress meanwhile; other
        # faults leave no kept step behind them (the step in flight is redone)
        # (the wall-clock measure: until training again, as the ledger's outage; the
        # link up is not training again: the blocked all-reduce waits for TCP's
        # backed-off retransmission, seconds in which no step completes)
        outages = [(f.at, f.end) for f in run.faults if f.end is not None]
        stalls = [(f.at, max(f.end, f.back or f.end)) for f in run.faults
                  if f.end is not None]
        run.kept_seconds = kept_wall_seconds(lines(lab, 0), stalls, run.start, run.end)
        run.kept_printed_seconds = kept_printed_seconds(all_steps, outages)
    run.ckpt_every = args.ckpt_every
    run.snapshot_every = args.snapshot_every if name == "ftagent-snapshots" else 0
    (tmp / "run.json").write_text(json.dumps(dataclasses.asdict(run), indent=1))
    return run


LOADS: list[float] = []  # 1-minute load averages sampled while a run waits


def wait_until(t: float) -> None:
    while time.time() < t:
        LOADS.append(os.getloadavg()[0])
        time.sleep(min(0.2, t - time.time()) if t > time.time() else 0)


# ---------------------------------------------------------------------- torchrun's default


def default_restart_trials(trials: int, args: argparse.Namespace, tmp: Path) -> tuple[int, int]:
    """(failed, trials): torchrun restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE."""
    failed = 0
    for i in range(trials):
        env = {"TRAIN_STEPS": "100000000", "TRAIN_STEP_SLEEP": str(args.step_sleep),
               "TRAIN_PG_TIMEOUT": "30", "PYTHONUNBUFFERED": "1"}
        d = tmp / f"default{i}"
        d.mkdir()
        with Lab(d, 2, arbiter=False, stamp=True) as lab:
            # torch reads only "1" as set: "0" is torchrun's default behaviour
            lab.env = {**FAST_ENV, **env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}
            for r in range(2):
                lab.start_rank(r, launcher=torchrun(lab, max_restarts=1))
            try:
                wait(lambda lab=lab: last_step(lab) >= 5, 120, "first steps")
                f = Fault("crash", time.time(), last_step(lab))
                lab.trigger("crash", 1)
                wait(lambda lab=lab, f=f: training_again(lab, f), 60, "training again")
            except TimeoutError:
                failed += 1
    return failed, trials


# ---------------------------------------------------------------------- overhead


def pss_kib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for ln in fh:
                if ln.startswith("Pss:"):
                    return float(ln.split()[1])
    except OSError:
        pass
    return float("nan")


def launcher_procs(root: int) -> list[psutil.Process]:
    """The launcher's own processes on a node: ``root`` and its descendants except the
    trainer's tree (a process running train.py that is not ftagent's warm standby). The
    standby counts as the launcher's: it is memory ftagent spends to restart faster."""
    try:
        top = psutil.Process(root)
        kids = top.children(recursive=True)
    except psutil.Error:
        return []
    trainer: set[int] = set()
    for k in kids:
        try:
            cmd = " ".join(k.cmdline())
        except psutil.Error:
            continue
        if "train.py" in cmd and "standby" not in cmd:
            trainer.add(k.pid)
            trainer.update(c.pid for c in k.children(recursive=True))
    return [top, *(k for k in kids if k.pid not in trainer)]


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def overhead(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """Median step seconds over a healthy job; the launcher's CPU % and PSS (rank 0)."""
    env = {"TRAIN_STEPS": str(args.overhead_steps), "TRAIN_STEP_SLEEP": str(args.step_sleep),
           "TRAIN_PG_TIMEOUT": "60", "PYTHONUNBUFFERED": "1",
           "TRAIN_SDK": "0" if args.overhead_no_sdk else "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with Lab(tmp, 2, job="overhead", arbiter=name == "ftagent", stamp=True,
             prometheus=name == "ftagent" and not args.overhead_no_prometheus) as lab:
        launch(lab, name, env, args)
        wait(lambda: len(steps(lab, 0)) >= 20, 180, f"{name}: steps")
        root = lab.agents[0].pid
        procs = launcher_procs(root)
        cpu0, t0 = cpu_seconds(procs), time.monotonic()
        pss, own = [], []
        while lab.agents[0].poll() is None and len(steps(lab, 0)) < args.overhead_steps - 20:
            pss.append(sum(pss_kib(p.pid) for p in launcher_procs(root)))
            own.append(pss_kib(root))
            time.sleep(1.0)
        cpu1, t1 = cpu_seconds(procs), time.monotonic()
        lab.wait_agents(120)
        dts = [dt for _, s, dt in steps(lab, 0) if s > 20 and dt > 0]
    cpu = (cpu1 - cpu0) / max(t1 - t0, 1e-9)
    return {"step": statistics.median(dts) if dts else float("nan"),
            "cpu_percent": 100 * cpu if name != "bare" else float("nan"),
            "pss_mib": statistics.median(pss) / 1024 if pss and name != "bare" else float("nan"),
            "own_pss_mib": statistics.median(own) / 1024 if own and name != "bare"
            else float("nan"),
            "steps": float(len(dts))}


# ---------------------------------------------------------------------- report


NOT_WIRED: dict[str, str] = {}


def missing_columns(names: list[str]) -> list[str]:
    """A one-line reason for each peer that has no row."""
    out = []
    for col in PEERS:
        if col in NOT_WIRED:
            out.append(f"{col}: {NOT_WIRED[col]}")
        elif col not in names:
            why = peer_missing(col)
            out.append(f"{col}: {why or 'not asked for (--launchers)'}")
    return out


def fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.1f} {unit}".strip()


def ledger_row(r: Run) -> tuple[float, float, dict[str, float]] | None:
    """(ledger ETTR over the whole wall, ledger ETTR over the outside window, seconds)."""
    g = r.ledger
    if not g or "error" in g:
        return None
    secs = {k: float(v) for k, v in dict(g.get("seconds") or {}).items()}
    wall = float(g.get("wall_seconds") or 0.0)
    # the outside window starts at rank 0's first step: the ledger's startup is before it
    window = wall - secs.get("startup", 0.0)
    prod = secs.get("productive", 0.0)
    return (prod / wall if wall > 0 else 0.0, prod / window if window > 0 else 0.0, secs)


def ledger_table(rs: list[Run]) -> None:
    """ftagent's own ledger beside the outside measurement, and where the seconds went."""
    if not rs:
        return
    print("\n| ftagent run | outside | ledger (training window) | difference | old outside "
          "(printed step times) | ledger ETTR (from registration) | ledger: wall / "
          "productive / outage / recomputed steps |")
    print("|---|---|---|---|---|---|---|")
    cats: dict[str, list[float]] = {}
    for i, r in enumerate(rs):
        row = ledger_row(r)
        if row is None:
            print(f"| {i + 1} | {100 * r.goodput:.1f} % | ledger missing: {r.ledger} | | | | |")
            continue
        whole, window, secs = row
        g = r.ledger or {}
        lost = sum(f.lost for f in r.faults)
        print(f"| {i + 1} | {100 * r.goodput:.1f} % | {100 * window:.1f} % | "
              f"{100 * (window - r.goodput):+.1f} pts | {100 * r.goodput_printed:.1f} % "
              f"({100 * (window - r.goodput_printed):+.1f} pts) | {100 * whole:.1f} % | "
              f"{float(g.get('wall_seconds') or 0):.1f} s / {secs.get('productive', 0):.1f} s / "
              f"{secs.get('outage', 0):.1f} s / {g.get('recomputed_steps')} "
              f"(outside: {lost}) |")
        for k, v in secs.items():
            cats.setdefault(k, []).append(v)
    print("\nftagent, each fault on the arbiter's timeline (seconds from the injection; "
          "decision -> released: the trainers' stop, a replacement agent's start, the "
          "barrier):")
    print("| fault | detected | decided | barrier released | training again |")
    print("|---|---|---|---|---|")
    for r in rs:
        for f in r.faults:
            print(f"| {f.kind} | " + " | ".join(
                fmt(None if x is None else x - f.at) for x in (f.detect, f.decided,
                                                             f.released, f.back)) + " |")
    if cats:
        print("\nftagent, where the wall time went (the ledger, mean over runs):")
        for k, vs in sorted(cats.items(), key=lambda kv: -statistics.mean(kv[1])):
            print(f"  {k:<14} {statistics.mean(vs):8.1f} s")


def redone_table(runs: list[Run]) -> None:
    """The work each fault redid, where it landed in the disk checkpoint's interval, and the
    bar of issue 34: with snapshots at most one snapshot interval a fault."""
    print("\n| launcher | fault | since the disk checkpoint | redone | redone, seconds |")
    print("|---|---|---|---|---|")
    for r in runs:
        red = redone(r.faults, r.step_seconds, r.ckpt_every)
        for f in red["faults"]:
            print(f"| {r.launcher} | {f['kind']} | {f['since_disk_checkpoint']} steps | "
                  f"{f['lost_steps']} steps | {f['lost_seconds']:.1f} s |")
    for r in runs:
        red = redone(r.faults, r.step_seconds, r.ckpt_every)
        if red["max_steps"] is None:
            continue
        half = r.ckpt_every / 2
        line = (f"{r.launcher}: redone per fault {red['mean_steps']:.1f} steps on average "
                f"({red['mean_seconds']:.1f} s), at most {red['max_steps']}; disk interval "
                f"{r.ckpt_every} steps ({r.ckpt_every * r.step_seconds:.0f} s; half: "
                f"{half:.0f})")
        if r.snapshot_every:
            ok = red["max_steps"] <= r.snapshot_every
            line += (f"; snapshot interval {r.snapshot_every} steps: "
                     f"{'within' if ok else 'NOT within'} one snapshot interval")
        print(line)


def run_json(r: Run) -> dict[str, Any]:
    """One run's figures for the projection (bench/goodput_projection.py --from)."""
    return {"launcher": r.launcher, "goodput": r.goodput, "window": r.end - r.start,
            "load": r.load, "step_seconds": r.step_seconds, "ckpt_every": r.ckpt_every,
            "snapshot_every": r.snapshot_every,
            "redone": redone(r.faults, r.step_seconds, r.ckpt_every),
            "faults": [{"kind": f.kind, "detect": None if f.detect is None else f.detect - f.at,
                        "back": None if f.back is None else f.back - f.at,
                        "lost_steps": f.lost} for f in r.faults],
            "ledger": r.ledger, "notes": r.notes}


def report(runs: list[Run], trials: tuple[int, int] | None,
           over: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(f"\nmachine: {platform.node()} {platform.processor() or platform.machine()}, "
          f"{psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
          f"load {os.getloadavg()[0]:.1f}; torch gloo CPU, 2 ranks on 2 netns nodes, steps "
          f"{args.step_sleep}s + compute, checkpoint every {args.ckpt_every} steps")
    print(f"command: {' '.join(sys.argv)}")
    by: dict[str, list[Run]] = {}
    for r in runs:
        by.setdefault(r.launcher, []).append(r)

    def mean(xs: list[float]) -> float | None:
        return statistics.mean(xs) if xs else None

    print("\n| fault | launcher | detect | training again | lost steps |")
    print("|---|---|---|---|---|")
    for kind in KINDS:
        for name, rs in by.items():
            fs = [f for r in rs for f in r.faults if f.kind == kind]
            if not fs:
                continue
            det = mean([f.detect - f.at for f in fs if f.detect is not None])
            back = mean([f.back - f.at for f in fs if f.back is not None])
            lost = mean([float(f.lost) for f in fs if f.back is not None])
            print(f"| {kind} | {name} | {fmt(det)} | {fmt(back)} | "
                  f"{'-' if lost is None else f'{lost:.0f}'} |")
    base = mean([r.goodput for r in by.get("torchrun", []) if r.end > r.start])
    print("\n| launcher | goodput | vs torchrun | old: printed step times | median-based | "
          "window | load (1 min) |")
    print("|---|---|---|---|---|---|---|")
    for name, all_rs in by.items():
        rs = [r for r in all_rs if r.end > r.start]
        if not rs:
            print(f"| {name} | no run finished (see the notes) | | | | | |")
            continue
        g = mean([r.goodput for r in rs]) or 0.0
        ratio = f"{g / base:.2f}x, {100 * (g - base):+.1f} pts" if base else "-"
        med = mean([r.goodput_median for r in rs]) or 0.0
        old = mean([r.goodput_printed for r in rs]) or 0.0
        window = mean([r.end - r.start for r in rs]) or 0.0
        load = mean([r.load for r in rs]) or 0.0
        print(f"| {name} | {100 * g:.1f} % | {ratio} | {100 * old:.1f} % | {100 * med:.1f} % "
              f"| {window:.0f} s | {load:.1f} |")
    print("(goodput: the wall time of the kept steps, from the lines' stamps, over the "
          "window; old: the durations the trainer printed for them, which can add up to "
          "more than the window, kept for one release)")
    if "torchrun-default" in by:
        print("(torchrun: the trainer's process-group timeout is --pg-timeout, "
              f"{args.pg_timeout:.0f} s, tuned for it: the favourable baseline, 'vs torchrun' "
              "compares with it; torchrun-default: torch's own default for gloo, "
              f"{torch_default_pg_timeout():.0f} s, what a torchrun user gets who sets none)")
    print("(the Xid: ftagent's simulated GPU on rank 1 raises a fatal Xid "
          f"{XID}; ftagent replaces the rank and the bench starts the new pod's agent at once; "
          "every other launcher has no GPU watch, so for them it is a crash of rank 1 at the "
          "same time after the launch)")
    ledger_table(by.get("ftagent", []) + by.get("ftagent-snapshots", []))
    redone_table(runs)
    for col in missing_columns(list(by)):
        print(f"missing column -- {col}")
    for r in runs:
        for n in r.notes:
            print(f"note ({r.launcher}): {n}")
    if trials is not None:
        print(f"\ntorchrun with default settings (no TORCH_DISABLE_SHARE_RDZV_TCP_STORE): "
              f"{trials[0]}/{trials[1]} restarts failed to train again within 60 s")
    if over:
        b = over.get("bare", {}).get("step", float("nan"))
        print("\n| healthy job | median step | vs bare | launcher CPU | launcher PSS "
              "(its process / with its helpers) |")
        print("|---|---|---|---|---|")
        for name, o in over.items():
            print(f"| {name} | {1000 * o['step']:.1f} ms | {o['step'] / b:.3f}x | "
                  f"{o['cpu_percent']:.2f} % | {o['own_pss_mib']:.0f} / {o['pss_mib']:.0f} "
                  "MiB |")
        print("(ftagent's helpers: the containment watchdog and the warm-restart standby, "
              "an interpreter with the trainer's imports done; medians over "
              f"{args.overhead_rounds} alternated round(s), rank 0's node)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="training window per run")
    ap.add_argument("--rounds", type=int, default=1, help="runs per launcher, alternated")
    ap.add_argument("--launchers", default="ftagent,torchrun")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds before the first fault")
    ap.add_argument("--gap", type=float, default=10.0, help="healthy seconds between faults")
    ap.add_argument("--outage", type=float, default=10.0, help="seconds the link is down")
    ap.add_argument("--faults", default=",".join(KINDS), help="the schedule, in this order")
    ap.add_argument("--xid-at", type=float, default=0.0,
                    help="seconds after the launch the fatal Xid comes (0: half the window "
                    "+ 30 s, at least 200 s)")
    ap.add_argument("--pg-timeout", type=float, default=30.0, help="the trainer's own")
    ap.add_argument("--spares", type=int, default=1,
                    help="ftagent's and ftagent-snapshots' warm spares (ftagent run --spare, "
                    "a lab node each); 0: none, the replaced rank waits for its new pod")
    ap.add_argument("--ftagent-flags", default="",
                    help="more `ftagent run` flags, e.g. '--stop-timeout 2'")
    ap.add_argument("--peer-hang-timeout", type=float, default=5.0,
                    help="ft_launcher's --ft-rank-heartbeat-timeout (seconds)")
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--schedule", choices=("fixed", "random"), default="fixed",
                    help="random: each fault at a random point of its slot of the window "
                    "(--seed), the disk checkpoint every --ckpt-seconds")
    ap.add_argument("--ckpt-seconds", type=float, default=300.0,
                    help="random schedule: the disk checkpoint interval, in seconds of "
                    "training (made steps by --step-estimate)")
    ap.add_argument("--step-estimate", type=float, default=0.0,
                    help="seconds a healthy step takes (0: --step-sleep + 15 ms)")
    ap.add_argument("--seed", type=int, default=1, help="random schedule: its draws")
    ap.add_argument("--tail", type=float, default=60.0,
                    help="random schedule: healthy seconds after the last fault's slot")
    ap.add_argument("--startup-estimate", type=float, default=15.0,
                    help="random schedule: seconds from the launch to the first step (the "
                    "Xid's GPU timeline counts from the agent's start)")
    ap.add_argument("--snapshot-every", type=int, default=10,
                    help="ftagent-snapshots: steps between two in-memory snapshots")
    ap.add_argument("--json", default="", help="also write the runs' figures here")
    ap.add_argument("--default-trials", type=int, default=3)
    ap.add_argument("--overhead-steps", type=int, default=600)
    ap.add_argument("--overhead-rounds", type=int, default=2, help="alternated rounds")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--overhead-no-sdk", action="store_true",
                    help="the healthy job without ftagent.step() (progress from its log)")
    ap.add_argument("--overhead-no-prometheus", action="store_true",
                    help="no Prometheus scraping ftagent's agents (the lab's is every 1 s)")
    args = ap.parse_args()
    if args.schedule == "random":
        est = args.step_estimate or args.step_sleep + 0.015
        args.ckpt_every = disk_interval_steps(args.ckpt_seconds, est)
        if args.faults == ",".join(KINDS):
            args.faults = "crash,hang,xid"
    why = netns_unavailable()
    if why:
        print(f"goodput: {why}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="ftagent-goodput-"))
    print(f"logs in {tmp}")
    runs: list[Run] = []
    names = [n.strip() for n in args.launchers.split(",") if n.strip()]
    for n in [n for n in names if n in PEERS]:
        why = NOT_WIRED.get(n) or peer_missing(n)
        if why:
            print(f"{n}: left out: {why}", flush=True)
            names.remove(n)
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]  # alternate who goes first
        for name in order:
            d = tmp / f"{name}-{rnd}"
            d.mkdir()
            print(f"round {rnd + 1}: {name} ...", flush=True)
            try:
                runs.append(run_schedule(name, args, d))
            except (TimeoutError, RuntimeError, OSError, subprocess.SubprocessError) as e:
                # say so in the table instead of losing the others
                failed = Run(name)
                failed.notes.append(f"run failed: {type(e).__name__}: {e} (logs in {d})")
                runs.append(failed)
            finally:
                drop_snapshot_roots()  # memory the run's agents held (tmpfs)
    trials = None
    if args.default_trials > 0:
        print("torchrun default-settings restart trials ...", flush=True)
        trials = default_restart_trials(args.default_trials, args, tmp)
    over: dict[str, dict[str, float]] = {}
    if not args.no_overhead:
        got: dict[str, list[dict[str, float]]] = {}
        for rnd in range(args.overhead_rounds):
            order = ["bare", "ftagent", "torchrun"]
            for name in order if rnd % 2 == 0 else order[::-1]:
                print(f"overhead round {rnd + 1}: {name} ...", flush=True)
                d = tmp / f"overhead-{name}-{rnd}"
                d.mkdir()
                got.setdefault(name, []).append(overhead(name, args, d))
        over = {name: {k: statistics.median(o[k] for o in os_) for k in os_[0]}
                for name, os_ in got.items()}
    report(runs, trials, over, args)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "bench": "goodput", "command": " ".join(sys.argv), "schedule": args.schedule,
            "minutes": args.minutes, "runs": [run_json(r) for r in runs]}, indent=1))
        print(f"figures in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
