"""The one vocabulary every part of ftagent speaks: observation -> fault -> action.

Sources produce *observations* (facts), detectors turn observations into *faults*
(conclusions), and a policy (local, or the arbiter's) turns faults into *actions*
(decisions for the whole job). Everything here is a plain value: frozen dataclasses
that tests can build and compare, with ``to_dict`` for the events file and the wire.
``proto/ftagent/v1/ftagent.proto`` mirrors these types.
"""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any


class FaultKind(str, enum.Enum):
    """What went wrong, in the users' words."""

    CRASH = "crash"  # trainer exited non-zero or was killed by a signal
    HANG = "hang"  # no step progress within the learned budget
    GPU = "gpu"  # Xid, ECC, GPU lost, NVLink down
    NIC = "nic"  # link admin-down or carrier lost past the grace period
    NODE = "node"  # node NotReady, pod preempted
    BARRIER = "barrier"  # ranks did not meet after a restart
    AGENT = "agent"  # ftagent itself failed at something (never fatal to training)
    LOSS = "loss"  # the training loss went NaN/inf or spiked (an alert by default)
    STRAGGLER = "straggler"  # a rank slower in compute than the job's median (a warning)


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    FATAL = "fatal"  # hardware that will not heal by restarting in place


class Scope(str, enum.Enum):
    """How far a fault reaches: it decides whether a restart in place can help."""

    PROCESS = "process"
    POD = "pod"
    NODE = "node"
    JOB = "job"


class ActionKind(str, enum.Enum):
    """A decision for the whole job (see DESIGN.md, "Action")."""

    RESTART = "restart"  # every rank restarts its trainer in place, then meets at a barrier
    REPLACE = "replace"  # stop this rank's pod (distinct exit code); the others restart
    STOP = "stop"  # stop the trainer and exit with the given code
    ALERT_ONLY = "alert_only"  # record and alert; touch nothing
    DUMP_STACKS = "dump_stacks"  # capture py-spy stacks of the trainer tree and report them
    BUSY = "busy"  # the job is busy, not hung: record who is busy and who waits (``JobBusy``)
    # persist the newest complete snapshot now (a planned disruption of the node announced)
    LAST_WORDS = "last_words"


# Actions that leave the trainer running: carried out on the way (the decider's
# ``on_minor_action``), never the end of an attempt.
MINOR_ACTIONS = frozenset({ActionKind.ALERT_ONLY, ActionKind.DUMP_STACKS, ActionKind.BUSY,
                           ActionKind.LAST_WORDS})


class Origin(str, enum.Enum):
    """Who decided an Action: the arbiter for the job, or this agent's local policy alone
    (no arbiter, or failing open). An agent that decided alone exits with the trainer's
    own status, as without ftagent; the arbiter's STOP exits --exit-stop."""

    ARBITER = "arbiter"
    LOCAL = "local"


class TrainerState(str, enum.Enum):
    """The trainer's lifecycle as the supervisor sees it.

    ::

        INIT ──▶ WAITING ──▶ RUNNING ──exit 0──────────────────────▶ SUCCEEDED
                   ▲  (barrier)  │
                   │             ├─exit≠0 / signal / hang restart──▶ RESTARTING ──┐
                   │             │                                                │
                   └─────────────┼────────────────────────────────────────────────┘
                                 │        (restart budget left; backoff waited)
                                 ├─budget spent / STOP action─────▶ FAILED
                                 └─SIGTERM/SIGINT/SIGHUP to agent─▶ STOPPED

    WAITING is the time before a (re)start: the local policy's backoff, or the job
    barrier when an arbiter decides. FAILED and STOPPED exit with the trainer's code
    (128+N for signal N) so Kubernetes' restartPolicy sees the truth.
    """

    INIT = "init"
    WAITING = "waiting"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


def new_id() -> str:
    """A unique id; faults are re-sent until acknowledged, so ids make that idempotent."""
    return uuid.uuid4().hex


# --------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class LogLine:
    """One line of the trainer's output (without its newline), decoded leniently."""

    text: str
    stream: str = "stdout"  # "stdout" | "stderr"
    ts: float = 0.0  # monotonic seconds


@dataclass(frozen=True)
class Progress:
    """A training step completed (from a log line or the SDK)."""

    step: int
    loss: float | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    samples: int | None = None  # samples in this step (SDK)
    tokens: int | None = None  # tokens in this step (SDK)
    step_seconds: float | None = None  # the trainer's own measurement, if it prints one
    total_steps: int | None = None  # the run's last step, when the trainer prints N/total
    source: str = "log"  # "log" | "sdk" | the log format's name
    ts: float = 0.0
    tflops_per_gpu: float | None = None  # model TFLOP/s per GPU, when the trainer prints it
    # (step, loss) of earlier steps read in the same batch and folded into this one (their
    # intervals are buffering, not steps): the loss detector still judges each of them
    folded_losses: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PhaseMarker:
    """A declared long phase (checkpoint, eval) begins or ends."""

    phase: str
    begin: bool
    source: str = "log"
    ts: float = 0.0


