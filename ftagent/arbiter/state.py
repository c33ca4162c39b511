"""What the arbiter knows about a job, and how a decision changes it.

The registry owns these objects; the policy (``policy.py``, ``barrier.py``) only reads
them and returns ``Decision`` values. ``apply`` is the one place a job's state changes:
a decision, and what an agent tells (``Registered``, ``Left``, ``Progressed``, ``Arrived``,
``AtBarrier``, ``Exited``, ...: named tuples the registry builds from checked messages).
Nothing here does I/O, so a test can replay a stream of changes and compare plain values.
(A rank's ``pending`` commands and its ``conn`` belong to the connections part,
``arbiter/commands.py``: what was sent, not what the job is.)

Everything is rebuilt from agents' Hellos after an arbiter restart (stateless design):
the job's generation is the highest any agent reports, its restart count likewise. The
one exception is who owns each rank (``JobState.owners``): an agent's Hello cannot be
trusted to say it, so the job's history record keeps it (``Owned``).

Warm spares (``ftagent run --spare``, ``JobState.spares``) are agents of the job without a
rank: a REPLACE ASSIGNs one the replaced rank (the decision makes its pod the rank's
owner), and when it arrives at the new generation's barrier it *is* that rank
(``Promoted``: its stream takes the rank's seat, the replaced agent's stream is dropped).

Job lifecycle::

    STARTING ──all ranks arrived──▶ RUNNING ──fault: RESTART/REPLACE──▶ RESTARTING
       │   (barrier, generation 0)     ▲                                     │
       │                               └────────all ranks arrived────────────┘
       ├──barrier timeout / budget spent──▶ STOPPED
       └──every rank exited 0────────────▶ SUCCEEDED
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ftagent.arbiter import fr_verdict
from ftagent.arbiter.replica_ring import ReplicaBook
from ftagent.model import Fault, JobBusy
from ftagent.wire.limits import MAX_OPEN_FAULTS, MAX_SPARES

SEEN_FAULTS_KEPT = 10_000  # per job; duplicate ids older than this are long acknowledged


class JobPhase(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPED = "stopped"
    SUCCEEDED = "succeeded"


# The phases a job ends in (``JobState.finished``): the pure deciders read the phase
# against it in place (policy.py, barrier.py), no property call per decision.
FINISHED = frozenset({JobPhase.STOPPED, JobPhase.SUCCEEDED})


class Verdict(str, enum.Enum):
    """What a decision does. The first five are model.ActionKind values."""

    RESTART = "restart"  # every rank restarts in place at generation+1, then meets at a barrier
    REPLACE = "replace"  # `rank` exits with EXIT_REPLACE; the others restart at generation+1
    STOP = "stop"  # targets stop their trainer and exit with `exit_code`
    ALERT_ONLY = "alert_only"  # recorded for humans; nothing sent
    DUMP_STACKS = "dump_stacks"  # every rank sends its stacks; decide when all did or `until`
    RELEASE_BARRIER = "release_barrier"  # targets start generation `generation` now
    REJOIN = "rejoin"  # targets restart into `generation` (lagging, or every rank resyncs)
    RECONCILE = "reconcile"  # agents report a higher generation: the job is at it now
    WAIT = "wait"  # a rank's link is down: decide when it is back or at `until`
    LINK_BACK = "link_back"  # `rank`'s link is back, others' are still down: keep waiting
    IGNORE = "ignore"  # recorded, nothing to do (stale generation, already handled)
    BUSY = "busy"  # a job hang's stacks showed ranks alive in a phase: no restart; every
    # rank is told who is busy and who waits (`busy`), and status shows it
    ASSIGN = "assign"  # the spare `spare` becomes rank `rank` at `generation` (after a REPLACE)
    RETIRE_SPARE = "retire_spare"  # the spare `spare` had a fatal fault: never assigned;
    # it exits with the replace status (its pod moves), its stream's end drops it
    LAST_WORDS = "last_words"  # targets persist their newest complete snapshot now (their
    # node announced a planned disruption: kube/node_lifecycle.py); nothing restarts


@dataclass(frozen=True, slots=True)
class Culprit:
    """A rank a decision blames, with the pod and node it ran on when decided ("" where
    its agent did not say): the structured form of a verdict's culprit, the same in the
    decision's message (``policy.culprit_clause``), its timeline entry, the status JSON, the
    per-rank culprit counter and the Kubernetes Event."""

    rank: int
    pod: str = ""
    node: str = ""


@dataclass(frozen=True)
class Decision:
    """One decision of the policy, with the reason a human reads in the timeline."""

    verdict: Verdict
    reason: str
    generation: int  # the job's generation once this decision is applied
    targets: tuple[int, ...] = ()  # ranks the command goes to; () means every rank
    rank: int | None = None  # the rank it is about: culprit, REPLACE target, NIC rank
    exit_code: int | None = None  # STOP: the code agents exit with
    fault_id: str = ""
    until: float | None = None  # DUMP_STACKS / WAIT: deadline (wall clock)
    # The fault's decision is still open (stacks awaited, a link still down): its agent
    # keeps it and re-sends it after a reconnect, to this arbiter or its successor.
    pending: bool = False
    # RESTART for a collective mismatch: its place (fr_verdict.Verdict.key), remembered so
    # that the same mismatch after the restart STOPs the job (a program error)
    mismatch: str = ""
    busy: JobBusy | None = None  # BUSY: who is busy, who waits
    spare: str = ""  # ASSIGN: the spare's agent instance (JobState.spares)
    # the ranks this decision blames (a hang's culprits, the crashed or replaced rank),
    # sorted by rank; its reason names them in ``policy.culprit_clause``'s form
    culprits: tuple[Culprit, ...] = ()
    # DUMP_STACKS: the id of the command it sends (made where it is carried out,
    # jobs.execute: a random one, never a peer's), kept by the probe it opens
    # (``HangProbe.command_id``): an answer counts only with it. Not part of what was
    # decided (equality ignores it)
    command_id: str = field(default="", compare=False)


@dataclass(slots=True)
class RankState:
    """One agent as last heard from. ``last_step_at`` is the estimated wall time of the
    rank's last step (arrival time minus the agent's seconds_since_progress)."""

    rank: int
    pod: str = ""
    pod_uid: str = ""  # the verified pod (TokenReview) that registered it; "" unverified
    node: str = ""
    gpus: tuple[str, ...] = ()  # GPU ids the rank's pod holds (Hello.gpus; (): unknown)
    connected: bool = False
    state: str = ""
    generation: int = 0  # the generation the agent's trainer runs or waits for
    released_generation: int = -1
    running: bool = False  # a trainer of `generation` runs (unreleased: started fail-open)
    instance: str = ""  # the agent process's random id (Hello.agent_instance)
    commanded: int = -1  # highest generation a RESTART/REJOIN/REPLACE was sent for
    restarts: int = 0
    step: int = -1
    loss: float | None = None
    samples_per_second: float = 0.0
    tokens_per_second: float = 0.0
    last_step_at: float | None = None
    hung: bool = False
    last_fault: str = ""
    last_exit_status: int | None = None
    # (generation, status) of the exit heard from this agent: the link says its last exit
    # again on a new stream until an arbiter confirms reading it (link_protocol.py)
    exit_heard: tuple[int, int] | None = None
    stack: str | None = None  # signature of the stacks sent for the current hang probe
    # its flight-recorder summary sent with those stacks (fr_verdict.summary_of, read
    # once on arrival: fr_verdict.read; a plain dict is read at the verdict); used only
    # while ``stack`` is set, so the resets of ``stack`` retire it too
    fr: fr_verdict.Summary | dict[str, Any] | None = None
    # Commands sent but not acknowledged, re-sent on reconnect: slot -> (id, bytes).
    pending: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    conn: object | None = None  # the registry's live connection, if any
    from_spare: bool = False  # a spare took this rank over (ASSIGN, then Promoted)
    # steps whose in-memory snapshot its trainer holds complete (SnapshotReport), sorted
    snapshot_steps: tuple[int, ...] = ()
    # what its pod and node have for the ladder's pod-level tiers (ladder.Features), kept
    # by the cluster's watches (kube/cluster.py); None outside Kubernetes or not seen yet
    tiers: Any = None

    def progress_age(self, now: float) -> float | None:
        return None if self.last_step_at is None else max(0.0, now - self.last_step_at)


@dataclass(slots=True)
class SpareState:
    """A warm spare of the job: an agent with a warm standby and no rank, until the
    arbiter ASSIGNs it one (``assigned``, for ``generation``)."""

    instance: str  # its agent process's id (Hello.agent_instance): the key
    pod: str = ""
    pod_uid: str = ""  # the verified pod (TokenReview); "" unverified
    node: str = ""
    conn: object | None = None
    assigned: int | None = None  # -1: retired (RETIRE_SPARE), never assigned
    generation: int = -1
    # It arrived for ``generation`` while the replaced agent's trainer may still run: its
    # arrival counts once that agent reported its trainer's exit or left (``Promoted``),
    # so no trainer of the old generation runs beside the new one.
    arrived: int = -1


@dataclass(slots=True)
class BarrierState:
    """Ranks that arrived for ``generation`` (their previous trainer has exited)."""

    generation: int
    opened_at: float
    arrived: set[int] = field(default_factory=set)
    first_arrival_at: float | None = None
    released: bool = False


@dataclass(slots=True)
class HangProbe:
    """A job hang: stacks were requested from every rank; decide when all came or at deadline."""

    fault_id: str
    rank: int
    deadline: float
    exit_status: int | None = None
    # The connected ranks that have not answered yet (``RankState.stack`` None): the
    # probe is decided when it is empty (policy.decide_stacks reads its size, no scan of
    # the ranks per answer: 16,384 answers cost 16,384, not 16,384^2). Built by ``apply``
    # at the probe's first answer (its one pass over the ranks), then kept rank by rank
    # as they answer, leave and come back (``_index_rank``). None: not built (no answer
    # yet, or stacks written by hand, not applied): the policy scans the ranks.
    owing: set[int] | None = None
    # The id of the DUMP_STACKS the probe sent (``Decision.command_id``: the same for
    # every rank, and when it is re-sent): an answer is read only with this id
    # (jobs.stacks), so a late answer to an earlier probe (one decided at its deadline,
    # or lost with an arbiter that restarted) never counts for this one. Its reason is
    # kept to ask a rank first heard of during the probe (commands.ask_stacks).
    command_id: str = ""
    reason: str = ""


@dataclass(slots=True)
class NicOutage:
    """A rank's link is down: restart when it is back, replace it at ``deadline``."""

    fault_id: str
    since: float
    deadline: float


