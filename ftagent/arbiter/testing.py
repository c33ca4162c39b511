"""Helpers for tests, the demo and benchmarks: a real arbiter in a child process.

``ArbiterProcess`` runs ``python -m ftagent arbiter --listen 127.0.0.1:PORT`` with its
stderr in a file, reads the bound address from the ``listening on`` line (so port 0
works), and can SIGKILL and restart it on the same port, as a crashed Deployment would.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from ftagent.agent.reporter import ArbiterLink
from ftagent.config import ArbiterClientConfig, IdentityConfig

_LISTENING = re.compile(r"^listening on (\S+:\d+)$", re.M)


class ArbiterProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 log_dir: str | None = None, start_timeout: float = 20.0) -> None:
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self._own_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="ftagent-arbiter-"))
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.port = 0
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"arbiter-{self.starts}.log"

    def start(self, port: int | None = None) -> str:
        """Start (on ``port``, default: the previous one, else a free one); return HOST:PORT."""
        port = self.port if port is None else port
        self.starts += 1
        log = self.log_path.open("wb")
        cmd = [sys.executable, "-m", "ftagent", "arbiter", "--listen", f"127.0.0.1:{port}",
               "--metrics-port", "-1", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            m = _LISTENING.search(self.log_path.read_text(errors="replace"))
            if m:
                self.address = m.group(1)
                self.port = int(self.address.rpartition(":")[2])
                return self.address
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"arbiter did not start: {self.log_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL, like a node or OOM kill: no goodbye to the agents."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode if self.proc else None

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace")
                         for p in sorted(self.log_dir.glob("arbiter-*.log")))

    def __enter__(self) -> ArbiterProcess:
        self.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        if e is None and self._own_dir:  # keep the logs of a failure for the reader
            shutil.rmtree(self.log_dir, ignore_errors=True)
        elif e is not None:
            sys.stderr.write(f"arbiter logs kept in {self.log_dir}\n")


async def wait_until(cond: Callable[[], bool | Awaitable[bool]], timeout: float,
                     what: str = "condition", interval: float = 0.02) -> None:
    """Poll ``cond`` until true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


@asynccontextmanager
async def running_links(address: str, job: str, world_size: int, *, ranks: Sequence[int] = (),
                        token: str = "", tls_ca: str = "", tls_cert: str = "",
                        tls_key: str = "", connect_timeout: float = 10.0,
                        **kwargs: Any) -> AsyncIterator[list[ArbiterLink]]:
    """Simulated agents: one running ArbiterLink per rank, connected before the body runs.

    ``kwargs`` go to ArbiterLink (max_restarts, alert_only, progress_interval).
    """
    client = ArbiterClientConfig(arbiter=address, token=token, tls_ca=tls_ca,
                                 tls_cert=tls_cert, tls_key=tls_key)
    links = [ArbiterLink(client,
                         IdentityConfig(job=job, rank=r, world_size=world_size, pod=f"pod-{r}",
                                        node=f"node-{r}"), **kwargs)
             for r in (ranks or range(world_size))]
    tasks = [asyncio.create_task(link.run()) for link in links]
    try:
        await wait_until(lambda: all(link.connected for link in links), connect_timeout,
                         f"{len(links)} links of {job} to connect")
        yield links
    finally:
        for link in links:
            await link.close()
        await asyncio.gather(*tasks, return_exceptions=True)


def ftagent_cmd(*args: str) -> Sequence[str]:
    return [sys.executable, "-m", "ftagent", *args]
