"""The node agent's loop: sources -> detectors -> faults -> arbiter shards and Node conditions.

The same watch loop and parts as the pod agent's (``watch/``: every part registered in
``watch/registry.py``, today the GPUs and the links with RDMA ports), here for the whole
host: every GPU NVML shows (not the trainer's ``CUDA_VISIBLE_DEVICES``) and the host's
links (the DaemonSet runs with ``hostNetwork``). This module adds the node's sinks.

Which faults go to the arbiter (``reportable``):

* NIC: a link down past ``--nic-grace`` and its recovery (scope NODE): the arbiter waits
  for the link, then restarts, or replaces a rank on the node after ``--nic-replace-after``;
* GPU: faults of the reset-GPU and replace-node classes (severity FATAL), sent with scope
  NODE and the GPU's index and UUID in the evidence. The node agent cannot tell which pod
  holds which GPU (the kubelet's pod-resources API is not read here); the arbiter can,
  from the GPUs each pod's agent names in its Hello (``--gpus``, $NVIDIA_VISIBLE_DEVICES),
  and decides for those ranks only; a pod that names none counts as holding every GPU of
  the node. Application-level Xids (13, 31, 43, ...: the restart class) are counted and
  logged but not sent: they are the error of the process using the GPU, which its own
  pod agent sees and decides (restarting every job on a node for one job's bad kernel
  would be wrong).

A source that cannot start (no NVML, no netlink) is one log line; the others go on, and
the agent never exits for a fault it sees. A GPU marked unhealthy stays so until the
agent restarts (a GPU reset or a reboot restarts the DaemonSet's pod too); a link's
condition follows the link.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from ftagent.detect.nic import REASON_TEXT
from ftagent.model import Fault, FaultKind, Observation, Scope, Severity
from ftagent.node.conditions import (
    GPU_CONDITION,
    NIC_CONDITION,
    Health,
    NodeConditions,
    NodeStatusWriter,
    WriteError,
    reason_of,
)
from ftagent.node.reports import NodeReporter
from ftagent.timegrid import sleep_on_grid
from ftagent.watch.gpu import GpuWatch
from ftagent.watch.loop import Part, WatchLoop
from ftagent.watch.nic import NicWatch

__all__ = ["GpuWatch", "NicWatch", "NodeAgent", "lasting_key", "reportable"]

log = logging.getLogger("ftagent.node")

TICK_SECONDS = 0.25
WRITE_TIMEOUT = 10.0
WRITE_RETRY_CAP = 30.0


def reportable(f: Fault) -> Fault | None:
    """The fault as the arbiter gets it (scope NODE), or None when it stays local."""
    if f.kind is FaultKind.NIC:
        return f if f.scope is Scope.NODE else Fault(
            f.kind, f.message, severity=f.severity, scope=Scope.NODE, evidence=f.evidence,
            id=f.id, detected_at=f.detected_at)
    if f.kind is FaultKind.GPU and f.severity is Severity.FATAL:
        return Fault(f.kind, f.message, severity=f.severity, scope=Scope.NODE,
                     evidence=f.evidence, id=f.id, detected_at=f.detected_at)
    return None


def lasting_key(f: Fault) -> str:
    """What a sent fault lasts as, for pods that come later (``NodeReporter.report``): a
    link's outage until its recovery, a fatal GPU fault until the agent restarts (a GPU
    marked unhealthy stays so, see above): one per link or GPU, the latest."""
    if f.kind is FaultKind.NIC:
        return f"nic:{f.evidence.get('device', '')}"
    return f"gpu:{f.evidence.get('uuid') or f.evidence.get('gpu', '')}"


class NodeAgent:
    """Holds the watch loop (watch/: every registered part) and the two sinks; ``run()``
    until cancelled. ``gpu`` and ``nic`` are parts too (tests name them); the conditions
    are written for the GPU and NIC parts."""

    def __init__(self, node: str, *, parts: Sequence[Part] = (), gpu: GpuWatch | None = None,
                 nic: NicWatch | None = None, reporter: NodeReporter | None = None,
                 writer: NodeStatusWriter | None = None,
                 conditions: NodeConditions | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.node = node
        parts = [*parts, *(p for p in (gpu, nic) if p is not None)]
        self.gpu = next((p for p in parts if isinstance(p, GpuWatch)), None)
        self.nic = next((p for p in parts if isinstance(p, NicWatch)), None)
        # the node's own tick drives the detectors' (grace expiries), then the conditions
        self.watch = WatchLoop(parts, self.on_fault, tick_seconds=None)
        self.reporter = reporter
        self.writer = writer
        self.conditions = conditions or NodeConditions()
        self.wall = wall
        self.faults: list[Fault] = []  # the last ones seen, for status and tests
        self.kept_local = 0  # faults not sent (application-level Xids)
        self.condition_writes = 0
        self._write: asyncio.Task[None] | None = None
        self._write_error = ""
        self._retry_at = 0.0
        self._write_failures = 0

    # ------------------------------------------------------------------ flow

    def emit(self, obs: Observation) -> None:
        """One observation, through every detector (what a source's ``emit`` does)."""
        self.watch.emit(obs)

    def on_fault(self, f: Fault) -> None:
        self.faults = (self.faults + [f])[-100:]
        sent = reportable(f)
        level = logging.WARNING if f.severity in (Severity.ERROR, Severity.FATAL) else \
            logging.INFO
        if sent is None:
            self.kept_local += 1
            log.log(level, "node %s: %s fault (%s): %s -- not sent: an application error "
                    "its pod's agent decides", self.node, f.kind.value, f.severity.value,
                    f.message)
            return
        log.log(level, "node %s: %s fault (%s): %s", self.node, f.kind.value,
                f.severity.value, f.message)
        if self.reporter is not None:
            key = lasting_key(sent)
            if sent.kind is FaultKind.NIC and sent.evidence.get("recovered"):
                self.reporter.settle(key)
                key = ""
            elif sent.kind is FaultKind.NIC and sent.evidence.get("guessed"):
                key = ""  # a warning (detect/nic.py): no recovery will come to settle it
            self.reporter.report(sent, lasting=key)

    def health(self) -> list[Health]:
        """The conditions of the areas watched now (none for an area that is off)."""
        out: list[Health] = []
        if self.gpu is not None and self.gpu.source.gpus:
            bad = [(g.dev, self.gpu.detector.unhealthy_reason(g.dev.index))
                   for g in self.gpu.source.gpus]
            bad = [(d, why) for d, why in bad if why]
            if bad:
                out.append(Health(GPU_CONDITION, False, reason_of(bad[0][1] or ""), "; ".join(
                    f"{d.describe()}: {why}" for d, why in bad)))
            else:
                n = len(self.gpu.source.gpus)
                out.append(Health(GPU_CONDITION, True, "GPUsHealthy",
                                  f"{n} GPU(s) watched by ftagent node, none unhealthy"))
        if self.nic is not None:
            names = self.nic.source.watched()
            if self.nic.rdma is not None:
                names += [f"{p.device}/{p.port}" for p in self.nic.rdma.snapshot()]
            if names:
                down = []
                for name in names:
                    st = self.nic.detector.state(name)
                    # a warned outage (a link not named, others up: detect/nic.py) is
                    # no node condition
                    if st is not None and st.faulted and not st.warned and not st.up \
                            and st.reason:
                        down.append((name, st.reason))
                if down:
                    out.append(Health(NIC_CONDITION, False, reason_of(down[0][1]), "; ".join(
                        f"link {n} {REASON_TEXT.get(r, r)}" for n, r in down)))
                else:
                    out.append(Health(NIC_CONDITION, True, "LinksUp",
                                      f"links up: {', '.join(sorted(names))}"[:1000]))
        return out

    # ------------------------------------------------------------------ run

    async def run(self) -> None:
        tasks: list[asyncio.Task[None]] = []

        def start(name: str, coro: Coroutine[Any, Any, None]) -> None:
            tasks.append(asyncio.create_task(self._guard(name, coro)))

        start("watch", self.watch.run())  # each source guarded there
        if self.reporter is not None:
            start("arbiter reports", self.reporter.run())
        try:
            while True:
                self.tick(time.monotonic())
                await sleep_on_grid(TICK_SECONDS)  # wakes with the NIC and GPU polls
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._write is not None:
                self._write.cancel()

    def tick(self, now: float) -> None:
        """Grace expiries of links, then the conditions if a write is due."""
        self.watch.tick(now)
        if self.writer is None or (self._write is not None and not self._write.done()):
            return
        states = self.health()
        if now < self._retry_at and not self.conditions.changed(states):
            return
        wall = self.wall()
        plan = self.conditions.plan(states, wall)
        if plan is not None:
            self._write = asyncio.create_task(self._write_conditions(states, plan, wall))

    async def _write_conditions(self, states: list[Health], plan: list[dict[str, Any]],
                                wall: float) -> None:
        assert self.writer is not None
        try:
            await asyncio.to_thread(self.writer.patch_conditions, self.node, plan, WRITE_TIMEOUT)
        except WriteError as e:
            self._write_failures += 1
            delay = min(WRITE_RETRY_CAP, 0.5 * 2 ** min(self._write_failures, 10))
            self._retry_at = time.monotonic() + delay
            if str(e) != self._write_error:
                log.error("node conditions not written: %s (retrying)", e)
            self._write_error = str(e)
            return
        self.conditions.written(states, wall)
        self.condition_writes += 1
        self._write_failures, self._retry_at = 0, 0.0
        if self._write_error:
            log.info("node conditions written again")
        self._write_error = ""
        for h in states:
            log.debug("condition %s=%s (%s)", h.type, h.healthy, h.reason)

    async def _guard(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run one part; its failure is one error line, the rest go on."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a source's setup failure (no netlink, ...)
            log.error("%s stopped: %s; the node agent carries on without it", name, e)
