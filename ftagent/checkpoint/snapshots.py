"""The trainer's side of in-memory snapshots: stage, write in the background, find, load.

:class:`Snapshotter` is what ``ftagent.checkpoint.save``/``load`` call. ``save`` copies the
state into host buffers it keeps (the only part the training step waits for), and hands
the copy to one background thread, which writes it with DCP into this rank's directory
under the memory-backed snapshot root (storage.py: marker last, then renamed into place),
drops old shards by the retention rule and the memory cap, and tells
the agent which steps it holds (SDK ``snapshots``); the agent persists them to the durable
directory (persister.py). The root outlives the trainer (tmpfs the agent or the pod owns),
so a restarted trainer finds them.

``load`` walks the ladder: the step the arbiter named (``FTAGENT_RESUME_STEP``: the newest
step every rank of the job holds) or, without one, the newest step every rank agrees it
holds (a collective when torch.distributed is initialized, else the ranks' directories
visible here); verified before DCP reads it (read once into memory, its checksums computed
on the way, and DCP loads those verified bytes: storage.SnapshotReader); when torch.distributed is
initialized every rank must have loaded it, else every rank falls to the durable copy
(the disk rung), else to nothing. Each fall is logged with its reason. The peer rung: a
shard the agent fetched from its replica holder before the trainer started (replica.py)
lies where the memory rung looks, noted ``from-peer``; ``load`` reports its source
``peer``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import ctypes
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ftagent import sdk
from ftagent.checkpoint import layout, persist
from ftagent.checkpoint.crc import cpus as crc_cpus
from ftagent.checkpoint.settings import Settings, interval_due
from ftagent.checkpoint.storage import SnapshotReader, SnapshotWriter

log = logging.getLogger("ftagent.checkpoint")
# each rank's shard is its own DCP checkpoint, saved and loaded without a process group on
# purpose (no collective in the background thread): DCP's warning about it is noise
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

MAX_HELD_REPORTED = 8  # steps told to the agent (the newest)
__all__ = ["Settings", "Snapshotter", "Stats", "interval_due", "stage"]


@dataclass
class Stats:
    """What the trainer's snapshots cost, for the agent's metrics and the bench."""

    saves: int = 0
    skipped: int = 0  # the previous one was still being written
    last_blocking_seconds: float = 0.0
    last_write_seconds: float = 0.0
    last_bytes: int = 0
    newest_step: int | None = None
    said: set[str] = field(default_factory=set)  # "says so once" keys


BULK_MIN = 1 << 20  # bytes: a host tensor this large is copied by copy_bulk
_SEGMENT = 8 << 20  # bytes of one memmove of copy_bulk
COPY_THREADS = 8  # threads of copy_bulk at most


def stage(state: Any, into: Any = None,
          bulk: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """A copy of ``state`` in host memory, reusing ``into``'s tensors where the shapes and
    dtypes match (no allocation, no page faults after the first save). A device tensor
    goes into pinned host memory, copied asynchronously (``synchronize`` waits for all).
    Non-tensors are deep-copied. With ``bulk``, a large dense host tensor that reuses its
    buffer is not copied here: (destination, source) is appended for :func:`copy_bulk`,
    which copies them all on every core (the list holds both: alive until then)."""
    if isinstance(state, torch.Tensor):
        t = state.detach()
        if isinstance(into, torch.Tensor) and into.shape == t.shape and \
                into.dtype == t.dtype and into.device.type == "cpu":
            if bulk is not None and _plain_host(t) and _plain_host(into) and \
                    t.nbytes >= BULK_MIN:
                bulk.append((into, t))
                return into
            into.copy_(t, non_blocking=t.device.type != "cpu")
            return into
        if t.device.type == "cpu":
            return t.to("cpu", copy=True)
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        return buf
    if isinstance(state, Mapping):
        old = into if isinstance(into, Mapping) else {}
        return {k: stage(v, old.get(k), bulk) for k, v in state.items()}
    if isinstance(state, list):
        old_l = into if isinstance(into, list) and len(into) == len(state) else [None] * len(state)
        return [stage(v, o, bulk) for v, o in zip(state, old_l, strict=True)]
    return copy.deepcopy(state)


def _plain_host(t: torch.Tensor) -> bool:
    """A dense, contiguous host tensor whose bytes are its values (no lazy conjugate or
    negation, not quantized): a plain byte copy copies it."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
            and not t.is_quantized and not t.is_conj() and not t.is_neg())


