"""GPU faults from GPU observations: the Xid table and one fault per (GPU, cause, episode).

Pure: time comes from the observations, the device descriptions from an injected lookup.

**The Xid table** follows NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors, the
r570/r575 edition whose rows carry a resolution: RESTART_APP, RESET_GPU, RESTART_BM/VM,
IGNORE, and the XID_48/NVLink workflows), as summarised in the project's FIELD-NOTES; it
was not re-read against the catalog's workbook for this table (the table itself is in
``ftagent/xid.py``, the vocabulary: the simulated NVML words its Xids with it too). Each
Xid maps to one ``GpuAction``:

* ``restart`` -- an application-level error (13, 31, 43, 45, 68, 94, ...): the job
  restarts in place on the same GPUs;
* ``reset_gpu`` -- the GPU needs a reset before it is usable again (48, 62, 64, 95, 109,
  119, 120, NVLink 74 and 144-150, ...): no process may hold it during a reset, so this
  rank's pod moves (the policy's REPLACE) and the GPU can be reset behind it;
* ``replace_node`` -- the node must go (79 fell off the bus, 151, 160; NVLink errors on a
  GPU whose row remapping failed);
* ``ignore`` -- informational (63 a page retirement / row remap was recorded, 92 a high
  single-bit ECC rate): counted, never a fault.

Where others differ: NVIDIA's k8s-device-plugin treats 13, 31, 43, 45, 68 and 109 as
application errors that leave the device healthy (we reset the GPU on 109, a context-switch
timeout, as NVSentinel does); AWS EKS's and GKE's node health lists are similar and differ
from each other on 109 and 63; NVSentinel's older CSV restarts the application on 8, 13,
31, 32, 43, 94, resets the GPU on 46, 62, 64, 95, 109, 119, 120, 136, 140, 143, runs its
NVLink workflow on 74, reboots the machine on 79 and 160 and restarts the VM on 151 (we
replace the node: the pod cannot restart a VM). ``--gpu-xid-action XID=ACTION`` overrides a
row (``default=ACTION`` sets the action of Xids not in the table, ``restart`` unless set).

**Other causes** (not Xids): GPU lost (NVML's ``GpuIsLost`` from any call), a double-bit
ECC error (event, or the volatile uncorrected count rising), a row-remap failure, a
pending row remap and GPU lost are node-scope faults; a pending page retirement, an
NVLink link gone inactive and the driver's recovery action (GPU reset, drain and reset,
bus reset) ask for a GPU reset; a recovery action of node or system reboot replaces the
node. Thermal or power slowdown is a warning in the log and a metric, never a fault.

**Floods**: every occurrence is counted (``xid_counts``), but a (GPU, cause) raises one
fault per *episode*: an episode ends when the cause has been quiet for ``quiet`` seconds
(a condition from the poll: when it clears). The same Xid from NVML and the kernel log is
one occurrence seen twice: an episode counts the larger of the two paths' counts, so
neither double counts, and memory stays bounded by the (GPU, cause) pairs, not the lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ftagent.model import (
    SXID_UNKNOWN_DEVICE,
    Fault,
    FaultKind,
    GpuDevice,
    GpuEvent,
    GpuHealth,
    Observation,
    Scope,
    Severity,
)
from ftagent.xid import UNKNOWN_MEANING, XidInfo
from ftagent.xid import XID_CATALOG as XID_CATALOG  # importable from here too
from ftagent.xid import GpuAction as GpuAction

log = logging.getLogger("ftagent.detect.gpu")

EPISODE_QUIET = 60.0  # seconds without an occurrence that end a (GPU, cause) episode

MAX_KEYS = 4096  # (GPU, cause) pairs tracked; more fold into the GPU's "other" Xid
OTHER_XID = -1
DETAIL_CHARS = 500

RECOMMENDED = {
    GpuAction.RESTART: "restart the job in place",
    GpuAction.RESET_GPU: "reset the GPU (this rank moves off it)",
    GpuAction.REPLACE_NODE: "replace the node",
    GpuAction.IGNORE: "nothing to do",
}

# action -> (severity, scope) of its fault: the arbiter's policy rows for GPU faults
# (FATAL or NODE scope: REPLACE that rank; ERROR: RESTART in place)
FAULT_CLASS = {
    GpuAction.RESTART: (Severity.ERROR, Scope.PROCESS),
    GpuAction.RESET_GPU: (Severity.FATAL, Scope.POD),
    GpuAction.REPLACE_NODE: (Severity.FATAL, Scope.NODE),
}


# NVML_GPU_RECOVERY_ACTION_* (field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, driver >= 570)
_G, _N = GpuAction.RESET_GPU, GpuAction.REPLACE_NODE
RECOVERY_ACTIONS: dict[int, tuple[str, GpuAction]] = {
    1: ("GPU reset", _G), 2: ("node reboot", _N), 3: ("drain peer-to-peer", _G),
    4: ("drain and reset", _G), 5: ("recover the IMEX domain", _G), 6: ("bus reset", _G),
    7: ("system reboot", _N),
}

# NVML clocks event reasons that are slowdowns worth a warning (power capping by software
# and idling are normal operation)
SLOWDOWN_REASONS = {0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                    0x80: "hw_power_brake"}


def parse_xid_actions(specs: Iterable[str]) -> tuple[dict[int, GpuAction], GpuAction]:
    """``XID=ACTION`` overrides (and ``default=ACTION``) -> (table overrides, default).

    Raises ValueError naming the bad item."""
    table: dict[int, GpuAction] = {}
    default = GpuAction.RESTART
    choices = ", ".join(a.value for a in GpuAction)
    for spec in specs:
        key, sep, value = spec.strip().partition("=")
        try:
            action = GpuAction(value.strip().lower())
        except ValueError:
            raise ValueError(f"{spec!r}: the action must be one of {choices}") from None
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"{spec!r} is not XID=ACTION")
        if key == "default":
            default = action
        elif key.isascii() and key.isdigit() and len(key) <= 5:
            table[int(key)] = action
        else:
            raise ValueError(f"{spec!r}: the Xid must be a number (or 'default')")
    return table, default


def classify(xid: int, overrides: Mapping[int, GpuAction] | None = None,
             default: GpuAction = GpuAction.RESTART) -> XidInfo:
    """The table's row for ``xid``, with any override applied."""
    known = XID_CATALOG.get(xid)
    info = known or XidInfo(xid, UNKNOWN_MEANING, default)
    if overrides and xid in overrides:
        return XidInfo(xid, info.meaning, overrides[xid])
    return info