@dataclass(slots=True)
class NicResume:
    """The last link is back: the job may resume by itself (TCP retransmits) before
    ``deadline``; ``steps`` are the ranks' steps when it came back (policy.decide_nic_resume)."""

    fault_id: str
    rank: int
    since: float
    deadline: float
    steps: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class JobState:
    job: str
    namespace: str = ""
    world_size: int = 1
    generation: int = 0
    restarts: int = 0
    max_restarts: int = 3
    alert_only: bool = False
    phase: JobPhase = JobPhase.STARTING
    ranks: dict[int, RankState] = field(default_factory=dict)
    barrier: BarrierState | None = None
    hang_probe: HangProbe | None = None
    nic_outages: dict[int, NicOutage] = field(default_factory=dict)
    nic_resume: NicResume | None = None
    seen_faults: OrderedDict[str, bool] = field(default_factory=OrderedDict)  # id -> final
    # Faults whose decision is still open (stacks awaited, a link down): id -> rank. Once
    # neither is pending they are settled with a final FaultAck to their rank.
    open_faults: dict[str, int] = field(default_factory=dict)
    stop_reason: str = ""
    mismatch: str = ""  # the collective mismatch the last restart was for (Decision.mismatch)
    # The last BUSY verdict (its reason, who was busy and who waited) while it holds:
    # until a rank steps past `busy_step` (the highest step when it was decided), a job
    # hang's stacks show its roles swapped (policy.roles_swapped), or the job moves on.
    busy: str = ""
    busy_step: int = -1
    busy_roles: JobBusy | None = None
    connected: int = 0
    last_seen: float = 0.0
    # Who owns each rank: rank -> (pod, uid) as verified at its Hello (the stream's
    # TokenReview'd pod, never what an agent merely says). Another pod may take the rank
    # only once this one is gone (jobs._admit, the pod watch). Kept in the job's history
    # record, so that an arbiter restart does not forget it (``Owned``). At most one per
    # rank: bounded by the job's ranks.
    owners: dict[int, tuple[str, str]] = field(default_factory=dict)
    # A fingerprint of ``owners`` (XOR of each entry's hash), kept as they change: the
    # history record is rewritten when it changes without comparing every rank.
    owners_print: int = 0
    # Connected warm spares, by agent instance, oldest first: at most MAX_SPARES (a Hello
    # beyond is refused where it enters, jobs.py).
    spares: dict[str, SpareState] = field(default_factory=dict)
    # Its agents' replica holders and the ring by node they were given (replica_ring.py)
    replica_book: ReplicaBook = field(default_factory=ReplicaBook)
    # The connected ranks that are not ``quiet`` at ``quiet_generation``, kept by ``apply``
    # (rebuilt when the job's generation moves or a barrier is released, one rank's entry
    # otherwise). While it is empty at the job's generation, the barrier's reconcile knows
    # without a scan that no rank has anything to reconcile: N agents' Hellos at a job's
    # start cost N, not N^2 (16,384 ranks: 20 s of the event loop before).
    loud: set[int] = field(default_factory=set)
    # The ranks whose trainer of the job's generation exited 0 (state "succeeded"), kept
    # the same way: the job's end is a count, not a scan per exit (16,384 exits: 8.4 s).
    succeeded: set[int] = field(default_factory=set)
    quiet_generation: int = -1  # -1: not built (a JobState made without ``apply``)

    def remember_fault(self, fault_id: str, final: bool = True) -> None:
        self.seen_faults[fault_id] = final
        while len(self.seen_faults) > SEEN_FAULTS_KEPT:
            self.seen_faults.popitem(last=False)

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED


