"""One worker's attempts: their environment, and which processes are its trainer's.

What a worker (worker.py) adds to the process side of the supervisor (supervisor.py:
spawn, reap, signal, the stop of a trainer and its tree): the attempt's environment, and
which processes are this worker's trainer's (alone: the agent's whole tree; under the
launcher: its own session and marker, never a peer worker's).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import psutil

from ftagent.agent import supervisor
from ftagent.agent.supervisor import TrainerProcess, Tree

# the step the arbiter said every rank's snapshot holds (ftagent.checkpoint.load loads it)
RESUME_VAR = "FTAGENT_RESUME_STEP"
WORKER_VAR = "FTAGENT_LOCAL_RANK"  # marks a worker's processes, for orphans that left its session


def attempt_env(environ: Mapping[str, str], *, restarts: int, generation: int,
                extra: Mapping[str, str], per_attempt: Mapping[str, str]) -> dict[str, str]:
    """The trainer's environment for one attempt: the worker's, the agent's restart count
    and generation, unbuffered output unless the user chose, the parts' variables (SDK
    socket, flight recorder), then the per-attempt ones (torchrun's) last."""
    env = dict(environ)
    env["FTAGENT_RESTART_COUNT"] = str(restarts)
    env["FTAGENT_GENERATION"] = str(generation)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    env.update(per_attempt)
    return env


def worker_tree(trainer: Callable[[], TrainerProcess | None], local_rank: int) -> Tree:
    """The processes of one worker's trainer (``trainer()``: its current attempt): its
    session (the trainer leads one), and what carries the worker's marker (an orphan that
    called setsid, a previous attempt's leftover); never a peer worker's."""
    mark = str(local_rank)

    def tree() -> list[psutil.Process]:
        t = trainer()
        sid = t.pid if t is not None else None
        mine = []
        for p in supervisor.tree():
            try:
                in_session = sid is not None and (p.pid == sid or os.getsid(p.pid) == sid)
                if in_session or p.environ().get(WORKER_VAR) == mark:
                    mine.append(p)
            except (psutil.Error, OSError):
                continue
        return mine

    return tree
