"""The durable copy: a complete in-memory shard written to the job's checkpoint directory.

Layout (each rank directory is a standard DCP checkpoint: ``.metadata`` + ``__0_0.distcp``,
loadable by plain ``torch.distributed.checkpoint.load(state, checkpoint_id=...)``)::

    <durable>/step-<N>/rank-<R>/ftagent-snapshot.json   marker, written last
    <durable>/step-<N>/.rank-<R>.<pid>.tmp/             being written (never read)

Files are copied and flushed to stable storage (fsync), the marker last, then the rank
directory is renamed into place and its parent flushed. Retention keeps each rank's newest
``keep`` complete steps and only ever removes steps older than those: the last persisted
checkpoint is never lost to a newer one that did not complete. Used by the trainer's
background writer (every N-th snapshot) and by the agent's last words (lastwords.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil

from ftagent.checkpoint import layout


def rank_dir(durable: str, step: int, rank: int) -> str:
    return os.path.join(durable, f"step-{step}", f"rank-{rank}")


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _copy_synced(src: str, dst: str) -> None:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, 1 << 22)
        fo.flush()
        os.fsync(fo.fileno())


def persist(src: str, durable: str, *, rank: int, step: int, keep: int = 2) -> str:
    """Copy the complete shard in ``src`` (a snapshot directory; its marker is checked, not
    its checksums: the writer just computed them) to the durable directory; its path.
    OSError when the copy fails (the last persisted step stays as it was)."""
    marker = layout.read_marker(src)
    parent = os.path.join(durable, f"step-{step}")
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".rank-{rank}.{os.getpid()}.tmp")
    final = rank_dir(durable, step, rank)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for name in marker.files:
            _copy_synced(os.path.join(src, name), os.path.join(tmp, name))
        _copy_synced(os.path.join(src, layout.MARKER), os.path.join(tmp, layout.MARKER))
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(parent)
    retain(durable, marker.job, rank, keep)
    return final


def complete_steps(durable: str, job: str, rank: int) -> list[int]:
    """Persisted steps whose shard of ``rank`` is complete (marker there and naming it),
    oldest first."""
    out = []
    for step in layout.steps_in(durable):
        try:
            m = layout.read_marker(rank_dir(durable, step, rank))
        except layout.SnapshotRejected:
            continue
        if (m.job, m.rank, m.step) == (job, rank, step):
            out.append(step)
    return out


def retain(durable: str, job: str, rank: int, keep: int) -> None:
    """This rank's shards of steps older than its newest ``keep`` complete ones are
    removed (a step directory goes once no rank's shard is left in it)."""
    done = complete_steps(durable, job, rank)
    if len(done) <= keep:
        return
    oldest_kept = done[-keep]
    for step in layout.steps_in(durable):
        if step >= oldest_kept:
            continue
        shutil.rmtree(rank_dir(durable, step, rank), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(durable, f"step-{step}"))
