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
Faults (only on rank FAULT_RANK, default 0, and only while FTAGENT_RESTART_COUNT equals
FAULT_ATTEMPT, default 0, so the job heals after a restart):
  FAULT_EVERY_ATTEMPT=1      inject on every attempt instead (a fault that never heals)
  FAULT_<KIND>_ATTEMPT=K     this fault only on attempt K (e.g. FAULT_HANG_ATTEMPT=1)
  FAULT_CRASH_AT_STEP=N      exit 3 at step N (FAULT_EXIT_CODE to change it)
  FAULT_HANG_AT_STEP=N       block forever before the all-reduce of step N
  FAULT_DATA_STALL_AT_STEP=N loop forever "waiting for data", printing every second
  FAULT_SLOW_FACTOR=F        this rank's steps take F times longer (all ranks wait)
  CKPT_EVERY=K               every K steps pause CKPT_FACTOR (default 10) x step time,
                             logging "saving checkpoint ..." like Megatron
"""

from __future__ import annotations

import datetime
import os
import sys
import time


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


def log(msg: str) -> None:
    print(f"[rank{RANK}] {msg}", flush=True)


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


def hang_before_collective(step: int) -> None:
    """Stands for a rank stuck before a collective (a deadlock, a lost peer)."""
    log(f"step {step}: (fault) hanging before all-reduce")
    while True:
        time.sleep(3600)


def wait_for_data(step: int) -> None:
    """Stands for a stuck data loader that keeps logging while no step advances."""
    while True:
        log(f"step {step}: waiting for data ...")
        time.sleep(1.0)


def checkpoint(step: int, seconds: float) -> None:
    log(f"saving checkpoint at iteration {step} to /tmp/ckpt")
    time.sleep(seconds)
    log(f"successfully saved checkpoint from iteration {step} to /tmp/ckpt")


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    sdk = None
    if USE_SDK:
        import ftagent as sdk  # type: ignore[no-redef]

    steps = env_int("TRAIN_STEPS", 100)
    step_sleep = env_float("TRAIN_STEP_SLEEP", 0.05)
    slow = env_float("FAULT_SLOW_FACTOR", 1.0) if FAULTY else 1.0
    ckpt_every = env_int("CKPT_EVERY", 0)
    ckpt_factor = env_float("CKPT_FACTOR", 10.0)
    timeout = datetime.timedelta(seconds=env_float("TRAIN_PG_TIMEOUT", 120.0))

    torch.manual_seed(1234 + RANK)
    if WORLD > 1:
        dist.init_process_group("gloo", timeout=timeout)
    model: nn.Module = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    if WORLD > 1:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = 16
    log(f"started: world={WORLD} attempt={ATTEMPT} steps={steps}")

    last = time.monotonic()
    for step in range(1, steps + 1):
        if fault_at("FAULT_DATA_STALL_AT_STEP", step):
            wait_for_data(step)
        x = torch.randn(batch, 32)
        y = x.sum(dim=1, keepdim=True)
        time.sleep(step_sleep * slow)
        if fault_at("FAULT_CRASH_AT_STEP", step):
            log(f"step {step}: (fault) crashing with exit code "
                f"{env_int('FAULT_EXIT_CODE', 3)}")
            return env_int("FAULT_EXIT_CODE", 3)
        if fault_at("FAULT_HANG_AT_STEP", step):
            hang_before_collective(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces gradients here
        opt.step()
        now = time.monotonic()
        dt, last = now - last, now
        value = float(loss.item())
        if FMT == "megatron":
            log(f" iteration {step:8d}/{steps:8d} | consumed samples: {step * batch * WORLD} | "
                f"elapsed time per iteration (ms): {dt * 1000:.1f} | lm loss: {value:.6E} |")
        else:
            log(f"step={step}/{steps} loss={value:.4f} samples_per_second={batch / dt:.1f}")
        if sdk is not None:
            sdk.step(step, loss=value, samples=batch)
        if ckpt_every and step % ckpt_every == 0 and step < steps:
            if sdk is not None:
                with sdk.phase("checkpoint"):
                    checkpoint(step, ckpt_factor * (step_sleep + 0.005))
            else:
                checkpoint(step, ckpt_factor * (step_sleep + 0.005))
            last = time.monotonic()
    log("finished")
    if WORLD > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
