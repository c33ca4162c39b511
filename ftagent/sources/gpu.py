"""The trainer's GPUs through NVML and the kernel log: events, a health poll, readings.

``GpuSource.run(emit)`` (the agent's Source protocol):

1. starts NVML (``nvmlInit``) off the loop; no driver, no library or no GPU for this
   trainer is one log line and the source is off -- the agent carries on;
2. maps ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES`` onto NVML's GPUs
   (gpu_devices.py), each with index, UUID, PCI bus id and model name;
3. registers, per GPU, the event types it supports of Xid critical, double- and
   single-bit ECC, DRAM retirement failure, fatal poison, GPU unavailable and recovery
   action (``nvmlDeviceGetSupportedEventTypes`` & ours -> ``nvmlDeviceRegisterEvents``),
   and waits for them in one thread (``nvmlEventSetWait_v2`` with a 0.5 s timeout;
   ``NVMLError_Timeout`` is the normal case, and the stop flag is read between waits);
4. reads the kernel log (kmsg.py) in a second thread, mapping each Xid line's PCI bus id
   to the GPU (Xids of GPUs the trainer does not use are skipped); both threads hand
   events to the loop through one ``Handoff``, which merges floods;
5. every ``--gpu-poll-interval`` polls, off the loop, what needs no event: volatile ECC
   counts, remapped rows (pending, failure) or, where rows are not remapped, pending page
   retirement, NVLink state, clock event reasons and the recovery action field, as one
   ``GpuHealth`` per GPU for the detector.

Every NVML call goes through ``gpu_calls.NvmlCalls``: ``NVMLError_NotSupported`` (or a function the
driver lacks) turns that call off for that GPU, quietly; ``NVMLError_GpuIsLost`` from any
call, on any thread, is a ``lost`` event of its own, after which the GPU is not called
again. ``readings()`` reads telemetry for the metrics collector at scrape time, and
``calls`` records what worked (``make gpu-check`` prints it).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ftagent.config import ConfigError, GpuConfig
from ftagent.model import (
    SXID_UNKNOWN_DEVICE,
    GpuDevice,
    GpuEvent,
    GpuHealth,
    GpuReading,
    Observation,
)
from ftagent.sources import kmsg as kmsg_mod
from ftagent.sources.gpu_calls import NvmlCalls, WatchedGpu
from ftagent.sources.gpu_devices import select_gpus
from ftagent.sources.gpu_handoff import Handoff
from ftagent.sources.nvml_backend import Nvml, event_types
from ftagent.timegrid import sleep_on_grid

log = logging.getLogger("ftagent.sources.gpu")

EVENT_WAIT_MS = 500
NVLINK_PROBE = 36  # NVML_NVLINK_MAX_LINKS of current drivers


class LineFeed(Protocol):
    """A kernel-log reader (kmsg.KmsgReader, gpu_sim.SimulatedKmsg)."""

    path: str
    lines: int

    def open(self) -> None: ...
    def start(self, on_line: Callable[[float, str], None]) -> None: ...
    def stop(self, timeout: float = ...) -> None: ...


def open_backend(cfg: GpuConfig, rank: int = 0) -> tuple[Callable[[], Nvml] | None,
                                                         LineFeed | None]:
    """(NVML factory, kernel-log feed) for ``cfg``; ConfigError for a malformed
    ``simulated:FILE`` (one line naming the line, exit 2)."""
    if cfg.gpu_backend == "none":
        return None, None
    feed: LineFeed | None = None
    if cfg.gpu_backend.startswith("simulated:"):
        from ftagent.sources import gpu_script
        from ftagent.sources.gpu_sim import SimulatedKmsg, SimulatedNvml

        try:
            script = gpu_script.load(cfg.gpu_backend.partition(":")[2])
        except gpu_script.ScriptError as e:
            raise ConfigError(f"--gpu-backend: {e}") from None
        sim = SimulatedNvml(script, rank=rank)
        factory: Callable[[], Nvml] = lambda: sim  # noqa: E731
        if cfg.kmsg == "auto":
            feed = SimulatedKmsg(sim)
    else:
        from ftagent.sources.nvml_backend import real

        factory = real
        if cfg.kmsg == "auto":
            feed = kmsg_mod.KmsgReader(kmsg_mod.KMSG)
    if cfg.kmsg not in ("auto", "none", ""):
        feed = kmsg_mod.KmsgReader(cfg.kmsg)
    return factory, feed


class GpuSource:
    def __init__(self, cfg: GpuConfig, environ: Mapping[str, str],
                 factory: Callable[[], Nvml] | None, feed: LineFeed | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.environ = dict(environ)
        self.factory = factory
        self.feed = feed
        self.clock = clock
        self.nv = NvmlCalls(self._put, clock)
        self.registered: dict[int, list[str]] = {}  # gpu -> event kinds registered
        self.event_counts: dict[tuple[int, str], int] = {}
        self.off_reason = ""
        self.ready = asyncio.Event()  # set once the GPUs are known (or the source is off)
        self._by_addr: dict[int, WatchedGpu] = {}
        self._by_pci: dict[tuple[int, int, int], WatchedGpu] = {}
        self._types: dict[int, str] = {}
        self._set: Any = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._handoff: Handoff | None = None
        self._warned: set[tuple[int, str]] = set()
        self._feed_started = False

    # ------------------------------------------------------------------ public

    @property
    def gpus(self) -> list[WatchedGpu]:
        return self.nv.gpus

    @property
    def calls(self) -> dict[tuple[int, str], str]:
        return self.nv.calls

    def device(self, index: int) -> GpuDevice | None:
        return next((g.dev for g in self.gpus if g.dev.index == index), None)

    def poll(self) -> list[GpuHealth]:
        """One health sample per GPU still there (runs in an executor thread)."""
        return self.nv.poll()

    def readings(self) -> list[GpuReading]:
        """Telemetry of every GPU now, for the metrics collector (the scrape's thread)."""
        return self.nv.readings()

    async def run(self, emit: Callable[[Observation], None]) -> None:
        loop = asyncio.get_running_loop()
        self._handoff = Handoff(loop, emit)
        try:
            started = await loop.run_in_executor(None, self._start)
        finally:
            self.ready.set()
        if not started:
            return
        try:
            while True:
                for h in await loop.run_in_executor(None, self.poll):
                    emit(h)
                await sleep_on_grid(self.cfg.gpu_poll_interval)
        finally:
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self.feed is not None and self._feed_started:
            self._feed_started = False
            self.feed.stop()
        for t in self._threads:
            t.join(EVENT_WAIT_MS / 1000 * 2 + 0.5)
        self._threads = []
        if self.nv.nvml is not None:
            nvml, self.nv.nvml = self.nv.nvml, None
            try:
                if self._set is not None:
                    nvml.nvmlEventSetFree(self._set)
                nvml.nvmlShutdown()
            except Exception as e:  # noqa: BLE001 - on the way out
                log.debug("NVML shutdown: %s", e)

    # ------------------------------------------------------------------ start

    def _off(self, why: str, level: int = logging.INFO) -> bool:
        self.off_reason = why
        log.log(level, "GPU watch off: %s; the agent carries on without it", why)
        return False

    def _start(self) -> bool:
        if self.factory is None:
            return self._off("--gpu-backend none", logging.DEBUG)
        explicit = self.cfg.gpu_backend != "auto"
        try:
            import pynvml

            nvml = self.factory()
            nvml.nvmlInit()
        except ImportError:
            return self._off("nvidia-ml-py is not installed")
        except pynvml.NVMLError as e:
            return self._off(f"NVML unavailable ({type(e).__name__}: {e})",
                             logging.WARNING if explicit else logging.INFO)
        self.nv.nvml = nvml
        self._types = event_types(pynvml)
        try:
            return self._discover(nvml, pynvml)
        except pynvml.NVMLError as e:
            self.stop()
            return self._off(f"NVML failed while listing GPUs ({type(e).__name__}: {e})",
                             logging.WARNING)

    def _discover(self, nvml: Nvml, pynvml: Any) -> bool:
        devices: list[GpuDevice] = []
        handles: dict[int, Any] = {}
        mig_parent: dict[str, int] = {}
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                pci = nvml.nvmlDeviceGetPciInfo(h).busId
                devices.append(GpuDevice(i, nvml.nvmlDeviceGetUUID(h), _text(pci),
                                         nvml.nvmlDeviceGetName(h)))
            except pynvml.NVMLError as e:
                log.warning("GPU %d cannot be read (%s: %s); not watched", i,
                            type(e).__name__, e)
                continue
            handles[i] = h
            for uuid in self._migs(nvml, pynvml, h):
                mig_parent[uuid] = i
        chosen, why = select_gpus(self.environ, devices, mig_parent)
        if not chosen:
            self.stop()
            return self._off(f"no GPU for this trainer ({why}; NVML shows {len(devices)})")
        self.nv.gpus = [WatchedGpu(d, handles[d.index]) for d in chosen]
        self._by_addr = {_addr(g.handle): g for g in self.gpus}
        self._by_pci = {k: g for g in self.gpus if (k := kmsg_mod.pci_key(g.dev.pci_bus_id))}
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        log.info("watching %s (%s); NVML driver %s", ", ".join(
            g.dev.describe() for g in self.gpus), why, driver)
        self._register(nvml, pynvml)
        for g in self.gpus:
            self._probe_links(g, pynvml)
        self._start_kmsg()
        return True

    @staticmethod
    def _migs(nvml: Nvml, pynvml: Any, h: Any) -> list[str]:
        try:
            if nvml.nvmlDeviceGetMigMode(h)[0] != 1:
                return []
            slots = nvml.nvmlDeviceGetMaxMigDeviceCount(h)
        except pynvml.NVMLError:
            return []
        out = []
        for j in range(slots):
            try:
                out.append(_text(nvml.nvmlDeviceGetUUID(
                    nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j))))
            except pynvml.NVMLError:
                continue
        return out

    def _register(self, nvml: Nvml, pynvml: Any) -> None:
        try:
            self._set = nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            log.warning("NVML events unavailable (%s); polling only", e)
            return
        wanted = sum(self._types)
        for g in self.gpus:
            supported = self.nv.call(g, "nvmlDeviceGetSupportedEventTypes")
            mask = int(supported or 0) & wanted
            if mask and self.nv.call(g, "nvmlDeviceRegisterEvents", mask, self._set,
                                   result=True) is not None:
                self.registered[g.dev.index] = [k for b, k in self._types.items() if mask & b]
        if self.registered:
            t = threading.Thread(target=self._events, name="ftagent-nvml-events", daemon=True)
            self._threads.append(t)
            t.start()

    def _probe_links(self, g: WatchedGpu, pynvml: Any) -> None:
        links, active = [], set()
        for link in range(NVLINK_PROBE):
            state = self.nv.call(g, "nvmlDeviceGetNvLinkState", link, quiet=True)
            if state is None:
                if "nvmlDeviceGetNvLinkState" in g.disabled:
                    break
                continue
            links.append(link)
            if state:
                active.add(link)
        if links:  # links past the last one answered InvalidArgument: not an error
            self.calls[(g.dev.index, "nvmlDeviceGetNvLinkState")] = "ok"
            g.disabled.discard("nvmlDeviceGetNvLinkState")
        g.links, g.active_at_start = tuple(links), frozenset(active)

    def _start_kmsg(self) -> None:
        if self.feed is None:
            return
        try:
            self.feed.open()
            self.feed.start(self._on_kmsg)
        except OSError as e:
            level = logging.INFO if self.cfg.kmsg == "auto" else logging.WARNING
            log.log(level, "kernel-log Xids off: cannot read %s (%s)", self.feed.path,
                    e.strerror or e)
            self.feed = None
            return
        log.info("reading Xids from %s", self.feed.path)
        self._feed_started = True

    # ------------------------------------------------------------------ threads

    def _events(self) -> None:
        import pynvml

        assert self.nv.nvml is not None
        nvml = self.nv.nvml
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(self._set, EVENT_WAIT_MS)
            except pynvml.NVMLError_Timeout:
                continue
            except pynvml.NVMLError as e:
                if self._stop.is_set():
                    return
                if (-1, "nvmlEventSetWait_v2") not in self._warned:
                    self._warned.add((-1, "nvmlEventSetWait_v2"))
                    log.warning("NVML event wait failed (%s: %s); retrying", type(e).__name__, e)
                self._stop.wait(1.0)
                continue
            self._on_event(data)

    def _on_event(self, data: Any) -> None:
        g = self._by_addr.get(_addr(data.device))
        kind = self._types.get(int(data.eventType))
        if g is None or kind is None:
            return
        key = (g.dev.index, kind)
        self.event_counts[key] = self.event_counts.get(key, 0) + 1
        if kind == "ecc_sbe":  # corrected: counted (and in the ECC counters), not a fault
            return
        value = int(data.eventData)
        self._put(GpuEvent(g.dev.index, kind, xid=value if kind in ("xid", "recovery") else None,
                           ts=self.clock(), source="nvml"))

    def _on_kmsg(self, ts: float, line: str) -> None:
        found = kmsg_mod.parse_line(line)
        if found is None:
            return
        if found.sxid:  # an NVSwitch: acted on only if it is this host's (detect/gpu.py)
            source = "kmsg" if kmsg_mod.nvidia_pci_device(found.pci) else SXID_UNKNOWN_DEVICE
            self._put(GpuEvent(-1, "sxid", xid=found.xid, detail=f"{found.switch}: "
                               f"{found.detail}", ts=ts, source=source))
            return
        g = self._by_pci.get(found.pci)
        if g is not None:
            self._put(GpuEvent(g.dev.index, "xid", xid=found.xid, detail=found.detail, ts=ts,
                               source="kmsg"))

    def _put(self, ev: GpuEvent) -> None:
        if self._handoff is not None:
            self._handoff.put(ev)

def _addr(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
