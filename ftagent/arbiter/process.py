"""A real arbiter in a child process, for the demo, the benchmarks and the tests.

``ArbiterProcess`` runs ``python -m ftagent arbiter --listen 127.0.0.1:PORT`` with its
stderr in a file, reads the bound address from the ``listening on`` line (so port 0
works), and can SIGKILL and restart it on the same port, as a crashed Deployment would.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

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


def ftagent_cmd(*args: str) -> Sequence[str]:
    return [sys.executable, "-m", "ftagent", *args]
