"""Where snapshots lie and what makes one usable: paths, the completion marker, checks.

One rank's snapshot of one step is a directory in standard DCP layout (``.metadata`` and
``__0_0.distcp``, written by :class:`~ftagent.checkpoint.storage.SnapshotWriter`), plus
``ftagent-snapshot.json``, the per-rank completion marker, written last::

    <root>/<job>/rank-<R>/step-<N>/            complete (renamed into place last)
    <root>/<job>/rank-<R>/.step-<N>.<pid>.tmp/  being written (never read)

The marker says which job, rank, world size and step the shard is, each file's size and
CRC-32, and the state's fingerprint (every leaf's key, dtype and shape). A shard is usable
only when its directory has the final name, its marker parses (bounded), names this job,
rank and step, every file has the size and checksum the marker says, and the fingerprint
covers the state it is loaded into: a torn, truncated, foreign or stale (the model's shape
changed) shard is refused with a one-line reason, never half-loaded.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ftagent.checkpoint.crc import crc32

MARKER = "ftagent-snapshot.json"
FROM_PEER = "from-peer"  # a note in a shard fetched from a peer's replica (replica.py)
# the agent's note, in a rank's directory, of why it fetched no replica before this
# trainer started (replica_agent.py): checkpoint.load says it when it passes the peer rung
PEER_MISSED = "peer-missed"
MAX_NOTE = 300  # bytes of that note read back
FORMAT = 1
MAX_MARKER_BYTES = 1 << 20  # a marker past it is not ours
MAX_FILES = 4096  # files one shard may have
_STEP_DIR = re.compile(r"step-(\d{1,18})")


class SnapshotRejected(Exception):
    """A snapshot that must not be loaded; ``str()`` says why in one line."""


def rank_dir(root: str, job: str, rank: int) -> str:
    return os.path.join(root, job, f"rank-{rank}")


def step_dir(root: str, job: str, rank: int, step: int) -> str:
    return os.path.join(rank_dir(root, job, rank), f"step-{step}")


def temp_dir(root: str, job: str, rank: int, step: int) -> str:
    return os.path.join(rank_dir(root, job, rank), f".step-{step}.{os.getpid()}.tmp")


def steps_in(directory: str) -> list[int]:
    """The steps of the final-named shard directories under ``directory`` (oldest first);
    whether each is complete is :func:`verify`'s question, not this listing's."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.fullmatch(n)))


def crc_of(path: str) -> int:
    """The CRC-32 of the file at ``path``, over its mapping (no copy), on every core
    (crc.py): zlib's value."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ) as m:
            return crc32(m)


def map_checked(path: str, size: int, crc: int) -> mmap.mmap | bytes:
    """The file at ``path`` mapped read-only (tmpfs pages: no copy, no allocation), its
    CRC-32 computed over the mapping: the mapping when it is exactly ``size`` bytes and its
    checksum is ``crc``, else SnapshotRejected. The load's one pass: DCP then reads these
    verified pages (storage.SnapshotReader), not the file through a second read. Shards are
    never rewritten in place (written under a temporary name, then renamed), so the mapping
    stays what was verified; an unlinked file's pages live until it is closed."""
    try:
        with open(path, "rb") as f:
            have = os.fstat(f.fileno()).st_size
            if have != size:
                raise SnapshotRejected(f"{os.path.dirname(path)} is truncated: "
                                       f"{os.path.basename(path)} has {have} bytes, "
                                       f"its marker says {size}")
            # the page tables filled in one call, not one fault per page
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            m: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, flags=flags,
                                             prot=mmap.PROT_READ) if size else b""
    except OSError as e:
        raise SnapshotRejected(f"{path}: {e.strerror}") from None
    c = crc32(m)  # on every core (crc.py)
    if c != crc:
        if isinstance(m, mmap.mmap):
            m.close()
        raise SnapshotRejected(f"{os.path.dirname(path)} is corrupt: "
                               f"{os.path.basename(path)}'s checksum differs")
    return m


def files_of(directory: str) -> dict[str, list[int]]:
    """name -> [size, crc32] of every plain file in ``directory`` but the marker."""
    out: dict[str, list[int]] = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name != MARKER and os.path.isfile(path):
            out[name] = [os.path.getsize(path), crc_of(path)]
    return out


def fingerprint(state: Any, prefix: str = "") -> dict[str, str]:
    """Every leaf of a (nested) state dict: dotted key -> ``tensor:<dtype>:<shape>`` for a
    tensor, ``obj:<type>`` for anything else. Two states load into each other only when
    the target's leaves are the snapshot's."""
    out: dict[str, str] = {}
    if isinstance(state, Mapping):
        for k, v in state.items():
            out.update(fingerprint(v, f"{prefix}{k}."))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(fingerprint(v, f"{prefix}{i}."))
    else:
        shape = getattr(state, "shape", None)
        dtype = getattr(state, "dtype", None)
        key = prefix[:-1]
        if shape is not None and dtype is not None and hasattr(state, "untyped_storage"):
            out[key] = f"tensor:{str(dtype).removeprefix('torch.')}:{list(shape)}"
        else:
            out[key] = f"obj:{type(state).__name__}"
    return out


@dataclass(frozen=True)
class Marker:
    """A parsed completion marker."""

    job: str
    rank: int
    world_size: int
    step: int
    files: dict[str, list[int]]
    fingerprint: dict[str, str]
    saved_at: float

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "job": self.job, "rank": self.rank,
                           "world_size": self.world_size, "step": self.step,
                           "files": self.files, "fingerprint": self.fingerprint,
                           "saved_at": self.saved_at}, sort_keys=True)


