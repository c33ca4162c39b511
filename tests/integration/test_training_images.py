"""The injected agent in real root filesystems of training-image distributions.

Debian root filesystems built here from Debian's packages (``mmdebstrap``, minbase, cached
under ``build/roots/``): bullseye (glibc 2.31, Python 3.9), bookworm (2.36, 3.11), trixie
(2.41, 3.13), and bookworm without Python. The agent folder the init container fills
(the entry shim, the bundle ``make image`` ships: built on bullseye by
packaging/build_compat.py, the vendored wheels: packaging/build_vendor.py) is
bind-mounted read-only at /opt/ftagent, ``proc`` is mounted,
and the pod's command runs in ``chroot``, as the kubelet would run it:
``/bin/sh /opt/ftagent/ftagent-entry -- python3 -c ...``. Where the agent can start it
really wraps the trainer (its events file is written, the trainer's output and exit status
pass through); where it cannot, the trainer still runs and one stderr line says why.

Needs root, ``mmdebstrap``, ``unshare`` and ``chroot``; skipped otherwise, failed instead
when ``FTAGENT_REQUIRE_IMAGE=1`` (CI, as root).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "packaging"))
import build_compat  # noqa: E402
import build_vendor  # noqa: E402
from build_vendor import elf_floor  # noqa: E402

ROOTS = ROOT / "build" / "roots"
FLAVOURS = {  # name: (suite, packages)
    "bullseye": ("bullseye", "python3"),
    "bookworm": ("bookworm", "python3"),
    "trixie": ("trixie", "python3"),
}
# bookworm less its Python: a copy of the bookworm root with python3 purged (offline, a few
# seconds, where a fourth mmdebstrap run would take a minute)
NO_PYTHON = "bookworm-nopython"
REQUIRED = os.environ.get("FTAGENT_REQUIRE_IMAGE") == "1"
MISSING = [t for t in ("mmdebstrap", "unshare", "chroot") if shutil.which(t) is None]
if os.geteuid() != 0 or MISSING:
    why = f"needs root and {', '.join(MISSING) or 'mmdebstrap'}"
    if REQUIRED:
        pytest.fail(f"FTAGENT_REQUIRE_IMAGE=1 but {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)

# the first run builds the root filesystems and, unless `make image` did, the bullseye
# bundle (CPython compiled in a bullseye root: the long part)
pytestmark = pytest.mark.timeout(3600)

CHROOT = shutil.which("chroot") or "chroot"
# what the webhook makes the trainer container's command (ftagent/kube/inject.py)
POD_COMMAND = ["/opt/ftagent/busybox", "sh", "/opt/ftagent/ftagent-entry", "--"]
TRAINER = ("import os, sys; print('trainer', sys.version_info[:2], os.environ.get("
           "'FTAGENT_RESTART_COUNT')); sys.stderr.write('trainer-stderr\\n'); sys.exit(7)")
FALLBACK = "ftagent: not started, the trainer runs without fault tolerance: "


def mmdebstrap_argv(flavour: str) -> list[str]:
    suite, include = FLAVOURS[flavour]
    return ["mmdebstrap", "--mode=root", "--variant=minbase", "--skip=output/mknod",
            "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            *([f"--include={include}"] if include else []), suite]


def built(flavour: str) -> bool:
    stamp = ROOTS / f"{flavour}.stamp"
    return stamp.is_file() and stamp.read_text() == " ".join(mmdebstrap_argv(flavour)) and \
        (ROOTS / flavour / "bin").exists()


@contextlib.contextmanager
def roots_lock() -> Iterator[None]:
    """One builder of build/roots at a time: pytest-xdist's workers share it (this module's,
    test_injected_image's), and a second worker that found a root missing would otherwise
    remove the first one's half-built copy and build it again; it waits, then finds it
    stamped. Not reentrant: taken around each build, never around a call that takes it."""
    ROOTS.mkdir(parents=True, exist_ok=True)
    with open(ROOTS / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_roots(flavours: list[str]) -> None:
    """Build the missing root filesystems, all at once (mostly downloads and dpkg: they
    overlap well even on two cores)."""
    with roots_lock():
        _build_roots(flavours)


def _build_roots(flavours: list[str]) -> None:
    todo = [f for f in flavours if not built(f)]
    ROOTS.mkdir(parents=True, exist_ok=True)
    procs = []
    for flavour in todo:
        part = ROOTS / f"{flavour}.part"
        shutil.rmtree(part, ignore_errors=True)
        shutil.rmtree(ROOTS / flavour, ignore_errors=True)
        procs.append((flavour, part, subprocess.Popen(
            [*mmdebstrap_argv(flavour), str(part)], stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)))
    for flavour, part, proc in procs:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"mmdebstrap {flavour}: {err[-2000:]}"
        part.rename(ROOTS / flavour)
        (ROOTS / f"{flavour}.stamp").write_text(" ".join(mmdebstrap_argv(flavour)))


def root_of(flavour: str) -> Path:
    """The flavour's root filesystem, built once (a stamp names what it was built from)."""
    if flavour == NO_PYTHON:
        return without_python(root_of("bookworm"))
    build_roots([flavour])
    return ROOTS / flavour


