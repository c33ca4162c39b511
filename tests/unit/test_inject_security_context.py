"""Injection never blocks a pod through its securityContext (issue 32): the injected init
container runs under every combination of pod-level and container-level ``runAsUser``,
``runAsNonRoot`` and ``runAsGroup`` the API accepts, and Windows pods are left alone.

The kubelet's check is written out here (``pkg/kubelet/kuberuntime``: ``verifyRunAsNonRoot``
over ``securitycontext.DetermineEffectiveSecurityContext``), independently of inject.py:
the container's own field wins, the pod's fills what the container leaves unset, and with
``runAsNonRoot`` true an effective UID 0, or no UID and an image USER that is root or not
numeric, is refused (CreateContainerConfigError: the pod never starts)."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from ftagent.kube.inject import INIT_NAME, Settings, init_security_context, mutate
from tests.webhook_pods import example_pods

SETTINGS = Settings(image="ftagent:test", arbiter="arbiter.ftagent:9400",
                    arbiter_ca=lambda: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END "
                    "CERTIFICATE-----")
IMAGE_USER = "65532:65532"  # the ftagent image's USER (tests/integration/test_image.py)
INHERITED = ("runAsUser", "runAsGroup", "runAsNonRoot", "seLinuxOptions", "windowsOptions",
             "seccompProfile", "appArmorProfile")


def effective(pod_sc: dict[str, Any] | None, sc: dict[str, Any] | None) -> dict[str, Any]:
    """DetermineEffectiveSecurityContext: the container's fields, the pod's where unset."""
    out = dict(sc or {})
    for key in INHERITED:
        if key not in out and key in (pod_sc or {}):
            out[key] = (pod_sc or {})[key]
    return out


def kubelet_refuses(pod_sc: dict[str, Any] | None, sc: dict[str, Any] | None,
                    image_user: str = IMAGE_USER) -> str:
    """verifyRunAsNonRoot: why the kubelet would not start this container ("" : it starts)."""
    eff = effective(pod_sc, sc)
    if not eff.get("runAsNonRoot"):
        return ""
    if eff.get("runAsUser") is not None:
        return "runAsUser breaks non-root policy" if eff["runAsUser"] == 0 else ""
    user = image_user.split(":")[0]
    if not user.isdigit():
        return f"image has non-numeric user ({user})" if user else "image will run as root"
    return "image will run as root" if int(user) == 0 else ""


def test_the_model_refuses_what_the_kubelet_refuses() -> None:
    """The checker itself: the issue's pod (pod-level runAsUser 0 under a container's
    runAsNonRoot) is refused; the image's user, a named or root image user likewise."""
    assert kubelet_refuses({"runAsUser": 0}, {"runAsNonRoot": True})
    assert not kubelet_refuses({"runAsUser": 0}, {"runAsNonRoot": True, "runAsUser": 7})
    assert not kubelet_refuses(None, {"runAsNonRoot": True})
    assert kubelet_refuses(None, {"runAsNonRoot": True}, image_user="ftagent")
    assert kubelet_refuses(None, {"runAsNonRoot": True}, image_user="0:0")
    assert not kubelet_refuses({"runAsUser": 0}, {})


BASE = next(p for p in example_pods() if p.example == "pytorchjob.yaml").pod
UIDS = (None, 0, 1000)
NON_ROOT = (None, True, False)
GIDS = (None, 0, 1000)
POD_LEVEL = [{k: v for k, v in (("runAsUser", u), ("runAsNonRoot", n), ("runAsGroup", g))
              if v is not None} for u, n, g in itertools.product(UIDS, NON_ROOT, GIDS)]
CONTAINER_LEVEL = [None, {"runAsUser": 0, "runAsNonRoot": False},
                   {"runAsUser": 1000, "runAsGroup": 0, "runAsNonRoot": True},
                   {"runAsNonRoot": True}, {"runAsGroup": 0, "privileged": True}]


def _pod(pod_sc: dict[str, Any], sc: dict[str, Any] | None) -> dict[str, Any]:
    pod = copy.deepcopy(BASE)
    if pod_sc:
        pod["spec"]["securityContext"] = pod_sc
    for c in pod["spec"]["containers"]:
        if sc is not None:
            c["securityContext"] = dict(sc)
    # a user init container of its own, root and not checked: never ours to change
    pod["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox",
                                      "command": ["true"],
                                      "securityContext": {"runAsUser": 0}}]
    return pod