class Registered(NamedTuple):
    """An agent's Hello was accepted for ``rank`` (checked at the edge, wire/checks.py)."""

    rank: int
    pod: str
    node: str
    state: str
    instance: str
    pod_uid: str  # "" when the stream's credential names no pod: the rank's is kept
    gpus: tuple[str, ...]
    generation: int
    released_generation: int
    running: bool
    restart_count: int
    world_size: int
    alert_only: bool
    conn: object
    # what the timeline says of it (journal.py): who connected ("pod" or the peer), and
    # whether the rank was known (a reconnect) and had no live stream (a new stream)
    peer: str = ""
    known: bool = False
    fresh: bool = True


class Owned(NamedTuple):
    """The ranks' owners the job's history record kept (an arbiter restart): (rank, pod,
    uid) each, checked where the record was read (history.owners_from_json). A rank
    registered since keeps its own."""

    owners: tuple[tuple[int, str, str], ...]


class SpareJoined(NamedTuple):
    """A spare's Hello was accepted (the job had room: MAX_SPARES)."""

    instance: str
    pod: str
    node: str
    pod_uid: str
    conn: object
    peer: str = ""  # its pod, else its stream's peer (the timeline's name for it)
    # the rank it claimed, held by a former spare: it is told to serve as a spare (None:
    # it came as a spare)
    told: int | None = None


class SpareLeft(NamedTuple):
    """The spare's stream ended: it is no spare of the job any more (a Hello brings it back)."""

    instance: str
    peer: str = ""  # its pod or instance, for the timeline


