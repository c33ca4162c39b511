"""The Kubernetes floor the docs state is what the install needs (issue 32): every object of
the default install and of each component validates against the schemas (offline, strict:
no field a version does not know) of every Kubernetes release from the stated floor to the
newest one kubernetes-validate ships, and the release below the floor refuses the default
install. Before: the docs said 1.27, and 1.27 to 1.29 have no ValidatingAdmissionPolicy v1.
"""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest

from tests.conftest import ROOT
from tests.integration.test_deploy import CUSTOM_KINDS, DEFAULT, kustomize, needs_kubectl, render

# Every component at once (each optional one patches or adds; cert-manager replaces the
# webhook's self-signed certificate, so it is its own render).
EVERYTHING = ("arbiter", "webhook", "node", "node-kmsg", "nvidia-gpu-operator", "monitoring",
              "network-policies", "image-pull-secret", "critical-priority")
WITH_CERT_MANAGER = ("arbiter", "webhook", "cert-manager", "node", "critical-priority")


def stated_floor() -> str:
    """The floor docs/install.md states ("Kubernetes 1.30 or later")."""
    text = (ROOT / "docs" / "install.md").read_text()
    (floor,) = re.findall(r"Kubernetes (\d+\.\d+) or later", text)
    return str(floor)


def releases() -> list[str]:
    """Every Kubernetes minor release kubernetes-validate has schemas for, oldest first."""
    found = {tuple(int(x) for x in v.split(".")[:2])
             for v in kubernetes_validate.utils.all_versions()}
    return [f"{a}.{b}" for a, b in sorted(found)]


def refusals(objs: list[dict[str, Any]], version: str) -> list[str]:
    out = []
    for o in objs:
        if o["kind"] in CUSTOM_KINDS:  # CRDs: no schema in any release
            continue
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except (kubernetes_validate.ValidationError,
                kubernetes_validate.utils.SchemaNotFoundError) as e:
            out.append(f"{o['kind']} {o['metadata']['name']}: {type(e).__name__} "
                       f"{str(e).splitlines()[0] if str(e) else ''}")
    return out


def test_the_docs_state_the_floor_the_tests_use() -> None:
    assert stated_floor() == "1.30"
    compat = (ROOT / "docs" / "compatibility.md").read_text()
    assert "| Kubernetes | 1.30 or later" in compat
    newest = releases()[-1]
    assert f"1.30–{newest} schemas" in compat, newest  # says what was validated


@needs_kubectl
@pytest.mark.parametrize("components", [DEFAULT, EVERYTHING, WITH_CERT_MANAGER],
                         ids=["default", "everything", "cert-manager"])
def test_every_release_from_the_floor_takes_the_install(components: tuple[str, ...]) -> None:
    floor = stated_floor()
    versions = releases()
    supported = versions[versions.index(floor):]
    assert len(supported) >= 2
    objs = render(components, "ml-platform")
    for version in supported:
        assert refusals(objs, version) == [], version


@needs_kubectl
def test_the_release_below_the_floor_refuses_the_default_install() -> None:
    """The floor is not lower than the install needs: below it the default install's
    ValidatingAdmissionPolicy (v1) does not exist; what the docs said before (1.27) too."""
    objs = kustomize("deploy")
    versions = releases()
    below = versions[versions.index(stated_floor()) - 1]
    for version in (below, "1.27"):
        refused = refusals(objs, version)
        assert refused and all(r.startswith("ValidatingAdmissionPolicy") for r in refused), \
            (version, refused)
