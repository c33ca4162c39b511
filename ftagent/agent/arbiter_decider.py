"""The decider when an arbiter decides for the job (``ftagent run --arbiter HOST:PORT``).

What changes against the local policy (decider.LocalDecider), and only this:

* **Barrier**: before every (re)start the agent arrives at the job barrier of its
  generation once its previous trainer has fully exited, and starts only when the arbiter
  releases it, so every rank starts together and no new trainer meets the previous
  attempt's rendezvous store.
* **Decisions**: faults go to the arbiter, whose commands (RESTART, STOP, REPLACE,
  DUMP_STACKS) become the agent's actions. The restart budget is the job's.
* **Fail open**: if the arbiter is unreachable — at start, during a barrier, or while a
  decision is awaited — for ``--arbiter-fail-open-after`` seconds, the agent goes on
  alone: it starts the trainer, and its local policy decides about faults. A fault raised
  while the arbiter is briefly away waits for it (it is usually back within seconds, and
  a decision taken alone splits the job's generations); it is decided locally only once
  the link has been down that long. Faults stay kept in the link and reach the arbiter
  (or its successor) when it is back, until settled. A trainer started without the
  barrier says so in the agent's Hello, and the arbiter reconciles (barrier.reconcile).
  Alone is the node's local group with ``--nproc-per-node N``: a decision taken alone
  stops and restarts every local worker together, and a start without the arbiter waits
  at the group's barrier for every local worker's previous trainer to be gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ftagent.agent.decider import LocalDecider
from ftagent.agent.evidence import capture
from ftagent.agent.reporter import ArbiterLink
from ftagent.model import (
    Action,
    ActionKind,
    CollectiveSample,
    Fault,
    FaultKind,
    Observation,
    PhaseMarker,
    PhaseTiming,
    ProcessExit,
    Progress,
    Resumed,
    Severity,
    TrainerState,
)
from ftagent.wire.convert import stacks_json

if TYPE_CHECKING:
    from ftagent.agent.worker import Worker

log = logging.getLogger("ftagent.arbiter_decider")

POLL = 0.25
EXIT_FLUSH = 2.0  # seconds for the trainer's exit to reach a connected arbiter


class ArbiterDecider:
    """The arbiter link as the agent's decider; ``local`` decides when failing open."""

    def __init__(self, agent: Worker, local: LocalDecider | None = None) -> None:
        cfg = agent.cfg
        self.agent = agent
        self.local = local if local is not None else LocalDecider(agent)
        self.link = ArbiterLink(cfg.arbiter, cfg.identity,
                                max_restarts=cfg.supervisor.max_restarts or None)
        self.hang_state: Callable[[], tuple[float, bool]] = lambda: (0.0, False)
        # DUMP_STACKS: stacks of the tree (cmd/run.py adds the liveness verdict, agent/verify.py)
        self.stack_capture: Callable[[Sequence[int]], Awaitable[dict[str, Any]]] = \
            lambda pids: capture(pids, cfg.hang.hang_dump_timeout)
        # BUSY: the arbiter's "job busy, no restart" verdict (cmd/run.py: agent/peer_wait.py)
        self.on_busy: Callable[[Action], None] | None = None
        self.fail_open_after = cfg.arbiter.arbiter_fail_open_after
        self.released_start = False  # the current trainer was started by the barrier
        self._undecided: Fault | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        agent.observers.append(_LinkObserver(self))

    def start(self) -> None:
        self.link.starting()  # the fail-open clock starts now, before the first barrier
        self._tasks = [asyncio.create_task(self.link.run()),
                       asyncio.create_task(self._forward_commands())]

    async def close(self) -> None:
        """Tell the arbiter how this rank ended (a moment's flush), then close the link.

        A link that is down at the end (an arbiter restarting or failing over) is given
        ``--arbiter-fail-open-after`` to come back first (what a fault waits before it is
        decided alone): otherwise a job that finished while its arbiter was away reads
        "gone (was running)", not succeeded."""
        try:
            await self.local.close()
            if self._tasks and self.link.connected:
                await self._flush(EXIT_FLUSH)
            elif self._tasks and self.link.arbiter_id and self.link.pending():
                # it was reached once: it may be back (a restart, a failover)
                log.warning("the arbiter is away at exit: waiting up to %.0fs for it to "
                            "hear how this rank ended", self.fail_open_after)
                await self._flush(self.fail_open_after)
        finally:
            if self._tasks:
                link_task, forward = self._tasks
                forward.cancel()
                await self.link.close()
                link_task.cancel()
                await asyncio.gather(link_task, forward, return_exceptions=True)

    async def _forward_commands(self) -> None:
        while True:
            action = await self.link.commands.get()
            self._undecided = None
            self.agent.deliver(action)

    # ------------------------------------------------------------------ the hooks

    async def before_start(self) -> Action | None:
        """Meet the other ranks at the barrier of this generation (or fail open)."""
        agent = self.agent
        gen = agent.generation
        self.released_start = False
        self.link.arrive(gen)  # kept and re-sent on every stream until released
        self.local.arrived()
        if not await self._online():
            log.warning("no arbiter for %.0fs: starting generation %d without the barrier",
                        self.fail_open_after, gen)
            return await self.local.before_start()
        agent.events.write("state", "barrier", f"waiting at the barrier of generation {gen}",
                           generation=gen)
        t0 = time.monotonic()
        while True:
            if await self.link.wait_released(gen, POLL):
                agent.lifecycle.reached(self.link.released_generation)
                self.released_start = True
                agent.events.write("state", "released",
                                   f"barrier of generation {gen} released",
                                   generation=agent.generation,
                                   barrier_seconds=round(time.monotonic() - t0, 3))
                return None
            if agent.stop_requested:
                return None
            decisive = self._take_decisive()
            if decisive is not None:
                if decisive.kind == ActionKind.RESTART and decisive.generation > gen:
                    agent.lifecycle.reached(decisive.generation)
                    gen = agent.generation
                    self.link.arrive(gen)
                    self.local.arrived()
                    continue
                if decisive.kind in (ActionKind.STOP, ActionKind.REPLACE):
                    agent.record(decisive)
                    return decisive
            if not self._still_online():
                log.warning("arbiter unreachable for %.0fs during the barrier: starting "
                            "generation %d alone", self.fail_open_after, gen)
                return await self.local.before_start()

    def decide(self, fault: Fault) -> None:
        if not self._decide_remotely(fault):
            self._decide_locally(fault)

    def _decide_locally(self, fault: Fault) -> None:
        """The local policy decides (the arbiter away or silent for this rank). A restart
        it decides is one of the job's restarts: the link counts it, and the next Hello
        tells the arbiter (the only other count is the arbiter's, which commands carry)."""
        if self.local.decide_action(fault).kind is ActionKind.RESTART:
            self.link.proto.restarted_locally()

    def _decide_remotely(self, fault: Fault) -> bool:
        """True when the arbiter will answer ``fault`` with a command (or the watchdog
        decides locally after all)."""
        agent = self.agent
        if fault.kind == FaultKind.HANG and agent.cfg.hang.hang_action == "alert":
            # --hang-action alert: the arbiter records a WARNING and decides nothing; the
            # local policy records ALERT_ONLY. (Crashes are still the arbiter's to decide.)
            evidence = {k: v for k, v in fault.evidence.items()
                        if k != "waiting_in_collective"}  # recorded, never probed
            self.link.report_fault(dataclasses.replace(fault, severity=Severity.WARNING,
                                                       evidence=evidence),
                                   generation=agent.generation)
            return False
        self.link.report_fault(fault, generation=agent.generation)
        if fault.evidence.get("recovered"):
            return True  # an all-clear: the arbiter may act on it, locally nothing to do
        if not self._still_online():
            return False  # failing open already: queued for the arbiter, decided here now
        self._undecided = fault
        agent.spawn(self._decision_watchdog(fault, agent.lifecycle.attempt))
        return True

    def report(self, fault: Fault) -> None:
        self.link.report_fault(fault, generation=self.agent.generation)

    async def _decision_watchdog(self, fault: Fault, attempt: tuple[int, int]) -> None:
        """Decide locally after all if the arbiter stays away, or settles a crash without
        a command for this rank (alert only, say): a dead trainer must not wait forever.
        Once the attempt the fault was raised in is over (a decision that arrived with
        the trainer's exit was carried out), there is nothing left to decide."""
        agent = self.agent
        while self._undecided is fault:
            if agent.lifecycle.attempt != attempt:
                self._undecided = None
                return
            if not self._still_online():
                log.warning("arbiter unreachable for %.0fs before deciding about %s; "
                            "deciding locally", self.fail_open_after, fault.kind.value)
                self._undecided = None
                self._decide_locally(fault)
                return
            outcome = self.link.outcome(fault.id)
            if outcome is not None and self.link.commands.empty():
                await asyncio.sleep(0)  # let a command read with the ack be forwarded
                if self._undecided is not fault:
                    return
                self._undecided = None
                log.info("the arbiter settled the %s without a command for this rank (%s)",
                         fault.kind.value, outcome)
                if fault.kind == FaultKind.CRASH:
                    self._decide_locally(fault)  # the trainer is gone: the local policy
                return
            await self.link.wait_settled(POLL)

    async def on_minor_action(self, action: Action) -> None:
        if action.kind == ActionKind.DUMP_STACKS:
            captured = await self.stack_capture(self.agent.tree_pids())
            self.link.report_stacks(action.id, stacks_json(captured))
        elif action.kind == ActionKind.BUSY and self.on_busy is not None:
            try:
                self.on_busy(action)
            except Exception:  # recording a verdict must never take the agent down
                log.exception("applying the arbiter's busy verdict failed")

    async def finished(self) -> Action | None:
        """The trainer succeeded: the worker ends (the arbiter heard of the exit)."""
        return None

    # ------------------------------------------------------------------ helpers

    async def _flush(self, timeout: float) -> None:
        """Give the link a moment to send what is queued (the trainer's exit) before
        closing, reconnecting if it must: the arbiter should hear how this rank ended."""
        deadline = time.monotonic() + timeout
        while self.link.pending() and (left := deadline - time.monotonic()) > 0:
            if self.link.connected:
                await asyncio.sleep(0.02)
            else:
                await self.link.wait_connected(left)

    def _take_decisive(self) -> Action | None:
        """A STOP/REPLACE/RESTART that arrived while waiting at the barrier."""
        queued = self.agent.take_delivered()
        for i, action in enumerate(queued):
            if action.kind in (ActionKind.STOP, ActionKind.REPLACE, ActionKind.RESTART):
                for later in queued[i + 1:]:  # what came after it stays, in order
                    self.agent.deliver(later)
                return action
        return None

    async def _online(self) -> bool:
        """True once connected; False when the link has been down --arbiter-fail-open-after."""
        while not self.link.connected:
            left = self.fail_open_after - self.link.offline_for()
            if left <= 0:
                return False
            await self.link.wait_connected(min(left, POLL))
        return True

    def _still_online(self) -> bool:
        """False once the link has been down for --arbiter-fail-open-after seconds."""
        return self.link.connected or self.link.offline_for() < self.fail_open_after


class _LinkObserver:
    """Tells the arbiter about progress, exits and the trainer's state."""

    def __init__(self, decider: ArbiterDecider) -> None:
        self.decider = decider

    def observe(self, obs: Observation) -> None:
        link = self.decider.link
        if isinstance(obs, Progress):
            since, hung = self.decider.hang_state()
            link.report_progress(obs, seconds_since_progress=since, hung=hung)
        elif isinstance(obs, ProcessExit):
            link.report_exit(obs, self.decider.agent.generation)
        elif isinstance(obs, (CollectiveSample, PhaseTiming)):
            link.observe_timing(obs)  # where the step's time goes: stragglers at the arbiter
        elif isinstance(obs, (Resumed, PhaseMarker)):
            link.observe_trainer(obs)  # the resume step and phase time: the goodput ledger

    def on_state(self, state: TrainerState, restarts: int) -> None:
        # (``restarts`` counts this worker's attempts, rejoins included: not the job's
        # restart count, which the link keeps from the arbiter's commands and local
        # decisions)
        link = self.decider.link
        link.trainer_state = state.value
        if state is TrainerState.RUNNING:
            link.started(self.decider.agent.generation, released=self.decider.released_start)
        else:
            link.proto.trainer_running = False
