"""What the arbiter shows: jobs for status (GetJob, ListJobs) and for the exporter.

Reads only: live jobs (``jobs.py``), the history's past ones (``history.py``), the
counters and ledger (``journal.py``) and the stragglers (``intake.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from ftagent.arbiter import barrier, convert, snapshots
from ftagent.arbiter.history import (
    History,
    JobRecord,
    incident_or_none,
    shown_state,
)
from ftagent.arbiter.journal import JobStats, Journal
from ftagent.arbiter.ledger import Breakdown, Incident
from ftagent.arbiter.state import JobState, RankState
from ftagent.arbiter.timeline import Timeline
from ftagent.metrics import JobSnapshot
from ftagent.v1 import ftagent_pb2 as pb

Key = tuple[str, str]  # (namespace, job)


class Readout:
    def __init__(self, jobs: dict[Key, JobState], journal: Journal,
                 stragglers_of: Callable[[JobState], list[int]],
                 clock: Callable[[], float]) -> None:
        self.jobs = jobs
        self.journal = journal
        self.stragglers_of = stragglers_of
        self.clock = clock

    @property
    def history(self) -> History:
        return self.journal.history

    @property
    def timeline(self) -> Timeline:
        return self.journal.timeline

    def find(self, name: str, namespace: str) -> JobState | None:
        if namespace or (namespace, name) in self.jobs:
            return self.jobs.get((namespace, name))
        found = [j for (_, n), j in self.jobs.items() if n == name]
        return found[0] if len(found) == 1 else None

    def find_any(self, name: str, namespace: str) -> JobState | JobRecord | None:
        """A live job, else one from the history (same rules as ``find``)."""
        live = self.find(name, namespace)
        if live is not None:
            return live
        past = self.history.past
        if namespace or (namespace, name) in past:
            if (namespace, name) in self.jobs:
                return self.jobs[(namespace, name)]
            return past.get((namespace, name))
        if any(n == name for (_, n) in self.jobs):
            return None  # several namespaces hold the name (find said so)
        found = [r for (_, n), r in past.items() if n == name]
        return found[0] if len(found) == 1 else None

    def listing(self) -> list[JobState | JobRecord]:
        """Live jobs and the history's past ones, by (namespace, job)."""
        out: dict[Key, JobState | JobRecord] = dict(self.history.past)
        out.update(self.jobs)
        return [out[k] for k in sorted(out)]

    def info(self, job: JobState | JobRecord, *, ranks: bool,
             timeline_limit: int = 0) -> pb.JobInfo:
        if isinstance(job, JobState):
            return self.job_info(job, ranks=ranks, timeline_limit=timeline_limit)
        info = pb.JobInfo(
            job=job.job, namespace=job.namespace, generation=job.generation,
            restarts=job.restarts, max_restarts=job.max_restarts, world_size=job.world_size,
            connected=0, alert_only=job.alert_only,
            state=shown_state(job.phase, job.stop_reason, self.clock() - job.last_seen))
        if job.goodput:
            wall = sum(job.goodput.values())
            info.goodput.CopyFrom(pb.Goodput(
                wall_seconds=wall, seconds=job.goodput,
                ratio=job.goodput.get("productive", 0.0) / wall if wall > 0 else 0.0,
                recomputed_steps=job.goodput_steps, incidents=job.goodput_restarts,
                per_incident=[_incident_pb(i) for i in map(incident_or_none,
                                                           job.goodput_incidents) if i]))
        if ranks:
            for e in self.timeline.entries(job.job, job.namespace, timeline_limit):
                info.timeline.append(convert.entry_to_proto(e))
        return info

    def job_info(self, job: JobState, *, ranks: bool, timeline_limit: int = 0) -> pb.JobInfo:
        now = self.clock()
        state = job.phase.value
        if job.connected == 0 and job.ranks:  # every agent left: say so
            state = shown_state(state, job.stop_reason, now - job.last_seen)
        info = pb.JobInfo(
            job=job.job, namespace=job.namespace, generation=job.generation,
            restarts=job.restarts, max_restarts=job.max_restarts, world_size=job.world_size,
            connected=job.connected, state=state, alert_only=job.alert_only,
            barrier=barrier.barrier_summary(job, now), busy=job.busy,
            spares=[f"{sp.pod or sp.instance} on {sp.node or '?'}"
                    + ("" if sp.assigned is None else " (retired: a fatal fault)"
                       if sp.assigned < 0 else f" (assigned rank {sp.assigned})")
                    for sp in job.spares.values()])
        snap = snapshots.resume_step(job)
        if snap is not None:
            info.snapshot_step = snap
        info.replicas = snapshots.replica_summary(job)
        s = self.journal.current(job)
        led = s.ledger if s is not None else None
        if led is not None:
            info.goodput.CopyFrom(_goodput_pb(led.breakdown(now)))
        if not ranks:
            return info
        stragglers = set(self.stragglers_of(job))
        shown = shown_ranks(job, stragglers)
        info.ranks_omitted = len(job.ranks) - len(shown)
        for r in shown:
            age = r.progress_age(now)
            said = f"{r.state} (straggler)" if r.rank in stragglers else r.state
            ri = info.ranks.add(
                rank=r.rank, pod=r.pod, node=r.node, connected=r.connected, state=said,
                step=r.step, samples_per_second=r.samples_per_second,
                tokens_per_second=r.tokens_per_second,
                progress_age_seconds=-1.0 if age is None else age, hung=r.hung,
                generation=r.generation, restarts=r.restarts, last_fault=r.last_fault)
            if r.loss is not None:
                ri.loss = r.loss
            if r.last_exit_status is not None:
                ri.last_exit_status = r.last_exit_status
        for e in self.timeline.entries(job.job, job.namespace, timeline_limit):
            info.timeline.append(convert.entry_to_proto(e))
        return info

    def job_snapshots(self) -> list[JobSnapshot]:
        """Every job the registry holds, live and past, for the exporter (on the loop)."""
        out = []
        for j in self.listing():
            if isinstance(j, JobState):
                s = self.journal.current(j) or JobStats()
                state = j.phase.value
                if j.connected == 0 and j.ranks and not j.finished:
                    state = "gone"
                running = sum(1 for r in j.ranks.values() if r.connected and
                              r.state == "running")
                slow = self.stragglers_of(j)
                nodes = {r.rank: r.node for r in j.ranks.values()}
                now = self.clock()
                gp = s.ledger.exported(now) if s.ledger else {}
                ratio = s.ledger.breakdown(now).ettr if s.ledger else None
                out.append(JobSnapshot(j.job, j.namespace, state, j.generation, j.restarts,
                                       dict(s.restarts_by_reason), s.seconds_lost,
                                       j.world_size, j.connected, running,
                                       tuple((r, nodes.get(r, "")) for r in slow),
                                       tuple(gp.items()), ratio,
                                       tuple(sorted(s.culprits.items()))))
            else:
                wall = sum(j.goodput.values())
                out.append(JobSnapshot(j.job, j.namespace, j.phase if j.finished else "gone",
                                       j.generation, j.restarts, dict(j.restarts_by_reason),
                                       j.seconds_lost, j.world_size, 0, 0,
                                       goodput=tuple(j.goodput.items()),
                                       goodput_ratio=j.goodput.get("productive", 0.0) / wall
                                       if wall > 0 else None))
        return out


