"""Where every second of a job went: a goodput ledger (issue 24).

For one job the ledger attributes wall time, from the job's first registration to now (or
its end), to categories that sum to that wall time exactly:

- ``startup``: job start until the first step of generation 0;
- ``productive``: training whose steps were kept;
- ``recomputed``: training whose steps were redone after a restart (from the step the job
  resumed at to the step it had reached when the fault began);
- ``detection``: a fault's onset (a crash: when the agent saw it; a hang: the hung rank's
  last step) until the agent's fault;
- ``decision``: the agent's fault until the arbiter released the barrier of the new
  generation (transit, policy, stack probes, the barrier's wait on every rank);
- ``restart``: barrier released until every rank's first step of the new generation;

"Every rank" is every rank that reports steps: many trainers print progress on one rank
only, so a generation trains once each rank that reported steps before it has reported
one in it (generation 0: the first step any rank reports, which in synchronous training
every rank has done too), or once a rank reports a second time (one that went silent does
not hold the ledger in ``restart``).
- ``unattributed``: time the ledger cannot place (an arbiter that was down, a generation
  change no fault explains, and after the job stopped for good).
- ``checkpoint`` and ``other_phases``: training time the trainer spent in declared phases
  (``ftagent.phase("checkpoint")``, Megatron's and DeepSpeed's "saving checkpoint" lines,
  an eval phase), as its agent measured them; taken out of ``productive`` (the rank that
  reports the most is believed: in synchronous training the others wait for it), never
  more than the training time since the generation began training.
- ``straggler``: training time the job waited on a slow rank: the share of each step the
  slowest rank's own time exceeds the others' median (arbiter/straggler.py's
  ``slowdown``, only while a rank is slow by its measure), over the time it was so.
- ``preflight``: the checks every rank runs before it arrives at a barrier
  (agent/preflight.py), as its agent measured them (``preflight``): carved out of the
  category the job was in (``decision`` after a fault, ``startup`` at the first start),
  the slowest rank's per generation (they run together), never more than that category
  holds.
- ``capacity``: after a decision, time a replacement pod of the job was Pending (no node
  for it yet: the cluster's capacity, not the job's fault), from the Kubernetes side's
  pod watch (``capacity``); it is carved out of ``decision``.
- ``outage``: a link outage that restarted nothing (the arbiter waited for the link, and
  once it was back the job's steps went on by themselves: TCP resumed the collective): the
  stall from the outage's onset (its link going down, as its agent measured it) to the
  job's first step after the link came back (``outage``, ``progress``). None of the
  other categories is that time: nothing was detected late, decided, restarted or redone;
  training was stalled on the network. It is an incident too (``Incident.restarted``
  False: detect = onset -> link back, decide = link back -> that first step, no restart,
  nothing recomputed). An outage that ends in a restart is that restart's incident, its
  time detection and decision as before (``restart`` takes the outage's times). The stall
  is the outage's only: not ``straggler`` (the agents' step means that hold the stalled
  step make a rank look slow for a while: ``slowed``'s ``step``/``over``), not a learned
  phase (the agent's hang verifier may learn the stall as an undeclared one, reported
  once steps resume: ``phases``), not ``recomputed`` (a later restart that resumes before
  it redoes the training around it).

The resume step comes from the job itself: an explicit report (``resumed``: a "loaded
checkpoint ... iteration N" line or an SDK call), else the first step of the new
generation (its first step F means step F - 1 was the last one kept). Where neither is
known the recomputed steps are ``None`` ("unknown"), never guessed, and the old
generation's training stays ``productive``.

Pure: no I/O, time passed in (wall-clock seconds, the registry's clock), so a test replays
a job's events with an injected clock. Values from agents (step times, fault times) are
clamped into the interval the ledger is placing, so a skewed or hostile clock moves time
between adjacent categories at most, never outside the job's wall time.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

SNAPSHOT_SOURCES = ("memory", "peer", "disk")  # where ftagent.checkpoint found the state
SAID_SOURCES = ("reported", *SNAPSHOT_SOURCES)  # the trainer said where it resumed
CATEGORIES = ("startup", "productive", "recomputed", "detection", "decision", "restart",
              "unattributed", "checkpoint", "other_phases", "straggler", "capacity",
              "outage", "preflight")
MAX_PREFLIGHT = 600.0  # seconds one preflight may claim (its budgets are seconds)
PHASE_CATEGORIES = ("checkpoint", "other_phases")  # (checkpoint, other) seconds, in order
SAMPLES_KEPT = 4096  # (time, step) points kept per training stretch, for interpolation
INCIDENTS_KEPT = 64  # per job, the newest
FAULTS_KEPT = 64  # faults remembered until a decision names them
# An outage's stall learned by the agent as an undeclared phase arrives with the summary
# after the step that ended it (one per 5 s); phase time reported later is not that stall.
STALL_REPORTED_WITHIN = 30.0
MAX_LEAD = 7 * 24 * 3600.0  # an onset claimed further before its detection: not believed


class Mode(str, enum.Enum):
    STARTUP = "startup"
    TRAINING = "productive"
    DETECTION = "detection"
    DECISION = "decision"
    RESTART = "restart"
    CAPACITY = "capacity"
    OUTAGE = "outage"  # training stalled on a link that is down (or not resumed yet)
    OFF = "unattributed"  # stopped, or waiting on something the ledger cannot explain


class FaultTimes(NamedTuple):
    """A fault as the ledger keeps it until a decision names it."""

    kind: str
    onset: float | None  # None: not measured
    detected: float
    last_step: int | None = None  # a hang: the last step its agent saw (None: not said)


@dataclass(slots=True)
class Stretch:
    """Training time [start, end) of one generation, with its steps over time."""

    generation: int
    start: float
    first_step: int  # the lowest first step of its ranks
    end: float | None = None
    samples: deque[tuple[float, int]] = field(
        default_factory=lambda: deque(maxlen=SAMPLES_KEPT))
    kept_until: float | None = None  # after this time its steps were redone (None: end)
    phase_moved: float = 0.0  # seconds of it moved to the phase categories
    # [onset, first step after) of each link outage inside it (booked as ``outage``), the
    # newest INCIDENTS_KEPT (a flapping link must not grow it without bound)
    stalls: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=INCIDENTS_KEPT))

    def reached(self) -> int | None:
        return self.samples[-1][1] if self.samples else None

    def time_of(self, step: int) -> float:
        """When this stretch completed ``step``: linear between the kept samples, its start
        for a step at or before its first, its last sample's time for one after."""
        prev: tuple[float, int] = (self.start, self.first_step)
        if step <= prev[1]:
            return self.start
        for t, s in self.samples:
            if s >= step:
                if s == prev[1]:
                    return t
                return prev[0] + (t - prev[0]) * (step - prev[1]) / (s - prev[1])
            prev = (max(t, prev[0]), s)
        return prev[0]


