"""The install page (docs/install.md) against what it names: every ``make`` target in its
command blocks exists in the Makefile, every repository path exists, every version is the
package's, and the objects its ``kubectl`` commands name are in the rendered default
install (names, replicas, the init container, the injected command, the example Job).
No cluster runs here: this keeps the page's commands pointing at real things."""

from __future__ import annotations

import re
import shutil

import pytest

from ftagent import __version__
from ftagent.kube import inject
from tests.conftest import ROOT

PAGE = ROOT / "docs" / "install.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(PAGE.read_text()) if kind == lang]


def commands() -> list[str]:
    """Every command line of the sh blocks (comments dropped, continuations joined)."""
    out = []
    for body in blocks("sh"):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def test_the_page_has_commands() -> None:
    assert len(commands()) >= 15, commands()


def test_every_make_target_exists() -> None:
    targets = make_targets()
    named = {m for c in commands() for m in re.findall(r"\bmake ([a-z][\w-]*)", c)}
    named |= set(re.findall(r"`make ([a-z][\w-]*)", PAGE.read_text()))
    assert {"image", "push", "deps"} <= named, named
    assert named <= targets, named - targets


def test_every_repository_path_exists() -> None:
    text = PAGE.read_text()
    paths = set(re.findall(r"(?<![\w./-])((?:deploy|packaging|\.github|tests)/[\w./-]*\w)",
                           text))
    assert "deploy/examples/indexed-job.yaml" in paths, paths
    # `kubectl logs deploy/NAME` names a Deployment, not a path (checked in the render)
    paths -= set(re.findall(r"logs (deploy/[\w-]+)", text))
    missing = [p for p in sorted(paths) if not (ROOT / p).exists()]
    assert not missing, missing
    # what the build writes, as the Makefile and packaging/ name it
    assert f"build/image/ftagent-{__version__}.oci.tar" in text
    assert "IMAGE_VENV  ?= build/image-venv" in (ROOT / "Makefile").read_text()


def test_every_version_is_the_packages() -> None:
    text = PAGE.read_text()
    versions = set(re.findall(r"ftagent[-:](\d+\.\d+\.\d+)", text))
    versions |= set(re.findall(r"(?:newTag: |ref=v)(\d+\.\d+\.\d+)", text))
    assert versions == {__version__}, versions


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) missing")
def test_the_objects_it_names_are_in_the_render() -> None:
    from tests.integration.test_deploy import DEFAULT, render

    objs = {(o["kind"], o["metadata"]["name"]): o for o in render(DEFAULT)}
    ns = "ftagent-system"
    assert ("Namespace", ns) in objs
    for kind, name in (("Deployment", "ftagent-arbiter"), ("Deployment", "ftagent-webhook"),
                       ("DaemonSet", "ftagent-node"),
                       ("MutatingWebhookConfiguration", "ftagent"),
                       ("Service", "ftagent-arbiter")):
        assert (kind, name) in objs, (kind, name)
        assert f"{name}" in PAGE.read_text()
    for name in re.findall(r"logs deploy/([\w-]+)", PAGE.read_text()):
        assert ("Deployment", name) in objs, name
    # "2/2 READY" for both Deployments
    for name in ("ftagent-arbiter", "ftagent-webhook"):
        assert objs[("Deployment", name)]["spec"]["replicas"] == 2
        assert f"{name}   2/2" in PAGE.read_text()
    arbiter = objs[("Deployment", "ftagent-arbiter")]["spec"]["template"]["spec"]
    assert "--tls-secret=ftagent-arbiter-tls" in arbiter["containers"][0]["args"]
    # the components the page names
    for comp in set(re.findall(r"`(?:- components/)?([a-z-]+)` component", PAGE.read_text())):
        assert (ROOT / "deploy" / "components" / comp).is_dir(), comp
    # the injected pod as the page describes it
    assert f"`{inject.INIT_NAME}`" in PAGE.read_text()
    shim = f"/opt/ftagent/{inject.SHELL} sh /opt/ftagent/{inject.ENTRY}"
    assert shim in " ".join(PAGE.read_text().split())
    # the example Job: `-l job-name=rdma-train`, container `-c trainer`, `pgrep -f train.py`
    import yaml

    job = next(d for d in yaml.safe_load_all(
        (ROOT / "deploy" / "examples" / "indexed-job.yaml").read_text())
        if d and d["kind"] == "Job")
    assert f"job-name={job['metadata']['name']}" in PAGE.read_text()
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert f"-c {container['name']}" in PAGE.read_text()
    assert "train.py" in " ".join(container["command"])
