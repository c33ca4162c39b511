"""A tiny real training job: PyTorch DDP on CPU with gloo, with faults injected by env.

Run one process per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), each
under ``ftagent run``. It prints a progress line per step (``step=N loss=X ...``), and,
with ``TRAIN_SDK=1``, also reports through the SDK (``ftagent.step``).

Knobs (all optional):
  TRAIN_STEPS=100            steps to run, then exit 0
  TRAIN_STEP_SLEEP=0.05      extra seconds per step (a "model" that takes time)
  TRAIN_PG_TIMEOUT=120       process-group timeout (gloo raises after it)
  TRAIN_LOG_FORMAT=generic   generic | megatron (progress line style)
  TRAIN_SDK=0                1: also report steps/phases/collectives through ftagent's SDK
  TRAIN_NVRX_HEARTBEAT=0     1: a heartbeat per step to nvidia-resiliency-ext's rank monitor
                             (its RankMonitorClient, under its ft_launcher: its hang
                             detection needs one; bench/goodput.py's ft_launcher peer)
  INSTRUMENT=0               1: ftagent.torch.instrument(model, optimizer, data loader):
                             collective busbw, DDP buckets, forward/backward/optimizer/data
  TRAIN_SEQ_LEN=0            N > 0: tokens per sample; progress lines also carry tokens/s
                             (generic) or TFLOP/s per GPU (megatron: 6 x parameters x
                             tokens/s, Megatron's estimate), for the dashboard's panels
Checkpoints (real ones, so that "recovered" means resumed from the last saved step):
  CHECKPOINT_DIR=DIR         resume from DIR/ckpt.pt if it is there (every rank reads it:
                             model, optimizer and step); rank 0 writes it atomically (a
                             temporary file, fsync, rename), so a reader sees a whole one
  CHECKPOINT_EVERY=K         with CHECKPOINT_DIR: save after every K steps
  SIGTERM                    with CHECKPOINT_DIR: every rank stops at the same step (the stop
                             flag is all-reduced each step, one 4-byte collective), rank 0
                             saves it, and the trainer exits 143 (128 + SIGTERM, as a process
                             killed by it reports; TRAIN_SIGTERM_EXIT=0 to exit 0 instead).
                             A rank inside an injected fault (hang, stall, deadlock, spin)
                             exits 143 at once, without a new checkpoint.
                             Without CHECKPOINT_DIR, SIGTERM kills the process as by default.
In-memory snapshots (ftagent.checkpoint: under `ftagent run` they live in memory the agent
keeps across restarts; without it, plain DCP in FTAGENT_CHECKPOINT_DIR):
  SNAPSHOT_EVERY=K           snapshot model + optimizer after every K steps
                             (checkpoint.save: returns once the state is copied) and, at
                             start, resume from the newest snapshot complete on every rank
                             (checkpoint.load; the arbiter's FTAGENT_RESUME_STEP after a
                             restart), printing "snapshot loaded: step N" (or ": none")
Faults (only on rank FAULT_RANK, default 0, and only while FTAGENT_RESTART_COUNT equals
FAULT_ATTEMPT, default 0, so the job heals after a restart):
  FAULT_EVERY_ATTEMPT=1      inject on every attempt instead (a fault that never heals)
  FAULT_<KIND>_ATTEMPT=K     this fault only on attempt K (e.g. FAULT_HANG_ATTEMPT=1)
  FAULT_CRASH_AT_STEP=N      exit 3 at step N (FAULT_EXIT_CODE to change it)
  FAULT_CRASH_ON_FILE=PATH   exit 3 at the first step after PATH exists (first attempt)
  FAULT_HANG_AT_STEP=N       block forever before the all-reduce of step N
  FAULT_DATA_STALL_AT_STEP=N loop forever "waiting for data", printing every second
  FAULT_SLOW_FACTOR=F        this rank's steps take F times longer (all ranks wait)
  CKPT_EVERY=K               every K steps pause CKPT_FACTOR (default 10) x step time,
                             logging "saving checkpoint ..." like Megatron
  EVAL_EVERY=K               every K steps an *undeclared* evaluation: forward passes of the
                             model for EVAL_SECONDS (default 12), CPU-busy, printing nothing
                             until it ends (then one Megatron-style "validation loss at
                             iteration N" line); on every rank, or only on EVAL_RANK=R
                             (the other ranks then wait for it in the next all-reduce)
  FIRST_STEP_SECONDS=S       the first step computes S seconds longer (a compile-like start)
  SILENT_SAVES=STEP:SECONDS[,STEP:SECONDS]  after each STEP, a *silent* save on rank
                             SILENT_SAVE_RANK (default 0) for SECONDS: torch.save of a
                             4 MiB tensor into SILENT_SAVE_DIR (default the temp dir), fsync,
                             rename, again, at about SILENT_SAVE_MIBPS (default 8) MiB/s of
                             real storage writes, printing nothing (the other ranks wait
                             for it in the next all-reduce); a large model's checkpoint
  TRAIN_TIMING=0             1: "timing: NAME t=WALL" lines (time.time()) at the script's
                             first line, after importing torch, after init_process_group,
                             after DDP, at the first step and at an injected crash: where
                             a restart's time goes (bench/restart.py)
Faults a test or benchmark triggers at a moment of its choosing (any rank, any attempt):
  FAULT_TRIGGER_DIR=DIR      at each step, a file DIR/KIND.RANK injects KIND on this rank:
                             crash (exit 3), hang (before the all-reduce), stall ("waiting
                             for data" forever), each once (the file is removed when taken;
                             one that says generation=N strikes only that generation);
                             slow (steps take the file's number times longer while it exists)
Faults that verification must call a hang (same FAULT_RANK / attempt rules):
  FAULT_DEADLOCK_AT_STEP=N   a lock-order deadlock with a helper thread at step N
  FAULT_SPIN_AT_STEP=N       a tight infinite loop at one line at step N (CPU burning)
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

T_SCRIPT = time.time()  # the script's first lines ran: a restart's "started again" point


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


RANK = env_int("RANK", 0)
WORLD = env_int("WORLD_SIZE", 1)
ATTEMPT = env_int("FTAGENT_RESTART_COUNT", 0)
FAULTY = env_int("FAULT_RANK", 0) == RANK and (
    env_int("FAULT_ATTEMPT", 0) == ATTEMPT or os.environ.get("FAULT_EVERY_ATTEMPT") == "1")
FMT = os.environ.get("TRAIN_LOG_FORMAT", "generic")
USE_SDK = os.environ.get("TRAIN_SDK", "0") == "1"
NVRX_HEARTBEAT = os.environ.get("TRAIN_NVRX_HEARTBEAT", "0") == "1"
TIMING = os.environ.get("TRAIN_TIMING", "0") == "1"


IN_FAULT = False  # inside an injected fault that never reaches the next step (see StopFlag)


def log(msg: str) -> None:
    print(f"[rank{RANK}] {msg}", flush=True)


def timing(name: str, ts: float | None = None) -> None:
    """TRAIN_TIMING=1: when this point of the start-up was reached (wall clock, so that
    the bench can put it beside the agents' events files and the arbiter's log)."""
    if TIMING:
        log(f"timing: {name} t={time.time() if ts is None else ts:.6f}")


def fault_at(name: str, step: int) -> bool:
    """Fault ``name`` (e.g. FAULT_CRASH_AT_STEP) is due at ``step`` on this rank and attempt;
    ``FAULT_CRASH_ATTEMPT`` etc. override FAULT_ATTEMPT for one fault."""
    if os.environ.get(name, "") == "" or step != env_int(name, -1):
        return False
    if env_int("FAULT_RANK", 0) != RANK:
        return False
    if os.environ.get("FAULT_EVERY_ATTEMPT") == "1":
        return True
    return ATTEMPT == env_int(name.replace("_AT_STEP", "_ATTEMPT"), env_int("FAULT_ATTEMPT", 0))


def crash_on_file() -> bool:
    """FAULT_CRASH_ON_FILE=PATH: crash at the first step after PATH appears (a test drives
    the moment: e.g. while the arbiter is down), on FAULT_RANK's first attempt."""
    path = os.environ.get("FAULT_CRASH_ON_FILE", "")
    return (bool(path) and env_int("FAULT_RANK", 0) == RANK and ATTEMPT == 0
            and os.path.exists(path))


