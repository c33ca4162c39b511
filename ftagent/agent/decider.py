"""Who decides what a worker does about its faults: each worker holds one ``Decider``.

A worker (worker.py) supervises one trainer; what it does between two attempts and about
a fault is not its own business but its decider's, chosen at start (cmd/run.py) and held
by composition, never by subclassing the worker. A decider talks to its worker through a
narrow port (worker.py: read the lifecycle, ``deliver`` an action, await ``stopping``,
``record``) and never writes the worker's state:

* :class:`LocalDecider` -- the local policy (local_policy.py), alone or, for the
  launcher's N workers, through the node's :class:`WorkerGroup` (here: the local policy
  for N workers is one policy): the first failure of a generation stops every local
  worker, and none starts the next generation before all of them have arrived at the
  group's barrier.
* ``ArbiterDecider`` (arbiter_decider.py) -- the arbiter link: the job barrier, faults
  decided by the arbiter, and failing open to its own ``LocalDecider`` (the same group)
  when the arbiter stays away.

Every action says who decided it (``Action.origin``: the local policy's are LOCAL).

The hooks, in the order the worker calls them: ``start`` once before the first attempt;
``before_start`` before every attempt (a barrier; an Action here is a STOP/REPLACE that
came before the trainer started); ``decide``/``report`` for each fault; ``on_minor_action``
for ALERT_ONLY and DUMP_STACKS, which leave the trainer running; ``finished`` after a
trainer succeeded (a peer's later failure may still restart it); ``close`` once at the end.

The node's group (``WorkerGroup``), as torchrun's local group: the first failure of a
generation is decided once (restart all, within --max-restarts, or stop all), every
worker's trainer is stopped, and none starts the next generation before every worker of
the node has arrived at the group's barrier, i.e. every trainer of the failed generation
has exited and its tree is gone. Without an arbiter, a worker whose trainer succeeded
waits for its peers: a later failure of one of them restarts it too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Protocol

from ftagent.agent.local_policy import FailureStreak, decide
from ftagent.model import Action, ActionKind, Fault

if TYPE_CHECKING:
    from ftagent.agent.worker import Worker

log = logging.getLogger("ftagent.decider")

GROUP_ACTIONS = (ActionKind.RESTART, ActionKind.STOP, ActionKind.REPLACE)


class Decider(Protocol):
    def start(self) -> None:
        """Before the first attempt, on the agent's loop (the arbiter link's tasks)."""

    async def close(self) -> None:
        """After the last attempt: nothing of the decider outlives its worker."""

    async def before_start(self) -> Action | None:
        """Return when the next attempt may start, or the decision that ends the worker
        before it does (STOP/REPLACE)."""

    def decide(self, fault: Fault) -> None:
        """Decide about ``fault``: the action is delivered to the worker (now or later)."""

    def report(self, fault: Fault) -> None:
        """Record ``fault`` with whoever decides, without asking for a decision (one
        already came with the trainer's exit)."""

    async def on_minor_action(self, action: Action) -> None:
        """Carry out ALERT_ONLY or DUMP_STACKS; the trainer keeps running."""

    async def finished(self) -> Action | None:
        """The trainer succeeded: None to end the worker, or a decision that restarts or
        stops it after all (a peer failed)."""


class LocalDecider:
    """The local policy for one worker; with a ``group``, for the node's workers together."""

    def __init__(self, worker: Worker, group: WorkerGroup | None = None) -> None:
        self.worker = worker
        self.group = group
        # quick repeats of failures: the backoff grows only with these (local_policy)
        self.failures = FailureStreak(worker.cfg.supervisor.restart_backoff_window)
        if group is not None:
            group.add(worker)

    def start(self) -> None:
        pass

    async def close(self) -> None:
        if self.group is not None:  # the group's barriers stop counting this worker
            self.group.gone(self.worker)

    async def before_start(self) -> Action | None:
        """Start once every worker of the node is ready (the launcher), else at once."""
        if self.group is not None:
            return await self.group.barrier(self.worker)
        return None

    def arrived(self) -> None:
        """The worker is at a barrier other than the group's (the arbiter's): a peer that
        starts alone (failing open) need not wait for it."""
        if self.group is not None:
            self.group.arrive(self.worker)

    def decide(self, fault: Fault) -> None:
        """The local policy's action for ``fault`` goes on the action queue (of every
        worker of the node, for a restart or stop of the launcher's group)."""
        self.decide_action(fault)

    def decide_action(self, fault: Fault) -> Action:
        """``decide``, returning the action queued (the arbiter decider counts a restart
        it took alone)."""
        action = self.action(fault)
        if self.group is not None:
            self.group.decide(self.worker, action)
        else:
            self.worker.deliver(action)
        return action

    def report(self, fault: Fault) -> None:
        pass

    async def on_minor_action(self, action: Action) -> None:
        pass

    async def finished(self) -> Action | None:
        """With the group, wait for the peers: a later failure of one restarts this one."""
        if self.group is not None:
            return await self.group.finished(self.worker)
        return None

    def action(self, fault: Fault) -> Action:
        """What the local policy does about ``fault`` (pure but for this attempt's state)."""
        worker, sup = self.worker, self.worker.cfg.supervisor
        action = decide(fault, restarts_done=worker.restarts, max_restarts=sup.max_restarts,
                        backoff_base=sup.restart_backoff, backoff_cap=sup.restart_backoff_max,
                        hang_action=worker.cfg.hang.hang_action,
                        repeats=self.failures.record(time.monotonic()))
        # the generation it leads to: a local restart counts up (events and status say so);
        # its origin (LOCAL) makes the agent exit with the trainer's status (lifecycle.py)
        return dataclasses.replace(action,
                                   generation=worker.lifecycle.next_generation(action.kind))


class WorkerGroup:
    """The local policy for the node's workers together (module docstring)."""

    def __init__(self) -> None:
        self.workers: list[Worker] = []
        self.decided: dict[int, Action] = {}  # generation -> the decision that ends it
        self._arrived: dict[int, int] = {}  # local rank -> the latest generation it reached
        self._released: dict[int, asyncio.Event] = {}
        self._finished: dict[int, asyncio.Future[Action | None]] = {}  # by local rank
        self._gone: set[int] = set()  # workers whose supervision ended for good

    def add(self, worker: Worker) -> None:
        self.workers.append(worker)

    def decide(self, worker: Worker, action: Action) -> None:
        """The first group decision of a generation (the local policy's ``action`` about
        a fault of ``worker``) goes to every worker; what a peer raises after it (its own
        crash, caused by the first) is already answered."""
        if action.kind not in GROUP_ACTIONS:  # alert only: this worker's alone
            worker.deliver(action)
            return
        gen = worker.generation
        if gen in self.decided:
            log.info("local rank %d: the group's decision for generation %d stands (%s)",
                     self.workers.index(worker), gen, action.reason)
            # ... and is this fault's answer too: delivered again, to this worker only. A
            # worker whose own hang led to the decision drops it when its trainer then exits
            # by itself (the exit supersedes the hang); without this it would wait for an
            # answer to its crash forever, and its peers at the group's barrier with it. A
            # worker that has the decision already carries it out once (lifecycle).
            worker.deliver(dataclasses.replace(self.decided[gen], fault_id=action.fault_id))
            return
        self.decided[gen] = action
        log.info("local group: %s for every worker (%s)", action.kind.value, action.reason)
        for i, w in enumerate(self.workers):
            fut = self._finished.get(i)
            if fut is not None and not fut.done():
                fut.set_result(action)
            elif w.generation == gen and i not in self._gone:
                w.deliver(action)

    def arrive(self, worker: Worker) -> None:
        """``worker`` is at the barrier of its generation: its trainers of every earlier
        one have exited. It counts for that generation's barrier and every earlier one's
        (under an arbiter a worker may be told a higher generation than its peers')."""
        i = self.workers.index(worker)
        self._arrived[i] = max(self._arrived.get(i, worker.generation), worker.generation)
        for gen in list(self._released):
            self._check(gen)

    async def barrier(self, worker: Worker) -> Action | None:
        """Return once every live worker arrived at this generation (or a stop signal)."""
        gen = worker.generation
        self.arrive(worker)
        released = self._released.setdefault(gen, asyncio.Event())
        self._check(gen)
        if not released.is_set():
            await _first(released.wait(), worker.stopping())
        return None

    async def finished(self, worker: Worker) -> Action | None:
        """A worker whose trainer succeeded: None once every worker succeeded, or the
        group's decision if a peer fails first."""
        gen, i = worker.generation, self.workers.index(worker)
        if gen in self.decided:
            return self._take(worker, self.decided[gen])
        fut: asyncio.Future[Action | None] = asyncio.get_running_loop().create_future()
        self._finished[i] = fut
        self._check_done()
        await _first(asyncio.shield(fut), worker.stopping())
        self._finished.pop(i, None)
        if not fut.done():  # a stop signal
            return None
        action = fut.result()
        return None if action is None else self._take(worker, action)

    def gone(self, worker: Worker) -> None:
        """The worker's supervision ended (success, stop, a trainer that cannot start):
        the barrier and the all-finished check stop counting it."""
        self._gone.add(self.workers.index(worker))
        for gen in list(self._released):
            self._check(gen)
        self._check_done()

    def _take(self, worker: Worker, action: Action) -> Action:
        """The decision, taken out of the worker's queue if it was put there too."""
        for queued in worker.take_delivered():
            if queued.id != action.id:
                worker.deliver(queued)
        worker.record(action)
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
