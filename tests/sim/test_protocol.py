"""The protocol under arbiter restarts, broken streams, duplicates and delays.

Scripted scenarios first (each one a failure seen for real or found by the search, kept
as a regression example), then hypothesis' stateful search over interleavings of faults,
arbiter restarts, reconnects, lost streams, duplicated deliveries and time, across 2-16
ranks, checking the promises after every step (harness.World.check_safety) and at the end
(heal_and_check). ``FTAGENT_SIM_EXAMPLES`` runs more examples (CI runs a bounded number).
"""

from __future__ import annotations

import os

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ftagent.arbiter.state import JobPhase
from ftagent.model import ProcessExit
from tests.sim.harness import FAIL_OPEN, JOB, Phase, World, stream_code


def start(size: int = 2, budget: int = 3) -> World:
    w = World(size, budget)
    w.heal_and_check()
    assert all(a.phase is Phase.RUNNING and a.generation == 0 for a in w.agents)
    return w


def test_a_job_starts_through_the_barrier_of_generation_0() -> None:
    w = start(4)
    assert all(a.started_released for a in w.agents)


def test_crash_during_an_arbiter_outage_does_not_deadlock_the_job() -> None:
    """The field report: arbiter SIGKILLed, rank 1 crashes 11.5 s later, the arbiter is
    back 1 s after that; the job sat at "generation 2: 1/2 arrived" for good."""
    w = start(2)
    w.restart_arbiter()  # killed; nobody is connected
    w.advance(11.5)
    w.agents[1].crash()
    w.advance(1.0)  # back: within --arbiter-fail-open-after, so rank 1 waits for it
    w.heal_and_check()
    assert {a.generation for a in w.agents} == {1}
    job = w.registry.jobs[("", JOB)]
    assert job.restarts == 1 and job.generation == 1


def test_crash_during_a_long_outage_restarts_alone_and_the_job_reconciles() -> None:
    w = start(2)
    w.restart_arbiter()
    w.agents[1].crash()
    w.advance(FAIL_OPEN + 1)  # the arbiter stays away: rank 1 decides and starts alone
    assert w.agents[1].phase is Phase.RUNNING and not w.agents[1].started_released
    assert w.agents[1].generation == 1
    w.heal_and_check()  # rank 0 still runs generation 0: every rank restarts together
    gens = {a.generation for a in w.agents}
    assert len(gens) == 1 and all(a.started_released for a in w.agents)


def test_every_rank_restarted_alone_into_the_same_generation_is_adopted() -> None:
    w = start(2)
    w.restart_arbiter()
    for a in w.agents:
        a.crash()
    w.advance(FAIL_OPEN + 1)
    assert all(a.phase is Phase.RUNNING and a.generation == 1 for a in w.agents)
    w.heal_and_check()
    assert all(a.generation == 1 for a in w.agents)  # not restarted again
    assert w.registry.jobs[("", JOB)].phase is JobPhase.RUNNING


def test_the_arbiter_dies_between_a_decision_and_its_delivery() -> None:
    w = start(3)
    w.agents[2].crash()
    w.deliver_up(2)  # the exit
    w.deliver_up(2)  # the fault: decided, RESTART queued for every rank, then it dies
    w.deliver_down(0)  # rank 0 got its RESTART; ranks 1 and 2 did not
    w.restart_arbiter()
    w.heal_and_check()
    assert {a.generation for a in w.agents} == {1}
    assert all(len(g) == 1 for g in w.restart_generations.values())


def test_a_stale_rejoin_never_kills_a_trainer_of_the_jobs_generation() -> None:
    w = start(2)
    w.agents[1].crash()
    w.heal_and_check()
    a1 = w.agents[1]
    assert a1.phase is Phase.RUNNING and a1.generation == 1
    before = a1.restarts
    from ftagent.v1 import ftagent_pb2 as pb  # a REJOIN to the generation it runs
    a1.proto.on_message(pb.ArbiterMessage(command=pb.Command(
        id="late", kind=pb.COMMAND_KIND_RESTART, generation=1, reason="late")))
    assert a1.restarts == before and a1.phase is Phase.RUNNING


