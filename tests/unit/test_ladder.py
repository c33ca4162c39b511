"""The recovery ladder's table (arbiter/ladder.py): the tier per fault, with fallback
when the cluster lacks a tier's version or gate, or the tier is not built."""

from __future__ import annotations

from ftagent.arbiter.ladder import TIERS, Features, Tier, parse_version, pick, rungs, table

NEW = Features((1, 37), frozenset({"ContainerRestartRules",
                                   "RestartAllContainersOnContainerExits"}))


def test_a_restart_is_the_trainer_process_in_place_everywhere() -> None:
    for f in (Features(), NEW):
        assert pick("restart", "crash", f)[0] is Tier.PROCESS


def test_a_replace_uses_a_spare_when_one_is_connected_else_a_new_pod() -> None:
    t, why = pick("replace", "gpu", Features())
    assert t is Tier.POD and "replace-onto-spare: no warm spare connected" in why
    assert pick("replace", "node", Features(spare=True))[0] is Tier.SPARE


def test_the_plan_falls_back_when_the_gate_or_version_is_absent() -> None:
    # the tiers not built yet, asked for as the plan: picked only where the node has them
    assert pick("restart", "hang", NEW, built_only=False)[0] is Tier.PROCESS
    ladder = ("restart", "crash")
    assert rungs(*ladder)[:3] == (Tier.PROCESS, Tier.CONTAINER, Tier.POD_IN_PLACE)
    from ftagent.arbiter import ladder as lad
    only_pod = dict(lad.LADDER)
    only_pod[("restart", "crash")] = (Tier.CONTAINER, Tier.POD_IN_PLACE, Tier.POD)
    old = lad.LADDER
    lad.LADDER = only_pod
    try:
        t, why = pick("restart", "crash", Features((1, 34), None), built_only=False)
        assert t is Tier.POD
        assert "restart-container: needs Kubernetes 1.35, the cluster runs 1.34" in why
        assert "reset-pod: needs Kubernetes 1.36" in why
        t, why = pick("restart", "crash", Features((1, 36), frozenset()), built_only=False)
        assert t is Tier.POD and "needs gate ContainerRestartRules, not declared" in why
        t, _ = pick("restart", "crash", Features((1, 36), frozenset(
            {"RestartAllContainersOnContainerExits"})), built_only=False)
        assert t is Tier.POD_IN_PLACE
        t, why = pick("restart", "crash", NEW)  # built only: neither is built yet
        assert t is Tier.POD and "restart-container: not built" in why
    finally:
        lad.LADDER = old


def test_unknown_kinds_take_their_verdicts_default_and_the_table_is_complete() -> None:
    assert pick("replace", "anything", Features())[0] is Tier.POD
    assert pick("nonsense", "x", Features())[0] is Tier.POD
    rows = table()
    assert [r[0] for r in rows] == [t.value for t in TIERS]
    assert ("reset-pod", "pod UID, node, devices, emptyDir", "1.36",
            "RestartAllContainersOnContainerExits", "no") in rows


def test_versions_parse_or_are_unknown() -> None:
    assert parse_version("v1.36.2") == (1, 36)
    assert parse_version("v1.30.0-gke.1200") == (1, 30)
    assert parse_version("1.37+") == (1, 37)
    for bad in ("", "vX", "v1", "v1.x", "9" * 1000):
        assert parse_version(bad) is None
