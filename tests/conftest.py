"""Shared test helpers: run the real ``ftagent`` in a subprocess, wait on conditions."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def ftagent_cmd(*flags: str, cmd: list[str]) -> list[str]:
    """``python -m ftagent run FLAGS -- CMD`` with metrics off unless asked for."""
    extra = [] if any(f.startswith("--metrics-port") for f in flags) else ["--metrics-port=-1"]
    return [PY, "-m", "ftagent", "run", *extra, *flags, "--", *cmd]


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
             interval: float = 0.01) -> Any:
    """Poll ``pred`` until truthy or fail after ``timeout`` seconds (no blind sleeps)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def until(cond: Callable[[], Any], timeout: float = 5.0, what: str = "") -> Any:
    """``wait_for`` for async tests: poll ``cond`` without blocking the event loop that the
    code under test runs on; return its truthy value."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        await asyncio.sleep(0.005)


def free_port() -> int:
    """A loopback port free right now (for servers that cannot bind port 0 themselves)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def pid_gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


@pytest.fixture(autouse=True, scope="session")
def _schemas_read_once() -> Iterator[None]:
    """kubernetes_validate reads (``json.load``) the schema files again for every object it
    validates, the release's 1.3 MB ``_definitions.json`` among them: most of the time of the
    tests that validate renders (test_deploy_versions: 5 releases x ~30 objects x 3 installs).
    Each file is read once per worker here instead. They are files of the installed package
    that jsonschema only reads, so every verdict is the one an uncached read gives; an
    error (a missing schema, a release it lacks) is not cached and is raised as before."""
    try:
        from kubernetes_validate import utils
    except ImportError:  # pragma: no cover - the deploy tests skip then
        yield
        return
    read = utils.schema_contents
    utils.schema_contents = functools.lru_cache(maxsize=None)(read)
    try:
        yield
    finally:
        utils.schema_contents = read


@pytest.fixture
def events_file(tmp_path: Path) -> Path:
    return tmp_path / "events.jsonl"


def popen(args: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    env = dict(os.environ, **kw.pop("env", {}))
    return subprocess.Popen(args, env=env, **kw)


class Collector:
    """Reads a process's pipe in a thread so tests can wait on its content."""

    def __init__(self, stream: Any) -> None:
        import threading

        self.data = bytearray()
        self._stream = stream
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            chunk = self._stream.read1(65536)
            if not chunk:
                return
            self.data += chunk

    def __contains__(self, needle: bytes) -> bool:
        return needle in bytes(self.data)


def prom_query(port: int, expr: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """An instant query on the Prometheus at 127.0.0.1:``port``: its result vector, or []
    while Prometheus is not up yet."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return list(json.load(r)["data"]["result"])
    except OSError:
        return []
