"""The agent's series: bounded label values, progress per attempt and the lifecycle's facts
read at scrape time, detection latency for every fault kind, no ``_created`` series
(registries in-process, clocks injected)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ftagent.agent.hang_watch import HangWatch
from ftagent.agent.lifecycle import Lifecycle
from ftagent.agent.metrics_sink import MetricsSink
from ftagent.config import HangConfig
from ftagent.detect.hang import HangDetector
from ftagent.metrics import SDK_DROP_REASONS, AgentMetrics, ArbiterMetrics
from ftagent.model import (
    Action,
    ActionKind,
    CollectiveSample,
    Fault,
    FaultKind,
    Origin,
    PhaseMarker,
    ProcessExit,
    Progress,
    TrainerStart,
)
from ftagent.wire.limits import MAX_OPS, MAX_PHASES, OTHER, LabelFold

IDS = {"job_name": "j", "namespace": "ns", "pod": "p", "node": "n", "rank": "0"}


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def m(reg: CollectorRegistry) -> AgentMetrics:
    return AgentMetrics(reg, IDS)


def value(reg: CollectorRegistry, name: str, **extra: str) -> float | None:
    return reg.get_sample_value(name, {**IDS, **extra})


def label_values(reg: CollectorRegistry, family: str, label: str) -> set[str]:
    return {s.labels[label] for f in reg.collect() if f.name == family for s in f.samples}


# --------------------------------------------------------------------------- bounded labels


def test_label_fold_keeps_the_first_distinct_values_and_counts_the_rest() -> None:
    folded: list[int] = []
    fold = LabelFold("phase", 3, on_fold=lambda: folded.append(1))
    assert [fold(v) for v in ["a", "b", "a", OTHER, "c", "d", "b", "e"]] == [
        "a", "b", "a", OTHER, "c", OTHER, "b", OTHER]
    assert fold.seen == {"a", "b", "c"}  # OTHER takes no slot
    assert fold.folded == len(folded) == 2
    kinds = LabelFold("kind", 10, allowed=["crash", "hang"])
    assert [kinds(v) for v in ["crash", "evil", "hang"]] == ["crash", OTHER, "hang"]


def test_labels_folds_every_value_from_input(m: AgentMetrics, reg: CollectorRegistry) -> None:
    for i in range(1000):
        m.labels(phase=f"ckpt-{i}")
        m.labels(op=f"op-{i}")
    assert m.labels(phase="ckpt-0")["phase"] == "ckpt-0"
    assert m.labels(phase="ckpt-999")["phase"] == OTHER
    assert m.labels(kind="hang")["kind"] == "hang"
    assert m.labels(kind="x" * 300)["kind"] == OTHER
    assert m.labels(reason="range")["reason"] == "range"
    assert m.labels(reason="made-up")["reason"] == OTHER
    assert m.labels(direction="sideways")["direction"] == OTHER
    with pytest.raises(ValueError, match="no bound"):
        m.labels(gpu="0")  # a new label must be given a bound first
    assert value(reg, "ftagent_label_values_folded_total", label="phase") == 1001 - MAX_PHASES
    assert value(reg, "ftagent_label_values_folded_total", label="op") == 1000 - MAX_OPS
    assert value(reg, "ftagent_label_values_folded_total", label="kind") == 1


def test_every_extra_label_of_the_agent_is_bounded(m: AgentMetrics) -> None:
    """Each label beyond the identity has a fold or a fixed set in ``labels()``."""
    from ftagent.metrics import IDENTITY_LABELS

    extra = {name for f in m.registry.collect() for s in f.samples for name in s.labels
             } - set(IDENTITY_LABELS)
    extra |= {"phase", "op", "kind"}  # families without samples yet
    for name in extra - {"version", "le"}:  # version: a constant; le: the buckets
        m.labels(**{name: "anything"})  # raises for a label without a bound


def test_many_phase_and_op_names_keep_metrics_small(m: AgentMetrics,
                                                    reg: CollectorRegistry) -> None:
    """What 25,000 unique phase and op names did (900k series, 118 MB): now bounded."""
    det = HangDetector(HangConfig())
    watch = HangWatch(det, m, clock=Clock(1.0))
    sink = MetricsSink(m, clock=Clock(1.0))
    obs = [TrainerStart(pid=1, attempt=0, ts=0.0)]
    for i in range(25_000):
        obs += [PhaseMarker(f"ckpt-{i}", True, ts=i), PhaseMarker(f"ckpt-{i}", False, ts=i + 0.5),
                CollectiveSample(f"op-{i}", 1 << 20, 0.01, 8, ts=i + 0.6)]
    for o in obs:
        sink.observe(o)
        watch.observe(o)
    assert len(label_values(reg, "ftagent_phase_duration_seconds", "phase")) == MAX_PHASES + 1
    assert len(label_values(reg, "ftagent_collective_duration_seconds", "op")) == MAX_OPS + 1
    text = generate_latest(reg)
    assert len(text) < 512 * 1024
    assert text.count(b"\n") < 2000


def test_drop_reasons_are_exported_at_zero_from_the_start(reg: CollectorRegistry,
                                                          m: AgentMetrics) -> None:
    for reason in SDK_DROP_REASONS:
        assert value(reg, "ftagent_sdk_datagrams_dropped_total", reason=reason) == 0


def test_sdk_counts_are_read_from_each_workers_source_at_scrape_time() -> None:
    """The SDK source keeps its counts; one collector per registry reads every worker's
    (``--nproc-per-node``: shared families), so the family is exposed once."""
    from ftagent.sources.sdk_socket import SdkSocketSource

    reg = CollectorRegistry()
    ids = {"job_name": "j", "namespace": "n", "pod": "p", "node": "n", "rank": "0"}
    first = AgentMetrics(reg, {**ids, "local_rank": "0"})
    second = AgentMetrics(reg, {**ids, "rank": "1", "local_rank": "1"}, share=first)
    src = SdkSocketSource("/nonexistent/sdk.sock")  # never bound: counts only
    second.attach_sdk(src)
    src.received, src.dropped["range"] = 7, 2
    assert reg.get_sample_value("ftagent_sdk_datagrams_received_total",
                                second.labels()) == 7
    assert reg.get_sample_value("ftagent_sdk_datagrams_dropped_total",
                                second.labels(reason="range")) == 2
    assert reg.get_sample_value("ftagent_sdk_datagrams_received_total", first.labels()) == 0
    text = generate_latest(reg).decode()
    assert text.count("# HELP ftagent_sdk_datagrams_received_total ") == 1


def test_no_created_series(reg: CollectorRegistry, m: AgentMetrics) -> None:
    MetricsSink(m).on_fault(Fault(FaultKind.NIC, "down",
                                  evidence={"detection_latency_seconds": 0.1}))
    m.phase_duration.labels(**m.labels(phase="checkpoint")).observe(3)
    ArbiterMetrics(reg).decisions.labels(action="restart").inc()
    text = generate_latest(reg).decode()
    assert "_created" not in text
    assert "ftagent_faults_total{" in text and "ftagent_phase_duration_seconds_count{" in text


# --------------------------------------------------------------------------- progress per attempt


def test_a_new_attempt_hides_the_last_attempts_progress(m: AgentMetrics,
                                                        reg: CollectorRegistry) -> None:
    """Which attempt runs is read from the lifecycle at scrape time: the restart alone
    hides the last attempt's values, with no TrainerStart pushed to the sink."""
    life = Lifecycle()
    sink = MetricsSink(m, lifecycle=life)
    life.running(1)
    sink.observe(Progress(step=500, loss=0.25, samples_per_second=10.0, tokens_per_second=99.0,
                          tflops_per_gpu=120.0, samples=4, ts=1.0))
    assert value(reg, "ftagent_training_step") == 500
    life.exited(ProcessExit(pid=1, code=1, ts=2.0))
    assert value(reg, "ftagent_training_loss") == 0.25  # still the last value seen
    life.restart(Action(ActionKind.RESTART, "crash", origin=Origin.LOCAL))
    life.running(2)
    for name in ("ftagent_training_step", "ftagent_training_loss",
                 "ftagent_training_samples_per_second", "ftagent_training_tokens_per_second",
                 "ftagent_model_tflops_per_gpu"):
        assert value(reg, name) is None, name  # absent, not 0 (a loss of 0 looks great)
    assert value(reg, "ftagent_training_samples_total") == 4  # a counter: kept
    sink.observe(Progress(step=10, loss=0.5, ts=4.0))  # the new attempt restarts lower
    assert value(reg, "ftagent_training_step") == 10
    assert value(reg, "ftagent_training_loss") == 0.5
    assert value(reg, "ftagent_training_samples_per_second") is None  # not reported yet
    sink.observe(Progress(step=10, loss=9.0, ts=5.0))  # a redraw: no new progress
    assert value(reg, "ftagent_training_loss") == 0.5
    text = generate_latest(reg).decode()  # the families stay, with no stale sample
    assert "# TYPE ftagent_training_samples_per_second gauge" in text
    assert "ftagent_training_samples_per_second{" not in text


