"""The peer replica's I/O: a holder (a small TCP service on the agent), a push, a fetch.

replica_protocol.py decides; this moves bytes. A rank's agent pushes its newest complete
shard to the holder (another node's agent) from a background thread, at most
``bandwidth`` bytes a second, with a deadline on every read and write: a stalled peer
costs that thread its deadline, never the trainer a step (the trainer does not wait on
it). The holder keeps the newest two shards per rank it holds, in its memory-backed
root under ``<root>/<job>/replica/rank-<R>/step-<N>``, written under a temporary name with
the marker last and renamed into place; a replaced pod's agent fetches it back into its
own ``<root>/<job>/rank-<R>/step-<N>`` (with a ``from-peer`` note, so ``checkpoint.load``
reports the source ``peer``) before its trainer starts.

The agent's side (the background push, the fetch before the trainer starts, the flags,
the arbiter's ring and key) is replica_agent.py.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import secrets
import shutil
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import BinaryIO, Protocol, cast

from ftagent.checkpoint import layout
from ftagent.checkpoint import replica_protocol as rp

log = logging.getLogger("ftagent.checkpoint.replica")

FROM_PEER = layout.FROM_PEER  # the note in a fetched shard's directory
IO_TIMEOUT = 10.0  # seconds a read or write may wait on the peer
FETCH_SECONDS = 120.0  # a replaced pod's fetch in all: its trainer waits for it
MAX_CONNECTIONS = 8  # a holder's connections at once; past it a new one is closed
KEPT = 2  # replicas kept per rank by a holder: the newest two
PUSH_SECONDS = 60.0  # a push may take this long plus its size at MIN_RATE
MIN_RATE = 1 << 20  # bytes a second: slower than this, a push is dropped (a slow reader)
_CHUNK = 1 << 20


def replica_dir(root: str, job: str, rank: int) -> str:
    return os.path.join(root, job, "replica", f"rank-{rank}")


class _Reader(Protocol):
    def readline(self, limit: int = -1, /) -> bytes: ...
    def read1(self, n: int = -1, /) -> bytes: ...


def _readline(f: _Reader, limit: int) -> bytes:
    line = f.readline(limit + 1)
    if not line.endswith(b"\n"):
        raise rp.Refused("line too long or the stream ended")
    return line


class _Paced:
    """At most ``rate`` bytes a second (0: unpaced), on an injected clock."""

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self.t0, self.sent = clock(), 0

    def pace(self, n: int) -> None:
        self.sent += n
        if self.rate > 0:
            ahead = self.sent / self.rate - (self.clock() - self.t0)
            if ahead > 0:
                self.sleep(ahead)


def _send_shard(sock: socket.socket, directory: str, marker: layout.Marker,
                transcript: rp.Transcript, rate: int) -> None:
    line = rp.offer(marker)
    transcript.update(line)
    sock.sendall(line)
    paced = _Paced(rate)
    for name, _ in sorted(marker.files.items()):
        with open(os.path.join(directory, name), "rb") as f:
            while chunk := f.read(_CHUNK):
                transcript.update(chunk)
                sock.sendall(chunk)
                paced.pace(len(chunk))
    sock.sendall(transcript.digest())


def _receive_shard(f: _Reader, limits: rp.Limits, transcript: rp.Transcript,
                   final: str, deadline: float | None = None,
                   place: threading.Lock | None = None) -> layout.Marker:
    """Read an offer and its stream from ``f``, into a temporary directory beside
    ``final``; renamed to ``final`` with the marker last when all of it checks."""
    line = _readline(f, rp.MAX_OFFER)
    marker = rp.parse_offer(line, limits)
    transcript.update(line)
    recv = rp.Receiver(marker, transcript)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(final)}.{os.getpid()}."
                       f"{threading.get_ident()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        handles: dict[str, BinaryIO] = {}
        try:
            for name in marker.files:
                handles[name] = open(os.path.join(tmp, name), "wb")  # noqa: SIM115
            while not recv.done:
                if deadline is not None and time.monotonic() > deadline:
                    raise rp.Refused("the peer's shard did not arrive in time")
                data = f.read1(_CHUNK)
                if not data:
                    recv.eof()
                for c in recv.feed(data):
                    handles[c.name].write(c.data)
        finally:
            for h in handles.values():
                h.close()
        layout.write_marker(tmp, marker)  # last
        with place or contextlib.nullcontext():
            newer = [s for s in layout.steps_in(parent) if s > marker.step]
            if newer and place is not None:  # a racing push put a newer one in place
                raise rp.Refused(f"a shard of step {marker.step}, this agent holds step "
                                 f"{newer[-1]} of rank {marker.rank} already")
            if os.path.isdir(final):
                shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return marker


class Holder:
    """The agent's replica service: takes pushes of the ranks it holds for ``job``,
    serves fetches of them. Every connection must prove the job's replica key."""

    def __init__(self, root: str, job: str, key: bytes | Callable[[], bytes], *,
                 ranks: set[int] | None = None, max_bytes: int = 0,
                 host: str = "127.0.0.1", port: int = 0, rate: int = 0) -> None:
        """``key``: the job's replica key, or a function giving the current one (the
        arbiter's, which comes with its Welcome and changes with a failover)."""
        self.root, self.job = root, job
        self.key: Callable[[], bytes] = key if callable(key) else (lambda: key)
        self.ranks, self.max_bytes, self.rate = ranks, max_bytes, rate
        self.refused: list[str] = []  # why, newest last (bounded)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._place = threading.Lock()  # one shard put into place at a time
        self._clear_temps()
        holder = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = IO_TIMEOUT

            def handle(self) -> None:
                if not holder._slots.acquire(blocking=False):
                    holder._refuse("too many connections at once: one closed")
                    return
                try:
                    self._handle()
                finally:
                    holder._slots.release()

            def _handle(self) -> None:
                try:
                    holder._serve(self.connection, self.rfile)
                except (rp.Refused, layout.SnapshotRejected) as e:
                    holder._refuse(str(e))
                    with contextlib.suppress(OSError):
                        self.connection.sendall(b"REFUSED " + str(e)[:200].encode() + b"\n")
                except OSError as e:
                    holder._refuse(f"connection: {e}")

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="ftagent-replica", daemon=True)

    def start(self) -> Holder:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _refuse(self, why: str) -> None:
        # a fetch of a rank it holds nothing of is a fresh job's first start: said, not warned
        (log.info if why.startswith("no replica of rank") else log.warning)(
            "replica: refused: %s", why)
        self.refused = [*self.refused[-31:], why]

    def _clear_temps(self) -> None:
        """Shards a dead holder left half-received (never read; their space is freed)."""
        base = os.path.join(self.root, self.job, "replica")
        with contextlib.suppress(OSError):
            for name in os.listdir(base):
                d = os.path.join(base, name)
                with contextlib.suppress(OSError):
                    for t in os.listdir(d):
                        if t.startswith(".") and t.endswith(".tmp"):
                            shutil.rmtree(os.path.join(d, t), ignore_errors=True)

    def held(self, rank: int) -> int | None:
        steps = layout.steps_in(replica_dir(self.root, self.job, rank))
        return steps[-1] if steps else None

    def _bytes_held(self, but: int | None) -> int:
        """Bytes of the replicas held for every rank but ``but`` (their markers')."""
        total = 0
        base = os.path.join(self.root, self.job, "replica")
        with contextlib.suppress(OSError):
            for name in os.listdir(base):
                if not name.startswith("rank-") or name == f"rank-{but}":
                    continue
                for s in layout.steps_in(os.path.join(base, name)):
                    with contextlib.suppress(layout.SnapshotRejected):
                        total += layout.read_marker(os.path.join(base, name,
                                                                 f"step-{s}")).nbytes
        return total

    def _serve(self, conn: socket.socket, rfile: _Reader) -> None:
        h = rp.parse_hello(_readline(rfile, rp.MAX_LINE), job=self.job)
        key = self.key()
        if not key:
            raise rp.Refused("this agent has no replica key yet (the arbiter's Welcome)")
        server_nonce = secrets.token_hex(16)
        conn.sendall(rp.challenge(key, h.nonce, server_nonce))
        rp.check_response(_readline(rfile, rp.MAX_LINE), key, h.nonce, server_nonce)
        t = rp.Transcript(key, h.nonce, server_nonce)
        if h.op == "push":
            line = _readline(rfile, rp.MAX_OFFER)
            offered = rp.parse_offer(line, rp.Limits(self.job, self.ranks, self.max_bytes))
            held = self.held(offered.rank)  # then not older than the one held for it
            limits = rp.Limits(self.job, self.ranks, self.max_bytes,
                               {} if held is None else {offered.rank: held},
                               other_bytes=self._bytes_held(but=offered.rank))
            marker = rp.parse_offer(line, limits)  # refused before a directory is made
            rdir = replica_dir(self.root, self.job, marker.rank)
            final = os.path.join(rdir, f"step-{marker.step}")
            deadline = time.monotonic() + PUSH_SECONDS + marker.nbytes / MIN_RATE
            _receive_shard(_Prefixed(line, rfile), limits, t, final, deadline,
                           place=self._place)
            with self._place:  # KEPT per rank: the newest, and the one before it (which
                # a replaced pod loads when the others' newest common step is that one)
                # while the cap leaves room for it (the newest alone fits: checked above)
                steps = layout.steps_in(rdir)
                over = self.max_bytes and self._bytes_held(None) > self.max_bytes
                for s in steps[:-1] if over else steps[:-KEPT]:
                    shutil.rmtree(os.path.join(rdir, f"step-{s}"), ignore_errors=True)
            conn.sendall(b"OK\n")
        else:
            assert h.rank is not None
            kept = layout.steps_in(replica_dir(self.root, self.job, h.rank))
            if not kept:
                raise rp.Refused(f"no replica of rank {h.rank} here")
            # the step asked for (the arbiter's resume step) where held, else the newest
            step = h.step if h.step is not None and h.step in kept else kept[-1]
            d = os.path.join(replica_dir(self.root, self.job, h.rank), f"step-{step}")
            marker = layout.verify(d, job=self.job, rank=h.rank, step=step)
            _send_shard(conn, d, marker, t, self.rate)


