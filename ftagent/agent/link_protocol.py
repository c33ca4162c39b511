"""The agent's end of the arbiter protocol, without I/O: what it keeps, says and accepts.

``ArbiterLink`` (reporter.py) moves these messages over a gRPC stream; the protocol
simulation (tests/sim/) moves them over a simulated one. Both run this code, so what the
simulation proves about it holds for the agent.

What the agent tells the arbiter is the truth about itself, and only that: its rank, the
generation its trainer runs or waits for, the highest generation whose barrier it saw
released, whether a trainer of that generation runs now (not once the arbiter told it to
restart: ``Lifecycle.runs_generation``), its trainer state and its restart count -- all
read from the worker's lifecycle (lifecycle.py), their one owner: the link keeps no copy
of them. A link used alone (tests, the simulation) has a lifecycle its caller moves
(``running``, ``exited``), as a worker moves its own. It never takes the job's generation
from a Welcome: an agent that is behind is told to REJOIN, so it restarts into the job
instead of pretending to be there.

What must not be lost is kept until it is settled, and sent again on every new stream:

* a fault, until its FaultAck says ``final`` (decided, or ignored with a reason) or a
  command covers it (a RESTART to a later generation than the fault's, STOP, REPLACE);
  a non-final ack (stacks awaited, a link still down) keeps it for a successor arbiter;
* the barrier arrival, until that generation's barrier is released (or the agent starts
  without it, failing open);
* exits and stack dumps made while offline (a few, most recent kept);
* the trainer's last exit, until an arbiter confirmed reading it (``confirmed``: it ended
  a stream the agent had half-closed, so it read everything written on it) or the agent
  moved on (it arrives at the next barrier, which says the trainer exited, or starts a
  trainer). Handed to a stream is not read: an arbiter SIGKILLed before the agent noticed
  takes the exit written to it (or still queued) down with it, and a job whose ranks all
  exited 0 while it restarted was recorded "gone (was running)".

A warm spare (``--spare``) says so in its Hello and has no rank until the arbiter ASSIGNs it
one: the rank, the generation and the job's restart count go to the lifecycle
(``Lifecycle.assign``), and from then on the Hello, the events, the trainer and every
other part name that rank. An agent told SPARE (its rank is held by a former spare) becomes a
spare before it starts any trainer.

Commands are delivered at most once by id, and a RESTART only when it moves the agent to
a generation above the one it runs or waits for, as its lifecycle says (a stale or
repeated REJOIN never kills a trainer that already runs the job's generation; one
delivered while the worker is still carrying out the first is moot by the same rule,
lifecycle.moot). After STOP or REPLACE nothing more is delivered. Delivered means: the
rank's desired state moves, in its lifecycle (``Lifecycle.want``: the newest decision
replaces the one before; ``Lifecycle.release`` for a RELEASE), which wakes the worker --
no queue between the link and the worker (the worker compares desired with observed,
``Lifecycle.due``). ``Received.actions`` still lists what was delivered, for a link used
alone (tests, the node agent).

Events come in whole, one call each (``observe`` an exit, ``on_state`` a start,
``report_fault``, ``report_arrival``: from the worker's observers and the decider, not
through the shell), and what they say is posted in the outbox ``out`` (``post``), which
the shell (reporter.py) writes on the stream; the trainer's latest progress summary and
held snapshots are kept here, so that an exit or an arrival says them first. No I/O:
whether a stream is up, the writer's wake-up and the clock are injected.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ftagent.agent.lifecycle import Lifecycle
from ftagent.config import IdentityConfig
from ftagent.model import (
    Action,
    ActionKind,
    Fault,
    Observation,
    ProcessExit,
    Progress,
    TrainerState,
)
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import command_to_action, fault_to_proto, progress_to_proto

SEEN_COMMANDS = 256
KEPT_OFFLINE = 16  # exits and stacks made while offline
KEPT_FAULTS = 1024  # unsettled faults (oldest dropped first: a flood cannot grow memory)
KEPT_OUTCOMES = 256
SNAPSHOT_REPORT_INTERVAL = 0.2  # seconds between two SnapshotReports of one link


def _nothing() -> None:
    return None


def _never() -> bool:
    return False


@dataclass
class Received:
    """What one message from the arbiter asks of the agent."""

    send: list[pb.AgentMessage] = field(default_factory=list)  # acks to write back
    actions: list[Action] = field(default_factory=list)  # for the supervisor
    released: bool = False  # a barrier was released
    assigned: bool = False  # a spare was given a rank, or this agent was made a spare
    settled: list[tuple[str, str]] = field(default_factory=list)  # (fault id, outcome)


class LinkProtocol:
    """See the module docstring. Besides the messages it returns (the simulation moves
    those itself), the core takes the trainer's events whole -- its exit (``observe``),
    its start (``on_state``), a fault (``report_fault``), an arrival (``report_arrival``)
    -- and puts what they say in its outbox (``post``): the stream's ``out`` while one
    is up (``is_up``; ``wake`` wakes the shell's writer), else, when it must not be
    lost, ``later``. So each event is one call from the worker or the decider into the
    core, none through the shell (reporter.py), which only moves ``out`` over gRPC. The
    trainer's latest progress and its held snapshots are kept here too: an exit or an
    arrival says them first."""

    # what the worker hands it: its trainer's exit (watch/loop.py ``_route``) and start
    # (``Worker._apply``); the shell observes the rest (progress, timings)
    observes = (ProcessExit,)
    states = (TrainerState.RUNNING,)

    def __init__(self, identity: IdentityConfig, *, max_restarts: int | None = None,
                 version: str = "", alert_only: bool = False, instance: str = "",
                 lifecycle: Lifecycle | None = None,
                 wake: Callable[[], object] = _nothing, is_up: Callable[[], bool] = _never,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``lifecycle``: the worker's, read for its restart count and generation (a link
        used alone, without a worker, has a lifecycle nobody moves). ``is_up``: a stream
        is up (the shell's); ``wake``: something was put in ``out``; ``clock``:
        monotonic, for the snapshots' pace (none of them I/O: injected)."""
        self.identity = identity  # as configured: the rank and spare flag are the lifecycle's
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle(
            rank=identity.rank, spare=identity.spare)
        self.max_restarts = max_restarts
        self.version = version
        self.alert_only = alert_only
        self.instance = instance or uuid.uuid4().hex
        self.arbiter_id = ""
        self.faults: OrderedDict[str, pb.Fault] = OrderedDict()
        self.arrival: pb.BarrierArrival | None = None
        self.preflight_seconds = 0.0  # the last preflight's, said with the next arrival
        self.later: deque[pb.AgentMessage] = deque(maxlen=KEPT_OFFLINE)
        self.last_exit: pb.AgentMessage | None = None  # until confirmed read, or moved on
        self.outcomes: OrderedDict[str, str] = OrderedDict()  # settled faults' outcomes
        self._seen_commands: OrderedDict[str, None] = OrderedDict()
        self.final_delivered = False
        self.delivered = 0  # commands delivered (the decision watchdog: "one came")
        self.assigned = False  # this spare was ASSIGNed a rank (the lifecycle holds it)
        # the peer replica (checkpoint/replica_agent.py): the port this agent's holder
        # listens on (said in Hello), and what the arbiter said: the job's replica key and
        # where this rank's replica is kept ("HOST:PORT")
        self.replica_port: int = 0
        self.replica_key: bytes = b""
        self.replica_peer: str = ""
        # the outbox (``post``): written on the stream by the shell, in order
        self.out: deque[pb.AgentMessage] = deque()
        self.wake, self.is_up, self.clock = wake, is_up, clock
        # the trainer's latest progress summary, not yet sent (``progress_new``), and the
        # pace of summaries (the shell's writer sends one per interval)
        self.progress_summary: pb.ProgressSummary | None = None
        self.progress_new = False
        self.progress_sent_at = -1e9
        self.first_step_due = False  # the generation's first progress is not reported yet
        # the steps whose snapshot the trainer holds complete (None: it never said)
        self.snapshots: tuple[int, ...] | None = None
        self.snapshots_due = False
        self.snapshots_sent_at = -1e9
        # the trainer now starting was released by the barrier (False: failing open): the
        # decider says so at the barrier, the core tells the arbiter when it runs
        self.released_start = False
        self.starts = 0  # trainers started (what the trainer said is of the last one)

    @property
    def generation(self) -> int:
        """The generation this agent's trainer runs or waits for (the lifecycle's)."""
        return self.lifecycle.generation

    @property
    def released_generation(self) -> int:
        """The highest generation whose barrier the arbiter released (the lifecycle's:
        part of the rank's desired state)."""
        return self.lifecycle.released

    @property
    def spare(self) -> bool:
        """A warm spare: no rank until ASSIGNed one (the lifecycle's)."""
        return self.lifecycle.spare

    @property
    def trainer_state(self) -> str:
        """The trainer's state for status: the lifecycle's, or "spare"."""
        return "spare" if self.lifecycle.spare else self.lifecycle.state.value

    @property
    def assignment(self) -> tuple[int, int, int] | None:
        """(rank, generation, restart count) once ASSIGNed, as the lifecycle has them."""
        life = self.lifecycle
        return (life.rank, life.generation, life.restarts) if self.assigned else None

    # ------------------------------------------------------------------ agent -> arbiter

    def hello(self) -> pb.Hello:
        i = self.identity
        h = pb.Hello(job=i.job, namespace=i.namespace, pod=i.pod, node=i.node,
                     rank=self.lifecycle.rank,
                     world_size=i.world_size, restart_count=self.lifecycle.restarts,
                     generation=self.generation, agent_version=self.version,
                     alert_only=self.alert_only, state=self.trainer_state,
                     agent_instance=self.instance,
                     trainer_running=self.lifecycle.runs_generation,
                     gpus=i.gpus, spare=self.spare, replica_port=self.replica_port)
        if self.released_generation >= 0:
            h.released_generation = self.released_generation
        if self.max_restarts is not None:
            h.max_restarts = self.max_restarts
        return h

    def on_welcome(self, w: pb.Welcome) -> list[pb.AgentMessage]:
        """A new stream is up: what to send first (unsettled faults, the arrival, later)."""
        self.arbiter_id = w.arbiter_id
        self._replica(w.replica_key, w.replica_peer)
        out = [pb.AgentMessage(fault=f) for f in self.faults.values()]
        if self.arrival is not None:
            out.append(pb.AgentMessage(arrival=self.arrival))
        out.extend(self.later)
        if self.last_exit is not None and not any(m is self.last_exit for m in self.later):
            out.append(self.last_exit)  # handed to a stream that broke: maybe never read
        self.later.clear()
        return out

    def confirmed(self) -> None:
        """An arbiter read everything written on a stream (it ended the stream the agent
        had half-closed): the last exit has been heard."""
        self.last_exit = None

    def fault(self, fault: Fault, generation: int | None = None,
              exit_status: int | None = None) -> pb.AgentMessage:
        """Keep ``fault`` until settled; the message to send now."""
        if exit_status is None and isinstance(fault.evidence.get("exit_status"), int):
            exit_status = fault.evidence["exit_status"]
        msg = fault_to_proto(fault, self.generation if generation is None else generation,
                             exit_status)
        self.faults[fault.id] = msg
        while len(self.faults) > KEPT_FAULTS:
            self.faults.popitem(last=False)
        return pb.AgentMessage(fault=msg)

    def progress(self, p: Progress, seconds_since_progress: float, hung: bool,
                 ts: float) -> pb.ProgressSummary:
        return progress_to_proto(p, seconds_since_progress, hung, ts)

    def exit(self, exit: ProcessExit, generation: int) -> pb.AgentMessage:
        msg = pb.TrainerExit(generation=generation)
        if exit.code is not None:
            msg.exit_code = exit.code
        if exit.signal is not None:
            msg.signal = exit.signal
        self.last_exit = pb.AgentMessage(exit=msg)
        return self.last_exit

    def arrive(self, generation: int) -> pb.AgentMessage | None:
        """The previous trainer has exited; ready to start ``generation``. None when that
        barrier was released already (nothing to wait for)."""
        if generation > self.lifecycle.generation:  # the worker's is there already:
            self.lifecycle.reached(generation)  # moved only for a link used alone
        self.last_exit = None  # the arrival says the previous trainer exited
        if generation <= self.released_generation:
            return None
        self.arrival = pb.BarrierArrival(generation=generation, previous_trainer_exited=True,
                                         preflight_seconds=self.preflight_seconds)
        return pb.AgentMessage(arrival=self.arrival)

    def started(self, generation: int, *, released: bool) -> None:
        """A trainer of ``generation`` runs now (its lifecycle says so: ``running``);
        ``released`` False: failing open."""
        if generation > self.lifecycle.generation:  # as in ``arrive``
            self.lifecycle.reached(generation)
        self.last_exit = None
        if not released:
            self.arrival = None  # not waiting any more: the Hello tells the arbiter why

    # ------------------------------------------------------------------ the events, posted

    def post(self, msg: pb.AgentMessage, *, keep: bool = False) -> None:
        """Out on the stream now; while none is up, kept for the next one if ``keep``."""
        if self.is_up():
            self.out.append(msg)
            self.wake()
        elif keep:
            self.later.append(msg)

    def observe(self, obs: Observation) -> None:
        """The trainer's exit (``observes``), of the generation its lifecycle names."""
        if isinstance(obs, ProcessExit):
            self.report_exit(obs, self.lifecycle.generation)

    def on_state(self, state: TrainerState, restarts: int) -> None:
        """A trainer runs (``states``: the only step told; whether one runs is the
        lifecycle's, read for the Hello)."""
        if state is TrainerState.RUNNING:
            self.start(self.lifecycle.generation, released=self.released_start)

    def report_exit(self, exit: ProcessExit, generation: int) -> None:
        """The trainer exited: its held snapshots and last progress go first (a summary
        is due only every interval, and the arbiter should show the step the trainer
        ended at), then the exit; all kept for the next stream while none is up.
        Progress read after this (its pipe's last lines) goes at once too (the shell's
        ``report_progress`` reads ``Lifecycle.trainer_ended``)."""
        self.flush_progress()
        self.post(self.exit(exit, generation), keep=True)

    def report_fault(self, fault: Fault, generation: int | None = None,
                     exit_status: int | None = None) -> None:
        """Send ``fault`` (now or on the next stream) until the arbiter settles it."""
        self.post(self.fault(fault, generation, exit_status))

    def report_arrival(self, generation: int) -> None:
        """At the barrier of ``generation`` (``arrive``), re-sent on every stream until
        released. The stopped trainer's snapshots and last progress go first, as with an
        exit: the goodput ledger counts the steps a restart redoes from the step the old
        generation had reached."""
        self.flush_progress()
        msg = self.arrive(generation)
        if msg is not None:
            self.post(msg)

    def start(self, generation: int, *, released: bool) -> None:
        """A trainer of ``generation`` runs (``started``). Its first progress is sent at
        once, not coalesced: the arbiter's goodput ledger takes the generation's first
        step as where it resumed and when it trains again."""
        self.started(generation, released=released)
        self.starts += 1
        self.progress_sent_at = -1e9
        self.first_step_due = True

    def flush_progress(self) -> None:
        """The held snapshots (if changed) and the latest progress not yet sent: before
        an exit or an arrival, which a restart decision follows."""
        self.flush_snapshots(force=True)
        if self.progress_summary is not None and self.progress_new:
            self.progress_new = False
            self.post(pb.AgentMessage(progress=self.progress_summary), keep=True)

    def flush_snapshots(self, *, force: bool = False) -> None:
        """The held snapshots, if they changed since they were last sent (and it is time,
        unless ``force``)."""
        if self.snapshots is None or not self.snapshots_due:
            return
        now = self.clock()
        if not force and now - self.snapshots_sent_at < SNAPSHOT_REPORT_INTERVAL:
            return
        self.snapshots_due, self.snapshots_sent_at = False, now
        self.post(pb.AgentMessage(snapshots=pb.SnapshotReport(steps=self.snapshots)),
                  keep=True)

    # ------------------------------------------------------------------ arbiter -> agent

    def on_message(self, m: pb.ArbiterMessage) -> Received:
        got = Received()
        body = m.WhichOneof("body")
        if body == "fault_ack":
            a = m.fault_ack
            if a.final and self.faults.pop(a.fault_id, None) is not None:
                self._settle(got, a.fault_id, a.outcome or "decided")
        elif body == "command":
            self._command(m.command, got)
        return got

    def _replica(self, key: bytes, peer: str) -> None:
        """The arbiter's replica key (32 bytes) and this rank's holder, when it says them."""
        if len(key) == 32:
            self.replica_key = key
        if peer and len(peer) <= 300:
            self.replica_peer = peer

    def _command(self, cmd: pb.Command, got: Received) -> None:
        got.send.append(pb.AgentMessage(ack=pb.Ack(command_id=cmd.id)))
        self._replica(b"", cmd.replica_peer)
        if cmd.id in self._seen_commands:
            return
        self._seen_commands[cmd.id] = None
        while len(self._seen_commands) > SEEN_COMMANDS:
            self._seen_commands.popitem(last=False)
        if cmd.kind == pb.COMMAND_KIND_ASSIGN:
            r = cmd.target_rank
            if self.spare and not self.assigned and cmd.HasField("target_rank") and \
                    0 <= r < self.identity.world_size and not self.final_delivered:
                self.lifecycle.assign(r, cmd.generation,
                                      cmd.restarts if cmd.HasField("restarts") else None)
                self.assigned = True
                got.assigned = True
            return
        if cmd.kind == pb.COMMAND_KIND_SPARE:
            if not self.lifecycle.runs_generation and not self.final_delivered and \
                    not self.spare:
                self.lifecycle.make_spare()
                got.assigned = True
            return
        if cmd.kind == pb.COMMAND_KIND_RELEASE_BARRIER:
            self.lifecycle.release(cmd.generation)
            if self.arrival is not None and self.arrival.generation <= cmd.generation:
                self.arrival = None
            got.released = True
            return
        action = command_to_action(cmd)
        if action is None or self.final_delivered:
            return
        if action.kind is ActionKind.RESTART:
            if cmd.generation <= self.lifecycle.generation:
                return  # already there (a repeated or stale REJOIN): nothing to restart
            # (the job's count it carries is the lifecycle's to adopt, Action.restarts).
            # Once wanted, the Hello says no trainer runs: the one still being stopped is
            # not of the generation the rank is headed for (Lifecycle.runs_generation)
            self._cover(got, lambda f: f.generation < cmd.generation,
                        f"covered by the restart to generation {cmd.generation}")
        elif action.kind in (ActionKind.STOP, ActionKind.REPLACE):
            self.final_delivered = True
            self._cover(got, lambda f: True, f"covered by {action.kind.value}")
        self.delivered += 1
        got.actions.append(action)
        self.lifecycle.want(action)  # the rank's desired state: wakes its worker

    def _cover(self, got: Received, covered: object, outcome: str) -> None:
        assert callable(covered)
        for fid in [fid for fid, f in self.faults.items() if covered(f)]:
            del self.faults[fid]
            self._settle(got, fid, outcome)

    def _settle(self, got: Received, fault_id: str, outcome: str) -> None:
        got.settled.append((fault_id, outcome))
        self.outcomes[fault_id] = outcome
        while len(self.outcomes) > KEPT_OUTCOMES:
            self.outcomes.popitem(last=False)
