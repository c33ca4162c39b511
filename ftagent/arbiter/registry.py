"""Jobs -> ranks -> agent connections, and carrying decisions out.

The registry turns what agents send into state (``state.py``), asks the policy
(``policy.py``, ``barrier.py``) what to do, applies the decisions, writes them to the
timeline and queues the resulting commands on the agents' streams. It runs on the
server's event loop only (no locks) and never blocks: a command to 10k ranks is one
serialisation and 10k queue puts; each stream's writer drains its own queue.

Commands wait in the rank's ``pending`` until the agent acknowledges them, and are sent
again when the agent reconnects. After an arbiter restart nothing is pending: agents'
Hellos (generation, restart count, released generation) rebuild what matters.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from ftagent.arbiter import barrier, convert, fr_verdict, policy
from ftagent.arbiter.history import History, JobRecord, JobStats, shown_state
from ftagent.arbiter.ledger import Breakdown, Incident, Ledger
from ftagent.arbiter.state import Decision, JobPhase, JobState, RankState, Verdict, apply
from ftagent.arbiter.straggler import JobTimings, RankTiming, StragglerConfig, StragglerWatch
from ftagent.arbiter.timeline import Timeline
from ftagent.metrics import ArbiterMetrics, JobSnapshot
from ftagent.model import Fault, FaultKind, Scope, Severity
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import limits
from ftagent.wire.checks import (
    Refused,
    check_fault,
    check_generation_claim,
    check_hello,
    progress_in_range,
)

log = logging.getLogger("ftagent.arbiter.registry")

# Seconds a job with no agent left keeps its live state (a Hello continues it); then
# only its history record is kept, until --history-retention after its last agent left.
FORGET_AFTER = 3600.0
# Defaults of --restart-ceiling and --max-ranks-per-job: what one job's agents may ask for.
RESTART_CEILING = 100
MAX_RANKS_PER_JOB = 100_000
STRAGGLER_EVERY = 5.0  # seconds between straggler assessments (the agents' summary interval)
_SLOTS = {Verdict.RESTART: "life", Verdict.REJOIN: "life", Verdict.STOP: "life",
          Verdict.REPLACE: "life", Verdict.RELEASE_BARRIER: "release",
          Verdict.DUMP_STACKS: "dump", Verdict.BUSY: "busy"}
_RANK_STATES = {Verdict.RESTART: "restarting", Verdict.REJOIN: "restarting",
                Verdict.STOP: "stopping", Verdict.REPLACE: "replacing",
                Verdict.RELEASE_BARRIER: "running"}
_TIMED = (Verdict.RESTART, Verdict.REPLACE, Verdict.STOP, Verdict.DUMP_STACKS)

# Called with (job, decision, now) after each executed decision (add_decision_listener).
DecisionListener = Callable[[JobState, Decision, float], None]


class FanOut:
    """One command written to many streams: observes the time until the last write."""

    __slots__ = ("left", "started", "observe")

    def __init__(self, left: int, started: float, observe: Callable[[float], None]) -> None:
        self.left, self.started, self.observe = left, started, observe

    def done(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.observe(time.monotonic() - self.started)


@dataclass(frozen=True)
class Reject:
    """End the stream with an error status (queued so that the stream's owner ends it)."""

    code: grpc.StatusCode
    details: str
    reason: str  # label of ftagent_arbiter_rejected_requests


Outgoing = tuple[bytes, FanOut | None] | Reject | None


class Connection:
    """One agent's open stream: serialized messages queued for the stream's writer.

    ``None`` in the outbox ends the stream normally (superseded by a newer stream of the
    same rank), a ``Reject`` ends it with an error status.
    """

    __slots__ = ("id", "peer", "key", "rank", "outbox", "pod_uid")

    def __init__(self, peer: str = "", pod_uid: str = "") -> None:
        self.id = uuid.uuid4().hex[:8]
        self.peer = peer
        # The verified pod (TokenReview) this stream speaks for; "" when the credential
        # names no pod (HMAC job token, admin). A rank first registered by a pod stays that
        # pod's while the pod exists.
        self.pod_uid = pod_uid
        self.key: tuple[str, str] | None = None  # (namespace, job) once Hello was accepted
        self.rank = -1
        self.outbox: asyncio.Queue[Outgoing] = asyncio.Queue()

    def send(self, data: bytes, fanout: FanOut | None = None) -> None:
        self.outbox.put_nowait((data, fanout))

    def reject(self, code: grpc.StatusCode, details: str, reason: str) -> None:
        self.outbox.put_nowait(Reject(code, details, reason))

    def close(self) -> None:
        self.outbox.put_nowait(None)


class Registry:
    def __init__(self, cfg: policy.PolicyConfig, timeline: Timeline,
                 metrics: ArbiterMetrics | None, arbiter_id: str,
                 clock: Callable[[], float] = time.time,
                 history: History | None = None, *, restart_ceiling: int = RESTART_CEILING,
                 max_ranks_per_job: int = MAX_RANKS_PER_JOB) -> None:
        self.cfg = cfg
        # What a Hello may ask for: a restart budget up to the ceiling (more is cut to it),
        # ranks up to the cap (more are refused).
        self.restart_ceiling = restart_ceiling
        self.max_ranks_per_job = max_ranks_per_job
        # Is the pod with this uid still there (namespace, pod, uid)? Plugged in by the
        # cluster (its pod watch); without one a pod's rank stays its own.
        self.pod_alive: Callable[[str, str, str], bool] = lambda ns, pod, uid: True
        self.timeline = timeline
        self.metrics = metrics
        self.arbiter_id = arbiter_id
        self.clock = clock
        self.jobs: dict[tuple[str, str], JobState] = {}
        self.connected = 0
        # History is for status only: nothing in it decides anything.
        self.history = history or History()
        self.history.on_forget = lambda namespace, name: self.timeline.forget(name, namespace)
        self.timeline.seed(self.history.load())
        self.timeline.sink = self.history.entry
        self.stats: dict[tuple[str, str], tuple[JobState, JobStats]] = {}
        # Per job: latest step timings per rank and who is a straggler (straggler.py).
        self.timings: dict[tuple[str, str], tuple[JobState, JobTimings]] = {}
        self._stragglers_at = 0.0
        # Cluster hooks (report_fault, ranks_on_node, rank_of_pod, add_decision_listener):
        # indexes from Hellos, checked against the rank's state on every lookup.
        self._listeners: list[DecisionListener] = []
        self._pods: dict[tuple[str, str], tuple[tuple[str, str], int]] = {}
        self._nodes: dict[str, set[tuple[tuple[str, str], int]]] = {}

    # ------------------------------------------------------------------ agent messages

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
        rs = job.ranks.get(h.rank) if job is not None else None
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
        if (rs is not None and rs.pod_uid and conn.pod_uid != rs.pod_uid
                and self.pod_alive(h.namespace, rs.pod, rs.pod_uid)):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"rank {h.rank} of job {h.job} "
                          f"belongs to pod {rs.pod} (uid {rs.pod_uid}), which still exists: "
                          "another pod's credentials cannot take it over", "rank_owned")
        if job is not None and job.finished and job.connected == 0:
            # Every agent of the finished run is gone: this Hello starts a new run.
            self._note(job, now, "agent", f"a new run of the job starts (the previous one "
                       f"{job.phase.value}{': ' + job.stop_reason if job.stop_reason else ''})",
                       rank=h.rank)
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
            barrier.open_barrier(job, now)
            self._ledger(job, now, h.generation, midway=h.generation > 0 or h.trainer_running)
            self._gauges()
        elif h.HasField("max_restarts") and h.max_restarts != job.max_restarts:
            self._note(job, now, "agent", f"asks for a restart budget of {h.max_restarts}; "
                       f"the job's is {job.max_restarts}, fixed by its first registration",
                       rank=h.rank)
        job.alert_only = h.alert_only
        job.last_seen = now
        if h.world_size != job.world_size:
            self._note(job, now, "agent", f"says world size {h.world_size}, the job had "
                       f"{job.world_size}: using the larger", rank=h.rank)
            job.world_size = max(job.world_size, h.world_size)
        job.restarts = max(job.restarts, h.restart_count)
        known = rs is not None
        if rs is None:
            rs = job.ranks[h.rank] = RankState(rank=h.rank)
        elif rs.conn is not None and rs.conn is not conn:
            old = rs.conn
            assert isinstance(old, Connection)
            old.reject(grpc.StatusCode.ABORTED, f"rank {h.rank} of job {h.job} registered "
                       f"again from {h.pod or conn.peer}: this stream is replaced", "superseded")
            self._note(job, now, "agent", f"re-registered from {h.pod or conn.peer} (the "
                       f"previous stream from {rs.pod or old.peer} is closed)", rank=h.rank)
        fresh = rs.conn is None
        if rs.instance != h.agent_instance:
            rs.commanded = -1  # a new agent process: it was told nothing yet
        rs.pod, rs.node, rs.state, rs.instance = h.pod, h.node, h.state, h.agent_instance
        if conn.pod_uid:
            rs.pod_uid = conn.pod_uid
        rs.gpus = tuple(h.gpus)
        self._index(key, rs)
        released = h.released_generation if h.HasField("released_generation") else -1
        rs.generation, rs.released_generation = h.generation, released
        rs.running = h.trainer_running
        rs.restarts, rs.connected, rs.conn = h.restart_count, True, conn
        conn.key, conn.rank = key, h.rank
        if fresh:
            job.connected += 1
            self.connected += 1
            self._gauges()
            if known:
                self._note(job, now, "agent", f"reconnected ({h.pod or conn.peer}, generation "
                           f"{h.generation}{', trainer running' if h.trainer_running else ''})",
                           rank=h.rank)
            elif job.connected == job.world_size:
                self._note(job, now, "agent", f"all {job.world_size} ranks connected")
        conn.send(pb.ArbiterMessage(welcome=pb.Welcome(
            generation=job.generation, arbiter_id=self.arbiter_id,
            max_restarts=job.max_restarts, restarts=job.restarts)).SerializeToString())
        for _, data in list(rs.pending.values()):
            conn.send(data)
        self.execute(job, barrier.decide_hello(job, h.rank, now), now)

    def disconnect(self, conn: Connection) -> None:
        job, rs = self._lookup(conn)
        if job is None or rs is None:
            return
        rs.conn, rs.connected = None, False
        job.connected -= 1
        self.connected -= 1
        job.last_seen = self.clock()
        self._gauges()
        if not job.finished:
            self._note(job, job.last_seen, "agent", "disconnected", rank=rs.rank)
        if job.connected == 0:
            self.history.update(job, self._stats(job), job.last_seen)

    def handle(self, conn: Connection, m: pb.AgentMessage, received: float) -> None:
        """One message after Hello; ``received`` is time.monotonic() at arrival."""
        job, rs = self._lookup(conn)
        if job is None or rs is None:
            return
        now = self.clock()
        body = m.WhichOneof("body")
        if body == "progress":
            p = m.progress
            if not progress_in_range(p):
                return  # one bad summary is dropped; the next one will do
            rs.step, rs.hung = p.step, p.hung
            if job.busy and p.step > job.busy_step:  # the busy phase is over
                job.busy, job.busy_step = "", -1
            rs.loss = p.loss if p.HasField("loss") else None
            rs.samples_per_second, rs.tokens_per_second = p.samples_per_second, \
                p.tokens_per_second
            rs.last_step_at = now - max(0.0, p.seconds_since_progress)
            led = self._ledger(job, now)
            led.world_size, mode = job.world_size, led.mode
            # when the step was seen: the summary's own stamp (it may wait up to a
            # progress interval to be sent), never later than its arrival
            at = min(now, p.ts) if p.ts > 0 else rs.last_step_at
            # a rank that arrived for a generation not released to it yet still reports
            # its previous trainer (lines read after that trainer's exit), unless its
            # Hello said a trainer of that generation runs (started failing open)
            g = rs.generation if rs.released_generation >= rs.generation or rs.running \
                else max(0, rs.released_generation)
            if p.HasField("resumed_step"):  # before its first step: it decides the resume
                led.resumed(g, p.resumed_step)
            led.progress(rs.rank, g, p.step, at)
            led.phases(rs.rank, g, (p.checkpoint_seconds, p.other_phase_seconds), at)
            if led.mode is not mode:  # the record says where time goes (arbiter restart)
                self.history.update(job, self._stats(job), now)
            if p.timed_steps > 0:
                jt = self._timings(job)
                jt.note(RankTiming(rs.rank, rs.node, p.step_seconds, p.collective_seconds,
                                   p.data_seconds), now)
                led.slowed(jt.slowdown(now), at)  # time waited on a slow rank
        elif body == "fault":
            self._fault(conn, job, rs, m.fault, now, received)
        elif body == "arrival":
            a = m.arrival.generation
            if not 0 <= a <= max(job.generation, limits.MAX_CLAIMED_GENERATION):
                return  # no agent sends this (the server refuses it at the edge too)
            if a > rs.generation and rs.released_generation >= 0:
                rs.restarts += 1  # it ran a trainer and now waits to start a newer one
            rs.generation = max(rs.generation, a)
            rs.running = False
            rs.state = "waiting"
            if a > job.generation:
                # Only an arrival above the job's generation can change what reconcile
                # decides: ranks running alone or behind were already seen in their
                # Hellos, which come first on every stream. (Reconcile scans every rank:
                # once per arrival would make a barrier of N ranks cost N^2.)
                self.execute(job, barrier.reconcile(job, now), now)
            b = job.barrier
            decisions = barrier.decide_arrival(job, rs.rank, a, now)
            if b is not None and self.metrics and b.first_arrival_at is not None and any(
                    d.verdict is Verdict.RELEASE_BARRIER and not d.targets for d in decisions):
                self.metrics.barrier_seconds.observe(now - b.first_arrival_at)
            self.execute(job, decisions, now)
        elif body == "exit":
            self._exit(job, rs, m.exit, now)
        elif body == "ack":
            for slot, (cid, _) in list(rs.pending.items()):
                if cid == m.ack.command_id:
                    del rs.pending[slot]
        elif body == "stacks":
            if job.hang_probe is None or rs.stack is not None:
                return  # unsolicited (no probe, or this rank already answered): unread
            text = m.stacks.json  # one copy out of the message (1 MiB at most is read)
            size = len(text)
            if size <= policy.MAX_STACKS:  # parsed once, for both readers
                data = policy.parse_stacks(text)
                rs.stack = policy.signature_in(data, text)
                rs.fr = fr_verdict.summary_in(data, rs.rank)
            else:
                rs.stack = f"{policy.NO_STACK}stacks of {size} bytes (over {policy.MAX_STACKS})"
                rs.fr = None
            self._note(job, now, "stacks", f"stacks received ({size} bytes)",
                       rank=rs.rank)
            self.execute(job, policy.decide_stacks(job, now, self.cfg), now)

    def _fault(self, conn: Connection, job: JobState, rs: RankState, m: pb.Fault, now: float,
               received: float) -> None:
        """Decide a fault, then acknowledge it: ``final`` unless its decision is still open.

        The decision's commands are queued before the FaultAck, so an agent that reads the
        final ack has already read the commands it led to.
        """
        seen = job.seen_faults.get(m.id)
        if seen is not None:
            self._ack(conn, m.id, seen, "already received")
            return
        try:
            check_fault(m)
            fault = convert.fault_from_proto(m)
        except ValueError as e:
            self._note(job, now, "fault", f"unusable fault ignored: {e}", rank=rs.rank)
            self._ack(conn, m.id, True, f"ignored: {e}")
            return
        if self.metrics:
            self.metrics.faults.labels(kind=fault.kind.value).inc()
        self._stats(job).fault(fault.id, now, fault.kind.value)
        self._ledger_fault(job, rs, fault, now)
        rs.last_fault = f"{fault.kind.value}: {fault.message}"[:300]
        self._note(job, now, "fault", f"{fault.kind.value} ({fault.severity.value}, "
                   f"generation {m.generation}): {fault.message}", rank=rs.rank,
                   fault_id=fault.id)
        rep = policy.FaultReport(fault, rs.rank, m.generation,
                                 m.exit_status if m.HasField("exit_status") else None)
        decisions = policy.decide_fault(job, rep, now, self.cfg)
        final = not any(d.pending for d in decisions)
        job.remember_fault(fault.id, final)
        if not final and len(job.open_faults) < limits.MAX_OPEN_FAULTS:
            job.open_faults[fault.id] = rs.rank
        self.execute(job, decisions, now, received)
        outcome = decisions[0].verdict.value if decisions else "recorded"
        self._ack(conn, fault.id, final, outcome)

    def _settle_open_faults(self, job: JobState, outcome: str) -> None:
        """No stacks awaited and no link down any more: every open fault is decided."""
        if not job.open_faults or job.hang_probe is not None or job.nic_outages:
            return
        for fid, rank in job.open_faults.items():
            if fid in job.seen_faults:
                job.seen_faults[fid] = True
            rs = job.ranks.get(rank)
            if rs is not None and isinstance(rs.conn, Connection):
                self._ack(rs.conn, fid, True, outcome)
        job.open_faults.clear()

    def _ack(self, conn: Connection, fault_id: str, final: bool, outcome: str) -> None:
        conn.send(pb.ArbiterMessage(fault_ack=pb.FaultAck(
            fault_id=fault_id, final=final, outcome=limits.clip(outcome, 200))).SerializeToString())

    def _exit(self, job: JobState, rs: RankState, m: pb.TrainerExit, now: float) -> None:
        sig = m.signal if m.HasField("signal") else None
        code = m.exit_code if m.HasField("exit_code") else None
        rs.last_exit_status = 128 + sig if sig is not None else (code or 0)
        rs.state = "exited"
        how = f"signal {sig}" if sig is not None else f"code {code}"
        self._note(job, now, "exit", f"trainer of generation {m.generation} exited with {how}",
                   rank=rs.rank)
        if rs.last_exit_status == 0 and m.generation == job.generation:
            rs.state = "succeeded"
            done = sum(1 for r in job.ranks.values()
                       if r.state == "succeeded" and r.generation == job.generation)
            if done >= job.world_size and not job.finished:
                job.phase = JobPhase.SUCCEEDED
                self._ledger(job, now).end(now)
                self._note(job, now, "decision", f"every rank exited 0: job succeeded at "
                           f"generation {job.generation}", action="succeeded")

    # ------------------------------------------------------------------ decisions

    def execute(self, job: JobState, decisions: Iterable[Decision], now: float,
                received: float | None = None) -> None:
        """Apply each decision, record it, and queue its commands on the ranks' streams;
        then tell the decision listeners (the agents' commands are queued first)."""
        last = ""
        done: list[Decision] = []
        for d in decisions:
            done.append(d)
            apply(job, d, now)
            self._account(job, d, now)
            last = d.verdict.value
            kind = "barrier" if d.verdict is Verdict.RELEASE_BARRIER else "decision"
            self._note(job, now, kind, d.reason, rank=d.rank, fault_id=d.fault_id,
                       action=d.verdict.value)
            if self.metrics:
                self.metrics.decisions.labels(action=d.verdict.value).inc()
            if d.verdict not in _SLOTS:
                continue
            targets = d.targets or tuple(job.ranks)
            cid = uuid.uuid4().hex
            data = convert.command_for(d, cid, restarts=job.restarts).SerializeToString()
            fan = None
            if received is not None and d.verdict in _TIMED and self.metrics:
                n = sum(1 for r in targets if (rs := job.ranks.get(r)) and rs.conn is not None)
                fan = FanOut(n, received, self.metrics.fault_to_command.observe) if n else None
            for r in targets:
                rs = job.ranks.get(r)
                if rs is None:
                    continue
                if d.verdict is Verdict.REPLACE and r == d.rank:
                    self._command(rs, d.verdict, cid + "-replace", convert.command_for(
                        d, cid + "-replace", replace=True, restarts=job.restarts
                    ).SerializeToString(), fan,
                        d.generation)
                else:
                    self._command(rs, d.verdict, cid, data, fan, d.generation)
                    if d.verdict is Verdict.REPLACE:
                        rs.state = "restarting"
        if last:
            self._settle_open_faults(job, last)
        for d in done if self._listeners else ():
            for fn in self._listeners:
                try:
                    fn(job, d, now)
                except Exception:  # a listener's bug must not stop the decisions
                    log.exception("decision listener %r failed", fn)

    def _command(self, rs: RankState, verdict: Verdict, cid: str, data: bytes,
                 fan: FanOut | None, generation: int) -> None:
        rs.state = _RANK_STATES.get(verdict, rs.state)
        if verdict in (Verdict.RESTART, Verdict.REJOIN, Verdict.REPLACE):
            rs.commanded = max(rs.commanded, generation)
        if verdict is Verdict.RELEASE_BARRIER:
            rs.released_generation = max(rs.released_generation, rs.generation)
        slot = _SLOTS[verdict]
        if slot == "life":
            rs.pending.clear()
        rs.pending[slot] = (cid, data)
        if isinstance(rs.conn, Connection):
            rs.conn.send(data, fan)

    def tick(self) -> None:
        """Deadlines (stacks, links, barriers) and forgetting jobs nobody runs any more."""
        now = self.clock()
        if now >= self._stragglers_at:
            self._stragglers_at = now + STRAGGLER_EVERY
            self._assess_stragglers(now)
        for key, job in list(self.jobs.items()):
            self.execute(job, policy.decide_tick(job, now, self.cfg), now)
            if job.connected == 0 and now - job.last_seen > min(FORGET_AFTER,
                                                                 self.history.retention):
                del self.jobs[key]
                self.timings.pop(key, None)
                self._unindex(key)
                got = self.stats.pop(key, None)
                self.history.retire(job, got[1] if got else None)
                self._gauges()
            elif key in self.history.past:  # a job of the history runs again
                self._stats(job)
        for namespace, name in self.history.expired(now):
            self.history.drop(namespace, name)

    # ------------------------------------------------------------------ cluster hooks

    def report_fault(self, namespace: str, job: str, fault: Fault, now: float | None = None,
                     rank: int | None = None,
                     generation: int | None = None) -> list[Decision]:
        """Decide a fault no agent sent (a cluster watch, a node agent, a detector that
        compares ranks) exactly as an agent's: recorded on the timeline, counted, decided by
        the policy, carried out. Returns the decisions ([] for an unknown job or a fault id
        already seen: reporting again is harmless).

        ``rank``: the rank it is about (``None``: the whole job, no culprit). ``generation``:
        the job's generation when the fault was observed (default: the current one; an older
        one is recorded and ignored, as for an agent's stale fault). Never raises for a
        fault of a job or rank it does not know; call it on the server's event loop.
        """
        j = self.jobs.get((namespace, job))
        if j is None or fault.id in j.seen_faults:
            return []
        now = self.clock() if now is None else now
        g = j.generation if generation is None else generation
        rs = j.ranks.get(rank) if rank is not None else None
        if self.metrics:
            self.metrics.faults.labels(kind=fault.kind.value).inc()
        self._stats(j).fault(fault.id, now, fault.kind.value)
        self._ledger_fault(j, rs, fault, now)
        if rs is not None:
            rs.last_fault = f"{fault.kind.value}: {fault.message}"[:300]
        self._note(j, now, "fault", f"{fault.kind.value} ({fault.severity.value}, generation "
                   f"{g}, seen by the arbiter): {limits.clip(fault.message, 1000)}", rank=rank,
                   fault_id=fault.id)
        rep = policy.FaultReport(fault, -1 if rank is None else rank, g)
        decisions = policy.decide_fault(j, rep, now, self.cfg)
        j.remember_fault(fault.id)  # no agent re-sends it: decided now, whatever the outcome
        self.execute(j, decisions, now)
        return decisions

    def ranks_on_node(self, node: str) -> list[tuple[JobState, RankState]]:
        """Every live job's ranks whose agent said it runs on ``node`` (Hello.node)."""
        out = []
        for key, rank in list(self._nodes.get(node, ())):
            j = self.jobs.get(key)
            rs = j.ranks.get(rank) if j is not None else None
            if j is not None and rs is not None and rs.node == node:
                out.append((j, rs))
            else:
                self._nodes[node].discard((key, rank))
        if node in self._nodes and not self._nodes[node]:
            del self._nodes[node]
        return sorted(out, key=lambda t: (t[0].namespace, t[0].job, t[1].rank))

    def rank_of_pod(self, namespace: str, pod: str) -> tuple[JobState, RankState] | None:
        """The job and rank whose agent said it runs in pod ``namespace/pod`` (Hello.pod;
        an agent that gave no namespace matches any)."""
        for ns in (namespace, ""):
            got = self._pods.get((ns, pod))
            if got is None:
                continue
            j = self.jobs.get(got[0])
            rs = j.ranks.get(got[1]) if j is not None else None
            if j is not None and rs is not None and rs.pod == pod:
                return j, rs
            del self._pods[(ns, pod)]
        return None

    def add_decision_listener(self, fn: DecisionListener) -> None:
        """Call ``fn(job, decision, now)`` after each executed decision, on the loop, once
        the agents' commands are queued. Kubernetes actions (cordon, delete, Events) plug in
        here so that the registry never imports them; ``fn`` must not block (hand I/O to a
        thread) and its exceptions are logged, never raised."""
        self._listeners.append(fn)

    def fault_kind(self, job: JobState, fault_id: str) -> str:
        """The kind (``model.FaultKind`` value) of a fault the job saw, "" if unknown."""
        got = self.stats.get((job.namespace, job.job))
        seen = got[1].faults.get(fault_id) if got is not None and got[0] is job else None
        return seen[1] if seen else ""

    def _index(self, key: tuple[str, str], rs: RankState) -> None:
        if rs.pod:
            self._pods[(key[0], rs.pod)] = (key, rs.rank)
        if rs.node:
            self._nodes.setdefault(rs.node, set()).add((key, rs.rank))

    def _unindex(self, key: tuple[str, str]) -> None:
        """Drop a forgotten job's pods and nodes from the indexes (once per job)."""
        self._pods = {k: v for k, v in self._pods.items() if v[0] != key}
        for node in list(self._nodes):
            self._nodes[node] = {v for v in self._nodes[node] if v[0] != key}
            if not self._nodes[node]:
                del self._nodes[node]

    # ------------------------------------------------------------------ status

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
        out: dict[tuple[str, str], JobState | JobRecord] = dict(self.history.past)
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
                recomputed_steps=job.goodput_steps, incidents=job.goodput_restarts))
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
            barrier=barrier.barrier_summary(job, now), busy=job.busy)
        got = self.stats.get((job.namespace, job.job))
        led = got[1].ledger if got is not None and got[0] is job else None
        if led is not None:
            info.goodput.CopyFrom(_goodput_pb(led.breakdown(now)))
        if not ranks:
            return info
        stragglers = set(self.stragglers_of(job))
        for r in sorted(job.ranks.values(), key=lambda r: r.rank):
            age = r.progress_age(now)
            shown = f"{r.state} (straggler)" if r.rank in stragglers else r.state
            ri = info.ranks.add(
                rank=r.rank, pod=r.pod, node=r.node, connected=r.connected, state=shown,
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

    # ------------------------------------------------------------------ helpers

    def _lookup(self, conn: Connection) -> tuple[JobState | None, RankState | None]:
        job = self.jobs.get(conn.key) if conn.key is not None else None
        rs = job.ranks.get(conn.rank) if job is not None else None
        if rs is None or rs.conn is not conn:  # superseded by a newer stream of the rank
            return job, None
        return job, rs

    def _note(self, job: JobState, now: float, kind: str, message: str, *,
              rank: int | None = None, fault_id: str = "", action: str = "") -> None:
        self.timeline.add(now, job.job, job.namespace, job.generation, kind, message,
                          rank=rank, fault_id=fault_id, action=action)
        self.history.update(job, self._stats(job), now)

    def _stats(self, job: JobState) -> JobStats:
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

    def _ledger(self, job: JobState, now: float, generation: int = -1,
                midway: bool = False) -> Ledger:
        """The job's goodput ledger (ledger.py), started at its first registration, or
        continued from its record after an arbiter restart: the time since the record
        was written goes where time went then if the agents' generation is the record's
        (the job went on as it was), else it is unattributed."""
        s = self._stats(job)
        if s.ledger is None:
            carried, rec = None, s.carried
            if rec is not None:
                carried = dict(rec.goodput)
                gap = rec.goodput_mode if generation == rec.generation else "unattributed"
                carried[gap] = carried.get(gap, 0.0) + max(0.0, now - rec.last_seen)
            s.ledger = Ledger(now, job.world_size, carried, midway=midway,
                              carried_steps=rec.goodput_steps if rec else 0,
                              carried_restarts=rec.goodput_restarts if rec else 0)
            s.carried = None
        return s.ledger

    def waiting_for_capacity(self, namespace: str, job: str, waiting: bool,
                             now: float) -> None:
        """The Kubernetes side (kube/cluster.py, every tick while a REPLACE waits for its
        pod): a pod of ``job`` is Pending without a node (``waiting``) or none is. The
        ledger places that time in ``capacity`` instead of ``decision``."""
        j = self.jobs.get((namespace, job))
        if j is not None and not j.finished:
            self._ledger(j, now).capacity(waiting, now)

    def _ledger_fault(self, job: JobState, rs: RankState | None, fault: Fault,
                      now: float) -> None:
        """A fault's onset (a hang: the rank's last step) and detection, for the ledger;
        the agent's clock is not trusted beyond the ledger's clamping and ``now``."""
        detected = min(fault.detected_at, now)
        onset = detected
        if fault.kind is FaultKind.HANG:
            last = rs.last_step_at if rs is not None else min(
                (r.last_step_at for r in job.ranks.values() if r.last_step_at is not None),
                default=None)
            onset = min(last, detected) if last is not None else detected
        self._ledger(job, now).fault(fault.id, fault.kind.value, onset, detected)

    def _ledger_decision(self, job: JobState, d: Decision, now: float) -> None:
        led = self._ledger(job, now)
        if d.verdict in (Verdict.RESTART, Verdict.REPLACE):
            led.restart(d.generation, now, fault_id=d.fault_id)
        elif d.verdict is Verdict.RELEASE_BARRIER and not d.targets:
            led.released(d.generation, now)
        elif d.verdict is Verdict.STOP and not d.targets:
            led.end(now)

    def _account(self, job: JobState, d: Decision, now: float) -> None:
        """Restarts by fault kind; seconds from a fault to every rank training again."""
        s = self._stats(job)
        self._ledger_decision(job, d, now)
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

    def job_snapshots(self) -> list[JobSnapshot]:
        """Every job the registry holds, live and past, for the exporter (on the loop)."""
        out = []
        for j in self.listing():
            if isinstance(j, JobState):
                got = self.stats.get((j.namespace, j.job))
                s = got[1] if got is not None and got[0] is j else JobStats()
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
                                       tuple(gp.items()), ratio))
            else:
                wall = sum(j.goodput.values())
                out.append(JobSnapshot(j.job, j.namespace, j.phase if j.finished else "gone",
                                       j.generation, j.restarts, dict(j.restarts_by_reason),
                                       j.seconds_lost, j.world_size, 0, 0,
                                       goodput=tuple(j.goodput.items()),
                                       goodput_ratio=j.goodput.get("productive", 0.0) / wall
                                       if wall > 0 else None))
        return out

    # ------------------------------------------------------------------ stragglers

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

    def _assess_stragglers(self, now: float) -> None:
        """Every running job's timings against its median; a finding is a STRAGGLER fault
        (a warning the policy records; see policy.decide_fault for --straggler-action)."""
        for key, (job, jt) in list(self.timings.items()):
            if self.jobs.get(key) is not job:
                del self.timings[key]
                continue
            if job.phase is not JobPhase.RUNNING:
                continue
            ranks = [r.rank for r in job.ranks.values()
                     if r.connected and not r.hung and r.generation == job.generation]
            for f in jt.assess_job(job.generation, ranks, now):
                fault = Fault(FaultKind.STRAGGLER, f.message, severity=Severity.WARNING,
                              scope=Scope.POD, evidence=f.evidence, detected_at=now)
                self.report_fault(job.namespace, job.job, fault, now, rank=f.rank)

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.agents_connected.set(self.connected)
            self.metrics.jobs.set(len(self.jobs))


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
        resume_source=i.resume_source if over else "")
