"""Adaptive hang detection: no step progress within a budget learned from the job itself.

Pure: it takes observations with their ``ts`` (monotonic seconds) and ``tick(now)``;
it never reads a clock, so tests drive it with synthetic timelines.

The budget for the next step, measured from the last progress (or the end of a phase):

* **warm-up** — the first ``hang_warmup_steps`` steps of every attempt (compilation, data
  loader start, rendezvous, checkpoint load) get ``hang_first_step_timeout`` each;
* **learned** — after that, ``max(hang_timeout_min, hang_factor × p(hang_percentile) of the
  last 200 step intervals, 2 × the longest interval ever survived)``. The last term
  remembers rare long steps that recur (an undeclared checkpoint every N steps) after
  they have dropped out of the window. An observation that advances k steps at once
  (lines read together) is k intervals for the percentile (weighted by the steps it
  advanced, not counted once), each the seconds per step over this read and the one
  before it (``paired_interval``: a read that caught one step of a few is not the whole
  wait), and its whole gap for the longest: a step line
  read alone after the output pump's wait (--output-interval), e.g. the last one before
  a stall, is one step among the hundreds read seven at a time, not one read in
  seventy. Intervals of warm-up steps, intervals that span
  a phase and intervals declared a hang are not recorded: they say nothing about a
  normal step. Neither is a single step over ``OUTLIER`` x the median of the window (once
  it holds ``OUTLIER_AFTER`` steps): it held a phase nobody declared (a silent save every
  N steps), and belongs to ``longest``, not to the percentile;
* **in a phase** (checkpoint, eval, from a PhaseMarker) — the phase's own budget,
  ``max(hang_timeout_min, hang_factor × its longest duration seen)``, or
  ``hang_phase_timeout`` until one has been seen.

What counts as progress: a ``Progress`` whose step is higher than the last one. A repeated
step (tqdm redraws, the HF loss dict) or log lines ("waiting for data") are not. A step
lower than the last counts only after ``REWIND_CONFIRM`` increasing steps (a trainer that
reloaded an older checkpoint without restarting). Once the SDK has reported a step, log
progress is ignored: the SDK is exact, log lines are a guess. Phase markers are signs of
life too: they move the reference point but are never step intervals.

One HANG fault per episode: ``hung`` stays true until progress (or a phase marker, a new
attempt, the trainer's exit) clears it; the next stall is a new episode. The fault is a
*suspicion*: the agent verifies it (``agent/verify.py``) and, when the trainer is alive,
calls ``defer(until)``: not hung, suspect again at ``until``, and the stall is no step
interval (it is learned as an undeclared phase instead). ``TrainerStart``
starts an attempt over (warm-up again) but keeps everything learned.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from ftagent.config import HangConfig
from ftagent.model import (
    Fault,
    FaultKind,
    Observation,
    PhaseMarker,
    ProcessExit,
    Progress,
    Scope,
    Severity,
    TrainerStart,
)

WINDOW = 200  # recent step intervals (steps, not observations) the percentile is taken over
MAX_WEIGHT = WINDOW // 2  # steps one observation counts for at most: a jump in the step
# numbers (a trainer that skips some) never fills the window alone
LONGEST_MARGIN = 2.0  # a step as long as the longest one survived is not a hang
OUTLIER = 1.5  # a step over this x the median of plain steps held a phase (a silent save)
OUTLIER_AFTER = 20  # steps in the window before outliers are told apart
REWIND_CONFIRM = 3  # increasing steps below the last one before they count as progress
FINISH_PHASE = "finish"  # after the last step of a known total, until the trainer exits


@dataclass(frozen=True)
class Sample:
    """One planned verification sample: when, and whether it takes stacks (py-spy)."""

    at: float  # the detector's clock
    stacks: bool


def verify_plan(deadline: float, budget: float, window: float, samples: int,
                start_fraction: float) -> tuple[Sample, ...]:
    """When to sample a stalled trainer so its verdict is ready when the budget ends.

    ``samples`` samples, evenly over ``window`` seconds that end at ``deadline``, but that
    never begin before ``start_fraction`` of the budget (so a healthy step's jitter costs
    nothing): a short budget pushes the window's end past the deadline rather than shorten
    it (motion needs time to show). The early samples are cheap (/proc and psutil: CPU,
    I/O); those from half a window before the deadline on, and the last two at least (the
    two that motion needs), take stacks too. ``start_fraction`` 1 is verification as it was
    before: every sample after the deadline, with stacks (the verdict a window late).
    Pure: the caller sleeps until each ``at``."""
    n = max(2, int(samples))
    start = max(deadline - window, deadline - max(0.0, 1.0 - start_fraction) * max(0.0, budget))
    step = window / (n - 1)
    stacks_from = deadline - window / 2
    return tuple(Sample(start + i * step, i >= n - 2 or start + i * step >= stacks_from - 1e-9)
                 for i in range(n))


def paired_interval(gap: float, steps: int, prev: tuple[float, int] | None) -> float:
    """Seconds per step for the percentile: this read's, or over this read and the one
    before it (``prev``: its gap and steps, when it was a plain read too, warm-up
    included), whichever is lower.

    The output pump reads every --output-interval (0.5 s) while lines keep coming, so a
    line's time is its read's: with 0.25 s steps a read catches two steps (0.25 s each),
    now and then one (0.5 s: the whole wait). Early in a job the percentile is the largest
    of a handful of intervals, so one read that caught a single step made the budget
    10 x 0.5 s = 5 s on that rank and 3 s on its peer (the verdict corpus, 7 of 25 hangs:
    the peer, still 2 s from its own window when the arbiter asked for its stacks, sampled
    a whole window first, and the restart came 2 s later). Over two reads the wait is
    shared (1 s for 3 steps: 0.33 s). The lower of the two, so a read that caught more
    steps than its neighbour is not raised by it; uniform steps are unchanged. Erring low
    costs at most a verification (the budget only makes a hang suspected), not a restart;
    a long single step still counts whole in ``longest``."""
    own = gap / steps
    if prev is None:
        return own
    return min(own, (gap + prev[0]) / (steps + prev[1]))


@dataclass(frozen=True)
class Observed:
    """What one observation changed, for metrics (step duration, phase duration)."""

    new_progress: bool = False
    step_interval: float | None = None  # seconds per step since the previous one, if clean
    phase: str | None = None  # a phase that ended
    phase_seconds: float | None = None


class HangDetector:
    """Decides when a trainer is hung; see the module docstring for the rules."""

    _deferred: float | None  # set by defer(): verified alive, suspect again at this time

    def __init__(self, cfg: HangConfig, *, expect_progress: bool = True) -> None:
        """``expect_progress=False``: do not arm before this agent has seen a first step
        (log progress on a rank that prints nothing, e.g. Megatron's non-last ranks)."""
        self.cfg = cfg
        self.expect_progress = expect_progress
        # (seconds per step, steps): one entry per observation that advanced ``steps``
        # steps, kept while the newer ones hold fewer than WINDOW steps (so at most
        # WINDOW + 1 entries: each weighs one step at least)
        self._window: deque[tuple[float, int]] = deque()
        self._window_steps = 0
        self.longest = 0.0
        self.phase_longest: dict[str, float] = {}
        self.hung = False
        self.last_step: int | None = None
        self.attempt = -1
        self._running = False
        self._pid: int | None = None
        self._ever_progress = False
        self._sdk = False
        self._pct: float | None = None  # cached percentile, None when stale
        self._med: float | None = None  # cached median, None when stale
        self.phase_intervals = 0  # steps that held an undeclared phase (not in the window)
        # when a hang will be suspected if nothing happens (None: not armed): a fact of
        # the inputs alone, kept by each input that moves it (``_moved``) and read in place
        # (the verifier asked ``deadline()`` up to five times per look)
        self.deadline_at: float | None = None
        self._start(0.0)
        self._running = False
        self.deadline_at = None

    # ------------------------------------------------------------------ inputs

    def observe(self, obs: Observation) -> Observed | None:
        seen = self._observe(obs)
        self.deadline_at = self._deadline()  # every input that moves it comes through here
        return seen

    def _observe(self, obs: Observation) -> Observed | None:
        if isinstance(obs, TrainerStart):
            self.attempt = obs.attempt
            self._pid = obs.pid
            self._start(obs.ts)
            return None
        if isinstance(obs, ProcessExit):
            if self._pid is None or obs.pid == self._pid:
                self._running = False
                self.hung = False
                self.phases.clear()
            return None
        if not self._running:
            return None  # before the first start or after the exit: late lines
        if isinstance(obs, Progress):
            return self._progress(obs)
        if isinstance(obs, PhaseMarker):
            return self._phase(obs)
        return None

    def tick(self, now: float) -> list[Fault]:
        """The faults due at ``now``: at most one per hang episode."""
        if self.hung:
            return []
        deadline = self.deadline_at
        if deadline is None or now <= deadline:
            return []
        self.hung = True
        return [self._fault(now)]

    def defer(self, until: float) -> None:
        """Verified alive (agent/verify.py): no hang; suspect again at ``until``."""
        if not self._running:
            return
        self.hung = False
        self._tainted = True  # the stall is not a step interval
        self._deferred = until
        self.deadline_at = until

    # ------------------------------------------------------------------ state for metrics

    def deadline(self) -> float | None:
        """When a hang will be declared if nothing happens; None when not armed (the
        same as ``deadline_at``, which callers on the tick path read in place)."""
        return self.deadline_at

    def _deadline(self) -> float | None:
        if not self._running:
            return None
        if self._deferred is not None:  # verified alive: suspect again then
            return self._deferred
        if self.phases:
            return max(start + self.phase_budget(name) for name, start in self.phases.items())
        if not self.expect_progress and not self._ever_progress:
            return None
        return self._ref + self.step_budget()

    def budget(self, now: float) -> float:
        """The budget in force at ``now`` (a phase's or the next step's), in seconds."""
        phase = self._current_phase()
        return self.phase_budget(phase) if phase else self.step_budget()

    def seconds_since_progress(self, now: float) -> float:
        """Since the last step (or the trainer's start); 0 while no trainer runs."""
        return max(0.0, now - self.last_progress) if self._running else 0.0

    def step_budget(self) -> float:
        c = self.cfg
        pct = self.interval_percentile()
        if pct is None or self._events < c.hang_warmup_steps:
            return c.hang_first_step_timeout
        return max(c.hang_timeout_min, c.hang_factor * pct, LONGEST_MARGIN * self.longest)

    def phase_budget(self, phase: str) -> float:
        learned = self.phase_longest.get(phase)
        if learned is None:
            return self.cfg.hang_phase_timeout
        return max(self.cfg.hang_timeout_min, self.cfg.hang_factor * learned)

    @property
    def intervals(self) -> tuple[float, ...]:
        """Seconds per step of the recent observations in the window (one per observation;
        the percentile weighs each by the steps it advanced)."""
        return tuple(iv for iv, _ in self._window)

    def interval_percentile(self) -> float | None:
        """The ``hang_percentile`` of recent step intervals (nearest rank over steps: an
        observation of k steps is k intervals), None if none."""
        if self._pct is None and self._window:
            rank = max(1, math.ceil(self.cfg.hang_percentile / 100.0 * self._window_steps))
            seen = 0
            for iv, n in sorted(self._window):
                seen += n
                if seen >= rank:
                    self._pct = iv
                    break
        return self._pct

    def _phase_between_steps(self, interval: float, advanced: int) -> bool:
        """A step longer than the plain ones (over ``OUTLIER`` x their median, once
        ``OUTLIER_AFTER`` steps are in the window) held a phase nobody declared: a silent
        checkpoint save every N steps. It belongs to that phase, not to the step budget:
        it is kept in ``longest`` (the budget never falls below twice it) but not in the
        percentile, where one save in 20 steps made p99 the save (0.2 s steps, 0.5 s
        saves: a 5 s budget instead of the 3 s floor)."""
        if advanced != 1 or self._window_steps < OUTLIER_AFTER:
            return False
        median = self._median()
        if median is None or median <= 0 or interval <= OUTLIER * median:
            return False
        self.phase_intervals += 1
        return True

    def _median(self) -> float | None:
        if self._med is None and self._window:
            half, seen = max(1, math.ceil(self._window_steps / 2)), 0
            for iv, n in sorted(self._window):
                seen += n
                if seen >= half:
                    self._med = iv
                    break
        return self._med

    def _learn_interval(self, seconds_per_step: float, steps: int) -> None:
        self._window.append((seconds_per_step, steps))
        self._window_steps += steps
        while self._window_steps - self._window[0][1] >= WINDOW:
            self._window_steps -= self._window.popleft()[1]
        self._pct = None
        self._med = None

    # ------------------------------------------------------------------ internals

    def _start(self, ts: float) -> None:
        self._running = True
        self.hung = False
        self.last_step = None
        self._source = ""
        self._events = 0  # steps this attempt (advanced, not observations: see _progress)
        self._observed = 0  # progress observations this attempt
        self._ref = ts  # deadlines count from here (last step, phase end, start)
        self.last_progress = ts  # read in place by the verifier's plan (agent/verify.py)
        self._tainted = False  # a phase happened since the last step
        # open phases (name -> start): read in place where a call per tick was the cost
        self.phases: dict[str, float] = {}
        self._rewind: tuple[int, int] | None = None  # (last low step, increasing count)
        self._deferred = None  # a verified-alive stall: suspect again then
        self._prev_read: tuple[float, int] | None = None  # the last clean (gap, steps)

    def _progress(self, p: Progress) -> Observed | None:
        if p.source == "sdk":
            self._sdk = True
        elif self._sdk:
            return None
        if self.last_step is not None and p.step <= self.last_step and (
                p.step == self.last_step or not self._rewound(p.step)):
            return None
        self._rewind = None
        ts = max(p.ts, self._ref)  # sources may deliver slightly out of order
        gap = ts - self._ref
        # Lines read together (pipe buffering, the output pump's coalesced reads) arrive
        # as one observation of their last step. Warm-up counts steps, not observations
        # (a trainer printing 10 steps a second must not need 10x the warm-up), and the
        # percentile takes the gap per step: a fold of k steps in 0.5 s is k steps of
        # 0.5/k s, not one step of 0.5 s. A pause is not hidden by it: the first line
        # after a quiet spell is read at once, alone. (A line read alone after the pump's
        # wait still counts the wait: the read time is all that is known of it; it is one
        # step of the window's 200, so the percentile passes over it.)
        # ``longest`` keeps the whole gap: the budget never falls below 2 x the longest
        # wait for an observation a healthy trainer has made.
        advanced = 1 if self.last_step is None or p.step <= self.last_step \
            else p.step - self.last_step
        interval = gap / advanced
        self._events += advanced
        self._observed += 1
        ended = self._end_all_phases(ts)
        clean = not self._tainted and not ended and self._observed >= 2
        # the next read's pair: any plain read, a warm-up one too (the lower of the two
        # is taken, so a long one never raises the next)
        prev, self._prev_read = self._prev_read, (gap, advanced) if clean else None
        if clean and not self.hung and self._events > max(self.cfg.hang_warmup_steps, 1):
            if not self._phase_between_steps(interval, advanced):
                self._learn_interval(paired_interval(gap, advanced, prev),
                                     min(advanced, MAX_WEIGHT))
            self.longest = max(self.longest, gap)
        self._ref = self.last_progress = ts
        self.last_step = p.step
        self._source = p.source
        self._tainted = False
        self._ever_progress = True
        self.hung = False
        self._deferred = None
        if p.total_steps is not None and p.step >= p.total_steps:
            # The last step: what follows (final checkpoint, destroy_process_group, exit)
            # is not a step and gets a phase's budget, or a finished job would be "hung".
            self.phases.setdefault(FINISH_PHASE, ts)
        return Observed(new_progress=True, step_interval=interval if clean else None)

    def _rewound(self, step: int) -> bool:
        if self._rewind is not None and step > self._rewind[0]:
            self._rewind = (step, self._rewind[1] + 1)
        else:
            self._rewind = (step, 1)
        return self._rewind[1] >= REWIND_CONFIRM

    def _phase(self, m: PhaseMarker) -> Observed | None:
        ts = max(m.ts, self._ref)
        self.hung = False
        self._deferred = None
        self._tainted = True
        if m.begin:
            self.phases.setdefault(m.phase, ts)
            return None
        self._ref = ts
        start = self.phases.pop(m.phase, None)
        if start is None:
            return None
        seconds = self._learn_phase(m.phase, ts - start)
        return Observed(phase=m.phase, phase_seconds=seconds)

    def _end_all_phases(self, ts: float) -> bool:
        """A step while a phase is open: its end marker went missing; it ended by now."""
        for name, start in self.phases.items():
            self._learn_phase(name, ts - start)
        ended = bool(self.phases)
        self.phases.clear()
        return ended

    def _learn_phase(self, name: str, seconds: float) -> float:
        self.phase_longest[name] = max(self.phase_longest.get(name, 0.0), seconds)
        return seconds

    def current_phase(self) -> str | None:
        """The open phase whose budget ends last (None: none open)."""
        return self._current_phase()

    def _current_phase(self) -> str | None:
        if not self.phases:
            return None
        return max(self.phases, key=lambda n: self.phases[n] + self.phase_budget(n))

    def _fault(self, now: float) -> Fault:
        c = self.cfg
        phase = self._current_phase()
        budget = self.budget(now)
        since = now - self.last_progress
        pct = self.interval_percentile()
        step = "no step yet" if self.last_step is None else f"last step {self.last_step}"
        if phase:
            running = now - self.phases[phase]
            msg = (f"{phase} phase running for {running:.1f}s, over its budget of "
                   f"{budget:.1f}s ({step})")
        elif pct is None or self._events < c.hang_warmup_steps:
            msg = (f"no step progress for {since:.1f}s during warm-up (budget {budget:.0f}s, "
                   f"--hang-first-step-timeout; {step})")
        else:
            msg = (f"no step progress for {since:.1f}s, over the budget of {budget:.1f}s "
                   f"({c.hang_factor:g} x p{c.hang_percentile:g} step interval {pct:.3f}s, "
                   f"floor {c.hang_timeout_min:g}s; {step})")
        return Fault(
            kind=FaultKind.HANG,
            message=msg,
            severity=Severity.ERROR,
            scope=Scope.PROCESS,
            evidence={
                "last_step": self.last_step,
                "seconds_since_progress": round(since, 3),
                "budget_seconds": round(budget, 3),
                "over_budget_seconds": round(now - (self.deadline_at or now), 6),
                "interval_percentile": c.hang_percentile,
                "interval_seconds": None if pct is None else round(pct, 6),
                "longest_interval_seconds": round(self.longest, 6),
                "intervals_seen": len(self._window),
                "steps_in_window": self._window_steps,
                "phase": phase,
                "warmup": self._events < c.hang_warmup_steps or pct is None,
                "steps_this_attempt": self._events,
                "attempt": self.attempt,
                "progress_source": self._source or None,
            },
        )
