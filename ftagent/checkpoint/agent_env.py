"""What the agent tells its trainer about snapshots: the environment of every attempt.

Pure: the run's snapshot flags, the job's name, the container's memory limit and the
workers sharing it in, the variables out. The trainer's ``ftagent.checkpoint`` reads
them (snapshots.Settings.from_env). ``FTAGENT_RESUME_STEP`` is not here: it changes per
restart (the arbiter's command) and the worker adds it (worker.next_env,
trainer_exec.RESUME_VAR).
"""

from __future__ import annotations

import os

from ftagent.config import SnapshotConfig


def cap_bytes(share: float, limit: int | None, workers: int) -> int:
    """One rank's snapshot cap: ``share`` of the container's memory ``limit``, split
    between the ``workers`` that share it (0: no cap: no limit or share 0)."""
    if limit is None or share <= 0:
        return 0
    return max(1, int(share * limit / max(1, workers)))


def snapshot_env(cfg: SnapshotConfig, job: str, *, limit: int | None,
                 workers: int = 1) -> dict[str, str]:
    """The snapshot variables of every attempt of one worker."""
    env = {"FTAGENT_SNAPSHOT_DIR": os.path.abspath(cfg.snapshot_dir), "FTAGENT_JOB": job,
           "FTAGENT_SNAPSHOT_MAX_BYTES": str(cap_bytes(cfg.snapshot_memory_share, limit,
                                                       workers))}
    if cfg.snapshot_budget:
        env["FTAGENT_SNAPSHOT_BUDGET"] = repr(cfg.snapshot_budget)
    if cfg.checkpoint_dir:
        env["FTAGENT_CHECKPOINT_DIR"] = os.path.abspath(cfg.checkpoint_dir)
    return env
