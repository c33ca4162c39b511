from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FaultKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAULT_KIND_UNSPECIFIED: _ClassVar[FaultKind]
    FAULT_KIND_CRASH: _ClassVar[FaultKind]
    FAULT_KIND_HANG: _ClassVar[FaultKind]
    FAULT_KIND_GPU: _ClassVar[FaultKind]
    FAULT_KIND_NIC: _ClassVar[FaultKind]
    FAULT_KIND_NODE: _ClassVar[FaultKind]
    FAULT_KIND_BARRIER: _ClassVar[FaultKind]
    FAULT_KIND_AGENT: _ClassVar[FaultKind]
    FAULT_KIND_LOSS: _ClassVar[FaultKind]
    FAULT_KIND_STRAGGLER: _ClassVar[FaultKind]

class Severity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEVERITY_UNSPECIFIED: _ClassVar[Severity]
    SEVERITY_INFO: _ClassVar[Severity]
    SEVERITY_WARNING: _ClassVar[Severity]
    SEVERITY_ERROR: _ClassVar[Severity]
    SEVERITY_FATAL: _ClassVar[Severity]

class Scope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCOPE_UNSPECIFIED: _ClassVar[Scope]
    SCOPE_PROCESS: _ClassVar[Scope]
    SCOPE_POD: _ClassVar[Scope]
    SCOPE_NODE: _ClassVar[Scope]
    SCOPE_JOB: _ClassVar[Scope]

class CommandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_KIND_UNSPECIFIED: _ClassVar[CommandKind]
    COMMAND_KIND_RESTART: _ClassVar[CommandKind]
    COMMAND_KIND_STOP: _ClassVar[CommandKind]
    COMMAND_KIND_RELEASE_BARRIER: _ClassVar[CommandKind]
    COMMAND_KIND_DUMP_STACKS: _ClassVar[CommandKind]
    COMMAND_KIND_REPLACE: _ClassVar[CommandKind]
    COMMAND_KIND_BUSY: _ClassVar[CommandKind]
    COMMAND_KIND_ASSIGN: _ClassVar[CommandKind]
    COMMAND_KIND_SPARE: _ClassVar[CommandKind]
    COMMAND_KIND_LAST_WORDS: _ClassVar[CommandKind]
FAULT_KIND_UNSPECIFIED: FaultKind
FAULT_KIND_CRASH: FaultKind
FAULT_KIND_HANG: FaultKind
FAULT_KIND_GPU: FaultKind
FAULT_KIND_NIC: FaultKind
FAULT_KIND_NODE: FaultKind
FAULT_KIND_BARRIER: FaultKind
FAULT_KIND_AGENT: FaultKind
FAULT_KIND_LOSS: FaultKind
FAULT_KIND_STRAGGLER: FaultKind
SEVERITY_UNSPECIFIED: Severity
SEVERITY_INFO: Severity
SEVERITY_WARNING: Severity
SEVERITY_ERROR: Severity
SEVERITY_FATAL: Severity
SCOPE_UNSPECIFIED: Scope
SCOPE_PROCESS: Scope
SCOPE_POD: Scope
SCOPE_NODE: Scope
SCOPE_JOB: Scope
COMMAND_KIND_UNSPECIFIED: CommandKind
COMMAND_KIND_RESTART: CommandKind
COMMAND_KIND_STOP: CommandKind
COMMAND_KIND_RELEASE_BARRIER: CommandKind
COMMAND_KIND_DUMP_STACKS: CommandKind
COMMAND_KIND_REPLACE: CommandKind
COMMAND_KIND_BUSY: CommandKind
COMMAND_KIND_ASSIGN: CommandKind
COMMAND_KIND_SPARE: CommandKind
COMMAND_KIND_LAST_WORDS: CommandKind

