"""Fault intake: faults no agent sent -- node agents', the cluster's and comparing ranks' --
decided exactly like an agent's.

A fault no agent sent (``report``: the cluster's watches, the straggler watch) is decided
as a rank's fault is (``jobs.Jobs.fault``, where the agents' messages are read, with the
stacks of a hang probe), recorded on the timeline, counted and carried out; a node
agent's report is routed here to the jobs with ranks on its node (``node_report``). The
rank timing the straggler watch compares (``straggler.py``) comes in here too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ftagent.arbiter import convert, policy
from ftagent.arbiter.jobs import Jobs
from ftagent.arbiter.state import (
    Decision,
    FaultSeen,
    JobPhase,
    JobState,
    RankState,
    Slowed,
)
from ftagent.arbiter.straggler import JobTimings, RankTiming, StragglerConfig, StragglerWatch
from ftagent.model import Fault, FaultKind, Scope, Severity
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.limits import clip

log = logging.getLogger("ftagent.arbiter")

Key = tuple[str, str]  # (namespace, job)
STRAGGLER_EVERY = 5.0  # seconds between straggler assessments (the agents' summary interval)


class Intake:
    def __init__(self, jobs: Jobs, clock: Callable[[], float]) -> None:
        self.jobs = jobs
        self.cfg = jobs.cfg
        self.metrics = jobs.metrics
        self.clock = clock
        # Per job: latest step timings per rank and who is a straggler (straggler.py).
        self.timings: dict[Key, tuple[JobState, JobTimings]] = {}
        self._stragglers_at = 0.0

    def report(self, namespace: str, job: str, fault: Fault, now: float | None = None,
               rank: int | None = None, generation: int | None = None) -> list[Decision]:
        """A fault no agent sent (see ``Registry.report_fault``)."""
        j = self.jobs.jobs.get((namespace, job))
        if j is None or fault.id in j.seen_faults:
            return []
        now = self.clock() if now is None else now
        g = j.generation if generation is None else generation
        rs = j.ranks.get(rank) if rank is not None else None
        if self.metrics:
            self.metrics.faults.labels(kind=fault.kind.value).inc()
        rep = policy.FaultReport(fault, -1 if rank is None else rank, g)
        decisions = policy.decide_fault(j, rep, now, self.cfg)
        # no agent re-sends it: decided now, whatever the outcome
        self.jobs.execute(j, decisions, now, seen=FaultSeen(
            fault.id, True, rank if rs is not None else None,
            f"{fault.kind.value}: {fault.message}", fault, g, by_arbiter=True))
        return decisions

    def node_report(self, req: pb.NodeReport, arbiter_id: str) -> pb.NodeReportAck:
        """A node agent's report (ReportNode, checked and authorized by the server): decide
        each fault of it for every live job with ranks on the node.

        One decision per job and fault, about the job's lowest rank on the node: a REPLACE
        moves that rank's pod, the job's other ranks (there too, or elsewhere) restart in
        place; a second decision for another rank of the same job would spend the budget
        twice for one fault. A GPU's fault is about the ranks whose pods hold that GPU
        (``Hello.gpus``, ``holds_gpu``): a job whose ranks there all hold other GPUs is not
        touched, and a rank whose GPUs are not known counts as holding it. A fault seen
        before the job's current generation began (its wall time before the barrier opened)
        is decided as of the generation before, so it is ignored when the pod agent's own
        report of it already restarted the job. A node with no job is recorded in the log
        and acknowledged: nothing to decide.
        """
        now = self.clock()
        on_node = self.jobs.nodes.ranks_on_node(req.node)
        ack = pb.NodeReportAck(arbiter_id=arbiter_id, ranks=len(on_node))
        for m in req.faults:
            try:
                fault = convert.fault_from_proto(m)
            except ValueError as e:
                ack.acks.add(fault_id=m.id, final=True, outcome=f"ignored: {e}")
                continue
            fault = replace(fault, message=f"node {req.node}: {fault.message}")
            lowest: dict[tuple[str, str], RankState] = {}
            for job, rs in on_node:  # sorted by job, then rank
                if fault.kind is not FaultKind.GPU or \
                        holds_gpu(rs.gpus, fault.evidence) is not False:
                    lowest.setdefault((job.namespace, job.job), rs)
            spared = sorted({_name(j.namespace, j.job) for j, _ in on_node}
                            - {_name(*key) for key in lowest})
            outcomes = []
            for (namespace, name), rs in lowest.items():
                job = self.jobs.jobs[(namespace, name)]
                g = job.generation
                if g > 0 and job.barrier is not None and \
                        fault.detected_at < job.barrier.opened_at:
                    g -= 1
                decided = self.report(namespace, name, fault, now, rank=rs.rank, generation=g)
                what = decided[0].verdict.value if decided else "already received"
                outcomes.append(f"{_name(namespace, name)} rank {rs.rank}: {what}")
            if spared:
                outcomes.append(f"{', '.join(spared)}: not on that GPU")
            if not outcomes:
                log.info("node %s: %s fault %s, and no job has ranks on it: recorded (%s)",
                         req.node, fault.kind.value, fault.id, clip(fault.message, 300))
                outcomes.append(f"no job has ranks on node {req.node}: recorded")
            ack.acks.add(fault_id=m.id, final=True, outcome=clip("; ".join(outcomes), 200))
        return ack

    # ------------------------------------------------------------------ stragglers

    def timing(self, job: JobState, rs: RankState, p: pb.ProgressSummary, now: float) -> None:
        if p.timed_steps > 0:
            jt = self._timings(job)
            jt.note(RankTiming(rs.rank, rs.node, p.step_seconds, p.collective_seconds,
                               p.data_seconds), now)
            at = min(now, p.ts) if p.ts > 0 else (now if rs.last_step_at is None
                                                  else rs.last_step_at)
            # waited on a slow rank (means over this summary's last timed steps)
            self.jobs.apply(job, Slowed(jt.slowdown(now), at, p.step, p.timed_steps), now)

    def _timings(self, job: JobState) -> JobTimings:
        key = (job.namespace, job.job)
        got = self.timings.get(key)
        if got is None or got[0] is not job:  # a new run of the job starts over
            cfg = StragglerConfig(self.cfg.straggler_ratio, self.cfg.straggler_window,
                                  self.cfg.straggler_action)
            got = self.timings[key] = (job, JobTimings(StragglerWatch(cfg), job.generation))
        return got[1]

    def stragglers_of(self, job: JobState) -> list[int]:
        """Ranks named stragglers and still slow (status, the exporter)."""
        got = self.timings.get((job.namespace, job.job))
        return got[1].watch.current if got is not None and got[0] is job else []

    def assess_stragglers(self, now: float) -> None:
        """Every running job's timings against its median, every STRAGGLER_EVERY seconds;
        a finding is a STRAGGLER fault (a warning the policy records; see
        policy.decide_fault for --straggler-action)."""
        if now < self._stragglers_at:
            return
        self._stragglers_at = now + STRAGGLER_EVERY
        for key, (job, jt) in list(self.timings.items()):
            if self.jobs.jobs.get(key) is not job:
                del self.timings[key]
                continue
            if job.phase is not JobPhase.RUNNING:
                continue
            ranks = [r.rank for r in job.ranks.values()
                     if r.connected and not r.hung and r.generation == job.generation]
            for f in jt.assess_job(job.generation, ranks, now):
                fault = Fault(FaultKind.STRAGGLER, f.message, severity=Severity.WARNING,
                              scope=Scope.POD, evidence=f.evidence, detected_at=now)
                self.report(job.namespace, job.job, fault, now, rank=f.rank)


def holds_gpu(gpus: Sequence[str], evidence: Mapping[str, Any]) -> bool | None:
    """Does a pod holding ``gpus`` (UUIDs or the node's indices, ``Hello.gpus``) hold the
    GPU a node fault's ``evidence`` names (its ``uuid`` and ``gpu`` index)? None when it
    cannot be told: no GPUs given, an NVSwitch fault (``gpu`` < 0: every GPU), a MIG slice
    (its parent GPU is not named), or an id of a kind the evidence lacks."""
    want = str(evidence.get("uuid") or "").lower()
    index = evidence.get("gpu")
    if not gpus or not isinstance(index, int) or index < 0:
        return None
    for g in gpus:
        if g.startswith("GPU-") and want:
            if g.lower() == want:
                return True
        elif g.isdigit():
            if int(g) == index:
                return True
        else:
            return None
    return False


def _name(namespace: str, job: str) -> str:
    return f"{namespace}/{job}" if namespace else job