def test_the_lifecycles_facts_are_read_at_scrape_time(m: AgentMetrics,
                                                      reg: CollectorRegistry) -> None:
    """Running, generation, last exit status and restarts: what the lifecycle says when
    scraped, with no observation pushed to the sink (a spare that took a rank, a crash)."""
    life = Lifecycle(rank=-1, spare=True)
    MetricsSink(m, lifecycle=life)

    def page() -> dict[str, float]:
        facts = ("ftagent_trainer_running", "ftagent_trainer_last_exit_code",
                 "ftagent_job_generation", "ftagent_restarts_total")
        return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1])
                for ln in generate_latest(reg).decode().splitlines()
                if ln.split("{")[0] in facts}

    assert page() == {"ftagent_trainer_running": 0, "ftagent_trainer_last_exit_code": 0,
                      "ftagent_job_generation": 0, "ftagent_restarts_total": 0}
    life.assign(3, generation=2, restarts=1)  # the arbiter's ASSIGN
    life.running(41)
    assert page() == {"ftagent_trainer_running": 1, "ftagent_trainer_last_exit_code": 0,
                      "ftagent_job_generation": 2, "ftagent_restarts_total": 1}
    life.exited(ProcessExit(41, None, signal=9, ts=5.0))  # the crash
    assert page() == {"ftagent_trainer_running": 0, "ftagent_trainer_last_exit_code": 137,
                      "ftagent_job_generation": 2, "ftagent_restarts_total": 1}
    life.restart(Action(ActionKind.RESTART, "crash", origin=Origin.LOCAL))
    life.running(42)  # the last exit's status stays until the next exit
    assert page() == {"ftagent_trainer_running": 1, "ftagent_trainer_last_exit_code": 137,
                      "ftagent_job_generation": 3, "ftagent_restarts_total": 2}