def write_marker(directory: str, marker: Marker) -> None:
    """The marker, atomically (temporary file, rename): the last file of a shard."""
    tmp = os.path.join(directory, f".{MARKER}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(marker.to_json())
    os.replace(tmp, os.path.join(directory, MARKER))


def read_marker(directory: str) -> Marker:
    """The marker of the shard in ``directory``; SnapshotRejected when it is missing or not
    one (size-bounded, every field type-checked)."""
    path = os.path.join(directory, MARKER)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MARKER_BYTES + 1)
    except OSError as e:
        raise SnapshotRejected(f"no completion marker in {directory} "
                               f"(not finished: {e.strerror})") from None
    return parse_marker(raw, directory)


def parse_marker(raw: bytes, where: str) -> Marker:
    """A marker from its bytes (a file's, or a peer's: replica_protocol.py); bounded and
    every field type-checked, else SnapshotRejected naming ``where``."""
    directory = where
    if len(raw) > MAX_MARKER_BYTES:
        raise SnapshotRejected(f"completion marker in {directory} is too large")
    try:
        d = json.loads(raw)
        files = d["files"]
        fp = d["fingerprint"]
        ok = (d.get("format") == FORMAT and isinstance(d["job"], str)
              and all(isinstance(d[k], int) and not isinstance(d[k], bool)
                      for k in ("rank", "world_size", "step"))
              and isinstance(d["saved_at"], (int, float))
              and isinstance(files, dict) and len(files) <= MAX_FILES
              and all(isinstance(k, str) and "/" not in k and isinstance(v, list) and len(v) == 2
                      and all(isinstance(x, int) and x >= 0 for x in v)
                      for k, v in files.items())
              and isinstance(fp, dict)
              and all(isinstance(k, str) and isinstance(v, str) for k, v in fp.items()))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise SnapshotRejected(f"completion marker in {directory} is not one ftagent wrote")
    return Marker(d["job"], d["rank"], d["world_size"], d["step"], files, fp,
                  float(d["saved_at"]))


def verify(directory: str, *, job: str, rank: int, step: int,
           state_fingerprint: Mapping[str, str] | None = None,
           checksums: bool = True) -> Marker:
    """The shard in ``directory`` is complete and is (job, rank, step)'s, and the state it
    would fill has its leaves: its marker, else SnapshotRejected saying why."""
    m = read_marker(directory)
    if (m.job, m.rank, m.step) != (job, rank, step):
        raise SnapshotRejected(f"{directory} is a foreign snapshot (job {m.job!r} rank "
                               f"{m.rank} step {m.step}, wanted {job!r} rank {rank} step {step})")
    try:
        present = set(os.listdir(directory)) - {MARKER}
    except OSError as e:
        raise SnapshotRejected(f"{directory}: {e.strerror}") from None
    if set(m.files) - present:
        raise SnapshotRejected(f"{directory} is torn: missing {sorted(set(m.files) - present)[:3]}")
    for name, (size, crc) in m.files.items():
        path = os.path.join(directory, name)
        have = os.path.getsize(path)
        if have != size:
            raise SnapshotRejected(f"{directory} is truncated: {name} has {have} bytes, "
                                   f"its marker says {size}")
        if checksums and crc_of(path) != crc:
            raise SnapshotRejected(f"{directory} is corrupt: {name}'s checksum differs")
    if state_fingerprint is not None:
        differ = [k for k, v in state_fingerprint.items() if m.fingerprint.get(k) != v]
        if differ:
            k = differ[0]
            raise SnapshotRejected(
                f"{directory} does not fit the state (the model changed?): {k} is "
                f"{m.fingerprint.get(k, 'absent')} there, {state_fingerprint[k]} here"
                + (f" (+{len(differ) - 1} more)" if len(differ) > 1 else ""))
    return m


def complete_steps(root: str, job: str, rank: int) -> list[int]:
    """Steps of this rank's shards whose marker is there and names them (cheap: no
    checksums; the load verifies those), oldest first."""
    out = []
    d = rank_dir(root, job, rank)
    for step in steps_in(d):
        try:
            m = read_marker(os.path.join(d, f"step-{step}"))
        except SnapshotRejected:
            continue
        if (m.job, m.rank, m.step) == (job, rank, step):
            out.append(step)
    return out


def newest_common(held: Iterable[Iterable[int]]) -> int | None:
    """The newest step every rank holds (None: none)."""
    sets = [set(h) for h in held]
    if not sets:
        return None
    common = set.intersection(*sets)
    return max(common) if common else None


def note_peer_missed(root: str, job: str, rank: int, why: str) -> None:
    """Say (for this rank's next ``load``) why no replica was fetched; "" clears it."""
    path = os.path.join(rank_dir(root, job, rank), PEER_MISSED)
    try:
        if not why:
            if os.path.exists(path):
                os.unlink(path)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(why[:MAX_NOTE])
    except OSError:
        pass  # a note: never a reason to fail


def peer_missed(root: str, job: str, rank: int) -> str:
    """The agent's note of why it fetched no replica ("" : none), bounded, one line."""
    try:
        with open(os.path.join(rank_dir(root, job, rank), PEER_MISSED), "rb") as f:
            raw = f.read(MAX_NOTE)
    except OSError:
        return ""
    return " ".join(raw.decode(errors="replace").split())
