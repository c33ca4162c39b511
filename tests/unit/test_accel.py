"""Ascend / Kunlunxin: the parsers of the vendor tools' output, visible devices, the
vendor classification and its flood behaviour, the simulated tools' error behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftagent.config import GpuConfig
from ftagent.detect.accel import AccelDetector
from ftagent.detect.gpu import GpuAction
from ftagent.model import FaultKind, GpuDevice, GpuEvent, Scope, Severity
from ftagent.sources import accel_sim
from ftagent.sources.accel import detect, pick
from ftagent.sources.accel_script import ScriptError, parse
from ftagent.sources.ascend import parse_codes, parse_info, parse_kv
from ftagent.sources.kunlunxin import parse_m
from ftagent.sources.vendor_tool import parse_id_list, select_visible

# npu-smi info as Huawei's reference prints it for an Atlas 200I A2 (npusmi_007,
# 23.0.RC3; a second NPU added in Alarm): a 310B1 with the "Chip Device" second line
# and no HBM column.
DOC_310B = (Path(__file__).parent.parent / "fixtures" / "npu-smi-info-310b1.txt"
            ).read_text()


def test_npu_smi_info_reference_table() -> None:
    rows, version = parse_info(DOC_310B)
    assert version == "23.0.rc3"
    assert [(r["index"], r["name"], r["health"]) for r in rows] == [
        (0, "310B1", "ok"), (1, "310B1", "alarm")]
    assert rows[0]["power"] == 10.4 and rows[0]["temp"] == 66.0
    assert rows[0]["mem"] == (957, 10810) and "bus" not in rows[0]  # NA
    assert rows[1]["bus"] == "0000:12:00.0" and rows[1]["util"] == 7


def test_npu_smi_info_910b_with_hbm_and_lost_device() -> None:
    devs = parse("devices 2\nt=0 npu=1 lost\n").state(1.0)
    rows, _ = parse_info(accel_sim.npu_info(devs))
    assert rows[0]["hbm"] == (3395, 65536) and rows[0]["bus"] == "0000:C1:00.0"
    assert rows[1]["health"] == "unknown" and "bus" not in rows[1]


def test_health_query_and_codes() -> None:
    kv = parse_kv("        Health Status                  : OK\n"
                  "        Error Code                     : NA\n"
                  "        Error Information              : NA\n")
    assert kv["Health Status"] == "OK" and parse_codes(kv["Error Code"]) == ()
    assert parse_codes("80CB8002 0x80E01801,8C084E00") == (0x80CB8002, 0x80E01801, 0x8C084E00)
    assert parse_codes("x" * 100_000) == ()  # bounded, linear


def test_xpu_smi_m_fields() -> None:
    devs = parse("devices 2\nt=0 xpu=0 temp=61 power=250 util=87 mem_used=40000\n"
                 "t=0 xpu=1 lost\n").state(1.0)
    table = parse_m(accel_sim.xpu_m(devs) + "garbage line\n")
    assert list(table) == [0]  # the lost device is not listed
    r = table[0]
    assert (r["temp"], r["power"], r["util"], r["mem_used"], r["mem_total"]) == (
        61.0, 250.0, 87, 40000, 65536)
    assert r["model"] == "P800 OAM" and r["bus"] == "0000:C1:00.0"


def _devs(n: int) -> list[GpuDevice]:
    return [GpuDevice(i, f"S{i}", f"0000:{i:02x}:00.0", "Ascend 910B3") for i in range(n)]


@pytest.mark.parametrize(("env", "want"), [
    ({}, [0, 1, 2, 3, 4, 5, 6, 7]),
    ({"ASCEND_VISIBLE_DEVICES": "2-3,6"}, [2, 3, 6]),
    ({"ASCEND_VISIBLE_DEVICES": "2-3,6", "ASCEND_RT_VISIBLE_DEVICES": "1,2"}, [3, 6]),
    ({"ASCEND_RT_VISIBLE_DEVICES": "5,x,1"}, [5]),  # read up to the first bad entry
    ({"ASCEND_RT_VISIBLE_DEVICES": ""}, []),
])
def test_ascend_visible_devices(env: dict[str, str], want: list[int]) -> None:
    chosen, _ = select_visible(env, _devs(8), "ASCEND_VISIBLE_DEVICES",
                               "ASCEND_RT_VISIBLE_DEVICES")
    assert [d.index for d in chosen] == want


def test_visible_in_a_container_is_already_filtered() -> None:
    # the runtime mounted NPUs 4 and 5: the tool shows two devices, numbered 0 and 1
    chosen, why = select_visible({"ASCEND_VISIBLE_DEVICES": "4,5"}, _devs(2),
                                 "ASCEND_VISIBLE_DEVICES", None)
    assert [d.index for d in chosen] == [0, 1] and "ASCEND_VISIBLE_DEVICES=4,5" in why


def test_id_lists_are_bounded() -> None:
    assert parse_id_list("0-3,7") == [0, 1, 2, 3, 7]
    assert parse_id_list("0-99999999") is None and parse_id_list("3-1") is None


def test_auto_detection() -> None:
    none: dict[str, str] = {}
    assert detect(none, which=lambda t: None, devices=lambda g: []) == "nvidia"
    assert detect(none, which=lambda t: "/usr/local/bin/npu-smi" if t == "npu-smi" else None,
                  devices=lambda g: []) == "ascend"
    assert detect(none, which=lambda t: None,
                  devices=lambda g: ["/dev/xpu0"] if "xpu" in g else []) == "kunlunxin"
    # an explicit choice wins; the NVML simulator's timeline stays NVIDIA's under auto
    assert pick(GpuConfig(accelerator="ascend"), none) == "ascend"
    assert pick(GpuConfig(gpu_backend="simulated:/x"), none) == "nvidia"


def _ev(kind: str, code: int | None, ts: float, health: str = "OK", gpu: int = 0,
        count: int = 1) -> GpuEvent:
    return GpuEvent(gpu, kind, xid=code, detail=f"health {health}", ts=ts, source="poll",
                    count=count)


def test_ascend_classification() -> None:
    d = AccelDetector("ascend")
    # SeparateNPU (faultCode.json) -> replace the node
    [f] = d.observe(_ev("vendor_code", 0x80CB8002, 1.0, "Critical"))
    assert f.kind is FaultKind.GPU and f.severity is Severity.FATAL and f.scope is Scope.NODE
    assert "80CB8002" in f.message and f.evidence["action"] == "replace_node"
    # RestartBusiness -> restart in place
    [f] = d.observe(_ev("vendor_code", 0x8C084E00, 1.0, "Alarm", gpu=1))
    assert f.severity is Severity.ERROR and f.evidence["action"] == "restart"
    # NotHandleFault -> counted, no fault
    assert d.observe(_ev("vendor_code", 0x80E21007, 1.0, "Warning")) == []
    assert d.xid_counts()[(0, 0x80E21007)] == 1
    # unknown code: by the health level it came with
    [f] = d.observe(_ev("vendor_code", 0x81AB0001, 1.0, "Critical", gpu=2))
    assert f.evidence["action"] == "reset_gpu" and f.scope is Scope.POD
    [f] = d.observe(_ev("vendor_code", 0x81AB0002, 1.0, "Alarm", gpu=3))
    assert f.evidence["action"] == "restart"
    assert not d.healthy(0) and d.healthy(1)


def test_override_and_lost() -> None:
    d = AccelDetector("kunlunxin", overrides={0x80CB8002: GpuAction.IGNORE})
    assert d.observe(_ev("vendor_code", 0x80CB8002, 1.0, "Critical")) == []
    [f] = d.observe(GpuEvent(1, "lost", ts=2.0, source="poll"))
    assert f.scope is Scope.NODE and "kunlunxin device is lost" in f.message
    [f] = d.observe(_ev("vendor_health", 2, 3.0, gpu=2))  # Fault with no code
    assert f.evidence["action"] == "reset_gpu"


def test_a_flood_of_one_code_is_one_fault() -> None:
    d = AccelDetector("ascend")
    faults = []
    for i in range(10_000):
        faults += d.observe(_ev("vendor_code", 0x80CB8002, 1.0 + i * 0.001, "Critical"))
    assert len(faults) == 1
    assert d.xid_counts() == {(0, 0x80CB8002): 10_000}


def test_simulated_tools_fail_like_the_real_ones() -> None:
    ok = parse("devices 2\nt=1s npu=1 lost\n")
    assert accel_sim.run("npu-smi", ok, 0.5, 0, ["info", "-t", "health", "-i", "1", "-c",
                                                  "0"])[0] == 0
    rc, _, err = accel_sim.run("npu-smi", ok, 1.5, 0, ["info", "-t", "health", "-i", "1",
                                                        "-c", "0"])
    assert rc == 1 and "invalid" in err  # lost: its own query fails
    assert accel_sim.run("npu-smi", ok, 0.5, 0, ["info", "-t", "health", "-i", "7"])[0] == 1
    rc, out, _ = accel_sim.run("npu-smi", parse("driver not_loaded\n"), 0, 0, ["info"])
    assert rc == 255 and "dcmi module initialize failed" in out
    rc, _, err = accel_sim.run("xpu-smi", parse("driver permission\n"), 0, 0, ["-m"])
    assert rc == 1 and "Permission denied" in err


@pytest.mark.parametrize(("text", "where"), [
    ("t=1s fault=80CB8002\n", "name one device"),
    ("t=1s npu=0 fault=zz\n", "not a hexadecimal"),
    ("t=1s npu=0 health=Sad\n", "not one of"),
    ("bogus\n", "is not devices"),
    ("devices 999\n", "up to 64"),
])
def test_bad_timelines(text: str, where: str) -> None:
    with pytest.raises(ScriptError, match=where) as e:
        parse("# header\n" + text, "tl.txt")
    assert "tl.txt:2:" in str(e.value)
