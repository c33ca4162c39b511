"""A ``torch.distributed.checkpoint`` storage writer and reader for one rank's snapshot.

:class:`SnapshotWriter` is DCP's :class:`FileSystemWriter` (standard layout: a ``.metadata``
and ``__0_0.distcp``) that, once DCP's ``finish`` has written the metadata, writes the
completion marker (layout.py) last. :class:`SnapshotReader` is DCP's
:class:`FileSystemReader` that refuses, before DCP reads a byte of it, a shard whose marker
is missing, foreign, torn, truncated, corrupt or of another shape (layout.verify): so plain
``dcp.load(state, storage_reader=SnapshotReader(...))`` never half-fills a state from a bad
shard. No flush to stable storage: the shards live in memory (tmpfs); the durable copy is
persist.py's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

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


class SnapshotReader(FileSystemReader):
    """DCP's file system reader of the shard in ``path``, verified first (its marker names
    ``job``, ``rank``, ``step``; sizes and checksums match; ``fingerprint``, the state to
    fill, fits): :class:`~ftagent.checkpoint.layout.SnapshotRejected` otherwise."""

    def __init__(self, path: str | os.PathLike[str], *, job: str, rank: int, step: int,
                 fingerprint: Mapping[str, str] | None = None, checksums: bool = True) -> None:
        super().__init__(path)
        self.expect = (job, rank, step)
        self.state_fingerprint = fingerprint
        self.checksums = checksums  # False: the caller verified them just now
        self.marker: layout.Marker | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        job, rank, step = self.expect
        self.marker = layout.verify(os.fspath(self.path), job=job, rank=rank, step=step,
                                    state_fingerprint=self.state_fingerprint,
                                    checksums=self.checksums)
        return super().read_metadata(*args, **kwargs)