@dataclass
class _Episode:
    first: float
    last: float
    counts: dict[str, int] = field(default_factory=dict)  # by source (nvml, kmsg, poll)
    faulted: bool = False
    ignored: bool = False  # logged once as ignored; a cause that acts may still fault

    def occurrences(self) -> int:
        return max(self.counts.values(), default=0)


@dataclass(frozen=True)
class _Cause:
    """What a fault is about: an Xid, or a condition ("lost", "ecc_dbe", ...)."""

    name: str
    meaning: str
    action: GpuAction
    xid: int | None = None
    scope: Scope | None = None  # the action's scope unless set (a pending remap: NODE)


class GpuDetector:
    """GPU observations in, GPU faults out (see the module docstring)."""

    def __init__(self, *, overrides: Mapping[int, GpuAction] | None = None,
                 default: GpuAction = GpuAction.RESTART, quiet: float = EPISODE_QUIET,
                 devices: Callable[[int], GpuDevice | None] = lambda _: None,
                 wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.overrides = dict(overrides or {})
        self.default = default
        self.quiet = quiet
        self.devices = devices
        self._wall = wall
        self._monotonic = monotonic
        self._episodes: dict[tuple[int, str], _Episode] = {}
        self._xid_base: dict[tuple[int, int], int] = {}  # occurrences of closed episodes
        self._health: dict[int, GpuHealth] = {}
        self._unhealthy: dict[int, str] = {}  # gpu -> the cause that made it unhealthy
        self._slowdown: dict[int, int] = {}

    # ------------------------------------------------------------------ queries

    def xid_counts(self) -> dict[tuple[int, int], int]:
        """Occurrences of every (GPU, Xid) seen (GPU -1: an NVSwitch SXid)."""
        out = dict(self._xid_base)
        for (gpu, name), ep in list(self._episodes.items()):
            if name.startswith(("xid:", "sxid:")):
                key = (gpu, int(name.partition(":")[2]))
                out[key] = out.get(key, 0) + ep.occurrences()
        return out

    def healthy(self, gpu: int) -> bool:
        return gpu not in self._unhealthy

    def unhealthy_reason(self, gpu: int) -> str | None:
        return self._unhealthy.get(gpu)

    def slowdown(self, gpu: int) -> int:
        return self._slowdown.get(gpu, 0)

    # ------------------------------------------------------------------ inputs

    def observe(self, obs: Observation) -> list[Fault]:
        if isinstance(obs, GpuEvent):
            cause = self._event_cause(obs)
            if cause is None:
                return []
            return self._occur(obs.gpu, cause, obs.ts, obs.count, obs.source, obs.detail)
        if isinstance(obs, GpuHealth):
            return self._health_sample(obs)
        return []

    def tick(self, now: float) -> list[Fault]:
        return []  # episodes end lazily, on the next occurrence

    # ------------------------------------------------------------------ internals

    def _event_cause(self, ev: GpuEvent) -> _Cause | None:
        if ev.kind == "xid" and ev.xid is not None:
            info = classify(ev.xid, self.overrides, self.default)
            action = info.action
            nvlink = ev.xid == 74 or 144 <= ev.xid <= 150
            if nvlink and self._remap_failed(ev.gpu) and action is not GpuAction.IGNORE:
                action = GpuAction.REPLACE_NODE
            return _Cause(f"xid:{ev.xid}", info.meaning, action, ev.xid)
        if ev.kind == "sxid" and ev.xid is not None:  # NVSwitch: the node's fabric
            fatal = "non-fatal" not in ev.detail.lower() and "fatal" in ev.detail.lower()
            if ev.source == SXID_UNKNOWN_DEVICE:
                return _Cause(f"sxid:{ev.xid}", "NVSwitch " + ("fatal" if fatal else
                              "non-fatal") + " error of a device that is none of this "
                              "node's (counted; not acted on without NVML's word)",
                              GpuAction.IGNORE, ev.xid)
            return _Cause(f"sxid:{ev.xid}", "NVSwitch " + ("fatal" if fatal else "non-fatal")
                          + " error", GpuAction.REPLACE_NODE if fatal else GpuAction.IGNORE,
                          ev.xid)
        if ev.kind == "lost":
            return _Cause("lost", "GPU is lost (fell off the bus)", GpuAction.REPLACE_NODE)
        if ev.kind == "ecc_dbe":
            return _Cause("ecc_dbe", "double-bit (uncorrected) ECC error",
                          GpuAction.REPLACE_NODE)
        if ev.kind == "remap_failure":
            return _Cause("remap_failure", "row remapping failed", GpuAction.REPLACE_NODE)
        if ev.kind == "poison":
            return _Cause("poison", "uncontained (fatal poison) error", GpuAction.RESET_GPU)
        if ev.kind == "recovery" and ev.xid in RECOVERY_ACTIONS:
            what, action = RECOVERY_ACTIONS[ev.xid]
            return _Cause("recovery", f"the driver asks for a {what}", action)
        return None

    def _remap_failed(self, gpu: int) -> bool:
        h = self._health.get(gpu)
        return bool(h and h.remap_failure) or (gpu, "remap_failure") in self._episodes

    def _occur(self, gpu: int, cause: _Cause, ts: float, count: int, source: str,
               detail: str = "", condition: bool = False) -> list[Fault]:
        key = (gpu, cause.name)
        ep = self._episodes.get(key)
        if ep is not None and not condition and ts - ep.last > self.quiet:
            self._close(key, ep)
            ep = None
        if ep is None:
            if len(self._episodes) >= MAX_KEYS and cause.xid is not None:
                key = (gpu, f"xid:{OTHER_XID}")
                ep = self._episodes.get(key)
            if ep is None:
                ep = self._episodes[key] = _Episode(first=ts, last=ts)
        ep.last = max(ep.last, ts)
        ep.counts[source] = ep.counts.get(source, 0) + max(1, count)
        if ep.faulted:
            return []
        if cause.action is GpuAction.IGNORE:
            if not ep.ignored:
                log.info("GPU %d: %s (%s): ignored (counted in ftagent_gpu_xid_errors_total)",
                         gpu, _what(cause), cause.meaning)
            ep.ignored = True
            return []
        ep.faulted = True
        if cause.action is not GpuAction.RESTART and gpu >= 0:
            self._unhealthy.setdefault(gpu, _what(cause))
        return [self._fault(gpu, cause, ep, ts, detail)]

    def _close(self, key: tuple[int, str], ep: _Episode) -> None:
        del self._episodes[key]
        gpu, name = key
        if name.startswith(("xid:", "sxid:")):
            xkey = (gpu, int(name.partition(":")[2]))
            self._xid_base[xkey] = self._xid_base.get(xkey, 0) + ep.occurrences()

    def _health_sample(self, h: GpuHealth) -> list[Fault]:
        prev = self._health.get(h.gpu)
        self._health[h.gpu] = h
        faults: list[Fault] = []
        before = prev.ecc_uncorrected if prev and prev.ecc_uncorrected is not None else 0
        if h.ecc_uncorrected is not None and h.ecc_uncorrected > before:
            cause = _Cause("ecc_dbe", "double-bit (uncorrected) ECC error",
                           GpuAction.REPLACE_NODE)
            faults += self._occur(h.gpu, cause, h.ts, h.ecc_uncorrected - before, "poll",
                                  f"volatile uncorrected ECC count {before} -> "
                                  f"{h.ecc_uncorrected}")
        nvlink_errors = prev is not None and prev.nvlink_errors is not None and \
            h.nvlink_errors is not None and h.nvlink_errors > prev.nvlink_errors
        conditions = [
            ("remap_failure", bool(h.remap_failure), "row remapping failed",
             GpuAction.REPLACE_NODE),
            ("remap_pending", bool(h.remap_pending), "a row remap is pending",
             GpuAction.RESET_GPU),
            ("retired_pending", bool(h.retired_pending), "a page retirement is pending",
             GpuAction.RESET_GPU),
            ("nvlink_down", bool(h.nvlink_down), "NVLink link "
             + ", ".join(str(n) for n in h.nvlink_down) + " inactive",
             GpuAction.REPLACE_NODE if h.remap_failure else GpuAction.RESET_GPU),
            ("nvlink_errors", nvlink_errors and bool(h.remap_failure),
             "NVLink errors on a GPU whose row remapping failed", GpuAction.REPLACE_NODE),
        ]
        rec = RECOVERY_ACTIONS.get(h.recovery_action or 0)
        conditions.append(("recovery", rec is not None,
                           f"the driver asks for a {rec[0] if rec else 'nothing'}",
                           rec[1] if rec else GpuAction.IGNORE))
        for name, active, meaning, action in conditions:
            if active:
                scope = Scope.NODE if name in ("remap_failure", "remap_pending") else None
                faults += self._occur(h.gpu, _Cause(name, meaning, action, scope=scope), h.ts,
                                      1, "poll", condition=True)
            elif (h.gpu, name) in self._episodes:  # the condition cleared: episode over
                del self._episodes[(h.gpu, name)]
        self._throttle(h)
        return faults

    def _throttle(self, h: GpuHealth) -> None:
        if h.clock_event_reasons is None:
            return
        now = sum(bit for bit in SLOWDOWN_REASONS if h.clock_event_reasons & bit)
        was = self._slowdown.get(h.gpu, 0)
        if now & ~was:
            names = ", ".join(n for b, n in SLOWDOWN_REASONS.items() if now & ~was & b)
            log.warning("GPU %d is slowed down: %s (a warning, not a fault; see "
                        "ftagent_gpu_clock_event_reason)", h.gpu, names)
        elif was and not now:
            log.info("GPU %d: slowdown over", h.gpu)
        self._slowdown[h.gpu] = now

    def _fault(self, gpu: int, cause: _Cause, ep: _Episode, ts: float, detail: str) -> Fault:
        severity, scope = FAULT_CLASS[cause.action]
        scope = cause.scope or scope
        dev = self.devices(gpu) if gpu >= 0 else None
        who = dev.describe() if dev else ("NVSwitch" if gpu < 0 else f"GPU {gpu}")
        what = _what(cause)
        recommended = RECOMMENDED[cause.action]
        evidence: dict[str, Any] = {
            "gpu": gpu, "uuid": dev.uuid if dev else "", "pci_bus_id": dev.pci_bus_id if dev
            else "", "model": dev.name if dev else "", "cause": cause.name,
            "xid": cause.xid, "meaning": cause.meaning, "action": cause.action.value,
            "recommended": recommended, "occurrences": ep.occurrences(),
            "seen_by": sorted(ep.counts), "first_seen": ep.first,
            "first_seen_wall": self._wall() - (self._monotonic() - ep.first),
            "detail": detail[:DETAIL_CHARS],
        }
        h = self._health.get(gpu)
        if h is not None:
            evidence["counters"] = {f.name: getattr(h, f.name) for f in fields(h)
                                    if f.name not in ("gpu", "ts")}
        return Fault(FaultKind.GPU, f"{who}: {what} ({cause.meaning}): {recommended}",
                     severity=severity, scope=scope, evidence=evidence)


def _what(cause: _Cause) -> str:
    if cause.xid is None:
        return cause.name.replace("_", " ")
    return f"{'SXid' if cause.name.startswith('sxid:') else 'Xid'} {cause.xid}"
