"""The trainer-side SDK: ``ftagent.step()``, ``ftagent.phase()``, ``ftagent.collective()``.

Exact progress instead of guessing from log lines, phases the hang detector should
budget separately, and collective timings for bus-bandwidth metrics::

    import ftagent
    for step in range(start, steps):
        loss = train_step(batch)
        ftagent.step(step, loss=loss.item(), samples=batch_size)
        if step % 1000 == 0:
            with ftagent.phase("checkpoint"):
                save(...)

Every call is a no-op when the process does not run under ``ftagent run`` (the agent
sets ``FTAGENT_SDK_SOCKET``), and nothing here ever raises into the trainer or blocks it:
each call sends one datagram on a non-blocking unix socket and drops it when the agent
is gone or its queue is full (``net.unix.max_dgram_qlen`` datagrams, 10 on many
kernels). A dropped step is superseded by the next one; a phase marker, which nothing
supersedes, waits up to 5 ms for room first. Only the standard library is imported, so
``import ftagent`` stays cheap. After ``fork()`` the child opens its own socket
(``os.register_at_fork``).

Wire format, version 1: one ASCII datagram per call, fields separated by one space,
``-`` for "not given"; the receiver is ``ftagent/sources/sdk_socket.py``::

    v1 <pid> s <step> <loss> <samples> <tokens>      step completed
    v1 <pid> p <phase> <1|0>                         phase begins (1) / ends (0)
    v1 <pid> c <op> <nbytes> <seconds> <world_size>  one timed collective
    v1 <pid> a <op> <count> <nbytes> <seconds> <world_size>
                                                     count collectives of one size bucket,
                                                     bytes and seconds summed
    v1 <pid> t <phase> <count> <seconds>             count timed parts of steps (forward,
                                                     backward, optimizer, data), summed
    v1 <pid> r <step> [<source>]                     resumed after <step> (a checkpoint
                                                     saved at it was loaded); source:
                                                     memory | peer | disk (ftagent.checkpoint)
    v1 <pid> k <n> <step>... <bytes>                 the n (<= 8) steps whose snapshot this
                                                     rank holds complete, and the bytes they
                                                     take in memory (ftagent.checkpoint)

Numbers are decimal (``repr`` of a float: ``nan`` and ``inf`` allowed for the loss);
``a`` and ``t`` are what ``ftagent.torch.instrument()`` sends, a few times a second;
phase and op names are printable UTF-8 without whitespace (whitespace and control
characters become ``_``), 1..64 bytes. The sender keeps to the receiver's limits
(``ftagent/wire/limits.py``): a step or a collective out of range is not sent (the agent
would drop it), samples or tokens out of range are sent as ``-``. A receiver ignores
datagrams whose first field it does not know (a future version), and checks everything
again: the socket is open to any process of the pod.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import time
from contextlib import ContextDecorator, suppress
from typing import Any

from ftagent.wire.limits import MAX_LABEL_NAME, MAX_SECONDS, MAX_STEP, MAX_WORLD_SIZE

ENV = "FTAGENT_SDK_SOCKET"
VERSION = b"v1"
RETRY_SECONDS = 1.0  # after the agent was found gone, try to reach it again this often
PHASE_WAIT = 0.005  # a phase marker waits this long for room in a full queue; steps drop
NAME_MAX = MAX_LABEL_NAME  # bytes of a phase or op name


def _num(v: Any) -> bytes:
    """A number for the wire; ``-`` for None or anything that is not a number. A tensor
    is converted with ``float()`` (which waits for the device: pass ``loss.item()``)."""
    if v is None:
        return b"-"
    try:
        return repr(float(v)).encode()
    except Exception:  # noqa: BLE001 - never raise into the trainer
        return b"-"


def _int(v: Any, lo: int = 0, hi: int = MAX_STEP) -> bytes:
    """A count for the wire; ``-`` for None, a non-integer or a value out of [lo, hi]."""
    if v is None:
        return b"-"
    try:
        n = int(v)
    except Exception:  # noqa: BLE001
        return b"-"
    return b"%d" % n if lo <= n <= hi else b"-"


def _name(v: Any) -> bytes:
    """1..NAME_MAX bytes of printable UTF-8 without spaces, cut at a character boundary."""
    try:
        name = "".join(c if c.isprintable() and not c.isspace() else "_"
                       for c in str(v)[:NAME_MAX]) or "_"
    except Exception:  # noqa: BLE001 - a __str__ that raises
        name = "_"
    raw = name.encode("utf-8", "replace")
    if len(raw) > NAME_MAX:
        raw = raw[:NAME_MAX].decode("utf-8", "ignore").encode()
    return raw


class _Client:
    """The one connection of this process to its agent (see STYLE.md: the SDK's client
    is the only module-level mutable state)."""

    __slots__ = ("path", "sock", "prefix", "retry_at")

    def __init__(self) -> None:
        self.path: str | None = os.environ.get(ENV) or None
        self.sock: socket.socket | None = None
        self.prefix = b""
        self.retry_at = 0.0

    def ready(self) -> bool:
        """Connected, or connected now if the agent is configured and it is time to try.
        Checked before formatting, so a trainer without an agent pays almost nothing."""
        return self.sock is not None or (self.path is not None and self._connect())

    def send(self, payload: bytes, wait: float = 0.0) -> None:
        """Send one datagram; if the agent's queue is full, wait up to ``wait`` seconds
        for room (phase markers), else drop it (steps: the next one supersedes it)."""
        sock = self.sock
        if sock is None:
            return
        try:
            try:
                sock.send(self.prefix + payload)
            except (BlockingIOError, InterruptedError):
                if wait <= 0 or not select.select((), (sock,), (), wait)[1]:
                    return  # dropped; the connection stays
                sock.send(self.prefix + payload)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            if e.errno != errno.ENOBUFS:  # transient; anything else: the agent is gone
                self.close(retry=True)
        except Exception:  # noqa: BLE001 - never raise into the trainer
            pass

    def _connect(self) -> bool:
        if time.monotonic() < self.retry_at:
            return False
        try:
            sock = socket.socket(socket.AF_UNIX,
                                 socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        except OSError:
            self.retry_at = time.monotonic() + RETRY_SECONDS
            return False
        try:
            sock.connect(self.path or "")
        except OSError:
            sock.close()
            self.retry_at = time.monotonic() + RETRY_SECONDS
            return False
        self.sock = sock
        self.prefix = VERSION + b" %d " % os.getpid()
        return True

    def close(self, retry: bool = False) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with suppress(OSError):
                sock.close()
        self.retry_at = time.monotonic() + RETRY_SECONDS if retry else 0.0

    def after_fork(self) -> None:
        """In a forked child: its own socket, its own pid in the prefix, the current env."""
        self.close()
        self.path = os.environ.get(ENV) or None


_client = _Client()
os.register_at_fork(after_in_child=_client.after_fork)


def reconnect() -> None:
    """Re-read ``FTAGENT_SDK_SOCKET`` and reconnect on the next call (after changing the
    environment in-process; a forked child does this by itself)."""
    _client.after_fork()


def step(n: int, loss: float | None = None, samples: int | None = None,
         tokens: int | None = None) -> None:
    """Step ``n`` completed (with its loss, and the samples/tokens it processed)."""
    if not _client.ready():
        return
    try:
        try:  # the common case, formatted in one go; anything out of range: the slow way
            if not (0 <= n <= MAX_STEP and (samples is None or 0 <= samples <= MAX_STEP)
                    and (tokens is None or 0 <= tokens <= MAX_STEP)):
                raise ValueError
            msg = b"s %d %b %b %b" % (n, b"-" if loss is None else b"%r" % float(loss),
                                       b"-" if samples is None else b"%d" % samples,
                                       b"-" if tokens is None else b"%d" % tokens)
        except Exception:  # noqa: BLE001 - odd types: field by field, "-" for bad ones
            step_ = _int(n)
            if step_ == b"-":
                return  # no step to report: the agent would drop it
            msg = b"s %s %s %s %s" % (step_, _num(loss), _int(samples), _int(tokens))
        _client.send(msg)
    except Exception:  # noqa: BLE001 - never raise into the trainer
        pass


class phase(ContextDecorator):  # noqa: N801 - used like a function: with ftagent.phase(...)
    """A long phase the hang detector budgets on its own (checkpoint, eval)::

        with ftagent.phase("checkpoint"):
            save()

        @ftagent.phase("eval")
        def evaluate(): ...
    """

    def __init__(self, name: str) -> None:
        self.name = _name(name)

    def __enter__(self) -> phase:
        if _client.ready():
            _client.send(b"p %s 1" % self.name, PHASE_WAIT)
        return self

    def __exit__(self, *exc: object) -> None:
        if _client.ready():
            _client.send(b"p %s 0" % self.name, PHASE_WAIT)


def collective(op: str, nbytes: int, seconds: float, world_size: int) -> None:
    """One timed collective (``all_reduce``, ``all_gather``, ...) of ``nbytes`` bytes (for
    all_gather / reduce_scatter: the total over ranks, as nccl-tests counts it)."""
    if not _client.ready():
        return
    try:
        size, world = _int(nbytes), _int(world_size, 1, MAX_WORLD_SIZE)
        secs = float(seconds)
        if size == b"-" or world == b"-" or not 0.0 <= secs <= MAX_SECONDS:
            return  # the agent would drop it (and NaN fails the comparison)
        _client.send(b"c %s %s %r %s" % (_name(op), size, secs, world))
    except Exception:  # noqa: BLE001
        pass


def collectives(op: str, count: int, nbytes: int, seconds: float, world_size: int) -> None:
    """``count`` collectives of one op and group size, ``nbytes`` bytes and ``seconds``
    in total (aggregated in the trainer: ``ftagent.torch`` sends one of these per op and
    size bucket a few times a second instead of a datagram per collective)."""
    if not _client.ready():
        return
    try:
        n, size = _int(count, 1), _int(nbytes)
        world = _int(world_size, 1, MAX_WORLD_SIZE)
        secs = float(seconds)
        if b"-" in (n, size, world) or not 0.0 <= secs <= MAX_SECONDS:
            return
        _client.send(b"a %s %s %s %r %s" % (_name(op), n, size, secs, world))
    except Exception:  # noqa: BLE001
        pass


RESUME_SOURCES = ("memory", "peer", "disk")  # where ftagent.checkpoint found the state
MAX_SNAPSHOTS_HELD = 8  # steps one ``snapshots`` datagram names


def resumed(n: int, source: str | None = None) -> None:
    """The trainer resumed after step ``n``: it loaded the checkpoint saved once step ``n``
    was done, and its next step is ``n + 1``. Call it once per start, after loading and
    before the first step: the arbiter's goodput ledger then counts the steps after ``n``
    that the job had already done as recomputed (without it, the ledger takes the first
    step reported after the restart). ``source`` (``RESUME_SOURCES``: ftagent.checkpoint
    says it) is where the state came from. Sent like a phase marker (nothing supersedes it)."""
    if not _client.ready():
        return
    try:
        step_ = _int(n)
        if step_ != b"-":
            tail = b" " + source.encode() if source in RESUME_SOURCES else b""
            _client.send(b"r %s%s" % (step_, tail), PHASE_WAIT)
    except Exception:  # noqa: BLE001 - never raise into the trainer
        pass


def snapshots(steps: list[int], nbytes: int = 0) -> None:
    """The steps whose snapshot this rank holds complete and the bytes they take in
    memory (ftagent.checkpoint, after each write and load): the agent tells the arbiter,
    which picks the newest step every rank holds for the next restart. The newest
    ``MAX_SNAPSHOTS_HELD`` are sent."""
    if not _client.ready():
        return
    try:
        names = [_int(s) for s in sorted(set(steps))[-MAX_SNAPSHOTS_HELD:]]
        names = [n for n in names if n != b"-"]
        size = _int(nbytes)
        _client.send(b" ".join([b"k", b"%d" % len(names), *names,
                                b"0" if size == b"-" else size]), PHASE_WAIT)
    except Exception:  # noqa: BLE001 - never raise into the trainer
        pass


def phase_time(phase_name: str, seconds: float, count: int = 1) -> None:
    """``count`` occurrences of a part of the step (``forward``, ``backward``,
    ``optimizer``, ``data``) taking ``seconds`` in total: a measurement for
    ``ftagent_phase_duration_seconds``, not a phase the hang detector budgets (that is
    ``phase()``)."""
    if not _client.ready():
        return
    try:
        n, secs = _int(count, 1), float(seconds)
        if n == b"-" or not 0.0 <= secs <= MAX_SECONDS:
            return
        _client.send(b"t %s %s %r" % (_name(phase_name), n, secs))
    except Exception:  # noqa: BLE001
        pass