def test_a_second_writer_of_a_fact_the_lifecycle_owns_is_refused(m: AgentMetrics) -> None:
    MetricsSink(m, lifecycle=Lifecycle())
    for child in (m.trainer_running, m.trainer_last_exit_code, m.generation):
        with pytest.raises(TypeError, match="at scrape time"):
            child.set(1)
        with pytest.raises(TypeError, match="at scrape time"):
            child.inc()
    with pytest.raises(TypeError, match="at scrape time"):
        m.restarts.inc()


def test_the_trainers_start_and_exit_are_not_routed_to_the_sink(m: AgentMetrics) -> None:
    """The watch loop hands the sink only what it reads: the lifecycle holds the rest."""
    from ftagent.watch.loop import _route

    sink = MetricsSink(m)
    assert _route([sink.observe], TrainerStart(pid=1, attempt=0)) == ()
    assert _route([sink.observe], ProcessExit(pid=1, code=3)) == ()
    assert _route([sink.observe], Progress(step=1)) == (sink.observe,)


def test_nan_loss_is_exported(m: AgentMetrics, reg: CollectorRegistry) -> None:
    MetricsSink(m).observe(Progress(step=1, loss=math.nan, ts=1.0))
    loss = value(reg, "ftagent_training_loss")
    assert loss is not None and math.isnan(loss)


# --------------------------------------------------------------------------- detection latency


def latency(reg: CollectorRegistry, kind: str) -> tuple[float | None, float | None]:
    return (value(reg, "ftagent_detection_latency_seconds_count", kind=kind),
            value(reg, "ftagent_detection_latency_seconds_sum", kind=kind))


