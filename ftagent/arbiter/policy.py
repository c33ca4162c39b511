"""The arbiter's policy: the only place where a job's fate is decided.

Pure functions of (job state, event, now) -> list of ``Decision``; they never change the
state (``state.apply`` does) and never do I/O, so every rule below is a unit test.

Default table (a fault of the job's current generation; severity INFO/WARNING faults are
only recorded, except a NIC link that came back):

============================== =========================================================
fault                          decision
============================== =========================================================
any, job has alert_only        ALERT_ONLY: record, touch nothing
same fault id seen before      nothing (agents re-send until acknowledged)
generation older than the job  IGNORE: recorded, the restart was already decided
job STOPPED / SUCCEEDED        IGNORE
CRASH                          RESTART every rank at generation+1 (all meet at a barrier)
HANG WARNING "waiting in a     as HANG below (the suspicion of a rank verified waiting in a
  collective" (suspected_hang)   collective: its agent records no error until decided)
HANG, most other ranks still   the hung rank is the culprit: RESTART
  progressing
HANG, most ranks stalled       job hang: DUMP_STACKS on every rank; when all stacks are in
  (or several report hung)       (or after --stacks-timeout) name the culprit -- the rank
                                 whose step is behind, else whose stack differs from the
                                 majority (``name_culprit``) -- then RESTART; ranks
                                 their agents verified alive or spinning: BUSY, no
                                 restart, every rank told who is busy and who waits
                                 (``busy_verdict``); culprits the BUSY verdict still
                                 holding had waiting on ranks that now wait on them
                                 in a collective: ALERT_ONLY, the job moved
                                 (``roles_swapped``, once per BUSY verdict)
GPU, severity FATAL or scope   REPLACE that rank (its agent exits with EXIT_REPLACE so the
  NODE; NODE faults              pod moves), RESTART the others
GPU, severity ERROR            RESTART (application-level Xid)
NIC link down                  WAIT: restart once the link is back (NCCL/IB queue pairs
                                 error out on link loss, so a restart is the clean way
                                 back), REPLACE the rank if still down after
                                 --nic-replace-after
NIC link back (evidence        LINK_BACK with a deadline (``nic_resume_budget``): TCP
  {"recovered": true}, no        often resumes the stalled collective by itself (gloo over
  other link down)               TCP: a 10 s outage cost 3.5 s after link up); if every
                                 connected rank's step advances before the deadline, the
                                 outage is recorded and nothing restarts (ALERT_ONLY),
                                 else RESTART at the deadline. --nic-resume-timeout 0:
                                 RESTART at once (NCCL/IB queue pairs that error out)
CRASH/HANG while a link is     IGNORE (deferred): restarting cannot rendezvous over a
  down                           dead link; the link's recovery or replacement restarts;
                                 a HANG while the job may still resume after a link came
                                 back is deferred the same way (a CRASH restarts)
BARRIER, AGENT                 ALERT_ONLY
LOSS (NaN/inf, spike)          ALERT_ONLY, unless the agent runs --loss-action restart
                                 (evidence {"action": "restart"}): then as a CRASH
STRAGGLER (straggler.py)       ALERT_ONLY; a persistent one (slow for two windows) with
                                 --straggler-action replace: REPLACE that rank (alert
                                 only once the restart budget is spent: never a STOP)
NODE (from the cluster: node   as GPU FATAL: REPLACE the rank on it (kube/cluster.py deletes
  NotReady, pod preempted,       its pod, cordons a faulty node); a warning (replacement
  evicted, deleted)              stuck Pending) is ALERT_ONLY
a fault about no rank (rank    RESTART every rank, no culprit (never REPLACE)
  -1, Registry.report_fault)
============================== =========================================================

A REPLACE with a warm spare connected (``ftagent run --spare``) not on the replaced rank's
node also ASSIGNs the oldest such spare the replaced rank at the new generation
(``pick_spare``): it arrives at the barrier in the replaced pod's place and starts from
its warm standby, so the job does not wait for a new pod. No spare: the job waits for the
replaced pod to come back, as before.

The restart budget is per job (``--max-restarts``, or the agents' own): RESTART and
REPLACE each spend one; with none left the decision is STOP on every rank with the
faulting rank's exit status (1 when it has none), so Kubernetes sees the failure.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftagent.arbiter import fr_verdict, ladder
from ftagent.arbiter.barrier import barrier_expired, first_missing, rank_list
from ftagent.arbiter.state import (
    FINISHED,
    Culprit,
    Decision,
    JobState,
    SpareState,
    Verdict,
)
from ftagent.arbiter.straggler import StragglerAction
from ftagent.model import Fault, FaultKind, JobBusy, Scope, Severity
from ftagent.wire import limits

NIC_RESUME_SLACK = 5.0  # seconds past the outage's length a resume may take (nic_resume_budget)


@dataclass(frozen=True)
class PolicyConfig:
    max_restarts: int = 3  # per job, when the agents did not say
    barrier_timeout: float = 300.0
    nic_replace_after: float = 300.0
    # After the last link is back: wait for every rank's step to advance, at most this
    # long (nic_resume_budget), before restarting; 0 restarts at once.
    nic_resume_timeout: float = 60.0
    stacks_timeout: float = 15.0
    # Other ranks count as progressing when their last step is this much more recent
    # than the hung rank's (fraction of its age), or within this window when it has none.
    progressing_fraction: float = 0.5
    progress_window: float = 60.0
    # Stragglers (straggler.py): --straggler-ratio, --straggler-window, --straggler-action.
    straggler_ratio: float = 0.8
    straggler_window: float = 300.0
    straggler_action: StragglerAction = StragglerAction.ALERT


@dataclass(frozen=True)
class FaultReport:
    """A fault as the arbiter received it: from which rank, in which generation."""

    fault: Fault
    rank: int
    generation: int
    exit_status: int | None = None


MAX_CULPRITS_LISTED = 8  # culprits a message names one by one ("and N more" after)


def culprit_clause(culprits: tuple[Culprit, ...]) -> str:
    """The one form every decision names its culprits in: ``culprit ranks 1 (pod p,
    node n), 3 (pod q, node m)`` (``-`` for a pod or node not known), at most
    ``MAX_CULPRITS_LISTED`` of them then ``and N more``. Empty without culprits."""
    if not culprits:
        return ""
    shown = ", ".join(f"{c.rank} (pod {c.pod or '-'}, node {c.node or '-'})"
                      for c in culprits[:MAX_CULPRITS_LISTED])
    more = len(culprits) - MAX_CULPRITS_LISTED
    return f"culprit ranks {shown}" + (f" and {more} more" if more > 0 else "")


def decide_fault(job: JobState, rep: FaultReport, now: float, cfg: PolicyConfig) -> list[Decision]:
    """The decisions a new fault leads to (see the table in the module docstring)."""
    f = rep.fault
    g = job.generation
    who = f"rank {rep.rank}" if rep.rank >= 0 else "job"  # rank -1: about the whole job
    where = f"{who}: {f.kind.value} ({f.severity.value}): {f.message}"
    if f.id in job.seen_faults:
        return []
    if job.alert_only:
        return [_d(Verdict.ALERT_ONLY, f"{where} (fault tolerance off: alert only)", g, rep)]
    if job.phase in FINISHED:
        return [_d(Verdict.IGNORE, f"{where} (job already {job.phase.value})", g, rep)]
    if rep.generation < g:
        return [_d(Verdict.IGNORE, f"{where} (from generation {rep.generation}; the job "
                   f"already moved to generation {g})", g, rep)]
    if f.kind is FaultKind.NIC:
        return _nic(job, rep, where, now, cfg)
    if f.kind is FaultKind.LOSS and f.evidence.get("action") != "restart":
        return [_d(Verdict.ALERT_ONLY, where, g, rep)]
    if f.kind is FaultKind.STRAGGLER and f.evidence.get("persistent") is True and \
            rep.rank >= 0 and cfg.straggler_action is StragglerAction.REPLACE and \
            job.restarts < job.max_restarts:  # a slow job beats a stopped one
        return restart_or_stop(job, f"{where}: replacing rank {rep.rank} "
                               "(--straggler-action replace)", rep, cfg, replace=rep.rank)
    if (f.severity in (Severity.INFO, Severity.WARNING) and not suspected_hang(f)) or \
            f.kind in (FaultKind.BARRIER, FaultKind.AGENT):
        return [_d(Verdict.ALERT_ONLY, where, g, rep)]
    if job.nic_outages and f.kind in (FaultKind.CRASH, FaultKind.HANG):
        down = ", ".join(str(r) for r in sorted(job.nic_outages))
        return [_d(Verdict.IGNORE, f"{where} (deferred: link of rank {down} is down; the job "
                   "restarts when it is back or the rank is replaced)", g, rep, pending=True)]
    if job.nic_resume is not None and f.kind is FaultKind.HANG:
        return [_d(Verdict.IGNORE, f"{where} (deferred: rank {job.nic_resume.rank}'s link is "
                   "back; the job restarts unless every rank's step advances by "
                   f"{job.nic_resume.deadline - now:.0f}s from now)", g, rep, pending=True)]
    if f.kind in (FaultKind.GPU, FaultKind.NODE) and rep.rank >= 0 and (
            f.severity is Severity.FATAL or f.scope is Scope.NODE or f.kind is FaultKind.NODE):
        return restart_or_stop(job, f"{where}: replacing rank {rep.rank}", rep, cfg,
                               replace=rep.rank)
    if f.kind is FaultKind.HANG:
        return _hang(job, rep, where, now, cfg)
    culprit = rep.rank if f.kind is FaultKind.CRASH and rep.rank >= 0 else None
    return restart_or_stop(job, where, rep, cfg, culprit=culprit)


def suspected_hang(f: Fault) -> bool:
    """A rank verified waiting in a collective reports its hang as a WARNING suspicion
    (agent/peer_wait.py): waiting is not hanging until the ranks are compared. It is
    decided as a hang (stacks from every rank, then RESTART or BUSY), not only recorded."""
    return f.kind is FaultKind.HANG and f.severity is Severity.WARNING and \
        f.evidence.get("waiting_in_collective") is True


def restart_or_stop(job: JobState, reason: str, rep: FaultReport, cfg: PolicyConfig, *,
                    culprit: int | None = None, replace: int | None = None,
                    culprits: Sequence[int] = ()) -> list[Decision]:
    """RESTART (or REPLACE ``replace``) at generation+1 if the job's budget allows, else STOP.

    The ranks to blame -- ``culprits``, else ``culprit``, else the replaced rank -- go on
    every decision as structured ``Culprit`` values and into its reason in one form
    (``culprit_clause``), right after ``reason``: whichever rank reported the fault, and
    however many culprits there are. (It was said only when one culprit differed from
    the reporting rank, so the same hang named its culprit or not depending on which
    rank's report came first.)"""
    g = job.generation
    named = culprits_of(job, culprits or ([culprit] if culprit is not None else
                                          [replace] if replace is not None else []))
    clause = f"; {culprit_clause(named)}" if named else ""
    one = culprit if culprit is not None else named[0].rank if len(named) == 1 else None
    if job.restarts >= job.max_restarts:
        code = rep.exit_status if rep.exit_status not in (None, 0) else 1
        return [Decision(Verdict.STOP, f"{reason}{clause}; restart budget spent "
                         f"({job.restarts}/{job.max_restarts}): stopping every rank with exit "
                         f"code {code}", g, exit_code=code, fault_id=rep.fault.id,
                         rank=one if replace is None else replace, culprits=named)]
    spent = f"restart {job.restarts + 1}/{job.max_restarts}"
    if replace is not None:
        out = [Decision(Verdict.REPLACE, f"{reason}{clause}; others restart at generation "
                        f"{g + 1} ({spent})", g + 1, rank=replace, fault_id=rep.fault.id,
                        culprits=named)]
        spare = pick_spare(job, replace)
        if spare is not None:
            on = f" on node {spare.node}" if spare.node else ""
            out.append(Decision(Verdict.ASSIGN, f"spare {spare.pod or spare.instance}{on} "
                                f"takes rank {replace} at generation {g + 1}", g + 1,
                                rank=replace, fault_id=rep.fault.id, spare=spare.instance))
        return out
    d = Decision(Verdict.RESTART, f"{reason}{clause}; every rank restarts at generation "
                 f"{g + 1} ({spent})", g + 1, rank=one, fault_id=rep.fault.id, culprits=named)
    # the recovery ladder's tier for it (ladder.py): a pod-level one where the culprit's
    # process restart did not clear it and its pod and node have one (a rank whose agent
    # declared no tiers has the process restart only: the ladder has nothing to pick)
    rs = job.ranks.get(one) if one is not None else None
    if rs is None or rs.tiers is None:
        return [d]
    return [ladder.carry_out(d, rep.fault.kind.value, rs.tiers)]


def culprits_of(job: JobState, ranks: Sequence[int]) -> tuple[Culprit, ...]:
    """``ranks`` (deduplicated, sorted, the negative "no rank" left out) with the pod and
    node each ran on as the job knows them now."""
    out = []
    for r in sorted({r for r in ranks if r >= 0}):
        rs = job.ranks.get(r)
        out.append(Culprit(r, rs.pod if rs is not None else "", rs.node if rs is not None
                           else ""))
    return tuple(out)


def pick_spare(job: JobState, rank: int) -> SpareState | None:
    """The spare to take ``rank`` over: the oldest connected one not yet assigned and not
    on the node the replaced rank runs on (a node-scope fault would take it down too; a
    node that is not known does not rule a spare out). None: no spare fits."""
    rs = job.ranks.get(rank)
    node = rs.node if rs is not None else ""
    for sp in job.spares.values():
        if sp.conn is not None and sp.assigned is None and not (node and sp.node == node):
            return sp
    return None


def decide_spare_fault(job: JobState, spare: SpareState, fault: Fault) -> list[Decision]:
    """A fault from a spare's own agent (it runs no trainer: its GPUs, links, node). One
    that would REPLACE a rank there (fatal or node scope; a link down) RETIREs the spare:
    it is never assigned a rank and exits with the replace status, so its pod moves. Any
    other is only recorded. The job itself is not touched: no budget, no generation."""
    who = f"spare {spare.pod or spare.instance}"
    g = job.generation
    where = f"{who}: {fault.kind.value} ({fault.severity.value}): {fault.message}"
    if fault.id in job.seen_faults:
        return []
    fatal = fault.kind in (FaultKind.GPU, FaultKind.NODE, FaultKind.NIC) and (
        fault.severity is Severity.FATAL or fault.scope is Scope.NODE or (
            fault.kind is FaultKind.NIC and fault.severity is Severity.ERROR
            and not fault.evidence.get("recovered")))
    if fatal and spare.assigned is not None and spare.assigned >= 0:
        # assigned, not arrived yet: its preflight on ASSIGN failed. It never takes the
        # rank; the next spare does, else the rank's own recreated pod
        rank = spare.assigned
        out = [Decision(Verdict.RETIRE_SPARE, f"{where}: not used for rank {rank}, retired "
                        "as a spare (it exits with the replace status; its pod moves)", g,
                        rank=rank, fault_id=fault.id, spare=spare.instance)]
        nxt = pick_spare(job, rank)
        if nxt is not None and nxt.instance != spare.instance:
            on = f" on node {nxt.node}" if nxt.node else ""
            out.append(Decision(Verdict.ASSIGN, f"spare {nxt.pod or nxt.instance}{on} takes "
                                f"rank {rank} at generation {g}", g, rank=rank,
                                fault_id=fault.id, spare=nxt.instance))
        return out
    if not fatal or spare.assigned is not None:
        return [Decision(Verdict.ALERT_ONLY, f"{where} (a spare: recorded)", g,
                         fault_id=fault.id)]
    return [Decision(Verdict.RETIRE_SPARE, f"{where}: retired as a spare (it exits with the "
                     "replace status; its pod moves)", g, fault_id=fault.id,
                     spare=spare.instance)]


def _nic(job: JobState, rep: FaultReport, where: str, now: float,
         cfg: PolicyConfig) -> list[Decision]:
    g = job.generation
    ev = rep.fault.evidence
    if ev.get("recovered"):
        if rep.rank not in job.nic_outages:
            return [_d(Verdict.ALERT_ONLY, f"{where} (link back; no outage was pending)", g, rep)]
        outage = ev.get("outage_seconds")
        took = f" after {float(outage):.1f}s" if isinstance(outage, (int, float)) else ""
        still = sorted(r for r in job.nic_outages if r != rep.rank)
        if still:  # restarting now would start the job into a dead link
            return [Decision(Verdict.LINK_BACK, f"rank {rep.rank}: link back{took}; waiting "
                             f"for rank {rank_list(still)} before restarting", g,
                             rank=rep.rank, fault_id=rep.fault.id, pending=True)]
        budget = nic_resume_budget(outage, cfg)
        if budget <= 0:
            return restart_or_stop(job, f"rank {rep.rank}: link back{took}", rep, cfg,
                                   culprit=rep.rank)
        return [Decision(Verdict.LINK_BACK, f"rank {rep.rank}: link back{took}; waiting up to "
                         f"{budget:.0f}s for every rank's step to advance before restarting",
                         g, rank=rep.rank, fault_id=rep.fault.id, until=now + budget,
                         pending=True)]
    if rep.fault.severity in (Severity.INFO, Severity.WARNING):
        return [_d(Verdict.ALERT_ONLY, where, g, rep)]
    if rep.rank in job.nic_outages:
        return [_d(Verdict.IGNORE, f"{where} (link already down; waiting)", g, rep)]
    until = now + cfg.nic_replace_after
    return [Decision(Verdict.WAIT, f"{where}: waiting up to {cfg.nic_replace_after:.0f}s for "
                     "the link, then the job restarts (or the rank is replaced)", g,
                     rank=rep.rank, fault_id=rep.fault.id, until=until, pending=True)]


def nic_resume_budget(outage: object, cfg: PolicyConfig) -> float:
    """How long the job may take to resume by itself after its last link came back: the
    outage's length plus 5 s, at most ``cfg.nic_resume_timeout``. While a link is down,
    TCP doubles its retransmission timer (Linux: 200 ms up to 120 s), so its first retry
    after the link is back can come about as long after it as the outage lasted."""
    if cfg.nic_resume_timeout <= 0:
        return 0.0
    took = float(outage) if isinstance(outage, (int, float)) and outage >= 0 else \
        cfg.nic_resume_timeout
    return min(cfg.nic_resume_timeout, took + NIC_RESUME_SLACK)


def decide_nic_resume(job: JobState, now: float, cfg: PolicyConfig) -> list[Decision]:
    """After the last link came back: no restart once every connected rank's step went
    past the step it had then; a restart at the deadline if any did not."""
    watch = job.nic_resume
    if watch is None:
        return []
    ranks = [r for r in job.ranks.values() if r.connected]
    moved = [r for r in ranks if r.step > watch.steps.get(r.rank, r.step)]
    if ranks and len(moved) == len(ranks):
        return [Decision(Verdict.ALERT_ONLY, f"rank {watch.rank}: link back and every rank's "
                         f"step advanced {now - watch.since:.1f}s later (step "
                         f"{min(r.step for r in ranks)}): training resumed by itself, no "
                         "restart", job.generation, rank=watch.rank, fault_id=watch.fault_id)]
    if now < watch.deadline:
        return []
    stuck = rank_list(sorted(r.rank for r in ranks if r not in moved))
    rep = FaultReport(Fault(FaultKind.NIC, "link back", id=watch.fault_id), watch.rank,
                      job.generation)
    return restart_or_stop(job, f"rank {watch.rank}: link back but the step of rank {stuck} "
                           f"did not advance in {now - watch.since:.0f}s", rep, cfg,
                           culprit=watch.rank)


def _hang(job: JobState, rep: FaultReport, where: str, now: float,
          cfg: PolicyConfig) -> list[Decision]:
    g = job.generation
    if job.hang_probe is not None:
        return [_d(Verdict.IGNORE, f"{where} (already collecting stacks for the job hang)",
                   g, rep, pending=True)]
    others = [r for r in job.ranks.values() if r.rank != rep.rank and r.connected]
    if not others:
        return restart_or_stop(job, where, rep, cfg, culprit=rep.rank)
    # the ranks' last steps read in place (``RankState.progress_age``'s arithmetic, no
    # call per rank: a job of 1,024 ranks is read once)
    hung = job.ranks.get(rep.rank)
    last = hung.last_step_at if hung is not None else None
    age = max(0.0, now - last) if last is not None else None
    window = age * cfg.progressing_fraction if age else cfg.progress_window
    moving = 0
    for r in others:
        at = r.last_step_at
        if not r.hung and at is not None and max(0.0, now - at) < window:
            moving += 1
    # A rank its agent verified waiting inside a collective (a suspicion) is no culprit of
    # "the others progress": it waits for one of them. Their last steps may only look
    # fresher (the arbiter sees steps in the agents' summary slots); the stacks and the
    # flight recorder decide. Seen: a peer SIGSTOPped just after its last summary, and the
    # waiting rank named the culprit and restarted alone.
    waiting = rep.fault.evidence.get("waiting_in_collective") is True
    if moving * 2 > len(others) and not waiting:
        return restart_or_stop(job, f"{where} while {moving}/{len(others)} other ranks "
                               "progress", rep, cfg, culprit=rep.rank)
    until = now + cfg.stacks_timeout
    return [Decision(Verdict.DUMP_STACKS, f"{where}; {len(others) - moving}/{len(others)} "
                     "other ranks stalled too: job hang, collecting stacks from every rank "
                     f"(up to {cfg.stacks_timeout:.0f}s) to name the culprit", g,
                     rank=rep.rank, fault_id=rep.fault.id, until=until,
                     exit_code=rep.exit_status, pending=True)]


def decide_stacks(job: JobState, now: float, cfg: PolicyConfig, *,
                  force: bool = False) -> list[Decision]:
    """Finish a job hang once every connected rank sent stacks (or ``force`` at deadline)."""
    probe = job.hang_probe
    if probe is None:
        return []
    if not force:  # a connected rank has not answered yet: wait for it
        if probe.owing is not None:  # kept by state.apply: no scan per answer
            if probe.owing:
                return []
        elif any(r.connected and r.stack is None for r in job.ranks.values()):
            return []  # not counted (stacks written without apply): the ranks scanned
    steps = {r.rank: r.step for r in job.ranks.values()}
    stacks = {r.rank: r.stack for r in job.ranks.values() if r.stack is not None}
    got = f"stacks from {len(stacks)}/{job.world_size} ranks"
    if len(stacks) < job.world_size:  # the probe's deadline: who did not answer
        silent = first_missing(job.world_size, stacks, 10)
        more = job.world_size - len(stacks) - len(silent)
        got += f" (none from rank {rank_list(silent)}{f' and {more} more' if more > 0 else ''})"
    busy = job_busy(stacks)
    if busy is not None:  # alive ranks in an undeclared phase, the others wait for them
        ranks, why = busy
        told = busy_verdict(job, stacks, ranks)
        if told.spin_culprits:
            why += (f"; rank {rank_list(list(told.spin_culprits))} spins while the others wait "
                    "on it in a collective: its agent declares it after "
                    "--hang-culprit-spin-timeout")
        return [Decision(Verdict.BUSY, f"job busy, not hung ({got}): {why}; no restart",
                         job.generation, rank=ranks[0], fault_id=probe.fault_id, busy=told)]
    fr = flight_recorder_verdict(job)
    culprits, why = (list(fr.culprits), f"flight recorder: {fr.reason}"
                     f"{places(fr.culprits, stacks)}") if fr is not None \
        else name_culprit(steps, stacks)
    swapped = roles_swapped(job, culprits, stacks) if fr is None or fr.kind == "behind" \
        else None
    if swapped:  # one instant's stacks of a job that moved on: no culprit in them
        return [Decision(Verdict.ALERT_ONLY, f"job moved, not hung ({got}): {swapped}; no "
                         "restart (a rank that hangs now is decided on its next report)",
                         job.generation, rank=culprits[0], fault_id=probe.fault_id)]
    rep = FaultReport(Fault(FaultKind.HANG, "job hang", id=probe.fault_id), probe.rank,
                      job.generation, probe.exit_status)
    culprit = culprits[0] if len(culprits) == 1 else None
    if fr is not None and fr.key and fr.key == job.mismatch:  # a program error: no retry
        named = culprits_of(job, culprits)
        clause = f"; {culprit_clause(named)}" if named else ""
        return [Decision(Verdict.STOP, f"job hang ({got}): {why}{clause}; the same collective "
                         "mismatch as before the last restart: a program error, stopping every "
                         "rank", job.generation, exit_code=1,
                         fault_id=probe.fault_id, rank=culprit, culprits=named)]
    out = restart_or_stop(job, f"job hang ({got}): {why}", rep, cfg, culprits=culprits)
    if fr is not None and fr.key:
        out = [dataclasses.replace(d, mismatch=fr.key) for d in out]
    return out


def decide_tick(job: JobState, now: float, cfg: PolicyConfig) -> list[Decision]:
    """Deadlines: stacks of a job hang, a link that stays down, a barrier that never fills."""
    if job.phase in FINISHED or job.alert_only:
        return []
    if job.hang_probe is not None and now >= job.hang_probe.deadline:
        return decide_stacks(job, now, cfg, force=True)
    if job.nic_resume is not None and not job.nic_outages:
        resumed = decide_nic_resume(job, now, cfg)
        if resumed:
            return resumed
    for rank, outage in sorted(job.nic_outages.items()):
        if now >= outage.deadline:
            rep = FaultReport(Fault(FaultKind.NIC, "link down", id=outage.fault_id), rank,
                              job.generation)
            return restart_or_stop(job, f"rank {rank}: link still down after "
                                   f"{now - outage.since:.0f}s: replacing rank {rank}", rep,
                                   cfg, replace=rank)
    return barrier_expired(job, now, cfg.barrier_timeout)


def busy_verdict(job: JobState, stacks: Mapping[int, str], busy: Sequence[int]) -> JobBusy:
    """What every rank is told of a busy job (``job_busy``): who is busy, who waits, and
    the *spin culprits* -- spinning ranks the others are verified waiting on in a
    collective. With every rank's flight-recorder summary, a culprit must be behind (or
    give no dump) in it; without the recorder, every waiting rank's stack must be in a
    collective. When every rank is busy (an evaluation) there is no culprit."""
    live = {r: liveness_of(s) for r, s in stacks.items()}
    waiting = sorted(set(stacks) - set(busy))
    spinning = [r for r in busy if live[r][0] == "spinning"]
    culprits: list[int] = []
    if waiting and spinning:
        sent = {r.rank: r.fr for r in job.ranks.values() if r.stack is not None}
        if len(sent) >= 2 and all(s is not None for s in sent.values()):
            v = fr_verdict.decide(sent)
            behind = {r for f in v.findings if f.kind in ("behind", "unresponsive")
                      for r in f.ranks}
            culprits = [r for r in spinning if r in behind]
        elif all(COMMUNICATION.search(live[r][2]) for r in waiting):
            culprits = spinning
    first = live[busy[0]] if busy else (None, None, "")
    return JobBusy(busy_ranks=tuple(busy), waiting_ranks=tuple(waiting),
                   where=(first[1] or "")[:limits.MAX_WHERE], state=first[0] or "",
                   spin_culprits=tuple(culprits))


def roles_swapped(job: JobState, culprits: Sequence[int],
                  stacks: Mapping[int, str]) -> str | None:
    """Why ``culprits`` are no culprits, if the stacks only caught the job moving on: the
    BUSY verdict that still holds had them waiting on its busy ranks, and every one of those
    now waits in a collective -- the busy phase ended, its ranks joined the collective, and
    the ranks that waited in it are on their way out, sampled between the wait and their
    next step line (a silent save's end: the waiting rank was blamed for "not being in a
    collective" and restarted a tenth of a second before its step). Once per BUSY verdict:
    the decision ends it (``state.apply``), so a rank that really hangs right after is
    named by the next report. None: the culprits stand."""
    was = job.busy_roles
    if was is None or not job.busy or not culprits or not was.busy_ranks:
        return None
    if not set(culprits) <= set(was.waiting_ranks):
        return None
    now_waiting = [r for r in was.busy_ranks if r in stacks and
                   COMMUNICATION.search(liveness_of(stacks[r])[2])]
    if len(now_waiting) < len(was.busy_ranks):
        return None
    return (f"rank {rank_list(list(culprits))} waited on rank {rank_list(list(was.busy_ranks))} "
            f"(busy in {was.where or 'its own code'}), which now wait(s) on it in a "
            "collective: the roles swapped, the busy phase is over")


def flight_recorder_verdict(job: JobState) -> fr_verdict.Verdict | None:
    """The flight recorder's verdict (arbiter/fr_verdict.py) when every rank that sent
    stacks sent its summary too and it names culprits: a rank that never reached
    collective #N of a group, a collective mismatch (restarted once; the same mismatch
    again STOPs), or a rank with no dump -- stopped, dead, its pod frozen: no answer by
    the stacks deadline -- while a rank's dump shows it waiting inside a collective.
    Else None: the stacks decide (name_culprit)."""
    sent = {r.rank: r.fr for r in job.ranks.values() if r.stack is not None}
    if not sent or any(s is None for s in sent.values()):
        return None
    v = fr_verdict.decide(sent, world=job.world_size)
    if v.kind in ("mismatch", "behind") or fr_verdict.waits_on_silent(v):
        return v if v.culprits else None
    return None


def where_in(signature: str) -> str:
    """Where a rank's trainer is, from its stack signature: the agent's liveness verdict
    (its main thread first), else the first frame of the first thread py-spy listed."""
    _, where, sig = liveness_of(signature)
    return where or sig.split(" | ")[0].split(" < ")[0]


def places(ranks: Sequence[int], stacks: Mapping[int, str], most: int = 4) -> str:
    """``; rank R in WHERE`` for each of ``ranks`` whose stack came (the flight recorder
    names the collective; the stack says where the culprit's own code is)."""
    out = [f"rank {r} in {w[:200]}" for r in sorted(ranks)[:most]
           if r in stacks and not liveness_of(stacks[r])[2].startswith(NO_STACK)
           and (w := where_in(stacks[r]))]
    return "".join(f"; {p}" for p in out)


def name_culprit(steps: Mapping[int, int], stacks: Mapping[int, str]) -> tuple[list[int], str]:
    """The ranks to blame for a job hang, and why, from their last steps and stack signatures.

    In order: a minority of ranks whose step is behind the others; else the ranks that are
    *not* waiting in communication while the others are (a rank stuck before a collective
    leaves its peers blocked inside it: the peers are victims, with two ranks too); else a
    minority whose stack differs from the majority's; else nobody can be singled out.
    Signatures may carry a liveness tag (``stack_signature``); it is not compared here
    (``job_busy`` reads it first).
    """
    original = stacks
    stacks = {r: liveness_of(s)[2] for r, s in stacks.items()}
    unknown = sorted(r for r, s in stacks.items() if s.startswith(NO_STACK))
    stacks = {r: s for r, s in stacks.items() if r not in unknown}
    known = {r: s for r, s in steps.items() if s >= 0}
    if len(known) >= 2:
        lo, hi = min(known.values()), max(known.values())
        behind = sorted(r for r, s in known.items() if s == lo)
        if lo < hi and len(behind) * 2 < len(known):
            return behind, f"rank {rank_list(behind)} at step {lo}, behind the others (step {hi})"
    if len(stacks) >= 2:
        waiting = {r for r, s in stacks.items() if COMMUNICATION.search(s)}
        odd = sorted(set(stacks) - waiting)
        if waiting and odd and len(odd) * 2 <= len(stacks):
            # the agent's verdict says where the trainer's own thread is (its main thread
            # first); the signature's first thread is whichever py-spy listed first
            where = where_in(original[odd[0]])
            return odd, (f"rank {rank_list(odd)} is not in a collective (in {where}) while "
                         f"{len(waiting)} other rank(s) wait in one")
        sig, n = Counter(stacks.values()).most_common(1)[0]
        if n * 2 > len(stacks) and n < len(stacks):
            odd = sorted(r for r, s in stacks.items() if s != sig)
            return odd, f"rank {rank_list(odd)} stack differs from the other {n} ranks"
    if unknown:  # the ranks whose capture failed are the only ones not seen waiting
        reason = liveness_of(original[unknown[0]])[2].removeprefix(NO_STACK)[:200]
        seen_waiting = [r for r, s in stacks.items() if COMMUNICATION.search(s)]
        if seen_waiting and len(seen_waiting) == len(stacks) and \
                len(unknown) <= len(seen_waiting):
            return unknown, (f"rank {rank_list(unknown)} gave no stack ({reason}) while "
                             f"{len(seen_waiting)} other rank(s) wait in a collective")
        return [], f"no single culprit: rank {rank_list(unknown)} gave no stack ({reason})"
    return [], "no single culprit: the ranks stalled at the same step in the same place"


# Frames of a rank blocked in communication (torch.distributed, DDP's reducer, gloo/NCCL
# waits): such a rank waits for a peer rather than being the cause. A ``wait`` counts only
# in torch.distributed's own files: ``wait (threading.py)`` is any helper thread's idle
# Condition (a pin-memory thread, a watchdog) and ``wait_for_data`` a stalled loader -- a
# rank showing either alone is the culprit, not a peer waiting for one.
COMMUNICATION = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|barrier|"
    r"\bwait\w* \((?:distributed_c10d|c10d_logger|_functional_collectives|\w*nccl\w*|"
    r"\w*gloo\w*)\.py:|\brecv\b|\bsend\b|synchronize|finalize_backward|_sync_params|"
    r"\bbackward \(|run_backward|_engine_run_backward", re.I)

