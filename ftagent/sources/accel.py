"""Accelerators behind one interface: NVIDIA (NVML, sources/gpu.py), Huawei Ascend
(sources/ascend.py: ``npu-smi``) and Kunlunxin (sources/kunlunxin.py: ``xpu-smi``).

What every backend gives the agent is the same: an inventory of devices (``GpuDevice``:
index, UUID or serial, bus id, model), the ones this trainer may use (the vendor's
visible-devices variables), and per poll one ``Sample`` per device -- health, error codes,
utilisation, memory, temperature, power, ECC counters, link state -- which ``VendorSource``
turns into the observations the GPU detector already takes (``GpuEvent``), and into the
``GpuReading`` the metrics collector exports under the same ``ftagent_gpu_*`` families,
with an ``accelerator`` label. The NVML path keeps its own source (events, not polling);
this module's ``pick`` chooses between them (``--accelerator``), and both sources are an
``AcceleratorSource`` to the agents that hold them.

Vendor tools are separate processes (the vendors' Python bindings are not on PyPI): each
call runs with a timeout and a bounded read, and a tool that is absent, cannot reach its
driver or refuses this user turns the source off with one log line -- the agent runs on.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ftagent.config import ConfigError, GpuConfig
from ftagent.model import GpuDevice, GpuEvent, GpuReading, Observation
from ftagent.sources.vendor_tool import (
    MAX_CODES,
    Backend,
    BackendUnavailable,
    Sample,
    Tool,
)
from ftagent.timegrid import sleep_on_grid

log = logging.getLogger("ftagent.sources.accel")

ACCELERATORS = ("nvidia", "ascend", "kunlunxin")
TOOLS = {"ascend": "npu-smi", "kunlunxin": "xpu-smi"}
DEVICE_GLOBS = {"ascend": "/dev/davinci[0-9]*", "kunlunxin": "/dev/xpu[0-9]*"}


# ---------------------------------------------------------------------- tools


def tool_command(accelerator: str, gpu_backend: str, rank: int, t0: float | None = None
                 ) -> tuple[list[str], str]:
    """(argv prefix, what it is) of the vendor tool for ``--gpu-backend``: the real tool
    for auto, or the simulated one playing ``simulated:FILE`` from ``t0`` (now)."""
    tool = TOOLS[accelerator]
    if gpu_backend.startswith("simulated:"):
        path = gpu_backend.partition(":")[2]
        from ftagent.sources import accel_script

        try:
            accel_script.load(path)  # a malformed file is a flag error at start, exit 2
        except accel_script.ScriptError as e:
            raise ConfigError(f"--gpu-backend: {e}") from None
        start = time.time() if t0 is None else t0
        return ([sys.executable, "-m", "ftagent.sources.accel_sim", tool, path,
                 repr(start), str(rank)], f"simulated {tool} ({path})")
    return [tool], tool


def detect(environ: Mapping[str, str], which: Callable[[str], str | None] = shutil.which,
           devices: Callable[[str], list[str]] = glob.glob) -> str:
    """``--accelerator auto``: Ascend where npu-smi or /dev/davinciN is, Kunlunxin where
    xpu-smi or /dev/xpuN is, else NVIDIA (whose source turns itself off without NVML)."""
    for acc in ("ascend", "kunlunxin"):
        if which(TOOLS[acc]) or devices(DEVICE_GLOBS[acc]):
            return acc
    return "nvidia"


def pick(cfg: GpuConfig, environ: Mapping[str, str]) -> str:
    """The accelerator this agent watches. ``simulated:FILE`` with ``auto`` stays NVIDIA
    (the NVML simulator's timeline), so existing drills keep their meaning."""
    if cfg.accelerator != "auto":
        return cfg.accelerator
    if cfg.gpu_backend.startswith("simulated:") or cfg.gpu_backend in ("nvml", "none"):
        return "nvidia"
    return detect(environ)


def make_backend(accelerator: str, cfg: GpuConfig, rank: int = 0,
                 hide: Callable[[int], None] | None = None,
                 show: Callable[[int], None] | None = None) -> Backend | None:
    """The vendor backend (None for ``--gpu-backend none``); ConfigError for a bad FILE.
    ``hide`` / ``show``: see ``Tool``."""
    if cfg.gpu_backend == "none":
        return None
    if cfg.gpu_backend == "nvml":
        raise ConfigError(f"--gpu-backend nvml is NVIDIA's; --accelerator {accelerator} "
                          "takes auto, none or simulated:FILE")
    argv, what = tool_command(accelerator, cfg.gpu_backend, rank)
    if accelerator == "ascend":
        from ftagent.sources.ascend import AscendBackend
        from ftagent.sources.dcmi import DEFAULT_PATHS, Dcmi

        dcmi = None
        lib = cfg.dcmi_library
        simulated = cfg.gpu_backend.startswith("simulated:")
        if lib != "none" and not (lib == "auto" and simulated):
            dcmi, why = Dcmi.load(DEFAULT_PATHS if lib == "auto" else (lib,))
            if dcmi is None:
                log.log(logging.INFO if lib == "auto" else logging.WARNING,
                        "DCMI library not used (%s); npu-smi answers health and codes", why)
            else:
                log.info("health and error codes through the DCMI library %s", dcmi.path)
        return AscendBackend(Tool(argv, what, hide=hide, show=show), dcmi)
    from ftagent.sources.kunlunxin import KunlunxinBackend

    return KunlunxinBackend(Tool(argv, what, hide=hide, show=show))


# ---------------------------------------------------------------------- the source


class DeviceView(Protocol):
    @property
    def dev(self) -> GpuDevice: ...


class AcceleratorSource(Protocol):
    """What the pod agent, the node agent and gpu-check use of an accelerator source:
    ``gpu.GpuSource`` (NVML) and ``VendorSource`` (Ascend, Kunlunxin) both are one."""

    off_reason: str
    ready: asyncio.Event
    event_counts: dict[tuple[int, str], int]

    @property
    def gpus(self) -> Sequence[DeviceView]: ...
    def device(self, index: int) -> GpuDevice | None: ...
    def readings(self) -> list[GpuReading]: ...
    async def run(self, emit: Callable[[Observation], None]) -> None: ...
    def stop(self) -> None: ...


@dataclass
class WatchedDevice:
    dev: GpuDevice
    lost: bool = False
    codes: frozenset[int] = frozenset()
    health: str = "ok"
    ecc_uncorrected: int | None = None
    links: tuple[int, ...] = ()


@dataclass
class _Last:
    samples: dict[int, Sample] = field(default_factory=dict)


class VendorSource:
    """Polls a vendor backend every ``--gpu-poll-interval``: a code that appears on a
    device is one ``GpuEvent(kind="vendor_code")``; the health level turning worse
    without a code, a device that stops answering (``lost``) and a rising uncorrected
    ECC count are events too. The detector (detect/accel.py) classifies them and merges
    repeats into one fault per episode."""

    def __init__(self, cfg: GpuConfig, environ: Mapping[str, str], backend: Backend | None,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.environ = dict(environ)
        self.backend = backend
        self.accelerator = backend.accelerator if backend else "none"
        self.clock = clock
        self.off_reason = ""
        self.driver = ""
        self.ready = asyncio.Event()
        self.polled = asyncio.Event()  # set after each poll's events are emitted
        self.event_counts: dict[tuple[int, str], int] = {}
        self.calls: dict[tuple[int, str], str] = {}
        self._watched: list[WatchedDevice] = []
        self._last = _Last()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.feed = None  # no kernel-log reader (gpu_check prints it)

    @property
    def gpus(self) -> list[WatchedDevice]:
        return self._watched

    def device(self, index: int) -> GpuDevice | None:
        return next((w.dev for w in self._watched if w.dev.index == index), None)

    def _off(self, why: str, level: int = logging.INFO) -> bool:
        self.off_reason = why
        log.log(level, "%s watch off: %s; the agent carries on without it",
                self.accelerator, why)
        return False

    def start(self) -> bool:
        """Inventory and selection (executor thread). False: the source is off."""
        if self.backend is None:
            return self._off("--gpu-backend none", logging.DEBUG)
        try:
            devices, self.driver = self.backend.inventory()
        except BackendUnavailable as e:
            explicit = self.cfg.accelerator != "auto"
            return self._off(str(e), logging.WARNING if explicit else logging.INFO)
        chosen, why = self.backend.visible(self.environ, devices)
        if not chosen:
            return self._off(f"no {self.accelerator} device for this trainer ({why}; "
                             f"{self.backend.tool} shows {len(devices)})")
        self._watched = [WatchedDevice(d) for d in chosen]
        log.info("watching %s (%s); %s driver %s", ", ".join(d.describe() for d in chosen),
                 why, self.backend.tool, self.driver or "?")
        return True

    def poll(self) -> list[GpuEvent]:
        """One sample of every watched device -> the events it implies (executor thread)."""
        assert self.backend is not None
        live = [w for w in self._watched if not w.lost]
        if not live:
            return []
        try:
            samples = self.backend.sample([w.dev for w in live])
        except BackendUnavailable as e:
            if "sample" not in self._warned:
                self._warned.add("sample")
                log.warning("%s stopped answering (%s); retrying each poll",
                            self.backend.tool, e)
            return []
        now = self.clock()
        out: list[GpuEvent] = []
        by_index = {s.index: s for s in samples}
        with self._lock:
            for w in live:
                s = by_index.get(w.dev.index)
                if s is None:
                    continue
                self._last.samples[w.dev.index] = s
                self.calls[(w.dev.index, "sample")] = "lost" if s.lost else "ok"
                out += self._changes(w, s, now)
        for ev in out:
            key = (ev.gpu, ev.kind)
            self.event_counts[key] = self.event_counts.get(key, 0) + 1
        return out

    def _changes(self, w: WatchedDevice, s: Sample, now: float) -> list[GpuEvent]:
        src = self.backend.tool if self.backend else "poll"
        i = w.dev.index
        if s.lost:
            w.lost = True
            log.error("%s is lost: %s no longer shows it", w.dev.describe(), src)
            return [GpuEvent(i, "lost", detail=f"{src} no longer answers for it", ts=now,
                             source="poll")]
        out = [GpuEvent(i, "vendor_code", xid=c, detail=f"health {s.health}", ts=now,
                        source="poll") for c in s.codes[:MAX_CODES] if c not in w.codes]
        worse = _LEVEL.get(s.health, 0) > _LEVEL.get(w.health, 0)
        if worse and not s.codes:
            out.append(GpuEvent(i, "vendor_health", xid=_LEVEL[s.health],
                                detail=f"health {w.health} -> {s.health}", ts=now,
                                source="poll"))
        if (s.ecc_uncorrected is not None and w.ecc_uncorrected is not None
                and s.ecc_uncorrected > w.ecc_uncorrected):
            out.append(GpuEvent(i, "ecc_dbe", detail=f"uncorrectable ECC count "
                                f"{w.ecc_uncorrected} -> {s.ecc_uncorrected}", ts=now,
                                count=s.ecc_uncorrected - w.ecc_uncorrected, source="poll"))
        w.codes = frozenset(s.codes[:MAX_CODES])
        w.health = s.health
        if s.ecc_uncorrected is not None:
            w.ecc_uncorrected = s.ecc_uncorrected
        return out

    def readings(self) -> list[GpuReading]:
        """The last sample of every device as GPU readings (the scrape's thread)."""
        out = []
        with self._lock:
            for w in self._watched:
                d, s = w.dev, self._last.samples.get(w.dev.index)
                if w.lost or s is None:
                    out.append(GpuReading(d.index, d.uuid, d.pci_bus_id, d.name, lost=w.lost))
                    continue
                out.append(GpuReading(
                    d.index, d.uuid, d.pci_bus_id, d.name,
                    temperature_celsius=s.temperature_celsius, power_watts=s.power_watts,
                    utilization=s.utilization, memory_used_bytes=s.memory_used_bytes,
                    memory_total_bytes=s.memory_total_bytes,
                    ecc_errors=(s.ecc_corrected, s.ecc_uncorrected), nvlink_up=s.links))
        return out

    async def run(self, emit: Callable[[Observation], None]) -> None:
        loop = asyncio.get_running_loop()
        try:
            started = await loop.run_in_executor(None, self.start)
        finally:
            self.ready.set()
        if not started:
            return
        while True:
            for ev in await loop.run_in_executor(None, self.poll):
                emit(ev)
            self.polled.set()
            await sleep_on_grid(self.cfg.gpu_poll_interval)

    def stop(self) -> None:
        pass  # nothing held between polls: each tool call is its own process


_LEVEL = {"ok": 0, "warning": 1, "alarm": 2, "critical": 3, "unknown": 0}

