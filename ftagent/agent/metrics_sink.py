"""Turns observations, states and faults into the agent's Prometheus series.

A sink only listens: it never decides. A step that does not increase (a tqdm redraw) is
not new progress. Step and phase durations are not computed here: the hang detector
already separates clean step intervals from phases, and ``HangWatch`` records them.

What the worker's lifecycle owns is read there at scrape time, never pushed here:
``ftagent_restarts_total``, ``ftagent_trainer_running``, ``ftagent_trainer_last_exit_code``
and ``ftagent_job_generation`` (the sink keeps no copy, and a second writer is refused:
``ScrapedValue``), and which attempt runs: the progress series hold the values of the
attempt that reported them (``AttemptProgress``), so a new attempt shows none of the last
attempt's step, loss and throughput until it reports its own, with nothing pushed when it
starts. Every fault observes ``ftagent_detection_latency_seconds``: from the evidence
that triggered it to the moment it is raised (the hook runs then) — the trainer's exit
for a crash (its time, as the lifecycle holds it), the budget's expiry for a hang (the
detector's ``over_budget_seconds`` at creation, plus the evidence capture since), the
link change for a NIC fault (the detector's own ``detection_latency_seconds``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ftagent.agent.lifecycle import Lifecycle
from ftagent.metrics import AgentMetrics
from ftagent.model import (
    CollectiveSample,
    Fault,
    FaultKind,
    Observation,
    PhaseTiming,
    Progress,
    SnapshotsHeld,
)

log = logging.getLogger("ftagent.metrics")


def _seconds(v: object) -> float | None:
    """A duration from a fault's evidence: a finite number (not a bool), else None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


class ScrapedValue:
    """A counter's or gauge's child value, read at scrape time from its owner
    (prometheus_client's ``_value`` protocol: ``get``, ``get_exemplar``); ``inc`` and
    ``set`` are refused: the fact has one owner, and a push here would never be read."""

    def __init__(self, read: Callable[[], float]) -> None:
        self.read = read

    def get(self) -> float:
        return float(self.read())

    def get_exemplar(self) -> None:
        return None

    def inc(self, amount: float) -> None:
        raise TypeError("read at scrape time from its owner; never counted here")

    def set(self, value: float, timestamp: float | None = None) -> None:
        raise TypeError("read at scrape time from its owner; never set here")


def read_at_scrape(child: object, read: Callable[[], float]) -> None:
    """``child`` (a labelled counter or gauge) reports ``read()`` whenever it is scraped."""
    child._value = ScrapedValue(read)  # type: ignore[attr-defined]


class MetricsSink:
    # what the watch loop hands it (watch/loop.py ``_route``): the types ``observe`` reads;
    # the trainer's start and exit are not among them (the lifecycle holds both)
    observes = (Progress, CollectiveSample, PhaseTiming, SnapshotsHeld)

    def __init__(self, metrics: AgentMetrics, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 lifecycle: Lifecycle | None = None) -> None:
        """``lifecycle``: the worker's, where the series of its facts are read at scrape
        time (a fresh one's, that nothing moves, without)."""
        self.m = metrics
        self.clock = clock  # monotonic, as observations' ts
        self.wall = wall  # as Fault.detected_at
        life = self.life = lifecycle if lifecycle is not None else Lifecycle(clock)
        read_at_scrape(metrics.restarts, lambda: life.restarts)
        read_at_scrape(metrics.generation, lambda: life.generation)
        read_at_scrape(metrics.trainer_running, lambda: life.trainer_running)
        read_at_scrape(metrics.trainer_last_exit_code, lambda: life.trainer_exit.exit_status
                       if life.trainer_exit is not None else 0)
        metrics.progress.attempt = lambda: life.attempt
        self._snapshot_step: int | None = None  # the newest snapshot reported complete
        # the fault series' children per kind (``_fault_series``), for this identity
        self._series_ident: tuple[str, ...] = ()
        self._series: dict[FaultKind, tuple[dict[str, str], Any]] = {}
        self._label_kinds()

    def observe(self, obs: Observation) -> None:
        m = self.m
        if isinstance(obs, Progress):
            last = m.progress.current().get("step")  # this attempt's
            if last is not None and obs.step <= last:
                return
            m.progress.report(step=obs.step, loss=obs.loss,
                              samples_per_second=obs.samples_per_second,
                              tokens_per_second=obs.tokens_per_second,
                              tflops_per_gpu=obs.tflops_per_gpu)
            if obs.samples:
                m.samples.inc(obs.samples)
            if obs.tokens:
                m.tokens.inc(obs.tokens)
        elif isinstance(obs, CollectiveSample):
            m.observe_collectives(obs.op, obs.nbytes, obs.seconds, obs.world_size, obs.count)
        elif isinstance(obs, PhaseTiming):
            m.observe_phase(obs.phase, obs.seconds, obs.count)
        elif isinstance(obs, SnapshotsHeld):
            m.snapshot_bytes.set(obs.nbytes)
            if obs.steps and obs.steps[-1] != self._snapshot_step:
                self._snapshot_step = obs.steps[-1]
                m.snapshot_step.set(obs.steps[-1])
                m.snapshot_timestamp.set(self.wall())

    def on_fault(self, fault: Fault) -> None:
        if fault.evidence.get("recovered"):  # the all-clear after an outage, not a fault
            return
        if fault.evidence.get("waiting_in_collective") is True:
            return  # a suspicion the arbiter decides (agent/peer_wait.py), not a fault yet
        labels, count = self._fault_series(fault.kind)
        count.inc()
        latency = self.detection_latency(fault)
        if latency is not None:  # a series only where a latency is known
            self.m.detection_latency.labels(**labels).observe(max(0.0, latency))

    def _fault_series(self, kind: FaultKind) -> tuple[dict[str, str], Any]:
        """A kind's labels and fault counter child. The labels of every kind are folded
        once per identity (``_label_kinds``, at construction and after a relabel: a spare
        that took a rank), not per fault; the child is made at the kind's first fault (a
        series only for a kind that happened)."""
        if tuple(self.m.identity.values()) != self._series_ident:
            self._label_kinds()
        labels, count = self._series[kind]
        if count is None:
            count = self.m.faults.labels(**labels)
            self._series[kind] = (labels, count)
        return labels, count

    def _label_kinds(self) -> None:
        self._series_ident = tuple(self.m.identity.values())
        self._series = {k: (self.m.labels(kind=k.value), None) for k in FaultKind}

    def detection_latency(self, fault: Fault) -> float | None:
        """Seconds from the fault's triggering evidence to now (when it is raised)."""
        ev = fault.evidence
        measured = _seconds(ev.get("detection_latency_seconds"))
        if measured is not None:  # the detector measured it (NIC: since the link change)
            return measured
        life = self.life
        if fault.kind is FaultKind.CRASH and life.trainer_exit is not None \
                and life.trainer_pid is None:  # none runs: the exit is this attempt's
            return self.clock() - life.trainer_exit.ts
        over = _seconds(ev.get("over_budget_seconds"))
        if over is not None:  # a hang: past the budget when created, + evidence capture
            return over + max(0.0, self.wall() - fault.detected_at)
        return None
