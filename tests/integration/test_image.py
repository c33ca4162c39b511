"""The image ``make image`` built (build/image/ftagent-VERSION.oci.tar), smoke-tested without
a container runtime: the OCI layout read as a runtime reads it (index -> manifest -> config
and layers), the layers unpacked into a root filesystem, and the image's own ``ftagent``
run in it under ``chroot`` as the image's numeric user, in a mount namespace where the root
filesystem is read-only (as deploy/ runs it: readOnlyRootFilesystem) with /proc, /dev and a
writable /tmp mounted, as a runtime would. The arbiter and the webhook, started there on
loopback, answer a real client from this virtualenv; the node agent, in a network namespace
of its own, sees a veth link go down.

Skipped when the archive is missing (``make image``; ``make test`` builds it first and CI
sets FTAGENT_REQUIRE_IMAGE=1, which makes a missing archive or tool a failure) or when not
root (mount namespaces, chroot).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shlex
import shutil
import ssl
import stat
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ftagent
from tests.conftest import ROOT, wait_for
from tests.webhook_pods import admission_review, example_pods

sys.path.insert(0, str(ROOT / "packaging"))
import build_image  # noqa: E402

ARCHIVE = build_image.archive_path(ftagent.__version__)
REQUIRED = os.environ.get("FTAGENT_REQUIRE_IMAGE") == "1"


def _missing() -> str | None:
    if not ARCHIVE.is_file():
        return f"no image archive {ARCHIVE.relative_to(ROOT)} (make image)"
    if os.geteuid() != 0:
        return "needs root: mount namespaces and chroot"
    for tool in ("unshare", "chroot", "tar"):
        if shutil.which(tool) is None:
            return f"no {tool}"
    return None


def _check_prerequisites() -> None:
    why = _missing()
    if why is not None:
        if REQUIRED:
            pytest.fail(f"FTAGENT_REQUIRE_IMAGE=1: {why}")
        pytest.skip(why)


class Image:
    """The archive's layout, its config, and its layers unpacked into ``rootfs``."""

    def __init__(self, archive: Path, where: Path) -> None:
        layout = where / "layout"
        layout.mkdir()
        with tarfile.open(archive) as t:
            t.extractall(layout, filter="tar")
        self.layout = layout
        self.index = self.json("index.json")
        [desc] = self.index["manifests"]
        self.tag = desc["annotations"]["org.opencontainers.image.ref.name"]
        self.manifest = self.blob(desc["digest"])
        self.config = self.blob(self.manifest["config"]["digest"])
        self.rootfs = where / "rootfs"
        self.rootfs.mkdir()
        for layer in self.manifest["layers"]:
            assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
            # GNU tar as root keeps owners, modes and links, as a runtime's unpacker does
            subprocess.run(["tar", "-xzf", str(self.path(layer["digest"])), "-C",
                            str(self.rootfs), "--numeric-owner"], check=True, timeout=120)

    def json(self, name: str) -> Any:
        return json.loads((self.layout / name).read_text())

    def path(self, digest: str) -> Path:
        algo, hexa = digest.split(":")
        return self.layout / "blobs" / algo / hexa

    def blob(self, digest: str) -> Any:
        return json.loads(self.path(digest).read_text())

    def argv(self, *args: str, tmp: Path, entry: list[str] | None = None) -> list[str]:
        """``args`` run as the image's user inside the root filesystem, after its entry
        point (or ``entry``)."""
        cfg = self.config["config"]
        env = ["env", "-i", *cfg["Env"], "HOME=/tmp"]
        return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                self.setup(tmp) + 'exec "$@"', "sh", "chroot", f"--userspec={cfg['User']}",
                str(self.rootfs), *env, *(entry or cfg["Entrypoint"]), *args]

    def setup(self, tmp: Path) -> str:
        """What a runtime does before the entry point: the mount points the image lacks
        (no /dev in the layer), the root read-only, /proc, /dev, a writable /tmp."""
        r = str(self.rootfs)
        return (f"mkdir -p {r}/dev {r}/proc {r}/tmp && "
                f"mount --bind {r} {r} && mount -o remount,bind,ro {r} && "
                f"mount -t proc proc {r}/proc && mount --rbind /dev {r}/dev && "
                f"mount --bind {tmp} {r}/tmp && ")

    def shell(self, script: str, tmp: Path) -> list[str]:
        """``script`` run by root's sh in fresh mount, PID and network namespaces (only
        ``lo``, up; everything started there ends with it), where ``inside CMD...`` runs
        CMD as the image's user in its root filesystem."""
        cfg = self.config["config"]
        env = " ".join(shlex.quote(e) for e in [*cfg["Env"], "HOME=/tmp"])
        inside = (f"inside() {{ chroot --userspec={cfg['User']} {self.rootfs} env -i {env} "
                  '"$@"; }; ')
        return ["unshare", "--mount", "--net", "--pid", "--fork", "--propagation", "private",
                "/bin/sh", "-c", self.setup(tmp) + "ip link set lo up && " + inside + script]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    _check_prerequisites()
    where = tmp_path_factory.mktemp("image")
    yield Image(ARCHIVE, where)
    shutil.rmtree(where)  # ~0.5 GB: not left for pytest's last three runs to keep


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    """The container's /tmp: writable by the image's user, readable from here."""
    d = tmp_path / "ctmp"
    d.mkdir()
    d.chmod(0o1777)
    return d