class AgentMessage(_message.Message):
    __slots__ = ("job", "hello", "progress", "fault", "arrival", "exit", "ack", "stacks", "snapshots")
    JOB_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    job: str
    hello: Hello
    progress: ProgressSummary
    fault: Fault
    arrival: BarrierArrival
    exit: TrainerExit
    ack: Ack
    stacks: Stacks
    snapshots: SnapshotReport
    def __init__(self, job: _Optional[str] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., progress: _Optional[_Union[ProgressSummary, _Mapping]] = ..., fault: _Optional[_Union[Fault, _Mapping]] = ..., arrival: _Optional[_Union[BarrierArrival, _Mapping]] = ..., exit: _Optional[_Union[TrainerExit, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., stacks: _Optional[_Union[Stacks, _Mapping]] = ..., snapshots: _Optional[_Union[SnapshotReport, _Mapping]] = ...) -> None: ...

class SnapshotReport(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, steps: _Optional[_Iterable[int]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("job", "namespace", "pod", "node", "rank", "world_size", "restart_count", "generation", "agent_version", "max_restarts", "alert_only", "released_generation", "state", "agent_instance", "trainer_running", "gpus", "spare", "replica_port")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    ALERT_ONLY_FIELD_NUMBER: _ClassVar[int]
    RELEASED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RUNNING_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PORT_FIELD_NUMBER: _ClassVar[int]
    job: str
    namespace: str
    pod: str
    node: str
    rank: int
    world_size: int
    restart_count: int
    generation: int
    agent_version: str
    max_restarts: int
    alert_only: bool
    released_generation: int
    state: str
    agent_instance: str
    trainer_running: bool
    gpus: _containers.RepeatedScalarFieldContainer[str]
    spare: bool
    replica_port: int
    def __init__(self, job: _Optional[str] = ..., namespace: _Optional[str] = ..., pod: _Optional[str] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., restart_count: _Optional[int] = ..., generation: _Optional[int] = ..., agent_version: _Optional[str] = ..., max_restarts: _Optional[int] = ..., alert_only: _Optional[bool] = ..., released_generation: _Optional[int] = ..., state: _Optional[str] = ..., agent_instance: _Optional[str] = ..., trainer_running: _Optional[bool] = ..., gpus: _Optional[_Iterable[str]] = ..., spare: _Optional[bool] = ..., replica_port: _Optional[int] = ...) -> None: ...

class ProgressSummary(_message.Message):
    __slots__ = ("step", "loss", "samples_per_second", "tokens_per_second", "seconds_since_progress", "hung", "ts", "step_seconds", "collective_seconds", "data_seconds", "timed_steps", "resumed_step", "checkpoint_seconds", "other_phase_seconds", "resume_source")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    HUNG_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIMED_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OTHER_PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_SOURCE_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    samples_per_second: float
    tokens_per_second: float
    seconds_since_progress: float
    hung: bool
    ts: float
    step_seconds: float
    collective_seconds: float
    data_seconds: float
    timed_steps: int
    resumed_step: int
    checkpoint_seconds: float
    other_phase_seconds: float
    resume_source: str
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., seconds_since_progress: _Optional[float] = ..., hung: _Optional[bool] = ..., ts: _Optional[float] = ..., step_seconds: _Optional[float] = ..., collective_seconds: _Optional[float] = ..., data_seconds: _Optional[float] = ..., timed_steps: _Optional[int] = ..., resumed_step: _Optional[int] = ..., checkpoint_seconds: _Optional[float] = ..., other_phase_seconds: _Optional[float] = ..., resume_source: _Optional[str] = ...) -> None: ...

class Fault(_message.Message):
    __slots__ = ("id", "kind", "severity", "scope", "message", "evidence_json", "detected_at", "generation", "exit_status")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_JSON_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: FaultKind
    severity: Severity
    scope: Scope
    message: str
    evidence_json: str
    detected_at: float
    generation: int
    exit_status: int
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[_Union[FaultKind, str]] = ..., severity: _Optional[_Union[Severity, str]] = ..., scope: _Optional[_Union[Scope, str]] = ..., message: _Optional[str] = ..., evidence_json: _Optional[str] = ..., detected_at: _Optional[float] = ..., generation: _Optional[int] = ..., exit_status: _Optional[int] = ...) -> None: ...

class BarrierArrival(_message.Message):
    __slots__ = ("generation", "previous_trainer_exited", "preflight_seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_TRAINER_EXITED_FIELD_NUMBER: _ClassVar[int]
    PREFLIGHT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    previous_trainer_exited: bool
    preflight_seconds: float
    def __init__(self, generation: _Optional[int] = ..., previous_trainer_exited: _Optional[bool] = ..., preflight_seconds: _Optional[float] = ...) -> None: ...

class TrainerExit(_message.Message):
    __slots__ = ("generation", "exit_code", "signal")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    generation: int
    exit_code: int
    signal: int
    def __init__(self, generation: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("command_id",)
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    def __init__(self, command_id: _Optional[str] = ...) -> None: ...

class Stacks(_message.Message):
    __slots__ = ("command_id", "json")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    json: str
    def __init__(self, command_id: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...

class NodeReport(_message.Message):
    __slots__ = ("node", "agent_instance", "agent_version", "faults", "healthy")
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    node: str
    agent_instance: str
    agent_version: str
    faults: _containers.RepeatedCompositeFieldContainer[Fault]
    healthy: bool
    def __init__(self, node: _Optional[str] = ..., agent_instance: _Optional[str] = ..., agent_version: _Optional[str] = ..., faults: _Optional[_Iterable[_Union[Fault, _Mapping]]] = ..., healthy: _Optional[bool] = ...) -> None: ...

class NodeReportAck(_message.Message):
    __slots__ = ("arbiter_id", "acks", "ranks")
    ARBITER_ID_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    arbiter_id: str
    acks: _containers.RepeatedCompositeFieldContainer[FaultAck]
    ranks: int
    def __init__(self, arbiter_id: _Optional[str] = ..., acks: _Optional[_Iterable[_Union[FaultAck, _Mapping]]] = ..., ranks: _Optional[int] = ...) -> None: ...

class ArbiterMessage(_message.Message):
    __slots__ = ("welcome", "fault_ack", "command")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    FAULT_ACK_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    fault_ack: FaultAck
    command: Command
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., fault_ack: _Optional[_Union[FaultAck, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("generation", "arbiter_id", "max_restarts", "restarts", "replica_peer", "replica_key")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ARBITER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PEER_FIELD_NUMBER: _ClassVar[int]
    REPLICA_KEY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    arbiter_id: str
    max_restarts: int
    restarts: int
    replica_peer: str
    replica_key: bytes
    def __init__(self, generation: _Optional[int] = ..., arbiter_id: _Optional[str] = ..., max_restarts: _Optional[int] = ..., restarts: _Optional[int] = ..., replica_peer: _Optional[str] = ..., replica_key: _Optional[bytes] = ...) -> None: ...

class FaultAck(_message.Message):
    __slots__ = ("fault_id", "final", "outcome")
    FAULT_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    fault_id: str
    final: bool
    outcome: str
    def __init__(self, fault_id: _Optional[str] = ..., final: _Optional[bool] = ..., outcome: _Optional[str] = ...) -> None: ...

class JobBusy(_message.Message):
    __slots__ = ("busy_ranks", "waiting_ranks", "where", "state", "spin_culprits")
    BUSY_RANKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_RANKS_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SPIN_CULPRITS_FIELD_NUMBER: _ClassVar[int]
    busy_ranks: _containers.RepeatedScalarFieldContainer[int]
    waiting_ranks: _containers.RepeatedScalarFieldContainer[int]
    where: str
    state: str
    spin_culprits: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, busy_ranks: _Optional[_Iterable[int]] = ..., waiting_ranks: _Optional[_Iterable[int]] = ..., where: _Optional[str] = ..., state: _Optional[str] = ..., spin_culprits: _Optional[_Iterable[int]] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("id", "kind", "generation", "exit_code", "reason", "fault_id", "target_rank", "restarts", "busy", "resume_step", "replica_peer")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAULT_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_RANK_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PEER_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: CommandKind
    generation: int
    exit_code: int
    reason: str
    fault_id: str
    target_rank: int
    restarts: int
    busy: JobBusy
    resume_step: int
    replica_peer: str
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[_Union[CommandKind, str]] = ..., generation: _Optional[int] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ..., fault_id: _Optional[str] = ..., target_rank: _Optional[int] = ..., restarts: _Optional[int] = ..., busy: _Optional[_Union[JobBusy, _Mapping]] = ..., resume_step: _Optional[int] = ..., replica_peer: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job", "namespace", "timeline_limit")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    job: str
    namespace: str
    timeline_limit: int
    def __init__(self, job: _Optional[str] = ..., namespace: _Optional[str] = ..., timeline_limit: _Optional[int] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "pod", "node", "connected", "state", "step", "loss", "samples_per_second", "tokens_per_second", "progress_age_seconds", "hung", "generation", "restarts", "last_fault", "last_exit_status")
    RANK_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HUNG_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAULT_FIELD_NUMBER: _ClassVar[int]
    LAST_EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pod: str
    node: str
    connected: bool
    state: str
    step: int
    loss: float
    samples_per_second: float
    tokens_per_second: float
    progress_age_seconds: float
    hung: bool
    generation: int
    restarts: int
    last_fault: str
    last_exit_status: int
    def __init__(self, rank: _Optional[int] = ..., pod: _Optional[str] = ..., node: _Optional[str] = ..., connected: _Optional[bool] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., samples_per_second: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., progress_age_seconds: _Optional[float] = ..., hung: _Optional[bool] = ..., generation: _Optional[int] = ..., restarts: _Optional[int] = ..., last_fault: _Optional[str] = ..., last_exit_status: _Optional[int] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job", "namespace", "generation", "restarts", "max_restarts", "world_size", "connected", "state", "alert_only", "barrier", "ranks", "timeline", "goodput", "busy", "spares", "snapshot_step", "ranks_omitted", "replicas")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ALERT_ONLY_FIELD_NUMBER: _ClassVar[int]
    BARRIER_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    job: str
    namespace: str
    generation: int
    restarts: int
    max_restarts: int
    world_size: int
    connected: int
    state: str
    alert_only: bool
    barrier: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    timeline: _containers.RepeatedCompositeFieldContainer[TimelineEntry]
    goodput: Goodput
    busy: str
    spares: _containers.RepeatedScalarFieldContainer[str]
    snapshot_step: int
    ranks_omitted: int
    replicas: str
    def __init__(self, job: _Optional[str] = ..., namespace: _Optional[str] = ..., generation: _Optional[int] = ..., restarts: _Optional[int] = ..., max_restarts: _Optional[int] = ..., world_size: _Optional[int] = ..., connected: _Optional[int] = ..., state: _Optional[str] = ..., alert_only: _Optional[bool] = ..., barrier: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., timeline: _Optional[_Iterable[_Union[TimelineEntry, _Mapping]]] = ..., goodput: _Optional[_Union[Goodput, _Mapping]] = ..., busy: _Optional[str] = ..., spares: _Optional[_Iterable[str]] = ..., snapshot_step: _Optional[int] = ..., ranks_omitted: _Optional[int] = ..., replicas: _Optional[str] = ...) -> None: ...

class Goodput(_message.Message):
    __slots__ = ("wall_seconds", "seconds", "ratio", "recomputed_steps", "incidents", "per_incident", "started_at")
    class SecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    PER_INCIDENT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    wall_seconds: float
    seconds: _containers.ScalarMap[str, float]
    ratio: float
    recomputed_steps: int
    incidents: int
    per_incident: _containers.RepeatedCompositeFieldContainer[GoodputIncident]
    started_at: float
    def __init__(self, wall_seconds: _Optional[float] = ..., seconds: _Optional[_Mapping[str, float]] = ..., ratio: _Optional[float] = ..., recomputed_steps: _Optional[int] = ..., incidents: _Optional[int] = ..., per_incident: _Optional[_Iterable[_Union[GoodputIncident, _Mapping]]] = ..., started_at: _Optional[float] = ...) -> None: ...

class GoodputIncident(_message.Message):
    __slots__ = ("generation", "kind", "onset", "detect_seconds", "decide_seconds", "restart_seconds", "recompute_seconds", "reached_step", "resumed_step", "recomputed_steps", "resume_source", "no_restart")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ONSET_FIELD_NUMBER: _ClassVar[int]
    DETECT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECIDE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTART_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REACHED_STEP_FIELD_NUMBER: _ClassVar[int]
    RESUMED_STEP_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESUME_SOURCE_FIELD_NUMBER: _ClassVar[int]
    NO_RESTART_FIELD_NUMBER: _ClassVar[int]
    generation: int
    kind: str
    onset: float
    detect_seconds: float
    decide_seconds: float
    restart_seconds: float
    recompute_seconds: float
    reached_step: int
    resumed_step: int
    recomputed_steps: int
    resume_source: str
    no_restart: bool
    def __init__(self, generation: _Optional[int] = ..., kind: _Optional[str] = ..., onset: _Optional[float] = ..., detect_seconds: _Optional[float] = ..., decide_seconds: _Optional[float] = ..., restart_seconds: _Optional[float] = ..., recompute_seconds: _Optional[float] = ..., reached_step: _Optional[int] = ..., resumed_step: _Optional[int] = ..., recomputed_steps: _Optional[int] = ..., resume_source: _Optional[str] = ..., no_restart: _Optional[bool] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("job", "namespace", "replay")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    job: str
    namespace: str
    replay: bool
    def __init__(self, job: _Optional[str] = ..., namespace: _Optional[str] = ..., replay: _Optional[bool] = ...) -> None: ...

class TimelineEntry(_message.Message):
    __slots__ = ("seq", "ts", "job", "namespace", "generation", "kind", "message", "rank", "fault_id", "action", "culprits")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FAULT_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    CULPRITS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts: float
    job: str
    namespace: str
    generation: int
    kind: str
    message: str
    rank: int
    fault_id: str
    action: str
    culprits: _containers.RepeatedCompositeFieldContainer[Culprit]
    def __init__(self, seq: _Optional[int] = ..., ts: _Optional[float] = ..., job: _Optional[str] = ..., namespace: _Optional[str] = ..., generation: _Optional[int] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., rank: _Optional[int] = ..., fault_id: _Optional[str] = ..., action: _Optional[str] = ..., culprits: _Optional[_Iterable[_Union[Culprit, _Mapping]]] = ...) -> None: ...

class Culprit(_message.Message):
    __slots__ = ("rank", "pod", "node")
    RANK_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pod: str
    node: str
    def __init__(self, rank: _Optional[int] = ..., pod: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...
