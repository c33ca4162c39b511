"""A ``torch.distributed.checkpoint`` storage writer and reader for one rank's snapshot.

:class:`SnapshotWriter` is DCP's :class:`FileSystemWriter` (standard layout: a ``.metadata``
and ``__0_0.distcp``) that, once DCP's ``finish`` has written the metadata, writes the
completion marker (layout.py) last. :class:`SnapshotReader` is DCP's
:class:`FileSystemReader` that refuses, before DCP reads a byte of it, a shard whose marker
is missing, foreign, torn, truncated, corrupt or of another shape (layout.verify): so plain
``dcp.load(state, storage_reader=SnapshotReader(...))`` never half-fills a state from a bad
shard. The shard is read once: each file is mapped (tmpfs pages, no copy), its checksum computed
over the mapping (layout.map_checked), and DCP reads those verified pages, not the file
through a second read. No flush to stable
storage: the shards live in memory (tmpfs); the durable copy is persist.py's.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import sys
import threading
import time
import warnings
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ftagent.checkpoint import layout


class SnapshotWriter(FileSystemWriter):
    """DCP's file system writer into ``path`` (a fresh temporary directory), with the
    completion marker for (``job``, ``rank``, ``world_size``, ``step``) written last."""

    def __init__(self, path: str | os.PathLike[str], *, job: str, rank: int, world_size: int,
                 step: int, fingerprint: Mapping[str, str]) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=False, overwrite=True)
        self.snapshot = (job, rank, world_size, step)
        self.state_fingerprint = dict(fingerprint)
        self.marker: layout.Marker | None = None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        job, rank, world_size, step = self.snapshot
        directory = os.fspath(self.path)
        self.marker = layout.Marker(job, rank, world_size, step, layout.files_of(directory),
                                    self.state_fingerprint, time.time())
        layout.write_marker(directory, self.marker)


class _HeldStream(io.RawIOBase):
    """A read-only, seekable stream over bytes already in memory (no copy of them)."""

    def __init__(self, data: mmap.mmap | bytes | memoryview) -> None:
        super().__init__()
        self._view = memoryview(data)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._view.release()
        super().close()

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view),
                                                                   self._pos + size)
        out = bytes(self._view[self._pos:end]) if end > self._pos else b""
        self._pos += len(out)
        return out


class _HeldFiles(FileSystem):
    """DCP's file system, reading only the files verified into memory (by name in the
    shard's directory); any other read is refused."""

    def __init__(self, held: dict[str, mmap.mmap | bytes]) -> None:
        self.held = held

    def release(self) -> None:
        """Unmap, in a thread of its own: tearing down a populated mapping takes about
        0.5 s a GiB, which the trainer need not wait for (munmap runs without the GIL). A
        mapping still viewed by a stream is left to the collector."""
        maps = [m for m in self.held.values() if isinstance(m, mmap.mmap)]
        self.held.clear()
        if maps:
            threading.Thread(target=_unmap, args=(maps,), name="ftagent-snapshot-unmap",
                             daemon=True).start()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str],
                      mode: str) -> Generator[io.IOBase, None, None]:
        name = Path(path).name
        if mode != "rb" or name not in self.held:
            raise layout.SnapshotRejected(f"{path}: not a verified file of the snapshot")
        stream = _HeldStream(self.held[name])
        try:
            yield cast(io.IOBase, stream)
        finally:
            stream.close()


def _unmap(maps: list[mmap.mmap]) -> None:
    for m in maps:
        with contextlib.suppress(BufferError):
            m.close()


