"""Every Prometheus series ftagent exports, declared in one place.

Names are ``ftagent_*`` in base units (``_seconds``, ``_bytes``, ``_total``). Agent series
carry the identity labels ``job_name, namespace, pod, node, rank`` (+ ``phase``, ``kind``,
``device``, ``direction``, ``op``); arbiter series describe the arbiter itself. The
training job is ``job_name`` (kube-state-metrics' name for it), never ``job``: Prometheus
sets ``job`` to the scrape job, and without ``honor_labels`` it would rename ours.

Values that already live in a source (NIC counters, RDMA ports) are read at scrape time
by collectors that call a snapshot function, instead of being copied into gauges.
Each agent/arbiter uses its own ``CollectorRegistry`` so several can live in one process.

Every label value that comes from input is bounded: ``phase`` and ``op`` names pass
through a ``LabelFold`` (the first ``MAX_PHASES`` / ``MAX_OPS`` distinct names, the rest
become ``other`` and are counted in ``ftagent_label_values_folded_total{label}``);
``kind`` is a ``FaultKind``; ``reason``, ``direction`` and ``action`` are fixed sets in the
code; NIC and RDMA devices are at most ``MAX_DEVICES`` per scrape. No ``_created``
series are exported (they doubled the counter and histogram series for a timestamp no
dashboard reads).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ftagent.model import FaultKind, GpuReading, IbPortStats, NicStats
from ftagent.wire.limits import MAX_OPS, MAX_PHASES, OTHER, LabelFold

log = logging.getLogger("ftagent.metrics")

IDENTITY_LABELS = ("job_name", "namespace", "pod", "node", "rank")

# Step times from ~1 ms (tiny CPU jobs) to ~10 min (huge models); phases longer.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Phases: from a forward pass of a small model (~1 ms, ftagent.torch.instrument) to an
# hour-long checkpoint or evaluation (declared phases).
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                 60, 120, 300, 600, 1800, 3600)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

MAX_DEVICES = 64
"""NICs and RDMA ports exported per scrape (sorted by name): a pod has a few, a node a few
dozen; a host with hundreds of veths matched by a broad ``--nic`` pattern must not make
the scrape grow with them."""

# What an SDK datagram can be dropped for (``ftagent/sources/sdk_socket.py``): a fixed set.
SDK_DROP_REASONS = ("oversize", "version", "malformed", "range", "name")

# Collective sizes as a label: power-of-two buckets (the bucket's lower bound in bytes,
# as nccl-tests sizes are powers of two), below 1 KiB and above 16 GiB clamped: 25 values.
SIZE_BUCKET_MIN, SIZE_BUCKET_MAX = 10, 34
SIZE_BUCKETS = tuple(str(1 << k) for k in range(SIZE_BUCKET_MIN, SIZE_BUCKET_MAX + 1))


def size_bucket(nbytes: int) -> str:
    """The ``size`` label of a collective of ``nbytes`` bytes: 2**floor(log2), clamped."""
    k = min(max(int(nbytes).bit_length() - 1, SIZE_BUCKET_MIN), SIZE_BUCKET_MAX)
    return SIZE_BUCKETS[k - SIZE_BUCKET_MIN]


def observe_many(child: Any, seconds: float, count: int) -> None:
    """``count`` observations totalling ``seconds`` on one histogram child, in O(1): the
    trainer aggregates (``ftagent.torch``), so ``_sum`` and ``_count`` stay exact (each
    lands in the bucket of the mean). Falls back to at most 64 ``observe`` calls if
    prometheus_client's internals ever change."""
    if count <= 0 or not seconds >= 0.0:
        return
    mean = seconds / count
    try:
        bounds, buckets, total = child._upper_bounds, child._buckets, child._sum
        i = next(i for i, b in enumerate(bounds) if mean <= b)
        total.inc(seconds)
        buckets[i].inc(count)
    except Exception:  # noqa: BLE001 - internals moved: approximate, bounded
        for _ in range(min(count, 64)):
            child.observe(mean)


# Hang verification (ftagent/agent/verify.py): its verdicts, and the places of undeclared
# phases it keeps learned at once (the `where` label's bound).
VERIFY_VERDICTS = ("alive", "spinning", "hung", "unknown", "recognised", "suspect", "waiting")
BUSY_ROLES = ("busy", "waiting", "culprit")  # agent/peer_wait.py
UNDECLARED_PLACES = 8

# prometheus_client reads this flag at collect time, for every registry in the process.
disable_created_metrics()


