"""The watch loop: sources -> pure detectors -> sinks, on the process's one asyncio loop.

One loop for the pod agent (``ftagent run``: the host's GPUs and NICs beside the
trainer), the node agent (``ftagent node``) and ``make gpu-check``: it starts every
source of its parts (``async run(emit)``; blocking libraries -- NVML, the vendor tools,
the kernel log -- run in their own threads inside the source and hand their results to
the loop), hands each observation to the observers that read its type (an observer's
``observes``; one that says nothing reads every one) and then to every detector, and each
fault a detector returns to the fault sink. Detectors are ticked on the process's grid
(timegrid.py: one wake-up shared with the other periodic work), and a detector with a
``next_deadline()`` (a link's grace) is ticked exactly when it expires.

A detector may say when it next has something to do instead (``next_tick(now)``: the
earliest time its ``tick`` can act, None for "not before an observation or a wake"; the
pod agent's hang watch does): it is ticked only then, and ``due`` holds the earliest such
time, so the owner's ticker sleeps until it (or until ``refresh`` after a wake) rather
than on the grid. One that keeps that time as a fact names its keeper in ``timing`` (an
object whose ``next_due`` it updates after each observation, tick and wake: the hang
verifier): the loop reads the field instead of asking. A detector whose tick never does
anything says ``ticks = False`` and is never ticked. ``polled``: some detector has
neither, the owner still ticks the grid.

Nothing here knows what a part watches: the parts come from the registry
(``watch/registry.py``), the sinks from the command that wires the process. A source
that fails is one error line (and ``on_error``); the others go on -- the agent never
takes training down for its own watch.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client.registry import Collector

from ftagent.model import Fault, Observation
from ftagent.timegrid import sleep_on_grid

log = logging.getLogger("ftagent.watch")

TICK_SECONDS = 0.5  # the pod agent's tick: detectors without a deadline of their own

FaultSink = Callable[[Fault], "Awaitable[None] | None"]


class Source(Protocol):
    async def run(self, emit: Callable[[Observation], None]) -> None: ...


class Detector(Protocol):
    def observe(self, obs: Observation) -> list[Fault]: ...
    def tick(self, now: float) -> list[Fault]: ...


class Part(Protocol):
    """What a registered factory returns: the sources of one area (GPUs, links), the pure
    detectors that judge them, and the Prometheus collector that exports them."""

    name: str

    def sources(self) -> Sequence[Source]: ...
    def detectors(self) -> Sequence[Detector]: ...
    def collector(self, labels: Mapping[str, str]) -> Collector | None: ...


class WatchLoop:
    """Runs ``parts``' sources and detectors; faults go to ``on_fault`` (a function, or a
    coroutine function whose coroutines run as tasks the loop keeps until done).

    ``observers`` see every observation before the detectors do (gpu-check prints them).
    ``tick_seconds`` None: the owner calls ``tick(now)`` itself (the node agent, on its
    own tick). ``clock`` is the detectors' "now" (monotonic, as the sources' ``ts``).
    ``wake``: the owner's ticker's event, set when an observation moved ``due`` earlier.
    """

    def __init__(self, parts: Iterable[Part], on_fault: FaultSink, *,
                 observers: Sequence[Callable[[Observation], None]] = (),
                 on_error: Callable[[str, BaseException], object] | None = None,
                 tick_seconds: float | None = TICK_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 wake: asyncio.Event | None = None) -> None:
        self.parts = list(parts)
        self.on_fault = on_fault
        self.observers = list(observers)
        # per observation type, the observers that take it (``_route``): one fan-out to
        # those, not a call to every observer for every observation
        self._routed_from: list[Callable[[Observation], None]] = []
        self._routes: dict[type, tuple[Callable[[Observation], None], ...]] = {}
        self.on_error = on_error
        self.tick_seconds = tick_seconds
        self.clock = clock
        self.detectors: list[Detector] = [d for p in self.parts for d in p.detectors()]
        self.faults = 0  # raised so far (tests, status)
        self._inflight: set[asyncio.Future[Any]] = set()
        self._armed: set[tuple[int, float]] = set()  # (id(detector), deadline) timers
        # deadline-driven detectors (``next_tick``): each one's next due time; the others
        # are ticked on every tick (``polled``), those with ``ticks = False`` never
        self._quiet = {id(d) for d in self.detectors if getattr(d, "ticks", True) is False}
        self._timed: dict[int, Callable[[float], float | None]] = {
            id(d): nt for d in self.detectors
            if (nt := getattr(d, "next_tick", None)) and id(d) not in self._quiet}
        # those that keep their next due time as a fact: the keeper (``timing``, with a
        # ``next_due`` it updates after each observation, tick and wake), read, not asked
        self._kept: dict[int, Any] = {
            id(d): t for d in self.detectors
            if id(d) in self._timed and (t := getattr(d, "timing", None)) is not None}
        self._dues: dict[int, float] = dict.fromkeys(self._timed, -math.inf)  # tick first
        self.polled = any(id(d) not in self._timed and id(d) not in self._quiet
                          for d in self.detectors)
        self.due = -math.inf if self._timed else math.inf  # the earliest of ``_dues``
        self.wake = wake

    # ------------------------------------------------------------------ flow

    def emit(self, obs: Observation) -> None:
        """One observation from a source: its observers, then every detector."""
        if self._routed_from != self.observers:  # an observer added since: route again
            self._routed_from, self._routes = list(self.observers), {}
        route = self._routes.get(type(obs))
        if route is None:
            route = self._routes[type(obs)] = _route(self.observers, obs)
        for o in route:
            try:
                o(obs)
            except Exception:
                log.exception("observer %r failed", o)
        for d in self.detectors:
            try:
                faults = d.observe(obs)
            except Exception:
                log.exception("detector %s failed on %s", type(d).__name__, type(obs).__name__)
                continue
            self._raise(faults)
        self._arm_deadlines()
        if self._timed:
            before = self.due
            self.refresh(self.clock())
            if self.due < before and self.wake is not None:
                self.wake.set()  # the owner's ticker sleeps until the old due time

    def tick(self, now: float) -> None:
        """The detectors' ticks (a link down past its grace): every polled one, and each
        deadline-driven one whose due time came (then asked for its next)."""
        timed, dues = self._timed, self._dues
        for d in self.detectors:
            key = id(d)
            if key in self._quiet or dues.get(key, -math.inf) > now:
                continue
            try:
                faults = d.tick(now)
            except Exception:
                log.exception("detector %s failed", type(d).__name__)
                continue
            self._raise(faults)
            if key in timed:
                self._schedule(key, now)
        if timed:
            self.due = min(dues.values(), default=math.inf)

    def refresh(self, now: float) -> None:
        """Ask every deadline-driven detector for its next due time again (after an
        observation, or a wake: a verdict came, a budget was deferred)."""
        for key in self._timed:
            self._schedule(key, now)
        self.due = min(self._dues.values(), default=math.inf)

    def _schedule(self, key: int, now: float) -> None:
        kept = self._kept.get(key)
        if kept is not None:
            at = kept.next_due  # kept current by its owner: read in place
        else:
            try:
                at = self._timed[key](now)
            except Exception:  # a broken one is ticked every time, as before
                log.exception("detector's next tick failed")
                at = now
        self._dues[key] = math.inf if at is None else at

    def _raise(self, faults: list[Fault]) -> None:
        for f in faults:
            self.faults += 1
            try:
                pending = self.on_fault(f)
            except Exception:
                log.exception("fault sink failed on %s", f.message)
                continue
            if inspect.isawaitable(pending):
                task = asyncio.ensure_future(pending)
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)

    def _arm_deadlines(self) -> None:
        """Tick a detector exactly when its next deadline (a NIC grace) expires, instead of
        at the next periodic tick, up to a tick later."""
        loop: asyncio.AbstractEventLoop | None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven by hand (tests): the caller ticks
            return
        for d in self.detectors:
            next_deadline = getattr(d, "next_deadline", None)
            when = next_deadline() if next_deadline is not None else None
            if when is not None and (id(d), when) not in self._armed:
                self._armed.add((id(d), when))
                # +1 ms: a timer may fire a hair early, and the detector wants now > deadline
                loop.call_later(max(0.0, when - self.clock()) + 0.001, self._tick_at, d, when)

    def _tick_at(self, d: Detector, when: float) -> None:
        self._armed.discard((id(d), when))
        try:
            faults = d.tick(self.clock())
        except Exception:
            log.exception("detector %s failed", type(d).__name__)
            return
        self._raise(faults)

    # ------------------------------------------------------------------ run

    async def run(self, emit: Callable[[Observation], None] | None = None) -> None:
        """Every source and the ticker, until cancelled. ``emit``: one more observer (the
        pod agent runs the loop as one of its sources and hands its own ``observe``)."""
        if emit is not None and emit not in self.observers:
            self.observers.append(emit)
        tasks = [asyncio.create_task(self._guard(src)) for p in self.parts for src in p.sources()]
        period = self.tick_seconds
        try:
            if period is None:  # the owner ticks: wait to be cancelled
                await asyncio.gather(*tasks)
                await asyncio.Event().wait()
            else:
                while True:
                    await sleep_on_grid(period)
                    self.tick(self.clock())
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _guard(self, src: Source) -> None:
        """Run one source; its failure is one error line, the rest go on."""
        name = type(src).__name__
        try:
            await src.run(self.emit)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a source's setup failure (no netlink, ...)
            log.error("source %s stopped: %s; carrying on without it", name, e, exc_info=True)
            if self.on_error is not None:
                try:
                    self.on_error(name, e)
                except Exception:
                    log.exception("source error hook failed")


def _route(observers: Sequence[Callable[[Observation], None]],
           obs: Observation) -> tuple[Callable[[Observation], None], ...]:
    """The observers that take an observation of ``obs``'s type: an observer (or the
    object whose bound ``observe`` it is) says which types it reads in ``observes``
    (a tuple of types); one that says nothing takes every observation."""
    out = []
    for o in observers:
        wants = getattr(getattr(o, "__self__", o), "observes", None)
        if wants is None or isinstance(obs, wants):
            out.append(o)
    return tuple(out)
