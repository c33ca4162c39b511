"""When the node agent patches its conditions, and what they say (pure, clock passed in)."""

from __future__ import annotations

from ftagent.node.conditions import (
    GPU_CONDITION,
    NIC_CONDITION,
    Health,
    NodeConditions,
    describe,
    reason_of,
    rfc3339,
)

UP = Health(NIC_CONDITION, True, "LinksUp", "links up: eth0")
DOWN = Health(NIC_CONDITION, False, "CarrierLost", "link eth0 lost carrier")
GPU_OK = Health(GPU_CONDITION, True, "GPUsHealthy", "8 GPU(s)")


def test_first_plan_writes_every_watched_area_with_times() -> None:
    c = NodeConditions(heartbeat=60)
    plan = c.plan([UP, GPU_OK], 100.0)
    assert plan is not None and [p["type"] for p in plan] == [NIC_CONDITION, GPU_CONDITION]
    assert plan[0] == {"type": NIC_CONDITION, "status": "True", "reason": "LinksUp",
                       "message": "links up: eth0", "lastHeartbeatTime": rfc3339(100.0),
                       "lastTransitionTime": rfc3339(100.0)}
    assert c.plan([], 100.0) is None  # nothing watched: nothing written


def test_only_transitions_and_heartbeats_are_written() -> None:
    c = NodeConditions(heartbeat=60)
    c.written([UP], 100.0)
    assert c.plan([UP], 110.0) is None
    assert c.plan([UP], 159.9) is None
    beat = c.plan([UP], 160.0)
    assert beat is not None and beat[0]["lastHeartbeatTime"] == rfc3339(160.0)
    c.written([UP], 160.0)
    down = c.plan([DOWN], 170.0)
    assert down is not None and down[0]["status"] == "False"
    assert down[0]["lastTransitionTime"] == rfc3339(170.0)
    c.written([DOWN], 170.0)
    assert c.plan([DOWN], 171.0) is None, "a link down for a while is not rewritten"
    worse = Health(NIC_CONDITION, False, "CarrierLost", "links eth0, eth1 lost carrier")
    plan = c.plan([worse], 172.0)
    assert plan is not None and plan[0]["lastTransitionTime"] == rfc3339(170.0), \
        "a new message is written, the status did not move"


def test_a_failed_write_is_planned_again() -> None:
    c = NodeConditions(heartbeat=60)
    c.written([UP], 100.0)
    assert c.plan([DOWN], 101.0) is not None
    # not written (the API server failed): still due, transition time kept
    again = c.plan([DOWN], 105.0)
    assert again is not None and again[0]["lastTransitionTime"] == rfc3339(101.0)


def test_reasons_are_camel_case_and_errors_name_the_fix() -> None:
    assert reason_of("Xid 79") == "Xid79"
    assert reason_of("carrier_lost") == "CarrierLost"
    assert reason_of("ecc dbe") == "EccDbe"
    assert reason_of("79") == "Unhealthy" and reason_of("") == "Unhealthy"
    assert "nodes/status" in describe(403, "n1") and "--node" in describe(404, "n1")
    assert describe(500, "n1", "Internal Server Error") == \
        "the API server answered 500 Internal Server Error"
