"""The network: links through netlink, RDMA ports through sysfs, one debounce detector for
both, the NIC and InfiniBand series (``--nic*``, ``--rdma-sysfs``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.registry import Collector

from ftagent.detect.nic import NicDetector
from ftagent.model import Scope
from ftagent.sources.nic import NicSource
from ftagent.sources.rdma import RdmaSource
from ftagent.watch.context import WatchContext
from ftagent.watch.loop import Detector, Source


@dataclass
class NicWatch:
    source: NicSource
    detector: NicDetector
    rdma: RdmaSource | None = None
    name: str = "nic"

    def sources(self) -> Sequence[Source]:
        return (self.source,) if self.rdma is None else (self.source, self.rdma)

    def detectors(self) -> Sequence[Detector]:
        return (self.detector,)

    def collector(self, labels: Mapping[str, str]) -> Collector:
        from ftagent.metrics import NicCollector

        rdma = self.rdma
        return NicCollector(dict(labels), self.source.snapshot,
                            rdma.snapshot if rdma is not None else lambda: ())


def build(ctx: WatchContext) -> NicWatch:
    """Scope NODE with ``--nic-scope node`` (hostNetwork, the node agent), else POD."""
    scope = Scope.NODE if ctx.nic.nic_scope == "node" else Scope.POD
    detector = NicDetector(ctx.nic.nic_grace, scope=scope)
    return NicWatch(NicSource(ctx.nic, ctx.trainer_environ, netns=ctx.netns,
                              flaps=detector.flaps), detector,
                    RdmaSource(ctx.nic, ctx.trainer_environ, flaps=detector.flaps))
