"""The injected agent, continued: the built image's bundle in a pod as the kubelet would run
it, and the arm64 files (read: nothing arm64 runs here). Shares the root filesystems,
the agent folder and the helpers of test_training_images.py (same skips)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.integration.test_training_images import (
    CHROOT,
    POD_COMMAND,
    REQUIRED,
    ROOTS,
    TRAINER,
    assemble_agent_dir,
    root_of,
    roots_lock,
    run_in,
    wrapped,
)


@pytest.fixture(scope="module")
def agent_dir() -> Path:
    return assemble_agent_dir()


def arm64_root() -> Path:
    """bookworm's arm64 libc and Python, unpacked without running anything (extract
    variant: no maintainer scripts, so no arm64 CPU or emulator is needed)."""
    with roots_lock():
        return _arm64_root()


def _arm64_root() -> Path:
    path, stamp = ROOTS / "arm64-bookworm", ROOTS / "arm64-bookworm.stamp"
    argv = ["mmdebstrap", "--mode=root", "--variant=extract", "--arch=arm64",
            "--include=libc6,python3.11-minimal", "bookworm"]
    if stamp.is_file() and stamp.read_text() == " ".join(argv) and path.is_dir():
        return path
    part = ROOTS / "arm64-bookworm.part"
    shutil.rmtree(part, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run([*argv, str(part)], check=True, capture_output=True, timeout=600)
    part.rename(path)
    stamp.write_text(" ".join(argv))
    return path


def glibc_versions(elf: Path) -> set[tuple[int, int]]:
    out = subprocess.run(["objdump", "-T", str(elf)], capture_output=True, text=True,
                         timeout=60).stdout
    return {(int(a), int(b)) for a, b in re.findall(r"GLIBC_(\d+)\.(\d+)", out)}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
def test_arm64_image_files_meet_the_wheels(agent_dir: Path) -> None:
    """An arm64 Debian 12 root's files, read: its loader sits where the shim looks for
    glibc's, its Python is an AArch64 CPython 3.11 (a version the wheels have), and its
    libc defines every GLIBC_x.y symbol version the aarch64 wheels' shared objects need."""
    root = arm64_root()
    assert (root / "lib" / "ld-linux-aarch64.so.1").exists()
    python = root / "usr" / "bin" / "python3.11"
    assert python.read_bytes()[18:20] == b"\xb7\x00"  # e_machine: EM_AARCH64
    manifest = json.loads((agent_dir / "py" / "manifest.json").read_text())
    assert "3.11" in manifest["pythons"]
    defined = glibc_versions(root / "lib" / "aarch64-linux-gnu" / "libc.so.6")
    needed: set[tuple[int, int]] = set()
    for so in (agent_dir / "py" / "aarch64").rglob("*.so*"):
        if so.is_file():
            needed |= glibc_versions(so)
    assert needed and needed <= defined | {(2, 0)}, sorted(needed - defined)


def test_arm64_files(agent_dir: Path) -> None:
    """arm64 cannot run here: its wheels are checked as files (ELF machine, glibc floor)."""
    manifest = json.loads((agent_dir / "py" / "manifest.json").read_text())
    assert manifest["glibc"]["aarch64"] == [2, 17]
    grpc = list((agent_dir / "py" / "aarch64").glob("cp3*/grpc/_cython/cygrpc*.so"))
    assert {p.parent.parent.parent.name for p in grpc} == {
        "cp" + v.replace(".", "") for v in manifest["pythons"]}
    for so in grpc:
        assert so.read_bytes()[18:20] == b"\xb7\x00"  # e_machine: EM_AARCH64
    if shutil.which("objdump"):
        out = subprocess.run(["objdump", "-T", str(grpc[0])], capture_output=True,
                             text=True).stdout
        versions = {tuple(int(x) for x in v.split(".")) for v in
                    re.findall(r"GLIBC_(\d+\.\d+)", out)}
        assert versions and max(versions) <= (2, 17)
    assert (agent_dir / "py" / "aarch64" / "bin" / "py-spy").read_bytes()[18:20] == b"\xb7\x00"


def image_bundle(into: Path) -> Path:
    """/opt/ftagent-bundle of the image ``make image`` built (its one layer, read from the
    OCI archive without unpacking the rest)."""
    import tarfile

    sys.path.insert(0, str(ROOT / "packaging"))
    import build_image

    archive = build_image.archive_path()
    if not archive.is_file():
        if REQUIRED:
            pytest.fail(f"FTAGENT_REQUIRE_IMAGE=1 but no {archive} (make image)")
        pytest.skip(f"no {archive.name} (make image)")
    with tarfile.open(archive) as oci:
        def blob(digest: str) -> Any:
            return oci.extractfile("blobs/sha256/" + digest.split(":", 1)[1])

        index = json.load(oci.extractfile("index.json"))  # type: ignore[arg-type]
        manifest = json.load(blob(index["manifests"][0]["digest"]))
        (layer,) = manifest["layers"]
        with tarfile.open(fileobj=blob(layer["digest"]), mode="r|gz") as t:
            for m in t:
                name = m.name.removeprefix("./")
                if name.startswith("opt/ftagent-bundle/") and (m.isfile() or m.isdir()
                                                                 or m.issym()):
                    m.name = name
                    t.extract(m, into, filter="tar")
    return into / "opt" / "ftagent-bundle"


def test_an_injected_pod_with_the_built_image(tmp_path: Path) -> None:
    """The webhook's patch, run as the kubelet would: the init container's script (in a
    root with the image's /opt/ftagent-bundle) fills the emptyDir, then the trainer
    container's new command runs in a training image (bookworm) with that emptyDir
    read-only at /opt/ftagent: the agent wraps the trainer."""
    import copy

    import jsonpatch

    from ftagent.kube.inject import Settings, mutate

    bundle = image_bundle(tmp_path / "image")
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "labels": {"ftagent.io/inject": "true"}},
           "spec": {"containers": [{"name": "main", "image": "x",
                                    "command": ["python3", "-c", TRAINER]}]}}
    new = jsonpatch.apply_patch(pod, mutate(copy.deepcopy(pod), "ml", Settings()).patch)
    init, trainer = new["spec"]["initContainers"][0], new["spec"]["containers"][0]
    root, empty = root_of("bookworm"), tmp_path / "emptydir"
    empty.mkdir()
    (root / "opt" / "ftagent-bundle").mkdir(parents=True, exist_ok=True)
    (root / "opt" / "ftagent").mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
         f"mount --bind '{bundle}' '{root}/opt/ftagent-bundle' && mount --bind '{empty}' "
         f"'{root}/opt/ftagent' && exec {CHROOT} '{root}' \"$@\"", "sh", *init["command"]],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert trainer["command"][:len(POD_COMMAND)] == POD_COMMAND
    env = {e["name"]: e["value"] for e in trainer["env"] if "value" in e}
    r = run_in(root, empty, trainer["command"][len(POD_COMMAND):], tmp_path,
               env={**env, "FTAGENT_METRICS_PORT": "-1"})
    wrapped(r, "3.11", tmp_path)
