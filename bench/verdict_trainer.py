"""The faults examples/train.py does not have, for bench/verdicts.py's corpus: a small real
PyTorch DDP job (gloo on CPU, one process per rank, ``step=N/M loss=X`` lines) whose
``SCENARIO`` picks what happens on rank ``FAULT_RANK`` (default 0) at step ``AT``
(default 10), first attempt only (``FTAGENT_RESTART_COUNT`` 0), so a restart heals it:

  first_step_hang   before its first step, blocks forever reading its data index from a
                    dead mount (a FIFO nobody writes: no CPU, no I/O, its stack in ``open``)
  save_hang_first   "saving checkpoint at iteration AT", then blocks forever opening a FIFO
                    nobody writes (a dead mount: no CPU, no I/O, its stack in ``open``)
  save_hang_later   saves of SAVE_SECONDS (default 2) at steps 5 and AT-5 complete; the
                    save at AT blocks the same way (the phase's length was learned)
  eval_hang         an undeclared evaluation at AT that blocks forever on a queue nothing
                    fills (silent, no CPU)
  loader_hang       the batch comes from a DataLoader worker (num_workers=1) that blocks
                    forever at AT: the main thread waits on the worker's queue
  mismatch          at AT rank FAULT_RANK calls all_gather where the others all_reduce
  inner             WORLD 4: two data-parallel groups {0,1}, {2,3} inside the world; at AT
                    rank FAULT_RANK skips its group's all-reduce (its peer waits in it)
  slow_read         healthy: every READ_EVERY (default 10) steps rank FAULT_RANK reads a
                    shard from SLOW_SERVER (host:port, a loopback server that answers after
                    its delay) in its main thread: a socket recv() of seconds, while the
                    other ranks wait for it in the next all-reduce
  slow_read_loader  healthy: the same read, inside a DataLoader worker (num_workers=1)
  gc_pause          healthy: at AT, a garbage collection over millions of cyclic objects,
                    GC_SECONDS (default 8) of CPU, printing nothing
  plain             healthy: nothing happens (with FAULT_SLOW_FACTOR: a slow rank)

Knobs as examples/train.py: TRAIN_STEPS, TRAIN_STEP_SLEEP, TRAIN_PG_TIMEOUT.
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import socket
import sys
import tempfile
import time
from typing import Any

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
ATTEMPT = int(os.environ.get("FTAGENT_RESTART_COUNT", "0"))
SCENARIO = os.environ.get("SCENARIO", "plain")
AT = int(os.environ.get("AT", "10"))
FAULTY = RANK == int(os.environ.get("FAULT_RANK", "0")) and ATTEMPT == 0


def log(msg: str) -> None:
    print(f"[rank{RANK}] {msg}", flush=True)


def dead_mount(step: int) -> None:
    """Block forever in open() of a FIFO no one writes: the kernel parks the thread."""
    path = os.path.join(tempfile.mkdtemp(prefix="deadmount-"), "shard.pt")
    os.mkfifo(path)
    with open(path, "rb") as f:  # never returns
        f.read()


def save(step: int, seconds: float, hang: bool) -> None:
    log(f"saving checkpoint at iteration {step} to /tmp/ckpt")
    if hang:
        dead_mount(step)
    time.sleep(seconds)
    log(f"successfully saved checkpoint from iteration {step} to /tmp/ckpt")


def evaluate_stuck(step: int) -> None:
    """An evaluation waiting on results nothing will produce."""
    q: queue.Queue[int] = queue.Queue()
    q.get()


def read_shard(address: str) -> bytes:
    """One shard from the remote store: a request, then recv() until the answer ends."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=120) as s:
        s.sendall(b"GET shard\n")
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    return b"".join(chunks)


def gc_pause(seconds: float) -> None:
    """Collections over cyclic garbage, CPU-busy and silent, for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        junk: list[Any] = []
        for _ in range(300_000):
            a: list[Any] = []
            a.append(a)
            junk.append(a)
        del junk
        gc.collect()


class Batches:
    """A dataset for the DataLoader scenarios: its worker reads from the slow store every
    READ_EVERY items, or blocks forever at item AT (loader_hang)."""

    def __init__(self, n: int, slow: str, hang_at: int) -> None:
        self.n, self.slow, self.hang_at = n, slow, hang_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        every = int(os.environ.get("READ_EVERY", "10"))
        if self.slow and i > 0 and i % every == 0:
            read_shard(self.slow)
        if i == self.hang_at:
            threading_event_wait()
        return torch.randn(16, 32)


def threading_event_wait() -> None:
    import threading

    threading.Event().wait()


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = int(os.environ.get("TRAIN_STEPS", "100"))
    sleep = float(os.environ.get("TRAIN_STEP_SLEEP", "0.2"))
    slow = float(os.environ.get("FAULT_SLOW_FACTOR", "1")) if FAULTY else 1.0
    timeout = datetime.timedelta(seconds=float(os.environ.get("TRAIN_PG_TIMEOUT", "300")))
    dist.init_process_group("gloo", timeout=timeout)
    torch.manual_seed(1234 + RANK)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dp = None
    if SCENARIO == "inner":
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp = groups[RANK // 2]
    server = os.environ.get("SLOW_SERVER", "")
    loader = None
    if SCENARIO in ("loader_hang", "slow_read_loader"):
        data = Batches(steps + 10, server if SCENARIO == "slow_read_loader" and FAULTY else "",
                       AT if SCENARIO == "loader_hang" and FAULTY else -1)
        loader = iter(torch.utils.data.DataLoader(data, batch_size=None, num_workers=1,
                                                  prefetch_factor=1))
    log(f"started: world={WORLD} attempt={ATTEMPT} steps={steps} scenario={SCENARIO}")
    if SCENARIO == "first_step_hang" and FAULTY:
        dead_mount(0)
    last = time.monotonic()
    for step in range(1, steps + 1):
        x = next(loader) if loader is not None else torch.randn(16, 32)
        if SCENARIO == "slow_read" and server and FAULTY and step % int(os.environ.get(
                "READ_EVERY", "10")) == 0:
            read_shard(server)
        time.sleep(sleep * slow)
        if FAULTY and step == AT and SCENARIO == "mismatch":
            dist.all_gather([torch.empty(4) for _ in range(WORLD)], torch.ones(4))
        elif SCENARIO == "mismatch":
            dist.all_reduce(torch.ones(4))
        if dp is not None and not (FAULTY and step == AT):
            dist.all_reduce(torch.ones(4), group=dp)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        now = time.monotonic()
        log(f"step={step}/{steps} loss={float(loss):.4f} samples_per_second="
            f"{16 / (now - last):.1f}")
        last = now
        if SCENARIO == "save_hang_first" and step == AT:
            save(step, 0.0, FAULTY)
        if SCENARIO == "save_hang_later" and step in (5, AT - 5, AT):
            save(step, float(os.environ.get("SAVE_SECONDS", "2")), FAULTY and step == AT)
        if SCENARIO == "eval_hang" and FAULTY and step == AT:
            evaluate_stuck(step)
        if SCENARIO == "gc_pause" and FAULTY and step == AT:
            gc_pause(float(os.environ.get("GC_SECONDS", "8")))
            last = time.monotonic()
    log("finished")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
