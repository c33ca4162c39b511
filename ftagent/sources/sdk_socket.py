"""The agent's end of the SDK: datagrams from ``ftagent.step/phase/collective`` → observations.

The agent binds a unix datagram socket, puts its path in ``FTAGENT_SDK_SOCKET`` for the
trainer, and ``SdkSocketSource.run`` turns each datagram (format: ``ftagent/sdk.py``) into
``Progress(source="sdk")``, ``PhaseMarker(source="sdk")``, ``CollectiveSample``,
``PhaseTiming``, ``Resumed(source="sdk")`` or ``SnapshotsHeld``, stamped
with the agent's monotonic clock on arrival (a datagram is delivered at once, so that is
when the step completed).

Everything is range-checked here, where it enters (``ftagent/wire/limits.py``): at most
``MAX_SDK_DATAGRAM`` bytes, the v1 shape (field count, ASCII digits for integers), steps,
samples, tokens and byte counts in ``[0, MAX_STEP]``, a world size in
``[1, MAX_WORLD_SIZE]``, a collective's seconds finite in ``[0, MAX_SECONDS]`` (a loss may
be NaN or infinite: that is news), names of 1..``MAX_LABEL_NAME`` bytes of printable
UTF-8. A datagram that fails is dropped, counted by reason (``DROP_REASONS``), logged at
most once a minute; nothing raises and nothing is kept, so a buggy or hostile sender
can neither stop the source nor grow the agent. Phase and op names then go through the
agent's ``LabelFold`` (the first ``MAX_PHASES`` / ``MAX_OPS`` distinct names, the rest
become ``other``) before anything sees them: the hang detector learns a budget per phase
name, so the names must be bounded before it, not only as label values.

Its counts (``received``, ``dropped`` by reason) stay here; ``ftagent/metrics.py`` reads
them at scrape time (``AgentMetrics.attach_sdk``).
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

from ftagent.model import (
    CollectiveSample,
    Observation,
    PhaseMarker,
    PhaseTiming,
    Progress,
    Resumed,
    SnapshotsHeld,
)
from ftagent.sdk import MAX_SNAPSHOTS_HELD, RESUME_SOURCES
from ftagent.wire.limits import (
    MAX_LABEL_NAME,
    MAX_OPS,
    MAX_PHASES,
    MAX_PID,
    MAX_SDK_DATAGRAM,
    MAX_SECONDS,
    MAX_STEP,
    MAX_WORLD_SIZE,
    LabelFold,
)

log = logging.getLogger("ftagent.sdk_socket")

MAX_DATAGRAM = MAX_SDK_DATAGRAM
MAX_FLOAT_FIELD = 32  # bytes of one float field ("-1.2345678901234567e-308" is 24)
DRAIN_MAX = 1024  # datagrams handled per wake-up before yielding to the event loop
LOG_EVERY = 60.0  # seconds between two warnings about bad datagrams

# Why a datagram was dropped (the ``reason`` label of ftagent_sdk_datagrams_dropped_total).
OVERSIZE = "oversize"  # longer than MAX_DATAGRAM
VERSION = "version"  # not "v1 ..." (a future version, or not the SDK at all)
MALFORMED = "malformed"  # the wrong number of fields, a field that is not a number
RANGE = "range"  # a number out of its range, a non-finite float where one must be finite
NAME = "name"  # a phase or op name empty, too long, not UTF-8 or not printable
DROP_REASONS = (OVERSIZE, VERSION, MALFORMED, RANGE, NAME)

SdkObservation = (Progress | PhaseMarker | CollectiveSample | PhaseTiming | Resumed
                  | SnapshotsHeld)


class _Drop(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _count(b: bytes, lo: int = 0, hi: int = MAX_STEP) -> int:
    """An integer field: ASCII digits only (no sign, no ``_``, no spaces), in [lo, hi]."""
    if not b.isdigit():  # bytes.isdigit: ASCII 0-9 only
        raise _Drop(MALFORMED)
    if len(b) > 20:  # more than 2**64: out of range without parsing a huge number
        raise _Drop(RANGE)
    v = int(b)
    if not lo <= v <= hi:
        raise _Drop(RANGE)
    return v


def _opt_count(b: bytes) -> int | None:
    return None if b == b"-" else _count(b)


def _float(b: bytes) -> float:
    if len(b) > MAX_FLOAT_FIELD:
        raise _Drop(MALFORMED)
    try:
        return float(b)
    except ValueError:
        raise _Drop(MALFORMED) from None


def _name(b: bytes) -> str:
    if not 0 < len(b) <= MAX_LABEL_NAME:
        raise _Drop(NAME)
    try:
        name = b.decode("utf-8")
    except UnicodeDecodeError:
        raise _Drop(NAME) from None
    if not name.isprintable():
        raise _Drop(NAME)
    return name


def check_datagram(data: bytes, ts: float, phases: Callable[[str], str] = str,
                   ops: Callable[[str], str] = str) -> SdkObservation | str:
    """One SDK datagram → its observation, or the reason (one of ``DROP_REASONS``) it is
    dropped. ``phases`` and ``ops`` bound the names (the agent's ``LabelFold``s)."""
    if len(data) > MAX_DATAGRAM:
        return OVERSIZE
    parts = data.split(b" ")
    if parts[0] != b"v1":
        return VERSION if data else MALFORMED
    if len(parts) < 4:
        return MALFORMED
    kind, args = parts[2], parts[3:]
    try:
        _count(parts[1], 1, MAX_PID)
        if kind == b"s" and len(args) == 4:
            step = _count(args[0])
            loss = None if args[1] == b"-" else _float(args[1])  # NaN and inf are news
            return Progress(step=step, loss=loss, samples=_opt_count(args[2]),
                            tokens=_opt_count(args[3]), source="sdk", ts=ts)
        if kind == b"p" and len(args) == 2 and args[1] in (b"0", b"1"):
            return PhaseMarker(phase=phases(_name(args[0])), begin=args[1] == b"1",
                               source="sdk", ts=ts)
        if kind == b"c" and len(args) == 4:
            op = _name(args[0])
            nbytes, seconds = _count(args[1]), _float(args[2])
            world = _count(args[3], 1, MAX_WORLD_SIZE)
            if not 0.0 <= seconds <= MAX_SECONDS:  # also NaN and inf
                return RANGE
            return CollectiveSample(op=ops(op), nbytes=nbytes, seconds=seconds,
                                    world_size=world, ts=ts)
        if kind == b"a" and len(args) == 5:  # aggregated in the trainer (ftagent.torch)
            op = _name(args[0])
            count, nbytes, seconds = _count(args[1], 1), _count(args[2]), _float(args[3])
            world = _count(args[4], 1, MAX_WORLD_SIZE)
            if not 0.0 <= seconds <= MAX_SECONDS:
                return RANGE
            return CollectiveSample(op=ops(op), nbytes=nbytes, seconds=seconds,
                                    world_size=world, ts=ts, count=count)
        if kind == b"r" and len(args) in (1, 2):
            origin = args[1].decode("ascii", "replace") if len(args) == 2 else ""
            if origin and origin not in RESUME_SOURCES:
                return MALFORMED
            return Resumed(step=_count(args[0]), source="sdk", ts=ts, origin=origin)
        if kind == b"k" and 2 <= len(args) <= MAX_SNAPSHOTS_HELD + 2:
            if _count(args[0], 0, MAX_SNAPSHOTS_HELD) != len(args) - 2:
                return MALFORMED
            return SnapshotsHeld(steps=tuple(sorted({_count(a) for a in args[1:-1]})),
                                 nbytes=_count(args[-1]), ts=ts)
        if kind == b"t" and len(args) == 3:
            name = _name(args[0])
            count, seconds = _count(args[1], 1), _float(args[2])
            if not 0.0 <= seconds <= MAX_SECONDS:
                return RANGE
            return PhaseTiming(phase=phases(name), seconds=seconds, count=count,
                               source="sdk", ts=ts)
    except _Drop as d:
        return d.reason
    return MALFORMED


def parse_datagram(data: bytes, ts: float) -> SdkObservation | None:
    """One SDK datagram → its observation, or None if it is not a valid v1 datagram."""
    obs = check_datagram(data, ts)
    return None if isinstance(obs, str) else obs


class SdkSocketSource:
    """Binds ``path`` (a stale socket there is replaced) and emits what trainers send.

    ``phases`` / ``ops``: the folds names go through (the agent passes its metrics'
    ``phase_names``/``op_names``, the same sets its series use); without, the source
    bounds the names with folds of its own, so its consumers stay bounded either way.
    ``received`` and ``dropped`` count what came in; a collector reads them at scrape
    time (``AgentMetrics.attach_sdk``), so they are kept once."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.monotonic,
                 rcvbuf: int = 1 << 20, phases: Callable[[str], str] | None = None,
                 ops: Callable[[str], str] | None = None) -> None:
        self.path = path
        self.clock = clock
        self.rcvbuf = rcvbuf
        self.phases = phases if phases is not None else LabelFold("phase", MAX_PHASES)
        self.ops = ops if ops is not None else LabelFold("op", MAX_OPS)
        self.received = 0
        self.garbage = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
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
                data = sock.recv(MAX_DATAGRAM + 1)  # +1: a longer one is seen as such
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._warn("receiving from the SDK socket failed: %s", e)
                return
            self.received += 1
            obs = check_datagram(data, self.clock(), self.phases, self.ops)
            if isinstance(obs, str):
                self.garbage += 1
                self.dropped[obs] += 1
                self._warn("dropped %d invalid SDK datagram(s); last (%s): %r", self.garbage,
                           obs, data[:80])
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
