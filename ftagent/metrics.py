"""Every Prometheus series ftagent exports, declared in one place.

Names are ``ftagent_*`` in base units (``_seconds``, ``_bytes``, ``_total``). Agent series
carry the identity labels ``job, namespace, pod, node, rank`` (+ ``phase``, ``kind``,
``device``, ``direction``, ``op``); arbiter series describe the arbiter itself.

Values that already live in a source (NIC counters, RDMA ports) are read at scrape time
by collectors that call a snapshot function, instead of being copied into gauges.
Each agent/arbiter uses its own ``CollectorRegistry`` so several can live in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("ftagent.metrics")

IDENTITY_LABELS = ("job", "namespace", "pod", "node", "rank")

# Step times from ~1 ms (tiny CPU jobs) to ~10 min (huge models); phases longer.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
PHASE_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class AgentMetrics:
    """The per-agent series, bound to this agent's identity labels."""

    def __init__(self, registry: CollectorRegistry, identity: dict[str, str]) -> None:
        self.registry = registry
        self.identity = dict(identity)
        ids = list(IDENTITY_LABELS)

        def gauge(name: str, doc: str, extra: Iterable[str] = ()) -> Gauge:
            return Gauge(name, doc, ids + list(extra), registry=registry)

        def counter(name: str, doc: str, extra: Iterable[str] = ()) -> Counter:
            return Counter(name, doc, ids + list(extra), registry=registry)

        def hist(name: str, doc: str, buckets: tuple[float, ...],
                 extra: Iterable[str] = ()) -> Histogram:
            return Histogram(name, doc, ids + list(extra), buckets=buckets,
                             registry=registry)

        i = self.identity
        # -- supervisor
        self.info = gauge("ftagent_agent_info", "Always 1; labels say who this agent is.",
                          ["version"])
        self.trainer_running = gauge(
            "ftagent_trainer_running", "1 while the trainer process runs.").labels(**i)
        self.trainer_last_exit_code = gauge(
            "ftagent_trainer_last_exit_code",
            "Exit status of the last trainer run (128+N for signal N).").labels(**i)
        self.restarts = counter(
            "ftagent_restarts", "Trainer restarts done by this agent.").labels(**i)
        self.faults = counter("ftagent_faults", "Faults detected, by kind.", ["kind"])
        self.generation = gauge(
            "ftagent_job_generation", "The job generation this agent runs (arbiter).").labels(**i)
        # -- progress
        self.step = gauge("ftagent_training_step", "Last training step seen.").labels(**i)
        self.loss = gauge("ftagent_training_loss", "Last training loss seen.").labels(**i)
        self.samples_per_second = gauge(
            "ftagent_training_samples_per_second", "Training throughput in samples/s.").labels(**i)
        self.tokens_per_second = gauge(
            "ftagent_training_tokens_per_second", "Training throughput in tokens/s.").labels(**i)
        self.samples = counter("ftagent_training_samples",
                               "Samples processed (SDK-reported).").labels(**i)
        self.tokens = counter("ftagent_training_tokens",
                              "Tokens processed (SDK-reported).").labels(**i)
        self.step_duration = hist(
            "ftagent_step_duration_seconds", "Time between consecutive steps.",
            STEP_BUCKETS).labels(**i)
        self.phase_duration = hist(
            "ftagent_phase_duration_seconds", "Duration of declared phases (checkpoint, eval).",
            PHASE_BUCKETS, ["phase"])
        self.seconds_since_progress = gauge(
            "ftagent_seconds_since_progress", "Seconds since the last step progress.").labels(**i)
        self.hang = gauge("ftagent_hang", "1 while the trainer is considered hung.").labels(**i)
        self.hang_budget = gauge(
            "ftagent_hang_budget_seconds",
            "Current budget for the next step before a hang is declared.").labels(**i)
        self.detection_latency = hist(
            "ftagent_detection_latency_seconds",
            "From the fault's cause (exit, last progress, link change) to its detection.",
            LATENCY_BUCKETS, ["kind"])
        # -- collectives (SDK)
        self.collective_seconds = hist(
            "ftagent_collective_duration_seconds", "Duration of reported collectives.",
            LATENCY_BUCKETS, ["op"])
        self.collective_algbw = gauge(
            "ftagent_collective_algbw_bytes_per_second",
            "Algorithm bandwidth of the last collective: bytes / seconds.", ["op"])
        self.collective_busbw = gauge(
            "ftagent_collective_busbw_bytes_per_second",
            "Bus bandwidth of the last collective (nccl-tests factors).", ["op"])

        self.info.labels(**i, version=_version()).set(1)
        self.faults_by_kind = lambda kind: self.faults.labels(**i, kind=kind)

    def labels(self, **extra: str) -> dict[str, str]:
        """Identity labels plus ``extra``, for series with additional labels."""
        return {**self.identity, **extra}