class Triggers:
    """FAULT_TRIGGER_DIR: faults at the moment a file appears (a drill's schedule)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory

    def take(self, kind: str) -> bool:
        """DIR/KIND.RANK exists: remove it (once) and say so. A file that says
        ``generation=N`` is for that generation's trainer only (FTAGENT_GENERATION): a
        later one removes it unused -- a fault meant for an attempt that was stopped
        before its next step (its peer's fault restarted the job first) does not strike
        the next attempt too."""
        if not self.dir:
            return False
        path = os.path.join(self.dir, f"{kind}.{RANK}")
        try:
            with open(path) as f:
                said = f.read().strip()
            os.unlink(path)
        except FileNotFoundError:
            return False
        if said.startswith("generation="):
            meant = said.partition("=")[2]
            if meant != os.environ.get("FTAGENT_GENERATION", "0"):
                log(f"(fault) trigger {kind} for generation {meant} dropped unused")
                return False
        log(f"(fault) triggered: {kind}")
        return True

    def slow(self) -> float:
        """The factor in DIR/slow.RANK while it exists, else 1."""
        if not self.dir:
            return 1.0
        try:
            with open(os.path.join(self.dir, f"slow.{RANK}")) as f:
                return max(1.0, float(f.read().strip() or 1))
        except (OSError, ValueError):
            return 1.0


def hang_before_collective(step: int) -> None:
    """Stands for a rank stuck before a collective (a deadlock, a lost peer)."""
    global IN_FAULT
    IN_FAULT = True
    log(f"step {step}: (fault) hanging before all-reduce")
    while True:
        time.sleep(3600)


def wait_for_data(step: int) -> None:
    """Stands for a stuck data loader that keeps logging while no step advances."""
    global IN_FAULT
    IN_FAULT = True
    while True:
        log(f"step {step}: waiting for data ...")
        time.sleep(1.0)


def deadlock(step: int) -> None:
    """Stands for a lock-order deadlock: the main thread holds A and wants B, a helper
    thread (a metrics flusher, say) holds B and wants A. Both park with still stacks."""
    import threading

    global IN_FAULT
    IN_FAULT = True
    a, b = threading.Lock(), threading.Lock()
    b_held = threading.Event()

    def flusher() -> None:
        with b:
            b_held.set()
            with a:
                pass

    log(f"step {step}: (fault) taking the locks in the wrong order")
    with a:
        threading.Thread(target=flusher, name="metrics-flusher", daemon=True).start()
        b_held.wait()
        with b:
            pass


def spin(step: int) -> None:
    """Stands for a bug that loops forever at one line, burning CPU."""
    global IN_FAULT
    IN_FAULT = True
    log(f"step {step}: (fault) spinning forever")
    n = 0
    while n >= 0:
        n += 1


def evaluate(model: object, step: int, seconds: float) -> float:
    """An undeclared evaluation: forward passes through the model, CPU-busy, silent until
    it is done (like Megatron's), for ``seconds``."""
    import torch

    total, batches = 0.0, 0
    end = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            x = torch.randn(256, 32)
            out = model(x)  # type: ignore[operator]
            total += float(nn_loss(out, x.sum(dim=1, keepdim=True)))
            batches += 1
    value = total / max(batches, 1)
    log(f"validation loss at iteration {step} | lm loss value: {value:.6E} | "
        f"batches: {batches}")
    return value


def nn_loss(out: object, target: object) -> float:
    import torch

    return float(torch.nn.functional.mse_loss(out, target))  # type: ignore[arg-type]


def burn(seconds: float) -> None:
    """CPU-busy start-up (compilation, say) for ``seconds``."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += sum(i * i for i in range(1000))


class Checkpoints:
    """DIR/ckpt.pt: model + optimizer state and the last completed step."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.path = os.path.join(directory, "ckpt.pt")

    def load(self, model: Any, opt: Any) -> int:
        """Restore into ``model`` (before DDP wraps it) and ``opt``; the step saved, or 0."""
        import torch

        if not os.path.exists(self.path):
            return 0
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
        log(f"resumed from checkpoint at step {step} ({self.path})")
        return step

    def save(self, model: Any, opt: Any, step: int) -> None:
        """Rank 0 only: write a temporary file, fsync it, rename it over the last one."""
        import torch

        os.makedirs(self.dir, exist_ok=True)
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash of the node
        finally:
            os.close(fd)
        log(f"checkpoint saved at step {step} ({self.path})")


class StopFlag:
    """SIGTERM (Kubernetes deleting the pod) asks for a stop at the next step boundary.

    A rank inside an injected fault (a hang, a data stall, a deadlock, a spin) never
    reaches that boundary: there the handler exits 143 at once, without a new checkpoint
    (else a restart of a hung job waits the agent's whole --stop-timeout for its SIGKILL).
    A peer blocked in a collective with it then fails when it goes, and exits too. No
    watcher thread: it would show in every stack dump the agent takes of this trainer.
    """

    def __init__(self) -> None:
        import signal

        self.asked = False
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum: int, frame: object) -> None:
        self.asked = True
        if IN_FAULT:
            log("SIGTERM inside an injected fault: exiting without a checkpoint")
            sys.stderr.flush()
            os._exit(env_int("TRAIN_SIGTERM_EXIT", 143))

    def agreed(self, world: int) -> bool:
        """Whether any rank was asked (all ranks then stop at the same step: a rank that
        stopped alone would leave the others waiting in their next all-reduce)."""
        if world <= 1:
            return self.asked
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.asked else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def silent_save(step: int, seconds: float) -> None:
    """A checkpoint save that prints nothing for ``seconds``: real storage writes (each
    file fsynced, so the bytes reach the disk and /proc/PID/io's write_bytes), paced at
    SILENT_SAVE_MIBPS; at most two 4 MiB files on disk at a time."""
    import tempfile

    import torch

    directory = os.environ.get("SILENT_SAVE_DIR") or tempfile.gettempdir()
    rate = env_float("SILENT_SAVE_MIBPS", 8.0) * (1 << 20)
    path = os.path.join(directory, f"silent-save-{RANK}-{os.getpid()}.pt")
    chunk = torch.zeros(1 << 20)  # 4 MiB of float32
    start = time.monotonic()
    written = 0
    while time.monotonic() - start < seconds:
        with open(path + ".tmp", "wb") as f:
            torch.save(chunk, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        written += chunk.numel() * 4
        ahead = written / rate - (time.monotonic() - start)
        if ahead > 0:
            time.sleep(min(ahead, max(0.0, seconds - (time.monotonic() - start))))
    with contextlib.suppress(OSError):
        os.unlink(path)


def silent_saves() -> dict[int, float]:
    """SILENT_SAVES=STEP:SECONDS,...: {step: seconds} on SILENT_SAVE_RANK, else {}."""
    if env_int("SILENT_SAVE_RANK", 0) != RANK:
        return {}
    out = {}
    for item in os.environ.get("SILENT_SAVES", "").split(","):
        if item.strip():
            step, _, seconds = item.partition(":")
            out[int(step)] = float(seconds)
    return out


def checkpoint(step: int, seconds: float) -> None:
    log(f"saving checkpoint at iteration {step} to /tmp/ckpt")
    time.sleep(seconds)
    log(f"successfully saved checkpoint from iteration {step} to /tmp/ckpt")


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    timing("script", T_SCRIPT)
    timing("imported")
    sdk = None
    if USE_SDK:
        import ftagent as sdk  # type: ignore[no-redef]

    steps = env_int("TRAIN_STEPS", 100)
    step_sleep = env_float("TRAIN_STEP_SLEEP", 0.05)
    slow = env_float("FAULT_SLOW_FACTOR", 1.0) if FAULTY else 1.0
    ckpt_every = env_int("CKPT_EVERY", 0)
    ckpt_factor = env_float("CKPT_FACTOR", 10.0)
    eval_every = env_int("EVAL_EVERY", 0)
    eval_seconds = env_float("EVAL_SECONDS", 12.0)
    eval_rank = env_int("EVAL_RANK", -1)
    saves = silent_saves()
    first_step = env_float("FIRST_STEP_SECONDS", 0.0)
    seq_len = env_int("TRAIN_SEQ_LEN", 0)
    timeout = datetime.timedelta(seconds=env_float("TRAIN_PG_TIMEOUT", 120.0))

    torch.manual_seed(1234 + RANK)
    if WORLD > 1:
        dist.init_process_group("gloo", timeout=timeout)
        timing("process_group")
    model: nn.Module = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt_dir = os.environ.get("CHECKPOINT_DIR", "")
    ckpts = Checkpoints(ckpt_dir) if ckpt_dir else None
    save_every = env_int("CHECKPOINT_EVERY", 0)
    stop = StopFlag() if ckpts is not None else None
    start = ckpts.load(model, opt) if ckpts is not None else 0
    snapshot_every = env_int("SNAPSHOT_EVERY", 0)
    snapshots = None
    if snapshot_every:
        from ftagent import checkpoint as snapshots

        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        got = snapshots.load(state)
        if got is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            start = got
        log(f"snapshot loaded: {'none' if got is None else f'step {got}'}")
    plain = model  # what is saved: the module without DDP's wrapper
    if WORLD > 1:
        model = DDP(model)
        timing("ddp")
    batch = 16
    batches = None
    if os.environ.get("INSTRUMENT", "0") == "1":
        import ftagent.torch

        data = torch.utils.data.TensorDataset(torch.randn(batch * 64, 32))
        loader = torch.utils.data.DataLoader(data, batch_size=batch, drop_last=True)
        ftagent.torch.instrument(model=model, optimizer=opt, dataloader=loader)
        batches = _cycle(loader)
    log(f"started: world={WORLD} attempt={ATTEMPT} steps={steps} from_step={start}")
    heartbeat: Any = None
    if NVRX_HEARTBEAT:
        from nvidia_resiliency_ext.fault_tolerance import (
            RankMonitorClient,
        )

        heartbeat = RankMonitorClient()
        heartbeat.init_workload_monitoring()

    trig = Triggers(os.environ.get("FAULT_TRIGGER_DIR", ""))
    last = time.monotonic()
    for step in range(start + 1, steps + 1):
        if fault_at("FAULT_DATA_STALL_AT_STEP", step) or trig.take("stall"):
            wait_for_data(step)
        x = next(batches)[0] if batches is not None else torch.randn(batch, 32)
        y = x.sum(dim=1, keepdim=True)
        time.sleep(step_sleep * slow * trig.slow())
        if step == 1 and first_step > 0:
            burn(first_step)
        if fault_at("FAULT_DEADLOCK_AT_STEP", step):
            deadlock(step)
        if fault_at("FAULT_SPIN_AT_STEP", step):
            spin(step)
        if fault_at("FAULT_CRASH_AT_STEP", step) or crash_on_file() or trig.take("crash"):
            timing("crash")
            log(f"step {step}: (fault) crashing with exit code "
                f"{env_int('FAULT_EXIT_CODE', 3)}")
            # die at once, as a segfault or an OOM kill would: a normal exit with a live
            # process group can take seconds of interpreter shutdown, during which the
            # peers' collectives fail first and the order of the faults becomes a race
            sys.stderr.flush()
            os._exit(env_int("FAULT_EXIT_CODE", 3))
        if fault_at("FAULT_HANG_AT_STEP", step) or trig.take("hang"):
            hang_before_collective(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces gradients here
        opt.step()
        now = time.monotonic()
        dt, last = now - last, now
        value = float(loss.item())
        if step == start + 1:
            timing("first_step")
        if FMT == "megatron":
            log(f" iteration {step:8d}/{steps:8d} | consumed samples: {step * batch * WORLD} | "
                f"elapsed time per iteration (ms): {dt * 1000:.1f} | lm loss: {value:.6E} |"
                + (f" throughput per GPU (TFLOP/s/GPU): {tflops(model, batch * seq_len / dt):.6f} |"
                   if seq_len > 0 else ""))
        else:
            log(f"step={step}/{steps} loss={value:.4f} samples_per_second={batch / dt:.1f}"
                + (f" tokens_per_second={batch * seq_len / dt:.1f}" if seq_len > 0 else ""))
        if sdk is not None:
            sdk.step(step, loss=value, samples=batch)
        if heartbeat is not None:
            heartbeat.send_heartbeat()
        if eval_every and step % eval_every == 0 and step < steps and eval_rank in (-1, RANK):
            evaluate(model, step, eval_seconds)
            last = time.monotonic()
        if step in saves and step < steps:
            silent_save(step, saves[step])
            last = time.monotonic()
        if ckpt_every and step % ckpt_every == 0 and step < steps:
            if sdk is not None:
                with sdk.phase("checkpoint"):
                    checkpoint(step, ckpt_factor * (step_sleep + 0.005))
            else:
                checkpoint(step, ckpt_factor * (step_sleep + 0.005))
            last = time.monotonic()
        if snapshots is not None and step % snapshot_every == 0 and step < steps:
            snapshots.save(step, {"model": plain.state_dict(), "optim": opt.state_dict()})
        if ckpts is not None and stop is not None:
            if stop.agreed(WORLD):
                if RANK == 0:
                    ckpts.save(plain, opt, step)
                log(f"stopping at step {step} on SIGTERM")
                if WORLD > 1:
                    del model, opt
                    shutdown()
                return env_int("TRAIN_SIGTERM_EXIT", 143)
            if save_every and step % save_every == 0 and step < steps and RANK == 0:
                ckpts.save(plain, opt, step)
    if ckpts is not None and RANK == 0 and start < steps:
        ckpts.save(plain, opt, steps)
    log("finished")
    if snapshots is not None:
        snapshots.wait(30.0)
    if WORLD > 1:
        del model, opt  # DDP's reducer goes before its process group (see shutdown)
        shutdown()
    return 0


def tflops(model: Any, tokens_per_second: float) -> float:
    """Megatron's estimate of model TFLOP/s: 6 FLOPs per parameter per token (forward and
    backward), however tiny the model."""
    return 6.0 * sum(p.numel() for p in model.parameters()) * tokens_per_second / 1e12


def _cycle(loader: Iterable[Any]) -> Iterator[Any]:
    """Batches from ``loader`` forever (a new epoch when one ends)."""
    while True:
        yield from loader


def shutdown() -> None:
    """Leave the process group so that no rank aborts at exit.

    Without this, about 1 rank in 30 died of SIGABRT ("terminate called without an
    active exception") after a healthy run: a rank that tears its gloo pairs down while
    its peer is still in its last collective makes the peer's gloo thread fail, and a
    DDP reducer destroyed after its process group leaves a joinable thread behind. So:
    meet at a barrier (every rank is done with every collective), drop DDP before the
    group, then destroy it.
    """
    import torch.distributed as dist

    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
