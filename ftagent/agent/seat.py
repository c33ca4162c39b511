"""The deciders' port: what a decider (decider.py, arbiter_decider.py) may use of a worker.

A worker takes a seat at the pod's decider when it is built; from then on the decider
sees it only as a :class:`Seat`, five members and nothing else: the facts and the desired
state (the worker's lifecycle: rank, generation, restart count, trainer state, the stop
request, the events that move them; a decision is delivered by moving the desired state,
``Lifecycle.want``, and the worker compares it with what it observes, ``Lifecycle.due``),
its configuration, the wait for a change of the desired state, the wait for a stop, and
the events file. There is no queue of actions between a decider and the worker.
Deciders never import worker.py (the layer test reads type-checking imports too), so
the worker and its deciders can change apart, and the protocol simulation (tests/sim/)
seats its own worker at the shipped deciders through the same five members.

A rank's hooks into the arbiter session (:class:`RankHooks`) are values the worker's
parts build (cmd/run.py, the flight recorder, the warm standby) and hand to the decider
with the seat (``Decider.add(seat, hooks)``): nothing sets them afterwards.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ftagent.agent.lifecycle import Lifecycle
    from ftagent.config import RunConfig
    from ftagent.model import Action, Fault


class Seat(Protocol):
    """A worker as its decider sees it (module docstring): five members."""

    @property
    def lifecycle(self) -> Lifecycle:
        """The facts and their events (lifecycle.py): the one owner, read here."""

    @property
    def cfg(self) -> RunConfig:
        """The worker's configuration (as it was started: the rank is the lifecycle's)."""

    async def changed(self, timeout: float | None = None) -> None:
        """Return once the lifecycle's desired state moved (a decision wanted, a barrier
        released, a rank assigned, a stop), or after ``timeout`` seconds."""

    async def stopping(self) -> None:
        """Return once the agent was told to stop (``lifecycle.stop_requested``)."""

    def write(self, event: str, kind: str, message: str, **fields: Any) -> Any:
        """One line of the worker's events file (the rank it names is the lifecycle's)."""


def no_hang_state() -> tuple[float, bool]:
    return 0.0, False


@dataclass(frozen=True)
class RankHooks:
    """What a rank's arbiter session calls back, given at construction.

    ``hang_state``: seconds since progress and whether hung (the progress summaries);
    ``stacks``: the DUMP_STACKS answer for this rank's tree (None: the session's plain
    stack capture); ``on_busy``: the arbiter's "job busy, no restart" verdict
    (agent/peer_wait.py); ``prepare_spare``: --spare's warm standby, started at once."""

    hang_state: Callable[[], tuple[float, bool]] = no_hang_state
    stacks: Callable[[], Awaitable[dict[str, Any]]] | None = None
    on_busy: Callable[[Action], None] | None = None
    prepare_spare: Callable[[], None] | None = None
    # LAST_WORDS: persist the newest complete snapshot now (cmd/run.py, --checkpoint-dir)
    on_last_words: Callable[[], Awaitable[None]] | None = None
    # a spare ASSIGNed a rank: the before-barrier parts (preflight) once more; the fault
    # one found, already raised (the worker's), or None
    preflight: Callable[[], Awaitable[Fault | None]] | None = None
    # the port of the pod's replica holder (checkpoint/replica_agent.py), said in the
    # rank's Hello so that the arbiter places replicas in a ring by node; 0: none
    replica_port: int = 0
