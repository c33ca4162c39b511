"""Ascend and Kunlunxin faults: each vendor's codes and health levels -> the GPU actions.

Pure. ``AccelDetector`` is the GPU detector (detect/gpu.py: one fault per (device, cause,
episode), floods counted, not repeated) with the vendor's classification for the events
``VendorSource`` raises: ``vendor_code`` (an error code), ``vendor_health`` (the health
level worse without a code), and the shared ``lost`` / ``ecc_dbe``.

**Ascend** (``ASCEND_LEVELS``): the fault handling levels of Ascend's MindCluster device
plugin (``faultCode.json``; hiascend.com "故障事件信息" and the ModelArts NPU error-code
table, L1-L6) mapped onto ours:

* NotHandleFault (L1) -> ignore; PreSeparateNPU and SubHealthFault -> ignore (the running
  job is not affected; the device plugin stops scheduling onto the chip);
* RestartRequest, RestartBusiness (L2, L3) -> restart the job in place;
* FreeRestartNPU, RestartNPU (L4) -> reset the device (this rank's pod moves off it);
* SeparateNPU (L5/L6) -> replace the node (the chip is isolated until repaired).

``ASCEND_CODES`` carries the rows we could read from the published files (a sample, not
all of faultCode.json; ``--gpu-xid-action CODE=ACTION`` with the code in decimal adds or
overrides one). A code not in the table is classified by the health level npu-smi
reports with it -- Warning: ignore, Alarm: restart, Critical: reset the device -- which
is our inference from npu-smi's level names (一般/重要/紧急告警), not Huawei's rule.

**Kunlunxin**: no public error-code catalogue was found; codes are classified by the
health level (Warning: ignore, Fault: reset the device), a rising uncorrectable ECC
count replaces the node as NVIDIA's double-bit ECC does, and a device that xpu-smi no
longer lists is lost (replace the node). All inferred; docs/accelerators.md says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ftagent.detect.gpu import MAX_KEYS, GpuAction, GpuDetector, _Cause
from ftagent.model import Fault, GpuEvent, Observation

_R, _G, _N, _I = (GpuAction.RESTART, GpuAction.RESET_GPU, GpuAction.REPLACE_NODE,
                  GpuAction.IGNORE)

ASCEND_LEVELS: dict[str, GpuAction] = {
    "NotHandleFault": _I, "PreSeparateNPU": _I, "SubHealthFault": _I,
    "RestartRequest": _R, "RestartBusiness": _R,
    "FreeRestartNPU": _G, "RestartNPU": _G,
    "SeparateNPU": _N,
}

# code -> fault handling level, from MindCluster's faultCode.json (gitcode.com/Ascend/
# mind-cluster, component/ascend-device-plugin/build/faultCode.json), its samples
# (Ascend/mindcluster-deploy samples/fault/1/faultCode.json) and the event example of
# hiascend.com's "故障事件信息" (8C084E00 RestartBusiness).
ASCEND_CODES: dict[int, str] = {
    **{int(c, 16): "NotHandleFault" for c in (
        "80E21007", "80E38003", "80F78006", "80C98006", "80CB8006", "81318006", "80A18006",
        "80A18005", "80CD8006", "80CD8003", "80A38006", "80A38003", "80DE1805", "80E01805",
        "80E18400", "80E01809", "80E18401", "80F38006", "80F38003", "80E18006", "81078603",
        "8C2FA009")},
    0x8C084E00: "RestartBusiness",
    **{int(c, 16): "SeparateNPU" for c in (
        "80CF8003", "812E4E00", "80FA4E00", "80C98003", "80CB8002", "80CB8008", "80CB8009",
        "80BD8008", "80BD8000", "80BD8003", "816F8008", "816F8002", "817F8002", "817F8008",
        "81578002", "81998008", "8C204E00")},
}

ASCEND_BY_HEALTH = {1: ("Warning", _I), 2: ("Alarm", _R), 3: ("Critical", _G)}
KUNLUNXIN_BY_HEALTH = {1: ("Warning", _I), 2: ("Fault", _G), 3: ("Fault", _G)}


def code_label(accelerator: str) -> Callable[[int], str]:
    """How a code is written in metrics and messages: Ascend's as 8 hex digits."""
    if accelerator == "ascend":
        return lambda c: f"{c:08X}"
    if accelerator == "kunlunxin":
        return lambda c: f"0x{c:X}"
    return str


class AccelDetector(GpuDetector):
    """The GPU detector with a vendor's classification (see the module docstring)."""

    def __init__(self, accelerator: str, *, overrides: Mapping[int, GpuAction] | None = None,
                 default: GpuAction = GpuAction.RESTART, **kw: Any) -> None:
        super().__init__(overrides=overrides, default=default, **kw)
        self.accelerator = accelerator
        self.label = code_label(accelerator)
        self._codes: dict[tuple[int, int], int] = {}

    def observe(self, obs: Observation) -> list[Fault]:
        if isinstance(obs, GpuEvent) and obs.kind == "vendor_code" and obs.xid is not None:
            key = (obs.gpu, obs.xid)
            if key in self._codes or len(self._codes) < MAX_KEYS:
                self._codes[key] = self._codes.get(key, 0) + max(1, obs.count)
        return super().observe(obs)

    def xid_counts(self) -> dict[tuple[int, int], int]:
        """Occurrences of every (device, error code): the ``xid`` series of the GPU
        collector, written with ``code_label``."""
        return dict(self._codes)

    def _event_cause(self, ev: GpuEvent) -> _Cause | None:
        if ev.kind == "vendor_health" and ev.xid is not None:
            table = ASCEND_BY_HEALTH if self.accelerator == "ascend" else KUNLUNXIN_BY_HEALTH
            name, action = table.get(ev.xid, ("unknown", _I))
            return _Cause(f"health:{ev.xid}", f"health {name} with no error code", action)
        if ev.kind == "vendor_code" and ev.xid is not None:
            return self._code_cause(ev)
        if ev.kind == "lost":
            return _Cause("lost", f"{self.accelerator} device is lost (the tool no longer "
                          "shows it)", GpuAction.REPLACE_NODE)
        return super()._event_cause(ev)

    def _code_cause(self, ev: GpuEvent) -> _Cause:
        code = ev.xid
        assert code is not None
        label = self.label(code)
        if code in self.overrides:
            return _Cause(f"code:{label}", "--gpu-xid-action", self.overrides[code])
        level = ASCEND_CODES.get(code) if self.accelerator == "ascend" else None
        if level is not None:
            return _Cause(f"code:{label}", f"{level} in MindCluster's faultCode.json",
                          ASCEND_LEVELS[level])
        health = ev.detail.removeprefix("health ").strip().lower()
        rank = {"warning": 1, "alarm": 2, "critical": 3}.get(health, 0)
        table = ASCEND_BY_HEALTH if self.accelerator == "ascend" else KUNLUNXIN_BY_HEALTH
        name, action = table.get(rank, ("OK", self.default))
        return _Cause(f"code:{label}", f"not in ftagent's table; classified by the health "
                      f"it came with, {name}", action)
