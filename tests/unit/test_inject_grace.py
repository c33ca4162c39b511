"""The agent's stop timeout from the pod's grace (ftagent/kube/grace.py, through inject.py
and the webhook): the kubelet SIGKILLs a container ``terminationGracePeriodSeconds``
after SIGTERM, so the agent must have stopped the trainer, recorded its exit and closed
before then. Before, every injected agent waited the default 30 s, the grace's default
too: a trainer that used its whole grace took the agent down with it, the exit unrecorded.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from ftagent.kube import grace
from ftagent.kube.inject import Settings, mutate
from ftagent.kube.webhook import review
from tests.agent_launcher import ftagent_launcher
from tests.conftest import wait_for
from tests.webhook_pods import admission_review

SETTINGS = Settings(image="ftagent:test", arbiter="arbiter.ftagent:9400")


def _pod(grace_s: Any = ..., env: list[dict[str, Any]] | None = None,
         command: list[str] | None = None, **container: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{
        "name": "main", "image": "x", "command": command or ["python", "train.py"],
        **({"env": env} if env is not None else {}), **container}]}
    if grace_s is not ...:
        spec["terminationGracePeriodSeconds"] = grace_s
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "labels": {"ftagent.io/inject": "true"}},
            "spec": spec}


def _patched(pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Through the webhook's own admission path: the review's JSON in, its patch applied."""
    status, body = review(json.dumps(admission_review(pod)).encode(), SETTINGS)
    resp = json.loads(body)["response"]
    assert status == 200 and resp["allowed"] is True
    patch = json.loads(base64.b64decode(resp["patch"])) if "patch" in resp else []
    return jsonpatch.apply_patch(pod, patch), resp


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom"))
            for e in pod["spec"]["containers"][0].get("env", [])}


# ------------------------------------------------------------------ the derivation (pure)


@pytest.mark.parametrize(("given", "stop", "warned"), [
    (30, "25", ""),
    (60, "55", ""),
    (..., "25", ""),  # absent: the API server's default 30
    (None, "25", ""),  # null: the same
    (0, "1", "almost no grace"),  # the kubelet gives 2 s at least; the trainer gets 1
    (1, "1", "almost no grace"),
    (2, "1", "almost no grace"),
    (7, "2", ""),
    (-5, "1", "almost no grace"),  # the API server takes a negative grace as 1 s
    ("30", "25", "the string '30'"),  # no whole number: the default, with a warning
    (True, "25", "is bool"),
    (30.0, "25", "is float"),
    ([30], "25", "is list"),
    (2**63, "1000000000", ""),  # beyond int64: capped at the agent's own bound
    (10**4000, "1000000000", ""),
])
def test_stop_timeout_derived_from_the_grace(given: Any, stop: str, warned: str) -> None:
    spec = {} if given is ... else {"terminationGracePeriodSeconds": given}
    st = grace.stop_timeout(spec, {})
    assert st.value == stop
    assert all(w.startswith("ftagent: ") for w in st.warnings)
    assert (warned in " ".join(st.warnings)) if warned else st.warnings == ()
    assert stop in st.note and len(st.note) < 300


def test_the_margin_leaves_the_agent_its_bounded_exit() -> None:
    """5 s: the agent's cleanup after the trainer's kill is bounded by ~2.25 s (shutdown
    FLOOR 1 s, LAST_LOOK 0.25 s, GUARD_SLACK 1 s); what is left is for the interpreter's
    exit on a loaded node. Checked against the agent's own constants here, where the
    kube layer may not import them."""
    from ftagent.agent import shutdown
    assert grace.STOP_MARGIN >= shutdown.FLOOR + shutdown.LAST_LOOK + shutdown.GUARD_SLACK + 2
    assert grace.MIN_STOP >= 1 and grace.derived(30) == 30 - grace.STOP_MARGIN


