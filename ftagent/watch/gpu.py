"""The accelerators: NVIDIA GPUs through NVML and the kernel log, or Ascend NPUs and
Kunlunxin XPUs through their vendor tool; one Xid (or vendor code) detector; the GPU
series (``--accelerator``, ``--gpu-backend``, ``--gpu-xid-action``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.registry import Collector

from ftagent.config import ConfigError
from ftagent.detect.gpu import GpuAction, GpuDetector, parse_xid_actions
from ftagent.sources.accel import AcceleratorSource
from ftagent.watch.context import WatchContext
from ftagent.watch.loop import Detector, Source


@dataclass
class GpuWatch:
    """One accelerator source and its detector (``AccelDetector`` for a vendor's)."""

    source: AcceleratorSource  # gpu.GpuSource (NVML) or accel.VendorSource
    detector: GpuDetector
    accelerator: str = "nvidia"
    name: str = "gpu"

    def sources(self) -> Sequence[Source]:
        return (self.source,)

    def detectors(self) -> Sequence[Detector]:
        return (self.detector,)

    def collector(self, labels: Mapping[str, str]) -> Collector:
        from ftagent.detect.accel import code_label
        from ftagent.metrics import GpuCollector

        source, accelerator = self.source, self.accelerator
        return GpuCollector(dict(labels), source.readings, self.detector.xid_counts,
                            self.detector.healthy, lambda: dict(source.event_counts),
                            accelerator=accelerator,
                            code_label=str if accelerator == "nvidia" else code_label(accelerator))


def xid_actions(ctx: WatchContext) -> tuple[dict[int, GpuAction], GpuAction]:
    try:
        return parse_xid_actions(ctx.gpu.gpu_xid_action)
    except ValueError as e:
        raise ConfigError(f"--gpu-xid-action {e}") from None


def build(ctx: WatchContext) -> GpuWatch | None:
    """The accelerator ``--accelerator`` names (auto: what the machine has), or None with
    ``--gpu-backend none``; ConfigError for a malformed ``simulated:FILE`` or action."""
    from ftagent.sources.accel import pick

    accelerator = pick(ctx.gpu, ctx.environ)
    if accelerator != "nvidia":
        return vendor(ctx, accelerator)
    from ftagent.sources.gpu import GpuSource, open_backend

    factory, feed = open_backend(ctx.gpu, ctx.rank)
    if factory is None:
        return None
    overrides, default = xid_actions(ctx)
    source = GpuSource(ctx.gpu, ctx.trainer_environ, factory, feed)
    return GpuWatch(source, GpuDetector(overrides=overrides, default=default,
                                        devices=source.device))


def vendor(ctx: WatchContext, accelerator: str) -> GpuWatch | None:
    """Ascend or Kunlunxin devices: the vendor tool's source and its code detector."""
    from ftagent.detect.accel import AccelDetector
    from ftagent.sources.accel import VendorSource, make_backend

    backend = make_backend(accelerator, ctx.gpu, ctx.rank, hide=ctx.hide, show=ctx.show)
    if backend is None:
        return None
    overrides, default = xid_actions(ctx)
    source = VendorSource(ctx.gpu, ctx.trainer_environ, backend)
    return GpuWatch(source, AccelDetector(accelerator, overrides=overrides, default=default,
                                          devices=source.device), accelerator)
