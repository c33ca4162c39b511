"""The webhook's container restart rules for the ladder's pod-level tiers
(kube/pod_tiers.py): added on request (the pod's ``ftagent.io/restart-in-place``, or the
webhook's setting), after the container's own rules, with the container's restartPolicy
the API server requires beside them, valid against the Kubernetes 1.37 schema and the
fake API server's validation, and read back by ``features_of`` as the kubelet would
evaluate them."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from ftagent.arbiter.ladder import Features
from ftagent.kube.inject import Settings, mutate
from ftagent.kube.pod_tiers import (
    RULES,
    Streaks,
    add_rules,
    features_of,
    pod_rules,
    rule_action,
)
from ftagent.model import EXIT_RESET_POD, EXIT_RESTART_CONTAINER
from tests.kube_fake import validate
from tests.kube_fake.resources import kind_for

ARB = Settings(arbiter="ftagent-arbiter.ftagent-system:9400")


def pod(note: str | None = None, policy: str | None = "Never",
        **container: Any) -> dict[str, Any]:
    notes = {"ftagent.io/restart-in-place": note} if note is not None else {}
    spec: dict[str, Any] = {"containers": [{"name": "trainer", "image": "t:1",
                                            "command": ["python", "train.py"], **container}]}
    if policy is not None:
        spec["restartPolicy"] = policy
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "w-0", "labels": {"ftagent.io/inject": "true"}, "annotations": notes},
        "spec": spec}


def injected(p: dict[str, Any], s: Settings = ARB) -> dict[str, Any]:
    m = mutate(copy.deepcopy(p), "ml", s)
    assert m.injected, m.status
    return dict(jsonpatch.apply_patch(p, m.patch))


def trainer(p: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = p["spec"]["containers"][0]
    return c


def test_rules_are_added_on_request_valid_for_1_37_and_the_fake_api_server() -> None:
    out = injected(pod("true"))
    c = trainer(out)
    assert c["restartPolicy"] == "Never"  # the pod's: every other exit as before
    assert c["restartPolicyRules"] == [
        {"action": "Restart", "exitCodes": {"operator": "In", "values": [216]}},
        {"action": "RestartAllContainers", "exitCodes": {"operator": "In", "values": [217]}}]
    kubernetes_validate.validate(out, "1.37", strict=True)
    validate.pod_spec(kind_for("pods"), copy.deepcopy(out), set(validate.GATES))
    assert pod_rules(out) == frozenset({"Restart", "RestartAllContainers"})
    # "container" (a 1.35 cluster: RestartAllContainers refused there): only the first
    c = trainer(injected(pod("container")))
    assert [r["action"] for r in c["restartPolicyRules"]] == ["Restart"]
    # the webhook's own setting for every arbitrated pod; a pod opts out
    assert "restartPolicyRules" in trainer(injected(pod(), Settings(
        arbiter=ARB.arbiter, restart_rules="pod")))
    assert "restartPolicyRules" not in trainer(injected(pod("false"), Settings(
        arbiter=ARB.arbiter, restart_rules="pod")))


def test_no_rules_by_default_nor_without_an_arbiter_to_choose_the_tier() -> None:
    assert "restartPolicyRules" not in trainer(injected(pod()))
    assert "restartPolicyRules" not in trainer(injected(pod("true"), Settings()))
    assert "restartPolicy" not in trainer(injected(pod()))


def test_the_pods_own_rules_stay_first_and_its_policy_is_kept() -> None:
    own = [{"action": "Restart", "exitCodes": {"operator": "In", "values": [42]}}]
    c = trainer(injected(pod("true", restartPolicy="OnFailure", restartPolicyRules=own)))
    assert c["restartPolicy"] == "OnFailure" and c["restartPolicyRules"][0] == own[0]
    assert len(c["restartPolicyRules"]) == 3
    # a pod restartPolicy unset (Always): the container states Always
    assert trainer(injected(pod("true", policy=None)))["restartPolicy"] == "Always"


def test_a_full_rule_list_is_left_alone_with_a_warning() -> None:
    full = [{"action": "Restart", "exitCodes": {"operator": "In", "values": [i]}}
            for i in range(1, 20)]
    p = pod("true", restartPolicy="Never", restartPolicyRules=full)
    m = mutate(copy.deepcopy(p), "ml", ARB)
    assert m.injected and any("at most 20" in w for w in m.warnings)
    assert len(trainer(dict(jsonpatch.apply_patch(p, m.patch)))["restartPolicyRules"]) == 19
    c: dict[str, Any] = {"restartPolicy": "Sometimes"}
    assert "is not one rules go with" in add_rules(c, "Never")


def test_the_kubelets_first_match_decides_what_ftagents_codes_do() -> None:
    # a rule of the pod's own that catches every failure first: ours never fire
    catch_all = {"action": "Restart", "exitCodes": {"operator": "NotIn", "values": [0]}}
    c: dict[str, Any] = {"restartPolicy": "Never", "restartPolicyRules": [catch_all],
                         "env": [{"name": "FTAGENT_JOB", "value": "j"}]}
    add_rules(c, "Never")
    assert rule_action(c, EXIT_RESTART_CONTAINER) == "Restart"
    assert rule_action(c, EXIT_RESET_POD) == "Restart"  # not RestartAllContainers
    p = {"spec": {"containers": [c, {"name": "side"}]}}
    assert pod_rules(p) == frozenset({"Restart"})  # only the agent's container counts
    # odd objects read as nothing
    for bad in (None, {}, {"restartPolicyRules": "x"}, {"restartPolicyRules": [1, {}]}):
        assert rule_action(bad, EXIT_RESET_POD) == ""
    assert pod_rules({"spec": {"containers": "x"}}) == frozenset()
    assert len(RULES) == 2


def test_features_of_a_pod_and_its_node() -> None:
    p = injected(pod("true"))
    node = {"status": {"nodeInfo": {"kubeletVersion": "v1.36.2"},
                       "declaredFeatures": ["RestartAllContainersOnContainerExits", 7]}}
    f = features_of(p, node, repeats=2)
    assert f == Features((1, 36), frozenset({"RestartAllContainersOnContainerExits"}),
                         frozenset({"Restart", "RestartAllContainers"}), False, 2)
    assert features_of(None, None) == Features()
    assert features_of(p, {"status": {"declaredFeatures": "nope"}}).declared is None


def test_streaks_count_restarts_in_a_row_blamed_on_one_rank() -> None:
    s, key = Streaks(), ("ns", "job")
    s.note(key, 2, 1, restart=True)
    assert s.repeats(key, 2, 1) == 1 and s.repeats(key, 1, 1) == 0
    s.note(key, 2, 2, restart=True)
    assert s.repeats(key, 2, 2) == 2
    assert s.repeats(key, 2, 3) == 0  # a generation since that it did not begin
    s.note(key, 3, 3, restart=True)  # another rank: a new streak
    assert s.repeats(key, 3, 3) == 1
    s.note(key, None, 4, restart=False)  # a REPLACE of another pod ends it
    assert s.repeats(key, 3, 4) == 0


def test_the_webhooks_restart_in_place_flag_and_variable_set_the_default_rules() -> None:
    """--restart-in-place / FTAGENT_RESTART_IN_PLACE -> Settings.restart_rules (none: "")."""
    from ftagent.cmd.webhook import _server, parse

    assert _server(parse(["--self-signed"], {})).settings.restart_rules == ""
    assert _server(parse(["--self-signed", "--restart-in-place", "pod"], {})
                   ).settings.restart_rules == "pod"
    assert _server(parse(["--self-signed"], {"FTAGENT_RESTART_IN_PLACE": "container"})
                   ).settings.restart_rules == "container"
    with pytest.raises(SystemExit):
        parse(["--self-signed", "--restart-in-place", "always"], {})
