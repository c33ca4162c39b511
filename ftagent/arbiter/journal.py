"""What the arbiter writes down about jobs: the timeline, the history, the counters and the
goodput ledger's feed. Nothing here decides anything, and nothing calls it to write: the
journal observes the changes ``state.apply`` applied (``observe``, subscribed by the
registry to the kinds of change it reads, ``OBSERVES``: once per ``state.apply``, with a
fault and the decision about it together), as the cluster's decision listener observes
decisions.

A change becomes at most one timeline entry (``timeline.py``), feeds the goodput ledger
(``ledger.py``) and the job's ``JobStats`` (restarts by fault kind, seconds lost,
culprits), and writes the job's history record (``history.py``: status after an arbiter
restart, the exporter's past jobs) when it can alter it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftagent.arbiter.history import (
    CULPRIT_RANKS_KEPT,
    FAULTS_KEPT,
    History,
    JobRecord,
    incident_or_none,
)
from ftagent.arbiter.ledger import Ledger
from ftagent.arbiter.state import (
    CapacityWait,
    Change,
    Decision,
    Exited,
    FaultSeen,
    Finished,
    Forgotten,
    JobPhase,
    JobState,
    Left,
    Noted,
    Preflighted,
    Progressed,
    Promoted,
    Registered,
    Slowed,
    SpareJoined,
    SpareLeft,
    Verdict,
)
from ftagent.arbiter.timeline import Timeline
from ftagent.model import FaultKind

Key = tuple[str, str]  # (namespace, job)

@dataclass(slots=True)
class JobStats:
    """What the exporter adds up per job: restarts by fault kind, time lost to faults.
    Written here only (the journal observes the applied changes); the job's record reads
    it as ``history.Counters``."""

    restarts_by_reason: dict[str, int] = field(default_factory=dict)
    seconds_lost: float = 0.0
    # an open loss window: (wall time the fault was received, generation restarted into)
    lost_since: float | None = None
    lost_generation: int = -1
    # recent faults received: id -> (wall time, kind); the restart they lead to is
    # counted under the kind, and the time lost starts at their arrival
    faults: OrderedDict[str, tuple[float, str]] = field(default_factory=OrderedDict)
    ledger: Ledger | None = None  # where the job's wall time went (ledger.py)
    carried: JobRecord | None = None  # the job's record before an arbiter restart
    # decisions that blamed each rank (Decision.culprits of restarts, replacements and
    # stops), for ftagent_job_culprits_total; at most CULPRIT_RANKS_KEPT ranks, the rest
    # counted under -1 ("other"): a job of 100,000 ranks adds no 100,000 series
    culprits: dict[int, int] = field(default_factory=dict)

    def blamed(self, rank: int) -> None:
        key = rank if rank in self.culprits or len(self.culprits) < CULPRIT_RANKS_KEPT else -1
        self.culprits[key] = self.culprits.get(key, 0) + 1

    def fault(self, fault_id: str, at: float, kind: str) -> None:
        self.faults[fault_id] = (at, kind)
        while len(self.faults) > FAULTS_KEPT:
            self.faults.popitem(last=False)


# Decisions that change what the job's record holds (generation, restarts, phase, the
# ledger's mode): the record is written after them.
_RECORDED = frozenset((Verdict.RESTART, Verdict.REPLACE, Verdict.STOP,
                       Verdict.RELEASE_BARRIER, Verdict.RECONCILE, Verdict.REJOIN))


class Journal:
    def __init__(self, timeline: Timeline, history: History,
                 clock: Callable[[], float]) -> None:
        self.timeline = timeline
        self.history = history
        self.clock = clock
        # History is for status only: nothing in it decides anything.
        self.history.on_forget = lambda namespace, name: self.timeline.forget(name, namespace)
        self.timeline.seed(self.history.load())
        self.timeline.sink = self.history.entry if history.durable else None
        # Per job (the JobState it belongs to: a new run of the job starts over).
        self.stats: dict[Key, tuple[JobState, JobStats]] = {}
        # Jobs a Hello or a spare's promotion may have changed since their record was last
        # written: ``flush`` (the registry's tick) writes them, so a storm of Hellos is one
        # write.
        self.unsaved: dict[Key, JobState] = {}
        self._observe: dict[type, Callable[[JobState, Any, float], None]] = {
            Decision: self._decided, FaultSeen: self._fault, Exited: self._exited,
            Finished: self._finished, Registered: self._registered, Left: self._left,
            Progressed: self._progress, Preflighted: self._preflighted,
            SpareJoined: self._spare_joined,
            SpareLeft: self._spare_left, Promoted: self._promoted, Noted: self._noted,
            Slowed: self._slowed, CapacityWait: self._capacity, Forgotten: self._forgotten}

    # The kinds of change the journal observes (jobs.Jobs.subscribe).
    OBSERVES = (Decision, FaultSeen, Exited, Finished, Registered, Left, Progressed,
                Preflighted, SpareJoined, SpareLeft, Promoted, Noted, Slowed,
                CapacityWait, Forgotten)

    def observe(self, job: JobState, applied: list[Change], now: float) -> None:
        """What one ``state.apply`` applied to ``job`` (a fault and the decision about it
        come together), in order: written down."""
        for c in applied:
            self._observe[type(c)](job, c, now)

    def note(self, job: JobState, now: float, kind: str, message: str, *,
             rank: int | None = None, fault_id: str = "", action: str = "",
             culprits: tuple[Any, ...] = (), generation: int | None = None) -> None:
        """One timeline entry (only the observers here write them), at the job's
        generation unless the change says which it happened at (``generation``)."""
        self.timeline.add(now, job.job, job.namespace,
                          job.generation if generation is None else generation, kind,
                          message, rank=rank, fault_id=fault_id, action=action,
                          culprits=culprits)

    def save(self, job: JobState, now: float) -> None:
        """Refresh the job's history record (when a store keeps it: in memory only, the
        live job is what status reads)."""
        if self.history.durable:
            self.history.update(job, self.stats_of(job), now)

    def flush(self, now: float) -> None:
        """Write the records of jobs whose owners may have changed (the registry's tick)."""
        for job in self.unsaved.values():
            self.save(job, now)
        self.unsaved.clear()

    def stats_of(self, job: JobState) -> JobStats:
        """The job's counters for the exporter; a job of the history that runs again
        (not finished: the same run, after an arbiter restart) continues its own."""
        key = (job.namespace, job.job)
        got = self.stats.get(key)
        if got is not None and got[0] is job:
            return got[1]
        s = JobStats()
        rec = self.history.superseded(key)
        if rec is not None and not rec.finished:
            s.restarts_by_reason = dict(rec.restarts_by_reason)
            s.seconds_lost = rec.seconds_lost
            s.carried = rec if rec.goodput else None
        self.stats[key] = (job, s)
        return s

    def current(self, job: JobState) -> JobStats | None:
        """The job's counters if this run of it has any (read only: creates nothing)."""
        got = self.stats.get((job.namespace, job.job))
        return got[1] if got is not None and got[0] is job else None

    def fault_kind(self, job: JobState, fault_id: str) -> str:
        """The kind (``model.FaultKind`` value) of a fault the job saw, "" if unknown."""
        s = self.current(job)
        seen = s.faults.get(fault_id) if s is not None else None
        return seen[1] if seen else ""

    # ------------------------------------------------------------------ the ledger

    def ledger(self, job: JobState, now: float, generation: int = -1,
               midway: bool = False) -> Ledger:
        """The job's goodput ledger (ledger.py), started at its first registration, or
        continued from its record after an arbiter restart: the time since the record
        was written goes where time went then if the agents' generation is the record's
        (the job went on as it was), else it is unattributed."""
        s = self.stats_of(job)
        if s.ledger is None:
            carried, rec = None, s.carried
            if rec is not None:
                carried = dict(rec.goodput)
                gap = rec.goodput_mode if generation == rec.generation else "unattributed"
                carried[gap] = carried.get(gap, 0.0) + max(0.0, now - rec.last_seen)
            s.ledger = Ledger(now, job.world_size, carried, midway=midway,
                              carried_steps=rec.goodput_steps if rec else 0,
                              carried_restarts=rec.goodput_restarts if rec else 0,
                              carried_incidents=tuple(
                                  i for i in map(incident_or_none, rec.goodput_incidents)
                                  if i) if rec else ())
            s.carried = None
        return s.ledger

    # ------------------------------------------------------------------ the observers

    def _registered(self, job: JobState, c: Registered, now: float) -> None:
        """A Hello: the job's ledger starts at its first (midway: an agent's generation or
        trainer says the job ran before this arbiter); a reconnect or the last rank."""
        s = self.stats_of(job)
        if s.ledger is None:
            self.ledger(job, now, c.generation, midway=c.generation > 0 or c.running)
        # its owners, world size, restart count or connected agents may have changed: the
        # record is written at the next tick (unchanged records are not written again)
        self.unsaved[(job.namespace, job.job)] = job
        if not c.fresh:
            return
        if c.known:
            self.note(job, now, "agent", f"reconnected ({c.peer}, generation "
                      f"{c.generation}{', trainer running' if c.running else ''})",
                      rank=c.rank)
        elif job.connected == job.world_size:
            self.note(job, now, "agent", f"all {job.world_size} ranks connected")

    def _left(self, job: JobState, c: Left, now: float) -> None:
        if not job.finished:
            self.note(job, job.last_seen, "agent", "disconnected", rank=c.rank)
        if job.connected == 0:
            self.save(job, job.last_seen)

    def _spare_joined(self, job: JobState, c: SpareJoined, now: float) -> None:
        if c.told is not None:
            holder = job.ranks.get(c.told)
            name = (holder.pod or holder.instance) if holder is not None else "-"
            self.note(job, now, "agent", f"rank {c.told} is held by spare {name}, which "
                      f"took it over when the rank was replaced: {c.peer} serves as the "
                      "job's spare", rank=c.told)
        else:
            self.note(job, now, "agent", f"spare {c.peer} connected ({len(job.spares)} "
                      "spare(s))")

    def _spare_left(self, job: JobState, c: SpareLeft, now: float) -> None:
        if not job.finished:
            self.note(job, job.last_seen, "agent", f"spare {c.peer or c.instance} "
                      "disconnected")

    def _promoted(self, job: JobState, c: Promoted, now: float) -> None:
        rs = job.ranks.get(c.rank)
        if rs is None or rs.instance != c.instance:
            return  # not promoted (state.apply found no such spare)
        self.unsaved[(job.namespace, job.job)] = job
        self.note(job, now, "agent", f"spare {rs.pod or rs.instance} is rank {c.rank} now "
                  f"(generation {rs.generation})", rank=c.rank)

    def _noted(self, job: JobState, c: Noted, now: float) -> None:
        self.note(job, now, c.kind, c.message, rank=c.rank, fault_id=c.fault_id,
                  action=c.action)

    def _exited(self, job: JobState, c: Exited, now: float) -> None:
        how = f"signal {c.signal}" if c.signal is not None else f"code {c.status}"
        self.note(job, now, "exit", f"trainer of generation {c.generation} exited with "
                  f"{how}" + (f" (read from {c.via}: its agent could not say it)"
                              if c.via else ""), rank=c.rank)

    def _finished(self, job: JobState, c: Finished, now: float) -> None:
        """Every rank's exit is known: succeeded (all 0), or failed (state._ended_unheard:
        exits read where agents left them, no arbiter decided it)."""
        self.ledger(job, now).end(now)
        if c.phase is JobPhase.SUCCEEDED:
            self.note(job, now, "decision", f"every rank exited 0: job succeeded at "
                      f"generation {job.generation}", action="succeeded")
        else:
            self.note(job, now, "decision", f"every rank exited: job {job.stop_reason}",
                      action="stop")
        self.save(job, now)

    def _forgotten(self, job: JobState, c: Forgotten, now: float) -> None:
        """The job is forgotten (no agent for long): only its history record stays."""
        key = (job.namespace, job.job)
        got = self.stats.pop(key, None)
        self.unsaved.pop(key, None)
        self.history.retire(job, got[1] if got else None)

    def _progress(self, job: JobState, c: Progressed, now: float) -> None:
        """A rank's progress summary for the ledger."""
        rs = job.ranks[c.rank]
        led = self.ledger(job, now)
        led.world_size, mode = job.world_size, led.mode
        # when the step was seen: the summary's own stamp (it may wait up to a
        # progress interval to be sent), never later than its arrival
        at = min(now, c.ts) if c.ts > 0 else c.last_step_at
        # a rank that arrived for a generation not released to it yet still reports
        # its previous trainer (lines read after that trainer's exit), unless its
        # Hello said a trainer of that generation runs (started failing open)
        g = rs.generation if rs.released_generation >= rs.generation or rs.running \
            else max(0, rs.released_generation)
        if c.resumed is not None:  # before its first step: it decides the resume
            led.resumed(g, *c.resumed)
        led.progress(rs.rank, g, c.step, at)
        led.phases(rs.rank, g, c.phases, at)
        if led.mode is not mode:  # the record says where time goes (arbiter restart)
            self.save(job, now)

    def _preflighted(self, job: JobState, c: Preflighted, now: float) -> None:
        self.ledger(job, now).preflight(c.generation, c.seconds, now)

    def _slowed(self, job: JobState, c: Slowed, now: float) -> None:
        self.ledger(job, now).slowed(c.seconds, c.at, step=c.step, over=c.over)

    def _capacity(self, job: JobState, c: CapacityWait, now: float) -> None:
        if not job.finished:
            self.ledger(job, now).capacity(c.waiting, now)

    def _fault(self, job: JobState, c: FaultSeen, now: float) -> None:
        """A fault seen: on the timeline, counted by kind, and its onset and detection for
        the ledger: the onset its detector measured (read by the ledger from the fault's
        evidence, ``Ledger.fault_seen``: a hang's last step, a link's going down, an Xid's
        time), else none (a hang's is then the job's
        last step as the summaries stamp it: never their arrival, which can come a summary
        slot later); a link back continues the outage it ends. The agent's clock is not
        trusted beyond the ledger's clamping and ``now``."""
        fault = c.fault
        if fault is None:
            return  # a spare's: recorded, not the job's
        kind = fault.kind.value
        seen = ", seen by the arbiter" if c.by_arbiter else ""
        self.note(job, now, "fault", f"{kind} ({fault.severity.value}, generation "
                  f"{c.generation}{seen}): {fault.message}", rank=c.rank,
                  fault_id=fault.id, generation=c.job_generation)
        self.stats_of(job).fault(fault.id, now, kind)
        link_back = fault.kind is FaultKind.NIC and fault.evidence.get("recovered") is True
        self.ledger(job, now).fault_seen(
            fault.id, kind, min(fault.detected_at, now), fault.evidence,
            same_as=c.outage if link_back else "")

    def _decided(self, job: JobState, d: Decision, now: float) -> None:
        """On the timeline; restarts by fault kind; seconds from a fault to every rank
        training again; the ledger's restarts, releases, end and link outages."""
        kind = "barrier" if d.verdict is Verdict.RELEASE_BARRIER else "decision"
        self.note(job, now, kind, d.reason, rank=d.rank, fault_id=d.fault_id,
                  action=d.verdict.value, culprits=d.culprits)
        s = self.stats_of(job)
        led = self.ledger(job, now)
        everyone = not d.targets
        if d.verdict in (Verdict.RESTART, Verdict.REPLACE):
            led.restart(d.generation, now, fault_id=d.fault_id)
            for c in d.culprits:
                s.blamed(c.rank)
            seen = s.faults.get(d.fault_id)
            reason = seen[1] if seen else "other"
            s.restarts_by_reason[reason] = s.restarts_by_reason.get(reason, 0) + 1
            if s.lost_since is None:
                s.lost_since = seen[0] if seen else now
            s.lost_generation = d.generation
        elif d.verdict is Verdict.RELEASE_BARRIER and everyone:
            led.released(d.generation, now)
            if s.lost_since is not None and d.generation >= s.lost_generation:
                s.seconds_lost += max(0.0, now - s.lost_since)
                s.lost_since = None
        elif d.verdict is Verdict.STOP and everyone:
            led.end(now)
            for c in d.culprits:
                s.blamed(c.rank)
            s.lost_since = None  # it will not train again: not counted as lost
        elif d.verdict is Verdict.STOP:
            for c in d.culprits:
                s.blamed(c.rank)
        elif d.verdict is Verdict.WAIT:  # a link down: the job stalls on it (outage)
            led.outage(d.fault_id, now)
        elif d.verdict is Verdict.ALERT_ONLY:  # a link back the job resumed from by itself
            led.settled(d.fault_id, now)
        if d.verdict in _RECORDED:
            self.save(job, now)
