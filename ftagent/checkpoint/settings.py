"""How one rank snapshots, from the environment ``ftagent run`` gives its trainer (or the
user sets), and the pure rule of the budgeted snapshot interval. A bad value is said in one
line on stderr and replaced by its default: a snapshot setting never stops training."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass


def _env_int(environ: Mapping[str, str], name: str, default: int, lo: int = 0) -> int:
    raw = environ.get(name, "")
    try:
        v = int(raw) if raw.strip() else default
    except ValueError:
        print(f"ftagent.checkpoint: {name}={raw[:32]!r} is not an integer; using {default}",
              file=sys.stderr)
        return default
    return max(lo, v)


def _env_share(environ: Mapping[str, str], name: str) -> float:
    raw = environ.get(name, "").strip()
    try:
        v = float(raw) if raw else 0.0
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:  # also NaN
        print(f"ftagent.checkpoint: {name}={raw[:32]!r} is not a share in [0, 1]; ignored",
              file=sys.stderr)
        return 0.0
    return v


def interval_due(steps_since: int, step_seconds: float | None, blocking_seconds: float,
                 budget: float) -> bool:
    """Is a snapshot due, ``steps_since`` steps after the last one, when saves may block
    at most ``budget`` of the training time? Yes until the step time and the blocking
    cost are known (the first snapshots measure them); then once the steps since cover
    ``blocking / budget`` seconds of training."""
    if budget <= 0 or step_seconds is None or blocking_seconds <= 0:
        return True
    return steps_since * step_seconds * budget >= blocking_seconds


@dataclass(frozen=True)
class Settings:
    """Where and how this rank snapshots, from the environment ``ftagent run`` gives its
    trainer (or the user sets): see docs/snapshots.md."""

    root: str  # memory-backed snapshot root ("" : no agent, plain DCP)
    job: str
    rank: int
    world_size: int
    # complete snapshots kept per rank: 2 is enough for synchronous training (a rank that
    # outlives a failed peer blocks in the next collective, at most one snapshot past the
    # step every rank holds, so it cannot drop that step before it is stopped)
    keep: int = 2
    max_bytes: int = 0  # memory cap for this rank's snapshots (0: none)
    resume_step: int | None = None  # the arbiter's step to load
    durable: str = ""  # the job's durable checkpoint directory ("" : none): the disk rung
    budget: float = 0.0  # the share of training time saves may block (0: every save asked)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 checkpoint_dir: str | None = None) -> Settings:
        env = os.environ if environ is None else environ
        resume = env.get("FTAGENT_RESUME_STEP", "").strip()
        return cls(
            root=env.get("FTAGENT_SNAPSHOT_DIR", ""),
            job=env.get("FTAGENT_JOB") or env.get("TORCHELASTIC_RUN_ID") or "local",
            rank=_env_int(env, "RANK", 0), world_size=_env_int(env, "WORLD_SIZE", 1, lo=1),
            keep=_env_int(env, "FTAGENT_SNAPSHOT_KEEP", 2, lo=1),
            max_bytes=_env_int(env, "FTAGENT_SNAPSHOT_MAX_BYTES", 0),
            resume_step=int(resume) if resume.isdigit() else None,
            durable=checkpoint_dir if checkpoint_dir is not None
            else env.get("FTAGENT_CHECKPOINT_DIR", ""),
            budget=_env_share(env, "FTAGENT_SNAPSHOT_BUDGET"))
