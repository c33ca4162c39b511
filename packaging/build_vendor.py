"""Build the agent for the training image's own Python (``make vendor``): ``build/vendor/py/``,
which the init container copies beside the bundle and the entry shim runs with
``PYTHON -I -S py/launch.py run -- CMD`` (packaging/launch.py).

For each CPython the agent runs on (3.10 up: ftagent's floor, and the generated gRPC code's
runtime, grpcio>=1.85.1 and protobuf>=7.35.1, has no wheels for 3.9) and each architecture
(x86_64, aarch64), ``pip download`` fetches the runtime dependencies as manylinux2014 wheels
(glibc 2.17) at the lock's versions (requirements/dev.lock), without running them, and this
unpacks them, each wheel once, where its tags say it belongs:

* ``any/``: pure Python (``py3-none-any``), and ftagent's own package from this checkout;
* ``ARCH/``: one architecture, any CPython 3 (``abi3``, ``none``: protobuf, psutil; py-spy's
  binary in ``ARCH/bin/``);
* ``ARCH/cpXY/``: one architecture and CPython version (grpcio).

``manifest.json`` names the versions and, per architecture, the glibc floor: the highest of
the wheels' manylinux tags and of the GLIBC_x.y symbol versions their ELF files need
(``objdump -T``, where objdump exists). Skips the build when its inputs are unchanged.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "vendor"
DIST = OUT / "py"
STAMP = OUT / "inputs.sha256"
PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
ARCHES = ("x86_64", "aarch64")
LOCK = ROOT / "requirements" / "dev.lock"
# `ftagent run`'s dependencies (pyproject.toml [project] dependencies), nothing more
RUNTIME = re.compile(r'^\s*"([^"]+)",', re.M)
TAG = re.compile(r"manylinux_?(\d+)_(\d+)_|manylinux(1|2010|2014)_")
LEGACY = {"1": (2, 5), "2010": (2, 12), "2014": (2, 17)}


def requirements() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    return [r.split(";")[0].strip() for r in RUNTIME.findall(block)]


def inputs_hash() -> str:
    """Everything the result depends on (the wheels' part and ftagent's sources)."""
    h = hashlib.sha256(wheels_hash().encode())
    for f in sorted([*ROOT.glob("ftagent/**/*.py"), *ROOT.glob("ftagent/**/*.pyi"),
                     ROOT / "packaging" / "launch.py"]):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def wheels_hash() -> str:
    """What decides the wheels (this file, the dependencies, the lock): a change of
    ftagent's own sources alone re-copies them, without asking the index again."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for f in (ROOT / "pyproject.toml", LOCK):
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def download(version: str, arch: str, into: Path) -> list[Path]:
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
           "--only-binary=:all:", "--implementation", "cp", "--python-version", version,
           "--platform", f"manylinux2014_{arch}", "-d", str(into)]
    if LOCK.is_file():
        cmd += ["-c", str(LOCK)]
    subprocess.run([*cmd, *requirements()], check=True, stdout=subprocess.DEVNULL)
    return sorted(into.glob("*.whl"))


def place(wheel: Path, arch: str, version: str) -> Path:
    """The folder a wheel belongs in, from its file name's tags."""
    _, _, rest = wheel.stem.partition("-")
    python_tag, abi, platform = rest.split("-")[-3:]
    if platform == "any":
        return DIST / "any"
    if abi in ("abi3", "none"):
        return DIST / arch
    return DIST / arch / ("cp" + version.replace(".", ""))


