"""Build the self-contained agent (``make bundle``): ``build/bundle/ftagent/`` holds the
``ftagent`` program with its own Python and libraries (PyInstaller, one folder: nothing to
unpack at each start), ``py-spy`` beside it, the entry shim ``ftagent-entry`` and
``busybox``, a static one: the pod's command is ``busybox sh ftagent-entry -- ...``.
glibc is the program's only host dependency, so build it on the oldest glibc it should run
on (the Dockerfile's base; docs/compatibility.md has the measured floors).

Skips the build when its inputs (ftagent/, packaging/, pyproject.toml, the Python) are
unchanged since the last one (a hash in build/bundle/inputs.sha256).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# packaging/build_compat.py runs this in an old-glibc root with its own output folder
OUT = Path(os.environ.get("FTAGENT_BUNDLE_OUT") or ROOT / "build" / "bundle")
DIST = OUT / "ftagent"
STAMP = OUT / "inputs.sha256"
# Not for `ftagent run`: the webhook's and the tests' dependencies stay out of the bundle.
EXCLUDE = ["kubernetes", "cryptography", "yaml", "torch", "numpy", "hypothesis", "pytest",
           "jsonpatch", "jsonschema", "kubernetes_validate", "tkinter", "grpc_tools",
           "setuptools", "pip", "mypy", "ftagent.demo", "ftagent.report", "matplotlib", "PIL"]


def inputs_hash() -> str:
    h = hashlib.sha256(sys.version.encode())
    files = sorted([*ROOT.glob("ftagent/**/*.py"), *ROOT.glob("packaging/*.py"),
                    ROOT / "packaging" / "ftagent-entry.sh",
                    ROOT / "pyproject.toml"])
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def build() -> Path:
    """One build at a time: pytest-xdist's workers (and two makes) share build/, and
    the second waits for the first's result instead of building over it."""
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build()


def _build() -> Path:
    digest = inputs_hash()
    if (DIST / "ftagent").is_file() and STAMP.is_file() and STAMP.read_text() == digest:
        return DIST
    work = OUT / "work"
    cmd = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--clean", "--onedir",
           "--name", "ftagent", "--distpath", str(OUT), "--workpath", str(work),
           "--specpath", str(work), "--log-level", "WARN",
           "--runtime-hook", str(ROOT / "packaging" / "rthook_env.py"),
           "--collect-submodules", "ftagent", "--paths", str(ROOT),
           # warm restarts: the trainer's own Python runs this file by path (a copy)
           "--add-data", f"{ROOT / 'ftagent' / 'agent' / 'standby_boot.py'}:ftagent/agent",
           # the flight-recorder trigger: copied as the trainer's sitecustomize.py
           "--add-data", f"{ROOT / 'ftagent' / 'agent' / 'fr_boot.py'}:ftagent/agent"]
    for mod in EXCLUDE:
        cmd += ["--exclude-module", mod]
    subprocess.run([*cmd, str(ROOT / "packaging" / "entry.py")], check=True, cwd=ROOT)
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy:  # evidence.find_py_spy looks beside sys.executable: the bundle's program
        shutil.copy2(py_spy, DIST / "py-spy")
    shutil.copy2(ROOT / "packaging" / "ftagent-entry.sh", DIST / "ftagent-entry")  # the shim
    shell = static_shell()
    if shell is not None:  # the shim's shell, for images without one (distroless)
        shutil.copy2(shell, DIST / "busybox")
        (DIST / "busybox").chmod(0o755)
    STAMP.write_text(digest)
    return DIST


def static_shell() -> Path | None:
    """A statically linked busybox (Debian's ``busybox-static``, fetched with ``apt-get
    download``, not installed: it would replace the dynamic ``busybox``): the pod's
    command runs the shim with its ``sh``, so the shim runs in images that have no
    ``/bin/sh`` (its applets: the shim's ``sleep`` where the image has none). None, with a
    warning, where apt cannot fetch it (``make image`` then fails: its pods need it)."""
    folder = OUT.parent / "static-sh"
    exe = folder / "root" / "bin" / "busybox"
    if exe.is_file():
        return exe
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        subprocess.run(["apt-get", "download", "-q", "busybox-static"], cwd=folder,
                       check=True, capture_output=True, timeout=300)
        (deb,) = folder.glob("busybox-static_*.deb")
        subprocess.run(["dpkg-deb", "-x", str(deb), str(folder / "root")], check=True,
                       capture_output=True, timeout=120)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        print(f"build_bundle: no static shell (apt-get download busybox-static: {e}); "
              "pods will use their image's /bin/sh", file=sys.stderr)
        return None
    return exe if exe.is_file() else None


if __name__ == "__main__":
    print(build() / "ftagent")