# A frame line of ``py-spy dump`` text: "    name (path/file.py:123)". No part of the
# pattern can match a newline, so a match attempt never leaves its line and the scan is
# linear: the earlier pattern's ``\s+`` crossed newlines, and 36 KB of whitespace lines
# from a peer took seconds (issue 20).
_TEXT_FRAME = re.compile(r"^[ \t]+([^\s]+) \(([^()\n]*:\d+)\)[ \t\r]*$", re.M)

_SCAN_PER_THREAD = 16 * 1024  # characters of one thread's py-spy text read for frames
_SCAN_BUDGET = 256 * 1024  # characters of py-spy text read in one Stacks message
_MAX_THREADS = 64  # threads in one signature

MAX_STACKS = limits.MAX_STACKS
"""Characters of one Stacks message the arbiter reads (an agent clips what it sends to
it: ``wire.convert.stacks_json``); a larger one is a capture without frames, unparsed."""


def job_busy(stacks: Mapping[int, str]) -> tuple[list[int], str] | None:
    """Ranks verified busy (alive, or spinning not yet past its budget) by their agents,
    from the liveness tags of their signatures: then the job is not hung, whatever the
    others wait in -- every rank busy in the same place is a job-wide undeclared phase, a
    few busy ranks keep the rest waiting for them in the next collective. None when no
    rank is busy (a job hang: ``name_culprit``)."""
    live = {r: liveness_of(s) for r, s in stacks.items()}
    busy = sorted(r for r, (state, _, _) in live.items() if state in ("alive", "spinning"))
    if not busy:
        return None
    where = live[busy[0]][1] or "its own code"
    spin = " (spinning: its agent declares it hung if it spins past its budget)" if \
        live[busy[0]][0] == "spinning" else ""
    if len(busy) == len(stacks):
        places = {live[r][1] for r in busy}
        same = "the same place" if len(places) == 1 else f"{len(places)} places"
        return busy, (f"every rank is busy ({same}: rank {rank_list(busy[:1])} in {where}){spin}:"
                      " a job-wide undeclared phase")
    waiting = sorted(set(stacks) - set(busy))
    return busy, (f"rank {rank_list(busy)} busy in {where}{spin} while rank {rank_list(waiting)} "
                  "wait(s) for it: an undeclared phase")


