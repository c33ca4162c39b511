"""NVML calls for the GPU source, each guarded: what failed, what is not supported, lost GPUs.

``NvmlCalls.call(gpu, name, *args)`` is ``nvml.name(handle, *args)`` or None:
``NVMLError_NotSupported`` (or a function the driver lacks) turns that call off for that
GPU, quietly; ``NVMLError_GpuIsLost`` from any call, on any thread, marks the GPU lost and
reports it once (``on_lost``), after which it is not called again; other errors are
logged once per (GPU, call). ``calls`` records the outcome of every call (``make
gpu-check`` prints it). ``poll`` reads the fault-relevant counters (``GpuHealth``),
``readings`` the telemetry for the metrics collector at scrape time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftagent.model import GpuDevice, GpuEvent, GpuHealth, GpuReading
from ftagent.sources.nvml_backend import Nvml

log = logging.getLogger("ftagent.sources.gpu")


@dataclass
class WatchedGpu:
    """A GPU the source watches: its handle and what is known about its calls."""

    dev: GpuDevice
    handle: Any
    disabled: set[str] = field(default_factory=set)
    lost: bool = False
    links: tuple[int, ...] = ()  # NVLink links that answered at start
    active_at_start: frozenset[int] = frozenset()


class NvmlCalls:
    def __init__(self, on_lost: Callable[[GpuEvent], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nvml: Nvml | None = None
        self.on_lost = on_lost
        self.clock = clock
        self.gpus: list[WatchedGpu] = []
        self.calls: dict[tuple[int, str], str] = {}  # (gpu, call) -> ok | not supported | error
        self._warned: set[tuple[int, str]] = set()

    def call(self, g: WatchedGpu, name: str, *args: Any, quiet: bool = False,
              result: bool = False) -> Any:
        """``nvml.name(handle, *args)``, or None where it failed (see the module doc).
        ``result``: return True for calls that return nothing."""
        import pynvml

        nvml = self.nvml
        if nvml is None or g.lost or name in g.disabled:
            return None
        key = (g.dev.index, name)
        try:
            value = getattr(nvml, name)(g.handle, *args)
        except pynvml.NVMLError_GpuIsLost:
            self._lose(g, name)
            return None
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            g.disabled.add(name)
            self.calls[key] = "not supported"
            log.debug("GPU %d: %s not supported; not called again", g.dev.index, name)
            return None
        except pynvml.NVMLError as e:
            if quiet:  # a probe (an NVLink link beyond the GPU's last)
                return None
            self.calls[key] = type(e).__name__
            if key not in self._warned:
                self._warned.add(key)
                log.warning("GPU %d: %s failed (%s: %s)", g.dev.index, name,
                            type(e).__name__, e)
            return None
        self.calls[key] = "ok"
        return True if result and value is None else value

    def _lose(self, g: WatchedGpu, call: str) -> None:
        if g.lost:
            return
        g.lost = True
        log.error("%s is lost (%s: NVMLError_GpuIsLost): it fell off the bus",
                  g.dev.describe(), call)
        self.on_lost(GpuEvent(g.dev.index, "lost", detail=f"{call} raised NVMLError_GpuIsLost",
                              ts=self.clock(), source="poll"))

    def recovery_action(self, g: WatchedGpu) -> int | None:
        """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (driver >= 570), where the GPU has it."""
        import pynvml

        name = "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"
        field_id = getattr(pynvml, name, None)
        if field_id is None:
            return None
        values = self.call(g, "nvmlDeviceGetFieldValues", [field_id])
        if values is None:
            return None
        v = values[0]
        if v.nvmlReturn != 0:
            self.calls[(g.dev.index, name)] = "not supported"
            return None
        self.calls[(g.dev.index, name)] = "ok"
        return int(v.value.uiVal)

    def poll(self) -> list[GpuHealth]:
        """One health sample per GPU still there."""
        import pynvml

        out = []
        now = self.clock()
        for g in self.gpus:
            ecc = self.call(g, "nvmlDeviceGetTotalEccErrors",
                             pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
            rows = self.call(g, "nvmlDeviceGetRemappedRows")
            retired = None
            if rows is None and "nvmlDeviceGetRemappedRows" in g.disabled:
                retired = self.call(g, "nvmlDeviceGetRetiredPagesPendingStatus")
            down = tuple(link for link in sorted(g.active_at_start)
                         if self.call(g, "nvmlDeviceGetNvLinkState", link) == 0)
            errors = None
            if rows is not None and rows[3] and g.links:
                errors = sum(self.call(g, "nvmlDeviceGetNvLinkErrorCounter", link, c) or 0
                             for link in g.links for c in range(5))
            reasons = self.call(g, "nvmlDeviceGetCurrentClocksEventReasons")
            recovery = self.recovery_action(g)
            if g.lost:
                continue
            out.append(GpuHealth(
                g.dev.index, ecc_uncorrected=ecc,
                remap_pending=bool(rows[2]) if rows else None,
                remap_failure=bool(rows[3]) if rows else None,
                retired_pending=bool(retired) if retired is not None else None,
                nvlink_down=down, nvlink_errors=errors, clock_event_reasons=reasons,
                recovery_action=recovery, ts=now))
        return out

    def readings(self) -> list[GpuReading]:
        """Telemetry of every GPU now."""
        import pynvml

        out = []
        for g in list(self.gpus):
            d = g.dev
            if g.lost:
                out.append(GpuReading(d.index, d.uuid, d.pci_bus_id, d.name, lost=True))
                continue
            util = self.call(g, "nvmlDeviceGetUtilizationRates")
            mem = self.call(g, "nvmlDeviceGetMemoryInfo")
            power = self.call(g, "nvmlDeviceGetPowerUsage")
            rows = self.call(g, "nvmlDeviceGetRemappedRows")
            ecc = tuple(self.call(g, "nvmlDeviceGetTotalEccErrors", t,
                                   pynvml.NVML_VOLATILE_ECC)
                        for t in (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                  pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))
            retired: tuple[Any, Any, Any] = (None, None, None)
            if "nvmlDeviceGetRemappedRows" in g.disabled:
                pages = [self.call(g, "nvmlDeviceGetRetiredPages", c) for c in (
                    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                    pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)]
                pending = self.call(g, "nvmlDeviceGetRetiredPagesPendingStatus")
                retired = (None if pages[0] is None else len(pages[0]),
                           None if pages[1] is None else len(pages[1]),
                           None if pending is None else bool(pending))
            links = tuple((link, bool(s)) for link in g.links
                          if (s := self.call(g, "nvmlDeviceGetNvLinkState", link)) is not None)
            out.append(GpuReading(
                d.index, d.uuid, d.pci_bus_id, d.name, lost=g.lost,
                temperature_celsius=self.call(g, "nvmlDeviceGetTemperature",
                                               pynvml.NVML_TEMPERATURE_GPU),
                power_watts=power / 1000.0 if power is not None else None,
                utilization=util.gpu / 100.0 if util is not None else None,
                memory_utilization=util.memory / 100.0 if util is not None else None,
                memory_used_bytes=int(mem.used) if mem is not None else None,
                memory_total_bytes=int(mem.total) if mem is not None else None,
                ecc_errors=(ecc[0], ecc[1]),
                remapped_rows=(rows[0], rows[1], bool(rows[2]), bool(rows[3]))
                if rows is not None else None,
                retired_pages=retired,
                clock_event_reasons=self.call(g, "nvmlDeviceGetCurrentClocksEventReasons"),
                nvlink_up=links,
                recovery_action=self.recovery_action(g)))
        return out