class Served:
    def __init__(self, argv: list[str], err: Path) -> None:
        self.err = err
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err.open("wb"))

    def line(self, prefix: str) -> str:
        found: list[str] = []

        def seen() -> bool:
            found[:] = [x for x in self.err.read_text().splitlines() if x.startswith(prefix)]
            assert self.proc.poll() is None, self.err.read_text()[-3000:]
            return bool(found)

        wait_for(seen, 60, f"{prefix!r} from {self.err.name}")
        return found[0]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture
def served() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for s in started:
        s.stop()


def _interpreter(elf: bytes) -> bool:
    """Whether a 64-bit little-endian ELF file names a program interpreter (PT_INTERP):
    a dynamically linked program."""
    import struct

    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    return any(struct.unpack_from("<I", elf, phoff + i * phentsize)[0] == 3
               for i in range(phnum))


def test_layout_tag_user_and_entry_point(image: Image) -> None:
    assert image.json("oci-layout") == {"imageLayoutVersion": "1.0.0"}
    assert image.tag == ftagent.__version__
    cfg = image.config["config"]
    assert cfg["User"] == "65532:65532"  # numeric: runAsNonRoot can check it
    assert cfg["Entrypoint"] == ["ftagent"]
    assert cfg["Labels"]["org.opencontainers.image.version"] == ftagent.__version__
    # what the webhook's init container copies into training pods
    bundle = image.rootfs / "opt" / "ftagent-bundle" / "ftagent"
    assert bundle.is_file() and os.access(bundle, os.X_OK)
    # the injected pods' shell: static (no program interpreter), so it runs in any image
    shell = bundle.parent / "busybox"
    assert os.access(shell, os.X_OK) and not _interpreter(shell.read_bytes())
    assert "ftagent:x:65532:65532:" in (image.rootfs / "etc" / "passwd").read_text()
    # nothing in the image belongs to its user or is writable by anyone but root (/tmp
    # aside: sticky, and an emptyDir in deploy/)
    for dirpath, dirs, files in os.walk(image.rootfs):
        for name in (*dirs, *files):
            st = os.lstat(os.path.join(dirpath, name))
            rel = os.path.relpath(os.path.join(dirpath, name), image.rootfs)
            assert st.st_uid != 65532, rel
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o002:
                assert st.st_mode & stat.S_ISVTX and stat.S_ISDIR(st.st_mode), rel


