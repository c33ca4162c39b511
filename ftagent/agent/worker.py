"""The node's workers: ``ftagent run --nproc-per-node N`` runs N supervised trainers.

Each worker is an ``Agent`` of its own (agent.py): its trainer process and tree, output
pump, progress and hang detector, SDK socket, evidence and events, and its own rank to
the arbiter (one ArbiterLink per worker: the arbiter already thinks in ranks, and its
barrier then holds every rank of the job, this node's included). What they share is the
process: one SIGCHLD reaper, the stop signals, one /metrics port, and the node's GPU and
NIC sources (on local rank 0's worker).

The workers' local policy is one ``WorkerGroup``, as torchrun's local group (each
worker's ``decider.LocalDecider`` decides through it: alone, or under an arbiter when it
fails open): the first failure of a generation is decided once (restart all, within
--max-restarts, or stop all), every worker's trainer is stopped, and none starts the next
generation before every worker of the node has arrived at the group's barrier, i.e. every
trainer of the failed generation has exited and its tree is gone. Without an arbiter, a
worker whose trainer succeeded waits for its peers: a later failure of one of them
restarts it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence

import psutil

from ftagent.agent import supervisor
from ftagent.agent.agent import Agent, install_process_parts
from ftagent.model import Action, ActionKind

log = logging.getLogger("ftagent.worker")

WORKER_VAR = "FTAGENT_LOCAL_RANK"  # marks a worker's processes, for orphans that left its session
GROUP_ACTIONS = (ActionKind.RESTART, ActionKind.STOP, ActionKind.REPLACE)


def worker_tree(agent: Agent, local_rank: int) -> Callable[[], list[psutil.Process]]:
    """The processes of one worker's trainer: its session (the trainer leads one), and
    what carries the worker's marker (an orphan that called setsid, a previous attempt's
    leftover); never a peer worker's."""
    mark = str(local_rank)

    def tree() -> list[psutil.Process]:
        sid = agent.trainer.pid if agent.trainer is not None else None
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


class WorkerGroup:
    """The local policy for the node's workers together (module docstring)."""

    def __init__(self) -> None:
        self.workers: list[Agent] = []
        self.decided: dict[int, Action] = {}  # generation -> the decision that ends it
        self._arrived: dict[int, int] = {}  # local rank -> the latest generation it reached
        self._released: dict[int, asyncio.Event] = {}
        self._finished: dict[int, asyncio.Future[Action | None]] = {}  # by local rank
        self._gone: set[int] = set()  # workers whose supervision ended for good

    def add(self, worker: Agent) -> None:
        self.workers.append(worker)

    def decide(self, worker: Agent, action: Action) -> None:
        """The first group decision of a generation (the local policy's ``action`` about
        a fault of ``worker``) goes to every worker; what a peer raises after it (its own
        crash, caused by the first) is already answered."""
        if action.kind not in GROUP_ACTIONS:  # alert only: this worker's alone
            worker.actions.put_nowait(action)
            return
        gen = worker.generation
        if gen in self.decided:
            log.info("local rank %d: the group's decision for generation %d stands (%s)",
                     self.workers.index(worker), gen, action.reason)
            return
        self.decided[gen] = action
        log.info("local group: %s for every worker (%s)", action.kind.value, action.reason)
        for i, w in enumerate(self.workers):
            fut = self._finished.get(i)
            if fut is not None and not fut.done():
                fut.set_result(action)
            elif w.generation == gen and i not in self._gone:
                w.actions.put_nowait(action)

    def arrive(self, worker: Agent) -> None:
        """``worker`` is at the barrier of its generation: its trainers of every earlier
        one have exited. It counts for that generation's barrier and every earlier one's
        (under an arbiter a worker may be told a higher generation than its peers')."""
        i = self.workers.index(worker)
        self._arrived[i] = max(self._arrived.get(i, worker.generation), worker.generation)
        for gen in list(self._released):
            self._check(gen)

    async def barrier(self, worker: Agent) -> Action | None:
        """Return once every live worker arrived at this generation (or a stop signal)."""
        gen = worker.generation
        self.arrive(worker)
        released = self._released.setdefault(gen, asyncio.Event())
        self._check(gen)
        if not released.is_set():
            await _first(released.wait(), worker._stop_event.wait())
        return None

    async def finished(self, worker: Agent) -> Action | None:
        """A worker whose trainer succeeded: None once every worker succeeded, or the
        group's decision if a peer fails first."""
        gen, i = worker.generation, self.workers.index(worker)
        if gen in self.decided:
            return self._take(worker, self.decided[gen])
        fut: asyncio.Future[Action | None] = asyncio.get_running_loop().create_future()
        self._finished[i] = fut
        self._check_done()
        await _first(asyncio.shield(fut), worker._stop_event.wait())
        self._finished.pop(i, None)
        if not fut.done():  # a stop signal
            return None
        action = fut.result()
        return None if action is None else self._take(worker, action)

    def gone(self, worker: Agent) -> None:
        """The worker's supervision ended (success, stop, a trainer that cannot start):
        the barrier and the all-finished check stop counting it."""
        self._gone.add(self.workers.index(worker))
        for gen in list(self._released):
            self._check(gen)
        self._check_done()

    def _take(self, worker: Agent, action: Action) -> Action:
        """The decision, taken out of the worker's queue if it was put there too."""
        keep = []
        while not worker.actions.empty():
            queued = worker.actions.get_nowait()
            if queued.id != action.id:
                keep.append(queued)
        for a in keep:
            worker.actions.put_nowait(a)
        worker._record_action(action)
        return action

    def _check(self, gen: int) -> None:
        live = set(range(len(self.workers))) - self._gone
        if all(self._arrived.get(i, -1) >= gen for i in live):
            self._released.setdefault(gen, asyncio.Event()).set()

    def _check_done(self) -> None:
        live = set(range(len(self.workers))) - self._gone
        if live and live <= set(self._finished):
            for fut in self._finished.values():
                if not fut.done():
                    fut.set_result(None)


async def _first(*aws: object) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]  # type: ignore[call-overload]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


async def run_workers(workers: Sequence[Agent], on_close: Callable[[], None] = lambda: None
                      ) -> int:
    """Run every worker in this process until all are done; the node's exit status is
    the first failing worker's own (its exit code, 128+N for signal N), else 0."""
    if not workers:
        return 0
    reaper = workers[0].reaper

    def on_signal(sig: int) -> None:
        for w in workers:
            w._on_signal(sig)

    install_process_parts(reaper, on_signal)

    try:  # a worker's decider leaves the group when its run ends (decider.close)
        codes = await asyncio.gather(*(w.run_worker() for w in workers),
                                     return_exceptions=True)
    finally:
        if supervisor.tree():  # nothing of any trainer outlives the agent
            await supervisor.kill_tree(None)
        reaper.uninstall()
        with contextlib.suppress(Exception):
            on_close()
    statuses = []
    for w, c in zip(workers, codes, strict=True):
        if isinstance(c, BaseException):
            log.error("worker failed: %r", c, exc_info=c)
            statuses.append(1)
        else:
            statuses.append(c)
        del w
    return next((c for c in statuses if c != 0), 0)