@dataclass(slots=True)
class Outage:
    """A link outage while the job trained, until its first step after the link is back."""

    fault_id: str
    onset: float
    detected: float
    back: float | None = None  # the (last) link back, as its agent saw it
    back_id: str = ""  # that link back's fault (the arbiter's resume verdict names it)


@dataclass(slots=True)
class Incident:
    """One restart: the fault's times, the decision, the new generation's first step; or
    (``restarted`` False) a link outage that restarted nothing: ``detected`` is the link
    back, ``first_step_at`` the job's first step after it."""

    generation: int  # the generation restarted into (an outage: the one it stalled)
    kind: str
    onset: float
    detected: float
    decided: float
    released: float | None = None
    first_step_at: float | None = None
    reached: int | None = None  # the step the old generation had reached
    resumed: int | None = None  # the last step kept (the new generation starts after it)
    # "reported" | "memory" | "peer" | "disk" (the trainer said; the last three:
    # ftagent.checkpoint's snapshot) | "first_step" | "" (unknown)
    resume_source: str = ""
    recompute_seconds: float = 0.0
    # restarted again before its generation trained: it redid nothing (the next incident
    # takes over the step the job had reached)
    superseded: bool = False
    restarted: bool = True  # False: a link outage the job resumed from by itself

    @property
    def recomputed_steps(self) -> int | None:
        if self.superseded or not self.restarted:
            return 0
        if self.reached is None or self.resumed is None:
            return None
        return max(0, self.reached - self.resumed)

    def durations(self) -> dict[str, float | None]:
        """Seconds per stage (None: not reached yet; an outage's restart: none)."""
        if not self.restarted:
            return {"detect": self.detected - self.onset,
                    "decide": None if self.first_step_at is None
                    else self.first_step_at - self.detected,
                    "restart": None, "recompute": 0.0}
        return {
            "detect": self.detected - self.onset,
            "decide": None if self.released is None else self.released - self.detected,
            "restart": None if self.first_step_at is None or self.released is None
            else self.first_step_at - self.released,
            "recompute": self.recompute_seconds,
        }


