"""Exit statuses job controllers understand: the agent's REPLACE and STOP statuses against
each controller's documented rule, and the policies shipped in deploy/examples/."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from ftagent.agent.worker import Worker, WorkerSpec
from ftagent.cmd.run import parse
from ftagent.model import (
    EXIT_REPLACE,
    EXIT_STOP,
    Action,
    ActionKind,
    Fault,
    FaultKind,
    ProcessExit,
)
from tests.webhook_pods import EXAMPLES, load_all

SIGNAL_STATUSES = {128 + s for s in range(1, signal.SIGRTMAX + 1)}


def kubeflow_retryable(code: int) -> bool:
    """Kubeflow Training Operator v1, restartPolicy ExitCode: IsRetryableExitCode."""
    return code >= 128


def pod_failure_action(policy: dict[str, Any], container: str, code: int,
                       conditions: tuple[str, ...] = ()) -> str:
    """The Job controller's podFailurePolicy: the first rule that matches decides; none
    matching counts the failure against backoffLimit ("Count")."""
    for rule in policy["rules"]:
        on = rule.get("onExitCodes")
        if on is not None:
            if on.get("containerName") not in (None, container) or code == 0:
                continue
            hit = code in on["values"]
            if hit == (on["operator"] == "In"):
                return str(rule["action"])
        for cond in rule.get("onPodConditions", []):
            if cond["type"] in conditions:
                return str(rule["action"])
    return "Count"


def jobset_action(failure_policy: dict[str, Any], job_failure_reason: str | None) -> str:
    """JobSet: a child Job that failed with a reason matched by a rule takes that rule's
    action; any other failure restarts the JobSet (within maxRestarts)."""
    if job_failure_reason is None:
        return "none"  # the child Job did not fail
    for rule in failure_policy.get("rules", []):
        if job_failure_reason in rule.get("onJobFailureReasons", [job_failure_reason]):
            return str(rule["action"])
    return "RestartJobSet"


def test_defaults_under_kubeflow_exit_code() -> None:
    assert kubeflow_retryable(EXIT_REPLACE)  # "move this pod": a new pod
    assert not kubeflow_retryable(EXIT_STOP)  # "the job is over": permanent
    assert EXIT_REPLACE not in SIGNAL_STATUSES  # never mistaken for a signal's 128+N
    assert EXIT_STOP not in (1, 2, 126, 127)  # nor for a trainer's usual codes


def _job_policies() -> list[tuple[str, dict[str, Any], dict[str, Any] | None]]:
    """(example, the child Job's podFailurePolicy, the JobSet failurePolicy or None)."""
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for d in load_all(path):
            if d["kind"] == "Job" and d["apiVersion"] == "batch/v1":
                out.append((path.name, d["spec"]["podFailurePolicy"], None))
            elif d["kind"] == "JobSet":
                for rj in d["spec"]["replicatedJobs"]:
                    out.append((path.name, rj["template"]["spec"]["podFailurePolicy"],
                                d["spec"]["failurePolicy"]))
            elif d["kind"] == "TrainingRuntime":
                js = d["spec"]["template"]["spec"]
                for rj in js["replicatedJobs"]:
                    out.append((path.name, rj["template"]["spec"]["podFailurePolicy"],
                                js["failurePolicy"]))
    return out


POLICIES = _job_policies()


def test_every_job_and_jobset_example_has_the_rules() -> None:
    assert {p[0] for p in POLICIES} == {"indexed-job.yaml", "jobset.yaml", "trainjob.yaml"}


@pytest.mark.parametrize("example,policy,jobset", POLICIES, ids=[p[0] for p in POLICIES])
def test_pod_failure_policy_reads_the_statuses(example: str, policy: dict[str, Any],
                                                jobset: dict[str, Any] | None) -> None:
    container = policy["rules"][0]["onExitCodes"]["containerName"]
    assert pod_failure_action(policy, container, EXIT_REPLACE) == "Ignore"  # a new pod
    assert pod_failure_action(policy, container, EXIT_STOP) == "FailJob"
    assert pod_failure_action(policy, container, 1) == "Count"  # the agent alone gave up
    assert pod_failure_action(policy, container, 137, ("DisruptionTarget",)) == "Ignore"
    if jobset is not None:
        assert jobset_action(jobset, None) == "none"  # REPLACE: the child Job goes on
        assert jobset_action(jobset, "PodFailurePolicy") == "FailJobSet"  # STOP
        assert jobset_action(jobset, "BackoffLimitExceeded") == "RestartJobSet"


def test_volcano_policies() -> None:
    (doc,) = load_all(EXAMPLES / "volcano-job.yaml")
    by_code = {p["exitCode"]: p["action"] for p in doc["spec"]["policies"] if "exitCode" in p}
    assert by_code == {EXIT_REPLACE: "RestartPod", EXIT_STOP: "TerminateJob"}


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "tfjob.yaml", "paddlejob.yaml",
                                  "mxjob.yaml"])
def test_kubeflow_examples_use_exit_code_restarts(name: str) -> None:
    (doc,) = load_all(EXAMPLES / name)
    specs = next(v for k, v in doc["spec"].items() if k.endswith("ReplicaSpecs"))
    assert {s["restartPolicy"] for s in specs.values()} == {"ExitCode"}


# ------------------------------------------------------------------ the agent


def agent(*flags: str) -> Worker:
    return Worker(WorkerSpec(parse([*flags, "--", "true"], {})))


def test_agent_exit_statuses() -> None:
    a = agent()
    crashed = ProcessExit(pid=1, code=9)
    assert a._exit_code_of(Action(ActionKind.REPLACE, "gpu", exit_code=87), crashed) == 215
    assert a._exit_code_of(Action(ActionKind.STOP, "budget", exit_code=9), crashed) == 86
    # what the local policy decided alone: the trainer's status, as without ftagent
    a.decider.decide(a, Fault(FaultKind.CRASH, "exit 9", evidence={"exit_status": 9}))
    local = a.lifecycle.due()
    assert local is not None
    assert local.kind == ActionKind.STOP and a._exit_code_of(local, crashed) == 9


def test_exit_status_flags() -> None:
    a = agent("--exit-replace", "250", "--exit-stop", "-1")
    assert a._exit_code_of(Action(ActionKind.REPLACE, "gpu"), None) == 250
    assert a._exit_code_of(Action(ActionKind.STOP, "budget", exit_code=3), None) == 3
    for bad in (["--exit-replace", "0"], ["--exit-replace", "256"], ["--exit-stop", "-2"]):
        with pytest.raises(Exception, match="must be in"):
            parse([*bad, "--", "true"], {})
