"""The self-contained agent (``make bundle``), run where no Python package is to be found,
wrapping a trainer whose ``sys.path`` and environment must be exactly those of a direct run.

Where the test may (root, ``unshare``), the run happens in a mount namespace in which the
virtualenv and the Python the bundle was built from are hidden under empty tmpfs mounts, so
anything the bundle still took from them would fail. The trainer is the distribution's
own Python, as a training image's would be.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ftagent.agent.flight_recorder import fr_env
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "packaging"))
import build_bundle  # noqa: E402

TRAINER_PY = shutil.which("python3", path="/usr/bin:/bin")
TRAINER = """
import json, os, sys
json.dump({"path": sys.path, "env": dict(os.environ), "exe": sys.executable},
          open(sys.argv[1], "w"))
"""
# What ftagent adds to the trainer's environment on purpose (README, "The supervisor").
ADDED = ("FTAGENT_",)

pytestmark = pytest.mark.skipif(TRAINER_PY is None, reason="no system python3 for the trainer")


@pytest.fixture(scope="module")
def bundle() -> Path:
    return build_bundle.build() / "ftagent"


def hidden_dirs() -> list[str]:
    """The virtualenv and the build Python's installation: hidden from the bundle's run."""
    base = Path(os.path.realpath(sys.executable)).parent.parent
    return sorted({str(ROOT / ".venv"), str(base)} - {"/usr", "/"})


def can_hide() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


def run_isolated(argv: list[str], env: dict[str, str],
                 cwd: Path) -> subprocess.CompletedProcess[str]:
    if can_hide():
        mounts = "".join(f"mount -t tmpfs none '{d}' && " for d in hidden_dirs()
                         if os.path.isdir(d))
        check = "! test -e '%s/bin/python' && " % (ROOT / ".venv")
        argv = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                mounts + check + 'exec "$@"', "sh", *argv]
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def view(result_file: Path) -> dict[str, Any]:
    return dict(json.loads(result_file.read_text()))


@pytest.mark.parametrize("with_ld_path", [True, False])
def test_trainer_sees_what_a_direct_run_sees(bundle: Path, tmp_path: Path,
                                             with_ld_path: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "psutil.py").write_text("raise ImportError('the trainer path leaked into ftagent')\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(lib),
           "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8", "PWD": str(tmp_path)}
    if with_ld_path:
        env["LD_LIBRARY_PATH"] = f"{lib}:/opt/nvidia/lib"
    assert TRAINER_PY is not None
    direct = subprocess.run([TRAINER_PY, str(script), str(tmp_path / "d")], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert direct.returncode == 0, direct.stderr
    wrapped = run_isolated([str(bundle), "run", "--metrics-port", "-1", "--", TRAINER_PY,
                            str(script), str(tmp_path / "w")], env, tmp_path)
    assert wrapped.returncode == 0, wrapped.stderr[-3000:]
    d, w = view(tmp_path / "d"), view(tmp_path / "w")
    assert w["path"] == d["path"] and w["exe"] == d["exe"]
    # the flight recorder's (agent/flight_recorder.py): torch's variables, and its
    # trigger first on PYTHONPATH (but not on the program's sys.path, compared above)
    fr = set(fr_env({}, 1, "/x")) - {"PYTHONPATH"}
    added = {k for k in w["env"] if k.startswith(ADDED) or k in fr}
    seen = {k: v for k, v in w["env"].items() if k not in added}
    ours, theirs = seen["PYTHONPATH"].split(os.pathsep, 1)
    assert ours.endswith("/fr/site")
    assert {**seen, "PYTHONPATH": theirs} == d["env"]
    assert "FTAGENT_RESTART_COUNT" in added  # the agent did wrap it
    assert not any(k.startswith("_PYI") or k.endswith("_ORIG") for k in w["env"])


def test_exit_status_and_restarts_from_the_bundle(bundle: Path, tmp_path: Path) -> None:
    r = run_isolated([str(bundle), "run", "--metrics-port", "-1", "--max-restarts", "1",
                      "--restart-backoff", "0", "--", "/bin/sh", "-c",
                      'echo "attempt $FTAGENT_RESTART_COUNT"; exit 7'],
                     {"PATH": "/usr/bin:/bin"}, tmp_path)
    assert r.returncode == 7, r.stderr[-3000:]
    assert r.stdout.split("\n")[:2] == ["attempt 0", "attempt 1"]
    assert "Traceback" not in r.stderr


def test_bundle_has_py_spy_beside_it(bundle: Path) -> None:
    assert (bundle.parent / "py-spy").is_file()
    r = subprocess.run([str(bundle), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("ftagent ")


def test_warm_restart_from_the_bundle(bundle: Path, tmp_path: Path) -> None:
    """The bundle carries the standby bootstrap (data, not code the bundle runs): the
    system Python's trainer restarts warm, and sees a fresh start's argv and path."""
    script = tmp_path / "train.py"
    script.write_text("import json, os, sys, time\n"
                      "n = int(os.environ['FTAGENT_RESTART_COUNT'])\n"
                      "print('attempt', n, sys.argv[1:], sys.path[0] == os.path.dirname("
                      "os.path.abspath(__file__)), flush=True)\n"
                      "print('step=1 loss=1.0', flush=True)\n"  # the standby starts now
                      "def standby():\n"
                      "    for p in filter(str.isdigit, os.listdir('/proc')):\n"
                      "        try:\n"
                      "            st = open('/proc/%s/stat' % p).read().rsplit(')', 1)[1]\n"
                      "            c = open('/proc/%s/cmdline' % p, 'rb').read()\n"
                      "        except OSError:\n"
                      "            continue\n"
                      "        if int(st.split()[1]) == os.getppid() and b'ftagent_standby' in c:\n"
                      "            return True\n"
                      "t = time.monotonic() + 60\n"
                      "while n == 0 and not standby() and time.monotonic() < t:\n"
                      "    time.sleep(0.01)\n"
                      "sys.exit(7 if n == 0 else 0)\n")
    events = tmp_path / "events.jsonl"
    assert TRAINER_PY is not None
    r = run_isolated([str(bundle), "run", "--metrics-port", "-1", "--max-restarts", "1",
                      "--events-file", str(events), "--warm-imports", "json",
                      "--", TRAINER_PY, str(script), "--lr", "3"],
                     {"PATH": "/usr/bin:/bin"}, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:4:2] == ["attempt 0 ['--lr', '3'] True",
                                          "attempt 1 ['--lr', '3'] True"]
    starts = [json.loads(x) for x in events.read_text().splitlines()
              if json.loads(x)["event"] == "standby"]
    assert [s["kind"] for s in starts][-1:] == ["warm"], starts


def glibc_floor(root: Path) -> tuple[int, int]:
    """The newest ``GLIBC_x.y`` symbol version any binary of the bundle needs: the oldest
    glibc a training image may have for the injected agent to start there."""
    newest = (2, 0)
    for f in root.parent.rglob("*"):
        if not f.is_file() or f.is_symlink():
            continue
        with f.open("rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        out = subprocess.run(["objdump", "-T", str(f)], capture_output=True, text=True,
                             timeout=60).stdout
        for major, minor in re.findall(r"\bGLIBC_(\d+)\.(\d+)\b", out):
            newest = max(newest, (int(major), int(minor)))
    return newest


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
def test_the_glibc_floor_the_docs_state_is_the_bundles(bundle: Path) -> None:
    """Issue 21: a training image with an older glibc than the bundle needs cannot start
    the agent (the entry shim then runs the trainer without it). The compatibility page
    states the floor of the bundle `make bundle` builds here (the build machine's glibc;
    `make image` ships the bullseye-built one: test_training_images.py checks its floor);
    this reads it from the binaries, so the page cannot drift."""
    major, minor = glibc_floor(bundle)
    page = (ROOT / "docs" / "compatibility.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| glibc"))
    assert f"make bundle`: {major}.{minor}" in row, (f"bundle needs glibc {major}.{minor}", row)
