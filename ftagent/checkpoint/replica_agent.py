"""The agent's side of the peer replica: push each newer shard in the background, fetch
a replaced pod's before its trainer starts, start the pod's holder (``--replica-listen``,
``--replica-peer``, ``--replica-bandwidth``), take the arbiter's ring and key (its Welcome
and commands, agent/link_protocol.py). The bytes and their checks: replica.py and
replica_protocol.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
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

    def __init__(self, root: str, job: str, rank: Callable[[], int],
                 key: bytes | Callable[[], bytes],
                 peer: Callable[[], tuple[str, int] | None], *, rate: int = 0,
                 on_lag: Callable[[int], None] | None = None) -> None:
        self.root, self.job, self.rank, self.peer = root, job, rank, peer
        self.key: Callable[[], bytes] = key if callable(key) else (lambda: key)
        self.rate = rate
        self.on_lag = on_lag  # the replica lag gauge (steps reported minus replicated)
        self._thread: threading.Thread | None = None
        self.pushed: list[tuple[int, float]] = []  # (step, seconds) of each copy
        self.failed: list[str] = []  # why, newest last (bounded)
        self.lag_steps = 0  # newest reported minus newest replicated
        self.reported = 0  # the newest step the trainer reported

    def observe(self, obs: object) -> None:
        if not isinstance(obs, SnapshotsHeld) or not obs.steps:
            return
        newest = obs.steps[-1]
        self.reported = newest
        last = self.pushed[-1][0] if self.pushed else None
        self._lag(newest - last if last is not None else newest)
        if newest == last or self.busy():
            return
        address, key = self.peer(), self.key()
        if address is None or not key:  # the arbiter has not said them yet
            return
        self._thread = threading.Thread(target=self._push, args=(address, self.rank(), key),
                                        name="ftagent-replica-push", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _lag(self, steps: int) -> None:
        self.lag_steps = max(0, steps)
        if self.on_lag is not None:
            self.on_lag(self.lag_steps)

    def _push(self, address: tuple[str, int], rank: int, key: bytes) -> None:
        t0 = time.monotonic()
        try:
            step = push(address, key, self.root, self.job, rank, rate=self.rate)
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
            self.pushed = [*self.pushed[-15:], (step, took)]
            self.reported = max(self.reported, step)
            self._lag(self.reported - step)
            log.info("replicated rank %d's snapshot of step %d to %s:%d in %.2fs", rank,
                     step, *address, took)


def parse_address(text: str, *, listen: bool = False) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[v6]:PORT`` too; port 0, any free one, where ``listen``), or None
    when empty or not one."""
    host, _, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not (0 if listen else 1) <= int(port) < 65536:
        return None
    return host, int(port)


def fetch_before_start(root: str, job: str, rank: int, key: bytes,
                       address: tuple[str, int], step: int | None = None) -> int | None:
    """A replaced pod's rank with no complete shard in memory fetches its replica from
    the holder before its trainer starts (``step``, the arbiter's resume step, where the
    holder has it, else its newest; bounded by IO_TIMEOUT per read); the step, or None
    (said in one line) when there is none or it was refused: the ladder goes on."""
    if layout.complete_steps(root, job, rank):
        return None  # the memory rung has it (a warm restart)
    try:
        got = fetch(address, key, root, job, rank, step=step)
    except (rp.Refused, layout.SnapshotRejected, OSError) as e:
        # a fresh job's first start has none: said, not warned
        (log.info if "no replica of rank" in str(e) else log.warning)(
            "no replica of rank %d fetched from %s:%d (the ladder goes on to disk): %s",
            rank, *address, e)
        layout.note_peer_missed(root, job, rank, f"the replica at {address[0]}:{address[1]} "
                                f"was not fetched: {type(e).__name__}: {e}")
        return None
    layout.note_peer_missed(root, job, rank, "")
    log.info("fetched rank %d's snapshot of step %d from its replica at %s:%d", rank, got,
             *address)
    return got


_holders: dict[tuple[str, str, str], Holder] = {}  # one per pod (the launcher's workers share)
_holders_lock = threading.Lock()