@pytest.mark.parametrize(("container", "argv", "warned"), [
    ({"env": [{"name": "FTAGENT_STOP_TIMEOUT", "value": "20"}]}, None, ""),
    ({"env": [{"name": "FTAGENT_STOP_TIMEOUT", "value": "45"}]}, None, "not below"),
    ({"env": [{"name": "FTAGENT_STOP_TIMEOUT", "value": "30"}]}, None, "not below"),
    # the last entry of a name is the one the kubelet sets
    ({"env": [{"name": "FTAGENT_STOP_TIMEOUT", "value": "45"},
              {"name": "FTAGENT_STOP_TIMEOUT", "value": "10"}]}, None, ""),
    # "" is unset for the agent: its default 30, not below a grace of 30
    ({"env": [{"name": "FTAGENT_STOP_TIMEOUT", "value": ""}]}, None, "not below"),
    ({"env": [{"name": "FTAGENT_STOP_TIMEOUT", "value": "soon"}]}, None, "refuses it"),
    ({"env": [{"name": "FTAGENT_STOP_TIMEOUT", "value": "9" * 5000}]}, None, "refuses it"),
    ({"env": [{"name": "FTAGENT_STOP_TIMEOUT", "valueFrom": {"configMapKeyRef": {
        "name": "c", "key": "k"}}}]}, None, ""),  # not readable here: kept, unchecked
    # the image's own ``ftagent run``: its flag wins over the env, as in the agent
    ({}, ["--stop-timeout", "40", "--", "python"], "not below"),
    ({}, ["--stop-timeout=20", "--", "python", "--stop-timeout", "99"], ""),
    ({"env": [{"name": "FTAGENT_STOP_TIMEOUT", "value": "45"}]},
     ["--stop-timeout", "20", "--", "python"], ""),
    ({}, ["--", "python"], "default --stop-timeout 30 is not below"),
])
def test_a_value_the_container_sets_is_kept(container: dict[str, Any],
                                            argv: list[str] | None, warned: str) -> None:
    st = grace.stop_timeout({"terminationGracePeriodSeconds": 30}, container, argv)
    assert st.value is None  # nothing added: the container's own stands
    assert (warned in " ".join(st.warnings)) if warned else st.warnings == ()
    assert all(len(w) < 400 for w in st.warnings)


def test_a_pre_stop_hook_is_named() -> None:
    st = grace.stop_timeout({"terminationGracePeriodSeconds": 60},
                            {"lifecycle": {"preStop": {"exec": {"command": ["sleep", "9"]}}}})
    assert st.value == "55" and "preStop" in st.note and "preStop" in st.warnings[0]


# ------------------------------------------------------------------ through the webhook


@pytest.mark.parametrize(("given", "stop"), [(30, "25"), (120, "115"), (..., "25"),
                                             (0, "1"), ("x", "25"), (True, "25"),
                                             (2**63, "1000000000"), (-1, "1")])
def test_the_patched_trainer_has_the_derived_stop_timeout(given: Any, stop: str) -> None:
    pod, resp = _patched(_pod(given))
    assert _env(pod)["FTAGENT_STOP_TIMEOUT"] == stop
    assert pod["metadata"]["annotations"]["ftagent.io/stop-timeout"].startswith(f"{stop} s:")
    assert ("warnings" in resp) == (given in (0, "x", -1) or given is True)


def test_the_containers_own_value_is_kept_and_warned_about() -> None:
    env = [{"name": "FTAGENT_STOP_TIMEOUT", "value": "45"}]
    pod, resp = _patched(_pod(30, env))
    assert [e for e in pod["spec"]["containers"][0]["env"]
            if e["name"] == "FTAGENT_STOP_TIMEOUT"] == env
    assert any("not below the pod's terminationGracePeriodSeconds 30" in w
               for w in resp["warnings"])
    assert "set on the container, kept" in pod["metadata"]["annotations"][grace.NOTE]
    pod, resp = _patched(_pod(60, env))  # below the grace: kept, no warning
    assert _env(pod)["FTAGENT_STOP_TIMEOUT"] == "45" and "warnings" not in resp


def test_an_image_running_ftagent_itself_is_warned_about() -> None:
    """A command that already is ``ftagent run`` is left alone (no patch), but a stop
    timeout not below the grace is still the kubelet's SIGKILL of the agent."""
    pod = _pod(30, command=["ftagent", "run", "--stop-timeout", "30", "--", "python"])
    new, resp = _patched(pod)
    assert new == pod and any("--stop-timeout '30' is not below" in w
                              for w in resp["warnings"])
    new, resp = _patched(_pod(60, command=["ftagent", "run", "--", "python"]))
    assert "warnings" not in resp  # the default 30 is below 60


