"""The package as a user gets it: ``python -m build`` makes an sdist and, from that sdist, a
wheel; the wheel installed into a fresh virtualenv (the package alone: its dependencies come
from the project's virtualenv through a .pth line, so no index is needed) runs
``ftagent --version`` and supervises ``true``.

Building the wheel from the sdist (``python -m build``'s default) also checks that the
sdist holds everything the wheel needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import ftagent
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the build backend from this virtualenv, no index needed
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                        str(ROOT)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def only(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def test_wheel_and_sdist_carry_the_version_and_the_license(dist: Path) -> None:
    v = ftagent.__version__
    wheel = only(dist, f"ftagent-{v}-py3-none-any.whl")
    sdist = only(dist, f"ftagent-{v}.tar.gz")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(f"ftagent-{v}.dist-info/METADATA").decode()
    assert f"ftagent-{v}.dist-info/licenses/LICENSE" in names
    assert "ftagent/v1/ftagent_pb2.pyi" in names  # package data, not only .py
    assert "ftagent/agent/standby_boot.py" in names  # the warm standby runs it by path
    assert f"\nVersion: {v}\n" in meta
    assert "\nLicense-Expression: Apache-2.0\n" in meta
    with tarfile.open(sdist) as t:
        members = {m.split("/", 1)[1] for m in t.getnames() if "/" in m}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml",
            "proto/ftagent/v1/ftagent.proto", "ftagent/cli.py"} <= members


def test_wheel_installs_into_a_fresh_venv_and_runs(dist: Path, tmp_path: Path) -> None:
    v = ftagent.__version__
    wheel = only(dist, f"ftagent-{v}-py3-none-any.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                        "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    # The dependencies: this virtualenv's site-packages, after the new venv's own (a .pth
    # line appends it), so `ftagent` itself comes from the wheel, not from the checkout.
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: val for k, val in os.environ.items()
           if not k.startswith(("FTAGENT_", "PYTHON", "VIRTUAL_ENV"))}
    where = subprocess.run([str(py), "-c", "import ftagent; print(ftagent.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    exe = venv / "bin" / "ftagent"
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=60)
    assert (r.returncode, r.stdout) == (0, f"ftagent {v}\n"), r.stderr
    r = subprocess.run([str(exe), "run", "--metrics-port=-1", "--", "true"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = subprocess.run([str(exe), "run", "--metrics-port=-1", "--", "sh", "-c", "exit 7"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 7, r.stdout[-2000:] + r.stderr[-2000:]
