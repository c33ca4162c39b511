"""What the arbiter writes down about jobs: the timeline, the history, the counters and the
goodput ledger's feed. Nothing here decides anything.

Every note goes to the timeline (``timeline.py``) and refreshes the job's history record
(``history.py``: status after an arbiter restart, and the exporter's past jobs). Per job
it keeps ``JobStats``: restarts by fault kind, seconds lost, and the goodput ledger
(``ledger.py``), which it feeds from faults and decisions (``fault``, ``decided``) in one
place.
"""

from __future__ import annotations

from collections.abc import Callable

from ftagent.arbiter.fault_onset import onset_of
from ftagent.arbiter.history import History, JobStats, incident_or_none
from ftagent.arbiter.ledger import Ledger
from ftagent.arbiter.state import Culprit, Decision, JobState, RankState, Verdict
from ftagent.arbiter.timeline import Timeline
from ftagent.model import Fault, FaultKind
from ftagent.v1 import ftagent_pb2 as pb

Key = tuple[str, str]  # (namespace, job)


class Journal:
    def __init__(self, timeline: Timeline, history: History,
                 clock: Callable[[], float]) -> None:
        self.timeline = timeline
        self.history = history
        self.clock = clock
        # History is for status only: nothing in it decides anything.
        self.history.on_forget = lambda namespace, name: self.timeline.forget(name, namespace)
        self.timeline.seed(self.history.load())
        self.timeline.sink = self.history.entry
        # Per job (the JobState it belongs to: a new run of the job starts over).
        self.stats: dict[Key, tuple[JobState, JobStats]] = {}

    def note(self, job: JobState, now: float, kind: str, message: str, *,
             rank: int | None = None, fault_id: str = "", action: str = "",
             culprits: tuple[Culprit, ...] = ()) -> None:
        self.timeline.add(now, job.job, job.namespace, job.generation, kind, message,
                          rank=rank, fault_id=fault_id, action=action, culprits=culprits)
        self.history.update(job, self.stats_of(job), now)

    def save(self, job: JobState, now: float) -> None:
        """Refresh the job's history record (its last agent left, the ledger's mode, its
        ranks' owners: the tick's save_owners)."""
        self.history.update(job, self.stats_of(job), now, owners=True)

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

    def retire(self, key: Key, job: JobState) -> None:
        """The job is forgotten (no agent for long): only its history record stays."""
        got = self.stats.pop(key, None)
        self.history.retire(job, got[1] if got else None)

    # ------------------------------------------------------------------ the ledger's feed

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

    def progress(self, job: JobState, rs: RankState, p: pb.ProgressSummary,
                 now: float) -> None:
        """A rank's progress summary for the ledger."""
        step, ts = p.step, p.ts
        led = self.ledger(job, now)
        led.world_size, mode = job.world_size, led.mode
        # when the step was seen: the summary's own stamp (it may wait up to a
        # progress interval to be sent), never later than its arrival
        at = min(now, ts) if ts > 0 else (now if rs.last_step_at is None else rs.last_step_at)
        # a rank that arrived for a generation not released to it yet still reports
        # its previous trainer (lines read after that trainer's exit), unless its
        # Hello said a trainer of that generation runs (started failing open)
        g = rs.generation if rs.released_generation >= rs.generation or rs.running \
            else max(0, rs.released_generation)
        if p.HasField("resumed_step"):  # before its first step: it decides the resume
            led.resumed(g, p.resumed_step, p.resume_source)
        led.progress(rs.rank, g, step, at)
        led.phases(rs.rank, g, (p.checkpoint_seconds, p.other_phase_seconds), at)
        if led.mode is not mode:  # the record says where time goes (arbiter restart)
            self.save(job, now)

    def fault(self, job: JobState, rs: RankState | None, fault: Fault, now: float) -> None:
        """A fault seen: counted by kind, and its onset and detection for the ledger: the
        onset its detector measured (ledger.onset_of: a hang's last step, a link's going
        down, an Xid's time), else none (a hang's is then the job's last step as the
        summaries stamp it: never their arrival, which can come a summary slot later); a
        link back continues the outage it ends. The agent's clock is not
        trusted beyond the ledger's clamping and ``now``."""
        self.stats_of(job).fault(fault.id, now, fault.kind.value)
        detected = min(fault.detected_at, now)
        onset = onset_of(fault.kind.value, detected, fault.evidence)
        outage = min(job.nic_outages.values(), key=lambda o: o.since, default=None) \
            if fault.kind is FaultKind.NIC and fault.evidence.get("recovered") is True \
            else None
        last = fault.evidence.get("last_step")  # a hang's: the last step its agent saw
        self.ledger(job, now).fault(
            fault.id, fault.kind.value, onset, detected,
            same_as=outage.fault_id if outage is not None else "",
            last_step=last if isinstance(last, int) and not isinstance(last, bool) else None)

    def succeeded(self, job: JobState, now: float) -> None:
        self.ledger(job, now).end(now)

    def decided(self, job: JobState, d: Decision, now: float) -> None:
        """Restarts by fault kind; seconds from a fault to every rank training again; the
        ledger's restarts, releases, end and link outages."""
        s = self.stats_of(job)
        led = self.ledger(job, now)
        if d.verdict in (Verdict.RESTART, Verdict.REPLACE):
            led.restart(d.generation, now, fault_id=d.fault_id)
        elif d.verdict is Verdict.RELEASE_BARRIER and not d.targets:
            led.released(d.generation, now)
        elif d.verdict is Verdict.STOP and not d.targets:
            led.end(now)
        elif d.verdict is Verdict.WAIT:  # a link down: the job stalls on it (outage)
            led.outage(d.fault_id, now)
        elif d.verdict is Verdict.ALERT_ONLY:  # a link back the job resumed from by itself
            led.settled(d.fault_id, now)
        if d.verdict in (Verdict.RESTART, Verdict.REPLACE, Verdict.STOP):
            for c in d.culprits:
                s.blamed(c.rank)
        if d.verdict in (Verdict.RESTART, Verdict.REPLACE):
            seen = s.faults.get(d.fault_id)
            reason = seen[1] if seen else "other"
            s.restarts_by_reason[reason] = s.restarts_by_reason.get(reason, 0) + 1
            if s.lost_since is None:
                s.lost_since = seen[0] if seen else now
            s.lost_generation = d.generation
        elif d.verdict is Verdict.RELEASE_BARRIER and not d.targets:
            if s.lost_since is not None and d.generation >= s.lost_generation:
                s.seconds_lost += max(0.0, now - s.lost_since)
                s.lost_since = None
        elif d.verdict is Verdict.STOP and not d.targets:
            s.lost_since = None  # it will not train again: not counted as lost