@dataclass(frozen=True)
class CollectiveSample:
    """Timed collectives reported through the SDK (for algbw/busbw): one, or ``count`` of
    the same op, group size and power-of-two size bucket aggregated in the trainer
    (``ftagent.torch.instrument``), with ``nbytes`` and ``seconds`` their totals."""

    op: str
    nbytes: int
    seconds: float
    world_size: int
    ts: float = 0.0
    count: int = 1


@dataclass(frozen=True)
class Resumed:
    """The trainer says it resumed after ``step`` (loaded the checkpoint saved at that
    step: Megatron's "loaded checkpoint ... at iteration N", ``ftagent.resumed(N)``): the
    steps after it that the job had already done are redone. ``source``: "sdk" | the log
    format's name."""

    step: int
    source: str = "log"
    ts: float = 0.0
    origin: str = ""  # where the state came from: memory | peer | disk ("" : not said)


@dataclass(frozen=True)
class SnapshotsHeld:
    """The steps whose in-memory snapshot the trainer's rank holds complete
    (``ftagent.checkpoint``, SDK ``snapshots``): the arbiter's resume step is the newest
    step every rank holds."""

    steps: tuple[int, ...]
    ts: float = 0.0
    nbytes: int = 0  # the memory they take


@dataclass(frozen=True)
class PhaseTiming:
    """Time spent in one part of the training step (forward, backward, optimizer, data,
    or a Megatron timer), ``count`` occurrences totalling ``seconds``. Unlike a
    ``PhaseMarker`` it is a measurement after the fact, never a budget for the hang
    detector. ``source``: "sdk" (``ftagent.torch.instrument``) | "megatron" (timer lines)."""

    phase: str
    seconds: float
    count: int = 1
    source: str = "sdk"
    ts: float = 0.0


@dataclass(frozen=True)
class GpuEvent:
    """Something a GPU said (sources/gpu.py): an NVML event, a kernel-log Xid, a lost GPU.

    ``count`` occurrences coalesced into one (a flood reaches the loop as few events);
    ``ts`` is the first one's. ``source``: "nvml" | "kmsg" | "poll".
    """

    gpu: int
    kind: str  # "xid" | "ecc_dbe" | "lost" | "remap_failure" | "poison" | "recovery" | "sxid"
    xid: int | None = None
    detail: str = ""
    ts: float = 0.0
    count: int = 1
    source: str = "nvml"


SXID_UNKNOWN_DEVICE = "kmsg-unknown-device"
"""``GpuEvent.source`` of a kernel-log SXid whose PCI address is no NVIDIA device of this
host (sources/gpu.py): anyone who can make the kernel log text can write an SXid line, so
such an SXid is counted and never node-fatal; NVML's own NVLink checks of the GPUs
(inactive links, NVLink Xids) still raise their faults."""


@dataclass(frozen=True)
class GpuHealth:
    """One poll of a GPU's fault-relevant counters (None: that call is not supported)."""

    gpu: int
    ecc_uncorrected: int | None = None  # volatile double-bit (uncorrected) ECC errors
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_pending: bool | None = None  # page retirement, where rows are not remapped
    nvlink_down: tuple[int, ...] = ()  # links active at start that are inactive now
    nvlink_errors: int | None = None  # sum of the NVLink error counters
    clock_event_reasons: int | None = None  # NVML clocks event (throttle) reasons bitmask
    recovery_action: int | None = None  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    ts: float = 0.0


@dataclass(frozen=True)
class LinkEvent:
    """A network link's state, from netlink RTM_NEWLINK/RTM_DELLINK or the initial dump."""

    ifname: str
    admin_up: bool
    carrier: bool
    operstate: str = ""
    index: int = 0
    deleted: bool = False
    ts: float = 0.0

    @property
    def up(self) -> bool:
        return self.admin_up and self.carrier and not self.deleted


# ------------------------------------------------------------------------- readings
# What the sources know of a device and its counters, read by the detectors and by the
# metrics collectors at scrape time: values, here so that sources import no sink or detector.


@dataclass(frozen=True)
class GpuDevice:
    """A GPU the trainer may use, as NVML names it."""

    index: int
    uuid: str
    pci_bus_id: str  # NVML's form, 00000000:3B:00.0
    name: str
    mig: tuple[str, ...] = ()  # MIG device UUIDs of this GPU the trainer may use

    def describe(self) -> str:
        return f"GPU {self.index} ({self.name}, {self.uuid}, PCI {self.pci_bus_id})"


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


