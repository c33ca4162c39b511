"""A simulated NVML that behaves like the real one, driven by a timeline (gpu_script.py).

``SimulatedNvml`` implements ``nvml_backend.Nvml`` with pynvml's names and signatures:
handles are real ``c_nvmlDevice_t`` pointers, results are pynvml's own ctypes structures
(``c_nvmlEventData_t``, ``nvmlPciInfo_t``, ``c_nvmlMemory_t``, ``c_nvmlFieldValue_t``...),
and errors are pynvml's own classes from the same calls: ``NVMLError_Uninitialized``
before ``nvmlInit``, ``NVMLError_LibraryNotFound`` / ``DriverNotLoaded`` without a
driver, ``NVMLError_Timeout`` from an event wait with nothing to report,
``NVMLError_GpuIsLost`` from every call on a lost GPU, ``NVMLError_NotSupported`` for
event types the GPU lacks, a call the timeline marks unsupported or NVLink on a GPU
without it, and an unsupported field as the entry's ``nvmlReturn``. The timeline is
applied lazily, as calls come; an event wait sleeps until the next scripted event or its
timeout. ``SimulatedKmsg`` plays the timeline's kernel-log lines (each Xid's too).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from ftagent.sources.gpu_script import DeviceSpec, Script
from ftagent.sources.nvml_backend import event_types
from ftagent.xid import meaning

_KIND_BIT = {kind: bit for bit, kind in event_types(pynvml).items()}
ALL_EVENTS = sum(_KIND_BIT.values())
EVENT_QUEUE = 10_000  # NVML's queue is bounded too: later events are dropped
_NO_INSTANCE = 0xFFFFFFFF


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # returns the NVMLError_* subclass for the code


def _addr(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


@dataclass
class _Gpu:
    spec: DeviceSpec
    handle: Any
    struct: Any
    lost: bool = False
    ecc: list[int] = field(default_factory=lambda: [0, 0])  # corrected, uncorrected
    remap: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    retired: list[int] = field(default_factory=lambda: [0, 0, 0])  # sbe, dbe, pending
    nvlink_up: list[bool] = field(default_factory=list)
    nvlink_errors: int = 0
    throttle: int = 0
    recovery: int = 0
    temp: int = 40
    power_mw: int = 120_000
    util: int = 0
    mem_used: int = 1 << 30
    registered: int = 0
    compute: str = "ok"  # preflight's compute check: ok, wrong, error, hang


class SimulatedNvml:
    """See the module docstring; ``rank`` picks the timeline's lines for this rank."""

    def __init__(self, script: Script, rank: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.script = script
        self.rank = rank
        self.clock = clock
        self.t0: float | None = None
        self._steps = deque(s for s in script.steps if s.rank in (None, rank) and s.ops)
        self._cond = threading.Condition()
        self._gpus: list[_Gpu] = []
        for spec in script.devices:
            struct = pynvml.struct_c_nvmlDevice_t()
            handle = ctypes.cast(ctypes.pointer(struct), pynvml.c_nvmlDevice_t)
            self._gpus.append(_Gpu(spec, handle, struct, nvlink_up=[True] * spec.nvlinks))
        self._by_addr = {_addr(g.handle): g for g in self._gpus}
        self._migs: dict[int, tuple[_Gpu, str, Any]] = {}
        self._events: deque[tuple[_Gpu, int, int]] = deque(maxlen=EVENT_QUEUE)
        self._sets: dict[int, Any] = {}
        self.calls = 0

    # ------------------------------------------------------------------ the timeline

    def _check(self) -> None:
        if self.t0 is None:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        self.calls += 1
        self._advance()

    def _advance(self) -> None:
        assert self.t0 is not None
        now = self.clock() - self.t0
        with self._cond:
            while self._steps and self._steps[0].t <= now:
                step = self._steps.popleft()
                assert step.gpu is not None
                self._apply(self._gpus[step.gpu], dict((k, v) for k, _, v in step.ops
                                                       if k in ("via", "detail")), step.ops)
            self._cond.notify_all()

    def _event(self, gpu: _Gpu, kind: str, data: int = 0) -> None:
        bit = _KIND_BIT.get(kind, 0)
        if bit and gpu.registered & bit:
            self._events.append((gpu, bit, data))

    def _apply(self, gpu: _Gpu, opts: dict[str, Any], ops: tuple[tuple[str, str, Any], ...]
               ) -> None:
        for key, op, value in ops:
            if key == "lost":
                gpu.lost = True
            elif key == "xid":
                if opts.get("via", "both") in ("nvml", "both"):
                    self._event(gpu, "xid", value)
            elif key in ("ecc_sbe", "ecc_dbe"):
                gpu.ecc[key == "ecc_dbe"] += value
                for _ in range(min(value, 100)):
                    self._event(gpu, key)
            elif key.startswith("remap_"):
                i = ("remap_corrected", "remap_uncorrected", "remap_pending",
                     "remap_failure").index(key)
                gpu.remap[i] = gpu.remap[i] + value if op == "+=" else value
                if key == "remap_failure" and value:
                    self._event(gpu, "remap_failure")
            elif key.startswith("retired_"):
                i = ("retired_sbe", "retired_dbe", "retired_pending").index(key)
                gpu.retired[i] = gpu.retired[i] + value if op == "+=" else value
            elif key == "nvlink":
                if value < len(gpu.nvlink_up):
                    gpu.nvlink_up[value] = op == "up"
            elif key == "nvlink_errors":
                gpu.nvlink_errors += value
            elif key == "recovery":
                gpu.recovery = value
                self._event(gpu, "recovery", value)
            elif key in ("throttle", "temp", "util", "mem_used", "compute"):
                setattr(gpu, key, value)
            elif key == "power":
                gpu.power_mw = value * 1000

    def kmsg_lines(self) -> list[tuple[float, str]]:
        """(t, line) of this rank's kernel log: scripted lines and every Xid's own."""
        out = []
        for s in self.script.steps:
            if s.rank not in (None, self.rank):
                continue
            if s.kmsg:
                out.append((s.t, s.kmsg))
            opts = {k: v for k, _, v in s.ops}
            if "xid" in opts and opts.get("via", "both") in ("kmsg", "both"):
                assert s.gpu is not None
                dom, bus, dev = self._gpus[s.gpu].spec.pci.split(":")
                text = opts.get("detail") or meaning(opts["xid"])
                out.append((s.t, f"NVRM: Xid (PCI:{int(dom, 16):04x}:{bus.lower()}:"
                                 f"{dev[:2].lower()}): {opts['xid']}, pid=4242, "
                                 f"name=python, {text}"))
        return sorted(out, key=lambda x: x[0])

    # ------------------------------------------------------------------ devices

    def _gpu(self, handle: Any, call: str) -> _Gpu:
        self._check()
        gpu = self._by_addr.get(_addr(handle))
        if gpu is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if gpu.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if call in gpu.spec.unsupported:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlInit(self) -> None:
        if self.script.driver == "missing":
            raise _err(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if self.script.driver == "not_loaded":
            raise _err(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        if self.t0 is None:
            self.t0 = self.clock()

    def nvmlShutdown(self) -> None:
        self._check()
        with self._cond:
            self.t0 = None
            self._cond.notify_all()

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return "570.133.20 (simulated)"

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._check()
        if not 0 <= index < len(self._gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpus[index]
        if gpu.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu.handle

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        mig = self._migs.get(_addr(handle))
        if mig is not None:
            self._check()
            return mig[1]
        return self._gpu(handle, "nvmlDeviceGetUUID").spec.uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle, "nvmlDeviceGetName").spec.name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        dom, bus, dev = gpu.spec.pci.split(":")
        info.busId = gpu.spec.pci.encode()
        info.busIdLegacy = gpu.spec.pci[4:].encode()
        info.domain, info.bus, info.device = int(dom, 16), int(bus, 16), int(dev[:2], 16)
        return info

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        on = int(bool(self._gpu(handle, "nvmlDeviceGetMigMode").spec.mig))
        return [on, on]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        return 7 if self._gpu(handle, "nvmlDeviceGetMaxMigDeviceCount").spec.mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not gpu.spec.mig:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= index < len(gpu.spec.mig):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        struct = pynvml.struct_c_nvmlDevice_t()
        mig = ctypes.cast(ctypes.pointer(struct), pynvml.c_nvmlDevice_t)
        self._migs[_addr(mig)] = (gpu, gpu.spec.mig[index], struct)
        return mig

    # ------------------------------------------------------------------ events

    def nvmlEventSetCreate(self) -> Any:
        self._check()
        struct = pynvml.struct_c_nvmlEventSet_t()
        es = ctypes.cast(ctypes.pointer(struct), pynvml.c_nvmlEventSet_t)
        self._sets[_addr(es)] = struct
        return es

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._gpu(handle, "nvmlDeviceGetSupportedEventTypes")
        return ALL_EVENTS

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
        if _addr(event_set) not in self._sets:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if event_types & ~ALL_EVENTS:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        gpu.registered |= event_types

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        deadline = self.clock() + timeout_ms / 1000.0
        while True:
            self._check()
            if _addr(event_set) not in self._sets:
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            with self._cond:
                if self._events:
                    gpu, bit, value = self._events.popleft()
                    data = pynvml.c_nvmlEventData_t()
                    data.device, data.eventType, data.eventData = gpu.handle, bit, value
                    data.gpuInstanceId = data.computeInstanceId = _NO_INSTANCE
                    return data
                now = self.clock()
                if now >= deadline:
                    raise _err(pynvml.NVML_ERROR_TIMEOUT)
                assert self.t0 is not None
                wake = deadline
                if self._steps:
                    wake = min(wake, self.t0 + self._steps[0].t)
                self._cond.wait(max(0.0, wake - now))

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self._check()
        with self._cond:
            self._sets.pop(_addr(event_set), None)
            self._cond.notify_all()

    # ------------------------------------------------------------------ health, telemetry

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int
                                    ) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        return gpu.ecc[error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED]

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        r = self._gpu(handle, "nvmlDeviceGetRemappedRows").remap
        return r[0], r[1], r[2], r[3]

    def nvmlDeviceGetRetiredPages(self, handle: Any, cause: int) -> list[int]:
        gpu = self._gpu(handle, "nvmlDeviceGetRetiredPages")
        n = gpu.retired[cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR]
        return [0x1000 * (i + 1) for i in range(n)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetRetiredPagesPendingStatus").retired[2]

    def _link(self, handle: Any, link: int, call: str) -> _Gpu:
        gpu = self._gpu(handle, call)
        if not gpu.nvlink_up:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.nvlink_up):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        return int(self._link(handle, link, "nvmlDeviceGetNvLinkState").nvlink_up[link])

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        gpu = self._link(handle, link, "nvmlDeviceGetNvLinkErrorCounter")
        return gpu.nvlink_errors if link == 0 and counter == 0 else 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").throttle

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list[int]) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, fid in enumerate(field_ids):
            values[i].fieldId = fid
            values[i].timestamp = int(time.time() * 1e6)
            recovery = fid == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
            if recovery and "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION" not in gpu.spec.unsupported:
                values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = gpu.recovery
                values[i].nvmlReturn = pynvml.NVML_SUCCESS
            else:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetTemperature").temp

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        u = pynvml.c_nvmlUtilization_t()
        u.gpu, u.memory = gpu.util, gpu.util // 2
        return u

    def ftagent_compute_check(self, handle: Any) -> str:
        """Not an NVML call: the simulator's stand-in for preflight's device-memory and
        compute check (agent/compute_probe.py runs it on a real GPU, in a child with
        CUDA; NVML cannot run a kernel). '' when the device passes; ``compute=wrong`` a
        wrong answer, ``error`` a CUDA error, ``hang`` never returns (the budget ends
        it); a lost GPU raises GpuIsLost as every call on it does."""
        gpu = self._gpu(handle, "ftagent_compute_check")
        if gpu.compute == "wrong":
            return "compute: a 256x256 matmul of ones is wrong"
        if gpu.compute == "error":
            return ("AcceleratorError: CUDA error: uncorrectable ECC error encountered "
                    "(simulated)")
        if gpu.compute == "hang":
            threading.Event().wait(3600)  # a kernel that never finishes
        return ""

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        m = pynvml.c_nvmlMemory_t()
        m.total, m.used = gpu.spec.memory_total, gpu.mem_used
        m.free = max(0, m.total - m.used)
        return m


class SimulatedKmsg:
    """The timeline's kernel-log lines, each at its time (KmsgReader's interface)."""

    def __init__(self, nvml: SimulatedNvml) -> None:
        self.nvml = nvml
        self.path = "simulated kernel log"
        self.lines = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self) -> None:
        pass

    def start(self, on_line: Callable[[float, str], None]) -> None:
        self._thread = threading.Thread(target=self._run, args=(on_line,),
                                        name="ftagent-kmsg-sim", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, on_line: Callable[[float, str], None]) -> None:
        t0 = self.nvml.t0 if self.nvml.t0 is not None else self.nvml.clock()
        for t, line in self.nvml.kmsg_lines():
            if self._stop.wait(max(0.0, t0 + t - self.nvml.clock())):
                return
            self.lines += 1
            on_line(self.nvml.clock(), line)
