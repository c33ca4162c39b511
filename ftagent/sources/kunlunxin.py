"""Kunlunxin XPUs (R200/R300/P800) through ``xpu-smi``.

Kunlunxin publishes no reference for xpu-smi's output that we could find; what is read is
what public parsers read, and the rest is marked inferred (docs/accelerators.md lists
both, to be checked on a Kunlunxin node):

* ``xpu-smi -m``: one whitespace-separated line per device. Documented by use: field [1]
  the device id, [4] temperature (C), [8] power (W), [17] memory used (MiB), [18] memory
  total (MiB), [19] utilisation (%), [21]-[22] the model in parentheses (SwanLab's
  ``kunlunxin.py`` collector; FlagPerf's Kunlunxin toolkit reads ``$19``, the total).
  Inferred: [0] the PCI bus id, [3] a state letter. A device that is no longer listed is
  lost.
* ``xpu-smi -q -i ID``: ``key : value`` lines like nvidia-smi ``-q`` (``Driver Version``
  documented by SwanLab's parser; ``Serial Number``, ``Health``, ``Error Code``, ``ECC
  Uncorrectable`` / ``ECC Correctable`` inferred).

Visible devices: ``XPU_VISIBLE_DEVICES`` (the Kunlunxin runtime, like
``CUDA_VISIBLE_DEVICES``: indices into what the tool shows); the device plugin's
``KUNLUNXIN_VISIBLE_DEVICES`` is not read (not confirmed). The XPU management library
(``libxpuml``) is not bound: no public header or binding was found.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ftagent.model import GpuDevice
from ftagent.sources.ascend import MIB, parse_codes, parse_kv
from ftagent.sources.vendor_tool import (
    TIMED_OUT,
    BackendUnavailable,
    Sample,
    Tool,
    select_visible,
)

_BUS = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
HEALTH = {"Healthy": "ok", "Warning": "warning", "Fault": "critical"}


def parse_m(text: str) -> dict[int, dict[str, object]]:
    """``xpu-smi -m`` -> {device id: fields}; lines that do not fit are skipped."""
    out: dict[int, dict[str, object]] = {}
    for line in text.splitlines()[:1024]:
        f = line[:1024].split()
        if len(f) < 23 or not f[1].isdigit() or len(f[1]) > 4:
            continue
        nums = [f[i] for i in (4, 8, 17, 18, 19)]
        if not all(n.isdigit() and len(n) <= 12 for n in nums):
            continue
        model = (f[21].lstrip("(") + " " + f[22].rstrip(")")).strip()
        out[int(f[1])] = {
            "bus": f[0] if _BUS.match(f[0]) else "", "state": f[3][:8],
            "temp": float(nums[0]), "power": float(nums[1]), "mem_used": int(nums[2]),
            "mem_total": int(nums[3]), "util": int(nums[4]), "model": model[:64]}
    return out


def _unavailable(rc: int, out: str, err: str, tool: str) -> BackendUnavailable:
    text = (err.strip() or out.strip() or f"exit status {rc}").splitlines()[0][:200]
    if "permission" in text.lower():
        return BackendUnavailable(f"{tool}: permission denied ({text})")
    return BackendUnavailable(f"{tool} cannot reach the XPU driver ({text})")


class KunlunxinBackend:
    accelerator = "kunlunxin"

    def __init__(self, tool: Tool) -> None:
        self.cmd = tool
        self.tool = tool.name

    def inventory(self) -> tuple[list[GpuDevice], str]:
        rc, out, err = self.cmd.run(["-m"])
        if rc != 0:
            raise _unavailable(rc, out, err, self.tool)
        devices, driver = [], ""
        for index, r in sorted(parse_m(out).items()):
            serial = ""
            rc, q, _ = self.cmd.run(["-q", "-i", str(index)])
            if rc == 0:
                kv = parse_kv(q)
                serial, driver = kv.get("Serial Number", ""), driver or kv.get(
                    "Driver Version", "")
            devices.append(GpuDevice(index, serial, str(r["bus"]), f"Kunlunxin {r['model']}"))
        return devices, driver

    def visible(self, environ: Mapping[str, str], devices: Sequence[GpuDevice]
                ) -> tuple[list[GpuDevice], str]:
        return select_visible(environ, devices, None, "XPU_VISIBLE_DEVICES")

    def sample(self, devices: Sequence[GpuDevice]) -> list[Sample]:
        rc, out, err = self.cmd.run(["-m"])
        if rc != 0:
            raise _unavailable(rc, out, err, self.tool)
        table = parse_m(out)
        samples = []
        for d in devices:
            r = table.get(d.index)
            rc, q, _ = self.cmd.run(["-q", "-i", str(d.index)]) if r else (1, "", "")
            if rc == TIMED_OUT:
                continue  # no sample this poll
            if r is None or rc != 0:
                samples.append(Sample(d.index, "unknown", lost=True))
                continue
            kv = parse_kv(q)
            unc, cor = kv.get("ECC Uncorrectable", ""), kv.get("ECC Correctable", "")
            samples.append(Sample(
                d.index, HEALTH.get(kv.get("Health", ""), "ok"),
                parse_codes(kv.get("Error Code", "")),
                temperature_celsius=float(str(r["temp"])), power_watts=float(str(r["power"])),
                utilization=int(str(r["util"])) / 100.0,
                memory_used_bytes=int(str(r["mem_used"])) * MIB,
                memory_total_bytes=int(str(r["mem_total"])) * MIB,
                ecc_uncorrected=int(unc) if unc.isdigit() and len(unc) < 13 else None,
                ecc_corrected=int(cor) if cor.isdigit() and len(cor) < 13 else None))
        return samples