def test_crash_latency_is_from_the_trainers_exit(m: AgentMetrics,
                                                 reg: CollectorRegistry) -> None:
    """The exit's time as the lifecycle holds it (no ProcessExit pushed to the sink)."""
    clock = Clock()
    life = Lifecycle()
    sink = MetricsSink(m, clock=clock, lifecycle=life)
    life.running(1)
    life.exited(ProcessExit(pid=1, code=3, ts=10.0))
    clock.t = 10.25  # output drained, leftover processes stopped: the fault is raised
    sink.on_fault(Fault(FaultKind.CRASH, "trainer exited with code 3",
                        evidence={"exit_status": 3}))
    assert latency(reg, "crash") == (1, pytest.approx(0.25))
    life.running(2)  # the next trainer runs: the last exit is not its crash's cause
    sink.on_fault(Fault(FaultKind.CRASH, "no exit of this trainer's seen"))
    assert latency(reg, "crash") == (1, pytest.approx(0.25))


def test_hang_latency_is_from_the_budgets_expiry(m: AgentMetrics,
                                                 reg: CollectorRegistry) -> None:
    """The real detector's fault: how far past the deadline its tick was, plus the time
    the evidence (py-spy) took before the fault was raised."""
    det = HangDetector(HangConfig(hang_first_step_timeout=30.0))
    det.observe(TrainerStart(pid=1, attempt=0, ts=100.0))
    assert det.deadline() == 130.0
    (fault,) = det.tick(130.4)  # the tick after the deadline
    assert fault.evidence["over_budget_seconds"] == pytest.approx(0.4)
    sink = MetricsSink(m, wall=lambda: fault.detected_at + 0.1)  # stacks took 0.1 s
    sink.on_fault(fault)
    assert latency(reg, "hang") == (1, pytest.approx(0.5))


def test_hang_latency_in_a_phase_counts_from_the_phases_deadline(
        m: AgentMetrics, reg: CollectorRegistry) -> None:
    det = HangDetector(HangConfig(hang_phase_timeout=60.0))
    det.observe(TrainerStart(pid=1, attempt=0, ts=0.0))
    det.observe(Progress(step=1, source="sdk", ts=5.0))
    det.observe(PhaseMarker("checkpoint", True, ts=500.0))  # long after the last step
    assert det.tick(560.0) == []
    (fault,) = det.tick(560.2)
    MetricsSink(m, wall=lambda: fault.detected_at).on_fault(fault)
    assert latency(reg, "hang") == (1, pytest.approx(0.2))


def test_nic_latency_is_the_detectors_and_recoveries_are_not_faults(
        m: AgentMetrics, reg: CollectorRegistry) -> None:
    sink = MetricsSink(m)
    sink.on_fault(Fault(FaultKind.NIC, "eth0 down", evidence={"detection_latency_seconds": 0.12}))
    sink.on_fault(Fault(FaultKind.NIC, "eth0 up", evidence={"recovered": True,
                                                             "detection_latency_seconds": 9.0}))
    assert latency(reg, "nic") == (1, pytest.approx(0.12))
    assert value(reg, "ftagent_faults_total", kind="nic") == 1


def test_latency_without_evidence_is_not_made_up(m: AgentMetrics,
                                                 reg: CollectorRegistry) -> None:
    sink = MetricsSink(m)
    sink.on_fault(Fault(FaultKind.CRASH, "no exit seen"))  # no ProcessExit before it
    sink.on_fault(Fault(FaultKind.HANG, "bad evidence",
                        evidence={"over_budget_seconds": math.inf}))
    sink.on_fault(Fault(FaultKind.GPU, "xid", evidence={"detection_latency_seconds": True}))
    for kind in ("crash", "hang", "gpu"):
        assert latency(reg, kind) == (None, None)  # no sample rather than a wrong one
        assert value(reg, "ftagent_faults_total", kind=kind) == 1


def test_snapshots_held_set_step_bytes_and_time(m: AgentMetrics, reg: CollectorRegistry) -> None:
    """ftagent.checkpoint's report: the newest complete step, its bytes, when it came (the
    age is time() minus it); the blocking copy is the "snapshot" phase's histogram."""
    from ftagent.model import PhaseTiming, SnapshotsHeld
    sink = MetricsSink(m, wall=lambda: 1234.5)
    sink.observe(SnapshotsHeld((10, 20), ts=1.0, nbytes=4096))
    sink.observe(PhaseTiming("snapshot", 0.002, ts=1.0))
    assert value(reg, "ftagent_snapshot_step") == 20
    assert value(reg, "ftagent_snapshot_bytes") == 4096
    assert value(reg, "ftagent_snapshot_timestamp_seconds") == 1234.5
    assert value(reg, "ftagent_phase_duration_seconds_count", phase="snapshot") == 1
