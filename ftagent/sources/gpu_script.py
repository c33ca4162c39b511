"""The ``--gpu-backend simulated:FILE`` timeline: what the simulated GPUs do, and when.

One statement a line; ``#`` starts a comment. Times are from the backend's start
(``nvmlInit``): ``t=2s``, ``t=500ms``, ``t=1.5``. A line may be for one rank only
(``rank=1``), so one file drives a whole job::

    gpus 2                                   # how many GPUs NVML shows (default: enough)
    device gpu=1 uuid=GPU-... pci=0000:3b:00.0 name="NVIDIA H100 80GB HBM3" nvlinks=18
    device gpu=0 mig=MIG-aaaa,MIG-bbbb unsupported=nvmlDeviceGetRemappedRows
    driver missing                           # or not_loaded: nvmlInit fails as without one
    t=2s gpu=1 xid=79                        # an Xid: an NVML event and a kernel-log line
    t=2s rank=1 gpu=0 xid=13 via=nvml detail="Graphics SM Warp Exception"
    t=5s gpu=0 ecc_dbe+=1                    # also ecc_sbe+=N, with their NVML events
    t=8s gpu=1 lost                          # every later call on it: NVMLError_GpuIsLost
    t=6s gpu=0 remap_pending=1 remap_failure=0 remap_corrected+=2 remap_uncorrected+=1
    t=6s gpu=0 retired_pending=1 retired_dbe+=1
    t=7s gpu=0 nvlink=3 down                 # or up; nvlink_errors+=N (on link 0)
    t=7s gpu=0 throttle=hw_thermal,sw_power_cap   # or none
    t=7s gpu=0 recovery=node_reboot          # none, gpu_reset, drain_and_reset, ... or N
    t=4s gpu=0 temp=91 power=700 util=100 mem_used=60GiB
    t=1s gpu=1 compute=wrong                 # preflight's compute check: ok, wrong, error, hang
    t=3s kmsg NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.

``unsupported=`` lists pynvml calls (or field names such as
``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``) that raise ``NVMLError_NotSupported`` on that
GPU. A line that is not one of these is a ``ScriptError`` naming the file and line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

# DGX H100-like bus ids for the first 8 GPUs; later ones count on
_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
THROTTLE = {"gpu_idle": 0x1, "applications_clocks": 0x2, "sw_power_cap": 0x4,
            "hw_slowdown": 0x8, "sync_boost": 0x10, "sw_thermal": 0x20, "hw_thermal": 0x40,
            "hw_power_brake": 0x80, "display_clock": 0x100}
RECOVERY = {"none": 0, "gpu_reset": 1, "node_reboot": 2, "drain_p2p": 3,
            "drain_and_reset": 4, "recover_imex_domain": 5, "bus_reset": 6,
            "system_reboot": 7}
_SETS = {"remap_pending", "remap_failure", "retired_pending", "temp", "power", "util",
         "mem_used", "xid", "nvlink", "compute"}
COMPUTE = ("ok", "wrong", "error", "hang")  # what preflight's compute check meets
_ADDS = {"ecc_dbe", "ecc_sbe", "remap_corrected", "remap_uncorrected", "retired_dbe",
         "retired_sbe", "nvlink_errors"}
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class ScriptError(ValueError):
    """A malformed timeline; the message names the file and line."""


@dataclass
class DeviceSpec:
    index: int
    uuid: str = ""
    pci: str = ""
    name: str = "NVIDIA H100 80GB HBM3"
    mig: tuple[str, ...] = ()
    unsupported: frozenset[str] = frozenset()
    nvlinks: int = 18
    memory_total: int = 80 << 30

    def __post_init__(self) -> None:
        i = self.index
        self.uuid = self.uuid or f"GPU-00000000-0000-4000-8000-{i:012x}"
        bus = _BUSES[i] if i < len(_BUSES) else 0xDC + i - len(_BUSES)
        self.pci = _nvml_bus_id(self.pci) if self.pci else f"00000000:{bus:02X}:00.0"


def _nvml_bus_id(text: str) -> str:
    """``0000:3b:00.0`` (or ``0000:3b:00``) in NVML's form, ``00000000:3B:00.0``."""
    m = re.fullmatch(r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.([0-7]))?", text)
    if m is None:
        raise ValueError(f"pci={text} is not a PCI bus id (0000:3b:00.0)")
    return f"{int(m.group(1), 16):08X}:{m.group(2).upper()}:{m.group(3).upper()}." \
           f"{m.group(4) or 0}"


@dataclass(frozen=True)
class Step:
    t: float
    line: int
    rank: int | None = None
    gpu: int | None = None
    ops: tuple[tuple[str, str, Any], ...] = ()  # (key, "=" | "+=" | "", value)
    kmsg: str = ""  # a raw kernel-log line


@dataclass
class Script:
    devices: list[DeviceSpec] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    driver: str = "ok"  # ok | missing | not_loaded


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", text)
    if m is None:
        raise ValueError(f"t={text} is not a time (2s, 500ms, 1.5)")
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]


def _int(key: str, text: str) -> int:
    m = re.fullmatch(r"(\d{1,15})([KMGT]iB|B)?", text, re.I)
    if m is None:
        raise ValueError(f"{key}={text} is not a number")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


