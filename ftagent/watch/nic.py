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
    """Scope NODE with ``--nic-scope node`` (hostNetwork, the node agent), else POD. The
    detector asks the source which links it only guessed (up at start, none named): their
    outages are judged against each other (detect/nic.py)."""
    scope = Scope.NODE if ctx.nic.nic_scope == "node" else Scope.POD
    # each reads the other (the source the detector's flap counts): the detector is
    # looked up when the first snapshot is taken, after it was built
    source = NicSource(ctx.nic, ctx.trainer_environ, netns=ctx.netns,
                       flaps=lambda dev: detector.flaps(dev))
    detector = NicDetector(ctx.nic.nic_grace, scope=scope, guessed=source.guessed)
    return NicWatch(source, detector,
                    RdmaSource(ctx.nic, ctx.trainer_environ, flaps=detector.flaps))
