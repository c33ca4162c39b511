"""The peer replica's wire protocol, without I/O: handshake, offer, stream, verdict.

One agent (the sender) copies one rank's newest complete shard to another agent (the
holder); a replaced pod's agent fetches it back the same way, the holder sending.
replica.py moves these bytes over TCP on loopback or the pod network; the tests feed them
directly. Everything a peer says is checked here before anything is written:

1. **Handshake** (both directions authenticated): each side sends a line with a fresh
   nonce; each proves it holds the job's replica key (the one the arbiter handed every
   agent it admitted for the job, arbiter/replica_ring.replica_key; without an arbiter,
   :func:`replica_key` of the job token both agents hold) with an HMAC over both nonces and
   its role. A peer without the key, or replaying another connection's proof, is refused.
2. **Offer**: one bounded JSON line, the shard's completion marker (layout.parse_marker:
   type-checked) and what it is: job, rank, step. Refused when the job is not this one, the
   rank is not one this holder keeps, the marker does not name the same (job, rank, step),
   the step is not newer than the one held, or the size is over the holder's cap.
3. **Stream**: each file of the marker, in name order, exactly its size; its CRC-32 is
   computed as it arrives and must be the marker's. Then 32 bytes: the HMAC of everything
   after the handshake (the offer and every byte), so a shard altered on the way is refused.
4. **Marker last**: only when all of it checks does :meth:`Receiver.feed` say ``done``; the
   caller writes the marker then and renames the directory into place (layout.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ftagent.checkpoint import layout

VERSION = 1
MAX_LINE = 1 << 16  # a handshake line
MAX_OFFER = layout.MAX_MARKER_BYTES + 4096
TRAILER = 32  # HMAC-SHA256


class Refused(Exception):
    """A peer's handshake, offer or stream that must not be taken; ``str()`` says why."""


def replica_key(token: str, job: str) -> bytes:
    """The key both agents of ``job`` derive from the job token they hold (never sent),
    where no arbiter hands one out."""
    return hmac.new(token.encode(), f"ftagent-replica/v{VERSION}/{job}".encode(),
                    hashlib.sha256).digest()


def proof(key: bytes, role: str, client_nonce: str, server_nonce: str) -> str:
    return hmac.new(key, f"{role}|{client_nonce}|{server_nonce}".encode(),
                    hashlib.sha256).hexdigest()


def hello(job: str, op: str, nonce: str, rank: int | None = None,
          step: int | None = None) -> bytes:
    """The client's first line: what it wants (``push`` a shard, ``fetch`` one: of
    ``step`` where held) and its nonce."""
    d: dict[str, object] = {"v": VERSION, "job": job, "op": op, "nonce": nonce, "rank": rank}
    if step is not None:
        d["step"] = step
    return json.dumps(d).encode() + b"\n"


@dataclass(frozen=True)
class Hello:
    job: str
    op: str
    nonce: str
    rank: int | None
    step: int | None = None  # a fetch: this step where held (None: the newest)


def parse_hello(line: bytes, *, job: str) -> Hello:
    """The client's hello, checked: this job, a known op, a nonce of 32 hex digits."""
    d = _json_line(line, MAX_LINE, "hello")
    nonce, op, rank = d.get("nonce"), d.get("op"), d.get("rank")
    if d.get("v") != VERSION or not isinstance(d.get("job"), str) or \
            op not in ("push", "fetch") or not _nonce_ok(nonce) or \
            not (rank is None or (isinstance(rank, int) and not isinstance(rank, bool)
                                  and rank >= 0)):
        raise Refused("hello is not one an ftagent agent sends")
    if d["job"] != job:
        raise Refused(f"hello for job {d['job'][:64]!r}, this agent is job {job!r}")
    if op == "fetch" and rank is None:
        raise Refused("fetch without a rank")
    step = d.get("step")
    if not (step is None or (isinstance(step, int) and not isinstance(step, bool)
                             and step >= 0)):
        raise Refused("hello is not one an ftagent agent sends")
    return Hello(d["job"], op, str(nonce), rank, step)


def challenge(key: bytes, client_nonce: str, server_nonce: str) -> bytes:
    """The server's line: its nonce and its proof."""
    return json.dumps({"nonce": server_nonce,
                       "proof": proof(key, "server", client_nonce, server_nonce)}
                      ).encode() + b"\n"


def check_challenge(line: bytes, key: bytes, client_nonce: str) -> str:
    """The server's proof checked (the client knows it talks to a holder of the key);
    its nonce."""
    d = _json_line(line, MAX_LINE, "challenge")
    nonce = d.get("nonce")
    if not _nonce_ok(nonce) or nonce == client_nonce or not isinstance(d.get("proof"), str) \
            or not hmac.compare_digest(d["proof"], proof(key, "server", client_nonce,
                                                         str(nonce))):
        raise Refused("the peer does not hold this job's replica key")
    return str(nonce)


def response(key: bytes, client_nonce: str, server_nonce: str) -> bytes:
    return json.dumps({"proof": proof(key, "client", client_nonce, server_nonce)}
                      ).encode() + b"\n"


def check_response(line: bytes, key: bytes, client_nonce: str, server_nonce: str) -> None:
    d = _json_line(line, MAX_LINE, "response")
    if not isinstance(d.get("proof"), str) or not hmac.compare_digest(
            d["proof"], proof(key, "client", client_nonce, server_nonce)):
        raise Refused("the peer does not hold this job's replica key")


def offer(marker: layout.Marker) -> bytes:
    """The offer line of a shard: its marker (what the holder writes last)."""
    return marker.to_json().encode() + b"\n"