_LIVE_TAG = re.compile(r"^live=(\w+)(?: where=(.*?))? :: ", re.S)


def liveness_of(signature: str) -> tuple[str | None, str | None, str]:
    """(liveness state, where, the signature without its tag) of a ``stack_signature``."""
    m = _LIVE_TAG.match(signature)
    if m is None:
        return None, None, signature
    return m.group(1), m.group(2), signature[m.end():]


def stack_signature(stacks_json: str, frames_per_thread: int = 4) -> str:
    """A comparable summary of a stack dump: the innermost frames of every thread.

    Accepts py-spy's ``dump --json`` output (a list of threads with ``frames``), the agent's
    evidence (processes with a py-spy text ``stack``), or any JSON nesting either; pids and
    thread ids are left out so that equal code paths on different ranks compare equal.
    The agent's verdict of life (a top-level ``liveness`` object: ``state``, ``where``,
    ``declared``; agent/verify.py) becomes a ``live=STATE where=WHERE :: `` tag in front
    (``liveness_of`` reads it back); a hang the agent already declared is ``hung``.
    """
    return signature_in(parse_stacks(stacks_json), stacks_json, frames_per_thread)


NOT_JSON = object()  # parse_stacks: the text is not JSON (or nested past the stack)


def parse_stacks(stacks_json: str) -> Any:
    """A Stacks answer parsed once (NOT_JSON when it is not JSON): ``signature_in`` and the
    flight recorder's ``fr_verdict.summary_in`` both read it."""
    try:
        return json.loads(stacks_json)
    except (ValueError, TypeError, RecursionError):
        return NOT_JSON


