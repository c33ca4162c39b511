"""The recovery ladder's table (arbiter/ladder.py): the tier per fault, with fallback
when the rank's pod lacks the restart rule or its node the version or gate; a RESTART
the process restart did not clear escalates to the pod-level tiers (carry_out)."""

from __future__ import annotations

from ftagent.arbiter.ladder import (
    ESCALATE_AFTER,
    TIERS,
    Features,
    Tier,
    carry_out,
    in_place,
    parse_version,
    pick,
    rungs,
    table,
)
from ftagent.arbiter.state import Decision, Verdict
from ftagent.model import EXIT_RESET_POD, EXIT_RESTART_CONTAINER

BOTH = frozenset({"Restart", "RestartAllContainers"})
NEW = Features((1, 37), frozenset({"RestartAllContainersOnContainerExits"}), BOTH)
AGAIN = ESCALATE_AFTER  # repeats that escalate


def f(**kw: object) -> Features:
    base = {"version": (1, 37), "declared": None, "rules": BOTH, "repeats": AGAIN}
    return Features(**{**base, **kw})  # type: ignore[arg-type]


def test_a_first_restart_is_the_trainer_process_in_place_everywhere() -> None:
    for feats in (Features(), NEW):
        assert pick("restart", "crash", feats)[0] is Tier.PROCESS
        assert pick("restart", "hang", feats)[0] is Tier.PROCESS


def test_a_replace_uses_a_spare_when_one_is_connected_else_a_new_pod() -> None:
    t, why = pick("replace", "gpu", Features())
    assert t is Tier.POD and "replace-onto-spare: no warm spare connected" in why
    assert pick("replace", "node", Features(spare=True))[0] is Tier.SPARE
    # a REPLACE never takes an in-place tier: the node or its device is the fault
    assert pick("replace", "gpu", f())[0] is Tier.POD


def test_a_repeated_crash_restarts_the_container_then_resets_the_pod_where_present() -> None:
    assert rungs("restart", "crash")[:3] == (Tier.PROCESS, Tier.CONTAINER, Tier.POD_IN_PLACE)
    t, why = pick("restart", "crash", f())
    assert t is Tier.CONTAINER and "restart-process: did not clear it" in why
    # a hang's ladder lists the pod reset first (the device state init set up is suspect)
    assert pick("restart", "hang", f())[0] is Tier.POD_IN_PLACE
    # no Restart rule in the pod: the next rung
    t, why = pick("restart", "crash", f(rules=frozenset({"RestartAllContainers"})))
    assert t is Tier.POD_IN_PLACE
    assert "restart-container: the pod has no restart rule Restart for exit code 216" in why


def test_each_absent_feature_falls_back_to_the_next_tier_and_says_why() -> None:
    # kubelet too old for both (the node declares nothing: its version decides)
    t, why = pick("restart", "crash", f(version=(1, 34)))
    assert t is Tier.PROCESS
    assert "restart-container: needs Kubernetes 1.35 (ContainerRestartRules), the " \
           "node's kubelet runs 1.34" in why
    assert "reset-pod: needs Kubernetes 1.36" in why
    # 1.35: the container restart, not the pod reset
    assert pick("restart", "hang", f(version=(1, 35)))[0] is Tier.PROCESS
    assert pick("restart", "crash", f(version=(1, 35)))[0] is Tier.CONTAINER
    # a node that declares features but not RestartAllContainers has it off
    t, why = pick("restart", "hang", f(declared=frozenset({"SomethingElse"})))
    assert t is Tier.PROCESS and "the node does not declare " \
        "RestartAllContainersOnContainerExits" in why
    # declared beats an unknown version
    assert pick("restart", "hang", f(version=None, declared=frozenset(
        {"RestartAllContainersOnContainerExits"})))[0] is Tier.POD_IN_PLACE
    # nothing known (outside Kubernetes, or the pod not seen): the process
    t, why = pick("restart", "hang", Features(repeats=5))
    assert t is Tier.PROCESS and "no restart rule" in why
    # a NIC fault has no pod-level tier
    assert pick("restart", "nic", f())[0] is Tier.PROCESS