@dataclass(frozen=True)
class Limits:
    """What a holder takes: this job, these ranks, at most ``max_bytes`` in all (the
    replicas of other ranks it holds take ``other_bytes`` of it), and only a step newer
    than the one it holds for that rank (``held``)."""

    job: str
    ranks: Collection[int] | None = None  # None: any rank (a fetch: the one asked for)
    max_bytes: int = 0  # 0: no cap
    held: dict[int, int] = field(default_factory=dict)  # rank -> step held
    step: int | None = None  # a fetch: exactly this step (None: any)
    other_bytes: int = 0  # held for other ranks, counted against max_bytes


def parse_offer(line: bytes, limits: Limits) -> layout.Marker:
    """The offered shard's marker, or Refused saying why (foreign job, rank not kept,
    stale step, over the cap)."""
    if len(line) > MAX_OFFER:
        raise Refused("offer is too large")
    try:
        m = layout.parse_marker(line.rstrip(b"\n"), "the peer's offer")
    except layout.SnapshotRejected as e:
        raise Refused(str(e)) from None
    if m.job != limits.job:
        raise Refused(f"a shard of job {m.job[:64]!r}, this agent keeps job {limits.job!r}")
    if limits.ranks is not None and m.rank not in limits.ranks:
        raise Refused(f"a shard of rank {m.rank}, this agent keeps ranks "
                      f"{sorted(limits.ranks)[:8]}")
    if m.step < 0 or m.rank < 0 or m.world_size < 1 or m.rank >= m.world_size:
        raise Refused(f"a shard of rank {m.rank} of {m.world_size}, step {m.step}: not one")
    if limits.step is not None and m.step != limits.step:
        raise Refused(f"a shard of step {m.step}, asked for step {limits.step}")
    held = limits.held.get(m.rank)
    if held is not None and m.step <= held:
        raise Refused(f"a shard of step {m.step}, this agent holds step {held} of rank "
                      f"{m.rank} already")
    if limits.max_bytes and m.nbytes + limits.other_bytes > limits.max_bytes:
        raise Refused(f"a shard of {m.nbytes} bytes, over this agent's replica cap "
                      f"({limits.max_bytes} bytes, {limits.other_bytes} held for other "
                      "ranks)")
    if not m.files:
        raise Refused("a shard without files")
    return m


class Transcript:
    """The HMAC of everything after the handshake, kept by both ends."""

    def __init__(self, key: bytes, client_nonce: str, server_nonce: str) -> None:
        self._h = hmac.new(key, f"stream|{client_nonce}|{server_nonce}".encode(),
                           hashlib.sha256)

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


@dataclass
class Chunk:
    """Bytes of file ``name`` at ``offset``, to write (checked when the file ends)."""

    name: str
    offset: int
    data: bytes


class Receiver:
    """The holder's (or fetcher's) side of one shard's stream after its offer: feed it the
    bytes as they come; it says which to write where, checks each file's CRC when the file
    ends and the trailer HMAC at the end (Refused otherwise), and ``done`` once all of it
    checks (the caller then writes the marker, last)."""

    def __init__(self, marker: layout.Marker, transcript: Transcript) -> None:
        self.marker = marker
        self._files = sorted(marker.files.items())
        self._i = 0
        self._off = 0
        self._crc = 0
        self._t = transcript
        self._trailer = b""
        self.done = False

    def feed(self, data: bytes) -> list[Chunk]:
        if self.done:
            if data:
                raise Refused("bytes after the end of the shard")
            return []
        out: list[Chunk] = []
        view = memoryview(data)
        while view:
            if self._i < len(self._files):
                name, (size, crc) = self._files[self._i]
                n = min(len(view), size - self._off)
                part = view[:n]
                self._crc = zlib.crc32(part, self._crc)
                self._t.update(part)
                if n:
                    out.append(Chunk(name, self._off, bytes(part)))
                self._off += n
                view = view[n:]
                if self._off == size:
                    if self._crc != crc:
                        raise Refused(f"the peer's {name} differs from its marker's checksum")
                    self._i, self._off, self._crc = self._i + 1, 0, 0
                continue
            need = TRAILER - len(self._trailer)
            self._trailer += bytes(view[:need])
            view = view[need:]
            if len(self._trailer) == TRAILER:
                if not hmac.compare_digest(self._trailer, self._t.digest()):
                    raise Refused("the shard was altered on the way (its HMAC differs)")
                self.done = True
                if view:
                    raise Refused("bytes after the end of the shard")
        # a file of size 0 ends without bytes
        while self._i < len(self._files) and self._files[self._i][1][0] == 0:
            if self._files[self._i][1][1] != 0:
                raise Refused(f"the peer's {self._files[self._i][0]} differs from its "
                              "marker's checksum")
            self._i += 1
        return out

    def eof(self) -> None:
        """The stream ended: Refused unless the whole shard came."""
        if not self.done:
            raise Refused("the stream ended before the shard was complete (torn)")


def _nonce_ok(nonce: object) -> bool:
    return isinstance(nonce, str) and len(nonce) == 32 and \
        all(c in "0123456789abcdef" for c in nonce)


def _json_line(line: bytes, limit: int, what: str) -> dict[str, Any]:
    if len(line) > limit:
        raise Refused(f"{what} is too long")
    try:
        d = json.loads(line)
    except ValueError:
        raise Refused(f"{what} is not JSON") from None
    if not isinstance(d, dict):
        raise Refused(f"{what} is not an object")
    return d