def unpack(wheel: Path, folder: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            parts = name.split("/")
            if parts[0].endswith(".data") and len(parts) > 2:
                if parts[1] == "scripts":
                    dest = folder / "bin" / "/".join(parts[2:])
                elif parts[1] in ("purelib", "platlib"):
                    dest = folder / "/".join(parts[2:])
                else:
                    continue
            else:
                dest = folder / name
            if name.endswith("/"):
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
            mode = (info.external_attr >> 16) & 0o777
            exe = mode & 0o111 or dest.parent.name == "bin" or dest.suffix == ".so"
            dest.chmod(0o755 if exe else 0o644)


def elf_floor(folder: Path) -> tuple[int, int]:
    """The highest GLIBC_x.y any ELF file under ``folder`` needs (objdump -T)."""
    best = (2, 0)
    objdump = shutil.which("objdump")
    if objdump is None:
        return best
    for f in folder.rglob("*"):
        if not f.is_file() or f.read_bytes()[:4] != b"\x7fELF":
            continue
        out = subprocess.run([objdump, "-T", str(f)], capture_output=True, text=True).stdout
        for m in re.finditer(r"GLIBC_(\d+)\.(\d+)", out):
            best = max(best, (int(m.group(1)), int(m.group(2))))
    return best


def tag_floor(wheel: Path) -> tuple[int, int]:
    """The lowest glibc the wheel's manylinux tags promise to run on (compressed tag sets:
    the lowest tag of the set)."""
    floors = []
    for m in TAG.finditer(wheel.name + "_"):
        if m.group(3):
            floors.append(LEGACY[m.group(3)])
        else:
            floors.append((int(m.group(1)), int(m.group(2))))
    return min(floors) if floors else (2, 0)


def build(arches: tuple[str, ...] = ARCHES) -> Path:
    """One build at a time: pytest-xdist's workers (and two makes) share build/, and
    the second waits for the first's result instead of building over it."""
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(arches)


def _build(arches: tuple[str, ...] = ARCHES) -> Path:
    digest = inputs_hash() + " " + ",".join(arches)
    if (DIST / "manifest.json").is_file() and STAMP.is_file() and STAMP.read_text() == digest:
        return DIST
    wheels_stamp = OUT / "wheels.sha256"
    wheels_digest = wheels_hash() + " " + ",".join(arches)
    found = OUT / "wheels.json"
    if not (wheels_stamp.is_file() and wheels_stamp.read_text() == wheels_digest
            and found.is_file()):
        wheels_stamp.unlink(missing_ok=True)
        found.write_text(json.dumps(unpack_all(arches)))
        wheels_stamp.write_text(wheels_digest)
    manifest = json.loads(found.read_text())
    shutil.rmtree(DIST / "any" / "ftagent", ignore_errors=True)
    shutil.copytree(ROOT / "ftagent", DIST / "any" / "ftagent",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(ROOT / "packaging" / "launch.py", DIST / "launch.py")
    (DIST / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    STAMP.write_text(digest)
    return DIST


def unpack_all(arches: tuple[str, ...]) -> dict[str, object]:
    """Download and unpack every (CPython, architecture)'s wheels into DIST; the manifest."""
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir(parents=True)
    floors: dict[str, tuple[int, int]] = {}
    wheels: dict[str, list[str]] = {}
    for arch in arches:
        floor = (2, 17)
        for version in PYTHONS:
            for wheel in download(version, arch, OUT / "wheels" / f"{arch}-{version}"):
                folder = place(wheel, arch, version)
                marker = folder / ".wheels" / wheel.name
                if not marker.exists():
                    unpack(wheel, folder)
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    marker.touch()
                    wheels.setdefault(arch, []).append(wheel.name)
                floor = max(floor, tag_floor(wheel))
        floors[arch] = max(floor, elf_floor(DIST / arch))
    return {"pythons": list(PYTHONS), "glibc": {a: list(f) for a, f in floors.items()},
            "wheels": {a: sorted(w) for a, w in wheels.items()}}


def copy_for(arch: str, dest: Path) -> None:
    """One architecture's part of the build (what an image of that architecture ships) at
    ``dest``: launch.py, any/, ARCH/ and a manifest naming ARCH alone."""
    manifest = json.loads((DIST / "manifest.json").read_text())
    if arch not in manifest["glibc"]:
        raise SystemExit(f"build_vendor: no {arch} in {DIST} (built for "
                         f"{', '.join(manifest['glibc'])})")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    skip = shutil.ignore_patterns(".wheels")
    shutil.copytree(DIST / "any", dest / "any", ignore=skip)
    shutil.copytree(DIST / arch, dest / arch, ignore=skip)
    shutil.copy2(DIST / "launch.py", dest / "launch.py")
    manifest["glibc"] = {arch: manifest["glibc"][arch]}
    manifest["wheels"] = {arch: manifest["wheels"].get(arch, [])}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", choices=ARCHES,
                    help="only this architecture (repeatable; default: all)")
    ap.add_argument("--copy-to", metavar="DIR",
                    help="then copy the (single) architecture's part to DIR")
    args = ap.parse_args()
    out = build(tuple(args.arch or ARCHES))
    if args.copy_to:
        if not args.arch or len(args.arch) != 1:
            raise SystemExit("build_vendor: --copy-to needs exactly one --arch")
        copy_for(args.arch[0], Path(args.copy_to))
    manifest = json.loads((out / "manifest.json").read_text())
    for arch, floor in manifest["glibc"].items():
        size = sum(f.stat().st_size for f in (out / arch).rglob("*") if f.is_file())
        print(f"{arch}: CPython {', '.join(manifest['pythons'])}, glibc {floor[0]}.{floor[1]}+,"
              f" {size / 2**20:.0f} MiB")
    print(out)
