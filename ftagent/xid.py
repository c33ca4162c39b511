"""NVIDIA's Xid catalog: what each Xid means and what it asks for (the vocabulary).

The table's rationale (NVIDIA's catalog, where others differ) is in ``detect/gpu.py``,
whose detector classifies Xids with it; the simulated NVML (``sources/gpu_sim.py``) words
a scripted Xid with it. Both stand on this module, so a source needs no detector.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GpuAction(str, enum.Enum):
    RESTART = "restart"
    RESET_GPU = "reset_gpu"
    REPLACE_NODE = "replace_node"
    IGNORE = "ignore"


@dataclass(frozen=True)
class XidInfo:
    xid: int
    meaning: str
    action: GpuAction


UNKNOWN_MEANING = "Xid not in ftagent's table"

_R, _G, _N, _I = (GpuAction.RESTART, GpuAction.RESET_GPU, GpuAction.REPLACE_NODE,
                  GpuAction.IGNORE)
XID_CATALOG: dict[int, XidInfo] = {x.xid: x for x in (
    XidInfo(8, "GPU stopped processing (robust channel timeout)", _R),
    XidInfo(13, "graphics engine exception", _R),
    XidInfo(31, "GPU memory page fault", _R),
    XidInfo(32, "invalid or corrupted push buffer stream", _R),
    XidInfo(43, "GPU stopped processing (channel reset)", _R),
    XidInfo(45, "preemptive cleanup after previous errors", _R),
    XidInfo(46, "GPU stopped processing", _G),
    XidInfo(48, "double-bit ECC error", _G),
    XidInfo(61, "internal micro-controller breakpoint/warning", _G),
    XidInfo(62, "internal micro-controller halt", _G),
    XidInfo(63, "ECC page retirement or row remapping recorded", _I),
    XidInfo(64, "ECC page retirement or row remapping recording failure", _G),
    XidInfo(68, "video processor exception", _R),
    XidInfo(69, "graphics engine class error", _R),
    XidInfo(74, "NVLink error", _G),
    XidInfo(79, "GPU has fallen off the bus", _N),
    XidInfo(92, "high single-bit ECC error rate", _I),
    XidInfo(94, "contained ECC error", _R),
    XidInfo(95, "uncontained ECC error", _G),
    XidInfo(109, "context switch timeout", _G),
    XidInfo(119, "GSP RPC timeout", _G),
    XidInfo(120, "GSP error", _G),
    XidInfo(136, "GPU error (reset per NVSentinel's table)", _G),
    XidInfo(140, "unrecovered ECC error", _G),
    XidInfo(143, "GPU error (reset per NVSentinel's table)", _G),
    *(XidInfo(x, "NVLink5 error", _G) for x in range(144, 151)),
    XidInfo(151, "key rotation error", _N),
    XidInfo(154, "GPU recovery action changed", _I),  # the action itself is read from NVML
    XidInfo(160, "GPU error requiring a node reboot", _N),
)}


def meaning(xid: int) -> str:
    """What the catalog says ``xid`` means (a fixed phrase for an Xid not in it)."""
    known = XID_CATALOG.get(xid)
    return known.meaning if known is not None else UNKNOWN_MEANING