def test_a_duplicated_command_is_applied_once() -> None:
    w = start(2)
    w.agents[0].crash()
    for _ in range(20):
        for r in range(2):
            w.deliver_up(r)
            w.deliver_down(r, duplicate=True)
    w.heal_and_check()
    assert {a.generation for a in w.agents} == {1} and {a.restarts for a in w.agents} == {1}


def test_a_second_agent_for_a_held_rank_is_refused() -> None:
    w = start(2)
    intruder = World(2, 0).agents[1]  # another process claiming rank 1
    s = w.agents[1].stream
    assert s is not None
    from ftagent.arbiter.registry import Connection
    from ftagent.v1 import ftagent_pb2 as pb
    conn = Connection("intruder")
    h = intruder.proto.hello()
    h.agent_instance = "someone-else"
    h.max_restarts = 0
    import pytest

    from ftagent.wire.checks import Refused
    with pytest.raises(Refused) as e:
        w.registry.hello(conn, h)
    assert e.value.code is grpc.StatusCode.ALREADY_EXISTS
    assert w.registry.jobs[("", JOB)].max_restarts == 3  # the budget is not lowered
    assert stream_code(w, 1) is None  # the real agent's stream is untouched
    del pb


def test_the_budget_is_spent_once_per_decision_and_then_the_job_stops() -> None:
    w = start(2, budget=1)
    w.agents[0].crash()
    w.heal_and_check()
    w.agents[1].crash()
    w.heal_and_check()
    assert all(a.phase is Phase.EXITED and a.exit_code == 3 for a in w.agents)
    assert w.registry.jobs[("", JOB)].phase is JobPhase.STOPPED


def test_a_job_hang_probe_lost_with_its_arbiter_is_decided_by_the_next() -> None:
    w = start(2)
    for a in w.agents:
        a.hang()
    for r in range(2):
        w.flush(r)  # DUMP_STACKS sent; the stacks travel up
    w.restart_arbiter()
    w.heal_and_check()
    assert {a.generation for a in w.agents} == {1}


def test_ranks_back_after_the_probe_was_raised_again_answer_it_at_once() -> None:
    """The arbiter dies while rank 0's hang is open; ranks 0 and 1 reconnect first (rank
    0's fault, sent again, raises a new probe of the two), rank 2 after. Rank 2 owes the
    probe an answer: it is sent the probe's DUMP_STACKS at its Hello and the probe is
    decided when it answers. (Before, it was never asked: the probe waited for its
    deadline, STACKS_TIMEOUT, to restart the hung job.)"""
    w = start(3)
    w.agents[0].hang()
    w.restart_arbiter()
    for r in (0, 1):
        w.connect(r)
    w.flush(1)  # rank 1's Hello first: rank 0's fault finds it there
    w.flush(0)  # Hello, the fault again: DUMP_STACKS to ranks 0 and 1; rank 0 answers
    job = w.registry.jobs[("", JOB)]
    assert job.hang_probe is not None
    w.connect(2)
    w.flush(2)  # back during the probe: asked, and it answers
    w.flush(1)  # the last answer
    assert job.hang_probe is None and job.generation == 1, [
        e.message for e in w.registry.timeline.entries(JOB, "", 30)]
    w.heal_and_check()
    assert {a.generation for a in w.agents} == {1}


def test_stacks_lost_with_a_broken_stream_are_decided_at_the_probes_deadline() -> None:
    """Found by the search: a rank's stacks answer is lost with its stream, and the re-sent
    DUMP_STACKS is the same command (answered once); the probe decides at its deadline."""
    w = start(3, budget=0)
    w.break_stream(0)
    w.agents[1].hang()
    w.deliver_up(1)  # the hang: DUMP_STACKS for every rank, rank 0's kept for its reconnect
    w.deliver_down(2)  # rank 2 gets it, answers, and its stream breaks with the answer
    w.break_stream(2)
    w.heal_and_check()
    assert all(a.phase is Phase.EXITED for a in w.agents)  # budget 0: the job stops
    assert w.registry.jobs[("", JOB)].phase is JobPhase.STOPPED


