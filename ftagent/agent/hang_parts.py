"""The hang parts a verifier needs, built first and handed to its constructor as one value.

Before issue 35 the verifier was built bare and its parts assigned afterwards, each by a
different module: its rank by cmd/run.py, the flight recorder's snapshot by
agent/flight_recorder.py (found by probing the worker's detectors with ``getattr``), the
arbiter's "can I ask?" by cmd/run.py after probing the session with ``hasattr``, the pod's
local peers by ``share_local_liveness`` once every worker existed. A part forgotten was a
silent ``None`` at verification time. Now the wiring builds ``HangParts`` first (the flight
recorder is prepared before the verifier) and ``Verifier(..., parts)`` reads it once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ftagent.agent.proc_wait import Waits

# a local rank's verifier (agent/verify.py ``Verifier``), typed loosely here: verify.py
# imports this module, and the layer test forbids import cycles, type-checking ones too
Verifier = Any


class Ranked(Protocol):
    """What holds this rank (the worker's lifecycle, its one owner): read in place."""

    rank: int


class LocalPeers:
    """Launcher mode: the pod's verifiers, one per local rank. Each verifier joins it when
    it is built; a rank waiting in a collective without an arbiter asks the others who is
    busy (agent/peer_wait.local_busy_peer). Fewer than two: nobody to ask."""

    def __init__(self) -> None:
        self._peers: list[tuple[int, Verifier]] = []

    def add(self, rank: int, verifier: Verifier) -> None:
        self._peers.append((rank, verifier))

    def __call__(self) -> Sequence[tuple[int, Verifier]]:
        return list(self._peers) if len(self._peers) >= 2 else []


@dataclass(frozen=True)
class HangParts:
    """What one worker's verifier is given at construction (none of it assigned later)."""

    # this rank: the verdict's culprit when it hangs itself; the worker's lifecycle (its
    # ``rank`` read in place when asked: a warm spare that takes over rank 3 is rank 3
    # here at once, with no callback through the wiring), a callable, or a fixed rank
    rank: int | Ranked | Callable[[], int] | None = None
    # the flight recorder's snapshot (agent/flight_recorder.FlightRecorder.snapshot),
    # taken once in each verification window
    window_dump: Callable[[], Awaitable[dict[str, Any]]] | None = None
    # True while an arbiter can compare the ranks (its link is connected): a rank waiting
    # in a collective then asks it (row C1) instead of declaring (agent/peer_wait.py)
    ask_arbiter: Callable[[], bool] | None = None
    local_peers: LocalPeers | None = None  # launcher mode without an arbiter
    # what the tree's blocked threads wait on (proc_wait.blocked_threads; None: not read,
    # no "waiting on I/O" verdict)
    waits: Callable[[Sequence[int]], Waits] | None = None
    # the agent's detector ticker (worker.Worker.wake_ticker): told when the verifier's
    # next due time moved outside an observation (a verdict, a deferred budget, a budget
    # that moved under the early samples, a dead-still look's end); None: nobody sleeps
    # on it (tests that tick by hand)
    wake: Callable[[], None] | None = None