def test_a_reinvocation_adds_nothing_and_says_nothing() -> None:
    pod, _ = _patched(_pod(0))
    m = mutate(copy.deepcopy(pod), "ml", SETTINGS)
    assert m.reason == "already injected" and m.patch == [] and m.warnings == []


# ------------------------------------------------------------------ a real agent, a real kill


def test_the_agent_exits_before_the_kubelets_sigkill(tmp_path: Path) -> None:
    """The injected pod's own command, run for real under a simulated kubelet: SIGTERM,
    then SIGKILL at terminationGracePeriodSeconds. The trainer ignores SIGTERM; the agent
    (FTAGENT_STOP_TIMEOUT from the pod's grace) kills it, writes its exit and exits with
    the trainer's status before the grace ends. With the old 30 s it was still waiting."""
    grace_s = 6
    ready, events = tmp_path / "ready", tmp_path / "events.jsonl"
    trainer = ["sh", "-c", f'trap "" TERM; : > {ready}; while :; do sleep 0.05; done']
    pod = _pod(grace_s, command=trainer)
    pod["metadata"]["annotations"] = {"ftagent.io/agent": "image"}  # ftagent on PATH
    new = jsonpatch.apply_patch(pod, mutate(copy.deepcopy(pod), "ml", SETTINGS).patch)
    c = new["spec"]["containers"][0]
    assert c["command"][:2] == ["ftagent", "run"]
    ftagent_launcher(tmp_path / "bin" / "ftagent")
    env = {**{e["name"]: e["value"] for e in c["env"] if "value" in e},
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path),
           "FTAGENT_METRICS_PORT": "0", "FTAGENT_MAX_RESTARTS": "0",
           "FTAGENT_ARBITER": "", "FTAGENT_TOKEN_FILE": "",
           "FTAGENT_EVENTS_FILE": str(events)}
    agent = subprocess.Popen(c["command"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(ready.exists, timeout=30, what="the trainer started")
        agent.send_signal(signal.SIGTERM)  # the kubelet's stop
        sigkill_at = time.monotonic() + grace_s
        try:
            code = agent.wait(timeout=max(0.0, sigkill_at - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the agent was still running at the grace ({grace_s} s): the "
                        "kubelet's SIGKILL would have taken its exit")
    finally:
        if agent.poll() is None:
            agent.kill()
        stderr = agent.communicate()[1]
    assert code in (128 + signal.SIGTERM, 128 + signal.SIGKILL), stderr
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    assert [x["exit_status"] for x in lines if x["event"] == "exit"] == [code], stderr


@pytest.mark.parametrize("command,args", [
    (["ftagent"], ["run", "--", "python", "train.py"]),  # the agent split from its args
    (["/usr/local/bin/ftagent"], ["run", "--stop-timeout", "30", "--", "python"]),
    (["/usr/local/bin/ftagent", "run"], ["--", "python", "train.py"]),
])
def test_a_container_running_the_agent_through_args_is_not_wrapped_again(
        command: list[str], args: list[str]) -> None:
    """``command: [ftagent], args: [run, --, ...]`` already runs the agent: wrapping it
    again ran an agent under an agent (the inner one's trainer was the outer's "trainer",
    two agents per rank, each reporting to the arbiter). Before, only ``command[:2]`` was
    read, and only as ``ftagent`` or the bundle's path."""
    pod = _pod(60, command=command, args=args)
    m = mutate(copy.deepcopy(pod), "ml", SETTINGS)
    assert m.reason == "already injected" and m.patch == [], (m.reason, m.patch)
    new, _ = _patched(pod)
    assert new == pod


def test_the_own_agents_stop_timeout_is_read_from_its_args_too() -> None:
    """The stop-timeout warning for an image's own agent reads ``args`` as well."""
    _, resp = _patched(_pod(30, command=["ftagent"],
                            args=["run", "--stop-timeout", "30", "--", "python"]))
    assert any("--stop-timeout '30' is not below" in w for w in resp["warnings"])


def test_a_trainer_merely_named_like_the_agent_is_still_wrapped() -> None:
    """Only ``ftagent run`` is the agent: a script named ftagent-train, or ``ftagent``
    with another subcommand, is a trainer to wrap."""
    for command in (["ftagent-train", "run"], ["python", "-m", "ftagent_train"]):
        m = mutate(copy.deepcopy(_pod(60, command=command)), "ml", SETTINGS)
        assert m.injected, (command, m.reason)
