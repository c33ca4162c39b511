"""``make push REGISTRY=...``: the archive ``make image`` built goes to a registry with
skopeo, tagged with the version, readable back with its layers, architecture and labels.

The registry is a real one (Debian's ``docker-registry``, the CNCF distribution registry)
on loopback, without TLS (``SKOPEO_FLAGS=--dest-tls-verify=false``). Needs the archive
(``make image``, root), ``skopeo`` and ``docker-registry``; skipped without them (``make
push`` installs skopeo itself; the registry is for this test only).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import ftagent
from tests.conftest import ROOT, wait_for

sys.path.insert(0, str(ROOT / "packaging"))
import build_image  # noqa: E402

ARCHIVE = build_image.archive_path(ftagent.__version__)
MISSING = [t for t in ("skopeo", "docker-registry", "make") if shutil.which(t) is None]
pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}"),
    pytest.mark.skipif(not ARCHIVE.is_file() or os.geteuid() != 0,
                       reason="needs the image archive (make image, as root)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    cfg = tmp_path / "config.yml"
    cfg.write_text(f"""version: 0.1
storage:
  filesystem:
    rootdirectory: {tmp_path / "store"}
http:
  addr: 127.0.0.1:{port}
""")
    proc = subprocess.Popen(["docker-registry", "serve", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: answers(f"http://127.0.0.1:{port}/v2/"), timeout=60,
                 what="the registry answers")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_make_push_without_a_registry_says_how() -> None:
    r = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "push"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "make push REGISTRY=HOST[/PATH]" in r.stderr


def test_make_push_puts_the_image_in_the_registry(registry: str) -> None:
    version = ftagent.__version__
    r = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "push",
                        f"REGISTRY={registry}/ml", "SKOPEO_FLAGS=--dest-tls-verify=false"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = subprocess.run(["skopeo", "inspect", "--tls-verify=false",
                        f"docker://{registry}/ml/ftagent:{version}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["Architecture"] == "amd64" and info["Os"] == "linux"
    assert info["Labels"]["org.opencontainers.image.version"] == version
    assert len(info["Layers"]) == 1