def without_python(source: Path) -> Path:
    with roots_lock():
        return _without_python(source)


def _without_python(source: Path) -> Path:
    path, stamp = ROOTS / NO_PYTHON, ROOTS / f"{NO_PYTHON}.stamp"
    want = (ROOTS / f"{source.name}.stamp").read_text()
    if stamp.is_file() and stamp.read_text() == want and (path / "bin").exists():
        return path
    part = ROOTS / f"{NO_PYTHON}.part"
    shutil.rmtree(part, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["cp", "-a", str(source), str(part)], check=True, timeout=300)
    subprocess.run(["chroot", str(part), "apt-get", "-qq", "-y", "purge", "--auto-remove",
                    "python3-minimal"], check=True, capture_output=True, timeout=300,
                   env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                        "DEBIAN_FRONTEND": "noninteractive"})
    part.rename(path)
    stamp.write_text(want)
    return path


def musl_root() -> Path:
    """An Alpine-like root: musl's loader (Debian's ``musl``), a static busybox as the
    shell and its applets, no glibc, no Python."""
    with roots_lock():
        return _musl_root()


def _musl_root() -> Path:
    path, stamp = ROOTS / "musl", ROOTS / "musl.stamp"
    want = "busybox-static musl"
    if stamp.is_file() and stamp.read_text() == want and (path / "bin" / "sh").exists():
        return path
    debs, part = ROOTS / "musl-debs", ROOTS / "musl.part"
    for old in (debs, part, path):
        shutil.rmtree(old, ignore_errors=True)
    debs.mkdir(parents=True)
    subprocess.run(["apt-get", "download", "-q", *want.split()], cwd=debs, check=True,
                   capture_output=True, timeout=300)
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(part)], check=True, timeout=120)
    for d in ("tmp", "proc", "dev", "opt/ftagent"):
        (part / d).mkdir(parents=True, exist_ok=True)
    subprocess.run([CHROOT, str(part), "/bin/busybox", "--install", "-s", "/bin"], check=True,
                   capture_output=True, timeout=60)
    assert not (part / "lib64").exists() and (part / "lib" / "ld-musl-x86_64.so.1").exists()
    part.rename(path)
    stamp.write_text(want)
    shutil.rmtree(debs, ignore_errors=True)
    return path


@pytest.fixture(scope="module")
def agent_dir() -> Path:
    return assemble_agent_dir()


def assemble_agent_dir() -> Path:
    """What the init container copies: the shim, the bundle, the wheels (one folder).
    The root filesystems are built first, together."""
    build_roots(list(FLAVOURS))
    # the image's bundle (make image builds it first: here it is then up to date)
    bundle, vendor = build_compat.build(), build_vendor.build()
    with roots_lock():  # a worker may be removing and copying it: one at a time
        return _agent_dir(bundle, vendor)


