"""One worker's lifecycle, without I/O: the sole owner of its rank, generation, restart
count, trainer state (whether its trainer runs, how the last one exited), stop request
and who decided what ended each attempt.

Events in (the worker's supervision and its decider tell it what happened), steps out (a
:class:`Step` per state change, which the worker writes to the events file and hands to
its observers). Nothing else keeps a copy of these facts: the worker, its decider and the
node's group read them here, and change them only through these events, so a generation
moves up in one place and a restart is counted once. Time comes from an injected clock,
as in link_protocol.py; tests drive it with numbers.

The states and their order are :class:`~ftagent.model.TrainerState`'s (its docstring
draws them). The events, in the order one attempt sees them::

    waiting()                      before every attempt: WAITING (barrier or backoff done)
    reached(generation)            the barrier released, or the arbiter named a higher
                                   generation while waiting: never down (and its
                                   restart count, if it named one)
    running(pid)                   a trainer of this generation runs: RUNNING
    exited(exit)                   its main process exited (the exit is kept: the last
                                   one's status, until the next trainer's exit)
    decided(action)                an action ended (or touched) the attempt; its origin
                                   says who decided (the arbiter, or the local policy)
    restart(action)                RESTARTING: into max(g + 1, the action's); one
                                   restart more, or the arbiter's count it carries

The restart count is the job's as this worker knows it, and the only one the agent
keeps: the link to the arbiter reads it for its Hello (link_protocol.py), the trainer
gets it (FTAGENT_RESTART_COUNT, torchrun's TORCHELASTIC_RESTART_COUNT). A restart the
local policy decides counts one; an arbiter's RESTART carries the job's count, which is
adopted (never down): a rejoin into a generation the job restarted into already is no
new restart, so an agent never counts one restart twice, across any arbiter restart.
    succeeded() / stopped(...)     the trainer's own exit 0 / a stop signal to the agent
    failed(action, exit, ...)      FAILED: the exit status the agent leaves with

and, at any time::

    want(action)                   the desired state: the newest decision delivered (the
                                   arbiter's latest command, or the local policy's:
                                   RESTART gen N, STOP, REPLACE) replaces the one before;
                                   a minor request (DUMP_STACKS, LAST_WORDS, BUSY,
                                   ALERT_ONLY) is kept in order until carried out
    release(generation)            the arbiter released the barrier of ``generation``
    assign(rank, generation, restarts)  a warm spare takes a replaced rank (the arbiter's
                                   ASSIGN, read by the link's core): no longer a spare
    make_spare()                   the arbiter said SPARE: a former spare holds this rank
    stop(signal)                   a stop signal to the agent (the first one counts)

Desired against observed (the reconciler's one comparison, ``due``): the worker is woken
by ``on_change`` (an injected callback: the worker sets an asyncio event; the link's read
loop moves the desired state through ``want`` and ``release`` in the same loop) and asks
``due()`` what to carry out -- a request not carried out yet, else the desired decision
unless it is moot (carried out already by id, or a RESTART into a generation reached).
Carrying one out is ``decided`` (or ``restart``/``failed``): after that the comparison
finds nothing to do, so a decision delivered twice, by the arbiter's resend or the local
group's, is carried out once, with no queue to de-duplicate.

The rank is here, not in the configuration's identity (that is the rank the agent was
started with): the link's Hello, the events file, the trainer's RANK, the metrics' rank
label, the peer-wait check and the persisted snapshots all read ``rank`` when they use
it, so a spare that takes over rank 3 is rank 3 to every part at once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftagent.model import (
    IN_PLACE_EXITS,
    MINOR_ACTIONS,
    Action,
    ActionKind,
    Origin,
    ProcessExit,
    TrainerState,
)

CARRIED_KEPT = 64  # ids of the last actions carried out, against a second delivery
REQUESTS_KEPT = 64  # minor requests waiting to be carried out (oldest dropped first)


@dataclass(frozen=True)
class Step:
    """One state change for the edges to carry out (the events file, the observers)."""

    state: TrainerState
    generation: int
    restarts: int
    at: float  # the lifecycle's clock at the change
    fields: dict[str, Any] = field(default_factory=dict)


class Lifecycle:
    """The facts of one worker's attempts (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, rank: int = 0,
                 spare: bool = False, on_change: Callable[[], None] | None = None) -> None:
        """``on_change``: called when the desired state moves (a decision or request
        wanted, a barrier released, a rank assigned, a stop): the worker's wake-up."""
        self.clock = clock
        self.on_change: Callable[[], None] = on_change if on_change is not None \
            else _nothing
        self.rank = rank  # this worker's rank in the job (-1 for a spare before ASSIGN)
        self.spare = spare  # a warm spare: no rank (and no trainer) until assigned one
        self.stop_signal: int | None = None  # the stop signal the agent was sent, if any
        self.state = TrainerState.INIT
        self.trainer_pid: int | None = None  # the trainer that runs (``running``), if one does
        self.trainer_exit: ProcessExit | None = None  # the last trainer's exit (``exited``)
        self.generation = 0  # of the trainer that runs, or of the barrier it waits at
        self.restarts = 0  # the job's restarts as this worker knows them (docstring)
        self.decided_by: Origin | None = None  # who decided the last action carried out
        self.last_action: Action | None = None
        self.since = clock()  # when the current state began
        self._carried: deque[str] = deque(maxlen=CARRIED_KEPT)
        # the desired state (module docstring): the newest decision, the minor requests
        # not carried out yet, the highest generation whose barrier was released
        self.desired: Action | None = None
        self.requests: deque[Action] = deque(maxlen=REQUESTS_KEPT)
        self.released = -1

    @property
    def attempt(self) -> tuple[int, int]:
        """Which attempt this is: a decision watched for one attempt is moot in the next."""
        return self.generation, self.restarts

    def next_generation(self, kind: ActionKind) -> int:
        """The generation a decision of ``kind`` taken now leads to: a restart counts up."""
        return self.generation + 1 if kind is ActionKind.RESTART else self.generation

    # ------------------------------------------------------------------ desired state

    def want(self, action: Action) -> None:
        """A decision (or a minor request) delivered: the newest decision is the desired
        one (it replaces any before it); requests are kept in order."""
        if action.kind in MINOR_ACTIONS:
            self.requests.append(action)
        else:
            self.desired = action
        self.on_change()

    def release(self, generation: int) -> None:
        """The arbiter released the barrier of ``generation`` (never down)."""
        if generation > self.released:
            self.released = generation
            self.on_change()

    def due(self) -> Action | None:
        """The comparison of desired with observed: what to carry out now -- the oldest
        request not carried out, else the desired decision unless it is moot -- or None.
        Carrying it out (``decided``, ``restart``, ``failed``) or ``dismiss`` makes the
        next comparison find the next thing, or nothing."""
        while self.requests:
            if not self.carried_out(self.requests[0].id):
                return self.requests[0]
            self.requests.popleft()
        d = self.desired
        if d is not None and self.moot(d):
            self.desired = d = None
        return d

    def decisive(self) -> Action | None:
        """The desired decision if it still means something (``due`` without the
        requests): a STOP, REPLACE or RESTART that arrived while waiting (a barrier)."""
        d = self.desired
        if d is not None and self.moot(d):
            self.desired = d = None
        return d

    def dismiss(self, action: Action) -> None:
        """``action`` is not carried out (superseded: the trainer exited by itself after a
        hang it answered; or taken in at a barrier, ``reached``): the comparison no longer
        finds it. Not marked carried out: wanted again (the local group's standing
        decision, for this worker's crash), it is due again."""
        if self.desired is action:
            self.desired = None
        elif action in self.requests:
            self.requests.remove(action)

    # ------------------------------------------------------------------ events

    def waiting(self) -> Step:
        """Before an attempt: at the barrier (or about to start, with no barrier)."""
        return self._to(TrainerState.WAITING, attempt=self.restarts)

    def reached(self, generation: int, restarts: int | None = None) -> None:
        """The barrier of ``generation`` released this worker, or the arbiter named a
        later generation while it waited (``restarts``: the job's count its RESTART
        carried): the worker is there. Never moves down."""
        self.generation = max(self.generation, generation)
        if restarts is not None:
            self.restarts = max(self.restarts, restarts)

    def assign(self, rank: int, generation: int, restarts: int | None = None) -> None:
        """This spare takes ``rank`` and joins at ``generation`` (with the job's restart
        count, if the arbiter named one): every part reads the new rank from here."""
        self.rank = rank
        self.spare = False
        self.reached(generation, restarts)
        self.on_change()

    def make_spare(self) -> None:
        """The arbiter said SPARE: this agent serves as a spare before any trainer."""
        self.spare = True
        self.on_change()

    def stop(self, sig: int) -> bool:
        """A stop signal to the agent; True the first time (a second one only hurries)."""
        if self.stop_signal is not None:
            return False
        self.stop_signal = sig
        self.on_change()
        return True

    @property
    def stop_requested(self) -> bool:
        return self.stop_signal is not None

    def running(self, pid: int) -> Step:
        """A trainer runs. The requests made before it (a DUMP_STACKS, a BUSY verdict of
        the previous attempt, come while waiting at a barrier) are not its: dropped."""
        self.requests.clear()
        self.trainer_pid = pid
        return self._to(TrainerState.RUNNING, pid=pid, attempt=self.restarts)

    def exited(self, exit_: ProcessExit) -> None:
        """The trainer's main process exited: none runs until the next ``running``. Not
        a state change: the attempt is RUNNING until what the exit leads to is decided
        (a restart, the end); the exit itself is a fact read here (the metrics' running
        trainer and last exit status, a crash's detection latency)."""
        self.trainer_pid = None
        self.trainer_exit = exit_

    @property
    def trainer_running(self) -> bool:
        """A trainer was started and its exit is not heard yet."""
        return self.trainer_pid is not None

    @property
    def trainer_ended(self) -> bool:
        """A trainer ran and exited, and none has started since: output read now is its
        last lines (its pipe drained after the exit), which the link sends at once."""
        return self.trainer_exit is not None and self.trainer_pid is None

    @property
    def restart_wanted(self) -> bool:
        """The arbiter's RESTART into a later generation is the desired decision, not
        carried out yet: the trainer that runs (if one does) is to be stopped for it."""
        d = self.desired
        return d is not None and d.kind is ActionKind.RESTART and \
            d.origin is Origin.ARBITER and not self.moot(d)

    @property
    def runs_generation(self) -> bool:
        """A trainer of ``generation`` runs and the arbiter has not moved this rank past
        it (``restart_wanted``): what the link's Hello says as ``trainer_running`` (the
        arbiter's reconcile counts such a rank as running the generation it names; one
        told to restart, as on its way), and what keeps the link from taking a SPARE
        command (a spare runs no trainer). Derived, not kept: no flag to go stale."""
        return self.trainer_pid is not None and not self.restart_wanted

    def decided(self, action: Action) -> None:
        """``action`` is carried out on this attempt (any kind, minor ones included)."""
        self.last_action = action
        self.decided_by = action.origin
        if action.id not in self._carried:
            self._carried.append(action.id)
        if self.desired is not None and self.desired.id == action.id:
            self.desired = None  # carried out: moot from now on, so no longer desired

    def carried_out(self, action_id: str) -> bool:
        """True if the action with this id was carried out already: one decision is
        carried out once, however often it is delivered (the node's group delivers its
        standing decision again to a worker that dropped it, decider.LocalDecider)."""
        return action_id in self._carried

    def moot(self, action: Action) -> bool:
        """True if ``action`` needs no carrying out: carried out already (by id), or an
        arbiter's RESTART into a generation this worker has reached (a repeated or
        stale rejoin must never kill a trainer of the job's generation). The one place
        a restart is deduplicated: the link delivers what it has not seen, this says
        whether it still means anything."""
        return self.carried_out(action.id) or (
            action.kind is ActionKind.RESTART and action.origin is Origin.ARBITER
            and action.generation <= self.generation)

    def restart(self, action: Action) -> Step:
        """A RESTART carried out, into the next generation or the one the arbiter named
        if that is higher: one restart more, or the job's count the arbiter's carries."""
        self.decided(action)
        self.restarts = self.restarts + 1 if action.restarts is None \
            else max(self.restarts, action.restarts)
        self.generation = max(self.generation + 1, action.generation)
        return self._to(TrainerState.RESTARTING, reason=action.reason,
                        backoff_seconds=action.backoff_seconds)

    def succeeded(self) -> Step:
        return self._to(TrainerState.SUCCEEDED, exit_status=0)

    def stopped(self, exit_status: int, signal: int | None) -> Step:
        """The agent was told to stop (a signal): the trainer's status is the agent's."""
        return self._to(TrainerState.STOPPED, exit_status=exit_status, signal=signal)

    def failed(self, action: Action, exit_: ProcessExit | None, *, exit_replace: int,
               exit_stop: int) -> tuple[int, Step]:
        """The worker ends on ``action`` (STOP, REPLACE, a budget spent): the status it
        exits with, and the FAILED step. REPLACE exits ``exit_replace``; the arbiter's
        STOP ``exit_stop`` (unless it is -1); what the local policy decided alone exits
        with the trainer's status, as without ftagent."""
        self.decided(action)
        code = exit_status_of(action, exit_, exit_replace=exit_replace, exit_stop=exit_stop)
        return code, self._to(TrainerState.FAILED, reason=action.reason, exit_status=code)

    def _to(self, state: TrainerState, **fields: Any) -> Step:
        self.state = state
        self.since = self.clock()
        return Step(state, self.generation, self.restarts, self.since, fields)


def _nothing() -> None:
    pass


def exit_status_of(action: Action, exit_: ProcessExit | None, *, exit_replace: int,
                   exit_stop: int) -> int:
    """The agent's exit status when ``action`` ends it (:meth:`Lifecycle.failed`)."""
    if action.kind == ActionKind.REPLACE:
        # a pod-level tier of the ladder: the kubelet's restart rule for this code restarts
        # the container (or the pod) in place; any other REPLACE moves the pod
        return action.exit_code if action.exit_code in IN_PLACE_EXITS else exit_replace
    if action.kind == ActionKind.STOP and action.origin is Origin.ARBITER and exit_stop > 0:
        return exit_stop
    if action.exit_code is not None:
        return action.exit_code
    return exit_.exit_status if exit_ is not None else 1