class Promoted(NamedTuple):
    """The spare ASSIGNed rank ``rank`` arrived: its stream is that rank's from now on."""

    instance: str
    rank: int


class SpareArrived(NamedTuple):
    """The spare ASSIGNed a rank arrived for ``generation`` before the replaced agent's
    trainer was known gone: held (``SpareState.arrived``) until it is."""

    instance: str
    generation: int


class Left(NamedTuple):
    """``rank``'s stream ended (it may come back with a Hello)."""

    rank: int


class Progressed(NamedTuple):
    """A progress summary of ``rank`` (values in range: wire/checks.progress_in_range)."""

    rank: int
    step: int
    hung: bool
    loss: float | None
    samples_per_second: float
    tokens_per_second: float
    last_step_at: float
    # for the goodput ledger (journal.py): the summary's own stamp (0: none), the step it
    # resumed from and how (ProgressSummary.resumed_step, resume_source; None: not said),
    # and the seconds its trainer spent checkpointing and in other phases
    ts: float = 0.0
    resumed: tuple[int, str] | None = None
    phases: tuple[float, float] = (0.0, 0.0)


class Arrived(NamedTuple):
    """``rank``'s previous trainer is gone; it waits to start ``generation``: counted at
    the barrier when that is the job's generation (as ``AtBarrier``)."""

    rank: int
    generation: int


class Preflighted(NamedTuple):
    """``rank``'s preflight before ``generation`` took ``seconds`` (BarrierArrival): the
    goodput ledger's own category."""

    rank: int
    generation: int
    seconds: float


class AtBarrier(NamedTuple):
    """``rank`` counted at the barrier of ``generation``: ``Arrived`` counts it when it is
    the job's generation; an arrival above it is counted by this after reconcile raised
    the job to it."""

    rank: int
    generation: int


class Exited(NamedTuple):
    """``rank``'s trainer of ``generation`` exited with ``status`` (128+signal if killed)."""

    rank: int
    generation: int
    status: int
    signal: int | None = None  # killed by this signal (``status`` is then 128+signal)
    # "" from the rank's agent; else where the arbiter read an exit the agent could not
    # deliver (its pod's terminal status, the exit note it left: ``exits_seen``)
    via: str = ""


class Revived(NamedTuple):
    """A job of the history that did not finish, taken live again to hear how its ranks
    ended while no arbiter ran (their pods' terminal status, exit notes): its ranks
    ``0..world_size-1`` as known at ``generation``, none connected. (Also a live job with
    no agent left whose exits name ranks this arbiter never heard from: those are added.)"""

    generation: int


class FaultSeen(NamedTuple):
    """A fault was decided (``final``) or its decision is still open (stacks awaited, a
    link down: its rank is acknowledged once it is settled). ``summary``: what status
    shows as ``rank``'s last fault (None: a fault about no rank)."""

    fault_id: str
    final: bool
    rank: int | None = None
    summary: str = ""
    # the fault itself (checked) and the generation it was seen at, for the timeline and
    # the ledger (journal.py); None: a spare's, recorded only
    fault: Fault | None = None
    generation: int = 0
    by_arbiter: bool = False  # a fault no agent sent (the cluster, a node agent, stragglers)
    # filled by ``apply`` (``as_found``): the job's generation when the fault was seen and
    # the oldest link outage open then (its fault id, "" none); the decision applied with
    # it may move the first and close the second before the journal reads them
    job_generation: int = -1
    outage: str = ""


class Settled(NamedTuple):
    """No stacks awaited and no link down any more: every open fault is decided.
    ``apply`` derives it from the decision that closed the last probe or outage
    (``faults``: each settled fault's (id, rank), whose agent gets a final FaultAck with
    that decision's commands: commands.send); applied alone it settles the same way."""

    faults: tuple[tuple[str, int], ...] = ()


class StacksIn(NamedTuple):
    """``rank``'s stacks for the current hang probe: their signature and flight-recorder
    summary (policy.read_stacks: policy.signature_in and fr_verdict.reading)."""

    rank: int
    signature: str
    fr: fr_verdict.Summary | dict[str, Any] | None


class SnapshotsIn(NamedTuple):
    """``rank``'s trainer holds complete snapshots of ``steps`` (SnapshotReport, checked)."""

    rank: int
    steps: tuple[int, ...]


class Noted(NamedTuple):
    """A fact for the timeline that changes no job state: a stream superseded, a budget
    or world size the job already fixed, a new run starting, an unusable fault, what the
    cluster did or did not do (a cordon skipped, a planned node event). Applied like every
    change, so that the journal is the one writer of the timeline."""

    kind: str  # the timeline entry's kind (agent | fault | decision | note | ...)
    message: str
    rank: int | None = None
    fault_id: str = ""
    action: str = ""


class Slowed(NamedTuple):
    """The job waited ``seconds`` per step on its slowest rank (the straggler watch's
    timings, over ``over`` timed steps up to ``step``, seen at ``at``): the ledger's."""

    seconds: float
    at: float
    step: int
    over: int


class CapacityWait(NamedTuple):
    """A pod of the job is Pending without a node (``waiting``) or none is (the cluster,
    while a REPLACE waits for its pod): the ledger's ``capacity``."""

    waiting: bool


