"""Dead-still: a hang inside a phase whose budget has not run out (issue 35, item 4).

A declared phase gets ``--hang-phase-timeout`` (30 minutes) until its length has been seen
once, and the first step ``--hang-first-step-timeout`` (10 minutes): the first save and the
first evaluation are where storage and configuration faults show up, and a save blocked
forever on a dead mount waited out the whole budget. While a phase is open (or no step has
been seen), this watch samples the trainer's tree every quarter of
``--hang-dead-still-window`` (stacks, CPU, I/O, thread states: one ``TreeSampler`` sample,
~20 ms of py-spy per process) and asks the stall policy (``detect/stall.decide`` with
``phase_check``) about the samples spanning the last window: every thread blocked, no CPU,
no I/O, no stack movement is row D1, a hang declared then with the blocking frame as the
reason; any sign of life is row D2 and the phase budget holds. A stopped process is row F1.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from ftagent.detect.liveness import Snapshot, judge
from ftagent.detect.stall import Act, decide
from ftagent.model import Fault, FaultKind, Scope, Severity

log = logging.getLogger("ftagent.dead_still")

MIN_EVERY = 1.0  # seconds between samples at least (a tiny window in tests)


@dataclass
class _Episode:
    start: float  # the stall's start (the detector's clock): the phase began, or the start
    snaps: list[Snapshot] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)
    next_at: float = 0.0  # the verifier's clock
    done: bool = False  # declared, or nothing more to look at in this episode


class DeadStillWatch:
    """Called on the hang watch's ticks (``Verifier.prepare``), which come when
    ``next_tick`` says; raises through the verifier."""

    def __init__(self, verifier: Any) -> None:
        """``verifier``: verify.py's ``Verifier`` (not named here: verify.py builds this
        watch, and a type-checking import back would be an import cycle, test_layers)."""
        self.v = verifier
        self._ep: _Episode | None = None
        self._task: asyncio.Task[None] | None = None
        self.idle = True  # no episode, no look under way: nothing to drop (read in place)

    @property
    def window(self) -> float:
        return float(self.v.cfg.hang_dead_still_window or 0.0)

    def tick(self, now: float) -> None:
        det = self.v.detector
        window = self.window
        # armed: a deadline, no hang yet, and inside a phase or before the first step
        # (the cheap parts asked first: between steps of a learned job nothing is called)
        armed = window > 0 and not det.hung and (det.last_step is None or bool(det.phases)) \
            and det.deadline_at is not None
        if not armed:
            self.reset()
            return
        ep = self._open(now)
        if ep.done or (self._task is not None and not self._task.done()):
            return
        if self.v.clock() >= ep.next_at:
            self._task = asyncio.get_running_loop().create_task(self._look(ep, now))
            self._task.add_done_callback(self.v.woken)  # its next look: the ticker asks

    def next_tick(self, now: float, deadline: float | None) -> float | None:
        """When ``tick`` next looks (the verifier's clock), given the detector's
        ``deadline`` (None: hung, or not armed): None while not armed, a look is under
        way (its end wakes the ticker) or the episode is done. Drops a stale episode and
        opens the new one as ``tick`` would (bookkeeping; no sample is taken here)."""
        if not self.armed(deadline):
            self.reset()
            return None
        ep = self._open(now)
        if ep.done or (self._task is not None and not self._task.done()):
            return None
        return ep.next_at

    def armed(self, deadline: float | None) -> bool:
        """Inside a phase or before the first step, with a ``deadline`` (the detector's,
        None when hung or unarmed) and a window: read in place, nothing called."""
        det = self.v.detector
        return deadline is not None and (det.last_step is None or bool(det.phases)) and \
            float(self.v.cfg.hang_dead_still_window or 0.0) > 0

    def _open(self, now: float) -> _Episode:
        """The episode of the stall in progress (a new one when the stall's start moved)."""
        det = self.v.detector
        start = min(now, det.last_progress)  # armed: a trainer runs (seconds_since_progress)
        ep = self._ep
        if ep is None or abs(ep.start - start) > 1e-6:
            self.reset()
            ep = self._ep = _Episode(start, next_at=self.v.clock() + MIN_EVERY)
            self.idle = False
        return ep

    def reset(self) -> None:
        self.idle = True
        self._ep = None
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()

    async def _look(self, ep: _Episode, now: float) -> None:
        v = self.v
        window = self.window
        every = max(MIN_EVERY, window / 4)
        snap, entries = await v.sampler.sample(stacks=True)
        if self._ep is not ep:
            return
        ep.snaps.append(snap)
        ep.entries = entries
        ep.next_at = v.clock() + every
        ep.snaps = [s for s in ep.snaps if snap.ts - s.ts <= window + every]
        span = [s for s in ep.snaps if snap.ts - s.ts <= window + 1e-6]
        older = [s for s in ep.snaps if snap.ts - s.ts > window + 1e-6]
        if older:  # the newest sample at least a window back
            span = [older[-1], *span]
        if len(span) < 2 or span[-1].ts - span[0].ts < window:
            return
        det = v.detector
        motion = judge(span, v.thresholds)
        stalled = det.seconds_since_progress(v.now())
        phase = det.current_phase()
        # the verifier's budget and window: /proc's word on what the still threads wait on
        # too (a slow remote read in a phase is waiting on I/O, row I1, not dead-still)
        got = decide(v.budget(None, stalled, float(v.cfg.hang_spin_timeout)),
                     await v.window_of(motion, span), phase_check=True)
        if got.act is not Act.DECLARE:
            return
        if det.hung or self._ep is not ep:
            return  # the budget ran out meanwhile: the verifier has it
        ep.done = True
        det.hung = True  # one fault per episode; progress or a phase marker clears it
        fault = Fault(kind=FaultKind.HANG, message=got.reason, severity=Severity.ERROR,
                      scope=Scope.PROCESS, evidence={
                          "last_step": det.last_step, "phase": phase,
                          "seconds_since_progress": round(stalled, 3),
                          "budget_seconds": round(det.budget(now), 3),
                          "attempt": det.attempt, "verdict": got.state.value,
                          "where": got.where, "stall_seconds": round(stalled, 3),
                          "stall": got.to_json(), "rule": got.rule,
                          "culprits": list(got.culprits), "verification": motion.to_json(),
                          "processes": entries, **({"kill": True} if got.kill else {})})
        log.warning("%s", got.reason)
        v.declare_now(fault, ep.start, motion, got)
