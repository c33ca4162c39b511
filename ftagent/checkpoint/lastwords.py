"""Last words: when the pod is told to go (SIGTERM: eviction, preemption, a node drain, a
spot reclaim), the agent persists the newest complete in-memory snapshots of its ranks to
the job's durable checkpoint directory before it exits, and says how long it took.

Run by the agent after its trainers have stopped (cmd/run.py), inside the pod's
termination grace: newest first, each shard verified (sizes and checksums) before it is
copied (persist.py: marker last, renamed into place), until ``deadline`` (monotonic)
passes; a step already persisted is not copied again. Each rank's held steps all go when
time allows, so the durable directory has a step every rank holds even when one rank's
newest shard was not complete. Plain ``torch.distributed.checkpoint.load`` reads the result.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ftagent.checkpoint import layout, persist

log = logging.getLogger("ftagent.checkpoint")


@dataclass(frozen=True)
class Said:
    """What the last words did for one rank: the steps persisted (newest first), the
    seconds it took, and why a step was left (refused, out of time, failed)."""

    rank: int
    persisted: tuple[int, ...]
    seconds: float
    left: tuple[str, ...]


def last_words(root: str, job: str, ranks: Iterable[int], durable: str, *,
               deadline: float, keep: int = 2) -> list[Said]:
    """Persist each rank's complete snapshots (newest first) until ``deadline``."""
    out = []
    for rank in ranks:
        t0 = time.monotonic()
        done: list[int] = []
        left: list[str] = []
        already = set(persist.complete_steps(durable, job, rank)) if durable else set()
        for step in reversed(layout.complete_steps(root, job, rank)[-keep:]):
            if step in already:
                done.append(step)
                continue
            if time.monotonic() >= deadline:
                left.append(f"step {step}: out of time")
                continue
            src = layout.step_dir(root, job, rank, step)
            try:
                layout.verify(src, job=job, rank=rank, step=step)
                persist.persist(src, durable, rank=rank, step=step, keep=keep)
            except layout.SnapshotRejected as e:
                left.append(f"step {step}: {e}")
                continue
            except OSError as e:
                left.append(f"step {step}: {e.strerror or e}")
                continue
            done.append(step)
        said = Said(rank, tuple(done), time.monotonic() - t0, tuple(left))
        out.append(said)
        if done:
            log.info("last words: rank %d's snapshot of step %d persisted to %s in %.2fs%s",
                     rank, done[0], os.path.join(durable, f"step-{done[0]}"), said.seconds,
                     f" (also {list(done[1:])})" if done[1:] else "")
        else:
            log.warning("last words: rank %d: no complete snapshot persisted (%s)", rank,
                        "; ".join(left) or "none held")
    return out
