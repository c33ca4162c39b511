"""Who decides what the pod's workers do about their faults: one ``Decider`` per pod.

A worker (worker.py) supervises one trainer; what it does between two attempts and about
a fault is not its own business but the pod's decider's, chosen at start (cmd/run.py),
held by the pod (pod.py) and shared by all its workers, never a subclass of the worker.
Each worker takes its seat with ``add`` when it is built (with its rank's hooks, seat.py
``RankHooks``); from then on it calls the decider's hooks with itself, and the decider
answers through the worker's narrow port (seat.py ``Seat``: the lifecycle, where a
decision is delivered by moving the desired state, ``Lifecycle.want``; await ``changed``
or ``stopping``; ``write`` an event) and never writes the worker's observed state.
Deciders do not import worker.py:

* :class:`LocalDecider` -- the local policy (local_policy.py) for the pod's workers, one
  or the launcher's N, as torchrun's local group: the first failure of a generation
  stops every local worker, and none starts the next generation before all of them
  have arrived at the group's barrier. One object: the policy and the group are one.
* ``ArbiterDecider`` (arbiter_decider.py) -- the arbiter: one link session per rank
  inside it (the wire is one stream per rank), the job barrier, faults decided by the
  arbiter, and failing open to the pod's one ``LocalDecider``.

Every action says who decided it (``Action.origin``: the local policy's are LOCAL). An
action a hook returns (``barrier``'s STOP, ``finished``'s restart) is recorded by the
worker that carries it out, like any other.

The hooks, in the order a worker calls them: ``add`` once when it is built; ``start``
once before its first attempt; ``barrier`` before every attempt, a look each time the
worker wakes there (worker.py ``wait_at_barrier``: the desired state says released or
not; an Action here is a STOP/REPLACE that came before the trainer started; a wait of the
decider's own -- the local group's, a spare's -- is handed back to be awaited);
``decide``/``report``
for each fault; ``on_minor_action`` for ALERT_ONLY, DUMP_STACKS and BUSY, which leave the
trainer running; ``finished`` after its trainer succeeded (a peer's later failure may
still restart it); ``close`` once at the end of its supervision.

The group (torchrun's local group): the first failure of a generation is decided once
(restart all, within --max-restarts, or stop all), every worker's trainer is stopped,
and none starts the next generation before every worker of the pod has arrived at the
group's barrier, i.e. every trainer of the failed generation has exited and its tree is
gone. Without an arbiter, a worker whose trainer succeeded waits for its peers: a later
failure of one of them restarts it too. With one worker the group is that worker alone:
its barrier is passed at once, and its decisions are its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol

from ftagent.agent.local_policy import FailureStreak, decide
from ftagent.model import Action, ActionKind, Fault

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ftagent.agent.seat import RankHooks, Seat
    from ftagent.agent.worker_parts import Observer

log = logging.getLogger("ftagent.decider")

GROUP_ACTIONS = (ActionKind.RESTART, ActionKind.STOP, ActionKind.REPLACE)


# One look at a rank's barrier (``Decider.barrier``): go (None), end on this decision (an
# Action), look again within this many seconds or when the desired state moves (a float),
# or a wait of the decider's own to await, whose answer is one of those
Look = Action | float | None
Barrier = Look | Awaitable[Look]


class Decider(Protocol):
    """The pod's decider, as its workers see it (module docstring: the hooks)."""

    def add(self, worker: Seat, hooks: RankHooks) -> Sequence[Observer]:
        """``worker`` takes its seat (when it is built, before any worker runs) with its
        rank's ``hooks``; returns the observers the decider asks the worker to carry (the
        arbiter link's): the worker adds them itself, nothing outside worker.py changes a
        worker."""

    def start(self, worker: Seat) -> None:
        """Before ``worker``'s first attempt, on the agent's loop (its rank's link)."""

    async def close(self, worker: Seat) -> None:
        """After ``worker``'s last attempt: nothing of its seat outlives it."""

    def barrier(self, worker: Seat) -> Barrier:
        """One look at ``worker``'s barrier before its next attempt, made each time the
        worker wakes there (worker.py ``wait_at_barrier``): go (None), the decision that
        ends it before it starts (STOP/REPLACE), not yet (seconds it may sleep unless the
        desired state moves first), or a wait of the decider's own to await first."""

    def decide(self, worker: Seat, fault: Fault) -> None:
        """Decide about ``worker``'s ``fault``: the action is wanted (now or later)."""

    def report(self, worker: Seat, fault: Fault) -> None:
        """Record ``worker``'s ``fault`` with whoever decides, without asking for a
        decision (one already came with the trainer's exit)."""

    async def on_minor_action(self, worker: Seat, action: Action) -> None:
        """Carry out ALERT_ONLY, DUMP_STACKS or BUSY; the trainer keeps running."""

    async def finished(self, worker: Seat) -> Action | None:
        """``worker``'s trainer succeeded: None to end it, or a decision that restarts or
        stops it after all (a peer failed)."""


