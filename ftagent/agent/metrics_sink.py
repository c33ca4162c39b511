"""Turns observations, states and faults into the agent's Prometheus series.

A sink only listens: it never decides. A step that does not increase (a tqdm redraw) is
not new progress. Step and phase durations are not computed here: the hang detector
already separates clean step intervals from phases, and ``HangWatch`` records them.
"""

from __future__ import annotations

import logging

from ftagent.metrics import AgentMetrics
from ftagent.model import (
    CollectiveSample,
    Fault,
    Observation,
    ProcessExit,
    Progress,
    TrainerStart,
    TrainerState,
)
from ftagent.sources.sdk_socket import busbw

log = logging.getLogger("ftagent.metrics")

class MetricsSink:
    def __init__(self, metrics: AgentMetrics) -> None:
        self.m = metrics
        self._last_step: int | None = None
        self._restarts_seen = 0

    def observe(self, obs: Observation) -> None:
        m = self.m
        if isinstance(obs, Progress):
            if self._last_step is not None and obs.step <= self._last_step:
                return
            self._last_step = obs.step
            m.step.set(obs.step)
            if obs.loss is not None:
                m.loss.set(obs.loss)
            if obs.samples_per_second is not None:
                m.samples_per_second.set(obs.samples_per_second)
            if obs.tokens_per_second is not None:
                m.tokens_per_second.set(obs.tokens_per_second)
            if obs.samples:
                m.samples.inc(obs.samples)
            if obs.tokens:
                m.tokens.inc(obs.tokens)
        elif isinstance(obs, CollectiveSample):
            algbw, bus = busbw(obs.op, obs.nbytes, obs.seconds, obs.world_size)
            op = obs.op
            m.collective_seconds.labels(**m.labels(op=op)).observe(obs.seconds)
            m.collective_algbw.labels(**m.labels(op=op)).set(algbw)
            m.collective_busbw.labels(**m.labels(op=op)).set(bus)
        elif isinstance(obs, TrainerStart):
            m.trainer_running.set(1)
            m.generation.set(obs.generation)
            self._last_step = None
        elif isinstance(obs, ProcessExit):
            m.trainer_running.set(0)
            m.trainer_last_exit_code.set(obs.exit_status)

    def on_state(self, state: TrainerState, restarts: int) -> None:
        if restarts > self._restarts_seen:
            self.m.restarts.inc(restarts - self._restarts_seen)
            self._restarts_seen = restarts

    def on_fault(self, fault: Fault) -> None:
        if fault.evidence.get("recovered"):  # the all-clear after an outage, not a fault
            return
        self.m.faults_by_kind(fault.kind.value).inc()
        latency = fault.evidence.get("detection_latency_seconds")
        if isinstance(latency, (int, float)):
            self.m.detection_latency.labels(**self.m.labels(kind=fault.kind.value)).observe(
                latency)
