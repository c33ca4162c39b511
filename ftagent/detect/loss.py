"""Loss anomalies: a NaN or infinite loss, and a sudden spike, as faults of their own kind.

Pure: ``Progress`` observations in, ``Fault(kind=LOSS)`` out; the wall clock for the
fault's time is injected. A NaN loss silently burns GPU hours (every later step is NaN
too), and a spike is often the first sign of a diverging run, so both are worth an
alert; neither is a reason to kill a job by default (``--loss-action alert``: the
policy only records and alerts).

A *spike* is a robust z-score over a rolling window of the last ``window`` finite losses:
``(loss - median) / scale`` above ``threshold``, where ``scale`` is the median absolute
deviation (× 1.4826, the standard deviation of normal noise) floored at 1 % of the
median's magnitude, so a loss that barely moves (MAD near 0) does not turn every wiggle
into a spike. Only upward jumps count (a loss that drops is good news), and only after
``min_history`` losses are in the window. Median and MAD are robust: the spike itself,
and a few outliers before it, hardly move them.

One fault per episode: a NaN run raises once until a finite loss returns; a spike at
most once per ``window`` steps. A new trainer attempt (``TrainerStart``) starts over.
Values are bounded where they enter (the SDK socket and the log parser give floats; a
huge one is just large): nothing here can raise on a value or grow with the run.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ftagent.model import Fault, FaultKind, Observation, Progress, Scope, Severity, TrainerStart

MAD_TO_SIGMA = 1.4826  # MAD x this = the standard deviation, for normal noise
REFRESH = 8  # steps between recomputing the window's median and scale
SCALE_FLOOR = 0.01  # of |median|: the smallest deviation a spike is measured against


@dataclass(frozen=True)
class LossSettings:
    """``--loss-*`` flags (config.LossConfig) as the detector needs them."""

    window: int = 100  # finite losses the median and MAD are taken over
    threshold: float = 10.0  # robust z-score above which a loss is a spike
    min_history: int = 20  # losses in the window before spikes are looked for
    evidence: int = 20  # last (step, loss) pairs attached to a fault
    action: str = "alert"  # alert | restart (carried in the evidence for the policy)

    @classmethod
    def of(cls, cfg: object) -> LossSettings:
        """From ``config.LossConfig`` (``--loss-spike-window``, ``--loss-spike-threshold``,
        ``--loss-action``)."""
        window = int(getattr(cfg, "loss_spike_window", cls.window))
        return cls(window=window, threshold=float(getattr(cfg, "loss_spike_threshold",
                                                          cls.threshold)),
                   min_history=min(cls.min_history, window),
                   action=str(getattr(cfg, "loss_action", cls.action)))


def _shown(v: float) -> float | str:
    """A loss for JSON evidence: finite numbers as they are, NaN/inf as text."""
    return v if math.isfinite(v) else repr(v)


class LossDetector:
    """Watches the loss of one trainer's steps (the agent's ``Detector`` protocol)."""

    def __init__(self, settings: LossSettings = LossSettings(), *,
                 wall: Callable[[], float] = time.time) -> None:
        self.s = settings
        self.wall = wall
        self.reset()

    def reset(self) -> None:
        self.window: deque[float] = deque(maxlen=max(self.s.window, 2))
        self.recent: deque[tuple[int, float]] = deque(maxlen=max(self.s.evidence, 1))
        self.last_step: int | None = None
        self.in_nan = False
        self.spike_until = -1  # no spike fault before this step (one per window)
        self.nan_faults = 0
        self.spike_faults = 0
        self._stats: tuple[float, float] | None = None  # (median, scale) of the window
        self._since = 0  # losses appended since they were computed

    def observe(self, obs: Observation) -> list[Fault]:
        if isinstance(obs, TrainerStart):
            self.reset()
            return []
        if not isinstance(obs, Progress):
            return []
        faults = [f for step, loss in obs.folded_losses  # steps read in the same batch
                  if (f := self._one(step, loss)) is not None]
        if obs.loss is not None and (f := self._one(obs.step, obs.loss)) is not None:
            faults.append(f)
        return faults

    def _one(self, step: int, raw: object) -> Fault | None:
        if self.last_step is not None and step <= self.last_step:
            return None  # a redraw of the same step, or a step back: not a new loss
        self.last_step = step
        try:
            loss = float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            return None
        self.recent.append((step, loss))
        if not math.isfinite(loss):
            if self.in_nan:
                return None
            self.in_nan = True
            self.nan_faults += 1
            what = "NaN" if loss != loss else "infinite"
            return self._fault(f"training loss is {what} at step {step}",
                               reason="nan" if loss != loss else "inf", step=step)
        self.in_nan = False
        fault = self._spike(step, loss)
        self.window.append(loss)
        self._since += 1
        return fault

    ticks = False  # judged on each loss as it comes: the watch loop never ticks it

    def tick(self, now: float) -> list[Fault]:
        return []

    def score(self, loss: float) -> float | None:
        """The robust z-score of ``loss`` against the window (None before min_history).

        The window's median and scale (two sorts) are computed again every
        ``REFRESH`` steps, not on every step (they were 13 % of a launcher's CPU); a loss
        that scores above half the threshold against them is scored again against fresh
        ones, so a spike is always decided on the current window."""
        if len(self.window) < max(self.s.min_history, 2):
            return None
        if self._stats is None or self._since >= REFRESH:
            self._stats = self._window_stats()
        z = self._z(loss, *self._stats)
        if abs(z) > self.s.threshold / 2 and self._since:
            self._stats = self._window_stats()
            z = self._z(loss, *self._stats)
        return z

    def _window_stats(self) -> tuple[float, float]:
        self._since = 0
        values = list(self.window)
        median = statistics.median(values)
        mad = statistics.median([abs(v - median) for v in values])
        return median, max(MAD_TO_SIGMA * mad, SCALE_FLOOR * abs(median), 1e-12)

    @staticmethod
    def _z(loss: float, median: float, scale: float) -> float:
        z = (loss - median) / scale
        return z if math.isfinite(z) else math.copysign(math.inf, z)

    def _spike(self, step: int, loss: float) -> Fault | None:
        z = self.score(loss)
        if z is None or z <= self.s.threshold or step < self.spike_until:
            return None
        self.spike_until = step + self.s.window
        self.spike_faults += 1
        median = statistics.median(self.window)
        return self._fault(
            f"training loss spiked at step {step}: {loss:.6g} against a median of "
            f"{median:.6g} over the last {len(self.window)} steps (robust z-score "
            f"{z:.3g} > {self.s.threshold:g})", reason="spike", step=step,
            score=z if math.isfinite(z) else repr(z), median=median)

    def _fault(self, message: str, *, reason: str, step: int, **extra: object) -> Fault:
        restart = self.s.action == "restart"
        return Fault(
            FaultKind.LOSS, message, severity=Severity.ERROR if restart else Severity.WARNING,
            scope=Scope.JOB, detected_at=self.wall(),
            evidence={"reason": reason, "step": step, "action": self.s.action,
                      "threshold": self.s.threshold, "window": self.s.window,
                      "last_losses": [[s, _shown(v)] for s, v in self.recent], **extra})
