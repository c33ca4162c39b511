"""Who decides what a worker does about its faults: the agent holds one ``Decider``.

The agent (agent.py) supervises one trainer; what it does between two attempts and about
a fault is not its own business but its decider's, chosen at start (cmd/run.py) and held
by composition, never by subclassing the agent:

* :class:`LocalDecider` -- the local policy (local_policy.py), alone or, for the
  launcher's N workers, through the node's ``WorkerGroup`` (worker.py): the first
  failure of a generation stops every local worker, and none starts the next generation
  before all of them have arrived at the group's barrier.
* ``ArbiterDecider`` (arbiter_decider.py) -- the arbiter link: the job barrier, faults
  decided by the arbiter, and failing open to its own ``LocalDecider`` (the same group)
  when the arbiter stays away.

The hooks, in the order the agent calls them: ``start`` once before the first attempt;
``before_start`` before every attempt (a barrier; an Action here is a STOP/REPLACE that
came before the trainer started); ``decide``/``report`` for each fault; ``on_minor_action``
for ALERT_ONLY and DUMP_STACKS, which leave the trainer running; ``finished`` after a
trainer succeeded (a peer's later failure may still restart it); ``close`` once at the end.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Protocol

from ftagent.agent.local_policy import FailureStreak, decide
from ftagent.model import Action, Fault

if TYPE_CHECKING:
    from ftagent.agent.agent import Agent
    from ftagent.agent.worker import WorkerGroup


class Decider(Protocol):
    def start(self) -> None:
        """Before the first attempt, on the agent's loop (the arbiter link's tasks)."""

    async def close(self) -> None:
        """After the last attempt: nothing of the decider outlives its worker."""

    async def before_start(self) -> Action | None:
        """Return when the next attempt may start, or the decision that ends the worker
        before it does (STOP/REPLACE)."""

    def decide(self, fault: Fault) -> None:
        """Decide about ``fault``: the action reaches ``agent.actions`` (now or later)."""

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

    def __init__(self, agent: Agent, group: WorkerGroup | None = None) -> None:
        self.agent = agent
        self.group = group
        # quick repeats of failures: the backoff grows only with these (local_policy)
        self.failures = FailureStreak(agent.cfg.supervisor.restart_backoff_window)
        if group is not None:
            group.add(agent)

    def start(self) -> None:
        pass

    async def close(self) -> None:
        if self.group is not None:  # the group's barriers stop counting this worker
            self.group.gone(self.agent)

    async def before_start(self) -> Action | None:
        """Start once every worker of the node is ready (the launcher), else at once."""
        if self.group is not None:
            return await self.group.barrier(self.agent)
        return None

    def arrived(self) -> None:
        """The worker is at a barrier other than the group's (the arbiter's): a peer that
        starts alone (failing open) need not wait for it."""
        if self.group is not None:
            self.group.arrive(self.agent)

    def decide(self, fault: Fault) -> None:
        """The local policy's action for ``fault`` goes on the action queue (of every
        worker of the node, for a restart or stop of the launcher's group)."""
        self.decide_action(fault)

    def decide_action(self, fault: Fault) -> Action:
        """``decide``, returning the action queued (the arbiter decider counts a restart
        it took alone)."""
        action = self.action(fault)
        if self.group is not None:
            self.group.decide(self.agent, action)
        else:
            self.agent.actions.put_nowait(action)
        return action

    def report(self, fault: Fault) -> None:
        pass

    async def on_minor_action(self, action: Action) -> None:
        pass

    async def finished(self) -> Action | None:
        """With the group, wait for the peers: a later failure of one restarts this one."""
        if self.group is not None:
            return await self.group.finished(self.agent)
        return None

    def action(self, fault: Fault) -> Action:
        """What the local policy does about ``fault`` (pure but for this attempt's state)."""
        agent, sup = self.agent, self.agent.cfg.supervisor
        action = decide(fault, restarts_done=agent.restarts, max_restarts=sup.max_restarts,
                        backoff_base=sup.restart_backoff, backoff_cap=sup.restart_backoff_max,
                        hang_action=agent.cfg.hang.hang_action,
                        repeats=self.failures.record(time.monotonic()))
        # the generation it leads to: a local restart counts up (events and status say so);
        # its origin (LOCAL) makes the agent exit with the trainer's status (lifecycle.py)
        return dataclasses.replace(action,
                                   generation=agent.lifecycle.next_generation(action.kind))
