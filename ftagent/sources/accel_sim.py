"""Simulated ``npu-smi`` and ``xpu-smi``: real processes that print what the real tools
print, driven by an ``accel_script`` timeline, so the backends parse real output.

Run as ``python -m ftagent.sources.accel_sim TOOL TIMELINE T0 RANK [tool args...]``:
``T0`` is the wall-clock time (``time.time()``) the timeline starts at. The backends
build this command line for ``--gpu-backend simulated:FILE`` (``accel.tool_command``);
a test may equally put a two-line shell script named ``npu-smi`` on ``PATH``.

Output formats, and where they come from:

* ``npu-smi info``: the table of Huawei's npu-smi reference ("查询基本信息", npusmi_007,
  Atlas 200I A2 23.0.RC3 and 25.2.0 editions), with the ``HBM-Usage(MB)`` column the
  Atlas 800T A2 (910B) prints; the ``Process id`` section after it.
* ``npu-smi info -t health -i ID -c CHIP``: "查询指定芯片健康状态" (npusmi_028):
  ``Health Status``, ``Error Code``, ``Error Information`` as ``key : value`` lines.
  Several codes on one line are separated by spaces (inferred: the reference shows NA).
* ``npu-smi info -t board -i ID``: ``key : value`` lines; only ``Serial Number`` and
  ``PCIe Bus Info`` are read (inferred from the board query's field list).
* ``xpu-smi -m``: one line per device, whitespace-separated; the fields public parsers
  read are placed where they read them (SwanLab's kunlunxin collector: [1] device id,
  [4] temperature C, [8] power W, [17] memory used MiB, [18] total MiB, [19] utilisation
  %, [21]-[22] the model in parentheses; FlagPerf's Kunlunxin toolkit: awk ``$19`` total
  memory). [0] the PCI bus id and [3] the state letter are inferred.
* ``xpu-smi -q -i ID``: ``key : value`` lines like nvidia-smi's ``-q``; ``Driver
  Version`` is documented by SwanLab's parser, the health and ECC keys are inferred.

Error behaviour (the exit status and first line are inferred from field reports, not a
vendor document): driver not loaded -- npu-smi prints ``dcmi module initialize failed.
ret is -8005`` and exits 255, xpu-smi ``xpu-smi: failed to initialize the XPU driver``
and exits 1; no permission -- ``Permission denied`` (stderr), exit 1; a device id the
tool does not have -- ``device id N is invalid`` (stderr), exit 1; a lost device -- its
table row shows Health ``UNKNOWN`` (npu-smi: "该设备不存在或未启动") and its own queries
fail like a missing device.
"""

from __future__ import annotations

import sys
import time

from ftagent.sources.accel_script import DeviceState, Timeline, load

_ASCEND_BUS = "0000:{:02X}:00.0"
_BUSES = (0xC1, 0x01, 0x41, 0x81, 0xC2, 0x02, 0x42, 0x82)


