"""One trainer attempt's process side: its environment, its process tree, its stop.

What a worker (worker.py) needs of the operating system between deciding to start a
trainer and knowing it is gone, as plain functions over a
:class:`~ftagent.agent.supervisor.TrainerProcess` and a tree lister: the attempt's
environment, which processes are this trainer's (alone: the agent's whole tree; under the
launcher: its own session and marker, never a peer worker's), whether it already exited
(a peek, never a reap: the reaper owns that), and the stop: SIGTERM, grace, SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping

import psutil

from ftagent.agent import stop_grace, supervisor
from ftagent.agent.supervisor import TrainerProcess

log = logging.getLogger("ftagent.agent")

# the step the arbiter said every rank's snapshot holds (ftagent.checkpoint.load loads it)
RESUME_VAR = "FTAGENT_RESUME_STEP"
WORKER_VAR = "FTAGENT_LOCAL_RANK"  # marks a worker's processes, for orphans that left its session

Tree = Callable[[], list[psutil.Process]]


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


def zombie(pid: int) -> bool:
    """``pid`` has exited and waits to be reaped (WNOWAIT: the reaper still gets it)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return info is not None and info.si_pid == pid


def exited(trainer: TrainerProcess) -> bool:
    """The trainer is gone, or its exit waits for the loop (the SIGCHLD not handled yet)."""
    return trainer.exited.done() or zombie(trainer.pid)  # (not ``running``: no call)


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


async def terminate(trainer: TrainerProcess, tree: Tree, deadline: float, *,
                    forwarded: int | None, stop_timeout: float) -> None:
    """Our own stop (a restart): SIGTERM the trainer's group and tree, the grace being the
    handler's for as long as it is installed (stop_grace.py: not CPython's teardown after
    it; the attempt is discarded, its exit code is no one's). A stop signal ``forwarded``
    as is (the pod going): the trainer's handler and its teardown decide, and its exit
    code is the user's, up to ``deadline``. SIGKILL whatever is left at ``deadline``."""
    if not trainer.exited.done():  # running
        log.info("stopping trainer (pid %d)", trainer.pid)
        if forwarded is None:  # our own stop: SIGTERM the group and the tree
            trainer.send_signal(signal.SIGTERM)
            procs = tree()
            supervisor.signal_tree(signal.SIGTERM, procs)
            if supervisor.frozen(trainer.pid):  # stopped: SIGTERM waits for a SIGCONT
                log.warning("trainer (pid %d) is stopped (frozen): SIGKILL, no grace",
                            trainer.pid)
                deadline = time.monotonic()
            # its first look at the handlers: the tree just signalled, not listed again
            await stop_grace.wait_stopped(trainer.exited, lambda: [p.pid for p in tree()],
                                          signal.SIGTERM, deadline,
                                          first=[p.pid for p in procs])
        else:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(trainer.exited),
                                       max(0.0, deadline - time.monotonic()))
    if not trainer.exited.done():  # running
        killed = await supervisor.kill_tree(trainer.pgid, procs=tree)
        log.warning("trainer ignored SIGTERM for %.1fs: SIGKILLed %d process(es)",
                    stop_timeout, killed)


async def clear_leftovers(tree: Tree, deadline: float) -> None:
    """The main process is gone: what it left of its tree is stopped by ``deadline``."""
    if tree():
        killed = await supervisor.stop_tree(None, max(0.0, deadline - time.monotonic()),
                                            procs=tree)
        if killed:
            log.warning("SIGKILLed %d leftover process(es) of the trainer", killed)