def _value(key: str, text: str) -> Any:
    if key == "throttle":
        if text == "none":
            return 0
        bits = 0
        for name in text.split(","):
            if name not in THROTTLE:
                raise ValueError(f"throttle {name!r} is not one of {', '.join(THROTTLE)}")
            bits |= THROTTLE[name]
        return bits
    if key == "recovery":
        if text in RECOVERY:
            return RECOVERY[text]
        if text.isdigit():
            return int(text)
        raise ValueError(f"recovery {text!r} is not one of {', '.join(RECOVERY)} or a number")
    if key == "via":
        if text not in ("nvml", "kmsg", "both"):
            raise ValueError("via must be nvml, kmsg or both")
        return text
    if key == "detail":
        return text
    if key == "compute":
        if text not in COMPUTE:
            raise ValueError(f"compute must be one of {', '.join(COMPUTE)}")
        return text
    if key in ("remap_pending", "remap_failure", "retired_pending") and text not in "01":
        raise ValueError(f"{key} must be 0 or 1")
    return _int(key, text)


def _device(tokens: list[str], lineno: int) -> DeviceSpec:
    kv = dict(t.split("=", 1) for t in tokens if "=" in t)
    if len(kv) != len(tokens) or "gpu" not in kv:
        raise ValueError("device takes gpu=N and key=value pairs")
    allowed = {"gpu", "uuid", "pci", "name", "mig", "unsupported", "nvlinks", "memory"}
    unknown = set(kv) - allowed
    if unknown:
        raise ValueError(f"device: unknown {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(sorted(allowed))})")
    return DeviceSpec(
        index=_int("gpu", kv["gpu"]), uuid=kv.get("uuid", ""), pci=kv.get("pci", ""),
        name=kv.get("name", DeviceSpec.name),
        mig=tuple(m for m in kv.get("mig", "").split(",") if m),
        unsupported=frozenset(u for u in kv.get("unsupported", "").split(",") if u),
        nvlinks=_int("nvlinks", kv.get("nvlinks", "18")),
        memory_total=_int("memory", kv.get("memory", "80GiB")))


def _step(first: str, rest: str, lineno: int) -> Step:
    t = _seconds(first[2:])
    if rest == "kmsg" or rest.endswith(" kmsg"):
        raise ValueError("kmsg needs the kernel-log line after it")
    if rest.startswith("kmsg "):
        head, tail = "", rest[5:]
    elif " kmsg " in rest:
        head, tail = rest.split(" kmsg ", 1)
    else:
        head, tail = rest, ""
    tokens = shlex.split(head)
    rank = gpu = None
    ops: list[tuple[str, str, Any]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok == "lost":
            ops.append(("lost", "", True))
            continue
        key, op, value = re.fullmatch(r"([a-z_]+)(\+?=)?(.*)", tok).groups()  # type: ignore[union-attr]
        if key == "rank" and op == "=":
            rank = _int("rank", value)
        elif key == "gpu" and op == "=":
            gpu = _int("gpu", value)
        elif key == "nvlink" and op == "=" and i < len(tokens) and tokens[i] in ("up", "down"):
            ops.append(("nvlink", tokens[i], _int("nvlink", value)))
            i += 1
        elif op == "+=" and key in _ADDS or op == "=" and (key in _SETS or key in (
                "throttle", "recovery", "via", "detail")):
            ops.append((key, op, _value(key, value)))
        else:
            raise ValueError(f"{tok!r} is not a known event (see ftagent/sources/gpu_script.py)")
    if ops and gpu is None:
        raise ValueError("gpu=N is missing")
    if not ops and not tail:
        raise ValueError("nothing happens on this line")
    return Step(t, lineno, rank, gpu, tuple(ops), tail.strip())


def parse(text: str, path: str = "FILE") -> Script:
    """The timeline in ``text``; ScriptError ``PATH:LINE: what is wrong`` if malformed."""
    script = Script()
    count = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        first, _, rest = line.partition(" ")
        try:
            if first == "gpus":
                count = _int("gpus", rest.strip())
                if not 0 <= count <= 64:
                    raise ValueError("gpus must be 0..64")
            elif first == "device":
                script.devices.append(_device(shlex.split(rest), lineno))
            elif first == "driver":
                if rest.strip() not in ("ok", "missing", "not_loaded"):
                    raise ValueError("driver must be ok, missing or not_loaded")
                script.driver = rest.strip()
            elif first.startswith("t="):
                script.steps.append(_step(first, rest.strip(), lineno))
            else:
                raise ValueError(f"{first!r} is not gpus, device, driver or t=TIME")
        except ValueError as e:
            raise ScriptError(f"{path}:{lineno}: {e}: {raw.strip()[:120]!r}") from None
    used = [s.gpu for s in script.steps if s.gpu is not None] + [
        d.index for d in script.devices]
    n = count if count is not None else max(used, default=0) + 1
    for s in script.steps:
        if s.gpu is not None and s.gpu >= n:
            raise ScriptError(f"{path}:{s.line}: gpu={s.gpu} but there are {n} GPUs "
                              f"(gpus {n})")
    specs = {d.index: d for d in script.devices}
    if any(i >= n for i in specs):
        raise ScriptError(f"{path}: a device line names a GPU beyond gpus {n}")
    script.devices = [specs.get(i) or DeviceSpec(i) for i in range(n)]
    script.steps.sort(key=lambda s: s.t)  # stable: same-time lines keep their order
    return script


def load(path: str) -> Script:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ScriptError(f"{path}: cannot read the GPU timeline: {e}") from None
    return parse(text, path)