def test_exits_written_to_an_arbiter_killed_unread_reach_the_next_one() -> None:
    """CI's chaos run (seed 992808372) ended "gone: no agent for 0s (was running)": the
    arbiter was SIGKILLed and the trainers exited 0 before the agents noticed, so their
    exits went to the dead streams, unread, and the agents said Hello to the new arbiter
    without them. The link keeps the last exit until an arbiter confirms reading it."""
    w = start()
    for a in w.agents:
        a.lifecycle.succeeded()
        a.send(a.proto.exit(a.exited(ProcessExit(pid=1, code=0, signal=None)), a.generation),
               keep=True)
        assert a.stream is not None and a.stream.up  # handed to the stream, not read
    w.restart_arbiter()
    for r in range(2):
        w.connect(r)
        w.flush(r)
    job = w.registry.jobs[("", JOB)]
    assert job.phase is JobPhase.SUCCEEDED, [e.message for e in
                                             w.registry.timeline.entries(JOB, "", 30)]


def test_an_exit_said_again_to_the_arbiter_that_read_it_is_recorded_once() -> None:
    """The stream broke after the arbiter read the exit (the agent cannot know): the
    link says it again on the next stream, and the arbiter records it once."""
    w = start()
    a = w.agents[0]
    a.send(a.proto.exit(a.exited(ProcessExit(pid=1, code=0, signal=None)), a.generation),
           keep=True)
    w.flush(0)
    w.break_stream(0)
    w.connect(0)
    w.flush(0)
    notes = [e.message for e in w.registry.timeline.entries(JOB, "", 30)]
    assert sum("exited with code 0" in n for n in notes) == 1, notes


def test_the_finished_runs_agent_saying_its_exit_again_starts_no_new_run() -> None:
    """CI's GPU drill (stop 31): the job succeeded, every stream ended before the agents
    had the arbiter's confirmation, and one agent, still finishing, reconnected to say its
    exit again (``LinkProtocol.last_exit``). A Hello to a finished job with no agent
    connected started a new run of it: a new ledger from that moment, the job's goodput
    and state gone. The same agent (its instance) coming back is the finished run's."""
    w = start()
    for r, a in enumerate(w.agents):
        a.lifecycle.succeeded()
        a.send(a.proto.exit(a.exited(ProcessExit(pid=1, code=0, signal=None)), a.generation),
               keep=True)
        w.flush(r)
    job = w.registry.jobs[("", JOB)]
    assert job.phase is JobPhase.SUCCEEDED
    for r in range(2):
        w.break_stream(r)
    assert job.connected == 0
    w.connect(0)
    w.flush(0)
    notes = [e.message for e in w.registry.timeline.entries(JOB, "", 30)]
    assert w.registry.jobs[("", JOB)] is job, notes
    assert not any("new run" in n for n in notes), notes
    assert job.phase is JobPhase.SUCCEEDED


def test_restarts_are_counted_once_per_generation_across_arbiter_restarts() -> None:
    """Found by the search (issue 23: 3 real restarts counted as 5 under arbiter chaos):
    agents counted every restarting command they got, a rejoin included, and a restarted
    arbiter adopted the highest count from their Hellos. Commands now carry the job's
    count; heal_and_check compares it with the generations restarted into."""
    w = World(2, budget=1)
    w.heal_and_check()
    w.restart_arbiter()
    w.connect(0)
    w.connect(1)
    w.agents[0].crash()
    for r in range(2):
        w.flush(r)
    w.restart_arbiter()
    w.heal_and_check()
    job = w.registry.jobs[("", JOB)]
    assert job.restarts == 1 and job.generation == 1
    assert {a.lifecycle.restarts for a in w.agents} == {1}
    assert {a.proto.hello().restart_count for a in w.agents} == {1}