def replica_parts(w: Any, cfg: Any, job: str, parts: Any,
                  on_lag: Callable[[int], None] | None = None) -> Any:
    """The agent's replica parts for worker ``w`` (``--replica-listen``/``--replica-peer``):
    the pod's holder (started once), the fetch of this rank's replica just before its
    trainer starts (a replaced pod, or a warm spare once ASSIGNed a rank), and the
    background push. Under an arbiter its Welcome and commands give the job's replica key
    and this rank's holder (a ring by node, arbiter/replica_ring.py); ``--replica-peer``
    overrides the holder, and without an arbiter the key is derived from the job token
    (``--token``): with neither, nothing starts (said once)."""
    from ftagent.wire.credentials import current_token
    snap = cfg.snapshot
    arbitrated = bool(cfg.arbiter.arbiter)

    def link_proto() -> Any:
        """The rank's link core (Welcome's key, the commands' holder), looked up when
        used: the parts are built before the worker takes its seat at the decider."""
        link_of = getattr(getattr(w, "decider", None), "link_of", None)
        return getattr(link_of(w) if link_of is not None else None, "proto", None)

    token = current_token(cfg.arbiter.token, cfg.arbiter.token_file)
    static_key = rp.replica_key(token, job) if token else b""
    if not arbitrated and not static_key:
        log.warning("replica: --replica-listen/--replica-peer need the job token (--token) "
                    "or an arbiter (--arbiter): no peer replica")
        return parts

    def key() -> bytes:
        """The arbiter's key for this job (Welcome), else the job token's."""
        proto = link_proto()
        return (proto.replica_key if proto is not None else b"") or static_key

    static_peer = parse_address(snap.replica_peer) if snap.replica_peer else None
    if snap.replica_peer and static_peer is None:
        log.warning("replica: --replica-peer %r is not HOST:PORT: no replica",
                    snap.replica_peer[:64])
        return parts

    def peer() -> tuple[str, int] | None:
        """--replica-peer, else the holder the arbiter named for this rank."""
        if static_peer is not None:
            return static_peer
        proto = link_proto()
        return parse_address(proto.replica_peer) if proto is not None and \
            proto.replica_peer else None

    root = os.path.abspath(snap.snapshot_dir)
    holder = _start_holder(cfg, root, job, key)
    if holder is not None and arbitrated:  # said in the Hello: the arbiter's ring
        parts = parts.with_(replica_port=holder.address[1])
    if static_peer is None and not arbitrated:
        return parts

    async def fetch_first(env: Mapping[str, str]) -> None:
        """Before the trainer starts: its shard from the replica, when memory has none."""
        rank = w.ident.rank
        if w.ident.spare or layout.complete_steps(root, job, rank):
            return
        address, k = peer(), key()
        if address is None or not k:
            why = "no replica holder is known" if address is None else "no replica key"
            log.info("replica: rank %d has no snapshot in memory and %s: the ladder goes on "
                     "to disk", rank, why)
            layout.note_peer_missed(root, job, rank, why + " (the arbiter said none)")
            return
        resume = env.get("FTAGENT_RESUME_STEP", "")
        await asyncio.to_thread(fetch_before_start, root, job, rank, k, address,
                                int(resume) if resume.isdigit() else None)

    return parts.plus(before_start=[fetch_first], observers=[BackgroundReplica(
        root, job, lambda: w.ident.rank, key, peer, rate=snap.replica_bandwidth,
        on_lag=on_lag)])


def _start_holder(cfg: Any, root: str, job: str,
                  key: Callable[[], bytes]) -> Holder | None:
    """The pod's holder on --replica-listen (one per pod: the launcher's workers share
    it), its replicas capped, in all, at --snapshot-memory-share of the container's
    memory; None without the flag or when it cannot listen (said)."""
    snap = cfg.snapshot
    if not snap.replica_listen:
        return None
    listen = parse_address(snap.replica_listen, listen=True)
    if listen is None:
        log.warning("replica: --replica-listen %r is not HOST:PORT: not serving",
                    snap.replica_listen[:64])
        return None
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
                                         rate=snap.replica_bandwidth, max_bytes=cap).start()
                log.info("replica: holding peers' snapshots on %s:%d",
                         *_holders[ident].address)
            except OSError as e:
                log.warning("replica: cannot listen on %s:%d: %s", *listen, e)
                return None
        return _holders[ident]