def test_carry_out_turns_a_repeated_restart_into_an_in_place_replace_of_that_rank() -> None:
    d = Decision(Verdict.RESTART, "rank 1 crashed; every rank restarts at generation 3",
                 3, rank=1, fault_id="f1")
    assert carry_out(d, "crash", None) is d  # nothing known: as before
    assert carry_out(d, "crash", f(repeats=0)) is d  # the first time: the process
    out = carry_out(d, "hang", f())
    assert out.verdict is Verdict.REPLACE and out.rank == 1 and out.generation == 3
    assert out.exit_code == EXIT_RESET_POD and in_place(out)
    assert "rank 1 resets its pod in place (tier reset-pod (restart-process: did not " \
           "clear it" in out.reason
    out = carry_out(d, "crash", f())
    assert out.exit_code == EXIT_RESTART_CONTAINER and "restarts its container" in out.reason
    # escalated with no pod-level tier: the process restart, the reason says why
    out = carry_out(d, "crash", f(rules=frozenset()))
    assert out.verdict is Verdict.RESTART and "tier restart-process (" in out.reason
    # a job-wide restart with no culprit rank is never a pod tier
    assert carry_out(Decision(Verdict.RESTART, "x", 3), "crash", f()).verdict \
        is Verdict.RESTART
    assert not in_place(Decision(Verdict.REPLACE, "x", 3, rank=1))


def test_unknown_kinds_take_their_verdicts_default_and_the_table_is_complete() -> None:
    assert pick("replace", "anything", Features())[0] is Tier.POD
    assert pick("nonsense", "x", Features())[0] is Tier.POD
    rows = table()
    assert [r[0] for r in rows] == [t.value for t in TIERS]
    assert ("reset-pod", "pod UID, node, devices, emptyDir", "1.36",
            "RestartAllContainersOnContainerExits", "yes") in rows
    assert ("restart-container", "pod UID, node, devices, volumes", "1.35",
            "ContainerRestartRules", "yes") in rows


def test_versions_parse_or_are_unknown() -> None:
    assert parse_version("v1.36.2") == (1, 36)
    assert parse_version("v1.30.0-gke.1200") == (1, 30)
    assert parse_version("1.37+") == (1, 37)
    for bad in ("", "vX", "v1", "v1.x", "9" * 1000):
        assert parse_version(bad) is None


def test_the_in_place_replace_reaches_the_agent_as_its_exit_code() -> None:
    """The command carries the tier's code (arbiter/convert.py) and the agent exits with
    it (agent/lifecycle.py); any other REPLACE still exits with --exit-replace."""
    from ftagent.agent.lifecycle import exit_status_of
    from ftagent.arbiter.convert import command_for
    from ftagent.model import EXIT_REPLACE, Action, ActionKind
    from ftagent.wire.convert import command_to_action

    d = carry_out(Decision(Verdict.RESTART, "crash", 3, rank=1), "hang", f())
    cmd = command_for(d, "c1", replace=True).command
    assert cmd.exit_code == EXIT_RESET_POD and cmd.target_rank == 1
    action = command_to_action(cmd)
    assert action is not None and action.kind is ActionKind.REPLACE
    assert exit_status_of(action, None, exit_replace=EXIT_REPLACE, exit_stop=86) == \
        EXIT_RESET_POD
    # the other ranks restart their process (not the pod-level code)
    from ftagent.v1 import ftagent_pb2 as pb
    assert command_for(d, "c2", replace=False).command.kind == pb.COMMAND_KIND_RESTART
    plain = Decision(Verdict.REPLACE, "gpu lost", 3, rank=1)
    assert command_for(plain, "c3", replace=True).command.exit_code == EXIT_REPLACE
    for code in (None, 1, 99, EXIT_REPLACE):
        a = Action(ActionKind.REPLACE, "x", exit_code=code)
        assert exit_status_of(a, None, exit_replace=200, exit_stop=86) == 200