@pytest.mark.parametrize("pod_sc", POD_LEVEL, ids=[str(p) for p in POD_LEVEL])
@pytest.mark.parametrize("sc", CONTAINER_LEVEL, ids=[str(c) for c in CONTAINER_LEVEL])
def test_the_init_container_runs_under_any_security_context(
        pod_sc: dict[str, Any], sc: dict[str, Any] | None) -> None:
    before = _pod(pod_sc, sc)
    m = mutate(copy.deepcopy(before), "ml", SETTINGS)
    assert m.injected, m.status
    pod = jsonpatch.apply_patch(before, m.patch)
    init = next(c for c in pod["spec"]["initContainers"] if c["name"] == INIT_NAME)
    assert kubelet_refuses(pod["spec"].get("securityContext"), init["securityContext"]) == ""
    # the pod's own containers, init containers and pod-level settings are not touched
    assert pod["spec"].get("securityContext") == before["spec"].get("securityContext")
    assert [c.get("securityContext") for c in pod["spec"]["containers"]] == \
        [c.get("securityContext") for c in before["spec"]["containers"]]
    assert pod["spec"]["initContainers"][1:] == before["spec"]["initContainers"]
    # still restricted on its own, and named UIDs only where the pod's would be root
    sc_init = init["securityContext"]
    assert sc_init["runAsNonRoot"] is True and sc_init["allowPrivilegeEscalation"] is False
    assert sc_init["capabilities"] == {"drop": ["ALL"]}
    if pod_sc.get("runAsUser") == 0:
        assert sc_init["runAsUser"] == 65532
    else:  # OpenShift's restricted SCC refuses a UID outside the namespace's range
        assert "runAsUser" not in sc_init
    # and the API's schema takes the result
    kubernetes_validate.validate(pod, "1.30", strict=True)


def test_the_issue_pod_was_refused_before() -> None:
    """The old init context (runAsNonRoot, no UID) under the issue's pod-level
    ``runAsUser: 0``: refused by the kubelet; the new one is not."""
    old = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
           "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"},
           "readOnlyRootFilesystem": True}
    assert kubelet_refuses({"runAsUser": 0}, old)
    spec = {"securityContext": {"runAsUser": 0}}
    assert kubelet_refuses(spec["securityContext"], init_security_context(spec)) == ""


@pytest.mark.parametrize("garbage", ["0", None, -1, True, 1.5, {"x": 1}])
def test_a_pod_uid_that_is_no_known_non_root_gets_the_image_uid(garbage: Any) -> None:
    """Mutation runs before validation: whatever sits there, the init container's UID is
    one the kubelet accepts."""
    ctx = init_security_context({"securityContext": {"runAsUser": garbage}})
    assert ctx["runAsUser"] == 65532
    assert "runAsUser" not in init_security_context({"securityContext": "not a dict"})
    assert "runAsUser" not in init_security_context({})


@pytest.mark.parametrize("spec_part", [{"os": {"name": "windows"}},
                                       {"nodeSelector": {"kubernetes.io/os": "windows"}}],
                         ids=["os.name", "nodeSelector"])
def test_windows_pods_are_left_alone(spec_part: dict[str, Any]) -> None:
    """The API refuses seccompProfile, capabilities or runAsUser on any container of a pod
    with ``os.name: windows``, and /bin/sh is not there: skipped, only the annotation says
    why."""
    before = copy.deepcopy(BASE)
    before["spec"].update(copy.deepcopy(spec_part))
    m = mutate(copy.deepcopy(before), "ml", SETTINGS)
    assert m.reason == "not linux" and m.warnings
    pod = jsonpatch.apply_patch(before, m.patch)
    assert pod["spec"] == before["spec"]
    assert pod["metadata"]["annotations"]["ftagent.io/injected"].startswith("skipped: not linux")
    linux = copy.deepcopy(BASE)
    linux["spec"]["os"] = {"name": "linux"}
    assert mutate(linux, "ml", SETTINGS).injected
