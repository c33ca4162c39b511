"""The injected agent on arm64, run (not only read): an arm64 Debian root filesystem
(bookworm: glibc 2.36, Python 3.11; ``mmdebstrap --variant=extract --arch=arm64``, no
maintainer scripts) with the agent folder an arm64 image ships (the entry shim, the
aarch64 vendored wheels, the root's own static busybox), and a real
``busybox sh ftagent-entry -- python3.11 -c ...`` in ``chroot``.

This machine is amd64: the arm64 programs run under QEMU's user-mode emulator (Debian's
``qemu-user-static``), registered for AArch64 ELF files in a ``binfmt_misc`` instance of
the test's own user namespace (Linux 6.7 and newer mount one per user namespace), so
nothing on the host changes and every program the shim and the agent start (python3.11,
py-spy, the trainer) is emulated too. Slow (the agent's imports under emulation): one run.

Needs root, ``mmdebstrap``, ``unshare``, ``chroot``, ``qemu-aarch64-static`` and a kernel
with per-namespace binfmt_misc; skipped otherwise (also under FTAGENT_REQUIRE_IMAGE=1:
the emulator is an extra; the files are checked by test_injected_image.py either way).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "packaging"))
import build_vendor  # noqa: E402

ROOTS = ROOT / "build" / "roots"
QEMU = "/usr/bin/qemu-aarch64-static"
CHROOT = shutil.which("chroot") or "chroot"
# binfmt_misc's registration of AArch64 ELF executables (as Debian's qemu-user-static
# registers them); F: the emulator is opened now, so it runs inside the chroot too
AARCH64 = (r":qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02"
           r"\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff"
           r"\xfe\xff\xff\xff:" + QEMU + ":F")
BINFMT = "/proc/sys/fs/binfmt_misc"
USERNS = ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork",
          "--propagation", "private"]
FALLBACK = "ftagent: not started, the trainer runs without fault tolerance: "
TRAINER = ("import os, platform, sys; print('trainer', platform.machine(), sys.version_info[:2]"
           ", os.environ.get('FTAGENT_RESTART_COUNT')); sys.exit(7)")


def why_not() -> str | None:
    missing = [t for t in ("mmdebstrap", "unshare", "chroot") if shutil.which(t) is None]
    if missing or not Path(QEMU).is_file():
        return f"needs {', '.join(missing) or QEMU} (qemu-user-static)"
    r = subprocess.run([*USERNS, "/bin/sh", "-c", f"mount -t binfmt_misc none {BINFMT} && "
                        f"printf '%s' '{AARCH64}' > {BINFMT}/register"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return f"no binfmt_misc of its own in a user namespace here: {r.stderr.strip()}"
    return None


REASON = why_not()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""),
              pytest.mark.timeout(1200)]


def arm64_root() -> Path:
    """bookworm's arm64 libc, shell (dash), coreutils, Python 3.11 (with its standard
    library) and static busybox, unpacked (extract: nothing runs while it is made)."""
    path, stamp = ROOTS / "arm64-run", ROOTS / "arm64-run.stamp"
    argv = ["mmdebstrap", "--mode=root", "--variant=extract", "--arch=arm64",
            "--include=libc6,dash,coreutils,python3.11-minimal,libpython3.11-stdlib,"
            "busybox-static",
            "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*", "bookworm"]
    if stamp.is_file() and stamp.read_text() == " ".join(argv) and (path / "usr").is_dir():
        return path
    part = ROOTS / "arm64-run.part"
    shutil.rmtree(part, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    ROOTS.mkdir(parents=True, exist_ok=True)
    subprocess.run([*argv, str(part)], check=True, capture_output=True, timeout=900)
    for d in ("tmp", "proc", "dev", "opt/ftagent"):
        (part / d).mkdir(parents=True, exist_ok=True)
    part.rename(path)
    stamp.write_text(" ".join(argv))
    return path


def arm64_agent(root: Path) -> Path:
    """What an arm64 image's init container copies: the shim, the aarch64 wheels (no
    bundle: it is built per architecture, on arm64), an arm64 static busybox."""
    folder = ROOTS / "agent-arm64"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    build_vendor.build()
    build_vendor.copy_for("aarch64", folder / "py")
    shutil.copy2(ROOT / "packaging" / "ftagent-entry.sh", folder / "ftagent-entry")
    shutil.copy2(root / "bin" / "busybox", folder / "busybox")
    return folder


def test_the_agent_wraps_a_trainer_on_arm64(tmp_path: Path) -> None:
    root = arm64_root()
    agent = arm64_agent(root)
    r_ = str(root)
    script = " && ".join([
        f"mount -t binfmt_misc none {BINFMT}",
        f"printf '%s' '{AARCH64}' > {BINFMT}/register",
        f"mount --bind '{tmp_path}' '{r_}/tmp'",
        f"mount --rbind /dev '{r_}/dev'",
        f"mount --bind '{agent}' '{r_}/opt/ftagent'",
        f"mount -o remount,bind,ro '{r_}/opt/ftagent'",
        f"mount -t proc proc '{r_}/proc'",
        f"exec {CHROOT} '{r_}' \"$@\""])
    tmp_path.chmod(0o1777)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root",
           "FTAGENT_METRICS_PORT": "-1", "FTAGENT_MAX_RESTARTS": "0",
           "FTAGENT_EVENTS_FILE": "/tmp/events.jsonl", "FTAGENT_PROBE_TIMEOUT": "300"}
    # the image's own shell (dash), not the pod command's busybox: busybox sh runs its applets
    # (the shim's sleep) by executing /proc/self/exe, which under QEMU's user mode is the
    # emulator, not busybox (an artefact of the emulation: the applets run on arm64 CPUs)
    r = subprocess.run([*USERNS, "/bin/sh", "-c", script, "sh", "/bin/dash",
                        "/opt/ftagent/ftagent-entry", "--", "python3.11", "-c", TRAINER],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 7, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["trainer aarch64 (3, 11) 0"], r.stdout + r.stderr[-3000:]
    assert FALLBACK not in r.stderr
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events, r.stderr[-3000:]