def copy_bulk(bulk: list[tuple[torch.Tensor, torch.Tensor]],
              pool: concurrent.futures.ThreadPoolExecutor | None) -> None:
    """Every (destination, source) of ``stage``'s ``bulk`` (dense host tensors of the same
    size), in segments of 8 MiB spread over ``pool``'s threads: ``ctypes.memmove`` (libc's
    memmove, which streams large copies past the cache) runs without the GIL, so the
    segments copy in parallel at memory speed. ``bulk`` holds both tensors of each pair:
    their memory lives until this returns."""
    segments = []
    for dst, src in bulk:
        n = src.nbytes
        if dst.nbytes != n:  # stage pairs only equal shapes and dtypes
            raise ValueError("copy_bulk: tensors of different sizes")
        d, s = dst.data_ptr(), src.data_ptr()
        segments += [(d + o, s + o, min(_SEGMENT, n - o)) for o in range(0, n, _SEGMENT)]
    if pool is None or len(segments) < 2:
        for seg in segments:
            ctypes.memmove(*seg)
        return
    list(pool.map(lambda seg: ctypes.memmove(*seg), segments))


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (a collective: each rank calls it at the same point)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class Snapshotter:
    """One rank's snapshots (see the module's docstring)."""

    def __init__(self, settings: Settings, *,
                 report_held: Callable[[list[int]], None] | None = None,
                 report_resumed: Callable[[int, str], None] | None = None) -> None:
        self.s = settings
        self.stats = Stats()
        self._staged: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "ftagent-snapshot")
        self._copy_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: concurrent.futures.Future[None] | None = None
        self._lock = threading.Lock()
        self._report_held = report_held or (
            lambda steps: sdk.snapshots(steps, sum(self._bytes_of(s) for s in steps)))
        self._report_resumed = report_resumed or (lambda step, src: sdk.resumed(step, src))
        self.last_load: tuple[int | None, str, list[str]] = (None, "", [])
        # the blocking budget's inputs: the last call (step, time), the step time seen,
        # the step of the last snapshot
        self._seen: tuple[int, float] | None = None
        self._step_seconds: float | None = None
        self._last_step = -(1 << 62)

    # ------------------------------------------------------------------ save

    @property
    def my_dir(self) -> str:
        return layout.rank_dir(self.s.root, self.s.job, self.s.rank)

    def save(self, step: int, state: Mapping[str, Any]) -> bool:
        """Stage ``state`` as step ``step`` and return; the write goes on in the background.
        False (and nothing staged) when the previous snapshot is still being written, or,
        with a blocking budget (``FTAGENT_SNAPSHOT_BUDGET``), when this step is not due."""
        if step < 0:
            raise ValueError(f"ftagent.checkpoint.save: step must be >= 0, not {step}")
        t0 = time.perf_counter()
        if self.s.budget > 0:
            seen, self._seen = self._seen, (step, t0)
            if seen is not None and step > seen[0]:  # the step time, as the calls show it
                dt = (t0 - seen[1]) / (step - seen[0])
                self._step_seconds = dt if self._step_seconds is None \
                    else 0.8 * self._step_seconds + 0.2 * dt
            if not interval_due(step - self._last_step, self._step_seconds,
                                self.stats.last_blocking_seconds, self.s.budget):
                return False
        with self._lock:
            if self._inflight is not None and not self._inflight.done():
                self.stats.skipped += 1
                self._say_once("busy", f"snapshot of step {step} skipped: the previous one is "
                               "still being written (snapshot less often)")
                return False
            bulk: list[tuple[torch.Tensor, torch.Tensor]] = []
            self._staged = stage(state, self._staged, bulk)
            copy_bulk(bulk, self._copiers())
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # the device-to-host copies are done
            # the rest (the state's fingerprint, DCP, checksums) in the background: the
            # staged copy is not touched again before this write is done
            self._inflight = self._pool.submit(self._write, step, self._staged)
        self.stats.saves += 1
        self.stats.last_blocking_seconds = time.perf_counter() - t0
        self._last_step = step
        # the blocking part, as ftagent_phase_duration_seconds{phase="snapshot"}
        sdk.phase_time("snapshot", self.stats.last_blocking_seconds)
        return True

    def _copiers(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """The threads of the staging copy (one per CPU this process may use, at most
        COPY_THREADS: a few saturate the memory bus; None: one)."""
        if self._copy_pool is None:
            n = min(crc_cpus(), COPY_THREADS)
            if n < 2:
                return None
            self._copy_pool = concurrent.futures.ThreadPoolExecutor(n, "ftagent-snapshot-copy")
        return self._copy_pool

    def wait(self, timeout: float | None = None) -> bool:
        """Until the snapshot being written is complete (True) or ``timeout`` passes."""
        f = self._inflight
        if f is None:
            return True
        try:
            f.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - logged by _write
            return True
        return True

    def _write(self, step: int, staged: Any) -> None:
        t0 = time.perf_counter()
        fp = layout.fingerprint(staged)
        tmp = layout.temp_dir(self.s.root, self.s.job, self.s.rank, step)
        final = layout.step_dir(self.s.root, self.s.job, self.s.rank, step)
        try:
            os.makedirs(self.my_dir, exist_ok=True)
            self._clear_temps()
            writer = SnapshotWriter(tmp, job=self.s.job, rank=self.s.rank,
                                    world_size=self.s.world_size, step=step, fingerprint=fp)
            dcp.save(staged, storage_writer=writer, no_dist=True)
            nbytes = writer.marker.nbytes if writer.marker is not None else 0
            if not self._room_for(nbytes, step):
                shutil.rmtree(tmp, ignore_errors=True)
                return
            if os.path.isdir(final):  # a step of an abandoned timeline: this one replaces it
                shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - never stops training
            shutil.rmtree(tmp, ignore_errors=True)
            self._say_once(f"write:{type(e).__name__}",
                           f"snapshot of step {step} not written: {type(e).__name__}: {e}")
            return
        self.stats.last_write_seconds = time.perf_counter() - t0
        self.stats.last_bytes, self.stats.newest_step = nbytes, step
        self._retain()
        self.report_held()  # the agent persists from here (checkpoint/persister.py)

    def _clear_temps(self) -> None:
        """Shards a dead writer left half-written (never read; their space is freed)."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.my_dir):
                if name.startswith(".step-") and name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(self.my_dir, name), ignore_errors=True)

    def _room_for(self, nbytes: int, step: int) -> bool:
        """Under the memory cap: old shards go first (fewer kept, said once); a shard
        larger than the cap alone is not kept at all (said once)."""
        cap = self.s.max_bytes
        if cap <= 0:
            return True
        if nbytes > cap:
            self._say_once("cap-one", f"snapshot of step {step} ({nbytes} bytes) is larger "
                           f"than the snapshot memory cap ({cap} bytes): not kept")
            return False
        held = [(s, self._bytes_of(s)) for s in layout.steps_in(self.my_dir)]
        total = sum(b for _, b in held) + nbytes
        dropped = 0
        while held and total > cap:
            s, b = held.pop(0)
            shutil.rmtree(layout.step_dir(self.s.root, self.s.job, self.s.rank, s),
                          ignore_errors=True)
            total -= b
            dropped += 1
        if dropped:
            self._say_once("cap", f"snapshot memory cap ({cap} bytes) reached: keeping "
                           f"{len(held) + 1} snapshot(s) instead of {self.s.keep}")
        return True

    def _bytes_of(self, step: int) -> int:
        try:
            return layout.read_marker(layout.step_dir(
                self.s.root, self.s.job, self.s.rank, step)).nbytes
        except layout.SnapshotRejected:
            return 0

    def _retain(self) -> None:
        steps = layout.steps_in(self.my_dir)
        for s in steps[:-self.s.keep]:
            shutil.rmtree(layout.step_dir(self.s.root, self.s.job, self.s.rank, s),
                          ignore_errors=True)

    def held(self) -> list[int]:
        return layout.complete_steps(self.s.root, self.s.job, self.s.rank)

    def report_held(self) -> None:
        with contextlib.suppress(Exception):
            self._report_held(self.held()[-MAX_HELD_REPORTED:])

    def _say_once(self, key: str, message: str) -> None:
        if key not in self.stats.said:
            self.stats.said.add(key)
            print(f"ftagent.checkpoint: {message}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ load

    def load(self, state: MutableMapping[str, Any]) -> int | None:
        """Fill ``state`` in place from the newest complete snapshot: memory (or a peer's
        replica fetched into it), then the durable copy; its step, or None. Call on every
        rank."""
        fp = layout.fingerprint(state)
        why: list[str] = []
        step, source = self._from_memory(state, fp, why), "memory"
        if step is not None and os.path.exists(os.path.join(
                layout.step_dir(self.s.root, self.s.job, self.s.rank, step), layout.FROM_PEER)):
            source = "peer"  # fetched from a replica holder before the trainer started
        if step is None:
            missed = layout.peer_missed(self.s.root, self.s.job, self.s.rank) \
                if self.s.root else ""
            if missed:  # said once: the next start's reason is the agent's next note
                layout.note_peer_missed(self.s.root, self.s.job, self.s.rank, "")
            why.append(f"peer: {missed}" if missed else "peer: no replica fetched for this rank")
            step, source = self._from_disk(state, fp, why), "disk"
        self.last_load = (step, source if step is not None else "", why)
        if step is None:
            print(f"ftagent.checkpoint: nothing to resume from ({'; '.join(why)})",
                  file=sys.stderr, flush=True)
            return None
        print(f"ftagent.checkpoint: resumed after step {step} from {source}"
              + (f" ({'; '.join(why)})" if why else ""), file=sys.stderr, flush=True)
        self._drop_after(step)  # shards after it belong to an abandoned timeline
        with contextlib.suppress(Exception):
            self._report_resumed(step, source)
        self.report_held()
        return step

    def _memory_step(self, why: list[str]) -> int | None:
        """The step to load from memory: the arbiter's, else the newest every rank holds."""
        mine = self.held() if self.s.root else []
        if _dist_on():  # one gather, whatever each rank was told: the same collectives
            said = _gather((self.s.resume_step, mine))  # on every rank, in the same order
            named = {r for r, _ in said}
            if len(named) == 1 and None not in named:
                return self.s.resume_step
            if named != {None}:  # e.g. a replaced pod's rank, told nothing
                why.append("memory: the ranks were not all told the same resume step; "
                           "taking the newest step every rank holds")
            step = layout.newest_common(held for _, held in said)
        elif self.s.resume_step is not None:
            return self.s.resume_step
        else:
            visible = [layout.complete_steps(self.s.root, self.s.job, r)
                       for r in range(self.s.world_size)] if self.s.root else [[]]
            step = layout.newest_common(visible)
        if step is None:
            why.append("memory: no step whose shards every rank holds"
                       if mine else "memory: no snapshot held")
        return step

    def _from_memory(self, state: MutableMapping[str, Any], fp: dict[str, str],
                     why: list[str]) -> int | None:
        step = self._memory_step(why)
        ok = False
        if step is not None:
            d = layout.step_dir(self.s.root, self.s.job, self.s.rank, step)
            ok = self._try_load(state, d, step, fp, why, "memory")
        if _dist_on():
            everyone = _gather(ok)
            if ok and not all(everyone):
                why.append(f"memory: step {step} not loadable on every rank "
                           f"(ranks {[r for r, o in enumerate(everyone) if not o]})")
                ok = False
        return step if ok else None

    def _try_load(self, state: MutableMapping[str, Any], directory: str, step: int,
                  fp: dict[str, str], why: list[str], rung: str) -> bool:
        reader = SnapshotReader(directory, job=self.s.job, rank=self.s.rank, step=step,
                                fingerprint=fp)
        try:  # refused here with its reason (DCP would wrap it in its own exception);
            reader.check()  # the shard read once, checked on the way; DCP loads those bytes
        except layout.SnapshotRejected as e:
            why.append(f"{rung}: step {step} refused: {e}")
            return False
        try:
            dcp.load(state, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's: the next rung
            why.append(f"{rung}: step {step} failed to load: {type(e).__name__}: "
                       f"{str(e)[:200]}")
            return False
        return True

    def _from_disk(self, state: MutableMapping[str, Any], fp: dict[str, str],
                   why: list[str]) -> int | None:
        if not self.s.durable:
            why.append("disk: no durable checkpoint directory (FTAGENT_CHECKPOINT_DIR)")
            mine: list[int] = []
        else:
            mine = persist.complete_steps(self.s.durable, self.s.job, self.s.rank)
        step = layout.newest_common(_gather(mine)) if _dist_on() else (mine[-1] if mine else None)
        ok = False
        if step is not None:
            ok = self._try_load(state, persist.rank_dir(self.s.durable, step, self.s.rank),
                                step, fp, why, "disk")
        elif self.s.durable:
            why.append("disk: no persisted step every rank holds")
        if _dist_on():
            ok = all(_gather(ok))
        return step if ok else None

    def _drop_after(self, step: int) -> None:
        for s in layout.steps_in(self.my_dir):
            if s > step:
                shutil.rmtree(layout.step_dir(self.s.root, self.s.job, self.s.rank, s),
                              ignore_errors=True)

    def close(self, timeout: float = 30.0) -> None:
        self.wait(timeout)
        self._pool.shutdown(wait=False)
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=False)