def test_version_inside_the_image(image: Image, tmp: Path) -> None:
    r = subprocess.run(image.argv("--version", tmp=tmp), capture_output=True, text=True,
                       timeout=120)
    assert (r.returncode, r.stdout) == (0, f"ftagent {ftagent.__version__}\n"), r.stderr
    # the bundle too, outside any Python: the program the init container copies
    r = subprocess.run(image.argv("--version", tmp=tmp, entry=["/opt/ftagent-bundle/ftagent"]),
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (0, f"ftagent {ftagent.__version__}\n"), r.stderr
    # and the agent for a training image's own Python (the image's python3 plays one)
    r = subprocess.run(image.argv("-I", "-S", "/opt/ftagent-bundle/py/launch.py", "--version",
                                  tmp=tmp, entry=["python3"]),
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (0, f"ftagent {ftagent.__version__}\n"), r.stderr
    manifest = json.loads((image.rootfs / "opt/ftagent-bundle/py/manifest.json").read_text())
    assert list(manifest["glibc"]) == ["x86_64"]  # this image's architecture only
    # the root filesystem the servers below run on is read-only, /tmp is not
    r = subprocess.run(image.argv("-c", "touch /tmp/ok && touch /opt/venv/x", tmp=tmp,
                                  entry=["/bin/sh"]), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Read-only file system" in r.stderr, r.stderr
    assert (tmp / "ok").is_file()


def test_arbiter_answers_from_the_image(image: Image, tmp: Path, served: list[Served],
                                        tmp_path: Path) -> None:
    arb = Served(image.argv("arbiter", "--listen=127.0.0.1:0", "--metrics-port=0",
                            "--metrics-addr=127.0.0.1", tmp=tmp), tmp_path / "arbiter.err")
    served.append(arb)
    address = arb.line("listening on ").removeprefix("listening on ")
    metrics = arb.line("metrics on ").removeprefix("metrics on ")
    base = metrics.removesuffix("/metrics")
    assert urllib.request.urlopen(base + "/healthz", timeout=10).status == 200
    assert urllib.request.urlopen(base + "/readyz", timeout=10).status == 200
    body = urllib.request.urlopen(metrics, timeout=10).read().decode()
    assert "ftagent_" in body
    # a real gRPC client from this virtualenv: `ftagent status` lists no jobs
    r = subprocess.run([sys.executable, "-m", "ftagent", "status", "--arbiter", address,
                        "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)
    assert arb.stop() == 0, arb.err.read_text()[-3000:]  # SIGTERM: a clean exit


def test_webhook_answers_from_the_image(image: Image, tmp: Path, served: list[Served],
                                        tmp_path: Path) -> None:
    hook = Served(image.argv("webhook", "--listen=127.0.0.1:0", "--self-signed",
                             "--ca-bundle-out=/tmp/ca.pem", "--arbiter=arbiter.ftagent:9400",
                             tmp=tmp), tmp_path / "webhook.err")
    served.append(hook)
    port = int(hook.line("listening on ").rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=str(tmp / "ca.pem"))  # the CA it made
    ex = example_pods()[0]
    review = admission_review(ex.pod)
    conn = http.client.HTTPSConnection("localhost", port, context=ctx, timeout=30)
    conn.request("POST", "/mutate", body=json.dumps(review).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    assert resp.status == 200, out
    answer = out["response"]
    assert answer["uid"] == review["request"]["uid"] and answer["allowed"] is True
    patch = json.loads(base64.b64decode(answer["patch"]))
    assert any(op["path"].startswith("/spec/initContainers") for op in patch), patch
    assert hook.stop() == 0, hook.err.read_text()[-3000:]


# Polls a /metrics page (inside the image, with its Python) until a line appears.
PROBE = """
import sys, time, urllib.request
url, want = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 60
while True:
    try:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        body = ""
    if want in body.splitlines():
        print("seen:", want)
        break
    if time.monotonic() > deadline:
        sys.exit(f"never seen: {want!r}")
    time.sleep(0.1)
"""


def test_node_agent_reads_links_from_the_image_unprivileged(image: Image, tmp: Path) -> None:
    """The node agent as deploy/ runs it (UID 65532, no capability): netlink and sysfs
    need none. A veth link in a fresh network namespace, flipped down under it."""
    if shutil.which("ip") is None:
        pytest.skip("no ip (iproute2): make deps")
    (tmp / "probe.py").write_text(PROBE)
    url = "http://127.0.0.1:9555/metrics"
    script = (
        "ip link add d0 type veth peer name d1 && ip link set d1 up && ip link set d0 up && "
        "{ inside ftagent node --node=n1 --nic=d0 --gpu-backend=none --kmsg=none "
        "--arbiter=127.0.0.1:9 --metrics-port=9555 --metrics-addr=127.0.0.1 "
        "2>/tmp/node.err & } && "
        f"inside python3 /tmp/probe.py {url} 'ftagent_nic_up{{device=\"d0\",node=\"n1\"}} 1.0'"
        " && ip link set d0 down && "
        f"inside python3 /tmp/probe.py {url} 'ftagent_nic_up{{device=\"d0\",node=\"n1\"}} 0.0'"
    )
    r = subprocess.run(image.shell(script, tmp), capture_output=True, text=True, timeout=180)
    err = (tmp / "node.err").read_text() if (tmp / "node.err").exists() else ""
    assert r.returncode == 0, r.stdout + r.stderr + err[-3000:]
    assert r.stdout.count("seen:") == 2, r.stdout
