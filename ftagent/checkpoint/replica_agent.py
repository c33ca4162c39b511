"""The agent's side of the peer replica: push each newer shard in the background, fetch
a replaced pod's before its trainer starts, start the pod's holder (``--replica-listen``,
``--replica-peer``, ``--replica-bandwidth``). The bytes and their checks: replica.py and
replica_protocol.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ftagent.checkpoint import layout
from ftagent.checkpoint import replica_protocol as rp
from ftagent.checkpoint.replica import Holder, fetch, push
from ftagent.model import SnapshotsHeld

log = logging.getLogger("ftagent.checkpoint.replica")


class BackgroundReplica:
    """An observer of the worker's observations (``SnapshotsHeld``): each newer complete
    shard the trainer reports is pushed to the holder at ``peer()`` in a thread of the
    agent, one push at a time (a shard reported meanwhile waits for the next report), at
    most ``rate`` bytes a second, each read and write bounded by IO_TIMEOUT: a stalled or
    refusing holder costs this thread a deadline and a log line, never the trainer."""

    def __init__(self, root: str, job: str, rank: Callable[[], int], key: bytes,
                 peer: Callable[[], tuple[str, int] | None], *, rate: int = 0) -> None:
        self.root, self.job, self.rank, self.key, self.peer = root, job, rank, key, peer
        self.rate = rate
        self._thread: threading.Thread | None = None
        self.pushed: list[tuple[int, float]] = []  # (step, seconds) of each copy
        self.failed: list[str] = []  # why, newest last (bounded)
        self.lag_steps = 0  # newest reported minus newest replicated

    def observe(self, obs: object) -> None:
        if not isinstance(obs, SnapshotsHeld) or not obs.steps:
            return
        newest = obs.steps[-1]
        last = self.pushed[-1][0] if self.pushed else None
        self.lag_steps = newest - last if last is not None else newest
        if newest == last or self.busy():
            return
        address = self.peer()
        if address is None:
            return
        self._thread = threading.Thread(target=self._push, args=(address, self.rank()),
                                        name="ftagent-replica-push", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _push(self, address: tuple[str, int], rank: int) -> None:
        t0 = time.monotonic()
        try:
            step = push(address, self.key, self.root, self.job, rank, rate=self.rate)
        except (rp.Refused, layout.SnapshotRejected, OSError) as e:
            why = f"{type(e).__name__}: {e}"
            if "this agent holds step" in why:  # it has it already (e.g. just fetched)
                log.info("replica of rank %d not copied to %s:%d: %s", rank, *address, why)
                return
            self.failed = [*self.failed[-15:], why]
            log.warning("replica of rank %d not copied to %s:%d: %s", rank, *address, why)
            return
        if step is not None:
            took = time.monotonic() - t0
            self.pushed.append((step, took))
            log.info("replicated rank %d's snapshot of step %d to %s:%d in %.2fs", rank,
                     step, *address, took)


def parse_address(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[v6]:PORT`` too), or None when empty or not one."""
    host, _, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def fetch_before_start(root: str, job: str, rank: int, key: bytes,
                       address: tuple[str, int]) -> int | None:
    """A replaced pod's rank with no complete shard in memory fetches its replica from
    the holder before its trainer starts (bounded by IO_TIMEOUT per read); the step, or
    None (said in one line) when there is none or it was refused: the ladder goes on."""
    if layout.complete_steps(root, job, rank):
        return None  # the memory rung has it (a warm restart)
    try:
        step = fetch(address, key, root, job, rank)
    except (rp.Refused, layout.SnapshotRejected, OSError) as e:
        # a fresh job's first start has none: said, not warned
        (log.info if "no replica of rank" in str(e) else log.warning)(
            "no replica of rank %d fetched from %s:%d: %s", rank, *address, e)
        return None
    log.info("fetched rank %d's snapshot of step %d from its replica at %s:%d", rank, step,
             *address)
    return step


_holders: dict[tuple[str, str, str], Holder] = {}  # one per pod (the launcher's workers share)
_holders_lock = threading.Lock()


def replica_parts(w: Any, cfg: Any, job: str, parts: Any) -> Any:
    """The agent's replica parts for worker ``w`` (``--replica-listen``/``--replica-peer``):
    the pod's holder (started once), the fetch of this rank's replica before its trainer
    starts (a replaced pod; not a warm spare before its ASSIGN), and the background push.
    Without a job token nothing starts (said once): the channel's key is derived from it."""
    from ftagent.wire.credentials import current_token
    snap = cfg.snapshot
    token = current_token(cfg.arbiter.token, cfg.arbiter.token_file)
    if not token:
        log.warning("replica: --replica-listen/--replica-peer need the job token (--token): "
                    "no peer replica")
        return parts
    key = rp.replica_key(token, job)
    root = os.path.abspath(snap.snapshot_dir)
    listen = parse_address(snap.replica_listen) if snap.replica_listen else None
    if snap.replica_listen and listen is None:
        log.warning("replica: --replica-listen %r is not HOST:PORT: not serving",
                    snap.replica_listen[:64])
    if listen is not None:
        with _holders_lock:
            ident = (root, job, snap.replica_listen)
            if ident not in _holders:
                try:
                    from ftagent.agent.standby_memory import container_memory
                    from ftagent.checkpoint.agent_env import cap_bytes
                    mem = container_memory()  # the replicas' cap, in all: as the pod's own
                    cap = cap_bytes(snap.snapshot_memory_share,
                                    mem.limit if mem is not None else None, 1)
                    _holders[ident] = Holder(root, job, key, host=listen[0], port=listen[1],
                                             rate=snap.replica_bandwidth,
                                             max_bytes=cap).start()
                    log.info("replica: holding peers' snapshots on %s:%d", *listen)
                except OSError as e:
                    log.warning("replica: cannot listen on %s:%d: %s", *listen, e)
    peer = parse_address(snap.replica_peer) if snap.replica_peer else None
    if snap.replica_peer and peer is None:
        log.warning("replica: --replica-peer %r is not HOST:PORT: no replica",
                    snap.replica_peer[:64])
    if peer is None:
        return parts
    if not w.ident.spare:
        fetch_before_start(root, job, w.ident.rank, key, peer)
    return parts.plus(observers=[BackgroundReplica(
        root, job, lambda: w.ident.rank, key, lambda: peer, rate=snap.replica_bandwidth)])
