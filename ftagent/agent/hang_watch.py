"""Adapts the pure hang detector to the running agent.

The detector (``detect/hang.py``) only computes; this adapter feeds it, asks it for
faults on the agent's tick and exposes its state as scrape-time gauges. With a
``verifier`` (``agent/verify.py``) a hang fault of the detector is a suspicion, verified
over the last seconds of its budget (``Verifier.prepare``) before it is raised. The hang
fault's evidence (stacks, last lines) is ``worker_evidence.evidence_hook``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ftagent.detect.hang import HangDetector
from ftagent.metrics import AgentMetrics
from ftagent.model import Fault, Observation, TrainerStart
from ftagent.sources.progress import LogProgress

if TYPE_CHECKING:
    from ftagent.agent.verify import Verifier


class HangWatch:
    def __init__(self, detector: HangDetector, metrics: AgentMetrics | None = None,
                 parser: LogProgress | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 verifier: Verifier | None = None) -> None:
        self.detector = detector
        self.verifier = verifier
        self.parser = parser
        self.clock = clock
        self.metrics = metrics
        # the object that keeps this watch's next due time as a fact (``next_due``), read
        # by the watch loop instead of asking ``next_tick``: the verifier (None: asked)
        self.timing: Verifier | None = verifier
        if verifier is not None:  # the verifier's prepare, the budget, its own times:
            # its methods in place of these two, no hop through here on a tick
            self.tick = verifier.tick  # type: ignore[method-assign]
            self.next_tick = verifier.next_tick  # type: ignore[method-assign]
        if metrics is not None:
            metrics.seconds_since_progress.set_function(
                lambda: detector.seconds_since_progress(clock()))
            metrics.hang.set_function(lambda: float(self.declared()))
            metrics.hang_suspected.set_function(lambda: float(self.suspected()))
            metrics.hang_budget.set_function(lambda: detector.budget(clock()))
            if parser is not None:  # lines the parser could not afford or use
                parser.on_skip = lambda reason, n: metrics.log_lines_skipped.labels(
                    **metrics.identity, reason=reason).inc(n)

    def observe(self, obs: Observation) -> list[Fault]:
        if isinstance(obs, TrainerStart) and self.parser is not None:
            self.parser.reset()
        seen = self.detector.observe(obs)
        if self.verifier is not None:
            self.verifier.observe(obs, seen)
        m = self.metrics
        if seen is not None and m is not None:
            # the detector's clean intervals: no warm-up gaps, no phases, no hang
            if seen.step_interval is not None:
                m.step_duration.observe(seen.step_interval)
            if seen.phase is not None and seen.phase_seconds is not None:
                m.phase_duration.labels(**m.labels(phase=seen.phase)).observe(
                    seen.phase_seconds)
        return []

    def tick(self, now: float) -> list[Fault]:
        """The detector's faults at ``now`` (with a verifier, ``Verifier.tick`` is
        called instead: set by the constructor)."""
        return self.detector.tick(now)

    def next_tick(self, now: float) -> float | None:
        """When ``tick`` next has something to do (watch/loop.py: the ticker sleeps until
        then): the budget's end; with a verifier its ``next_tick`` (set in place of this
        method by the constructor: no hop through here)."""
        det = self.detector
        return None if det.hung else det.deadline_at

    def declared(self) -> bool:
        """A hang declared: the budget ran out and, with verification on, the verdict
        raised the HANG fault (``ftagent_hang``; the ``for: 0m`` alert keys on it). A budget
        running out is only a suspicion until then (``suspected``)."""
        det, v = self.detector, self.verifier
        if not det.hung:
            return False
        return v is None or v.window <= 0 or v.declared

    def suspected(self) -> bool:
        """A suspicion not (yet) declared (``ftagent_hang_suspected``): the budget ran out
        and the verdict is being judged, or this rank was verified waiting in a
        collective and the arbiter is comparing the ranks."""
        v = self.verifier
        if v is None:
            return False
        return (self.detector.hung and not self.declared()) or v.asking

    def state(self) -> tuple[float, bool]:
        """(seconds since progress, hung) now: what the arbiter's summaries carry."""
        return self.detector.seconds_since_progress(self.clock()), self.detector.hung
