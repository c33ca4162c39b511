"""The arbiter's registry: jobs -> ranks -> agent connections, as one facade.

The server (server.py), the cluster (kube/cluster.py) and the tests call this class; it
holds the parts, each with one job, and routes to them:

- ``connection.py``: one agent's stream (an outbox its writer drains); ``commands.py``:
  a decision's command queued on its targets' streams, re-sent on reconnect.
- ``jobs.py``: job state -- Hellos, progress, arrivals, exits and decisions, each a change
  ``state.apply`` makes (the one place a job changes), then published to the observers
  subscribed to its kind; ``execute`` carries decisions out. It reads the agents'
  messages itself: ``Registry.handle`` is ``Jobs.handle``, no step between.
- ``intake.py``: faults no agent sent -- from node agents, the cluster and comparing
  ranks (stragglers) -- decided by the policy (``policy.py``) as an agent's fault is in
  ``jobs.py`` (with a hang probe's stacks: read where the message is read).
- ``journal.py``: timeline, history, counters and the goodput ledger's feed: an observer
  of the applied changes (nothing calls it to write).
- ``nodemap.py``: which ranks run on a node, in a pod (the cluster's hooks).
- ``readout.py``: status and the exporter's view.

It runs on the server's event loop only (no locks) and never blocks: a command to 10k
ranks is one serialisation and 10k queue puts; each stream's writer drains its own queue.
After an arbiter restart nothing is pending: agents' Hellos (generation, restart count,
released generation) rebuild what matters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from ftagent.arbiter import policy
from ftagent.arbiter.connection import Connection, FanOut, Outgoing, Reject
from ftagent.arbiter.history import History, JobRecord
from ftagent.arbiter.intake import STRAGGLER_EVERY, Intake
from ftagent.arbiter.jobs import DecisionListener, Jobs
from ftagent.arbiter.journal import JobStats, Journal
from ftagent.arbiter.readout import Readout
from ftagent.arbiter.state import (
    CapacityWait,
    Decision,
    JobState,
    RankState,
)
from ftagent.arbiter.straggler import JobTimings
from ftagent.arbiter.timeline import Timeline
from ftagent.metrics import ArbiterMetrics, JobSnapshot
from ftagent.model import Fault
from ftagent.v1 import ftagent_pb2 as pb

__all__ = ["FORGET_AFTER", "MAX_RANKS_PER_JOB", "RESTART_CEILING", "STRAGGLER_EVERY",
           "Connection", "DecisionListener", "FanOut", "Outgoing", "Registry", "Reject"]

# Seconds a job with no agent left keeps its live state (a Hello continues it); then
# only its history record is kept, until --history-retention after its last agent left.
FORGET_AFTER = 3600.0
# Seconds between two looks for exit notes agents left in --state-dir (wire/exit_note.py).
EXIT_NOTES_EVERY = 2.0
# Defaults of --restart-ceiling and --max-ranks-per-job: what one job's agents may ask for.
RESTART_CEILING = 100
MAX_RANKS_PER_JOB = 100_000


class Registry:
    def __init__(self, cfg: policy.PolicyConfig, timeline: Timeline,
                 metrics: ArbiterMetrics | None, arbiter_id: str,
                 clock: Callable[[], float] = time.time,
                 history: History | None = None, *, restart_ceiling: int = RESTART_CEILING,
                 max_ranks_per_job: int = MAX_RANKS_PER_JOB) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.arbiter_id = arbiter_id
        self.clock = clock
        self.journal = Journal(timeline, history or History(), clock)
        self._jobs = Jobs(cfg, self.journal.history, metrics, arbiter_id, clock,
                          restart_ceiling=restart_ceiling, max_ranks_per_job=max_ranks_per_job)
        self._jobs.subscribe(self.journal.observe, Journal.OBSERVES)
        self.intake = Intake(self._jobs, clock)
        self._jobs.intake = self.intake
        # One message after Hello (the server's stream reader); ``received`` is
        # time.monotonic() at arrival. The jobs' own reader (``Jobs.handle``), not a
        # delegation to it: a message goes from the server to the part it changes.
        self.handle: Callable[[Connection, pb.AgentMessage, float], None] = \
            self._jobs.handle
        self._exit_notes_at = 0.0
        self.readout = Readout(self._jobs.jobs, self.journal, self.intake.stragglers_of,
                               clock)

    # ------------------------------------------------------------------ the parts' state

    @property
    def jobs(self) -> dict[tuple[str, str], JobState]:
        return self._jobs.jobs

    @property
    def connected(self) -> int:
        return self._jobs.connected

    @property
    def timeline(self) -> Timeline:
        return self.journal.timeline

    @property
    def history(self) -> History:
        return self.journal.history

    @property
    def stats(self) -> dict[tuple[str, str], tuple[JobState, JobStats]]:
        return self.journal.stats

    @property
    def timings(self) -> dict[tuple[str, str], tuple[JobState, JobTimings]]:
        return self.intake.timings

    @property
    def restart_ceiling(self) -> int:
        return self._jobs.restart_ceiling

    @property
    def max_ranks_per_job(self) -> int:
        return self._jobs.max_ranks_per_job

    @property
    def pod_alive(self) -> Callable[[str, str, str], bool]:
        """Is the pod with this uid still there (namespace, pod, uid)? Plugged in by the
        cluster (its pod watch); without one a pod's rank stays its own."""
        return self._jobs.pod_alive

    @pod_alive.setter
    def pod_alive(self, fn: Callable[[str, str, str], bool]) -> None:
        self._jobs.pod_alive = fn

    # ------------------------------------------------------------------ agent messages

    def hello(self, conn: Connection, h: pb.Hello) -> None:
        """Register ``conn`` as (job, rank); queue Welcome and what the rank missed.

        Raises ``Refused`` (the stream is closed with its status code) for a bad identity,
        a value out of range, or a rank already held by another live agent.
        """
        self._jobs.hello(conn, h)

    def disconnect(self, conn: Connection) -> None:
        self._jobs.disconnect(conn)

    def owner_of(self, namespace: str, job: str, rank: int) -> tuple[str, str] | None:
        """(pod, uid) that owns ``rank`` of the job by the arbiter's record (a live job's,
        else its history record's): a spare ASSIGNed the rank owns it although its pod's
        labels name another index."""
        key = (namespace, job)
        j = self.jobs.get(key)
        return j.owners.get(rank) if j is not None else self.history.owners(key).get(rank)

    def execute(self, job: JobState, decisions: Iterable[Decision], now: float,
                received: float | None = None) -> None:
        """Apply each decision, record it, and queue its commands on the ranks' streams;
        then tell the decision listeners (the agents' commands are queued first)."""
        self._jobs.execute(job, decisions, now, received)

    def tick(self) -> None:
        """Deadlines (stacks, links, barriers) and forgetting jobs nobody runs any more."""
        now = self.clock()
        self.journal.flush(now)
        if now >= self._exit_notes_at:
            self._exit_notes_at = now + EXIT_NOTES_EVERY
            self._exit_notes(now)
        self.intake.assess_stragglers(now)
        for key, job in list(self.jobs.items()):
            self._jobs.execute(job, policy.decide_tick(job, now, self.cfg), now)
            if job.connected == 0 and now - job.last_seen > min(FORGET_AFTER,
                                                                 self.history.retention):
                self.timings.pop(key, None)
                self._jobs.forget(key, job)
            elif key in self.history.past:  # a job of the history runs again
                self.journal.stats_of(job)
        for namespace, name in self.history.expired(now):
            self.history.drop(namespace, name)

    def _exit_notes(self, now: float) -> None:
        """Exits agents left in --state-dir while no arbiter heard them (exit_note.py)."""
        by_job: dict[tuple[str, str], dict[int, tuple[int | None, int]]] = {}
        for n in self.history.take_exits():
            by_job.setdefault((n.namespace, n.job), {})[n.rank] = (n.generation, n.status)
        for (namespace, name), exits in by_job.items():
            self._jobs.exits_seen(namespace, name, exits, "the exit notes its agents left",
                                  now)

    def exits_seen(self, namespace: str, job: str, exits: Mapping[int, int], via: str,
                   now: float | None = None) -> bool:
        """The cluster's pod watch: ranks' exit statuses read from their pods' terminal
        status (rank -> status), for ranks whose agent is not connected; a job of the
        history that did not finish is taken live to hear them (jobs.exits_seen).
        Returns whether the job is over or unknown (nothing more to read for it)."""
        return self._jobs.exits_seen(namespace, job, {r: (None, s) for r, s in exits.items()},
                                     via, self.clock() if now is None else now)

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
        return self.intake.report(namespace, job, fault, now, rank, generation)

    def node_report(self, req: pb.NodeReport) -> pb.NodeReportAck:
        """A node agent's (checked, authorized) report: each fault decided for the jobs
        with ranks on its node (intake.node_report)."""
        return self.intake.node_report(req, self.arbiter_id)

    def ranks_on_node(self, node: str) -> list[tuple[JobState, RankState]]:
        """Every live job's ranks whose agent said it runs on ``node`` (Hello.node)."""
        return self._jobs.nodes.ranks_on_node(node)

    def rank_of_pod(self, namespace: str, pod: str) -> tuple[JobState, RankState] | None:
        """The job and rank whose agent said it runs in pod ``namespace/pod`` (Hello.pod;
        an agent that gave no namespace matches any)."""
        return self._jobs.nodes.rank_of_pod(namespace, pod)

    def add_decision_listener(self, fn: DecisionListener) -> None:
        """Call ``fn(job, decision, now)`` after each executed decision, on the loop, once
        the agents' commands are queued. Kubernetes actions (cordon, delete, Events) plug in
        here so that the registry never imports them; ``fn`` must not block (hand I/O to a
        thread) and its exceptions are logged, never raised."""
        self._jobs.listeners.append(fn)

    def waiting_for_capacity(self, namespace: str, job: str, waiting: bool,
                             now: float) -> None:
        """The Kubernetes side (kube/cluster.py, every tick while a REPLACE waits for its
        pod): a pod of ``job`` is Pending without a node (``waiting``) or none is. The
        ledger places that time in ``capacity`` instead of ``decision``."""
        j = self.jobs.get((namespace, job))
        if j is not None and not j.finished:
            self._jobs.apply(j, CapacityWait(waiting), now)

    def record(self, job: JobState, kind: str, message: str, now: float, *,
               rank: int | None = None, fault_id: str = "") -> None:
        """A fact the cluster saw for the job's timeline that changes nothing (a planned
        node event, a cordon not made and why): applied as ``state.Noted``, so that the
        journal stays the one writer of the timeline."""
        self._jobs.record(job, kind, message, now, rank=rank, fault_id=fault_id)

    def fault_kind(self, job: JobState, fault_id: str) -> str:
        """The kind (``model.FaultKind`` value) of a fault the job saw, "" if unknown."""
        return self.journal.fault_kind(job, fault_id)

    # ------------------------------------------------------------------ status

    def find(self, name: str, namespace: str) -> JobState | None:
        return self.readout.find(name, namespace)

    def find_any(self, name: str, namespace: str) -> JobState | JobRecord | None:
        """A live job, else one from the history (same rules as ``find``)."""
        return self.readout.find_any(name, namespace)

    def listing(self) -> list[JobState | JobRecord]:
        """Live jobs and the history's past ones, by (namespace, job)."""
        return self.readout.listing()

    def info(self, job: JobState | JobRecord, *, ranks: bool,
             timeline_limit: int = 0) -> pb.JobInfo:
        return self.readout.info(job, ranks=ranks, timeline_limit=timeline_limit)

    def job_info(self, job: JobState, *, ranks: bool, timeline_limit: int = 0) -> pb.JobInfo:
        return self.readout.job_info(job, ranks=ranks, timeline_limit=timeline_limit)

    def job_snapshots(self) -> list[JobSnapshot]:
        """Every job the registry holds, live and past, for the exporter (on the loop)."""
        return self.readout.job_snapshots()

    def stragglers_of(self, job: JobState) -> list[int]:
        """Ranks named stragglers and still slow (status, the exporter)."""
        return self.intake.stragglers_of(job)