def busbw(op: str, nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s, as nccl-tests computes them (doc/PERFORMANCE.md):
    algbw = bytes / time; busbw = algbw × 2(n-1)/n for all_reduce, (n-1)/n for
    reduce_scatter, all_gather and all_to_all, 1 for broadcast, reduce and unknown ops.
    Torch's variants (``all_gather_into_tensor``, ``all_to_all_single``...) count as their
    base op. A zero or invalid time gives (0, 0)."""
    if not 0 < seconds < math.inf or nbytes < 0:
        return 0.0, 0.0
    n = max(int(n), 1)
    algbw = nbytes / seconds
    name = op.lower().replace("_", "").replace("-", "")
    if name.startswith("allreduce"):
        factor = 2.0 * (n - 1) / n
    elif name.startswith(("reducescatter", "allgather", "alltoall")):
        factor = (n - 1) / n
    else:
        factor = 1.0
    return algbw, algbw * factor


class SdkCounts(Protocol):
    """What the SDK socket source counts (``ftagent/sources/sdk_socket.py``)."""

    received: int
    dropped: dict[str, int]


@dataclass
class _Zero:
    received: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


_NO_SDK = _Zero()
SDK_FAMILY = "ftagent_sdk_datagrams"  # the collector's key among an agent's families


class SdkCollector(Collector):
    """``ftagent_sdk_datagrams_received_total`` and ``..._dropped_total{reason}``, read at
    scrape time from each worker's SDK source (the counts live there, once); every reason
    is exported from the start, at 0."""

    def __init__(self, labels: list[str]) -> None:
        self.labels = list(labels)
        self.sources: dict[tuple[str, ...], SdkCounts] = {}

    def attach(self, values: tuple[str, ...], source: SdkCounts) -> None:
        self.sources[values] = source

    def collect(self) -> Iterator[Any]:
        received = CounterMetricFamily("ftagent_sdk_datagrams_received",
                                       "Datagrams read from the SDK socket.", labels=self.labels)
        dropped = CounterMetricFamily("ftagent_sdk_datagrams_dropped",
                                      "SDK datagrams dropped as invalid, by reason.",
                                      labels=self.labels + ["reason"])
        for values, source in list(self.sources.items()):
            received.add_metric(list(values), source.received)
            counts = dict(source.dropped)
            for reason in SDK_DROP_REASONS:
                dropped.add_metric([*values, reason], counts.get(reason, 0))
        yield received
        yield dropped


# The current attempt's progress, per ``Progress`` field: (field, series, help).
PROGRESS_SERIES = (
    ("step", "ftagent_training_step", "Last training step seen."),
    ("loss", "ftagent_training_loss", "Last training loss seen."),
    ("samples_per_second", "ftagent_training_samples_per_second",
     "Training throughput in samples/s."),
    ("tokens_per_second", "ftagent_training_tokens_per_second",
     "Training throughput in tokens/s."),
    ("tflops_per_gpu", "ftagent_model_tflops_per_gpu",
     "Model TFLOP/s per GPU as the trainer reports it (Megatron's throughput per GPU)."),
)
PROGRESS_FAMILY = "ftagent_training_progress"  # the collector's key among an agent's families


def _no_attempt() -> object:
    return None


class AttemptProgress:
    """One worker's progress values and the attempt that reported them. ``attempt`` reads
    which attempt runs now from its owner (the worker's lifecycle, wired by the metrics
    sink): values an earlier attempt reported are not the current one's, so a new attempt
    needs no reset pushed when it starts."""

    def __init__(self) -> None:
        self.attempt: Callable[[], object] = _no_attempt
        # (attempt, values): replaced whole, so that a scrape (another thread) reads a pair
        self._held: tuple[object, dict[str, float]] = (None, {})

    def current(self) -> dict[str, float]:
        """The values the current attempt reported; none while it has reported nothing."""
        of, values = self._held
        return values if of == self.attempt() else {}

    def report(self, **values: float | None) -> None:
        """Values the current attempt reports (None: not reported): they replace its
        earlier ones; the first report of a new attempt starts from none."""
        now = self.attempt()
        of, held = self._held
        new = {k: float(v) for k, v in values.items() if v is not None}
        self._held = (now, {**held, **new} if of == now else new)


class ProgressCollector(Collector):
    """``PROGRESS_SERIES`` for each worker of a registry: its current attempt's values,
    read at scrape time. A series is absent until the attempt reports it: after a restart
    the last attempt's step, loss and throughput are gone until the new one reports its
    own (0 would read as step 0 and a loss of 0; a missing series leaves a gap, and
    ``sum``/``min`` over ranks stay right)."""

    def __init__(self, labels: list[str]) -> None:
        # as a labelled family's: docs/gen.py reads the labels of series with no sample here
        self._labelnames = tuple(labels)
        self.workers: dict[tuple[str, ...], AttemptProgress] = {}

    def collect(self) -> Iterator[Any]:
        families = [GaugeMetricFamily(name, doc, labels=list(self._labelnames))
                    for _, name, doc in PROGRESS_SERIES]
        for values, progress in list(self.workers.items()):
            try:
                held = progress.current()
            except Exception:  # a scrape must never fail because an owner did
                log.exception("attempt of the progress series failed")
                continue
            for (key, _, _), family in zip(PROGRESS_SERIES, families, strict=True):
                if key in held:
                    family.add_metric(list(values), held[key])
        yield from families


class AgentMetrics:
    """The per-agent series, bound to this agent's identity labels."""

    def __init__(self, registry: CollectorRegistry, identity: dict[str, str], *,
                 share: AgentMetrics | None = None) -> None:
        """``identity`` may add labels to IDENTITY_LABELS (the launcher's ``local_rank``);
        ``share``: another worker's metrics of the same pod, whose families (one per
        name in a registry) these series join with their own label values."""
        self.registry = registry
        self.identity = dict(identity)
        ids = list(IDENTITY_LABELS) + [k for k in identity if k not in IDENTITY_LABELS]
        self._families: dict[str, Any] = share._families if share is not None else {}
        fams = self._families

        def gauge(name: str, doc: str, extra: Iterable[str] = ()) -> Gauge:
            if name not in fams:
                fams[name] = Gauge(name, doc, ids + list(extra), registry=registry)
            return fams[name]

        def counter(name: str, doc: str, extra: Iterable[str] = ()) -> Counter:
            if name not in fams:
                fams[name] = Counter(name, doc, ids + list(extra), registry=registry)
            return fams[name]

        def hist(name: str, doc: str, buckets: tuple[float, ...],
                 extra: Iterable[str] = ()) -> Histogram:
            if name not in fams:
                fams[name] = Histogram(name, doc, ids + list(extra), buckets=buckets,
                                       registry=registry)
            return fams[name]

        i = self.identity
        self._ids = tuple(i[k] for k in ids)
        self._names = tuple(ids)  # the families' identity label names, in their order
        self._views: list[dict[str, str]] = []
        # -- bounded label values
        self.label_values_folded = counter(
            "ftagent_label_values_folded",
            "Label values folded into \"other\" past their cap (phase, op) or set (kind).",
            ["label"])

        def fold(label: str, cap: int, allowed: Iterable[str] | None = None) -> LabelFold:
            child = self.label_values_folded.labels(**i, label=label)
            return LabelFold(label, cap, allowed=allowed, on_fold=child.inc)

        self.phase_names = fold("phase", MAX_PHASES)
        self.op_names = fold("op", MAX_OPS)
        kinds = [k.value for k in FaultKind]
        self.folds = {"phase": self.phase_names, "op": self.op_names,
                      "kind": fold("kind", len(kinds), kinds),
                      # where an undeclared phase ran (agent/verify.py keeps at most 8)
                      "where": fold("where", UNDECLARED_PLACES)}
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
        self.standby_memory = gauge(
            "ftagent_standby_memory_bytes",
            "Proportional set size (PSS) of the warm standby interpreters kept for the next "
            "restart; host memory counted against the pod's limit (0: none, "
            "--no-warm-restart).").labels(**i)
        self.spare = gauge(
            "ftagent_spare",
            "1 while this agent serves as its job's warm spare (--spare): a warm standby, "
            "no trainer, no rank yet (its rank label is not its rank then).").labels(**i)
        # -- in-memory snapshots (ftagent.checkpoint; the blocking copy's seconds are
        # ftagent_phase_duration_seconds{phase="snapshot"})
        self.snapshot_step = gauge(
            "ftagent_snapshot_step",
            "Newest step whose in-memory snapshot this rank's trainer holds complete.").labels(**i)
        self.snapshot_bytes = gauge(
            "ftagent_snapshot_bytes",
            "Memory this rank's complete in-memory snapshots take (tmpfs: counted against "
            "the pod's limit).").labels(**i)
        self.snapshot_timestamp = gauge(
            "ftagent_snapshot_timestamp_seconds",
            "Unix time the newest snapshot was reported complete (its age: time() - this)."
        ).labels(**i)
        self.snapshot_replica_lag = gauge(
            "ftagent_snapshot_replica_lag_steps",
            "Steps between the newest snapshot this rank's trainer holds and the newest one "
            "copied to its peer replica (0: replicated; grows while the copy falls behind "
            "or its holder refuses).").labels(**i)
        # -- progress
        # the current attempt's step, loss and throughput (PROGRESS_SERIES): one collector
        # per registry, read at scrape time; each worker's under its identity
        if PROGRESS_FAMILY not in fams:
            fams[PROGRESS_FAMILY] = ProgressCollector(ids)
            registry.register(fams[PROGRESS_FAMILY])
        self._progress: ProgressCollector = fams[PROGRESS_FAMILY]
        self.progress = AttemptProgress()
        self._progress.workers[self._ids] = self.progress
        self.samples = counter("ftagent_training_samples",
                               "Samples processed (SDK-reported).").labels(**i)
        self.tokens = counter("ftagent_training_tokens",
                              "Tokens processed (SDK-reported).").labels(**i)
        self.step_duration = hist(
            "ftagent_step_duration_seconds", "Time between consecutive steps.",
            STEP_BUCKETS).labels(**i)
        self.phase_duration = hist(
            "ftagent_phase_duration_seconds",
            "Duration of declared phases (checkpoint, eval) and of the parts of a step "
            "(forward, backward, optimizer, data: ftagent.torch.instrument; Megatron's "
            "timers from its log).", PHASE_BUCKETS, ["phase"])
        self.seconds_since_progress = gauge(
            "ftagent_seconds_since_progress", "Seconds since the last step progress.").labels(**i)
        self.hang = gauge(
            "ftagent_hang",
            "1 while a hang is declared (verified, or on the budget when verification is "
            "off or failed); 0 while it is only suspected: see ftagent_hang_suspected."
        ).labels(**i)
        self.hang_suspected = gauge(
            "ftagent_hang_suspected",
            "1 while a hang is suspected but not declared: the step budget ran out and the "
            "verification is judging it, or this rank was verified waiting in a collective "
            "and the arbiter is comparing the ranks. Not an alert on its own: most "
            "suspicions are verified alive.").labels(**i)
        self.hang_budget = gauge(
            "ftagent_hang_budget_seconds",
            "Current budget for the next step before a hang is declared.").labels(**i)
        self.hang_verifications = counter(
            "ftagent_hang_verifications",
            "Suspected hangs verified, by verdict (alive, spinning, hung, unknown, recognised: "
            "a learned undeclared phase, no window; suspect: waiting in a collective, the "
            "arbiter asked; waiting: on a rank the arbiter judged busy; waiting_on_io: blocked "
            "on a remote read; frozen: stopped or in D; dead_still: blocked in a phase; "
            "undecided: contradicting evidence).", ["verdict"])
        self.waiting_on_busy_peer = gauge(
            "ftagent_waiting_on_busy_peer",
            "1 while this rank's trainer waits in a collective on a rank the arbiter judged "
            "busy, not hung (a silent checkpoint, an evaluation): waiting, not hanging; 0 "
            "once steps resume.").labels(**i)
        self.busy_verdicts = counter(
            "ftagent_busy_verdicts",
            "The arbiter's \"job busy, no restart\" verdicts this rank received, by its part "
            "in them: busy (verified alive or spinning), waiting (on a busy rank), culprit "
            "(spinning while the others wait on it: --hang-culprit-spin-timeout applies).",
            ["role"])
        self.undeclared_phases = counter(
            "ftagent_undeclared_phases",
            "Stalls over the hang budget that were not hangs: undeclared long phases "
            "(an evaluation printing nothing), learned.").labels(**i)
        self.undeclared_phase_budget = gauge(
            "ftagent_undeclared_phase_budget_seconds",
            "Budget learned for an undeclared phase, by where its stack runs (at most "
            f"{UNDECLARED_PLACES} places per agent).", ["where"])
        self.detection_latency = hist(
            "ftagent_detection_latency_seconds",
            "From the fault's cause (exit, last progress, link change) to its detection.",
            LATENCY_BUCKETS, ["kind"])
        self.log_lines_skipped = counter(  # reason: a constant of the agent's, not input
            "ftagent_log_lines_skipped",
            "Trainer output lines not parsed for progress (they still pass through), by "
            "reason: backlog (the agent fell behind), budget (parsing sampled), too_long, "
            "error.", ["reason"])
        # -- collectives (SDK)
        self.collective_seconds = hist(
            "ftagent_collective_duration_seconds", "Duration of reported collectives "
            "(op all_reduce_ddp: DDP's reducer timer on a sampled step, 1 in 10 on CPU, 1 in "
            "100 on CUDA, shared among the buckets by bytes; counts and bytes exact).",
            LATENCY_BUCKETS, ["op"])
        self.collective_algbw = gauge(
            "ftagent_collective_algbw_bytes_per_second",
            "Algorithm bandwidth of the last report of an op and size bucket (power of two, "
            "in bytes): bytes / seconds.", ["op", "size"])
        self.collective_busbw = gauge(
            "ftagent_collective_busbw_bytes_per_second",
            "Bus bandwidth of the last report of an op and size bucket (nccl-tests "
            "factors; all_reduce_ddp: the sampled step's overall reduction bandwidth).",
            ["op", "size"])
        # -- the SDK socket (its receiver range-checks every datagram)
        #    counted by the source, read at scrape time: one collector per registry, each
        #    worker's source under its identity; at 0 until a source is attached
        if SDK_FAMILY not in fams:
            fams[SDK_FAMILY] = SdkCollector(ids)
            registry.register(fams[SDK_FAMILY])
        self._sdk: SdkCollector = fams[SDK_FAMILY]
        self._sdk.attach(self._ids, _NO_SDK)

        self.info.labels(**i, version=_version()).set(1)
        self.faults_by_kind = lambda kind: self.faults.labels(**self.labels(kind=kind))

    def share_identity(self, view: dict[str, str]) -> None:
        """``view``: the same identity labels held elsewhere (the node's GPU and NIC
        collectors read theirs at scrape time); ``relabel`` keeps it in step."""
        self._views.append(view)

    def relabel(self, **changes: str) -> None:
        """Move every series of this agent to new identity label values, keeping what each
        counted: a warm spare that the arbiter assigned a rank exports as that rank from
        now on (its ``rank`` label was "-1", and a dashboard per rank would miss it)."""
        if not changes:
            return
        unknown = set(changes) - set(self.identity)
        if unknown:
            raise ValueError(f"not identity labels: {sorted(unknown)}")
        old = self._ids
        self.identity.update(changes)
        new = tuple(self.identity[k] for k in self._names)
        n = len(old)
        for fam in self._families.values():
            children = getattr(fam, "_metrics", None)  # prometheus_client's labelled children
            if children is None:
                continue
            with fam._lock:
                for key in [k for k in children if tuple(k[:n]) == old]:
                    children[new + tuple(key[n:])] = children.pop(key)
        if old in self._sdk.sources:
            self._sdk.sources[new] = self._sdk.sources.pop(old)
        if old in self._progress.workers:
            self._progress.workers[new] = self._progress.workers.pop(old)
        self._ids = new
        for view in self._views:
            view.update(changes)

    def attach_sdk(self, source: SdkCounts) -> None:
        """Export ``source``'s datagram counts (the SDK socket's own) under this identity."""
        self._sdk.attach(self._ids, source)

    def labels(self, **extra: str) -> dict[str, str]:
        """Identity labels plus ``extra``, for series with additional labels: the one door
        for label values from input, so each is folded through its ``LabelFold``. A label
        without one is a programming error (add a fold, or a fixed set)."""
        out = dict(self.identity)
        for k, v in extra.items():
            out[k] = self.folds[k](v) if k in self.folds else _fixed(k, v)
        return out

    def observe_phase(self, phase: str, seconds: float, count: int = 1) -> None:
        """``count`` occurrences of a step's part (``PhaseTiming``) totalling ``seconds``."""
        observe_many(self.phase_duration.labels(**self.labels(phase=phase)), seconds, count)

    def observe_collectives(self, op: str, nbytes: int, seconds: float, world_size: int,
                            count: int = 1) -> None:
        """``count`` collectives (``CollectiveSample``) of ``nbytes`` and ``seconds`` in
        total: their duration histogram, and algbw/busbw of the op and size bucket (of the
        mean size: the trainer aggregates within one bucket) from the totals."""
        count = max(int(count), 1)
        algbw, bus = busbw(op, nbytes, seconds, world_size)
        labels = self.labels(op=op)  # folded once for the three series
        observe_many(self.collective_seconds.labels(**labels), seconds, count)
        sized = {**labels, "size": size_bucket(nbytes // count)}
        self.collective_algbw.labels(**sized).set(algbw)
        self.collective_busbw.labels(**sized).set(bus)


_FIXED_LABELS = {"reason": SDK_DROP_REASONS, "label": ("phase", "op", "kind"),
                 "direction": ("receive", "transmit"), "verdict": VERIFY_VERDICTS,
                 "role": BUSY_ROLES,
                 "size": SIZE_BUCKETS}


def _fixed(label: str, value: str) -> str:
    allowed = _FIXED_LABELS.get(label)
    if allowed is None:
        raise ValueError(f"label {label!r} has no bound: give it a LabelFold or a fixed set")
    return value if value in allowed else OTHER


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
        self.cordons = Counter("ftagent_arbiter_cordons",
                               "Nodes cordoned and tainted by this arbiter (--kube), by node "
                               "and fault kind.", ["node", "kind"], registry=registry)
        self.cordons_skipped = Counter(
            "ftagent_arbiter_cordons_skipped",
            "Cordons the circuit breaker skipped (--max-cordon-fraction, --max-cordons): the "
            "pods were still replaced.", registry=registry)
        self.uncordons = Counter(
            "ftagent_arbiter_uncordons",
            "Nodes this arbiter uncordoned (its own cordon, --uncordon-after: the node agent "
            "reported the node healthy that long), by node.", ["node"], registry=registry)
        self.cordons_held = Gauge(
            "ftagent_arbiter_cordons_held",
            "Nodes ftagent holds cordoned now (its annotation on a node still unschedulable, "
            "from the node watch): what the circuit breaker counts.", registry=registry)
        self.actions_failed = Counter(
            "ftagent_arbiter_actions_failed",
            "Cluster actions of a decision that could not be carried out (refused by RBAC, "
            "retries spent, an error), by action: cordon, delete_pod, force_delete.",
            ["action"], registry=registry)
        self.leader = Gauge(
            "ftagent_arbiter_leader", "1 while this replica leads: holds the Lease "
            "(--leader-elect), or runs without leader election.", registry=registry)

    def watch_jobs(self, snapshot: Callable[[], Iterable[JobSnapshot]]) -> None:
        """Export every job ``snapshot`` returns at scrape time (``JobCollector``)."""
        self.registry.register(JobCollector(snapshot))


# The states ftagent_job_state has a series for (one is 1, the others 0), as
# kube-state-metrics does: "gone" is a job none of whose agents is left, unfinished.
JOB_STATES = ("starting", "running", "restarting", "stopped", "succeeded", "gone")


@dataclass(frozen=True)
class JobSnapshot:
    """One job as the arbiter's registry holds it (live or from history), per scrape."""

    job: str
    namespace: str
    state: str  # one of JOB_STATES
    generation: int
    restarts: int
    restarts_by_reason: dict[str, int]  # fault kind (or "other") -> restarts decided
    seconds_lost: float
    expected: int
    connected: int
    running: int
    # Ranks named stragglers and still slow (arbiter/straggler.py): (rank, node).
    stragglers: tuple[tuple[int, str], ...] = ()
    # The goodput ledger (arbiter/ledger.py): seconds per category (monotone, as
    # exported) and the effective training time ratio (None: no wall time yet).
    goodput: tuple[tuple[str, float], ...] = ()
    goodput_ratio: float | None = None
    # Decisions (restart, replace, stop) that named each rank a culprit: (rank, count);
    # rank -1 counts the ranks past the job's first 64 (history.CULPRIT_RANKS_KEPT).
    culprits: tuple[tuple[int, int], ...] = ()


class JobCollector(Collector):
    """Per job series, read from the registry at scrape time (not copied into gauges).

    Bounded by the jobs the registry holds (live ones until FORGET_AFTER, then history
    until --history-retention, at most MAX_PAST_JOBS of those); ``reason`` is a
    ``FaultKind`` value, ``other`` (a restart without a fault, e.g. a hang probe) or
    ``unknown`` (restarts an earlier arbiter decided, learnt from the agents' Hellos).
    """

    def __init__(self, snapshot: Callable[[], Iterable[JobSnapshot]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        job = ["job_name", "namespace"]
        state = GaugeMetricFamily("ftagent_job_state", "1 for the job's current state.",
                                  labels=job + ["state"])
        gen = GaugeMetricFamily("ftagent_job_generation", "The job's generation (restarts "
                                "in place move it up).", labels=job)
        restarts = CounterMetricFamily("ftagent_job_restarts", "Restarts of the job decided, "
                                       "by the kind of fault that caused them.",
                                       labels=job + ["reason"])
        ranks = GaugeMetricFamily("ftagent_job_ranks", "Ranks expected (world size), with "
                                  "an agent connected, and training.", labels=job + ["kind"])
        lost = CounterMetricFamily("ftagent_job_seconds_lost_to_faults", "Seconds from a "
                                   "fault's arrival to every rank training again (the next "
                                   "generation's barrier release), summed.", labels=job)
        stragglers = GaugeMetricFamily("ftagent_job_stragglers", "Ranks named stragglers "
                                       "(slow in their own work per step) and still slow.",
                                       labels=job)
        straggler = GaugeMetricFamily("ftagent_rank_straggler", "1 for each rank named a "
                                      "straggler and still slow.",
                                      labels=job + ["rank", "node"])
        goodput = CounterMetricFamily(
            "ftagent_job_goodput_seconds", "The job's wall time by where it went: startup, "
            "productive (steps kept), recomputed (steps redone after a restart), detection, "
            "decision (and barrier), restart, checkpoint and other_phases (declared "
            "phases), straggler (waiting on a slow rank), capacity (a replacement pod "
            "waiting for a node), outage (stalled on a link outage that restarted "
            "nothing), preflight (the checks before a barrier), unattributed. "
            "Productive holds its highest value when time moves out of it.",
            labels=job + ["category"])
        ratio = GaugeMetricFamily("ftagent_job_goodput_ratio", "Effective training time "
                                  "ratio: productive seconds over the job's wall time.",
                                  labels=job)
        culprits = CounterMetricFamily(
            "ftagent_job_culprits", "Decisions (restart, replace, stop) that named the rank "
            "a culprit: a hang's culprits, the crashed or replaced rank. rank=\"other\" "
            "counts the ranks past the job's first 64 named.", labels=job + ["rank"])
        try:
            for j in self.snapshot():
                lv = [j.job, j.namespace]
                for st in JOB_STATES:
                    state.add_metric(lv + [st], 1.0 if st == j.state else 0.0)
                gen.add_metric(lv, j.generation)
                by = dict(j.restarts_by_reason)
                seen = sum(by.values())
                if j.restarts > seen:
                    by["unknown"] = by.get("unknown", 0) + j.restarts - seen
                for reason in sorted(by):
                    restarts.add_metric(lv + [reason], by[reason])
                ranks.add_metric(lv + ["expected"], j.expected)
                ranks.add_metric(lv + ["connected"], j.connected)
                ranks.add_metric(lv + ["running"], j.running)
                lost.add_metric(lv, j.seconds_lost)
                stragglers.add_metric(lv, len(j.stragglers))
                for rank, node in j.stragglers:
                    straggler.add_metric(lv + [str(rank), node], 1.0)
                for category, seconds in j.goodput:
                    goodput.add_metric(lv + [category], seconds)
                if j.goodput_ratio is not None:
                    ratio.add_metric(lv, j.goodput_ratio)
                for rank, count in j.culprits:
                    culprits.add_metric(lv + [str(rank) if rank >= 0 else OTHER], count)
        except Exception:  # a scrape must never fail because the registry did
            log.exception("job snapshot failed")
        yield from (state, gen, restarts, ranks, lost, stragglers, straggler, goodput, ratio,
                    culprits)


# --------------------------------------------------------------------------- scrape-time collectors


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
            for n in islice(self.nics(), MAX_DEVICES):
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
            for p in islice(self.ib_ports(), MAX_DEVICES):
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


# NVML clocks event (throttle) reasons, as ftagent_gpu_clock_event_reason{reason} 0/1
CLOCK_EVENT_REASONS = (
    ("gpu_idle", 0x1), ("applications_clocks", 0x2), ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8), ("sync_boost", 0x10), ("sw_thermal", 0x20), ("hw_thermal", 0x40),
    ("hw_power_brake", 0x80), ("display_clock", 0x100))
MAX_GPUS = 64  # GPUs exported per scrape (NVML's own limit on a node)
MAX_XID_SERIES = 512  # (GPU, Xid) pairs exported per scrape


class GpuCollector(Collector):
    """DCGM-exporter-like GPU series (labels ``accelerator``, ``gpu``, ``UUID``,
    ``pci_bus_id``, ``modelName``): NVML values read at scrape time, Xid counts and health
    from the GPU detector, NVML event counts from the source. Ascend NPUs and Kunlunxin
    XPUs (sources/accel.py) fill the same families: ``accelerator`` says which, ``gpu`` is
    the device index, ``UUID`` its serial, and ``xid`` the vendor's error code as
    ``code_label`` writes it (Ascend: 8 hex digits)."""

    def __init__(self, identity: dict[str, str], readings: Callable[[], Iterable[GpuReading]],
                 xids: Callable[[], dict[tuple[int, int], int]],
                 healthy: Callable[[int], bool],
                 events: Callable[[], dict[tuple[int, str], int]] = dict,
                 accelerator: str = "nvidia",
                 code_label: Callable[[int], str] = str) -> None:
        self.identity = identity
        self.readings = readings
        self.xids = xids
        self.healthy = healthy
        self.events = events
        self.accelerator = accelerator
        self.code_label = code_label

    def collect(self) -> Iterator[Any]:
        ids = list(self.identity) + ["accelerator", "gpu", "UUID", "pci_bus_id", "modelName"]
        vals = list(self.identity.values()) + [self.accelerator]
        fams: dict[str, Any] = {}

        def fam(kind: type[Any], name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            if name not in fams:
                fams[name] = kind(name, doc, labels=ids + list(extra))
            return fams[name]

        G, C = GaugeMetricFamily, CounterMetricFamily
        fam(G, "ftagent_gpu_healthy", "1 unless the GPU has a fault that a restart in place "
            "does not cure (lost, uncorrected ECC, row remap, an Xid asking for a reset).")
        fam(C, "ftagent_gpu_xid_errors", "Xid errors seen (NVML events and the kernel log; "
            "one occurrence seen by both counts once).", ("xid",))
        labels_of: dict[int, list[str]] = {}
        try:
            for r in list(self.readings())[:MAX_GPUS]:
                lv = vals + [str(r.gpu), r.uuid, r.pci_bus_id, r.model]
                labels_of[r.gpu] = lv
                fams["ftagent_gpu_healthy"].add_metric(lv, float(self.healthy(r.gpu)
                                                                 and not r.lost))
                self._reading(fam, lv, r)
            for (gpu, xid), n in sorted(self.xids().items())[:MAX_XID_SERIES]:
                if gpu >= 0 and gpu in labels_of:
                    fams["ftagent_gpu_xid_errors"].add_metric(
                        labels_of[gpu] + [self.code_label(xid)], n)
                elif gpu < 0:
                    fam(C, "ftagent_nvswitch_sxid_errors", "NVSwitch SXid errors seen in the "
                        "kernel log.", ("sxid",)).add_metric(
                            vals + ["", "", "", "NVSwitch", str(xid)], n)
            for (gpu, kind), n in sorted(self.events().items()):
                if gpu in labels_of:
                    fam(C, "ftagent_gpu_nvml_events", "NVML events received, by type.",
                        ("type",)).add_metric(labels_of[gpu] + [kind], n)
        except Exception:  # a scrape must never fail because a source did
            log.exception("GPU snapshot failed")
        yield from fams.values()

    @staticmethod
    def _reading(fam: Callable[..., Any], lv: list[str], r: GpuReading) -> None:
        G, C = GaugeMetricFamily, CounterMetricFamily

        def gauge(name: str, doc: str, value: float | None) -> None:
            if value is not None:
                fam(G, name, doc).add_metric(lv, float(value))

        gauge("ftagent_gpu_temperature_celsius", "GPU temperature.", r.temperature_celsius)
        gauge("ftagent_gpu_power_watts", "Power draw.", r.power_watts)
        gauge("ftagent_gpu_utilization_ratio", "Fraction of time a kernel ran (0-1).",
              r.utilization)
        gauge("ftagent_gpu_memory_utilization_ratio", "Fraction of time memory was read or "
              "written (0-1).", r.memory_utilization)
        gauge("ftagent_gpu_memory_used_bytes", "Frame buffer memory used.", r.memory_used_bytes)
        gauge("ftagent_gpu_memory_total_bytes", "Frame buffer memory.", r.memory_total_bytes)
        gauge("ftagent_gpu_recovery_action", "The driver's recovery action (0 none, 1 GPU "
              "reset, 2 node reboot, 3 drain P2P, 4 drain and reset, ...).", r.recovery_action)
        for kind, n in zip(("corrected", "uncorrected"), r.ecc_errors, strict=True):
            if n is not None:
                fam(C, "ftagent_gpu_ecc_errors", "ECC errors since the last driver "
                    "reload/reset (volatile).", ("type",)).add_metric(lv + [kind], n)
        if r.remapped_rows is not None:
            corr, unc, pending, failure = r.remapped_rows
            rows = fam(C, "ftagent_gpu_remapped_rows", "Rows remapped, by the error that "
                       "caused it.", ("type",))
            rows.add_metric(lv + ["corrected"], corr)
            rows.add_metric(lv + ["uncorrected"], unc)
            gauge("ftagent_gpu_row_remap_pending", "1 while a remap waits for a GPU reset.",
                  pending)
            gauge("ftagent_gpu_row_remap_failure", "1 if a row remap failed.", failure)
        sbe, dbe, pending_pages = r.retired_pages
        for cause, n in (("sbe", sbe), ("dbe", dbe)):
            if n is not None:
                fam(G, "ftagent_gpu_retired_pages", "Retired pages (GPUs without row "
                    "remapping), by cause.", ("cause",)).add_metric(lv + [cause], n)
        gauge("ftagent_gpu_retired_pages_pending", "1 while a page retirement waits for a "
              "reset.", pending_pages)
        if r.clock_event_reasons is not None:
            reasons = fam(G, "ftagent_gpu_clock_event_reason", "1 while this reason holds "
                          "the clocks down (throttling).", ("reason",))
            for name, bit in CLOCK_EVENT_REASONS:
                reasons.add_metric(lv + [name], float(bool(r.clock_event_reasons & bit)))
        for link, up in r.nvlink_up:
            fam(G, "ftagent_gpu_nvlink_up", "1 while the NVLink link is active.",
                ("link",)).add_metric(lv + [str(link)], float(up))


def _version() -> str:
    from ftagent import __version__

    return __version__
