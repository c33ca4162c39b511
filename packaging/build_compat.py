"""The self-contained agent built on an old glibc (``make bundle-compat``; ``make image``
ships it): ``build/bundle-compat/ftagent/``, the same program as packaging/build_bundle.py
makes, with a glibc floor of 2.31 (Debian bullseye) instead of the build machine's.

The bundle needs the glibc it was built on and newer: its Python, libpython and the C
libraries it copies link against the build root's. Debian's oldest root with a Python the
agent runs on (3.10+) is bookworm (2.36), so this builds one, without a container runtime,
the way the official ``python:3.11-slim-bullseye`` image does (the Dockerfile's base):

1. a bullseye root filesystem (``mmdebstrap``, Debian's packages) with a C compiler and the
   headers of the libraries CPython's modules link (OpenSSL 1.1, zlib, libffi, bz2, lzma,
   SQLite);
   the apt sources of the root, its suite renamed to trixie, as ``deb-src``: CPython's
   source is trixie's ``python3.13`` source package (``apt-get source``, its upstream
   tarball, 3.13.5; Debian's own patches are not applied);
2. CPython built there (``--enable-shared``: PyInstaller needs libpython; no tests, no
   profile-guided build; about 40 minutes on the shared, loaded 2-core machine it was
   written on, an idle one not measured), installed at ``/opt/python``;
3. the agent's runtime dependencies and PyInstaller as manylinux2014 wheels at the lock's
   versions (``pip download`` here, installed there with ``--no-index``);
4. packaging/build_bundle.py run there by that Python, on this checkout (bind-mounted
   read-only), into ``build/bundle-compat/``.

Each step is kept while its inputs are unchanged (a stamp per step); the last is redone when
ftagent's sources change, as ``make bundle`` is. Needs root, ``mmdebstrap``, ``unshare``,
``chroot``. The glibc floor of the result is read from its ELF files (``objdump -T``) and
written to ``build/bundle-compat/ftagent/glibc-floor``; docs/compatibility.md has it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "packaging"))
import build_bundle  # noqa: E402
import build_vendor  # noqa: E402

SUITE = "bullseye"  # glibc 2.31: the oldest Debian suite the registry here still serves
# where CPython's source comes from: trixie's python3.13 (3.13.5; bookworm's 3.11.2 is
# older than the security fixes Debian applies as patches, which are not applied here)
SOURCE_SUITE = "trixie"
PYTHON_SOURCE = "python3.13"
PY = "3.13"
BUILD_DEPS = ["gcc", "make", "libc6-dev", "binutils", "xz-utils", "ca-certificates",
              "libssl-dev", "zlib1g-dev", "libffi-dev", "libbz2-dev", "liblzma-dev",
              "libsqlite3-dev",  # pyroute2 (the NIC watch) imports sqlite3
              "busybox-static"]
HOUSE = ROOT / "build" / "compat"
BROOT = HOUSE / "root"
OUT = ROOT / "build" / "bundle-compat"
DIST = OUT / "ftagent"
PREFIX = "/opt/python"
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "HOME": "/root", "LC_ALL": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}


def log(msg: str) -> None:
    print(f"build_compat: {msg}", file=sys.stderr, flush=True)


def stamped(name: str, want: str) -> bool:
    stamp = HOUSE / f"{name}.stamp"
    return stamp.is_file() and stamp.read_text() == want


def stamp(name: str, want: str) -> None:
    (HOUSE / f"{name}.stamp").write_text(want)


def chroot(script: str, *, binds: dict[Path, str] | None = None, timeout: int = 1800,
           ro: tuple[str, ...] = ()) -> None:
    """``sh -c SCRIPT`` in the build root, in a mount namespace of its own: /proc, /dev and
    ``binds`` (host path: path in the root; those in ``ro`` read-only)."""
    r = str(BROOT)
    steps = [f"mount -t proc proc '{r}/proc'", f"mount --rbind /dev '{r}/dev'"]
    for host, inside in (binds or {}).items():
        (BROOT / inside.lstrip("/")).mkdir(parents=True, exist_ok=True)
        steps.append(f"mount --bind '{host}' '{r}{inside}'")
        if inside in ro:
            steps.append(f"mount -o remount,bind,ro '{r}{inside}'")
    outer = " && ".join(steps) + f" && exec chroot '{r}' /bin/sh -ec \"$1\""
    subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", outer,
                    "sh", script], check=True, timeout=timeout, env=ENV)


def build_root() -> None:
    """Step 1: the bullseye root with the build dependencies."""
    want = " ".join([SUITE, *BUILD_DEPS])
    if stamped("root", want) and (BROOT / "bin").exists():
        return
    log(f"the {SUITE} build root (mmdebstrap: a few minutes)")
    part = HOUSE / "root.part"
    for old in (part, BROOT):
        shutil.rmtree(old, ignore_errors=True)
    HOUSE.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mmdebstrap", "--mode=root", "--variant=minbase", "--skip=output/mknod",
                    "--dpkgopt=path-exclude=/usr/share/doc/*",
                    "--dpkgopt=path-exclude=/usr/share/man/*",
                    "--dpkgopt=path-exclude=/usr/share/locale/*",
                    f"--include={','.join(BUILD_DEPS)}", SUITE, str(part)],
                   check=True, timeout=1800, env=ENV, stdout=subprocess.DEVNULL)
    part.rename(BROOT)
    stamp("root", want)


def fetch_source() -> None:
    """Step 1b: CPython's source at /usr/src/cpython: the root's own apt sources (the
    mirror mmdebstrap chose: none is named here), the first line again as ``deb-src`` of
    SOURCE_SUITE, ``apt-get source --download-only``, the upstream tarball unpacked."""
    want = (HOUSE / "root.stamp").read_text() + f" {SOURCE_SUITE} {PYTHON_SOURCE}"
    if stamped("source", want) and (BROOT / "usr/src/cpython/configure").is_file():
        return
    log(f"{PYTHON_SOURCE}'s source package from {SOURCE_SUITE}")
    resolv = Path("/etc/resolv.conf")
    if resolv.is_file():  # name resolution for apt in the root (mmdebstrap removed it)
        shutil.copy2(resolv, BROOT / "etc" / "resolv.conf")
    chroot(f'sed -n "1s/^deb \\([^ ]*\\) {SUITE} /deb-src \\1 {SOURCE_SUITE} /p"'
           " /etc/apt/sources.list > /etc/apt/sources.list.d/src.list"
           " && apt-get -qq update && rm -rf /usr/src/dl /usr/src/cpython /tmp/b"
           " && mkdir -p /usr/src/dl /usr/src/cpython && cd /usr/src/dl"
           f" && apt-get -qq source --download-only {PYTHON_SOURCE}"
           f" && tar -xf {PYTHON_SOURCE}_*.orig.tar.xz -C /usr/src/cpython"
           " --strip-components=1"
           " && cd / && rm -rf /usr/src/dl /etc/apt/sources.list.d/src.list"
           " && apt-get -qq update")
    stamp("source", want)


def build_python() -> None:
    """Step 2: CPython from source in the root, at /opt/python (with pip: ensurepip's
    own wheel, offline)."""
    want = (HOUSE / "source.stamp").read_text() + f" {PREFIX}"
    exe = BROOT / PREFIX.lstrip("/") / "bin" / f"python{PY}"
    if stamped("python", want) and exe.is_file():
        return
    log(f"CPython {PY} from source in the {SUITE} root (the long step)")
    jobs = os.cpu_count() or 2
    # /tmp/b is kept until the build is done: an interrupted build resumes (make)
    chroot(f"mkdir -p /tmp/b && cd /tmp/b && {{ [ -f Makefile ] ||"
           f" /usr/src/cpython/configure -q --prefix={PREFIX} --enable-shared"
           f" --disable-test-modules --with-ensurepip=install"
           f" LDFLAGS=-Wl,-rpath,{PREFIX}/lib > /dev/null; }}"
           f" && make -s -j{jobs} > /dev/null 2> /tmp/make.err"
           f" && make -s install > /dev/null 2>> /tmp/make.err"
           f" && rm -rf /tmp/b {PREFIX}/lib/python{PY}/test"
           f" && {PREFIX}/bin/python{PY} -c 'import ssl, zlib, ctypes, bz2, lzma, sqlite3'",
           timeout=4 * 3600)  # minutes on an idle machine; far more on a loaded one
    stamp("python", want)


def wheels_hash() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    for f in (ROOT / "pyproject.toml", build_vendor.LOCK):
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def install_wheels() -> None:
    """Step 3: the runtime dependencies and PyInstaller, manylinux2014 wheels fetched here
    (the root has no pip configuration of its own) and installed there, offline."""
    want = (HOUSE / "python.stamp").read_text() + " " + wheels_hash()
    if stamped("wheels", want):
        return
    log("the agent's wheels and PyInstaller")
    folder = HOUSE / "wheels"
    shutil.rmtree(folder, ignore_errors=True)
    reqs = [*build_vendor.requirements(), pyinstaller_requirement()]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
           "--only-binary=:all:", "--implementation", "cp", "--python-version", PY,
           "--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64",
           "-d", str(folder)]
    if build_vendor.LOCK.is_file():
        cmd += ["-c", str(build_vendor.LOCK)]
    subprocess.run([*cmd, *reqs], check=True, stdout=subprocess.DEVNULL, timeout=900)
    quoted = " ".join(f"'{r}'" for r in reqs)
    chroot(f"{PREFIX}/bin/python{PY} -m pip install -q --disable-pip-version-check"
           f" --no-index --find-links /wheels {quoted}", binds={folder: "/wheels"},
           ro=("/wheels",))
    stamp("wheels", want)


def pyinstaller_requirement() -> str:
    """PyInstaller at the lock's version when it has one (``pyinstaller>=6.0`` else)."""
    if build_vendor.LOCK.is_file():
        m = re.search(r"^(pyinstaller==\S+)$", build_vendor.LOCK.read_text(), re.M | re.I)
        if m:
            return m.group(1)
    return "pyinstaller>=6.0"