class Forgotten(NamedTuple):
    """No agent for long: the live state is dropped, only the history record stays."""


class Finished(NamedTuple):
    """Derived by ``apply``: the change before it ended the job (every rank exited 0)."""

    phase: JobPhase


Change = (Decision | Registered | Owned | Left | Progressed | Arrived | AtBarrier | Exited
          | FaultSeen | Settled | StacksIn | SpareJoined | SpareLeft | Promoted
          | SpareArrived | SnapshotsIn | Revived | Preflighted | Noted | Slowed | CapacityWait
          | Forgotten | Finished)

# What a command does to the state its target ranks show (status) until they report.
_RANK_STATES = {Verdict.RESTART: "restarting", Verdict.REJOIN: "restarting",
                Verdict.STOP: "stopping", Verdict.REPLACE: "replacing",
                Verdict.RELEASE_BARRIER: "running"}
# Verdicts that are commands to agents (the others are recorded only).
COMMANDS = frozenset((Verdict.RESTART, Verdict.REJOIN, Verdict.STOP, Verdict.REPLACE,
                      Verdict.RELEASE_BARRIER, Verdict.DUMP_STACKS, Verdict.BUSY,
                      Verdict.ASSIGN, Verdict.RETIRE_SPARE, Verdict.LAST_WORDS))
SPARE_COMMANDS = frozenset((Verdict.ASSIGN, Verdict.RETIRE_SPARE))  # to a spare's stream


def quiet(rs: RankState, generation: int) -> bool:
    """A rank that waits for ``generation`` (the job's) with nothing to reconcile: it runs
    no trainer and reports neither a newer generation nor that generation's barrier released.
    From such ranks the barrier's reconcile decides nothing (barrier.reconcile's rules 1-4)."""
    return (rs.generation == generation and not rs.running
            and rs.released_generation < generation)


def succeeded(rs: RankState, generation: int) -> bool:
    """The rank's trainer of ``generation`` (the job's) exited 0."""
    return rs.state == "succeeded" and rs.generation == generation


def _index_ranks(job: JobState, d: Change) -> None:
    """Keep ``job.loud``, ``job.succeeded`` and the hang probe's ``owing`` (once built)
    after ``d``. The ranks a change can move in or out: the rank of an agent's message; a
    command's targets (``_commanded`` set their states, what they were told, a released
    barrier's generation); every rank for a new generation or a command to every rank."""
    told = d.targets if isinstance(d, Decision) and d.verdict in COMMANDS else None
    if job.quiet_generation != job.generation or told == ():  # a command to every rank
        g = job.generation
        job.loud = {r for r, rs in job.ranks.items() if rs.connected and not quiet(rs, g)}
        job.succeeded = {r for r, rs in job.ranks.items() if succeeded(rs, g)}
        job.quiet_generation = g
        probe = job.hang_probe
        if probe is not None and probe.owing is not None:  # a pass over every rank anyway
            probe.owing = owing(job)
        return
    if isinstance(d, Decision):
        for r in told or ():  # a command to some ranks: theirs, O(targets)
            _index_rank(job, r)
        return  # other decisions change neither what ranks say nor their states
    rank = getattr(d, "rank", None)
    if type(rank) is int:
        _index_rank(job, rank)


def owing(job: JobState) -> set[int]:
    """The connected ranks that have not answered the job's hang probe (a pass over every
    rank: ``HangProbe.owing`` is this, kept by ``apply``)."""
    return {r for r, rs in job.ranks.items() if rs.connected and rs.stack is None}


def _index_rank(job: JobState, rank: int) -> None:
    rs = job.ranks.get(rank)
    probe = job.hang_probe
    if probe is not None and probe.owing is not None:  # ``HangProbe.owing``, this rank's
        if rs is not None and rs.connected and rs.stack is None:
            probe.owing.add(rank)
        else:
            probe.owing.discard(rank)
    g = job.generation
    if rs is not None and rs.connected and not quiet(rs, g):
        job.loud.add(rank)
    else:
        job.loud.discard(rank)
    if rs is not None and succeeded(rs, g):
        job.succeeded.add(rank)
    else:
        job.succeeded.discard(rank)


def apply(job: JobState, changes: Change | list[Change], now: float) -> list[Change]:
    """Change ``job`` as ``changes`` say, in order: one change, or the changes one event
    makes together (a fault seen and the decision about it: ``jobs.Jobs.execute``), as one
    transaction that the observers read once it is applied. Idempotent for STOP,
    RELEASE_BARRIER, Left, AtBarrier and Exited.

    Returns what it applied, in order, each change followed by the one it derived:
    ``Finished`` when an exit ended the job, ``Settled`` when a decision left no stacks
    awaited and no link down while faults were open (each is final now). A ``FaultSeen``
    comes back as it found the job (``as_found``): its observers read it after the
    decision applied with it moved the job on."""
    applied: list[Change] = []
    for d in changes if isinstance(changes, list) else (changes,):
        if isinstance(d, FaultSeen) and d.fault is not None:
            d = as_found(job, d)
        derived = _apply(job, d, now)
        _index_ranks(job, d)
        applied.append(d)
        if derived is not None:
            applied.append(derived)
    return applied