def read_stacks(stacks_json: str, rank: int) -> tuple[str, fr_verdict.Summary | None]:
    """Rank ``rank``'s Stacks answer (at most ``MAX_STACKS`` characters) parsed once and
    read by both readers, in one call: the signature the culprit is named from
    (``signature_in``) and the flight recorder's summary (``fr_verdict.reading``), read
    only where the answer carries the recorder's part (the recorder on: else None, as
    its reader says for an answer without one)."""
    data = parse_stacks(stacks_json)
    carried = isinstance(data, dict) and isinstance(data.get("flight_recorder"), dict)
    return signature_in(data, stacks_json), \
        fr_verdict.reading(data, rank) if carried else None


def signature_in(data: Any, stacks_json: str, frames_per_thread: int = 4) -> str:
    """``stack_signature`` of an answer already parsed (``data``, left as it is: the
    flight recorder's reader may read it after)."""
    if data is NOT_JSON:
        return stacks_json.strip()[:2000]
    tag = ""
    live = data.get("liveness") if isinstance(data, dict) else None
    if isinstance(data, dict):  # the flight recorder's summaries and the verdict are not
        skip = ("flight_recorder", "liveness") if isinstance(live, dict) \
            else ("flight_recorder",)  # stacks: walk a top-level copy without them
        data = {k: v for k, v in data.items() if k not in skip}
    if isinstance(live, dict):
        state = "hung" if live.get("declared") else str(live.get("state") or "unknown")
        if re.fullmatch(r"\w+", state):
            where = str(live.get("where") or "").replace(" :: ", " : ")[:200]
            tag = f"live={state}" + (f" where={where}" if where else "") + " :: "
    threads: list[str] = []
    # What a peer sends is read within bounds: the first frames of each thread are at the
    # start of its text, so a thread is read for at most _SCAN_PER_THREAD characters and
    # a message for _SCAN_BUDGET, whatever padding it carries (issue 20).
    budget = [_SCAN_BUDGET]

    def walk(node: Any) -> None:
        if len(threads) >= _MAX_THREADS:
            return
        if isinstance(node, dict):
            frames = node.get("frames")
            if isinstance(frames, list):
                threads.append(" < ".join(_frame(fr) for fr in frames[:frames_per_thread]))
            text = node.get("stack")
            if isinstance(text, str):
                for thread in text.split("\nThread ", 8)[:8]:
                    scan = min(len(thread), _SCAN_PER_THREAD, budget[0])
                    budget[0] -= scan
                    found = _text_frames(thread, frames_per_thread, scan)
                    if found:
                        threads.append(" < ".join(f"{n} ({loc})" for n, loc in found))
            for k, v in node.items():
                if k not in ("frames", "stack"):
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(data)
    del threads[_MAX_THREADS:]
    if not threads:  # a capture that failed (py-spy timed out, the process exited): say so
        return tag + NO_STACK + _capture_errors(data)
    return tag + " | ".join(threads)