def _bus(d: DeviceState) -> str:
    return d.bus or _ASCEND_BUS.format(_BUSES[d.index % 8] + d.index // 8)


def npu_info(devs: list[DeviceState]) -> str:
    bar = "+" + "-" * 27 + "+" + "-" * 15 + "+" + "-" * 52 + "+"
    dbl = "+" + "=" * 27 + "+" + "=" * 15 + "+" + "=" * 52 + "+"
    out = ["+" + "-" * 96 + "+",
           "| npu-smi 23.0.6                   Version: 23.0.6".ljust(97) + "|",
           bar,
           "| NPU   Name                | Health        | Power(W)    Temp(C)           "
           "Hugepages-Usage(page)|",
           "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  "
           "HBM-Usage(MB)        |",
           dbl]
    for d in devs:
        name = d.name or "910B3"
        if d.lost:
            out.append(f"| {d.index:<5} {name:<19} | {'UNKNOWN':<13} | "
                       f"{'NA':<11} {'NA':<17} {'NA':<21}|")
            out.append(f"| {0:<25} | {'NA':<13} | {'NA':<11} {'NA':<17} {'NA':<21}|")
        else:
            out.append(f"| {d.index:<5} {name:<19} | {d.health:<13} | {d.power:<11.1f} "
                       f"{d.temp:<17} {'0    / 0':<21}|")
            out.append(f"| {0:<25} | {_bus(d):<13} | {d.util:<11} {'0    / 0':<17} "
                       f"{f'{d.mem_used} / {d.memory_total}':<21}|")
        out.append(dbl)
    out += [bar, "| NPU     Chip              | Process id    | Process name             | "
                 "Process memory(MB)      |", dbl]
    for d in devs:
        out.append(f"| No running processes found in NPU {d.index}".ljust(97) + "|")
        out.append(dbl)
    return "\n".join(out) + "\n"


def npu_health(d: DeviceState) -> str:
    codes = " ".join(f"{c:08X}" for c in d.codes) or "NA"
    info = "NA" if not d.codes else "node type=AICORE, sensor type=Error, event state=fault"
    return (f"        {'Health Status':<31}: {d.health}\n"
            f"        {'Error Code':<31}: {codes}\n"
            f"        {'Error Information':<31}: {info}\n")


def npu_board(d: DeviceState) -> str:
    rows = [("NPU ID", str(d.index)), ("Software Version", "23.0.6"),
            ("Firmware Version", "7.1.0.5.220"), ("Board ID", "0x02"),
            ("PCIe Bus Info", _bus(d)), ("Serial Number", d.serial), ("Chip Count", "1")]
    return "".join(f"        {k:<31}: {v}\n" for k, v in rows)


def xpu_m(devs: list[DeviceState]) -> str:
    out = []
    for d in devs:
        if d.lost:
            continue  # a device that fell off the bus is not listed
        name = (d.name or "P800 OAM").split()
        model = f"({name[0]} {name[1] if len(name) > 1 else 'XPU'})"
        fields = [_bus(d), str(d.index), "0", "N" if d.health == "OK" else "F", str(d.temp),
                  "0", "0", "0", str(int(d.power)), "0", "0", "0", "0", "0", "0", "0", "0",
                  str(d.mem_used), str(d.memory_total), str(d.util), "0", *model.split()]
        out.append(" ".join(fields))
    return "\n".join(out) + "\n"


def xpu_q(d: DeviceState) -> str:
    health = {"OK": "Healthy", "Warning": "Warning"}.get(d.health, "Fault")
    rows = [("Driver Version", "5.0.21.26"), ("Product Name", d.name or "P800 OAM"),
            ("Serial Number", d.serial), ("Bus Id", _bus(d)), ("Health", health),
            ("Error Code", " ".join(f"0x{c:X}" for c in d.codes) or "N/A"),
            ("ECC Uncorrectable", str(d.ecc_uncorrected)),
            ("ECC Correctable", str(d.ecc_corrected))]
    return f"XPU {d.index}\n" + "".join(f"    {k:<25}: {v}\n" for k, v in rows)


def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) \
        else None


def run(tool: str, tl: Timeline, now: float, rank: int, args: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``tool args`` at ``now`` (seconds from the start)."""
    if tl.driver == "permission":
        return 1, "", "Permission denied\n"
    if tl.driver == "not_loaded":
        if tool == "npu-smi":
            return 255, "dcmi module initialize failed. ret is -8005\n", ""
        return 1, "", "xpu-smi: failed to initialize the XPU driver\n"
    devs = tl.state(now, rank)
    if tool == "npu-smi":
        if args == ["info"]:
            return 0, npu_info(devs), ""
        kind, dev = _arg(args, "-t"), _arg(args, "-i")
        if args[:1] == ["info"] and kind in ("health", "board") and dev is not None:
            if not dev.isdigit() or int(dev) >= len(devs) or devs[int(dev)].lost:
                return 1, "", f"device id {dev} is invalid\n"
            d = devs[int(dev)]
            return 0, npu_health(d) if kind == "health" else npu_board(d), ""
        return 1, "", f"npu-smi: unsupported arguments {' '.join(args)}\n"
    if args == ["-m"]:
        return 0, xpu_m(devs), ""
    dev = _arg(args, "-i")
    if args[:1] == ["-q"] and dev is not None:
        if not dev.isdigit() or int(dev) >= len(devs) or devs[int(dev)].lost:
            return 1, "", f"device id {dev} is invalid\n"
        return 0, xpu_q(devs[int(dev)]), ""
    return 1, "", f"xpu-smi: unsupported arguments {' '.join(args)}\n"


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] not in ("npu-smi", "xpu-smi"):
        sys.stderr.write("usage: accel_sim npu-smi|xpu-smi TIMELINE T0 RANK [args...]\n")
        return 2
    tool, path, t0, rank = argv[0], argv[1], float(argv[2]), int(argv[3])
    tl = load(path)
    now = time.time() - t0
    dev = _arg(argv[4:], "-i")
    devs = tl.state(now, rank)
    if dev is not None and dev.isdigit() and int(dev) < len(devs) and devs[int(dev)].hung:
        time.sleep(3600)  # a tool stuck on a sick device: the caller's timeout ends it
    rc, out, err = run(tool, tl, now, rank, argv[4:])
    sys.stdout.write(out)
    sys.stderr.write(err)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