def test_a_pod_claiming_another_rank_pod_or_node_never_gets_in_nor_acts() -> None:
    """Issue 20: a pod of the job with its own valid token claims rank 1 -- its pod, its
    node, or only the rank, while rank 1's agent is connected and after it disconnected
    (a free rank was anyone's to take). Refused every time; nothing decided; the job
    trains on."""
    w = start(3)
    for claim in ("rank", "pod", "node", "both", "instance"):
        w.impostor(1, claim)
        w.check_safety()
    w.break_stream(1)  # rank 1's agent is away: its rank is still its pod's
    for claim in ("rank", "pod", "node", "both", "instance"):
        w.impostor(1, claim)
        w.check_safety()
    w.heal_and_check()
    assert {a.generation for a in w.agents} == {0}
    assert w.registry.jobs[("", JOB)].restarts == 0


def test_a_ranks_owner_survives_an_arbiter_restart() -> None:
    """A rank belongs to its pod across an arbiter restart, as before it: pod-x (a pod of
    the job, its own valid token, labels that give no rank) says Hello as rank 0 after
    the restart, before rank 0's agent is back. Refused (the restarted arbiter forgot the
    owner before the job's record kept it); once pod-0 is gone, the rank is free."""
    w = start(2, 0)
    w.restart_arbiter()
    w.connect(1)
    w.flush(0)
    w.flush(1)
    w.impostor(0, "rank")
    w.check_safety()
    w.heal_and_check()
    assert {a.generation for a in w.agents} == {0}
    assert w.registry.jobs[("", JOB)].restarts == 0
    # pod-0 is gone (deleted): after another restart its rank is free to take
    del w.pods["pod-0"]
    w.restart_arbiter()
    w.connect(1)
    w.flush(1)
    w.impostor(0, "rank")
    assert w.impostor_welcomed == 1


# --------------------------------------------------------------------------- the search

EXAMPLES = int(os.environ.get("FTAGENT_SIM_EXAMPLES", "60"))


class Protocol(RuleBasedStateMachine):
    """Any interleaving of faults, arbiter restarts, reconnects, losses and time."""

    world: World

    @initialize(size=st.integers(2, 16), budget=st.integers(0, 4))
    def setup(self, size: int, budget: int) -> None:
        self.world = World(size, budget)
        self.world.heal_and_check()

    def _rank(self, data: int) -> int:
        return data % self.world.size

    @rule(r=st.integers(0, 15))
    def crash(self, r: int) -> None:
        self.world.agents[self._rank(r)].crash()

    @rule(r=st.integers(0, 15))
    def hang(self, r: int) -> None:
        self.world.agents[self._rank(r)].hang()

    @rule(r=st.integers(0, 15),
          claim=st.sampled_from(["rank", "pod", "node", "both", "instance"]))
    def impostor(self, r: int, claim: str) -> None:
        if ("", JOB) in self.world.registry.jobs:
            self.world.impostor(self._rank(r), claim)

    @rule()
    def restart_arbiter(self) -> None:
        self.world.restart_arbiter()

    @rule(r=st.integers(0, 15))
    def break_stream(self, r: int) -> None:
        self.world.break_stream(self._rank(r))

    @rule(r=st.integers(0, 15))
    def connect(self, r: int) -> None:
        self.world.connect(self._rank(r))

    @rule(r=st.integers(0, 15), n=st.integers(1, 8))
    def deliver_up(self, r: int, n: int) -> None:
        for _ in range(n):
            self.world.deliver_up(self._rank(r))

    @rule(r=st.integers(0, 15), n=st.integers(1, 8), duplicate=st.booleans())
    def deliver_down(self, r: int, n: int, duplicate: bool) -> None:
        for _ in range(n):
            self.world.deliver_down(self._rank(r), duplicate)

    @rule()
    def deliver_everything(self) -> None:
        for r in range(self.world.size):
            self.world.flush(r)

    @rule(seconds=st.sampled_from([0.5, 2.0, FAIL_OPEN + 1, 60.0]))
    def advance(self, seconds: float) -> None:
        self.world.advance(seconds)

    @invariant()
    def safe(self) -> None:
        if hasattr(self, "world"):
            self.world.check_safety()

    def teardown(self) -> None:
        if hasattr(self, "world"):
            self.world.heal_and_check()


Protocol.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], derandomize=not os.environ.get(
        "FTAGENT_SIM_RANDOM"))
test_protocol_search = Protocol.TestCase