@dataclass(frozen=True)
class GpuReading:
    """One GPU read from NVML at scrape time (None: that call is not supported there)."""

    gpu: int
    uuid: str
    pci_bus_id: str
    model: str
    lost: bool = False
    temperature_celsius: float | None = None
    power_watts: float | None = None
    utilization: float | None = None  # 0..1, like DCGM's GPU_UTIL / 100
    memory_utilization: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    ecc_errors: tuple[int | None, int | None] = (None, None)  # volatile corrected, uncorrected
    remapped_rows: tuple[int, int, bool, bool] | None = None  # corr, uncorr, pending, failure
    retired_pages: tuple[int | None, int | None, bool | None] = (None, None, None)
    clock_event_reasons: int | None = None
    nvlink_up: tuple[tuple[int, bool], ...] = ()
    recovery_action: int | None = None


@dataclass(frozen=True)
class ProcessExit:
    """The trainer's main process exited."""

    pid: int
    code: int | None  # exit code, or None when killed by a signal
    signal: int | None = None
    ts: float = 0.0
    # derived once, at construction (plain attributes, read where used: no call per read)
    exit_status: int = field(init=False, compare=False)  # the shell's: code, or 128+N
    ok: bool = field(init=False, compare=False)  # exited 0, not killed

    def __post_init__(self) -> None:
        status = 128 + self.signal if self.signal is not None else \
            self.code if self.code is not None else 0
        object.__setattr__(self, "exit_status", status)
        object.__setattr__(self, "ok", self.signal is None and self.code == 0)


@dataclass(frozen=True)
class TrainerStart:
    """The supervisor started the trainer (attempt 0 is the first run)."""

    pid: int
    attempt: int
    generation: int = 0
    ts: float = 0.0


Observation = (
    LogLine | Progress | PhaseMarker | CollectiveSample | PhaseTiming | GpuEvent | GpuHealth
    | LinkEvent | ProcessExit | TrainerStart | Resumed | SnapshotsHeld
)


# --------------------------------------------------------------------------- faults and actions


@dataclass(frozen=True)
class Fault:
    """A detector's conclusion. ``evidence`` is JSON-serialisable structured detail."""

    kind: FaultKind
    message: str
    severity: Severity = Severity.ERROR
    scope: Scope = Scope.PROCESS
    evidence: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=new_id)
    detected_at: float = field(default_factory=time.time)  # wall clock, for humans/timelines

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        d["severity"] = self.severity.value
        d["scope"] = self.scope.value
        return d


@dataclass(frozen=True)
class JobBusy:
    """The arbiter's "job busy, no restart" verdict, as every rank receives it: ranks its
    own agents verified alive or spinning, the ranks waiting for them, and the spinning
    ranks the others wait on in a collective (they get the short culprit spin budget)."""

    busy_ranks: tuple[int, ...] = ()
    waiting_ranks: tuple[int, ...] = ()
    where: str = ""
    state: str = ""  # alive | spinning
    spin_culprits: tuple[int, ...] = ()


@dataclass(frozen=True)
class Action:
    """A decision: what the supervisor does next. ``generation`` is the job's new generation."""

    kind: ActionKind
    reason: str
    generation: int = 0
    exit_code: int | None = None  # for STOP/REPLACE: the code the agent exits with
    backoff_seconds: float = 0.0  # for RESTART: wait before starting again
    target_rank: int | None = None  # for REPLACE/DUMP_STACKS: None means every rank
    fault_id: str | None = None  # the fault this answers, if any
    id: str = field(default_factory=new_id)
    origin: Origin = Origin.ARBITER  # who decided (commands off the wire: the arbiter)
    busy: JobBusy | None = None  # for BUSY: who is busy, who waits
    # for an arbiter's RESTART: the job's restart count it makes (a rejoin is no new one);
    # the worker's lifecycle adopts it (agent/lifecycle.py). None: count one
    restarts: int | None = None
    # for an arbiter's RESTART: the newest step whose snapshot every rank holds (the
    # restarted trainer loads it: FTAGENT_RESUME_STEP). None: none known
    resume_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        d["origin"] = self.origin.value
        return d


# Exit statuses of an agent the arbiter's decision ended (defaults of --exit-replace and
# --exit-stop), chosen for the job controllers' rules: Kubeflow v1 restartPolicy ExitCode
# retries 128-255 and treats 1-127 as permanent; Job podFailurePolicy (and so JobSet's child
# Jobs) matches exact codes. REPLACE ("move this pod": hardware fault) is retryable and above
# 128+64, so it is never a signal death's 128+N; STOP ("the job is over") is permanent and
# no code a trainer commonly uses. See deploy/examples/ for the matching policies.
EXIT_REPLACE = 215
EXIT_STOP = 86
# The pod-level tiers of the recovery ladder (arbiter/ladder.py): an agent told to restart
# its container in place, or to reset its whole pod in place, exits with one of these; the
# webhook's container restart rules (KEP-5307 ``Restart``, KEP-5532 ``RestartAllContainers``)
# match them. Above 128+64 like EXIT_REPLACE, and retryable (128-255) where no rule matches
# (the gate off): the pod then fails and is replaced, the next tier down.
EXIT_RESTART_CONTAINER = 216
EXIT_RESET_POD = 217
IN_PLACE_EXITS = (EXIT_RESTART_CONTAINER, EXIT_RESET_POD)