def as_found(job: JobState, c: FaultSeen) -> FaultSeen:
    """``c`` with what the job was when it arrived: its generation (the timeline's) and
    the oldest link outage then open (a link back continues it: the goodput ledger's)."""
    oldest = min(job.nic_outages.values(), key=lambda o: o.since, default=None)
    return c._replace(job_generation=job.generation,
                      outage=oldest.fault_id if oldest is not None else "")


def _apply(job: JobState, d: Change, now: float) -> Finished | Settled | None:
    if not isinstance(d, Decision):
        was = job.phase
        _AGENT_SAYS[type(d)](job, d, now)
        return Finished(job.phase) if job.phase is not was and job.finished else None
    if d.verdict in COMMANDS and d.verdict not in SPARE_COMMANDS:
        _commanded(job, d)
    v = d.verdict
    if v in (Verdict.RESTART, Verdict.REPLACE):
        job.restarts += 1
        job.mismatch = d.mismatch
        _new_generation(job, d.generation, now)
    elif v in (Verdict.RECONCILE, Verdict.REJOIN) and d.generation > job.generation:
        # Not a fault's decision: the budget is not spent. RECONCILE adopts a generation
        # the agents already run; REJOIN of every rank moves all of them to a new one.
        _new_generation(job, d.generation, now)
    elif v is Verdict.STOP and not d.targets:
        job.phase = JobPhase.STOPPED
        job.stop_reason = d.reason
        _busy_over(job)
        job.barrier = None
        job.hang_probe = None
        job.nic_outages.clear()
        job.nic_resume = None
    elif v in (Verdict.ALERT_ONLY, Verdict.BUSY) and job.hang_probe is not None and \
            d.fault_id == job.hang_probe.fault_id:
        # the stacks showed a busy job, not a hung one (policy.job_busy): probe over
        job.hang_probe = None
        for r in job.ranks.values():
            r.stack = None
        if v is Verdict.BUSY:
            job.busy, job.busy_roles = d.reason, d.busy
            job.busy_step = max((r.step for r in job.ranks.values()), default=-1)
        else:  # the stacks showed the busy verdict's roles swapped: it no longer holds
            _busy_over(job)
    elif v is Verdict.DUMP_STACKS and d.until is not None and d.rank is not None:
        job.hang_probe = HangProbe(fault_id=d.fault_id, rank=d.rank, deadline=d.until,
                                   exit_status=d.exit_code, command_id=d.command_id,
                                   reason=d.reason)
        for r in job.ranks.values():
            r.stack = None
    elif v is Verdict.RELEASE_BARRIER and not d.targets and job.barrier is not None:
        if job.barrier.generation == d.generation:
            job.barrier.released = True
            job.phase = JobPhase.RUNNING
    elif v is Verdict.LINK_BACK and d.rank is not None:
        job.nic_outages.pop(d.rank, None)
        if d.until is not None and not job.nic_outages:  # the last link: watch the steps
            job.nic_resume = NicResume(fault_id=d.fault_id, rank=d.rank, since=now,
                                       deadline=d.until,
                                       steps={r.rank: r.step for r in job.ranks.values()})
    elif v is Verdict.ALERT_ONLY and job.nic_resume is not None and \
            d.fault_id == job.nic_resume.fault_id:  # resumed by itself
        job.nic_resume = None
    elif (v is Verdict.WAIT and d.rank is not None and d.until is not None
          and d.rank not in job.nic_outages):
        job.nic_outages[d.rank] = NicOutage(fault_id=d.fault_id, since=now, deadline=d.until)
    elif v is Verdict.ASSIGN and d.rank is not None and d.spare in job.spares:
        sp = job.spares[d.spare]
        sp.assigned, sp.generation = d.rank, d.generation
        if sp.pod_uid:  # the arbiter's decision makes its pod the rank's owner
            _own(job, d.rank, (sp.pod, sp.pod_uid))
    elif v is Verdict.RETIRE_SPARE and d.spare in job.spares:
        sp = job.spares[d.spare]
        if sp.assigned is not None and sp.assigned >= 0 and \
                job.owners.get(sp.assigned) == (sp.pod, sp.pod_uid):
            # assigned but never arrived (its preflight failed): the rank is not its pod's
            # any more, so the rank's recreated pod (or the next spare) may take it
            job.owners_print ^= hash((sp.assigned, *job.owners.pop(sp.assigned)))
        sp.assigned = -1
    return _settle(job)


def _new_generation(job: JobState, generation: int, now: float) -> None:
    """The job moves to ``generation``: a fresh barrier, no probe, outage or hang left."""
    job.generation = generation
    job.phase = JobPhase.RESTARTING
    job.barrier = BarrierState(generation=generation, opened_at=now)
    job.hang_probe = None
    job.nic_outages.clear()
    job.nic_resume = None
    _busy_over(job)
    for r in job.ranks.values():
        r.hung = False
        r.stack = None


def _busy_over(job: JobState) -> None:
    """The last BUSY verdict no longer holds."""
    job.busy, job.busy_step, job.busy_roles = "", -1, None