class SnapshotReader(FileSystemReader):
    """DCP's file system reader of the shard in ``path``, verified first (its marker names
    ``job``, ``rank``, ``step``; sizes and checksums match; ``fingerprint``, the state to
    fill, fits): :class:`~ftagent.checkpoint.layout.SnapshotRejected` otherwise. With
    ``checksums`` (the default) the files are read once, checked on the way, and DCP
    loads from those bytes; without, the caller verified them and DCP reads the files."""

    def __init__(self, path: str | os.PathLike[str], *, job: str, rank: int, step: int,
                 fingerprint: Mapping[str, str] | None = None, checksums: bool = True) -> None:
        super().__init__(path)
        self.expect = (job, rank, step)
        self.state_fingerprint = fingerprint
        self.checksums = checksums  # False: the caller verified them just now
        self.marker: layout.Marker | None = None

    def check(self) -> layout.Marker:
        """Verify the shard (and, with ``checksums``, read it into memory on the way):
        its marker, else SnapshotRejected saying why. DCP's ``read_metadata`` calls it
        when the caller has not."""
        if self.marker is not None:
            return self.marker
        job, rank, step = self.expect
        directory = os.fspath(self.path)
        # marker, identity, files present with their sizes, shape: before any byte is read
        marker = layout.verify(directory, job=job, rank=rank, step=step,
                               state_fingerprint=self.state_fingerprint, checksums=False)
        if self.checksums:  # then each file once, its checksum on the way
            self.fs = _HeldFiles({name: layout.map_checked(os.path.join(directory, name),
                                                            size, crc)
                                  for name, (size, crc) in marker.files.items()})
        self.marker = marker
        return marker

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.check()
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            if isinstance(self.fs, _HeldFiles) and self._read_in_place(plan, planner,
                                                                        self.fs.held):
                done: Future[None] = Future()
                done.set_result(None)
                return done
            return super().read_data(plan, planner)
        finally:  # the verified bytes are no longer needed: the state holds them now
            if isinstance(self.fs, _HeldFiles):
                self.fs.release()

    def _read_in_place(self, plan: LoadPlan, planner: LoadPlanner,
                       held: dict[str, mmap.mmap | bytes]) -> bool:
        """DCP's read, one copy: each tensor copied into the state straight from the
        verified mapping. DCP's own read (``torch.load`` of each tensor's record into a
        new tensor, then a copy into the state) allocates, faults in and copies every byte
        once more. A record's place in the mapping comes from ``torch.load`` onto the
        ``meta`` device (the pickle only: its storage's ``_checkpoint_offset``); anything
        this path does not know (a transform, a record without that offset, a big-endian
        host) returns False before any byte is copied, and DCP's read does it all."""
        if sys.byteorder != "little":
            return False
        items = []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            data = held.get(Path(info.relative_path).name)
            if data is None or info.transform_descriptors:
                return False
            items.append((req, info, data))
        located: list[tuple[Any, Any, mmap.mmap | bytes, torch.Tensor | None, int]] = []
        for req, info, data in items:  # where each tensor lies, before any byte is copied
            if req.type == LoadItemType.BYTE_IO:
                located.append((req, info, data, None, 0))
                continue
            record = _HeldStream(memoryview(data)[info.offset:info.offset + info.length])
            try:
                meta = torch.load(cast(IO[bytes], record), map_location="meta",
                                  weights_only=True)
            finally:
                record.close()
            if not isinstance(meta, torch.Tensor):
                return False
            offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
            if not isinstance(offset, int) or offset < 0 or \
                    offset + meta.untyped_storage().nbytes() > info.length:
                return False
            located.append((req, info, data, meta, info.offset + offset))
        for req, info, data, meta, start in located:
            if meta is None:
                planner.load_bytes(req, io.BytesIO(bytes(memoryview(data)[
                    info.offset:info.offset + info.length])))
                continue
            target = planner.resolve_tensor(req).detach()
            tensor = _view_of(data, start, meta)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            if target.size() != tensor.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes "
                                     f"{target.size()} vs {tensor.size()}")
            target.copy_(tensor)
            del tensor  # the mapping's view: the mapping is closed after the read
            planner.commit_tensor(req, target)
        return True


def _view_of(data: mmap.mmap | bytes, start: int, meta: torch.Tensor) -> torch.Tensor:
    """The tensor ``meta`` describes (dtype, shape, strides, storage offset) over the
    ``meta``'s storage's bytes at ``start`` of ``data``: no copy (read-only: only read)."""
    nbytes = meta.untyped_storage().nbytes()
    if nbytes == 0:
        return torch.empty(meta.size(), dtype=meta.dtype)
    with warnings.catch_warnings():  # the mapping is read-only; the view is only read
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=start)
    return torch.empty(0, dtype=meta.dtype).set_(raw.untyped_storage(), meta.storage_offset(),
                                                 meta.size(), meta.stride())
