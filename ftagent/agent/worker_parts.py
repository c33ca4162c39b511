"""What a worker is made of beyond its spec: a :class:`WorkerParts` value.

The composition root (cmd/run.py) chooses a worker's sources, detectors, sinks, evidence,
trainer environment and spawn (cold, or through a warm standby; the flight recorder's
per-attempt directory around it), and hands them to the :class:`~ftagent.agent.worker.Worker`
constructor as one value. The worker copies them in once: nothing is set on it after it is
built (tests/unit/test_worker_seams.py), so what a worker does is what its spec and parts
say, read in one place.

Parts are added by value: each wiring step (standby.py ``warm_restart_parts``,
flight_recorder.py ``flight_recorder_parts``, the progress and watch wiring of cmd/run.py)
takes the parts so far and returns them with its own added (:meth:`WorkerParts.plus`) or a
seam wrapped (:meth:`WorkerParts.with_`), in the order the root calls them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ftagent.agent.seat import RankHooks
from ftagent.agent.supervisor import TrainerProcess
from ftagent.model import Fault, Observation
from ftagent.watch.loop import Detector, Source  # one definition of a source and a detector


class Observer(Protocol):
    """Hears the worker's observations. Optional, as class attributes: ``observes``, the
    observation types it reads (the watch loop hands it only those: watch/loop.py
    ``_route``; none said: every one), and ``on_state(state, restarts)`` with ``states``,
    the lifecycle steps it acts on (``Worker._apply``; none said: every one)."""

    def observe(self, obs: Observation) -> None: ...


# (stream, blob of complete lines joined by b"\n", monotonic time of the read)
LineHandler = Callable[[str, bytes, float], None]
# a hang fault and its trainer's pids (listed when a capture needs them: a verified hang
# carries its window's last sample) -> the fault with its evidence (stacks, dumps)
Evidence = Callable[[Fault, Callable[[], Sequence[int]]], Awaitable[Fault]]
# TrainerProcess's signature: (command, env, reaper, on_lines, *, stdout_fd, ...)
Spawn = Callable[..., TrainerProcess]
Close = Callable[[], Awaitable[None]]
# the next attempt's environment -> awaited before its trainer is started (the barrier
# already released): standby.py's wait for the rendezvous store (store_wait.py)
BeforeStart = Callable[[Mapping[str, str]], Awaitable[None]]
# the worker -> awaited before it arrives at the barrier of the generation it is about to
# start: a fault (a failed preflight, agent/preflight.py) is raised before the barrier
# releases, so the decider answers it first; None: go on
BeforeBarrier = Callable[[Any], Awaitable["Fault | None"]]


@dataclass(frozen=True)
class WorkerParts:
    """A worker's parts (a value; the worker copies them in when it is built).

    ``sources`` (``async run(emit)``), ``detectors`` (``observe(obs) -> faults``,
    ``tick(now) -> faults``), ``observers`` (``observe(obs)``, e.g. the metrics sink; an
    observer with ``on_state(state, restarts)`` also hears the lifecycle's steps),
    ``line_handlers`` (the trainer's output, on the loop), ``fault_hooks`` (every fault
    raised: metrics), ``evidence`` (the async enrichment of a hang fault), ``env`` (on top
    of the spec's environment for every attempt), ``spawn`` (the one place a trainer is
    started: the seam warm standbys replace), ``before_start`` (awaited with the next
    attempt's environment just before its trainer starts), ``before_barrier`` (awaited
    with the worker before it arrives at the barrier: preflight) and ``on_close`` (awaited when
    the worker's supervision ends, however it ends: the standbys' close); ``hooks``: what
    the rank's arbiter session calls back (seat.py ``RankHooks``), handed to the decider
    with the worker's seat."""

    sources: tuple[Source, ...] = ()
    detectors: tuple[Detector, ...] = ()
    observers: tuple[Observer, ...] = ()
    line_handlers: tuple[LineHandler, ...] = ()
    fault_hooks: tuple[Callable[[Fault], None], ...] = ()
    evidence: Evidence | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    spawn: Spawn = TrainerProcess
    on_close: tuple[Close, ...] = ()
    before_start: tuple[BeforeStart, ...] = ()
    before_barrier: tuple[BeforeBarrier, ...] = ()
    hooks: RankHooks = field(default_factory=RankHooks)

    def plus(self, *, sources: Sequence[Source] = (), detectors: Sequence[Detector] = (),
             observers: Sequence[Observer] = (), line_handlers: Sequence[LineHandler] = (),
             fault_hooks: Sequence[Callable[[Fault], None]] = (),
             env: Mapping[str, str] | None = None,
             on_close: Sequence[Close] = (),
             before_start: Sequence[BeforeStart] = (),
             before_barrier: Sequence[BeforeBarrier] = ()) -> WorkerParts:
        """These parts with more added after the ones already there (order is kept:
        observers and detectors run in the order they were added)."""
        return dataclasses.replace(
            self, sources=(*self.sources, *sources), detectors=(*self.detectors, *detectors),
            observers=(*self.observers, *observers),
            line_handlers=(*self.line_handlers, *line_handlers),
            fault_hooks=(*self.fault_hooks, *fault_hooks),
            env={**self.env, **(env or {})}, on_close=(*self.on_close, *on_close),
            before_start=(*self.before_start, *before_start),
            before_barrier=(*self.before_barrier, *before_barrier))

    def with_(self, *, spawn: Spawn | None = None, evidence: Evidence | None = None,
              **hooks: Any) -> WorkerParts:
        """These parts with a seam replaced (``spawn``, ``evidence``, or one of the rank's
        ``hooks`` by name): the caller wraps the one there (``parts.spawn``,
        ``parts.hooks.stacks``), never loses it."""
        return dataclasses.replace(self, spawn=spawn or self.spawn,
                                   evidence=evidence or self.evidence,
                                   hooks=dataclasses.replace(self.hooks, **hooks))


@dataclass  # not frozen: the Part protocol's name is a plain attribute
class TrainerWatch:
    """A worker's own sources and detectors as one part of the watch loop (watch/loop.py
    ``Part``): the worker runs them through the same loop as the node's GPUs and links."""

    name: str
    own_sources: tuple[Source, ...]
    own_detectors: tuple[Detector, ...]

    def sources(self) -> Sequence[Source]:
        return self.own_sources

    def detectors(self) -> Sequence[Detector]:
        return self.own_detectors

    def collector(self, labels: Mapping[str, str]) -> None:
        """Its series are the worker's metrics (metrics.py), not a collector of its own."""
        return None
