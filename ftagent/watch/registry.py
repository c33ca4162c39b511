"""The watch parts by name: adding a source is one file and one line here.

A factory takes the :class:`WatchContext` and returns a part (``loop.Part``: its sources,
its pure detectors, its collector), or None when its flags turn it off; it raises
``ConfigError`` for a setting only checkable when it is built. The pod agent (for the
node's first worker), the node agent and gpu-check build theirs from here
(node-problem-detector's plugin shape: a name, a factory, nothing else to edit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry

from ftagent.watch import gpu, nic
from ftagent.watch.context import WatchContext
from ftagent.watch.loop import TICK_SECONDS, FaultSink, Part, WatchLoop

Factory = Callable[[WatchContext], "Part | None"]

FACTORIES: dict[str, Factory] = {
    "nic": nic.build,  # links (netlink) and RDMA ports (sysfs)
    "gpu": gpu.build,  # NVML and the kernel log, or a vendor tool (Ascend, Kunlunxin)
}


def build(ctx: WatchContext, names: Iterable[str] | None = None) -> list[Part]:
    """The parts ``names`` (default: every registered one, in registration order) for
    ``ctx``, leaving out those their flags turn off; ConfigError from a factory."""
    out: list[Part] = []
    for name in FACTORIES if names is None else names:
        part = FACTORIES[name](ctx)
        if part is not None:
            out.append(part)
    return out


def register(parts: Iterable[Part], metrics: CollectorRegistry,
             labels: Mapping[str, str]) -> None:
    """Each part's collector in ``metrics``, its series labelled ``labels``."""
    for p in parts:
        collector = p.collector(labels)
        if collector is not None:
            metrics.register(collector)


def assemble(ctx: WatchContext, on_fault: FaultSink, *,
             metrics: CollectorRegistry | None = None,
             labels: Mapping[str, str] | None = None,
             names: Iterable[str] | None = None,
             on_error: Callable[[str, BaseException], object] | None = None,
             tick_seconds: float | None = TICK_SECONDS) -> WatchLoop:
    """The parts for ``ctx``, their collectors registered in ``metrics`` with ``labels``,
    in one :class:`WatchLoop` whose faults go to ``on_fault``."""
    parts = build(ctx, names)
    if metrics is not None:
        register(parts, metrics, labels or {})
    return WatchLoop(parts, on_fault, on_error=on_error, tick_seconds=tick_seconds)
