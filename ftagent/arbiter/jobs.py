"""The jobs: what agents tell changes them, decisions are carried out.

Every change of a job goes through ``Jobs.apply``: ``state.apply`` (the one place a job
changes: a Hello, a progress summary, an arrival, an exit, a decision; a fault and the
decision about it together, one transaction), then each observer subscribed to those
kinds of change, once with what it applied (``subscribe``: the journal writes the
timeline, the history and the goodput ledger from them). This part turns checked
messages into those changes, asks the barrier what an arrival or a Hello decides and the
policy what a rank's fault or a hang probe's stacks decide, and ``execute``s decisions:
apply, queue the commands (``commands.py``), tell the decision listeners (the cluster's
actions). Nothing here writes the timeline or the ledger. It runs on the server's event
loop only (no locks) and never blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import grpc

from ftagent.arbiter import barrier, commands, convert, policy, snapshots, state
from ftagent.arbiter.connection import Connection, live
from ftagent.arbiter.history import History
from ftagent.arbiter.nodemap import NodeMap
from ftagent.arbiter.state import (
    Arrived,
    AtBarrier,
    Change,
    Decision,
    Exited,
    FaultSeen,
    Forgotten,
    JobState,
    Left,
    Noted,
    Owned,
    Preflighted,
    Progressed,
    Promoted,
    RankState,
    Registered,
    Revived,
    Settled,
    SnapshotsIn,
    SpareArrived,
    SpareJoined,
    SpareLeft,
    StacksIn,
    Verdict,
    replaced_gone,
)
from ftagent.metrics import ArbiterMetrics
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import limits
from ftagent.wire.checks import (
    Refused,
    check_generation_claim,
    check_hello,
    progress_in_range,
    snapshot_steps,
)

log = logging.getLogger("ftagent.arbiter.registry")

Key = tuple[str, str]  # (namespace, job)
# Called with (job, decision, now) after each executed decision (add_decision_listener).
DecisionListener = Callable[[JobState, Decision, float], None]
# Called with (job, changes, now) after one ``state.apply``: what it applied of the kinds
# subscribed to, in order (``subscribe``).
Observer = Callable[[JobState, list[Change], float], None]


class MessageIntake(Protocol):
    """What ``handle`` hands to the intake (intake.py, which stands on this module:
    plugged in by the registry): a rank's step timings, for the straggler comparison.
    (An agent's fault and a hang probe's stacks are read here: ``fault``, ``stacks``.)"""

    def timing(self, job: JobState, rs: RankState, p: pb.ProgressSummary,
               now: float) -> None: ...


class Jobs:
    def __init__(self, cfg: policy.PolicyConfig, history: History,
                 metrics: ArbiterMetrics | None, arbiter_id: str,
                 clock: Callable[[], float], *, restart_ceiling: int,
                 max_ranks_per_job: int) -> None:
        self.cfg = cfg
        self.history = history  # read only: the ranks' owners a record kept
        self.metrics = metrics
        self.arbiter_id = arbiter_id
        self.clock = clock
        # What a Hello may ask for: a restart budget up to the ceiling (more is cut to it),
        # ranks up to the cap (more are refused).
        self.restart_ceiling = restart_ceiling
        self.max_ranks_per_job = max_ranks_per_job
        # Is the pod with this uid still there (namespace, pod, uid)? Plugged in by the
        # cluster (its pod watch); without one a pod's rank stays its own.
        self.pod_alive: Callable[[str, str, str], bool] = lambda ns, pod, uid: True
        self.jobs: dict[Key, JobState] = {}
        self.nodes = NodeMap(self.jobs)
        self.connected = 0
        self.listeners: list[DecisionListener] = []
        # the intake (intake.py: step timings), plugged in by the registry before any message
        self.intake: MessageIntake | None = None
        self._observers: list[tuple[Observer, frozenset[type]]] = []
        # The secret every job's replica key is derived from (snapshots.welcome_replica):
        # this process's own, never sent; agents get their job's key with each Welcome
        # (after a restart or failover: the new arbiter's).
        self.replica_secret = secrets.token_bytes(32)

    # ------------------------------------------------------------------ changes

    def subscribe(self, fn: Observer, kinds: Iterable[type]) -> None:
        """Call ``fn(job, changes, now)`` after each ``state.apply`` that applied changes
        of these kinds, once with all of them (on the loop; it must not block). The
        journal subscribes here."""
        self._observers.append((fn, frozenset(kinds)))

    def apply(self, job: JobState, changes: Change | list[Change],
              now: float) -> list[Change]:
        """``state.apply`` (one change, or the changes one event makes together: a fault
        and the decision about it), then each observer once with what it applied (with
        what it derived: the job finished, open faults settled). Returns what it applied."""
        applied = state.apply(job, changes, now)
        for fn, kinds in self._observers:
            seen = [c for c in applied if type(c) in kinds]
            if seen:
                fn(job, seen, now)
        return applied

    def record(self, job: JobState, kind: str, message: str, now: float, *,
               rank: int | None = None, fault_id: str = "", action: str = "") -> None:
        """A fact for the timeline that changes nothing (``state.Noted``)."""
        self.apply(job, Noted(kind, message, rank, fault_id, action), now)

    # ------------------------------------------------------------------ streams

    def hello(self, conn: Connection, h: pb.Hello) -> None:
        """Register ``conn`` as (job, rank); queue Welcome and what the rank missed.

        Raises ``Refused`` (the stream is closed with its status code) for a bad identity,
        a value out of range, or a rank already held by another live agent.
        """
        check_hello(h)
        now = self.clock()
        key = (h.namespace, h.job)
        job = self.jobs.get(key)
        check_generation_claim(h, job.generation if job is not None else -1)
        if h.spare or held_by_spare(job, h, conn):
            self._spare_hello(conn, h, job, now)
            return
        rs = job.ranks.get(h.rank) if job is not None else None
        # the rank's owner: the job's, or (no live job: an arbiter restart) its record's
        carried = self.history.owners(key) if job is None else {}
        self._admit(conn, h, rs, job.owners.get(h.rank) if job is not None
                    else carried.get(h.rank))
        same_agent = rs is not None and bool(h.agent_instance) \
            and rs.instance == h.agent_instance
        if job is not None and job.finished and job.connected == 0 and not same_agent:
            # Every agent of the finished run is gone: this Hello starts a new run. (Not
            # when it is one of them, back to say again how its rank ended: its link keeps
            # the exit until an arbiter confirms it read it. A new run is new agents.)
            self.record(job, "agent", f"a new run of the job starts (the previous one "
                        f"{job.phase.value}{': ' + job.stop_reason if job.stop_reason else ''})",
                        now, rank=h.rank)
            del self.jobs[key]
            job = rs = None
        if job is None:
            budget = min(h.max_restarts, self.restart_ceiling) if h.HasField("max_restarts") \
                else min(self.cfg.max_restarts, self.restart_ceiling)
            if h.HasField("max_restarts") and h.max_restarts > self.restart_ceiling:
                log.info("job %s asks for %d restarts: the arbiter's ceiling is %d",
                         h.job, h.max_restarts, self.restart_ceiling)
            job = self.jobs[key] = JobState(job=h.job, namespace=h.namespace,
                                            world_size=h.world_size, max_restarts=budget)
            if carried:
                self.apply(job, Owned(tuple((r, p, u) for r, (p, u) in carried.items())),
                           now)
            self.gauges()
        elif h.HasField("max_restarts") and h.max_restarts != job.max_restarts:
            self.record(job, "agent", f"asks for a restart budget of {h.max_restarts}; the "
                        f"job's is {job.max_restarts}, fixed by its first registration", now,
                        rank=h.rank)
        if h.world_size != job.world_size:
            self.record(job, "agent", f"says world size {h.world_size}, the job had "
                        f"{job.world_size}: using the larger", now, rank=h.rank)
        known = rs is not None
        old = live(rs.conn) if rs is not None else None
        if rs is not None and old is not None and old is not conn:
            old.reject(grpc.StatusCode.ABORTED, f"rank {h.rank} of job {h.job} registered "
                       f"again from {h.pod or conn.peer}: this stream is replaced", "superseded")
            self.record(job, "agent", f"re-registered from {h.pod or conn.peer} (the "
                        f"previous stream from {rs.pod or old.peer} is closed)", now,
                        rank=h.rank)
        fresh = rs is None or rs.conn is None
        # a REPLACE the rank's previous pod never acknowledged (it died with its node)
        # is that pod's, not its successor's: a new pod (another name or uid) is not
        # replaced in turn, it rejoins (barrier.decide_hello); nor is a new agent process
        # of the same pod (a pod-level tier restarted it in place: arbiter/ladder.py)
        if rs is not None and ((h.pod and rs.pod and h.pod != rs.pod) or (
                conn.pod_uid and rs.pod_uid and conn.pod_uid != rs.pod_uid) or (
                h.agent_instance and rs.instance and h.agent_instance != rs.instance)):
            commands.forget_replace(rs)
        if fresh:
            self.connected += 1
            self.gauges()
        self.apply(job, Registered(
            rank=h.rank, pod=h.pod, node=h.node, state=h.state, instance=h.agent_instance,
            pod_uid=conn.pod_uid, gpus=tuple(h.gpus), generation=h.generation,
            released_generation=h.released_generation
            if h.HasField("released_generation") else -1,
            running=h.trainer_running, restart_count=h.restart_count,
            world_size=h.world_size, alert_only=h.alert_only, conn=conn,
            peer=h.pod or conn.peer, known=known, fresh=fresh), now)
        rs = job.ranks[h.rank]
        self.nodes.index(key, rs)
        conn.key, conn.rank = key, h.rank
        snapshots.hello_replica(job, h.rank, h.node, conn.peer, h.replica_port)
        welcome = pb.Welcome(generation=job.generation, arbiter_id=self.arbiter_id,
                             max_restarts=job.max_restarts, restarts=job.restarts)
        snapshots.welcome_replica(welcome, job, h.rank, self.replica_secret)
        conn.send(pb.ArbiterMessage(welcome=welcome).SerializeToString())
        commands.resend(rs)
        self.execute(job, barrier.decide_hello(job, h.rank, now), now)
        if job.hang_probe is not None and rs.stack is None:  # it owes the probe an answer
            commands.ask_stacks(job, rs)

    def _spare_hello(self, conn: Connection, h: pb.Hello, job: JobState | None,
                     now: float) -> None:
        """A warm spare joins ``job`` (``h.spare``), or an agent whose rank a former spare
        holds now (its replaced pod, recreated) is told to serve as the job's spare."""
        told = not h.spare
        if job is None or (job.finished and job.connected == 0):
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"job {h.job} has no rank registered "
                          "yet: a spare joins a running job; retrying", "no_job")
        if job.finished:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"job {h.job} "
                          f"{job.phase.value}: no spare needed", "job_finished")
        if told and h.trainer_running:  # a spare runs no trainer: this one cannot serve
            holder = job.ranks[h.rank]
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"rank {h.rank} of job {h.job} is "
                          f"held by spare {holder.pod or holder.instance}, which took it over "
                          f"when the rank was replaced; this agent ({h.pod or conn.peer}) "
                          "still runs a trainer for it: refused (stop it, or start the pod "
                          "again to serve as a spare)", "rank_taken")
        if h.agent_instance not in job.spares and len(job.spares) >= limits.MAX_SPARES:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"job {h.job} has "
                          f"{len(job.spares)} spares, the most it keeps; this one "
                          f"({h.pod or conn.peer}) is refused", "too_many_spares")
        self.apply(job, SpareJoined(h.agent_instance, h.pod, h.node, conn.pod_uid, conn,
                                    h.pod or conn.peer, h.rank if told else None), now)
        conn.key, conn.rank, conn.spare = (h.namespace, h.job), -1, h.agent_instance
        snapshots.spare_replica(job, h.agent_instance, h.node, conn.peer, h.replica_port)
        welcome = pb.Welcome(generation=job.generation, arbiter_id=self.arbiter_id,
                             max_restarts=job.max_restarts, restarts=job.restarts)
        snapshots.welcome_replica(welcome, job, None, self.replica_secret)
        conn.send(pb.ArbiterMessage(welcome=welcome).SerializeToString())
        if told:
            holder = job.ranks[h.rank]
            reason = (f"rank {h.rank} is held by spare {holder.pod or holder.instance}, which "
                      f"took it over when the rank was replaced: {h.pod or conn.peer} serves "
                      "as the job's spare")
            conn.send(pb.ArbiterMessage(command=pb.Command(
                id=f"spare-{h.agent_instance}", kind=pb.COMMAND_KIND_SPARE,
                generation=job.generation, reason=reason)).SerializeToString())

    def spare_arrival(self, conn: Connection, generation: int) -> None:
        """The spare on ``conn`` arrives at the barrier of ``generation``: if it was
        ASSIGNed a rank for it, it takes that rank's seat (``promote``) once the replaced
        agent's trainer is gone; until then the arrival is held (``SpareArrived``)."""
        key = conn.key
        job = self.jobs.get(key) if key is not None else None
        sp = job.spares.get(conn.spare) if job is not None else None
        if job is None or sp is None or sp.conn is not conn or sp.assigned is None \
                or sp.assigned < 0 or generation < sp.generation:
            return
        self.apply(job, SpareArrived(sp.instance, generation), self.clock())
        self.promote_waiting(job, sp.assigned)

    def promote_waiting(self, job: JobState, rank: int) -> None:
        """A spare that arrived for ``rank`` takes its seat once the replaced agent's
        trainer is gone (``replaced_gone``), and its arrival is counted at the barrier."""
        sp = next((s for s in job.spares.values()
                   if s.assigned == rank and s.arrived >= 0), None)
        old = job.ranks.get(rank)
        if sp is None or not replaced_gone(old):
            return
        key = (job.namespace, job.job)
        conn = live(sp.conn)
        if old is not None and live(old.conn) is not None:
            self.connected -= 1  # that stream's end is not counted again (lookup: superseded)
        now = self.clock()
        self.apply(job, Promoted(sp.instance, rank), now)
        if conn is not None:
            conn.rank, conn.spare = rank, ""
        self.connected += 1
        rs = job.ranks[rank]
        self.nodes.index(key, rs)
        self.arrival(job, rs, sp.arrived, now)

    def fault(self, conn: Connection, job: JobState, rs: RankState, m: pb.Fault,
              now: float, received: float) -> None:
        """A rank's fault, decided (``policy.decide_fault``), then acknowledged: ``final``
        unless its decision is still open (stacks awaited, a link down); a fault id seen
        before is acknowledged again and decides nothing. Read here, where every agent
        message is read (as a spare's fault is, ``spare_fault``): the decision is carried
        out by ``execute`` without a step through another part.

        The decision's commands are queued before the FaultAck, so an agent that reads the
        final ack has already read the commands it led to.
        """
        seen = job.seen_faults.get(m.id)
        if seen is not None:
            conn.ack(m.id, seen, "already received")
            return
        try:
            fault = convert.checked_fault(m)
        except ValueError as e:
            self.record(job, "fault", f"unusable fault ignored: {e}", now, rank=rs.rank)
            conn.ack(m.id, True, f"ignored: {e}")
            return
        if self.metrics:
            self.metrics.faults.labels(kind=fault.kind.value).inc()
        rep = policy.FaultReport(fault, rs.rank, m.generation,
                                 m.exit_status if m.HasField("exit_status") else None)
        decisions = policy.decide_fault(job, rep, now, self.cfg)
        final = not any(d.pending for d in decisions)
        seen_now = FaultSeen(fault.id, final, rs.rank, f"{fault.kind.value}: {fault.message}",
                             fault, m.generation)
        if not decisions:
            self.execute(job, decisions, now, received, seen=seen_now)
            conn.ack(fault.id, final, "recorded")
            return
        # the FaultAck goes with the last decision's commands, after them on this stream
        self.execute(job, decisions, now, received, seen=seen_now,
                     answer=(conn, fault.id, final, decisions[0].verdict.value))

    def stacks(self, job: JobState, rs: RankState, m: pb.Stacks, now: float) -> None:
        """A rank's answer to a hang probe: read once (``policy.read_stacks``: its
        signature and flight-recorder summary), kept (``StacksIn``); once every connected
        rank answered, the probe is decided (``policy.decide_stacks``) and carried out."""
        probe = job.hang_probe
        if probe is None or rs.stack is not None or m.command_id != probe.command_id:
            # unsolicited (no probe, this rank answered already, or the answer to another
            # DUMP_STACKS: a late one of an earlier probe, decided at its deadline, or of
            # one lost with an arbiter that restarted): unread. The peer's id is compared,
            # never kept (the probe's is ours: Decision.command_id)
            return
        text = m.json  # one copy out of the message (1 MiB at most is read)
        size = len(text)
        if size <= policy.MAX_STACKS:  # parsed once, for both readers
            change = StacksIn(rs.rank, *policy.read_stacks(text, rs.rank))
        else:
            change = StacksIn(rs.rank, f"{policy.NO_STACK}stacks of {size} bytes (over "
                              f"{policy.MAX_STACKS})", None)
        # Kept, not written down: the probe's decision says how many ranks answered and
        # which did not (a timeline entry per rank pushed a 1,024-rank job's fault and
        # probe out of the 1,000 entries its timeline keeps)
        self.apply(job, change, now)
        decisions = policy.decide_stacks(job, now, self.cfg)
        if decisions:  # nothing until the last rank's stacks (or the deadline, at a tick)
            self.execute(job, decisions, now)

    def spare_fault(self, conn: Connection, m: pb.Fault, now: float) -> None:
        """A fault from a spare's agent (policy.decide_spare_fault), acknowledged final."""
        job = self.jobs.get(conn.key) if conn.key is not None else None
        sp = job.spares.get(conn.spare) if job is not None else None
        if job is None or sp is None or sp.conn is not conn:
            conn.ack(m.id, True, "ignored: not a spare of a live job")
            return
        try:
            fault = convert.checked_fault(m)
        except ValueError as e:
            conn.ack(m.id, True, f"ignored: {e}")
            return
        decisions = policy.decide_spare_fault(job, sp, fault)
        self.execute(job, decisions, now, seen=FaultSeen(fault.id, True))
        conn.ack(fault.id, True, decisions[0].verdict.value if decisions else "recorded")

    def _admit(self, conn: Connection, h: pb.Hello, rs: RankState | None,
               owner: tuple[str, str] | None) -> None:
        """Refuse a Hello the job cannot take: too many ranks, a rank held by another live
        agent, or a rank a still existing pod owns (``owner``: (pod, uid) as verified at
        the rank's last Hello, kept across an arbiter restart by the job's record)."""
        job = self.jobs.get((h.namespace, h.job))
        if h.world_size > self.max_ranks_per_job or (
                rs is None and job is not None and len(job.ranks) >= self.max_ranks_per_job):
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"job {h.job} may have at most "
                          f"{self.max_ranks_per_job} ranks (--max-ranks-per-job); rank "
                          f"{h.rank} of world size {h.world_size} refused", "too_many_ranks")
        if (rs is not None and rs.conn is not None and rs.conn is not conn and rs.instance
                and h.agent_instance != rs.instance):
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"rank {h.rank} of job {h.job} is "
                          f"held by another live agent ({rs.pod or 'unknown pod'}): refused; "
                          "a second agent for one rank is a misconfiguration (check --rank)",
                          "rank_taken")
        if (owner is not None and conn.pod_uid != owner[1]
                and self.pod_alive(h.namespace, owner[0], owner[1])):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"rank {h.rank} of job {h.job} "
                          f"belongs to pod {owner[0]} (uid {owner[1]}), which still exists: "
                          "another pod's credentials cannot take it over", "rank_owned")

    def lookup(self, conn: Connection) -> tuple[JobState | None, RankState | None]:
        job = self.jobs.get(conn.key) if conn.key is not None else None
        rs = job.ranks.get(conn.rank) if job is not None else None
        if rs is None or rs.conn is not conn:  # superseded by a newer stream of the rank
            return job, None
        return job, rs

    def disconnect(self, conn: Connection) -> None:
        if conn.spare:
            job = self.jobs.get(conn.key) if conn.key is not None else None
            sp = job.spares.get(conn.spare) if job is not None else None
            if job is not None and sp is not None and sp.conn is conn:
                self.apply(job, SpareLeft(sp.instance, sp.pod or sp.instance), self.clock())
            return
        job, rs = self.lookup(conn)
        if job is None or rs is None:
            return
        self.connected -= 1
        self.apply(job, Left(rs.rank), self.clock())
        if job.spares:  # a spare may wait for this replaced rank's agent to be gone
            self.promote_waiting(job, rs.rank)
        self.gauges()

    # ------------------------------------------------------------------ agent messages

    def handle(self, conn: Connection, m: pb.AgentMessage, received: float) -> None:
        """One message after Hello (``Registry.handle`` is this method); ``received`` is
        time.monotonic() at arrival. Faults and stacks are decided here; step timings go
        to the intake (the straggler comparison)."""
        if conn.spare:  # a spare says nothing else until it arrives as its assigned rank
            if m.WhichOneof("body") == "fault":  # its own GPUs, links, node
                self.spare_fault(conn, m.fault, self.clock())
            elif m.WhichOneof("body") == "arrival":
                self.spare_arrival(conn, m.arrival.generation)
            return
        job = self.jobs.get(conn.key) if conn.key is not None else None
        rs = job.ranks.get(conn.rank) if job is not None else None
        if rs is None or rs.conn is not conn:  # superseded by a newer stream of the rank
            return
        assert job is not None and self.intake is not None
        now = self.clock()
        body = m.WhichOneof("body")
        if body == "progress":
            if not progress_in_range(m.progress):
                return  # one bad summary is dropped; the next one will do
            self.progress(job, rs, m.progress, now)
            self.intake.timing(job, rs, m.progress, now)
        elif body == "fault":
            self.fault(conn, job, rs, m.fault, now, received)
        elif body == "arrival":
            self.arrival(job, rs, m.arrival.generation, now,
                         preflight=m.arrival.preflight_seconds)
        elif body == "exit":
            self.exit(job, rs, m.exit, now)
        elif body == "ack":
            commands.acked(rs, m.ack.command_id)
        elif body == "stacks":
            self.stacks(job, rs, m.stacks, now)
        elif body == "snapshots":
            steps = snapshot_steps(m.snapshots)
            if steps is not None:  # a report out of range is dropped; the next will do
                self.apply(job, SnapshotsIn(rs.rank, steps), now)

    def progress(self, job: JobState, rs: RankState, p: pb.ProgressSummary,
                 now: float) -> None:
        self.apply(job, Progressed(
            rs.rank, p.step, p.hung, p.loss if p.HasField("loss") else None,
            p.samples_per_second, p.tokens_per_second,
            now - max(0.0, p.seconds_since_progress), ts=p.ts,
            resumed=(p.resumed_step, p.resume_source) if p.HasField("resumed_step")
            else None, phases=(p.checkpoint_seconds, p.other_phase_seconds)), now)

    def arrival(self, job: JobState, rs: RankState, a: int, now: float,
                preflight: float = 0.0) -> None:
        if not 0 <= a <= max(job.generation, limits.MAX_CLAIMED_GENERATION):
            return  # no agent sends this (the server refuses it at the edge too)
        b = job.barrier  # was the rank counted at this barrier before (a re-sent arrival)?
        fresh = b is None or b.generation != job.generation or rs.rank not in b.arrived
        self.apply(job, Arrived(rs.rank, a), now)  # counted at the barrier if a is the job's
        if a > job.generation:
            # Only an arrival above the job's generation can change what reconcile
            # decides: ranks running alone or behind were already seen in their
            # Hellos, which come first on every stream. (Reconcile scans every rank:
            # once per arrival would make a barrier of N ranks cost N^2.)
            self.execute(job, barrier.reconcile(job, now), now)
            b = job.barrier
            fresh = b is None or b.generation != job.generation or rs.rank not in b.arrived
            self.apply(job, AtBarrier(rs.rank, a), now)  # at the generation it raised to
        b = job.barrier
        decisions = barrier.decide_barrier(job, rs.rank, a, fresh)  # pure, as the policy
        if b is not None and self.metrics and b.first_arrival_at is not None and any(
                d.verdict is Verdict.RELEASE_BARRIER and not d.targets for d in decisions):
            self.metrics.barrier_seconds.observe(now - b.first_arrival_at)
        self.execute(job, decisions, now)
        if preflight > 0:  # its own ledger category
            self.apply(job, Preflighted(rs.rank, a, preflight), now)

    def exit(self, job: JobState, rs: RankState, m: pb.TrainerExit, now: float) -> None:
        sig = m.signal if m.HasField("signal") else None
        code = m.exit_code if m.HasField("exit_code") else None
        status = 128 + sig if sig is not None else (code or 0)
        if rs.exit_heard == (m.generation, status):
            return  # said again on a new stream: the agent did not know it was read
        self.apply(job, Exited(rs.rank, m.generation, status, sig), now)
        if job.spares:  # a spare may wait for this replaced rank's trainer to be gone
            self.promote_waiting(job, rs.rank)

    def exits_seen(self, namespace: str, name: str,
                   exits: Mapping[int, tuple[int | None, int]], via: str,
                   now: float) -> bool:
        """Exits the ranks' agents could not deliver, read where they are left (``via``:
        the pods' terminal status in the cluster, the exit notes of --state-dir): rank ->
        (generation, or None for the one its agent last said; status). Each counts for a
        rank whose agent is not connected and whose exit of that generation was not heard;
        a job of the history that did not finish is taken live again (``Revived``) to
        hear them, so its status says succeeded or failed, not gone. Returns whether the
        job is over or unknown: nothing more to read for it."""
        key = (namespace, name)
        job = self.jobs.get(key)
        if job is None:
            rec = self.history.past.get(key)
            if rec is None or rec.finished:
                return True
            if not exits:
                return False
            world = max(1, min(rec.world_size, self.max_ranks_per_job))
            job = self.jobs[key] = JobState(job=name, namespace=namespace, world_size=world,
                                            generation=rec.generation, restarts=rec.restarts,
                                            max_restarts=rec.max_restarts,
                                            alert_only=rec.alert_only)
            carried = self.history.owners(key)
            if carried:
                self.apply(job, Owned(tuple((r, p, u) for r, (p, u) in carried.items())),
                           now)
            said = max((g for g, _ in exits.values() if g is not None), default=-1)
            self.apply(job, Revived(max(rec.generation, said)), now)
            self.record(job, "agent", f"no agent for {max(0.0, now - rec.last_seen):.0f}s "
                        f"(gone before this arbiter's term): its ranks' exits read from "
                        f"{via}", now)
            self.gauges()
        elif job.connected == 0 and not job.finished and any(
                r not in job.ranks for r in exits if r < job.world_size):
            # ranks whose agents never reached this arbiter (it started after they ended)
            self.apply(job, Revived(job.generation), now)
        for rank, (generation, status) in sorted(exits.items()):
            if job.finished:
                break
            rs = job.ranks.get(rank)
            g = rs.generation if rs is not None and generation is None else generation
            if rs is None or rs.connected or g is None or (
                    rs.exit_heard is not None and rs.exit_heard[0] >= g):
                continue
            self.apply(job, Exited(rank, g, status, None, via), now)
        return job.finished

    # ------------------------------------------------------------------ decisions

    def execute(self, job: JobState, decisions: Iterable[Decision], now: float,
                received: float | None = None, seen: FaultSeen | None = None,
                answer: commands.Answer | None = None) -> None:
        """Apply each decision (its observers write it down) and queue its commands on the
        ranks' streams, with a final FaultAck for each open fault it settled (``state.apply``
        derives ``Settled``: no stacks awaited, no link down any more; the commands first);
        then tell the decision listeners (the agents' commands are queued first).
        ``seen``: the fault these decisions are about, applied with the first of them in
        one transaction (one ``state.apply``, observed once: the fault is never written
        down without what was decided about it); ``answer``: its reporting agent's
        FaultAck, queued with the last decision's commands, after them (``decisions`` is
        then a non-empty list)."""
        if not decisions and isinstance(decisions, list):
            if seen is not None:
                self.apply(job, seen, now)
            return  # most arrivals and Hellos decide nothing
        last = len(decisions) - 1 if answer is not None and isinstance(decisions, list) \
            else -1
        done: list[Decision] = []
        for i, d in enumerate(decisions):
            if d.verdict is Verdict.DUMP_STACKS and not d.command_id:
                # its command's id, made here (the policy is pure): the probe it opens
                # keeps it (state.apply) and reads only answers that carry it
                d = dataclasses.replace(d, command_id=uuid.uuid4().hex)
            done.append(d)
            applied = self.apply(job, [seen, d] if seen is not None else d, now)
            seen = None
            if self.metrics:
                self.metrics.decisions.labels(action=d.verdict.value).inc()
            settled = applied[-1] if isinstance(applied[-1], Settled) else None
            commands.send(job, d, self.metrics, received,
                          settled.faults if settled is not None else (),
                          answer if i == last else None)
        if seen is not None:  # an iterable of no decisions
            self.apply(job, seen, now)
        for d in done if self.listeners else ():
            for fn in self.listeners:
                try:
                    fn(job, d, now)
                except Exception:  # a listener's bug must not stop the decisions
                    log.exception("decision listener %r failed", fn)

    def forget(self, key: Key, job: JobState) -> None:
        """Drop a job nobody ran for long: only its history record stays."""
        self.apply(job, Forgotten(), self.clock())
        del self.jobs[key]
        self.nodes.unindex(key)
        self.gauges()

    def gauges(self) -> None:
        if self.metrics:
            self.metrics.agents_connected.set(self.connected)
            self.metrics.jobs.set(len(self.jobs))


def held_by_spare(job: JobState | None, h: pb.Hello, conn: Connection) -> bool:
    """Is the rank this (non-spare) Hello claims held by a former spare's live stream, for
    another agent? Then the claimant is the replaced pod come back: it serves as a spare."""
    if job is None or job.finished:
        return False
    rs = job.ranks.get(h.rank)
    return (rs is not None and rs.from_spare and live(rs.conn) is not None
            and rs.conn is not conn and rs.instance != h.agent_instance)
