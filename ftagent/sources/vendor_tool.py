"""A vendor's management tool behind one interface: the bounded command runner (``Tool``),
one device's reading (``Sample``), the ``Backend`` protocol and the visible-devices
variables.

The base the vendor backends (``ascend.py``, ``kunlunxin.py``) build on: they and the
chooser that picks among them (``accel.py``) import this module, not each other.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ftagent.model import GpuDevice

TOOL_TIMEOUT = 10.0  # seconds a vendor tool may take before the call counts as failed
TOOL_OUTPUT = 1 << 20  # bytes of a tool's output read; the rest is not parsed
TIMED_OUT = 124  # Tool.run's exit status for a call that ran past its timeout
MAX_CODES = 32  # error codes taken from one device's sample


class BackendUnavailable(Exception):
    """The tool or its driver is absent, or this user may not use it: the source is off."""


class DeviceGone(Exception):
    """One device no longer answers (lost)."""


@dataclass(frozen=True)
class Sample:
    """One device read by a vendor tool (None: the tool does not show that value)."""

    index: int
    health: str = "ok"  # ok | warning | alarm | critical | unknown
    codes: tuple[int, ...] = ()  # error codes raised now
    lost: bool = False
    temperature_celsius: float | None = None
    power_watts: float | None = None
    utilization: float | None = None  # 0..1
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    ecc_uncorrected: int | None = None
    ecc_corrected: int | None = None
    links: tuple[tuple[int, bool], ...] = ()


class Backend(Protocol):
    """A vendor's management interface. Calls run in an executor thread."""

    accelerator: str
    tool: str

    def inventory(self) -> tuple[list[GpuDevice], str]:
        """(every device the tool shows, the driver version); BackendUnavailable."""
        ...

    def visible(self, environ: Mapping[str, str], devices: Sequence[GpuDevice]
                ) -> tuple[list[GpuDevice], str]:
        """The devices this trainer may use and why (the vendor's env variables)."""
        ...

    def sample(self, devices: Sequence[GpuDevice]) -> list[Sample]:
        """One sample per device the tool answered for: ``lost`` when it says the device
        is gone; none at all for a device whose query timed out (a slow tool is not a
        lost device: that would replace a node for a busy ``npu-smi``)."""
        ...


class Tool:
    """A vendor command line: ``run(args)`` -> (exit status, stdout, stderr), bounded."""

    def __init__(self, argv: Sequence[str], name: str, timeout: float = TOOL_TIMEOUT,
                 hide: Callable[[int], None] | None = None,
                 show: Callable[[int], None] | None = None) -> None:
        """``hide`` / ``show``: told each tool process's pid when it starts and ends, so
        the agent keeps it out of the trainer's tree (a restart must not kill it)."""
        self.argv = list(argv)
        self.name = name
        self.timeout = timeout
        self.hide = hide
        self.show = show
        self.runs = 0

    def run(self, args: Sequence[str]) -> tuple[int, str, str]:
        self.runs += 1
        try:
            p = subprocess.Popen(self.argv + list(args), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise BackendUnavailable(f"{self.name} is not installed (not on PATH)") from None
        except PermissionError:
            raise BackendUnavailable(f"{self.name}: permission denied") from None
        if self.hide is not None:
            self.hide(p.pid)
        try:
            stdout, stderr = p.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            return TIMED_OUT, "", f"{self.name} timed out after {self.timeout:g}s"
        finally:
            if self.show is not None:
                self.show(p.pid)
        out = stdout[:TOOL_OUTPUT].decode("utf-8", "replace")
        return p.returncode, out, stderr[:4096].decode("utf-8", "replace")


def parse_id_list(raw: str, limit: int = 1024) -> list[int] | None:
    """``0,1,4-7`` -> [0, 1, 4, 5, 6, 7]; None where it is not such a list."""
    out: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or len(part) > 16:
            return None
        a, b = int(lo), int(hi) if dash else int(lo)
        if b < a or b - a > limit or len(out) + b - a + 1 > limit:
            return None
        out.extend(range(a, b + 1))
    return out


def select_visible(environ: Mapping[str, str], devices: Sequence[GpuDevice],
                   runtime_var: str | None, app_var: str | None
                   ) -> tuple[list[GpuDevice], str]:
    """The container runtime's list (physical ids; inside a container the tool already
    shows only those, so it filters only when the tool shows more), then the runtime
    library's list on top (indices into the first, read up to the first bad entry, as
    CUDA_VISIBLE_DEVICES is). Unset: every device."""
    base, why = list(devices), []
    raw = environ.get(runtime_var) if runtime_var else None
    if raw is not None and raw.strip() not in ("", "all"):
        why.append(f"{runtime_var}={raw.strip()}")
        ids = parse_id_list(raw)
        if ids is not None and len(devices) > len(ids):
            wanted = set(ids)
            base = [d for d in devices if d.index in wanted]
    raw = environ.get(app_var) if app_var else None
    if raw is not None:
        why.append(f"{app_var}={raw.strip()}")
        chosen: list[GpuDevice] = []
        for tok in (t.strip() for t in raw.split(",")):
            if not tok.isdigit() or int(tok) >= len(base) or base[int(tok)] in chosen:
                break
            chosen.append(base[int(tok)])
        base = chosen
    return base, ", ".join(why) or "every device the tool shows"