class _Prefixed:
    """A reader that gives ``first`` back before the rest of ``f`` (the offer already read)."""

    def __init__(self, first: bytes, f: _Reader) -> None:
        self._first, self._f = first, f

    def readline(self, limit: int = -1, /) -> bytes:
        first, self._first = self._first, b""
        return first or self._f.readline(limit)

    def read1(self, n: int = -1, /) -> bytes:
        return self._f.read1(n)


def _connect(address: tuple[str, int], key: bytes, job: str, op: str, rank: int | None,
             step: int | None = None
             ) -> tuple[socket.socket, io.BufferedReader, rp.Transcript]:
    sock = socket.create_connection(address, timeout=IO_TIMEOUT)
    sock.settimeout(IO_TIMEOUT)
    f = cast(io.BufferedReader, sock.makefile("rb"))
    nonce = secrets.token_hex(16)
    sock.sendall(rp.hello(job, op, nonce, rank, step))
    line = f.readline(rp.MAX_LINE + 1)
    if line.startswith(b"REFUSED"):
        raise rp.Refused(line[8:].decode(errors="replace").strip())
    server_nonce = rp.check_challenge(line, key, nonce)
    sock.sendall(rp.response(key, nonce, server_nonce))
    return sock, f, rp.Transcript(key, nonce, server_nonce)