@dataclass(frozen=True, slots=True)
class Breakdown:
    start: float
    wall: float
    seconds: dict[str, float]
    recomputed_steps: int | None  # None: some restart's resume step is unknown
    # the newest INCIDENTS_KEPT: those carried over from before an arbiter restart (the
    # job's history record), then this ledger's
    incidents: tuple[Incident, ...]
    restarts: int = 0  # restarts placed, carried ones included (outages are not)
    carried_wall: float = 0.0  # seconds carried over from before an arbiter restart

    @property
    def started_at(self) -> float:
        """When the wall time began: the first registration, less any carried time."""
        return self.start - self.carried_wall

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive / wall (0 before any time passed)."""
        return self.seconds["productive"] / self.wall if self.wall > 0 else 0.0


class Ledger:
    """One job's wall time, placed as events arrive (see the module docstring).

    ``carried``: seconds per category from before an arbiter restart (the job's history
    record); they are added to what this ledger places from ``start`` on, as are
    ``carried_steps`` (recomputed steps; None: unknown) and ``carried_restarts``;
    ``carried_incidents`` (that record's incidents) are shown before this ledger's, as
    they were (their steps are in ``carried_steps`` already; a restart that was still
    under way stays as far as it had come).
    ``midway``: the job was already running when the ledger started (no startup).
    """

    def __init__(self, start: float, world_size: int = 1,
                 carried: dict[str, float] | None = None, midway: bool = False, *,
                 carried_steps: int | None = 0, carried_restarts: int = 0,
                 carried_incidents: tuple[Incident, ...] = ()) -> None:
        self.start = start
        self.world_size = max(1, world_size)
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.carried = {c: float((carried or {}).get(c, 0.0)) for c in CATEGORIES}
        self.carried_steps, self.carried_restarts = carried_steps, carried_restarts
        self.carried_incidents = tuple(carried_incidents)[-INCIDENTS_KEPT:]
        self.mode = Mode.STARTUP
        self.since = start  # start of the open interval (in ``mode``)
        self.generation = 0
        self.first_steps: dict[int, tuple[int, float]] = {}  # rank -> (step, at) this gen
        self.reporters: set[int] = set()  # ranks that ever reported a step
        self._expected: set[int] = set()  # reporters known when this generation began
        self._reports: dict[int, int] = {}  # rank -> summaries in this generation
        self.stretches: list[Stretch] = []
        self.incidents: deque[Incident] = deque(maxlen=INCIDENTS_KEPT)
        self.faults: OrderedDict[str, FaultTimes] = OrderedDict()
        self._exported: dict[str, float] = {}
        self._phase_seen: dict[int, tuple[float, ...]] = {}  # rank -> its phase seconds
        self._phase_job: tuple[float, ...] = (0.0,) * len(PHASE_CATEGORIES)
        self._slow_at: float | None = None  # the last straggler accounting (training)
        self._outage: Outage | None = None  # a link outage the job is stalled on
        self._stall_steps: deque[int] = deque(maxlen=8)  # steps that spanned an outage
        self._quiet_until = -1  # no straggler share up to this step (an outage's stall)
        # (seconds, until): phase time reported by then is the last outage's stall
        self._stall_credit: tuple[float, float] | None = None
        self._preflight: dict[int, float] = {}  # generation -> the slowest preflight
        if midway or any(self.carried.values()):
            # met midway (an arbiter restarted under a running job): until every rank's
            # next step, the ledger cannot say what the job is doing
            self.mode = Mode.OFF
        self.ended: float | None = None

    # ------------------------------------------------------------------ events

    def progress(self, rank: int, generation: int, step: int, at: float) -> None:
        """Rank ``rank`` of ``generation`` completed ``step`` at ``at`` (its last step)."""
        if self.ended is not None or step < 0:
            return
        if generation < self.generation:
            self._late(generation, step)
            return
        if generation > self.generation:  # a generation no decision announced (reconcile)
            self._new_generation(generation, self.since)
        at = self._clamp(_finite(at, self.since))
        if len(self.reporters) < self.world_size:
            self.reporters.add(rank)
        n = self._reports[rank] = self._reports.get(rank, 0) + 1
        if rank not in self.first_steps:
            self.first_steps[rank] = (step, at)
        if self.mode in (Mode.STARTUP, Mode.RESTART, Mode.OFF) and (
                self._expected <= self.first_steps.keys() or n >= 2):
            self._begin_training(max(t for _, t in self.first_steps.values()))
        cur = self._current()
        if cur is not None and at >= cur.start and (not cur.samples
                                                     or step > cur.samples[-1][1]):
            cur.samples.append((max(at, cur.samples[-1][0] if cur.samples else at), step))
            out = self._outage
            if self.mode is Mode.OUTAGE and out is not None and out.back is not None \
                    and at >= out.back:
                self._outage_over(at, step)

    def resumed(self, generation: int, step: int, source: str = "") -> None:
        """The job says generation ``generation`` resumed after ``step`` (a checkpoint
        loaded at iteration ``step``, an SDK call): preferred over the first step seen.
        ``source``: where ftagent.checkpoint found the state (``SNAPSHOT_SOURCES``; ""
        : the trainer did not say, recorded as "reported"). Call it before the
        generation's first step (such lines come before it); later, the first step has
        already decided."""
        if step < 0 or generation < self.generation:
            return
        inc = self._incident(generation)
        if inc is not None and inc.first_step_at is None:
            said = source if source in SNAPSHOT_SOURCES else "reported"
            if said == "reported" and inc.resume_source in SNAPSHOT_SOURCES:
                # ftagent.checkpoint said where the state came from, exactly; a checkpoint
                # line the trainer printed (a disk load before its snapshot's, whichever
                # report reached the arbiter last) is not where it resumed
                return
            if inc.resumed == step and inc.resume_source in SNAPSHOT_SOURCES and said in \
                    SNAPSHOT_SOURCES and SNAPSHOT_SOURCES.index(said) < \
                    SNAPSHOT_SOURCES.index(inc.resume_source):
                return  # ranks resumed from different rungs: the slowest one is the job's
            inc.resumed = step
            inc.resume_source = said

    def phases(self, rank: int, generation: int, seconds: tuple[float, ...],
               at: float) -> None:
        """Rank ``rank``'s trainer of ``generation`` has spent ``seconds`` (one per
        ``PHASE_CATEGORIES``, since it started) in declared phases, as of ``at``. The
        growth of the largest report since the last one moves from productive to those
        categories, at most the training time of this generation not moved yet."""
        if self.ended is not None or generation != self.generation or len(seconds) != len(
                PHASE_CATEGORIES) or not all(math.isfinite(v) and v >= 0 for v in seconds):
            return
        prev = self._phase_seen.get(rank)
        if prev is None and len(self._phase_seen) >= max(self.world_size, 1):
            return  # more ranks than the job has: not believed
        mine = self._phase_seen[rank] = tuple(max(a, b) for a, b in zip(
            prev or seconds, seconds, strict=True))
        # the job's: the largest over its ranks. Each rank's only grows, so it is the
        # previous job figure raised by this rank's (O(1) per summary: recomputing it over
        # every rank made each round of summaries O(ranks^2), 20 % of the arbiter's CPU
        # at 1,000 agents)
        job = tuple(max(a, b) for a, b in zip(self._phase_job, mine, strict=True))
        grew = [max(0.0, a - b) for a, b in zip(job, self._phase_job, strict=True)]
        self._phase_job = job
        credit = self._stall_credit
        if credit is not None and _finite(at, math.inf) <= credit[1]:
            # the agent's hang verifier learned the outage's stall as an undeclared phase
            # (a stall found alive), reported once steps resumed: it is ``outage``
            # already. Other first: a stall in a collective ran in no save.
            left = credit[0]
            for i in reversed(range(len(grew))):
                took = min(grew[i], left)
                grew[i] -= took
                left -= took
            self._stall_credit = (left, credit[1]) if left > 0 else None
        cur = self._current()
        if self.mode is not Mode.TRAINING or cur is None or not any(grew):
            return
        self._close(self._clamp(_finite(at, self.since)), Mode.TRAINING)
        room = max(0.0, min(self.since - cur.start - cur.phase_moved,
                            self.totals["productive"]))
        for c, g in zip(PHASE_CATEGORIES, grew, strict=True):
            move = min(g, room)
            room -= move
            cur.phase_moved += move
            self.totals["productive"] -= move
            self.totals[c] += move

    def slowed(self, share: float, at: float, *, step: int | None = None,
               over: int = 0) -> None:
        """The job waits ``share`` of each step on a slow rank (straggler.slowdown) as of
        ``at``: that share of the training time since the last call (or since training
        began) moves from productive to straggler. ``step``, ``over``: the summary behind
        this call has its means over the steps (step - over, step]; where those hold a
        step that spanned a link outage, its stall (already ``outage``) is what made a
        rank look slow, and nothing moves until the job is another ``over`` steps past
        ``step`` (the share compares every rank's latest means: by then each rank whose
        window held the stall has sent newer ones; the agents' means cover their last 64
        steps, a summary goes every 5 s: a few seconds). O(1) per summary."""
        cur = self._current()
        if self.ended is not None or self.mode is not Mode.TRAINING or cur is None:
            self._slow_at = None
            return
        at = self._clamp(_finite(at, self.since))
        start = max(self._slow_at if self._slow_at is not None else cur.start, cur.start)
        self._slow_at = max(at, start)
        share = _finite(share, 0.0)
        if step is not None and any(step - over < s <= step for s in self._stall_steps):
            self._quiet_until = max(self._quiet_until, step + over)
        reached = cur.reached()
        if reached is not None and reached <= self._quiet_until:
            share = 0.0
        if at <= start or not 0.0 < share < 1.0:
            return
        self._close(at, Mode.TRAINING)
        move = min(share * (at - start), self.totals["productive"])
        self.totals["productive"] -= move
        self.totals["straggler"] += move

    def preflight(self, generation: int, seconds: float, at: float) -> None:
        """A rank's preflight for ``generation`` took ``seconds`` (before its arrival at
        ``at``): that time, the slowest rank's per generation, moves into ``preflight``
        from the mode the job waits in (decision, capacity, startup)."""
        if self.ended is not None or generation != self.generation or \
                self.mode not in (Mode.DECISION, Mode.CAPACITY, Mode.STARTUP):
            return
        secs = min(_finite(seconds, 0.0), MAX_PREFLIGHT)
        done = self._preflight.get(generation, 0.0)
        if secs <= done:
            return
        self._preflight = {generation: secs}  # only the current generation's is kept
        self._close(max(_finite(at, self.since), self.since), self.mode)
        move = min(secs - done, self.totals[self.mode.value])
        self.totals[self.mode.value] -= move
        self.totals["preflight"] += move

    def capacity(self, waiting: bool, at: float) -> None:
        """A replacement pod of the job is Pending (``waiting``) or no longer is, as of
        ``at``: while the job waits for its new generation's barrier, that time is
        capacity, not decision."""
        if self.ended is not None:
            return
        at = max(_finite(at, self.since), self.since)
        if waiting and self.mode is Mode.DECISION:
            self._close(at, Mode.CAPACITY)
        elif not waiting and self.mode is Mode.CAPACITY:
            self._close(at, Mode.DECISION)

    def fault(self, fault_id: str, kind: str, onset: float | None, detected: float, *,
              same_as: str = "", last_step: int | None = None) -> None:
        """A fault arrived: it began at ``onset`` (a hang: the job's last step; a link:
        when it went down; an Xid: when the GPU raised it; None: not measured, a hang's
        is then the job's last step the ledger holds, any other's its detection) and was
        detected at ``detected``; a restart that names it uses these times. ``same_as``: an earlier
        fault this one continues (a link back after an outage): a restart that names this
        one takes that one's times, where the ledger still has them. ``last_step``: a
        hang's last step as its agent saw it (the job's last sample is believed over
        ``onset`` only past it)."""
        self.faults[fault_id] = self.faults.get(
            same_as, FaultTimes(kind, onset, detected, last_step))
        while len(self.faults) > FAULTS_KEPT:
            self.faults.popitem(last=False)
        out = self._outage
        if same_as and out is not None and self.ended is None:  # a link back
            back = max(_finite(detected, self.since), out.onset)
            out.back = back if out.back is None else max(out.back, back)
            out.back_id = fault_id

    def fault_seen(self, fault_id: str, kind: str, detected: float,
                   evidence: Mapping[str, object], *, same_as: str = "") -> None:
        """A fault arrived, as its agent sent it: ``fault`` with the onset its detector
        measured (``onset_of``: a hang's last step, a link's going down, an Xid's time;
        else None) and a hang's ``last_step`` read from its ``evidence`` (numbers only)."""
        last = evidence.get("last_step")  # a hang's: the last step its agent saw
        self.fault(fault_id, kind, onset_of(kind, detected, evidence), detected,
                   same_as=same_as,
                   last_step=last if isinstance(last, int) and not isinstance(last, bool)
                   else None)

    def outage(self, fault_id: str, now: float) -> None:
        """The arbiter waits for the link of fault ``fault_id`` (down since its onset):
        while the job trained, its time from that onset is ``outage`` until the job's
        first step stamped after the link came back (``progress``; steps a rank completes
        while its link is down are collectives that had finished before it went, not
        training again), or a restart (``restart``: then the outage is that restart's
        detection and decision). A second link down during an outage: the first's onset
        stands."""
        if self.ended is not None or self.mode is not Mode.TRAINING \
                or self._outage is not None:
            return
        now = max(_finite(now, self.since), self.since)
        f = self.faults.get(fault_id)
        detected = min(max(_finite(f.detected, now) if f else now, self.since), now)
        onset = f.onset if f is not None and f.onset is not None else detected
        self._close(min(max(_finite(onset, detected), self.since), detected), Mode.OUTAGE)
        self._outage = Outage(fault_id, self.since, detected)

    def settled(self, fault_id: str, now: float) -> None:
        """The arbiter found the job resumed by itself after the link back ``fault_id``
        (every rank's step advanced): where the ledger has not seen such a step stamped
        after the link came back (an agent's clock behind the arbiter's), the outage ends
        now."""
        out = self._outage
        if self.ended is None and self.mode is Mode.OUTAGE and out is not None \
                and out.back_id == fault_id:
            cur = self._current()
            self._outage_over(max(_finite(now, self.since), self.since),
                              cur.reached() if cur is not None else None)

    def restart(self, generation: int, now: float, *, fault_id: str = "", kind: str = "",
                onset: float | None = None, detected: float | None = None) -> None:
        """A RESTART/REPLACE decision moves the job to ``generation`` at ``now``; the fault
        that led to it (``fault_id``, else ``kind``, ``onset``, ``detected``) began at
        ``onset`` and the agent saw it at ``detected`` (unknown: ``now``). Where a hang
        was reported earlier in the same stall (no step since), the incident's onset and
        detection are that hang's (``_stall_seen``); its kind stays the decided fault's."""
        if self.ended is not None or generation <= self.generation:
            return
        self._outage = None  # an outage that ends in this restart is its incident
        last_step = None
        if fault_id in self.faults:
            kind, onset, detected, last_step = self.faults[fault_id]
        now = max(_finite(now, self.since), self.since)
        onset = None if onset is None else _finite(onset, now)
        detected = None if detected is None else _finite(detected, now)
        cur = self._current()
        lo = max(self.since, cur.start) if cur is not None else self.since
        detected = min(max(detected if detected is not None else now, lo), now)
        times = kind  # the kind of the fault whose times the incident takes
        first = self._stall_seen(cur, detected)
        if first is not None:  # a hang reported before it, the job stalled since: its times
            times, onset, last_step = first.kind, first.onset, first.last_step
            detected = min(max(first.detected, lo), now)
        if times == "hang" and cur is not None and cur.samples \
                and cur.samples[-1][0] <= detected:
            # the job's last step before the stall, as its summaries stamp it (their
            # arrival can be a summary slot later), where the agent measured no onset or
            # the job went past the step it saw last (that step was not the stall yet);
            # else the agent's own measure (another rank's agent may have read the same
            # step a log tick later)
            last, step = cur.samples[-1]
            if onset is None or last_step is None or step > last_step:
                onset = last if onset is None else max(onset, last)
        onset = min(max(onset if onset is not None else detected, lo), detected)
        reached = cur.reached() if cur is not None else None
        prev = self._last_restart()
        if cur is None and prev is not None and prev.generation == self.generation \
                and prev.first_step_at is None:
            # its generation never trained: the job still stands where that restart
            # found it, and that restart redid nothing
            reached, prev.superseded = prev.reached, True
        if self.mode in (Mode.TRAINING, Mode.OUTAGE):
            self._close(onset, Mode.DETECTION)
            if cur is not None:
                cur.end = onset
        else:
            onset = detected = max(self.since, onset)
            self._close(onset, Mode.DETECTION)
        self._close(detected, Mode.DECISION)
        self._new_generation(generation, now)
        self.incidents.append(Incident(generation, kind or "unknown", onset, detected, now,
                                       reached=reached))

    def released(self, generation: int, now: float) -> None:
        """The barrier of ``generation`` was released: its trainers start."""
        inc = self._incident(generation)
        if inc is None or inc.released is not None or self.ended is not None:
            return
        inc.released = max(_finite(now, self.since), self.since)
        if self.mode in (Mode.DECISION, Mode.CAPACITY) and generation == self.generation:
            self._close(inc.released, Mode.RESTART)

    def end(self, now: float) -> None:
        """The job ended (succeeded or stopped): the ledger stops at ``now``."""
        if self.ended is not None:
            return
        now = max(_finite(now, self.since), self.since)
        cur = self._current()
        if cur is not None and cur.end is None:
            cur.end = now
        self._close(now, Mode.OFF)
        self.ended, self._outage = now, None

    # ------------------------------------------------------------------ answers

    def breakdown(self, now: float) -> Breakdown:
        end = self.ended if self.ended is not None else max(_finite(now, self.since),
                                                            self.since)
        secs = {c: self.totals[c] + self.carried[c] for c in CATEGORIES}
        secs[self.mode.value] += end - self.since
        wall = end - self.start + sum(self.carried.values())
        steps = self.carried_steps
        for inc in self.incidents if steps is not None else ():
            n = inc.recomputed_steps
            if n is None:
                if inc.first_step_at is not None:
                    steps = None
                    break
                continue
            assert steps is not None
            steps += n
        shown = (*self.carried_incidents, *self.incidents)[-INCIDENTS_KEPT:]
        return Breakdown(self.start, wall, secs, steps, shown,
                         self.carried_restarts + sum(i.restarted for i in self.incidents),
                         sum(self.carried.values()))

    def exported(self, now: float) -> dict[str, float]:
        """Per category, for Prometheus counters: never lower than a value exported
        before (a restart moves time from productive to recomputed; the counter of
        productive then holds until kept training passes it again)."""
        for c, v in self.breakdown(now).seconds.items():
            self._exported[c] = max(self._exported.get(c, 0.0), v)
        return dict(self._exported)

    # ------------------------------------------------------------------ internals

    def _clamp(self, at: float) -> float:
        return at if at >= self.since else self.since

    def _current(self) -> Stretch | None:
        s = self.stretches[-1] if self.stretches else None
        return s if s is not None and s.generation == self.generation and s.end is None \
            else None

    def _incident(self, generation: int) -> Incident | None:
        """The restart into ``generation`` (an outage in it is not one)."""
        for inc in reversed(self.incidents):
            if inc.generation == generation and inc.restarted:
                return inc
        return None

    def _last_restart(self) -> Incident | None:
        for inc in reversed(self.incidents):
            if inc.restarted:
                return inc
        return None

    def _outage_over(self, at: float, step: int | None) -> None:
        """The job trains again after the outage (its first step after the link came
        back, at ``at``): the outage is an incident that restarted nothing."""
        out, cur = self._outage, self._current()
        assert out is not None
        self._outage = None
        self._close(at, Mode.TRAINING)
        self._slow_at = self.since
        if cur is not None:
            cur.stalls.append((out.onset, self.since))
        self._stall_credit = (self.since - out.onset, self.since + STALL_REPORTED_WITHIN)
        if step is not None:
            self._stall_steps.append(step)
        back = min(max(out.back if out.back is not None else self.since, out.onset),
                   self.since)
        self.incidents.append(Incident(self.generation, "nic", out.onset, back, back,
                                       first_step_at=self.since, restarted=False))

    def _close(self, at: float, mode: Mode) -> None:
        at = max(at, self.since)
        self.totals[self.mode.value] += at - self.since
        self.since, self.mode = at, mode

    def _new_generation(self, generation: int, at: float) -> None:
        self._outage, self._stall_credit = None, None
        self._stall_steps.clear()
        self._quiet_until = -1
        if self.mode in (Mode.TRAINING, Mode.OUTAGE):  # no fault explains it: say so
            cur = self._current()
            if cur is not None:
                cur.end = max(at, self.since)
            self._close(at, Mode.OFF)
        self.generation = generation
        self.first_steps, self._reports = {}, {}
        self._phase_seen, self._phase_job = {}, (0.0,) * len(PHASE_CATEGORIES)
        self._expected = set(self.reporters)

    def _stall_seen(self, cur: Stretch | None, before: float) -> FaultTimes | None:
        """The first hang reported since the job's last step (and before ``before``): a
        restart decided on a later fault of that stall (the collective's timeout crashing
        a hung rank, after the hang was judged busy) counts its detection from the hang,
        not the stall as steps redone. None: no such hang, or no step seen."""
        if cur is None or not cur.samples:
            return None
        last = cur.samples[-1][0]
        best: FaultTimes | None = None
        for f in self.faults.values():
            if f.kind == "hang" and last <= f.detected < before and (
                    best is None or f.detected < best.detected):
                best = f
        return best

    def _late(self, generation: int, step: int) -> None:
        """A step of a generation already restarted from (its agent's last summary, sent
        with its exit, may come after the fault): the step it had reached, while the
        restart's first step is not seen yet. A generation with no training stretch (the
        fault came before the ledger saw any of its steps: a loaded node's trainers
        printed their first steps only after it) had still done that step: it is redone
        too (no time moves: there was no training time to move)."""
        inc = self._last_restart()
        st = self.stretches[-1] if self.stretches else None
        if inc is None or inc.first_step_at is not None or generation >= inc.generation:
            return
        if st is not None and st.generation == generation:
            if st.end is not None and st.end <= inc.onset and (
                    inc.reached is None or step > inc.reached):
                inc.reached = step
                st.samples.append((st.end, step))
        elif (st is None or st.generation < generation) and (
                inc.reached is None or step > inc.reached):
            inc.reached = step  # (not older than the last generation that trained)

    def _begin_training(self, at: float) -> None:
        at = max(at, self.since)
        self._close(at, Mode.TRAINING)
        first = min(s for s, _ in self.first_steps.values())
        st = Stretch(self.generation, at, first)
        self.stretches.append(st)
        del self.stretches[:-SAMPLES_KEPT]
        inc = self._incident(self.generation)
        if inc is not None and inc.first_step_at is None:
            inc.first_step_at = at
            if inc.resume_source in SAID_SOURCES and inc.resumed is not None:
                self._recompute(inc, inc.resumed, inc.resume_source)
            else:
                self._recompute(inc, first - 1, "first_step")

    def _recompute(self, inc: Incident, resumed: int, source: str) -> None:
        """The job resumed after step ``resumed``: training before this incident that
        completed later steps was redone; that time moves from productive to recomputed
        (walking back over earlier stretches while they too lie after the resume step)."""
        inc.resumed, inc.resume_source = resumed, source
        moved = 0.0
        for st in reversed(self.stretches):
            if st.generation >= inc.generation or st.end is None:
                continue
            top = st.end if st.kept_until is None else st.kept_until
            t = min(max(st.time_of(resumed), st.start), top)
            # an outage inside it is booked as such already: not redone training
            moved += top - t - sum(max(0.0, min(b, top) - max(a, t)) for a, b in st.stalls)
            st.kept_until = t
            if st.first_step <= resumed + 1:
                break
        moved = max(0.0, min(moved, self.totals["productive"]))
        self.totals["productive"] -= moved
        self.totals["recomputed"] += moved
        inc.recompute_seconds = moved


