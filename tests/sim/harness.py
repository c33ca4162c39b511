"""A deterministic world for the agent <-> arbiter protocol: real logic, simulated wire.

What is real: the arbiter's ``Registry`` (with its policy and barrier), the agent's
``LinkProtocol`` (what it keeps, sends and accepts), its ``Lifecycle`` (the one owner of
generation and restart count) and its local policy (``local_policy.decide``), the proto
messages serialised as on the wire. What is simulated: the streams (ordered queues that
a break empties), the clock, and the supervisor around each link, a small model of the
agent with its ``ArbiterDecider`` (agent/arbiter_decider.py): it arrives at the barrier,
starts on release or fails open after ``FAIL_OPEN`` seconds offline, stops its trainer on
RESTART, defers a crash to the arbiter and decides locally when the arbiter stays away,
exits on STOP/REPLACE.

The checks are the protocol's promises (ftagent/arbiter/barrier.py, DESIGN.md):

* ``check_safety`` after every step: no trainer started through a barrier runs beside
  one of another generation; one fault never leads to restarts into two generations;
  the budget is never exceeded by fault-driven restarts.
* Identity (issue 20): every stream carries a verified pod (its uid, as a TokenReview
  would give it) and each Hello passes the server's check against the pod as the watch
  sees it (``auth.identity_problem``); ``impostor`` plays a pod of the job that claims
  another rank, pod or node and then reports a fatal fault. ``check_safety`` also checks
  that no impostor was ever welcomed, no decision ever followed an impostor's fault, and
  every registered rank still belongs to its own agent's pod.
* ``heal_and_check`` at the end: once every agent can reach the arbiter and time passes,
  the job trains again (every rank runs one generation) or stops with a reason, and no
  running agent still holds an unsettled fault. As in a real job, a trainer whose peers
  do not all train with it stops progressing, and its agent reports a hang.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from ftagent.agent.lifecycle import Lifecycle
from ftagent.agent.link_protocol import LinkProtocol
from ftagent.agent.local_policy import decide
from ftagent.arbiter.auth import PodFacts, Principal, identity_problem
from ftagent.arbiter.history import History, JobRecord, Loaded
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry, Reject
from ftagent.arbiter.state import JobPhase
from ftagent.arbiter.timeline import Entry, Timeline
from ftagent.config import IdentityConfig
from ftagent.model import Action, ActionKind, Fault, FaultKind, ProcessExit
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.checks import Refused

FAIL_OPEN = 15.0
BARRIER_TIMEOUT = 120.0
STACKS_TIMEOUT = 10.0
HANG_AFTER = 30.0  # seconds of a broken job before a running trainer reports a hang
JOB = "sim"


class Phase(enum.Enum):
    WAITING = "waiting"  # at the barrier of `generation`
    RUNNING = "running"  # a trainer of `generation` runs
    DEAD = "dead"  # the trainer crashed; a decision is awaited
    EXITED = "exited"  # the agent exited (STOP, REPLACE, budget spent)


@dataclass
class Stream:
    conn: Connection
    up: deque[pb.AgentMessage] = field(default_factory=deque)
    welcomed: bool = False


class SimAgent:
    """The supervisor's side of the agent and its ArbiterDecider, reduced to what the
    protocol sees."""

    def __init__(self, world: World, rank: int) -> None:
        self.world = world
        self.rank = rank
        # the shipped lifecycle (agent/lifecycle.py) owns rank, generation, restarts and
        # the trainer's state; the link reads them (its Hello, its RESTART dedup), as the
        # agent's does
        self.lifecycle = Lifecycle(clock=lambda: world.now, rank=rank)
        self.proto = LinkProtocol(IdentityConfig(job=JOB, rank=rank, world_size=world.size,
                                                 pod=f"pod-{rank}", node=f"node-{rank}"),
                                  max_restarts=world.budget, version="sim",
                                  instance=f"agent-{rank}", lifecycle=self.lifecycle)
        self.phase = Phase.WAITING
        self.started_released = False
        self.exit_code: int | None = None
        self.undecided: Fault | None = None
        self.stream: Stream | None = None
        self.offline_since: float | None = world.now
        self.actions: deque[Action] = deque()
        self.proto.arrive(0)

    @property
    def generation(self) -> int:
        return self.lifecycle.generation

    @property
    def restarts(self) -> int:
        return self.lifecycle.restarts

    # ------------------------------------------------------------------ link state

    @property
    def connected(self) -> bool:
        return self.stream is not None and self.stream.welcomed

    def offline_for(self) -> float:
        return 0.0 if self.offline_since is None else self.world.now - self.offline_since

    def still_online(self) -> bool:
        return self.connected or self.offline_for() < FAIL_OPEN

    def send(self, msg: pb.AgentMessage | None, *, keep: bool = False) -> None:
        if msg is None:
            return
        if self.connected:
            assert self.stream is not None
            self.stream.up.append(msg)
        elif keep:
            self.proto.later.append(msg)

    # ------------------------------------------------------------------ trainer events

    def crash(self) -> None:
        if self.phase is not Phase.RUNNING:
            return
        self.phase = Phase.DEAD  # the lifecycle stays RUNNING until decided, as the worker's
        self.send(self.proto.exit(self.exited(ProcessExit(pid=1, code=3, signal=None)),
                                  self.generation), keep=True)
        self.report(Fault(FaultKind.CRASH, f"rank {self.rank} crashed",
                          evidence={"exit_status": 3}))

    def hang(self) -> None:
        if self.phase is not Phase.RUNNING or self.undecided is not None:
            return
        self.report(Fault(FaultKind.HANG, f"rank {self.rank} hung"))

    def report(self, fault: Fault) -> None:
        """ArbiterDecider.decide: to the arbiter, decided alone once failed open."""
        self.send(self.proto.fault(fault, self.generation))
        if self.still_online():
            self.undecided = fault
        else:
            self.decide_locally(fault)
        self.tick()

    def decide_locally(self, fault: Fault) -> None:
        """The shipped local policy (local_policy.decide) with --max-restarts = the job's
        budget, no backoff."""
        self.undecided = None
        action = decide(fault, restarts_done=self.restarts, max_restarts=self.world.budget,
                        backoff_base=0.0, backoff_cap=0.0)
        if action.kind is ActionKind.RESTART:
            gen = self.lifecycle.next_generation(action.kind)
            self.world.restarted_into.add(gen)
            self.restart(dataclasses.replace(action, generation=gen))
        else:
            self.exit(action.exit_code if action.exit_code is not None else 1)

    # ------------------------------------------------------------------ supervisor

    def restart(self, action: Action) -> None:
        """Stop the trainer (if any), then arrive at the barrier of the restart's
        generation (the lifecycle counts it, or adopts the arbiter's count)."""
        if self.phase is Phase.RUNNING:
            self.send(self.proto.exit(self.exited(ProcessExit(pid=1, code=None, signal=15)),
                                      self.generation), keep=True)
        self.lifecycle.restart(action)
        self.lifecycle.waiting()
        self.phase = Phase.WAITING
        self.send(self.proto.arrive(self.generation))

    def exited(self, exit_: ProcessExit) -> ProcessExit:
        """The trainer's exit, heard by its one owner first (the lifecycle: the link's
        Hello reads whether a trainer runs there), as the worker's is."""
        self.lifecycle.exited(exit_)
        return exit_

    def exit(self, code: int) -> None:
        """The agent ends (STOP, REPLACE, a budget spent): its trainer, if one runs, is
        stopped with it."""
        if self.lifecycle.trainer_running:
            self.exited(ProcessExit(pid=1, code=None, signal=15))
        self.phase = Phase.EXITED
        self.exit_code = code

    def start(self, released: bool) -> None:
        self.phase = Phase.RUNNING
        self.started_released = released
        self.lifecycle.running(1)
        self.proto.started(self.generation, released=released)

    def command(self, action: Action) -> None:
        """An action the link delivered (a command of the arbiter's)."""
        self.actions.append(action)

    def tick(self) -> None:
        """What the agent's loop does next, given what it has."""
        while self.actions and self.phase is not Phase.EXITED:
            a = self.actions.popleft()
            self.undecided = None  # _forward_commands: any command answers the wait
            if a.kind is ActionKind.RESTART:
                # A decision is never applied twice: a command only ever moves an agent up.
                assert not self.lifecycle.moot(a), (
                    f"rank {self.rank} at generation {self.generation} was told to restart "
                    f"into generation {a.generation}")
                self.restart(a)
            elif a.kind in (ActionKind.STOP, ActionKind.REPLACE):
                self.exit(a.exit_code if a.exit_code is not None else 1)
            elif a.kind is ActionKind.DUMP_STACKS:
                self.send(pb.AgentMessage(stacks=pb.Stacks(command_id=a.id, json="[]")),
                          keep=True)
        if self.phase is Phase.EXITED:
            return
        f = self.undecided
        if f is not None:
            if not self.still_online():
                self.decide_locally(f)
            elif self.proto.outcomes.get(f.id) is not None and not self.actions:
                self.undecided = None
                if f.kind is FaultKind.CRASH:
                    self.decide_locally(f)
        if self.phase is Phase.WAITING:
            if self.proto.released_generation >= self.generation:
                self.start(released=True)
            elif not self.still_online():
                self.start(released=False)


class KeptRecords:
    """What ``--state-dir`` keeps across an arbiter restart, in memory: each job's latest
    record, through its JSON form as history_file.FileHistory writes and reads it (so a
    field that does not survive the round trip does not survive here). Timeline entries
    are for status only and not kept."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], str] = {}

    def record(self, item: Entry | JobRecord) -> None:
        if isinstance(item, JobRecord):
            self.records[item.key] = json.dumps(item.to_json())

    def load(self) -> Loaded:
        return Loaded(jobs=[JobRecord.from_json(json.loads(r))
                            for r in self.records.values()])

    def forget(self, namespace: str, job: str) -> None:
        self.records.pop((namespace, job), None)

    def close(self) -> None:
        pass


class World:
    def __init__(self, size: int, budget: int,
                 agent: Callable[[World, int], SimAgent] = SimAgent) -> None:
        """``agent`` builds each rank's agent: this module's model of the supervisor and
        its decider, or decider_agent.py's, which drives the shipped ArbiterDecider."""
        self.size = size
        self.budget = budget
        self.now = 1_000_000.0
        self.cfg = PolicyConfig(max_restarts=budget, barrier_timeout=BARRIER_TIMEOUT,
                                stacks_timeout=STACKS_TIMEOUT)
        self.arbiters = 0
        # the pod watch: every rank's pod (labels give job and rank), and the intruder's,
        # a pod of the same job whose labels give no rank
        self.pods = {f"pod-{r}": PodFacts(uid=f"uid-{r}", job=JOB, node=f"node-{r}", rank=r,
                                          world_size=size) for r in range(size)}
        self.pods["pod-x"] = PodFacts(uid="uid-x", job=JOB, node="node-x")
        self.impostor_welcomed = 0
        self.impostor_decisions = 0
        self.kept = KeptRecords()  # the arbiter's --state-dir: it outlives each arbiter
        self.registry = self._new_registry()
        self.restart_generations: dict[str, set[int]] = {}  # fault id -> RESTART targets
        # generations some agent restarted into for a fault (an arbiter's RESTART or
        # REPLACE, or its own local decision): what the job's restart count must equal
        self.restarted_into: set[int] = set()
        self.agents = [agent(self, r) for r in range(size)]

    def _new_registry(self) -> Registry:
        self.arbiters += 1
        reg = Registry(self.cfg, Timeline(), None, f"arbiter-{self.arbiters}",
                       clock=lambda: self.now, history=History(self.kept))
        reg.pod_alive = lambda ns, pod, uid: (f := self.pods.get(pod)) is not None \
            and f.uid == uid

        def watch(job: object, d: object, now: float) -> None:
            if getattr(d, "fault_id", "").startswith("intruder"):
                self.impostor_decisions += 1

        reg.add_decision_listener(watch)
        return reg

    @staticmethod
    def principal(pod: str, uid: str, node: str) -> Principal:
        """What a TokenReview of that pod's token makes the caller."""
        return Principal(f"pod {pod}", namespace="", pod=pod, pod_uid=uid, pod_node=node)

    def admit(self, conn: Connection, p: Principal, h: pb.Hello) -> bool:
        """The server's Hello check (server._read_loop): the claim against the verified
        pod as the watch sees it, then the registry (rank ownership). False: refused."""
        problem, retry = identity_problem(p, h.namespace, h.pod, h.node, h.job, h.rank,
                                          h.world_size, self.pods.get(p.pod or ""))
        if problem:
            conn.reject(grpc.StatusCode.UNAVAILABLE if retry else
                        grpc.StatusCode.PERMISSION_DENIED, problem, "identity_mismatch")
            return False
        try:
            self.registry.hello(conn, h)
        except Refused as e:
            conn.reject(e.code, str(e), e.reason)
            return False
        return True

    def impostor(self, victim: int, claim: str) -> None:
        """Pod ``pod-x`` of the job, with its own valid token, says Hello as rank ``victim``
        claiming the victim's pod, node, or (``rank``) only the rank; if welcomed it would
        report a fatal GPU fault. It must be refused, and nothing decided."""
        v = self.agents[victim]
        pod, node = ("pod-x", "node-x")
        if claim == "pod":
            pod = f"pod-{victim}"
        elif claim == "node":
            node = f"node-{victim}"
        elif claim == "both":
            pod, node = f"pod-{victim}", f"node-{victim}"
        conn = Connection("intruder", pod_uid="uid-x")
        h = pb.Hello(job=JOB, rank=victim, world_size=self.size, pod=pod, node=node,
                     agent_instance=v.proto.instance if claim == "instance" else "intruder",
                     generation=v.generation)
        if self.admit(conn, self.principal("pod-x", "uid-x", "node-x"), h):
            self.impostor_welcomed += 1
            f = pb.Fault(id=f"intruder-{victim}-{claim}", kind=pb.FAULT_KIND_GPU,
                         severity=pb.SEVERITY_FATAL, scope=pb.SCOPE_NODE, message="forged",
                         generation=self.registry.jobs[("", JOB)].generation)
            self.registry.handle(conn, pb.AgentMessage(fault=f), 0.0)
            self.registry.disconnect(conn)

    # ------------------------------------------------------------------ the wire

    def connect(self, r: int) -> None:
        a = self.agents[r]
        if a.stream is not None or a.phase is Phase.EXITED:
            return
        a.stream = Stream(Connection(f"sim-{r}", pod_uid=f"uid-{r}"))
        a.stream.up.append(pb.AgentMessage(hello=a.proto.hello()))

    def break_stream(self, r: int, *, notify: bool = True) -> None:
        a = self.agents[r]
        if a.stream is None:
            return
        if notify:
            self.registry.disconnect(a.stream.conn)
        if a.connected:
            a.offline_since = self.now
        a.stream = None
        a.tick()

    def deliver_up(self, r: int) -> bool:
        """The arbiter reads the agent's next message; False when nothing was in flight."""
        a = self.agents[r]
        s = a.stream
        if s is None or not s.up:
            return False
        m = pb.AgentMessage.FromString(s.up.popleft().SerializeToString())
        if m.WhichOneof("body") == "hello":
            self.admit(s.conn, self.principal(f"pod-{r}", f"uid-{r}", f"node-{r}"), m.hello)
        else:
            self.registry.handle(s.conn, m, 0.0)
        return True

    def deliver_down(self, r: int, duplicate: bool = False) -> bool:
        """The agent reads the arbiter's next message; False when nothing was in flight."""
        a = self.agents[r]
        s = a.stream
        if s is None or s.conn.outbox.empty():
            return False
        item = s.conn.outbox.get_nowait()
        if item is None or isinstance(item, Reject):
            self.break_stream(r)
            return True
        m = pb.ArbiterMessage.FromString(item[0])
        for _ in range(2 if duplicate else 1):
            self._receive(a, m)
        return True

    def _receive(self, a: SimAgent, m: pb.ArbiterMessage) -> None:
        if a.phase is Phase.EXITED or a.stream is None:
            return
        if m.WhichOneof("body") == "welcome":
            if not a.stream.welcomed:
                a.stream.welcomed = True
                a.offline_since = None
                a.stream.up.extend(a.proto.on_welcome(m.welcome))
            return
        got = a.proto.on_message(m)
        a.stream.up.extend(got.send)
        for action in got.actions:
            if action.kind is ActionKind.RESTART and action.fault_id:
                self.restart_generations.setdefault(action.fault_id, set()).add(
                    action.generation)
                self.restarted_into.add(action.generation)
            a.command(action)
        a.tick()

    def restart_arbiter(self) -> None:
        """SIGKILL and start again: every stream breaks, the new one knows only what its
        history store kept (``kept``)."""
        for r in range(self.size):
            self.break_stream(r, notify=False)
        self.registry = self._new_registry()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.registry.tick()
        for a in self.agents:
            a.tick()

    def flush(self, r: int) -> None:
        for _ in range(10_000):
            if not (self.deliver_up(r) or self.deliver_down(r)):
                return

    # ------------------------------------------------------------------ the promises

    def check_safety(self) -> None:
        assert self.impostor_welcomed == 0, "a pod claiming another rank/pod/node got in"
        assert self.impostor_decisions == 0, "an impostor's fault was decided"
        job = self.registry.jobs.get(("", JOB))
        for rs in (job.ranks.values() if job is not None else ()):
            assert rs.pod_uid in ("", f"uid-{rs.rank}"), (
                f"rank {rs.rank} is held by {rs.pod_uid}, not its own pod")
        released = {a.rank: a.generation for a in self.agents
                    if a.phase is Phase.RUNNING and a.started_released}
        assert len(set(released.values())) <= 1, (
            f"trainers of different generations started through the barrier: {released}")
        for fid, gens in self.restart_generations.items():
            assert len(gens) == 1, f"fault {fid} restarted the job into generations {gens}"
        fault_gens = {g for gens in self.restart_generations.values() for g in gens}
        assert len(fault_gens) <= self.budget, (
            f"{len(fault_gens)} fault-driven restarts with a budget of {self.budget}")

    def check_counts(self, restarts: int, generation: int) -> None:
        """A settled job: restarts equal the faults decided into a restart; generation
        and restart count agree (one generation per restart), or the timeline says why
        not (ranks reunited after a restart decided alone: every rank restarts together
        one generation further); and every agent's shipped lifecycle (agent/lifecycle.py,
        the one owner of both in the agent) says what the job says."""
        decided = len(self.restarted_into)
        notes = [e.message for e in self.registry.timeline.entries(JOB, "", 100)]
        assert restarts == decided, (
            f"the job counts {restarts} restarts; {decided} faults were decided into one")
        assert generation == restarts or any(
            f"restart together at generation {generation}" in n or
            f"restarts together at generation {generation}" in n for n in notes), (
            f"generation {generation} after {restarts} restarts, and the timeline says "
            "nothing of why:\n  " + "\n  ".join(notes))
        for a in self.agents:
            if a.phase is Phase.EXITED:
                continue
            life = a.lifecycle
            assert (life.restarts, life.generation) == (restarts, generation), (
                f"rank {a.rank}'s lifecycle counts {life.restarts} restarts at generation "
                f"{life.generation}; the job {restarts} at generation {generation}")

    def heal_and_check(self, max_seconds: float = 3 * BARRIER_TIMEOUT) -> None:
        """Everyone can reach the arbiter now; the job must settle: train or stop."""
        waited = 0.0
        while True:
            for r in range(self.size):
                self.connect(r)
            for _ in range(50):
                moved = False
                for r in range(self.size):
                    self.connect(r)
                    moved = self.deliver_up(r) or moved
                    moved = self.deliver_down(r) or moved
                if not moved:
                    break
            self.check_safety()
            live = [a for a in self.agents if a.phase is not Phase.EXITED]
            job = self.registry.jobs.get(("", JOB))
            if not live:
                assert job is None or job.phase is JobPhase.STOPPED or all(
                    a.exit_code is not None for a in self.agents), "exited without a reason"
                return
            gens = {a.generation for a in live}
            if (all(a.phase is Phase.RUNNING for a in live) and len(gens) == 1
                    and len(live) == self.size and job is not None
                    and job.phase is JobPhase.RUNNING and job.generation in gens
                    and job.hang_probe is None and not job.open_faults):
                # (a decision still open -- stacks awaited -- is not settled: time goes on)
                for a in live:
                    assert not a.proto.faults, (
                        f"rank {a.rank} still holds unsettled faults {list(a.proto.faults)}")
                # one restart per generation restarted into, across any arbiter restart
                assert job.restarts == len(self.restarted_into), (
                    f"the job counts {job.restarts} restarts; agents restarted into "
                    f"generations {sorted(self.restarted_into)}")
                self.check_counts(job.restarts, job.generation)
                return
            if job is not None and job.phase is JobPhase.STOPPED and not live:
                return
            if waited >= max_seconds:
                states = [(a.rank, a.phase.value, a.generation, a.started_released,
                           a.proto.released_generation) for a in self.agents]
                lines = [e.message for e in self.registry.timeline.entries(JOB, "", 30)]
                raise AssertionError(f"the job neither trains nor stopped after {waited:.0f}s "
                                     f"of healed network: agents {states}; job "
                                     f"{job and (job.phase, job.generation, job.barrier)}; "
                                     "timeline:\n  " + "\n  ".join(lines))
            self.advance(1.0)
            waited += 1.0
            if waited % HANG_AFTER == 0:
                # Trainers need each other: one whose peers are not all training with it
                # stops making progress, and its hang detector says so.
                for a in live:
                    a.hang()


def stream_code(world: World, r: int) -> grpc.StatusCode | None:
    """The status the arbiter last ended rank ``r``'s stream with (tests of refusal)."""
    s = world.agents[r].stream
    if s is None:
        return None
    for item in list(s.conn.outbox._queue):  # type: ignore[attr-defined]
        if isinstance(item, Reject):
            return item.code
    return None