def _commanded(job: JobState, d: Decision) -> None:
    """The ranks a command goes to: what status shows for them, what they were told."""
    for r in d.targets or tuple(job.ranks):
        rs = job.ranks.get(r)
        if rs is None:
            continue
        if d.verdict is Verdict.REPLACE and r != d.rank:
            rs.state = "restarting"  # the others restart; the replaced rank is "replacing"
        else:
            rs.state = _RANK_STATES.get(d.verdict, rs.state)
        if d.verdict in (Verdict.RESTART, Verdict.REJOIN, Verdict.REPLACE):
            rs.commanded = max(rs.commanded, d.generation)
        elif d.verdict is Verdict.RELEASE_BARRIER:
            rs.released_generation = max(rs.released_generation, rs.generation)


def _own(job: JobState, rank: int, owner: tuple[str, str]) -> None:
    old = job.owners.get(rank)
    if old == owner:
        return
    if old is not None:
        job.owners_print ^= hash((rank, *old))
    job.owners[rank] = owner
    job.owners_print ^= hash((rank, *owner))


def _owned(job: JobState, c: Owned, now: float) -> None:
    for rank, pod, uid in c.owners:
        if rank not in job.owners:
            _own(job, rank, (pod, uid))


def _left(job: JobState, c: Left, now: float) -> None:
    rs = job.ranks.get(c.rank)
    if rs is not None and rs.connected:
        rs.conn, rs.connected = None, False
        job.connected -= 1
    job.last_seen = now


def _progressed(job: JobState, c: Progressed, now: float) -> None:
    rs = job.ranks[c.rank]
    rs.step, rs.hung, rs.loss = c.step, c.hung, c.loss
    if job.busy and c.step > job.busy_step:  # the busy phase is over
        _busy_over(job)
    rs.samples_per_second, rs.tokens_per_second = c.samples_per_second, c.tokens_per_second
    rs.last_step_at = c.last_step_at


def _arrived(job: JobState, c: Arrived, now: float) -> None:
    rs = job.ranks[c.rank]
    if c.generation > rs.generation and rs.released_generation >= 0:
        rs.restarts += 1  # it ran a trainer and now waits to start a newer one
    rs.generation = max(rs.generation, c.generation)
    rs.running = False
    rs.state = "waiting"
    # counted at the barrier of the job's generation in the same step; an arrival above
    # it is counted after reconcile raised the job to it (``AtBarrier``, jobs.arrival)
    _at_barrier(job, AtBarrier(c.rank, c.generation), now)


def _at_barrier(job: JobState, c: AtBarrier, now: float) -> None:
    if job.finished or c.generation != job.generation:
        return
    b = job.barrier
    if b is None or b.generation != job.generation:
        b = job.barrier = BarrierState(generation=job.generation, opened_at=now)
    if b.released or c.rank in b.arrived:
        return
    b.arrived.add(c.rank)
    if b.first_arrival_at is None:
        b.first_arrival_at = now


def _exited(job: JobState, c: Exited, now: float) -> None:
    rs = job.ranks[c.rank]
    rs.last_exit_status = c.status
    rs.exit_heard = (c.generation, c.status)
    rs.state = "exited"
    if c.status == 0 and c.generation == job.generation:
        rs.state = "succeeded"
        if job.quiet_generation == job.generation:  # the index (``_index_ranks``)
            _index_rank(job, c.rank)
            done = len(job.succeeded)
        else:
            done = sum(1 for r in job.ranks.values() if succeeded(r, job.generation))
        if done >= job.world_size and not job.finished:
            job.phase = JobPhase.SUCCEEDED
    if c.via and not job.finished and job.connected == 0:
        _ended_unheard(job)


def _ended_unheard(job: JobState) -> None:
    """Exits read where agents left them (``Exited.via``): with no agent connected and
    every rank's exit known for the job's generation, one that was not 0 ends the job
    as failed (no arbiter decided it: the agents ended alone, failing open)."""
    exits = [r for r in job.ranks.values() if r.exit_heard is not None
             and r.exit_heard[0] >= job.generation]
    if len(exits) < job.world_size:
        return
    failed = next((r for r in sorted(exits, key=lambda r: r.rank)
                   if r.last_exit_status != 0), None)
    if failed is not None:
        job.phase = JobPhase.STOPPED
        job.stop_reason = (f"failed: rank {failed.rank} exited with code "
                           f"{failed.last_exit_status} while no arbiter heard it")
        job.barrier = None
        job.hang_probe = None


def _revived(job: JobState, c: Revived, now: float) -> None:
    if not job.ranks:  # taken from its record: it ran
        job.phase = JobPhase.RUNNING
    job.generation = max(job.generation, c.generation)
    job.last_seen = now
    for r in range(job.world_size):
        if r not in job.ranks:
            job.ranks[r] = RankState(rank=r, generation=job.generation,
                                     released_generation=job.generation, state="gone")


def _fault_seen(job: JobState, c: FaultSeen, now: float) -> None:
    job.remember_fault(c.fault_id, c.final)
    if not c.final and len(job.open_faults) < MAX_OPEN_FAULTS:
        job.open_faults[c.fault_id] = -1 if c.rank is None else c.rank
    rs = job.ranks.get(c.rank) if c.rank is not None else None
    if rs is not None and c.summary:
        rs.last_fault = c.summary[:300]


def _settled(job: JobState, c: Settled, now: float) -> None:
    if job.hang_probe is None and not job.nic_outages and job.nic_resume is None:
        for fid in job.open_faults:
            if fid in job.seen_faults:
                job.seen_faults[fid] = True
        job.open_faults.clear()


