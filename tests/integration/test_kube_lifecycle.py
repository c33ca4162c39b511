"""Planned disruptions (KEP-5683 node lifecycle conditions, a drain by someone else)
through the fake API server: recorded as planned, never a fault, and a node another
system drains is never cordoned again by ftagent."""

from __future__ import annotations

import asyncio
from typing import Any

from ftagent.kube.node_lifecycle import held_by_other, planned
from tests.arbiter_helpers import wait_until
from tests.integration.test_kube_actions import NS, cluster, run


def notes(s: Any) -> list[str]:
    return [e.message for e in s.reg.timeline.entries("llm", NS, 0)]


def test_a_drain_in_progress_is_planned_not_a_fault_and_is_said_once() -> None:
    async def body() -> None:
        async with cluster() as s:
            job = s.reg.jobs[(NS, "llm")]
            for _ in range(3):  # the same transition seen again (heartbeats): said once
                s.fake.set_node_condition("node-1", "DrainInProgress", "True",
                                          reason="NodeMaintenance", message="by ops")
            await wait_until(lambda: any("planned: node node-1 DrainInProgress" in m
                                         for m in notes(s)), 20, "the planned event")
            await asyncio.sleep(0.3)  # noqa: ASYNC110 -- nothing else may follow
            assert len([m for m in notes(s) if m.startswith("planned:")]) == 1
            assert job.generation == 0 and s.fake.count("delete", "pods") == 0
    run(body)


def test_a_node_another_system_drains_is_not_cordoned_again() -> None:
    async def body() -> None:
        async with cluster(node_notready_grace=0.5) as s:
            job = s.reg.jobs[(NS, "llm")]
            s.fake.set_node_condition("node-2", "DrainInProgress", "True",
                                      reason="Upgrade")
            await wait_until(lambda: any("planned" in m for m in notes(s)), 20, "planned")
            s.fake.set_node_ready("node-2", "Unknown")  # then it goes away for real
            await wait_until(lambda: job.generation == 1, 20, "the node loss decided")
            await wait_until(lambda: s.fake.count("delete", "pods") >= 1, 20, "pod deleted")
            assert s.fake.count("update", "nodes") == 0
            assert any("node node-2 not cordoned: DrainInProgress on the node (Upgrade)" in m
                       for m in notes(s))
    run(body)


def test_the_pure_rules() -> None:
    node: dict[str, Any] = {"status": {"conditions": [
        {"type": "Ready", "status": "True"},
        {"type": "MaintenancePlanned", "status": "True", "reason": "Firmware",
         "lastTransitionTime": "2026-01-01T00:00:00Z"},
        {"type": "DrainInProgress", "status": "False"}, 1, None]}}
    assert [p.type for p in planned(node)] == ["MaintenancePlanned"]
    assert held_by_other(node).startswith("MaintenancePlanned")
    cordoned: dict[str, Any] = {"spec": {"unschedulable": True}}
    assert "someone else" in held_by_other(cordoned)
    ours = {"spec": {"unschedulable": True}, "metadata": {"annotations": {
        "ftagent.io/cordoned-by": "ftagent-arbiter"}}}
    assert held_by_other(ours) == "" and held_by_other(None) == "" and planned("x") == []


def test_a_planned_disruption_tells_the_ranks_there_to_say_their_last_words_once() -> None:
    """A lifecycle condition on node-1 sends LAST_WORDS to the job's ranks on that node
    only (persist the newest complete snapshot now), once per transition; nothing
    restarts and no other rank hears of it."""
    from ftagent.v1 import ftagent_pb2 as pb

    async def body() -> None:
        async with cluster(per_node=2) as s:  # ranks 2, 3 on node-1
            job = s.reg.jobs[(NS, "llm")]
            for _ in range(3):
                s.fake.set_node_condition("node-1", "MaintenancePlanned", "True",
                                          reason="Firmware")
            await wait_until(lambda: any(m.startswith("last words: node node-1 Maintenance"
                                                      "Planned") for m in notes(s)), 20,
                             "the last words decision")
            await asyncio.sleep(0.3)  # noqa: ASYNC110 -- no second one may follow
            got = {r: [c.kind for c in s.commands(r)] for r in range(4)}
            assert got == {0: [], 1: [], 2: [pb.COMMAND_KIND_LAST_WORDS],
                           3: [pb.COMMAND_KIND_LAST_WORDS]}, got
            said = [m for m in notes(s) if m.startswith("last words:")]
            assert len(said) == 1 and "ranks 2, 3 persist their newest complete" in said[0]
            assert job.generation == 0 and job.restarts == 0
    run(body)


def test_a_condition_flapping_every_second_sends_last_words_once_a_minute() -> None:
    """Bad input: a lifecycle condition that flips True/False over and over (a new
    transition each time) is noted per transition, but the job's ranks on the node are
    told to persist at most once per LAST_WORDS_EVERY."""
    from ftagent.kube.cluster import LAST_WORDS_EVERY
    from ftagent.v1 import ftagent_pb2 as pb

    assert LAST_WORDS_EVERY >= 30

    async def body() -> None:
        async with cluster() as s:
            for i in range(4):
                s.fake.set_node_condition("node-1", "DrainInProgress", "True",
                                          reason=f"flap-{i}")
                await wait_until(lambda i=i: any(f"flap-{i}" in m for m in notes(s)), 20,
                                 "the transition seen")
                s.fake.set_node_condition("node-1", "DrainInProgress", "False")
                await asyncio.sleep(1.05)  # noqa: ASYNC110 -- a new lastTransitionTime (s)
            kinds = [c.kind for c in s.commands(1)]
            assert kinds.count(pb.COMMAND_KIND_LAST_WORDS) == 1, kinds
            assert len([m for m in notes(s) if m.startswith("last words:")]) == 1
    run(body)