def _agent_dir(bundle: Path, vendor: Path) -> Path:
    folder = ROOTS / "agent"
    stamp = folder / ".from"
    want = json.dumps([(bundle / "ftagent").stat().st_mtime_ns,
                       (vendor / "manifest.json").stat().st_mtime_ns,
                       (ROOT / "packaging" / "ftagent-entry.sh").read_text()])
    if stamp.is_file() and stamp.read_text() == want:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(bundle, folder, symlinks=True, ignore=shutil.ignore_patterns("py"))
    shutil.copytree(vendor, folder / "py", symlinks=True,
                    ignore=shutil.ignore_patterns(".wheels"))
    shutil.copy2(ROOT / "packaging" / "ftagent-entry.sh", folder / "ftagent-entry")
    stamp.write_text(want)
    return folder


def run_in(root: Path, agent: Path, command: list[str], tmp: Path, *,
           env: dict[str, str] | None = None, read_only: bool = False,
           noexec_tmp: bool = False, no_shell: bool = False
           ) -> subprocess.CompletedProcess[str]:
    """``/bin/sh /opt/ftagent/ftagent-entry -- COMMAND`` in ``root``, in a mount namespace
    of its own: the agent folder read-only at /opt/ftagent, /proc, and ``tmp`` (a folder of
    this host, so the test reads the agent's events file) as /tmp, unless ``read_only``:
    then the whole root, /tmp included, is read-only."""
    r = str(root)
    (root / "opt" / "ftagent").mkdir(parents=True, exist_ok=True)
    (root / "dev").mkdir(exist_ok=True)
    steps = [f"mount --bind '{r}' '{r}'", f"mount -o remount,bind,ro '{r}'"] if read_only \
        else [f"mount --bind '{tmp}' '{r}/tmp'"] + \
        ([f"mount -o remount,bind,noexec '{r}/tmp'"] if noexec_tmp else [])
    steps += [f"mount --rbind /dev '{r}/dev'",  # as a container runtime provides it
              f"mount --bind '{agent}' '{r}/opt/ftagent'",
              f"mount -o remount,bind,ro '{r}/opt/ftagent'",
              f"mount -t proc proc '{r}/proc'"]
    if no_shell:  # as in a distroless image: no program at /bin/sh (nor bash, dash)
        steps += [f"mount --bind /dev/null '{os.path.realpath(root / p)}'"
                  for p in ("bin/sh", "bin/bash") if (root / p).exists()]
    script = " && ".join(steps) + f" && exec {CHROOT} '{r}' \"$@\""
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root",
            "FTAGENT_METRICS_PORT": "-1", "FTAGENT_MAX_RESTARTS": "0",
            "FTAGENT_EVENTS_FILE": "/tmp/events.jsonl", "FTAGENT_PROBE_TIMEOUT": "120"}
    tmp.chmod(0o1777)
    argv = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh",
            *POD_COMMAND, *command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env={**base, **(env or {})})


def wrapped(r: subprocess.CompletedProcess[str], version: str, tmp: Path) -> None:
    """The agent ran: the trainer's line and status passed through, and the agent's events
    file has the trainer's start and exit."""
    assert r.returncode == 7, r.stderr[-3000:]
    assert r.stdout.splitlines() == [f"trainer ({version.replace('.', ', ')}) 0"], r.stderr
    assert FALLBACK not in r.stderr and "trainer-stderr" in r.stderr
    events = [json.loads(line) for line in (tmp / "events.jsonl").read_text().splitlines()]
    assert events, r.stderr


@pytest.mark.parametrize(("flavour", "version"), [("bookworm", "3.11"), ("trixie", "3.13")])
def test_agent_runs_on_the_images_python(flavour: str, version: str, agent_dir: Path,
                                         tmp_path: Path) -> None:
    """Python 3.10+: the wheels path, on the image's own interpreter."""
    r = run_in(root_of(flavour), agent_dir, ["python3", "-c", TRAINER], tmp_path)
    wrapped(r, version, tmp_path)