def build() -> Path:
    """One build at a time: pytest-xdist's workers (and two makes) share build/, and
    the second waits for the first's result instead of building over it."""
    HOUSE.mkdir(parents=True, exist_ok=True)
    with open(HOUSE / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build()


def _build() -> Path:
    """Everything, each step only when its inputs changed; the bundle's folder."""
    build_root()
    fetch_source()
    build_python()
    install_wheels()
    want = (HOUSE / "wheels.stamp").read_text() + " " + source_hash()
    if stamped("bundle", want) and (DIST / "ftagent").is_file():
        return DIST
    log(f"the bundle, by PyInstaller on the {SUITE} root's CPython {PY}")
    OUT.mkdir(parents=True, exist_ok=True)
    # build_bundle's own stamp knows ftagent's sources, not this root's Python: rebuild
    (OUT / "inputs.sha256").unlink(missing_ok=True)
    # the root's busybox is the static one (busybox-static): build_bundle's static shell
    chroot("mkdir -p /static-sh/root/bin && cp /bin/busybox /static-sh/root/bin/busybox && "
           f"FTAGENT_BUNDLE_OUT=/out {PREFIX}/bin/python{PY} /src/packaging/build_bundle.py",
           binds={ROOT: "/src", OUT: "/out"}, ro=("/src",))
    floor = build_vendor.elf_floor(DIST)
    (DIST / "glibc-floor").write_text(f"{floor[0]}.{floor[1]}\n")
    stamp("bundle", want)
    return DIST


def source_hash() -> str:
    """build_bundle's inputs (ftagent/, packaging/, pyproject.toml) less the Python's
    version, which is the root's here."""
    return build_bundle.inputs_hash()


if __name__ == "__main__":
    if os.geteuid() != 0:
        raise SystemExit("build_compat: needs root (mmdebstrap, chroot)")
    out = build()
    print(f"{out / 'ftagent'} (glibc {(out / 'glibc-floor').read_text().strip()}+)")