class LocalDecider:
    """The local policy for the pod's workers together (module docstring)."""

    def __init__(self) -> None:
        self.workers: list[Seat] = []
        # per local rank: quick repeats of its failures (the backoff grows only with these)
        self._streaks: list[FailureStreak] = []
        self.decided: dict[int, Action] = {}  # generation -> the decision that ends it
        self._arrived: dict[int, int] = {}  # local rank -> the latest generation it reached
        self._released: dict[int, asyncio.Event] = {}
        self._finished: dict[int, asyncio.Future[Action | None]] = {}  # by local rank
        self._gone: set[int] = set()  # workers whose supervision ended for good

    def add(self, worker: Seat, hooks: RankHooks | None = None) -> Sequence[Observer]:
        self.workers.append(worker)
        self._streaks.append(FailureStreak(worker.cfg.supervisor.restart_backoff_window))
        return ()

    def start(self, worker: Seat) -> None:
        pass

    async def close(self, worker: Seat) -> None:
        """The worker's supervision ended (success, stop, a trainer that cannot start):
        the barrier and the all-finished check stop counting it."""
        self._gone.add(self.workers.index(worker))
        for gen in list(self._released):
            self._check(gen)
        self._check_done()

    def barrier(self, worker: Seat) -> Barrier:
        """Go once every live worker arrived at this generation: None, or the group's
        wait to await (it ends with a stop signal too)."""
        gen = worker.lifecycle.generation
        self.arrive(worker)
        released = self._released.setdefault(gen, asyncio.Event())
        self._check(gen)
        if released.is_set():
            return None
        return _first(released.wait(), worker.stopping())

    def arrive(self, worker: Seat) -> None:
        """``worker`` is at the barrier of its generation (the group's, or the arbiter's:
        a peer that starts alone, failing open, need not wait for it): its trainers of
        every earlier one have exited. It counts for that generation's barrier and every
        earlier one's (under an arbiter a worker may be told a higher generation than
        its peers')."""
        i = self.workers.index(worker)
        gen = worker.lifecycle.generation
        self._arrived[i] = max(self._arrived.get(i, gen), gen)
        for gen in list(self._released):
            self._check(gen)

    def decide(self, worker: Seat, fault: Fault) -> None:
        """The local policy's action for ``fault`` is the desired decision (of every
        worker of the pod, for a restart or stop)."""
        self.decide_action(worker, fault)

    def decide_action(self, worker: Seat, fault: Fault) -> Action:
        """``decide``, returning the action the worker was given."""
        action = self.action(worker, fault)
        if action.kind not in GROUP_ACTIONS:  # alert only: this worker's alone
            worker.lifecycle.want(action)
            return action
        gen = worker.lifecycle.generation
        if gen in self.decided:
            log.info("local rank %d: the group's decision for generation %d stands (%s)",
                     self.workers.index(worker), gen, action.reason)
            # ... and is this fault's answer too: delivered again, to this worker only. A
            # worker whose own hang led to the decision drops it when its trainer then exits
            # by itself (the exit supersedes the hang); without this it would wait for an
            # answer to its crash forever, and its peers at the group's barrier with it. A
            # worker that has the decision already carries it out once (lifecycle).
            again = dataclasses.replace(self.decided[gen], fault_id=action.fault_id)
            worker.lifecycle.want(again)
            return again
        self.decided[gen] = action
        if len(self.workers) > 1:
            log.info("local group: %s for every worker (%s)", action.kind.value,
                     action.reason)
        for i, w in enumerate(self.workers):
            fut = self._finished.get(i)
            if fut is not None and not fut.done():
                fut.set_result(action)
            elif w.lifecycle.generation == gen and i not in self._gone:
                w.lifecycle.want(action)
        return action

    def report(self, worker: Seat, fault: Fault) -> None:
        pass

    async def on_minor_action(self, worker: Seat, action: Action) -> None:
        pass

    async def finished(self, worker: Seat) -> Action | None:
        """A worker whose trainer succeeded: None once every worker succeeded, or the
        group's decision if a peer fails first."""
        gen, i = worker.lifecycle.generation, self.workers.index(worker)
        if gen in self.decided:
            return self.decided[gen]  # recorded as carried out: then moot if wanted too
        fut: asyncio.Future[Action | None] = asyncio.get_running_loop().create_future()
        self._finished[i] = fut
        self._check_done()
        await _first(asyncio.shield(fut), worker.stopping())
        self._finished.pop(i, None)
        if not fut.done():  # a stop signal
            return None
        action = fut.result()
        return action

    def action(self, worker: Seat, fault: Fault) -> Action:
        """What the local policy does about ``worker``'s ``fault`` (pure but for this
        attempt's state)."""
        sup = worker.cfg.supervisor
        streak = self._streaks[self.workers.index(worker)]
        action = decide(fault, restarts_done=worker.lifecycle.restarts,
                        max_restarts=sup.max_restarts,
                        backoff_base=sup.restart_backoff, backoff_cap=sup.restart_backoff_max,
                        hang_action=worker.cfg.hang.hang_action,
                        repeats=streak.record(time.monotonic()))
        # the generation it leads to: a local restart counts up (events and status say so);
        # its origin (LOCAL) makes the agent exit with the trainer's status (lifecycle.py)
        return dataclasses.replace(action,
                                   generation=worker.lifecycle.next_generation(action.kind))

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