def test_without_python_the_bundle_runs(agent_dir: Path, tmp_path: Path) -> None:
    """No Python in the image (glibc 2.36): the self-contained bundle."""
    root = root_of(NO_PYTHON)
    assert not (root / "usr" / "bin" / "python3").exists()
    r = run_in(root, agent_dir, ["/bin/sh", "-c", "echo trainer-out; echo trainer-stderr >&2;"
                                 ' echo "count=$FTAGENT_RESTART_COUNT"; exit 7'], tmp_path)
    assert r.returncode == 7 and r.stdout == "trainer-out\ncount=0\n", r.stderr[-3000:]
    assert FALLBACK not in r.stderr


def test_musl_falls_back_with_one_clear_line(agent_dir: Path, tmp_path: Path) -> None:
    """musl libc (as in Alpine), no Python: neither way can start; the line says musl."""
    r = run_in(musl_root(), agent_dir, ["/bin/sh", "-c", "echo trainer-out; exit 7"],
               tmp_path)
    assert r.returncode == 7 and r.stdout == "trainer-out\n", r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    line = r.stderr.splitlines()[0]
    assert line.startswith(FALLBACK) and "image Python: no python3 on PATH" in line
    assert "musl libc (/lib/ld-musl-x86_64.so.1, as in Alpine): the bundle needs glibc" in line


def test_python_39_and_glibc_231_run_the_bundle(agent_dir: Path, tmp_path: Path) -> None:
    """bullseye: Python 3.9 (no grpcio>=1.85 wheels for it: the wheels path says so and
    steps aside) and glibc 2.31: the bundle built on bullseye runs the agent, which
    wraps the image's python3 (before: the bundle needed 2.36, the trainer ran unwrapped)."""
    r = run_in(root_of("bullseye"), agent_dir, ["python3", "-c", TRAINER], tmp_path)
    wrapped(r, "3.9", tmp_path)


def test_the_bundles_glibc_floor_is_what_the_docs_say(agent_dir: Path) -> None:
    """The floor read from the bundle's ELF files (objdump -T): bullseye's 2.31 or lower,
    and the compatibility page states it for `make image`."""
    if shutil.which("objdump") is None:
        pytest.skip("no objdump (binutils)")
    major, minor = elf_floor(agent_dir)  # the bundle, and the wheels (2.17) beside it
    assert (major, minor) <= (2, 31), (major, minor)
    page = (ROOT / "docs" / "compatibility.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| glibc"))
    assert f"`make image`: {major}.{minor}" in row, (major, minor, row)


def test_wheels_binaries_resolve_against_glibc_231(agent_dir: Path) -> None:
    """The vendored wheels' own floor (manylinux2014, glibc 2.17) checked against a real
    older glibc: bullseye's dynamic loader (2.31) finds every GLIBC_x.y symbol version the
    x86_64 wheels' shared objects need (a Python 3.10+ in such an image runs them)."""
    root = root_of("bullseye")
    sos = ["/opt/ftagent/" + str(p.relative_to(agent_dir))
           for p in sorted((agent_dir / "py" / "x86_64").rglob("*.so*")) if p.is_file()]
    assert len(sos) >= 5
    (root / "opt" / "ftagent").mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
         f"mount --bind '{agent_dir}' '{root}/opt/ftagent' && exec {CHROOT} '{root}' /bin/sh -c "
         "'for f; do echo \"== $f\"; /lib64/ld-linux-x86-64.so.2 --list \"$f\" 2>&1; done' "
         "sh \"$@\"", "sh", *sos], capture_output=True, text=True, timeout=120)
    assert r.stdout.count("== ") == len(sos), r.stderr
    assert "version `GLIBC" not in r.stdout, r.stdout