def push(address: tuple[str, int], key: bytes, root: str, job: str, rank: int,
         *, rate: int = 0) -> int | None:
    """Copy this rank's newest complete shard (verified first) to the holder at
    ``address``, at most ``rate`` bytes a second; its step (None: nothing to copy).
    Refused (the holder's reason) or OSError (timeout, connection) otherwise."""
    steps = layout.complete_steps(root, job, rank)
    if not steps:
        return None
    step = steps[-1]
    d = layout.step_dir(root, job, rank, step)
    marker = layout.verify(d, job=job, rank=rank, step=step)
    sock, f, t = _connect(address, key, job, "push", None)
    with sock, f:
        _send_shard(sock, d, marker, t, rate)
        answer = f.readline(256)
    if answer != b"OK\n":
        raise rp.Refused(answer.decode(errors="replace").removeprefix("REFUSED ").strip()
                         or "the holder closed the connection")
    return step


def fetch(address: tuple[str, int], key: bytes, root: str, job: str, rank: int,
          *, within: float = FETCH_SECONDS, step: int | None = None) -> int:
    """This rank's shard from the holder at ``address`` (``step`` where it holds it, else
    its newest), checked, into this agent's memory root where ``checkpoint.load`` finds it
    (noted ``from-peer``); its step. Refused when it has not all come ``within`` seconds
    (the trainer is waiting)."""
    deadline = time.monotonic() + within
    sock, f, t = _connect(address, key, job, "fetch", rank, step)
    with sock, f:
        line = f.readline(rp.MAX_OFFER + 1)
        if line.startswith(b"REFUSED"):
            raise rp.Refused(line[8:].decode(errors="replace").strip())
        marker = rp.parse_offer(line, rp.Limits(job, {rank}))
        final = layout.step_dir(root, job, rank, marker.step)
        _receive_shard(_Prefixed(line, f), rp.Limits(job, {rank}), t, final, deadline)
    with open(os.path.join(final, FROM_PEER), "w") as note:
        note.write(f"{address[0]}:{address[1]}\n")
    return marker.step