def _goodput_pb(b: Breakdown) -> pb.Goodput:
    """The ledger's breakdown on the wire, each incident's stages with it."""
    return pb.Goodput(wall_seconds=b.wall, seconds=b.seconds, ratio=b.ettr,
                      recomputed_steps=b.recomputed_steps, incidents=b.restarts,
                      started_at=b.started_at,
                      per_incident=[_incident_pb(i) for i in b.incidents])


def _incident_pb(i: Incident) -> pb.GoodputIncident:
    d = i.durations()
    over = i.first_step_at is not None or i.superseded  # its steps are settled
    return pb.GoodputIncident(
        generation=i.generation, kind=i.kind, onset=i.onset, detect_seconds=d["detect"] or 0.0,
        decide_seconds=d["decide"], restart_seconds=d["restart"],
        recompute_seconds=i.recompute_seconds, reached_step=i.reached,
        resumed_step=i.resumed if over else None,
        recomputed_steps=i.recomputed_steps if over else None,
        resume_source=i.resume_source if over else "", no_restart=not i.restarted)


MAX_RANKS_SHOWN = 1000  # ranks in one GetJob answer (JobInfo.ranks_omitted counts the rest)


def shown_ranks(job: JobState, stragglers: set[int],
                limit: int = MAX_RANKS_SHOWN) -> list[RankState]:
    """The ranks GetJob shows, by rank: all of them up to ``limit``; past it, the ones
    worth a look first (not running, hung, disconnected, at fault, stragglers), then the
    lowest. One pass over the ranks and a heap of ``limit``: at 100,000 ranks the answer
    is still ``limit`` rows (building a row costs far more than looking at a rank)."""
    ranks = job.ranks
    if len(ranks) <= limit:
        return [ranks[k] for k in sorted(ranks)]
    picked: dict[int, RankState] = {}
    for k, r in ranks.items():
        if not r.connected or r.hung or r.state != "running" or r.last_fault \
                or k in stragglers:
            picked[k] = r
            if len(picked) >= limit:
                break
    if len(picked) < limit:
        for k in heapq.nsmallest(limit, ranks):
            if len(picked) >= limit:
                break
            picked.setdefault(k, ranks[k])
    return [picked[k] for k in sorted(picked)]

