"""The protocol simulation with the shipped ArbiterDecider deciding for every rank.

The same world as test_protocol.py (the real Registry, LinkProtocol, Lifecycle), but each
agent's decisions go through agent/arbiter_decider.py and its fail-open into the real
decider.LocalDecider, on the world's clock over a fake transport (decider_agent.py). The
scripted cases of test_protocol.py that exercise the decider, then a short search.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import Phase as HPhase
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from ftagent.arbiter.state import JobPhase
from tests.sim.decider_agent import DeciderAgent, world_loop
from tests.sim.harness import FAIL_OPEN, JOB, Phase, World
from tests.sim.test_protocol import Protocol


@pytest.fixture
def worlds() -> Iterator[list[World]]:
    made: list[World] = []
    yield made
    for w in made:
        world_loop(w).close()


def start(made: list[World], size: int = 2, budget: int = 3) -> World:
    w = World(size, budget, agent=DeciderAgent)
    made.append(w)
    w.heal_and_check()
    assert all(a.phase is Phase.RUNNING and a.generation == 0 for a in w.agents)
    return w


def test_every_rank_starts_through_the_barrier_and_a_crash_restarts_them_all(
        worlds: list[World]) -> None:
    w = start(worlds, 3)
    assert all(a.started_released for a in w.agents)
    w.agents[1].crash()
    w.heal_and_check()
    assert {a.generation for a in w.agents} == {1}
    assert all(a.started_released for a in w.agents)
    job = w.registry.jobs[("", JOB)]
    assert (job.restarts, job.generation) == (1, 1)
    assert {a.proto.hello().restart_count for a in w.agents} == {1}


def test_a_crash_in_a_short_outage_waits_for_the_arbiter(worlds: list[World]) -> None:
    w = start(worlds)
    w.restart_arbiter()
    w.advance(11.5)
    w.agents[1].crash()
    w.advance(1.0)  # back within --arbiter-fail-open-after: the decider waits for it
    assert w.agents[1].phase is Phase.DEAD
    w.heal_and_check()
    assert {a.generation for a in w.agents} == {1}
    assert w.registry.jobs[("", JOB)].restarts == 1


def test_a_crash_in_a_long_outage_is_decided_alone_and_the_job_reconciles(
        worlds: list[World]) -> None:
    w = start(worlds)
    w.restart_arbiter()
    w.agents[1].crash()
    w.advance(FAIL_OPEN + 1)  # the decider's watchdog: the local policy restarts it
    a1 = w.agents[1]
    assert a1.phase is Phase.RUNNING and not a1.started_released and a1.generation == 1
    assert a1.lifecycle.decided_by is not None and a1.lifecycle.decided_by.value == "local"
    w.heal_and_check()
    gens = {a.generation for a in w.agents}
    assert len(gens) == 1 and all(a.started_released for a in w.agents)


def test_the_budget_spent_stops_every_rank(worlds: list[World]) -> None:
    w = start(worlds, 2, budget=0)
    w.agents[0].crash()
    w.heal_and_check()
    assert all(a.phase is Phase.EXITED for a in w.agents)
    assert w.registry.jobs[("", JOB)].phase is JobPhase.STOPPED


PHASES = [HPhase.explicit, HPhase.reuse, HPhase.generate] + (
    [HPhase.shrink] if os.environ.get("FTAGENT_SIM_SHRINK") else [])


class DeciderProtocol(Protocol):
    """test_protocol's search, every rank deciding through the shipped ArbiterDecider."""

    @initialize(size=st.integers(2, 16), budget=st.integers(0, 4))
    def setup(self, size: int, budget: int) -> None:
        self.world = World(size, budget, agent=DeciderAgent)
        self.world.heal_and_check()

    def impostor(self, r: int, claim: str) -> None:
        """Not a rule here: identity is the arbiter's promise (test_protocol.py searches
        it); this search is about decisions. (A sequence it found lets an impostor in on
        the old code as well: see the lane's report.)"""

    def teardown(self) -> None:
        if hasattr(self, "world"):
            try:
                self.world.heal_and_check()
            finally:
                world_loop(self.world).close()


DeciderProtocol.TestCase.settings = settings(
    max_examples=int(os.environ.get("FTAGENT_SIM_DECIDER_EXAMPLES", "10")),
    stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], phases=PHASES,
    derandomize=not os.environ.get("FTAGENT_SIM_RANDOM"))
test_decider_search = DeciderProtocol.TestCase