def _finite(t: float, default: float) -> float:
    """``t``, or ``default`` for NaN and infinities (nothing then moves or goes missing)."""
    return t if math.isfinite(t) else default


# ---------------------------------------------------------------- a fault's onset
# When a fault began, from what its detector measured: many faults are reported after
# they began (a hang once its budget ran out, a link once its grace did, a GPU fault once
# its Xid was read) and their detectors say how long before. Read here, by the ledger
# (its one reader: ``fault_seen``), believing numbers only, and bounded; the ledger then
# clamps the result into the training the fault interrupts.


def onset_of(kind: str, detected: float, evidence: Mapping[str, object]) -> float | None:
    """When a fault began, from what its detector measured (None: not said, take its
    detection): a hang, ``seconds_since_progress`` before its detection (the last step its
    agent saw); a link, its ``detection_latency_seconds`` (down -> fault) or, once back,
    its ``outage_seconds``; a GPU, the Xid's ``first_seen_wall``. Values from the agent:
    a number, not negative, at most ``MAX_LEAD`` before ``detected`` (the ledger clamps
    the result into the training it interrupts)."""
    lead: object = None
    if kind == "hang":
        lead = evidence.get("seconds_since_progress")
    elif kind == "nic":
        lead = evidence.get("outage_seconds" if evidence.get("recovered") is True
                            else "detection_latency_seconds")
    elif kind == "gpu":
        first = evidence.get("first_seen_wall")
        if _number(first):
            assert isinstance(first, (int, float))
            lead = detected - first
    if not _number(lead) or not math.isfinite(detected):
        return None
    assert isinstance(lead, (int, float))
    return detected - min(max(float(lead), 0.0), MAX_LEAD)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