def test_read_only_root_without_tmp_falls_back(agent_dir: Path, tmp_path: Path) -> None:
    """A read-only root and no writable /tmp: the agent has nowhere for its runtime
    folder; the trainer runs and the line says so."""
    r = run_in(root_of("bookworm"), agent_dir, ["python3", "-c", TRAINER], tmp_path,
               read_only=True)
    assert r.returncode == 7 and r.stdout == "trainer (3, 11) None\n", r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith(FALLBACK) and "no writable temporary folder" in first


def test_an_image_without_a_shell(agent_dir: Path, tmp_path: Path) -> None:
    """No /bin/sh in the image (distroless): the pod's command is the static busybox
    beside the agent, so the shim runs, and the agent wraps the trainer."""
    code = "import os; print(os.access('/bin/sh', os.X_OK));" + TRAINER
    r = run_in(root_of("bookworm"), agent_dir, ["python3", "-c", code], tmp_path,
               no_shell=True)
    assert r.stdout.startswith("False\n"), r.stdout + r.stderr
    r = subprocess.CompletedProcess(r.args, r.returncode, r.stdout.split("\n", 1)[1], r.stderr)
    wrapped(r, "3.11", tmp_path)


def test_noexec_tmp_does_not_matter(agent_dir: Path, tmp_path: Path) -> None:
    r = run_in(root_of("bookworm"), agent_dir, ["python3", "-c", TRAINER], tmp_path,
               noexec_tmp=True)
    wrapped(r, "3.11", tmp_path)


def test_hostile_environment_still_starts_the_trainer(agent_dir: Path, tmp_path: Path) -> None:
    """The image sets FTAGENT_* values `ftagent run` refuses, and points the old
    FTAGENT_AGENT_BIN at a program that is not the agent: the trainer starts and one line
    names the bad value; no variable swaps the agent's program."""
    root = root_of("bookworm")
    r = run_in(root, agent_dir, ["python3", "-c", TRAINER], tmp_path,
               env={"FTAGENT_METRICS_PORT": "abc"})
    assert r.returncode == 7 and r.stdout.startswith("trainer (3, 11)"), r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith(FALLBACK) and "FTAGENT_METRICS_PORT: 'abc'" in first
    # the image's PYTHONPATH holds a grpc that breaks on import: the agent's Python (-I)
    # never reads it; the trainer's does (its environment is its own)
    (tmp_path / "grpc.py").write_text("raise ImportError('the image path leaked')\n")
    r = run_in(root, agent_dir, ["python3", "-c", TRAINER], tmp_path,
               env={"FTAGENT_AGENT_BIN": "/bin/true", "FTAGENT_PROBE_TIMEOUT": "0",
                    "PYTHONPATH": "/tmp"})
    wrapped(r, "3.11", tmp_path)


def test_the_agent_on_the_images_python_finds_its_py_spy(agent_dir: Path,
                                                         tmp_path: Path) -> None:
    """Hang evidence needs py-spy: on the wheels path it is the vendored one (ARCH/bin),
    found through the import folders launch.py puts first, and it runs in the image."""
    code = ("import json, runpy, subprocess, sys; m = runpy.run_path('/opt/ftagent/py/launch.py');"
            " sys.path[:0] = m['paths'](json.load(open('/opt/ftagent/py/manifest.json')));"
            " from ftagent.agent.evidence import find_py_spy; exe = find_py_spy();"
            " print(exe); print(subprocess.run([exe, '--version'], capture_output=True,"
            " text=True).stdout.strip())")
    r = run_in(root_of("bookworm"), agent_dir, ["python3", "-I", "-S", "-c", code], tmp_path,
               env={"FTAGENT_PROBE_TIMEOUT": "1"})  # the shim's own probe may fall back:
    lines = [x for x in r.stdout.splitlines() if x.strip()]  # only this output matters
    assert lines[:1] == ["/opt/ftagent/py/x86_64/bin/py-spy"], r.stdout + r.stderr
    assert lines[1].startswith("py-spy "), r.stdout + r.stderr