class ArbiterMetrics:
    """The arbiter's own series."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.agents_connected = Gauge(
            "ftagent_arbiter_agents_connected", "Agents with an open stream.", registry=registry)
        self.jobs = Gauge("ftagent_arbiter_jobs", "Jobs known to the arbiter.",
                          registry=registry)
        self.decisions = Counter("ftagent_arbiter_decisions", "Decisions made, by action.",
                                 ["action"], registry=registry)
        self.faults = Counter("ftagent_arbiter_faults", "Faults received, by kind.", ["kind"],
                              registry=registry)
        self.fault_to_command = Histogram(
            "ftagent_arbiter_fault_to_command_seconds",
            "From receiving a fault to sending the resulting command to every rank.",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.barrier_seconds = Histogram(
            "ftagent_arbiter_barrier_seconds",
            "From the first to the last rank's barrier arrival.",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.rejected = Counter("ftagent_arbiter_rejected_requests",
                                "Requests rejected (auth, malformed, wrong job).", ["reason"],
                                registry=registry)


# --------------------------------------------------------------------------- scrape-time collectors


@dataclass(frozen=True)
class NicStats:
    """One link as the NIC source knows it, read at scrape time."""

    device: str
    up: bool
    carrier: bool
    flaps: int
    receive_bytes: int
    transmit_bytes: int
    receive_bps: float
    transmit_bps: float


@dataclass(frozen=True)
class IbPortStats:
    """One RDMA port from sysfs (data counters already converted to bytes)."""

    device: str
    port: str
    state_id: int  # 4 = ACTIVE, as node_exporter's node_infiniband_state_id
    phys_state_id: int
    rate_bytes_per_second: float
    receive_bytes: int
    transmit_bytes: int
    receive_bps: float = 0.0  # over the source's rate window
    transmit_bps: float = 0.0


class NicCollector(Collector):
    """node_exporter-like NIC and InfiniBand series from the NIC source's snapshot."""

    def __init__(
        self,
        identity: dict[str, str],
        nics: Callable[[], Iterable[NicStats]],
        ib_ports: Callable[[], Iterable[IbPortStats]] = lambda: (),
    ) -> None:
        self.identity = identity
        self.nics = nics
        self.ib_ports = ib_ports

    def collect(self) -> Iterator[Any]:
        ids = list(self.identity)
        vals = list(self.identity.values())
        dev = ids + ["device"]
        up = GaugeMetricFamily("ftagent_nic_up", "1 if the link is administratively up.",
                               labels=dev)
        carrier = GaugeMetricFamily("ftagent_nic_carrier", "1 if the link has carrier.",
                                    labels=dev)
        flaps = CounterMetricFamily("ftagent_nic_flaps", "Link down/up flaps seen.", labels=dev)
        rx = CounterMetricFamily("ftagent_nic_receive_bytes", "Bytes received.", labels=dev)
        tx = CounterMetricFamily("ftagent_nic_transmit_bytes", "Bytes transmitted.", labels=dev)
        bw = GaugeMetricFamily("ftagent_nic_bandwidth_bytes_per_second",
                               "Link throughput over the last window.", labels=dev + ["direction"])
        try:
            for n in self.nics():
                lv = vals + [n.device]
                up.add_metric(lv, float(n.up))
                carrier.add_metric(lv, float(n.carrier))
                flaps.add_metric(lv, n.flaps)
                rx.add_metric(lv, n.receive_bytes)
                tx.add_metric(lv, n.transmit_bytes)
                bw.add_metric(lv + ["receive"], n.receive_bps)
                bw.add_metric(lv + ["transmit"], n.transmit_bps)
        except Exception:  # a scrape must never fail because a source did
            log.exception("NIC snapshot failed")
        port = ids + ["device", "port"]
        state = GaugeMetricFamily("ftagent_infiniband_state_id",
                                  "RDMA port state (4 = ACTIVE).", labels=port)
        phys = GaugeMetricFamily("ftagent_infiniband_physical_state_id",
                                 "RDMA port physical state (5 = LinkUp).", labels=port)
        rate = GaugeMetricFamily("ftagent_infiniband_rate_bytes_per_second",
                                 "RDMA port signalling rate.", labels=port)
        irx = CounterMetricFamily("ftagent_infiniband_port_receive_bytes",
                                  "RDMA port data received.", labels=port)
        itx = CounterMetricFamily("ftagent_infiniband_port_transmit_bytes",
                                  "RDMA port data transmitted.", labels=port)
        ibw = GaugeMetricFamily("ftagent_infiniband_bandwidth_bytes_per_second",
                                "RDMA port throughput over the last window.",
                                labels=port + ["direction"])
        try:
            for p in self.ib_ports():
                lv = vals + [p.device, p.port]
                state.add_metric(lv, p.state_id)
                phys.add_metric(lv, p.phys_state_id)
                rate.add_metric(lv, p.rate_bytes_per_second)
                irx.add_metric(lv, p.receive_bytes)
                itx.add_metric(lv, p.transmit_bytes)
                ibw.add_metric(lv + ["receive"], p.receive_bps)
                ibw.add_metric(lv + ["transmit"], p.transmit_bps)
        except Exception:
            log.exception("RDMA snapshot failed")
        yield from (up, carrier, flaps, rx, tx, bw, state, phys, rate, irx, itx, ibw)


def _version() -> str:
    from ftagent import __version__

    return __version__
