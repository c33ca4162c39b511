"""The agent's end of the SDK: datagrams from ``ftagent.step/phase/collective`` → observations.

The agent binds a unix datagram socket, puts its path in ``FTAGENT_SDK_SOCKET`` for the
trainer, and ``SdkSocketSource.run`` turns each datagram (format: ``ftagent/sdk.py``) into
``Progress(source="sdk")``, ``PhaseMarker(source="sdk")`` or ``CollectiveSample``, stamped
with the agent's monotonic clock on arrival (a datagram is delivered at once, so that is
when the step completed). A datagram that does not parse is counted, logged at most once
a minute, and skipped: a buggy or hostile sender cannot stop the source.

``busbw`` converts a collective's time into the bandwidths nccl-tests reports.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import stat
import time
from collections.abc import Callable

from ftagent.model import CollectiveSample, Observation, PhaseMarker, Progress

log = logging.getLogger("ftagent.sdk_socket")

MAX_DATAGRAM = 4096  # the SDK's datagrams are < 200 bytes
DRAIN_MAX = 1024  # datagrams handled per wake-up before yielding to the event loop
LOG_EVERY = 60.0  # seconds between two warnings about bad datagrams


def _float(b: bytes) -> float | None:
    return None if b == b"-" else float(b)


def _int(b: bytes) -> int | None:
    return None if b == b"-" else int(b)


def parse_datagram(data: bytes, ts: float) -> Progress | PhaseMarker | CollectiveSample | None:
    """One SDK datagram → its observation, or None if it is not a valid v1 datagram."""
    parts = data.split(b" ")
    if len(parts) < 4 or parts[0] != b"v1" or not parts[1].isdigit():
        return None
    kind, args = parts[2], parts[3:]
    try:
        if kind == b"s" and len(args) == 4:
            step = int(args[0])
            samples, tokens = _int(args[2]), _int(args[3])
            if step < 0 or (samples is not None and samples < 0) or \
                    (tokens is not None and tokens < 0):
                return None
            return Progress(step=step, loss=_float(args[1]), samples=samples, tokens=tokens,
                            source="sdk", ts=ts)
        if kind == b"p" and len(args) == 2 and args[1] in (b"0", b"1") and args[0]:
            return PhaseMarker(phase=args[0].decode("utf-8", "replace"), begin=args[1] == b"1",
                               source="sdk", ts=ts)
        if kind == b"c" and len(args) == 4 and args[0]:
            nbytes, seconds, world = int(args[1]), float(args[2]), int(args[3])
            if nbytes < 0 or not 0 <= seconds < math.inf or world < 1:
                return None
            return CollectiveSample(op=args[0].decode("utf-8", "replace"), nbytes=nbytes,
                                    seconds=seconds, world_size=world, ts=ts)
    except ValueError:
        return None
    return None


def busbw(op: str, nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s, as nccl-tests computes them (doc/PERFORMANCE.md):
    algbw = bytes / time; busbw = algbw × 2(n-1)/n for all_reduce, (n-1)/n for
    reduce_scatter, all_gather and all_to_all, 1 for broadcast, reduce and unknown ops.
    Torch's variants (``all_gather_into_tensor``, ``all_to_all_single``...) count as their
    base op. A zero or invalid time gives (0, 0)."""
    if not 0 < seconds < math.inf or nbytes < 0:
        return 0.0, 0.0
    n = max(int(n), 1)
    algbw = nbytes / seconds
    name = op.lower().replace("_", "").replace("-", "")
    if name.startswith("allreduce"):
        factor = 2.0 * (n - 1) / n
    elif name.startswith(("reducescatter", "allgather", "alltoall")):
        factor = (n - 1) / n
    else:
        factor = 1.0
    return algbw, algbw * factor


class SdkSocketSource:
    """Binds ``path`` (a stale socket there is replaced) and emits what trainers send."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.monotonic,
                 rcvbuf: int = 1 << 20) -> None:
        self.path = path
        self.clock = clock
        self.rcvbuf = rcvbuf
        self.received = 0
        self.garbage = 0
        self._sock: socket.socket | None = None
        self._ino: int | None = None
        self._last_warning = -math.inf

    def bind(self) -> None:
        """Bind now (idempotent), so the trainer can be started with the path in its env
        before ``run`` is scheduled. Raises OSError (with the path) if it cannot."""
        if self._sock is not None:
            return
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(st.st_mode):
                raise FileExistsError(f"{self.path} exists and is not a socket: remove it or "
                                      "choose another SDK socket path")
            os.unlink(self.path)  # a previous agent's socket
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            sock.bind(self.path)
            self._ino = os.stat(self.path).st_ino
        except OSError:
            sock.close()
            raise
        self._sock = sock

    async def run(self, emit: Callable[[Observation], None]) -> None:
        """Emit observations until cancelled; then close the socket and remove its file."""
        self.bind()
        sock = self._sock
        assert sock is not None
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._drain, sock, emit)
        try:
            await asyncio.Event().wait()
        finally:
            loop.remove_reader(sock.fileno())
            self.close()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        sock.close()
        try:
            if os.stat(self.path).st_ino == self._ino:  # not a newer agent's socket
                os.unlink(self.path)
        except OSError:
            pass

    def _drain(self, sock: socket.socket, emit: Callable[[Observation], None]) -> None:
        for _ in range(DRAIN_MAX):
            try:
                data = sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._warn("receiving from the SDK socket failed: %s", e)
                return
            self.received += 1
            obs = parse_datagram(data, self.clock())
            if obs is None:
                self.garbage += 1
                self._warn("ignored %d malformed SDK datagram(s); last: %r", self.garbage,
                           data[:80])
                continue
            try:
                emit(obs)
            except Exception:  # noqa: BLE001 - a sink's bug must not stop the source
                log.exception("handling an SDK observation failed")

    def _warn(self, msg: str, *args: object) -> None:
        now = self.clock()
        if now - self._last_warning >= LOG_EVERY:
            self._last_warning = now
            log.warning(msg, *args)