def _settle(job: JobState) -> Settled | None:
    """After a decision: the open faults it settled (no stacks awaited, no link down any
    more), final now; None while one is still pending or none was open."""
    if not job.open_faults or job.hang_probe is not None or job.nic_outages \
            or job.nic_resume is not None:
        return None
    settled = Settled(tuple(job.open_faults.items()))
    _settled(job, settled, 0.0)
    return settled


def _stacks_in(job: JobState, c: StacksIn, now: float) -> None:
    rs = job.ranks[c.rank]
    rs.stack, rs.fr = c.signature, c.fr
    probe = job.hang_probe
    if probe is not None and probe.owing is None:  # the probe's first answer: who owes one
        probe.owing = owing(job)


def _registered(job: JobState, c: Registered, now: float) -> None:
    """A Hello: the agents are the truth for generation and restarts (they only go up)."""
    if not job.ranks and job.barrier is None:
        job.barrier = BarrierState(generation=job.generation, opened_at=now)  # its first
    job.alert_only = c.alert_only
    job.last_seen = now
    job.world_size = max(job.world_size, c.world_size)
    job.restarts = max(job.restarts, c.restart_count)
    rs = job.ranks.get(c.rank)
    if rs is None:
        rs = job.ranks[c.rank] = RankState(rank=c.rank)
    if rs.instance != c.instance:
        rs.commanded = -1  # a new agent process: it was told nothing yet
        rs.exit_heard = None  # nor heard of
        rs.snapshot_steps = ()  # its trainer's snapshots: said again by the new agent
    rs.pod, rs.node, rs.state, rs.instance = c.pod, c.node, c.state, c.instance
    if c.pod_uid:
        rs.pod_uid = c.pod_uid
        _own(job, c.rank, (c.pod, c.pod_uid))
    rs.gpus = c.gpus
    rs.generation, rs.released_generation = c.generation, c.released_generation
    rs.running = c.running
    rs.restarts = c.restart_count
    if not rs.connected:
        job.connected += 1
    rs.connected, rs.conn = True, c.conn


def _spare_joined(job: JobState, c: SpareJoined, now: float) -> None:
    job.last_seen = now
    sp = job.spares.get(c.instance)
    if sp is None:
        if len(job.spares) >= MAX_SPARES:
            return  # refused where it entered (jobs.py): never more than MAX_SPARES
        sp = job.spares[c.instance] = SpareState(instance=c.instance)
    sp.pod, sp.node, sp.conn = c.pod, c.node, c.conn
    if c.pod_uid:
        sp.pod_uid = c.pod_uid


def _spare_left(job: JobState, c: SpareLeft, now: float) -> None:
    job.spares.pop(c.instance, None)
    job.last_seen = now


def _spare_arrived(job: JobState, c: SpareArrived, now: float) -> None:
    sp = job.spares.get(c.instance)
    if sp is not None and sp.assigned is not None and sp.assigned >= 0:
        sp.arrived = max(sp.arrived, c.generation)


def replaced_gone(rs: RankState | None) -> bool:
    """The replaced rank's agent left, or reported its trainer's exit since the REPLACE
    (its state was "replacing"): a spare may take the rank's seat without a trainer of the
    old generation still running beside the new one."""
    return rs is None or not rs.connected or rs.state in ("exited", "succeeded")


def _promoted(job: JobState, c: Promoted, now: float) -> None:
    """The assigned spare takes rank ``c.rank``'s seat: a fresh RankState with its stream
    (the replaced agent's stream, if still open, no longer speaks for the rank)."""
    sp = job.spares.get(c.instance)
    if sp is None or sp.assigned != c.rank:
        return
    del job.spares[c.instance]
    old = job.ranks.get(c.rank)
    if old is None or not old.connected:
        job.connected += 1
    job.ranks[c.rank] = RankState(rank=c.rank, pod=sp.pod, pod_uid=sp.pod_uid, node=sp.node,
                                  connected=True, state="waiting", generation=sp.generation,
                                  instance=sp.instance, commanded=sp.generation,
                                  conn=sp.conn, from_spare=True)
    if sp.pod_uid:
        _own(job, c.rank, (sp.pod, sp.pod_uid))


# What each kind of change an agent's message makes does (one lookup per message).
def _snapshots_in(job: JobState, c: SnapshotsIn, now: float) -> None:
    rs = job.ranks.get(c.rank)
    if rs is not None:
        rs.snapshot_steps = c.steps


def _recorded(job: JobState, c: Any, now: float) -> None:
    """A change for the observers only (the timeline, the ledger): the job is as it was."""


_AGENT_SAYS: dict[type, Callable[[JobState, Any, float], None]] = {
    Registered: _registered, Owned: _owned, Left: _left, Progressed: _progressed,
    Arrived: _arrived, AtBarrier: _at_barrier, Exited: _exited, FaultSeen: _fault_seen,
    Settled: _settled, StacksIn: _stacks_in, SpareJoined: _spare_joined,
    SpareLeft: _spare_left, Promoted: _promoted, SpareArrived: _spare_arrived,
    SnapshotsIn: _snapshots_in, Revived: _revived, Preflighted: _recorded, Noted: _recorded,
    Slowed: _recorded, CapacityWait: _recorded, Forgotten: _recorded,
    Finished: _recorded}