NO_STACK = "no stack: "


def _text_frames(thread: str, limit: int, end: int) -> list[tuple[str, str]]:
    """The first ``limit`` frames (name, file:line) in ``thread[:end]``, one thread of
    py-spy text, in time linear in ``end`` (``_TEXT_FRAME`` never matches across lines)."""
    return [(m.group(1), m.group(2).rsplit("/", 1)[-1])
            for m in itertools.islice(_TEXT_FRAME.finditer(thread, 0, end), limit)]


def _capture_errors(data: Any) -> str:
    """Why a capture has no frames, in words (its processes' errors), never raw JSON."""
    errors: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            err = node.get("error")
            if isinstance(err, str) and err and err not in errors:
                errors.append(err[:160])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(data)
    return "; ".join(errors[:3]) or "the capture held no frames"


def _frame(fr: Any) -> str:
    if not isinstance(fr, dict):
        return str(fr)
    path = str(fr.get("short_filename") or fr.get("filename") or "?").rsplit("/", 1)[-1]
    return f"{fr.get('name', '?')} ({path}:{fr.get('line', '?')})"


def _d(verdict: Verdict, reason: str, generation: int, rep: FaultReport, *,
       pending: bool = False) -> Decision:
    return Decision(verdict, reason, generation, rank=rep.rank, fault_id=rep.fault.id,
                    pending=pending)
