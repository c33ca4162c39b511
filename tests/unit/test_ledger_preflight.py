"""The goodput ledger's ``preflight`` category: the checks before a barrier, carved out of
the category the job waits in (ledger.py), and through the registry from a BarrierArrival."""

from __future__ import annotations

import pytest

from ftagent.arbiter.ledger import CATEGORIES, Ledger
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.timeline import Timeline
from ftagent.v1 import ftagent_pb2 as pb


def sums(led: Ledger, now: float) -> dict[str, float]:
    b = led.breakdown(now)
    assert set(b.seconds) == set(CATEGORIES) and "preflight" in CATEGORIES
    assert sum(b.seconds.values()) == pytest.approx(b.wall)
    assert all(v >= 0 for v in b.seconds.values()), b.seconds
    return b.seconds


def test_the_slowest_ranks_preflight_moves_out_of_decision_once_per_generation() -> None:
    led = Ledger(0.0, world_size=2)
    led.progress(0, 0, 1, 5.0)
    led.progress(1, 0, 1, 5.0)
    led.fault("f", "crash", 20.0, 20.0)
    led.restart(1, 20.0, fault_id="f")
    led.preflight(1, 1.5, 22.0)  # rank 0
    led.preflight(1, 2.5, 22.5)  # rank 1: the slower one counts, once
    led.preflight(1, 1.0, 22.6)
    led.preflight(0, 9.0, 22.7)  # an old generation's: not this wait
    led.released(1, 23.0)
    s = sums(led, 23.0)
    assert s["preflight"] == pytest.approx(2.5)
    assert s["decision"] == pytest.approx(3.0 - 2.5)


def test_startup_preflight_and_bounds() -> None:
    led = Ledger(0.0)
    led.preflight(0, 0.4, 1.0)
    led.preflight(0, float("nan"), 1.0)
    led.preflight(0, -5, 1.0)
    assert sums(led, 2.0)["preflight"] == pytest.approx(0.4)
    led2 = Ledger(0.0)
    led2.preflight(0, 1e9, 3.0)  # never more than the category held
    s = sums(led2, 3.0)
    assert s["preflight"] == pytest.approx(3.0) and s["startup"] == pytest.approx(0.0)


def test_a_barrier_arrival_says_its_preflight_to_the_ledger() -> None:
    now = [100.0]
    reg = Registry(PolicyConfig(), Timeline(), None, "a", clock=lambda: now[0])
    conns = [Connection(f"p{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=2, agent_instance=f"i{r}"))
    now[0] = 101.0
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(
            generation=0, preflight_seconds=0.75)), 0.0)
    led = reg.stats[("", "j")][1].ledger
    assert led is not None
    assert led.breakdown(101.0).seconds["preflight"] == pytest.approx(0.75)
