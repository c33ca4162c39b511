"""Huawei Ascend NPUs through ``npu-smi`` (the DCMI library's command line).

Formats (Huawei's npu-smi reference, hiascend.com, Atlas 200I A2 23.0.RC3 / 25.2.0 and the
Atlas 300I Pro 23.0.RC3 editions; the 910B layout with ``HBM-Usage(MB)`` as printed on
Atlas 800T A2 nodes):

* ``npu-smi info``: a table with two lines per NPU -- ``| NPU  Name | Health | Power(W)
  Temp(C) Hugepages-Usage(page) |`` and ``| Chip [Device] | Bus-Id | AICore(%)
  Memory-Usage(MB) [HBM-Usage(MB)] |`` -- then a process section headed ``Process id``.
  Health is one of OK, Warning, Alarm, Critical, UNKNOWN ("该设备不存在或未启动": the
  device does not exist or has not started; a device watched since the start that shows
  UNKNOWN is lost).
* ``npu-smi info -t health -i ID -c CHIP``: ``Health Status : OK``, ``Error Code : NA``,
  ``Error Information : NA`` (npusmi_028); the codes are the black-box error codes whose
  handling Ascend's device plugin configures in ``faultCode.json`` (detect/accel.py).
* ``npu-smi info -t board -i ID``: ``Serial Number``, ``PCIe Bus Info`` (key : value).

Visible devices: ``ASCEND_VISIBLE_DEVICES`` (Ascend Docker Runtime, physical ids, ranges
allowed: ``0-3``) and ``ASCEND_RT_VISIBLE_DEVICES`` (CANN runtime: indices into those).
Link state (HCCS/RoCE, ``hccn_tool -i ID -link -g``) is not read yet.

Where the DCMI library loads (``--dcmi-library``, sources/dcmi.py), health and error
codes come from ``dcmi_get_device_health`` / ``dcmi_get_device_errorcode_v2`` instead of
a ``npu-smi info -t health`` process per NPU (a failing call falls back to npu-smi); the
table (telemetry, bus ids) still comes from ``npu-smi info``. Every parser is linear in
its input and ignores what it does not recognise.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence

from ftagent.model import GpuDevice
from ftagent.sources.dcmi import Dcmi, DcmiError
from ftagent.sources.vendor_tool import (
    MAX_CODES,
    TIMED_OUT,
    BackendUnavailable,
    Sample,
    Tool,
    select_visible,
)

log = logging.getLogger("ftagent.sources.ascend")

HEALTH = {"OK": "ok", "Warning": "warning", "Alarm": "alarm", "Critical": "critical",
          "UNKNOWN": "unknown"}
_ROW1 = re.compile(r"^\s*(\d{1,4})\s+(\S[^|]{0,63}?)\s*$")
_ROW2 = re.compile(r"^\s*(\d{1,4})(?:\s+(\d{1,4}))?\s*$")
_BUS = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_USAGE = re.compile(r"(\d{1,12})\s*/\s*(\d{1,12})")
_NUM = re.compile(r"^\d{1,9}(?:\.\d{1,4})?$")
_CODE = re.compile(r"^(?:0x)?([0-9A-Fa-f]{1,9})$")
_VERSION = re.compile(r"Version:\s*(\S{1,32})")
MIB = 1 << 20


def parse_info(text: str) -> tuple[list[dict[str, object]], str]:
    """``npu-smi info`` -> (one dict per NPU: index, name, health, power, temp, bus, util,
    memory used/total MB, hbm used/total MB), driver version)."""
    rows: list[dict[str, object]] = []
    version = ""
    pending: dict[str, object] | None = None
    for line in text.splitlines():
        if "Process id" in line:
            break
        if not version and (m := _VERSION.search(line[:200])):
            version = m.group(1)
        if not line.startswith("|"):
            continue
        cells = line.strip().strip("|").split("|")
        if len(cells) < 3:
            continue
        first, mid, rest = cells[0], cells[1].strip(), cells[2].split()
        if mid in HEALTH and (m := _ROW1.match(first)):
            pending = {"index": int(m.group(1)), "name": m.group(2).strip(),
                       "health": HEALTH[mid]}
            if rest and _NUM.match(rest[0]):
                pending["power"] = float(rest[0])
            if len(rest) > 1 and _NUM.match(rest[1]):
                pending["temp"] = float(rest[1])
            continue
        if pending is not None and _ROW2.match(first):
            if _BUS.match(mid):
                pending["bus"] = mid
            if rest and rest[0].isdigit():
                pending["util"] = int(rest[0])
            usages = _USAGE.findall(cells[2])
            if usages:
                pending["mem"] = (int(usages[0][0]), int(usages[0][1]))
            if len(usages) > 1:
                pending["hbm"] = (int(usages[1][0]), int(usages[1][1]))
            rows.append(pending)
            pending = None
    return rows, version


def parse_kv(text: str) -> dict[str, str]:
    """``  Key   : value`` lines -> {key: value} (the first of each key)."""
    out: dict[str, str] = {}
    for line in text.splitlines()[:400]:
        key, sep, value = line.partition(":")
        if sep and key.strip() and key.strip() not in out:
            out[key.strip()[:64]] = value.strip()[:512]
    return out


def parse_codes(value: str) -> tuple[int, ...]:
    """``80CB8002 80E01801`` (or ``0x..``, comma-separated; ``NA``: none)."""
    out: list[int] = []
    for tok in re.split(r"[\s,;]+", value.strip())[:MAX_CODES]:
        if (m := _CODE.match(tok)) and int(m.group(1), 16):
            out.append(int(m.group(1), 16))
    return tuple(out)


def _unavailable(rc: int, out: str, err: str, tool: str) -> BackendUnavailable:
    text = (err.strip() or out.strip() or f"exit status {rc}").splitlines()[0][:200]
    if "permission" in text.lower():
        return BackendUnavailable(f"{tool}: permission denied ({text}); run as root or in "
                                  "the HwHiAiUser group")
    return BackendUnavailable(f"{tool} cannot reach the NPU driver ({text})")


class AscendBackend:
    accelerator = "ascend"

    def __init__(self, tool: Tool, dcmi: Dcmi | None = None) -> None:
        self.cmd = tool
        self.tool = tool.name
        self.dcmi = dcmi
        self._chip: dict[int, int] = {}
        self._dcmi_warned = False

    def inventory(self) -> tuple[list[GpuDevice], str]:
        rc, out, err = self.cmd.run(["info"])
        rows, version = parse_info(out) if rc == 0 else ([], "")
        if rc != 0 or not rows and "NPU" not in out:
            raise _unavailable(rc, out, err, self.tool)
        devices = []
        for r in rows:
            index = int(str(r["index"]))
            serial, bus = "", str(r.get("bus", ""))
            rc, out, _ = self.cmd.run(["info", "-t", "board", "-i", str(index)])
            if rc == 0:
                kv = parse_kv(out)
                serial = kv.get("Serial Number", "")
                bus = bus or kv.get("PCIe Bus Info", "")
            devices.append(GpuDevice(index, serial, bus, f"Ascend {r['name']}"))
            self._chip[index] = 0
        return devices, version

    def visible(self, environ: Mapping[str, str], devices: Sequence[GpuDevice]
                ) -> tuple[list[GpuDevice], str]:
        return select_visible(environ, devices, "ASCEND_VISIBLE_DEVICES",
                              "ASCEND_RT_VISIBLE_DEVICES")

    def sample(self, devices: Sequence[GpuDevice]) -> list[Sample]:
        rc, out, err = self.cmd.run(["info"])
        if rc != 0:
            raise _unavailable(rc, out, err, self.tool)
        table = {int(str(r["index"])): r for r in parse_info(out)[0]}
        samples = []
        for d in devices:
            r = table.get(d.index)
            if r is None or r["health"] == "unknown":
                samples.append(Sample(d.index, "unknown", lost=True))
                continue
            read = self._health(d.index, str(r["health"]))
            if read is None:
                continue  # no sample this poll (the query timed out)
            health, codes = read
            if health == "gone":
                samples.append(Sample(d.index, "unknown", lost=True))
                continue
            mem = r.get("hbm") or r.get("mem")
            used, total = mem if isinstance(mem, tuple) else (None, None)
            util = r.get("util")
            power, temp = r.get("power"), r.get("temp")
            samples.append(Sample(
                d.index, health, codes,
                temperature_celsius=float(temp) if isinstance(temp, float) else None,
                power_watts=float(power) if isinstance(power, float) else None,
                utilization=util / 100.0 if isinstance(util, int) else None,
                memory_used_bytes=used * MIB if used is not None else None,
                memory_total_bytes=total * MIB if total is not None else None))
        return samples

    def _health(self, index: int, table_health: str) -> tuple[str, tuple[int, ...]] | None:
        """(health, codes) of one NPU: through DCMI where loaded, else ``npu-smi info -t
        health``; health "gone" when the device no longer exists; None: no answer."""
        chip = self._chip.get(index, 0)
        if self.dcmi is not None:
            try:
                health = self.dcmi.health(index, chip)
                return health, () if health == "gone" else self.dcmi.codes(index, chip)[
                    :MAX_CODES]
            except DcmiError as e:
                if not self._dcmi_warned:
                    self._dcmi_warned = True
                    log.warning("%s; asking npu-smi instead", e)
        rc, out, _ = self.cmd.run(["info", "-t", "health", "-i", str(index), "-c", str(chip)])
        if rc == TIMED_OUT:
            return None
        if rc != 0:
            return "gone", ()
        kv = parse_kv(out)
        return HEALTH.get(kv.get("Health Status", ""), table_health), parse_codes(
            kv.get("Error Code", ""))
