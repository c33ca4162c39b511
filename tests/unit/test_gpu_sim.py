"""The simulated NVML (sources/gpu_sim.py) and its timeline (gpu_script.py): it must fail
the way pynvml fails, with pynvml's own classes from the same calls."""

from __future__ import annotations

import pynvml
import pytest

from ftagent.sources.gpu_script import ScriptError, parse
from ftagent.sources.gpu_sim import SimulatedNvml

TIMELINE = """\
gpus 2
device gpu=1 pci=0000:3b:00.0 name="NVIDIA A100-SXM4-80GB" nvlinks=0 \
unsupported=nvmlDeviceGetRemappedRows,NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
t=1s gpu=1 xid=79            # comment
t=2s rank=1 gpu=0 xid=13 via=nvml
t=500ms gpu=0 ecc_dbe+=2
t=3s gpu=0 remap_pending=1 remap_uncorrected+=1 throttle=hw_thermal,sw_power_cap
t=3s gpu=0 nvlink=2 down recovery=node_reboot temp=91 power=700 util=100 mem_used=60GiB
t=4s gpu=1 lost
t=4s kmsg nvidia-nvswitch0: SXid (PCI:0000:83:00.0): 12028, Non-fatal, Link 44
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sim(text: str = TIMELINE, rank: int = 0) -> tuple[SimulatedNvml, Clock]:
    clock = Clock()
    return SimulatedNvml(parse(text, "t.txt"), rank=rank, clock=clock), clock


@pytest.mark.parametrize(("text", "where"), [
    ("t=2s gpu=0 xid=abc", "t.txt:1: xid=abc is not a number"),
    ("gpus 1\n\nt=2s gpu=0 explode=1", "t.txt:3: 'explode=1' is not a known event"),
    ("t=2x gpu=0 lost", "t.txt:1: t=2x is not a time"),
    ("t=1s xid=79", "t.txt:1: gpu=N is missing"),
    ("gpus 1\nt=1s gpu=3 lost", "t.txt:2: gpu=3 but there are 1 GPUs"),
    ("t=1s gpu=0 throttle=hot", "t.txt:1: throttle 'hot'"),
    ("t=1s kmsg", "t.txt:1: kmsg needs"),
    ("reboot now", "t.txt:1: 'reboot' is not"),
    ("driver maybe", "t.txt:1: driver must be"),
    ("device gpu=0 pci=3b", "t.txt:1: pci=3b is not a PCI bus id"),
])
def test_a_malformed_timeline_names_the_line(text: str, where: str) -> None:
    with pytest.raises(ScriptError) as e:
        parse(text, "t.txt")
    assert str(e.value).startswith(where), str(e.value)
    assert "\n" not in str(e.value)


def test_calls_before_init_and_without_a_driver_raise_what_nvml_raises() -> None:
    nvml, _ = sim()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    for driver, cls in (("missing", pynvml.NVMLError_LibraryNotFound),
                        ("not_loaded", pynvml.NVMLError_DriverNotLoaded)):
        with pytest.raises(cls):
            sim(f"driver {driver}")[0].nvmlInit()


def test_devices_look_like_nvml_s() -> None:
    nvml, _ = sim()
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 2
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    assert isinstance(h, pynvml.c_nvmlDevice_t)
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA A100-SXM4-80GB"
    pci = nvml.nvmlDeviceGetPciInfo(h)
    assert isinstance(pci, pynvml.nvmlPciInfo_t) and pci.busId == "00000000:3B:00.0"
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetRemappedRows(h)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetNvLinkState(h, 0)  # no NVLink on this one
    h0 = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetNvLinkState(h0, 18)  # past its last link
    fv = nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    assert fv[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_the_timeline_plays_as_calls_come() -> None:
    nvml, clock = sim()
    nvml.nvmlInit()
    es = nvml.nvmlEventSetCreate()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1)]
    for h in handles:
        nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlDeviceGetSupportedEventTypes(h), es)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.nvmlEventSetWait_v2(es, 0)
    clock.now += 1.0  # t=1s: the DBEs (t=0.5s) and the Xid 79, in time order
    got = [nvml.nvmlEventSetWait_v2(es, 0) for _ in range(3)]
    assert all(isinstance(d, pynvml.c_nvmlEventData_t) for d in got)
    assert [d.eventType for d in got] == [pynvml.nvmlEventTypeDoubleBitEccError] * 2 + [
        pynvml.nvmlEventTypeXidCriticalError]
    assert got[2].eventData == 79
    assert pynvml.nvmlDeviceGetUUID is not None  # (the real module has the same names)
    with pytest.raises(pynvml.NVMLError_Timeout):  # rank 1's Xid 13 is not ours
        nvml.nvmlEventSetWait_v2(es, 0)
    assert nvml.nvmlDeviceGetTotalEccErrors(
        handles[0], pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC) == 2
    clock.now += 2.0  # t=3s
    h0 = handles[0]
    assert nvml.nvmlDeviceGetRemappedRows(h0) == (0, 1, 1, 0)
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h0) == 0x44
    assert nvml.nvmlDeviceGetNvLinkState(h0, 2) == 0 and nvml.nvmlDeviceGetNvLinkState(h0, 1)
    assert nvml.nvmlDeviceGetTemperature(h0, pynvml.NVML_TEMPERATURE_GPU) == 91
    assert nvml.nvmlDeviceGetPowerUsage(h0) == 700_000  # milliwatts, as NVML's
    assert nvml.nvmlDeviceGetMemoryInfo(h0).used == 60 << 30
    fv = nvml.nvmlDeviceGetFieldValues(h0, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    assert fv[0].nvmlReturn == 0 and fv[0].value.uiVal == 2
    assert nvml.nvmlEventSetWait_v2(es, 0).eventType == pynvml.nvmlEventTypeGpuRecoveryAction
    clock.now += 1.0  # t=4s: GPU 1 is lost, for every call
    for call in (lambda: nvml.nvmlDeviceGetName(handles[1]),
                 lambda: nvml.nvmlDeviceGetHandleByIndex(1),
                 lambda: nvml.nvmlDeviceGetTemperature(handles[1], 0)):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert nvml.nvmlDeviceGetName(h0)  # the other GPU is fine
    nvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlEventSetWait_v2(es, 0)


def test_kernel_log_lines_of_the_timeline() -> None:
    nvml, _ = sim(rank=1)
    lines = nvml.kmsg_lines()
    assert lines[0] == (1.0, "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, "
                             "GPU has fallen off the bus")
    assert [t for t, _ in lines] == [1.0, 4.0]  # rank 1's Xid 13 was via=nvml only
    assert "SXid" in lines[1][1]


def test_mig_devices() -> None:
    nvml, _ = sim("device gpu=0 mig=MIG-aaaa,MIG-bbbb")
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(h) == [1, 1]
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 1)) == "MIG-bbbb"
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 2)
