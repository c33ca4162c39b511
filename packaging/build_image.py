"""Build the ftagent image (``make image``) without a container runtime or a registry:
``build/image/ftagent-VERSION.oci.tar``, an OCI image layout in a tar archive (what
``skopeo copy oci-archive:…`` and ``podman load`` read), tagged VERSION, to be pushed as
``ghcr.io/ftagent/ftagent:VERSION``, the image deploy/ references.

Made from the project's files and the package registries alone:

1. the project's wheel (``python -m build``) and its dependencies with the ``kube`` extra,
   as a directory of wheels (pip's cache and index);
2. what the webhook's init container copies into training pods, at /opt/ftagent-bundle:
   the self-contained agent built on Debian bullseye, glibc 2.31 (packaging/build_compat.py
   runs packaging/build_bundle.py there), the entry shim, and in ``py/``
   the agent for the training image's own Python, this image's architecture's wheels
   (packaging/build_vendor.py);
3. a Debian root filesystem made by ``mmdebstrap`` (minbase, no recommends, no docs but
   the copyright files), with ``python3`` and a virtualenv at /opt/venv into which the
   wheels are installed offline (``--no-index``), pip removed afterwards, and the user
   ``ftagent`` (UID/GID 65532);
4. committed as one layer with ``umoci`` (``raw add-layer``), the config naming the numeric
   user 65532:65532 and the entry point ``ftagent``.

deploy/Dockerfile builds the same layout (/opt/venv, /opt/ftagent-bundle, UID 65532) for
builders with a registry. Needs root (mmdebstrap's root mode, chroot), mmdebstrap and umoci
(``make deps``). Skips the build when its inputs are unchanged since the last one (a hash
in build/image/inputs.sha256, see inputs_hash). Prints the image's size.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "packaging"))
import build_bundle  # noqa: E402
import build_compat  # noqa: E402
import build_vendor  # noqa: E402

OUT = ROOT / "build" / "image"
STAMP = OUT / "inputs.sha256"
NAME = "ghcr.io/ftagent/ftagent"
SUITE = "bookworm"  # python3 is 3.11, as the wheels pip picks for this virtualenv
UID = 65532
ARCH = "x86_64"  # this machine's, as the bundle's (--architecture=amd64 below)
VENV = "/opt/venv"
BUNDLE = "/opt/ftagent-bundle"
PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def version() -> str:
    ns: dict[str, str] = {}
    for line in (ROOT / "ftagent" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            exec(line, ns)  # one assignment of a string literal
    return ns["__version__"]


def archive_path(ver: str | None = None) -> Path:
    return OUT / f"ftagent-{ver or version()}.oci.tar"


def run(argv: list[str], **kw: object) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, **kw)  # type: ignore[call-overload]


def wheels(ver: str) -> Path:
    """The project's wheel and every wheel it needs with the kube extra (pip's cache)."""
    dist, house = OUT / "dist", OUT / "wheels"
    for d in (dist, house):
        shutil.rmtree(d, ignore_errors=True)
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist),
         str(ROOT)], stdout=subprocess.DEVNULL)
    wheel = dist / f"ftagent-{ver}-py3-none-any.whl"
    lock = ROOT / "requirements" / "dev.lock"  # the versions the tests ran with
    run([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(house),
         "--only-binary", ":all:", *(["-c", str(lock)] if lock.is_file() else []),
         f"{wheel}[kube]"])
    return house


def inputs_hash() -> str:
    """The sources (the bundle's inputs: ftagent/, packaging/, pyproject.toml, the Python),
    this script, the suite, LICENSE and README.md (in the wheel). Not the versions the
    index would resolve today: `rm build/image/inputs.sha256` rebuilds with the newest."""
    h = hashlib.sha256(SUITE.encode())
    h.update(Path(__file__).read_bytes())
    h.update(build_bundle.inputs_hash().encode())
    h.update(build_vendor.inputs_hash().encode())
    for name in ("LICENSE", "README.md"):
        h.update(hashlib.sha256((ROOT / name).read_bytes()).digest())
    return h.hexdigest()


def rootfs(house: Path, bundle: Path, vendor: Path, ver: str) -> Path:
    """The root filesystem as one tar (mmdebstrap; the hooks run on this host as root)."""
    tar = OUT / "rootfs.tar"
    root = '"$1"'
    hooks = [
        f"cp -a {bundle} {root}{BUNDLE}",
        f"cp -a {vendor} {root}{BUNDLE}/py",
        f"cp -a {house} {root}/tmp/wheels",
        f"chroot {root} python3 -m venv {VENV}",
        f"chroot {root} {VENV}/bin/pip install -q --no-index --no-cache-dir --no-compile"
        f" --find-links /tmp/wheels 'ftagent[kube]=={ver}'",
        # bytecode once, at build time: the root filesystem is read-only in the pods
        f"chroot {root} {VENV}/bin/python -m compileall -q -j 0 {VENV}/lib",
        f"chroot {root} {VENV}/bin/pip uninstall -q -y setuptools pip",
        f"rm -rf {root}/tmp/wheels",
        f"ln -s {VENV}/bin/ftagent {root}/usr/local/bin/ftagent",
        f"chroot {root} groupadd --gid {UID} ftagent",
        f"chroot {root} useradd --uid {UID} --gid {UID} --no-create-home"
        " --home-dir /nonexistent --shell /usr/sbin/nologin ftagent",
        f"chroot {root} ftagent --version",
        f"{root}{BUNDLE}/ftagent --version",
        f"chroot {root} python3 -I -S {BUNDLE}/py/launch.py --version",
        f"rm -rf {root}/var/log/* {root}/var/cache/ldconfig/aux-cache",
    ]
    argv = ["mmdebstrap", "--mode=root", "--variant=minbase", "--include=python3,python3-venv",
            "--aptopt=APT::Install-Recommends \"false\"",
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--dpkgopt=path-exclude=/usr/share/info/*",
            # a runtime mounts /dev: no device nodes in the layer
            "--skip=output/dev,output/mknod",
            *(f"--customize-hook={h}" for h in hooks), SUITE, str(tar)]
    run(argv, stdout=subprocess.DEVNULL)
    return tar


def commit(tar: Path, ver: str) -> Path:
    """One layer and the config (umoci), then the layout as a tar archive."""
    layout = OUT / "oci"
    shutil.rmtree(layout, ignore_errors=True)
    image = f"{layout}:{ver}"
    run(["umoci", "init", "--layout", str(layout)])
    run(["umoci", "new", "--image", image])
    run(["umoci", "raw", "add-layer", "--image", image, str(tar),
         "--history.created_by", f"packaging/build_image.py: mmdebstrap {SUITE} + ftagent {ver}"])
    labels = {"org.opencontainers.image.title": "ftagent",
              "org.opencontainers.image.version": ver,
              "org.opencontainers.image.licenses": "Apache-2.0",
              "org.opencontainers.image.source": "https://github.com/ftagent/ftagent"}
    run(["umoci", "config", "--image", image, f"--config.user={UID}:{UID}",
         "--config.entrypoint=ftagent", "--config.cmd=--help", "--config.workingdir=/",
         f"--config.env=PATH={PATH}", "--config.env=PYTHONDONTWRITEBYTECODE=1",
         "--architecture=amd64", "--os=linux",
         *(f"--config.label={k}={v}" for k, v in labels.items())])
    run(["umoci", "gc", "--layout", str(layout)])
    out = archive_path(ver)
    part = out.with_suffix(".part")
    with tarfile.open(part, "w") as t:
        for entry in sorted(layout.iterdir()):
            t.add(entry, arcname=entry.name)
    part.replace(out)
    shutil.rmtree(layout)
    return out


def describe(out: Path) -> str:
    with tarfile.open(out) as t:
        index = json.load(t.extractfile("index.json"))  # type: ignore[arg-type]
    tag = index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
    unpacked = json.loads((OUT / "image.json").read_text())["unpacked_bytes"]
    mib = 1024 * 1024
    return (f"{NAME}:{tag} -> {out.relative_to(ROOT)}: {out.stat().st_size / mib:.0f} MiB"
            f" compressed, {unpacked / mib:.0f} MiB unpacked")


def build() -> Path:
    ver = version()
    OUT.mkdir(parents=True, exist_ok=True)
    digest = inputs_hash()
    out = archive_path(ver)
    if out.is_file() and STAMP.is_file() and STAMP.read_text() == digest:
        print(f"up to date: {describe(out)}")
        return out
    STAMP.unlink(missing_ok=True)
    bundle = build_compat.build()  # the old-glibc bundle: what training images can run
    if not (bundle / "busybox").is_file():
        raise SystemExit("build_image: the bundle has no static busybox (the injected pods' "
                         "shell): apt-get download busybox-static failed, see above")
    build_vendor.build()  # both architectures: the same build the tests use
    build_vendor.copy_for(ARCH, OUT / "py")
    house = wheels(ver)
    tar = rootfs(house, bundle, OUT / "py", ver)
    out = commit(tar, ver)
    (OUT / "image.json").write_text(json.dumps({"unpacked_bytes": tar.stat().st_size}))
    tar.unlink()
    STAMP.write_text(digest)
    print(describe(out))
    return out


if __name__ == "__main__":
    build()
