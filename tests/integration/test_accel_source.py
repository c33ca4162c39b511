"""The vendor source (sources/accel.py) with the Ascend and Kunlunxin backends running the
simulated ``npu-smi`` / ``xpu-smi`` as real processes: what the backends parse is the
tools' printed output. The simulated tool reads its timeline at every call, so a test
moves time on by rewriting the file (every line at ``t=0``): no sleeps.

And ``ftagent run --accelerator``: a bad timeline is exit 2 naming the line; a missing
tool, an unloaded driver or no permission is one line and the trainer runs untouched."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ftagent.config import GpuConfig
from ftagent.detect.accel import AccelDetector, code_label
from ftagent.metrics import GpuCollector
from ftagent.model import Scope, Severity
from ftagent.sources.accel import VendorSource, make_backend
from ftagent.sources.vendor_tool import BackendUnavailable, Tool
from tests.conftest import PY, ftagent_cmd

LABELS = {"job_name": "j", "namespace": "", "pod": "p", "node": "n", "rank": "0"}


def source(tmp_path: Path, accelerator: str, text: str,
           environ: dict[str, str] | None = None) -> tuple[VendorSource, Path]:
    tl = tmp_path / "tl.txt"
    tl.write_text(text)
    cfg = GpuConfig(accelerator=accelerator, gpu_backend=f"simulated:{tl}")
    return VendorSource(cfg, environ or {}, make_backend(accelerator, cfg)), tl


def metrics(src: VendorSource, det: AccelDetector) -> str:
    reg = CollectorRegistry()
    reg.register(GpuCollector(LABELS, src.readings, det.xid_counts, det.healthy,
                              lambda: dict(src.event_counts), accelerator=src.accelerator,
                              code_label=code_label(src.accelerator)))
    return generate_latest(reg).decode()


def test_ascend_inventory_poll_fault_and_lost(tmp_path: Path) -> None:
    base = "devices 2\ndevice npu=1 serial=2102312NNA10N5000123 name=910B3\n"
    src, tl = source(tmp_path, "ascend", base, {"ASCEND_RT_VISIBLE_DEVICES": "1"})
    det = AccelDetector("ascend", devices=src.device)
    assert src.start() and src.driver == "23.0.6"
    (w,) = src.gpus
    assert (w.dev.index, w.dev.uuid, w.dev.pci_bus_id, w.dev.name) == (
        1, "2102312NNA10N5000123", "0000:01:00.0", "Ascend 910B3")
    assert src.poll() == []
    (r,) = src.readings()
    assert (r.temperature_celsius, r.power_watts, r.memory_total_bytes) == (40.0, 90.0,
                                                                           65536 << 20)
    tl.write_text(base + "t=0 npu=1 fault=80CB8002 health=Critical temp=88\n")
    (ev,) = src.poll()
    assert (ev.kind, ev.xid, ev.detail) == ("vendor_code", 0x80CB8002, "health critical")
    (fault,) = det.observe(ev)
    assert fault.severity is Severity.FATAL and fault.scope is Scope.NODE
    assert "Ascend 910B3" in fault.message and "80CB8002" in fault.message
    assert src.poll() == []  # the code is still raised: not a new occurrence
    text = metrics(src, det)
    assert 'ftagent_gpu_xid_errors_total{UUID="2102312NNA10N5000123",accelerator="ascend"' \
        in text and 'xid="80CB8002"} 1.0' in text
    assert 'ftagent_gpu_temperature_celsius{UUID="2102312NNA10N5000123",accelerator=' \
        '"ascend",gpu="1"' in text
    assert [ln for ln in text.splitlines() if ln.startswith("ftagent_gpu_healthy{")][0] \
        .endswith(" 0.0")
    tl.write_text(base + "t=0 npu=1 lost\n")
    (lost,) = src.poll()
    assert lost.kind == "lost" and src.gpus[0].lost and src.poll() == []
    assert src.readings()[0].lost


def test_kunlunxin_ecc_and_a_device_that_falls_off(tmp_path: Path) -> None:
    base = "devices 2\n"
    src, tl = source(tmp_path, "kunlunxin", base)
    det = AccelDetector("kunlunxin", devices=src.device)
    assert src.start() and src.driver == "5.0.21.26"
    assert [g.dev.name for g in src.gpus] == ["Kunlunxin P800 OAM"] * 2
    assert src.poll() == []
    tl.write_text(base + "t=0 xpu=0 ecc_uncorrected+=2 util=75\n")
    (ev,) = src.poll()
    assert (ev.gpu, ev.kind, ev.count) == (0, "ecc_dbe", 2)
    (fault,) = det.observe(ev)
    assert fault.scope is Scope.NODE
    assert src.readings()[0].utilization == 0.75
    tl.write_text(base + "t=0 xpu=0 ecc_uncorrected+=2\nt=0 xpu=1 lost\n")
    (lost,) = src.poll()
    assert (lost.gpu, lost.kind) == (1, "lost")


@pytest.mark.parametrize(("accelerator", "driver", "words"), [
    ("ascend", "not_loaded", "cannot reach the NPU driver (dcmi module initialize failed"),
    ("ascend", "permission", "permission denied (Permission denied)"),
    ("kunlunxin", "not_loaded", "cannot reach the XPU driver"),
])
def test_no_driver_or_no_permission_turns_the_source_off(
        tmp_path: Path, accelerator: str, driver: str, words: str,
        caplog: pytest.LogCaptureFixture) -> None:
    src, _ = source(tmp_path, accelerator, f"driver {driver}\n")
    with caplog.at_level(logging.INFO, "ftagent.sources.accel"):
        assert not src.start()
    assert words in src.off_reason
    assert len([r for r in caplog.records if "watch off" in r.message]) == 1


def test_a_missing_tool_is_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match="not installed"):
        Tool(["/nonexistent/npu-smi"], "npu-smi").run(["info"])


TRAINER = ["-c", "print('step=1 loss=1.0'); print('done')"]


def run(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ftagent_cmd(*flags, cmd=[PY, *TRAINER]), capture_output=True,
                          text=True, timeout=60, env=env)


def test_run_with_a_bad_timeline_is_exit_2_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "npus.txt"
    bad.write_text("devices 2\nt=1s npu=0 fault=80CB8002\nt=2s npu=0 health=Sad\n")
    r = run("--accelerator", "ascend", "--gpu-backend", f"simulated:{bad}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{bad}:3: health=Sad is not one of OK" in r.stderr


@pytest.mark.parametrize("accelerator", ["ascend", "kunlunxin"])
def test_run_without_the_vendor_tool_says_so_once_and_trains(accelerator: str) -> None:
    env = {**os.environ, "PATH": os.path.dirname(PY), "FTAGENT_ACCELERATOR": accelerator}
    r = run(env=env)
    assert r.returncode == 0 and r.stdout == "step=1 loss=1.0\ndone\n", r.stderr
    off = [ln for ln in r.stderr.splitlines() if f"{accelerator} watch off" in ln]
    assert len(off) == 1 and "is not installed" in off[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_tool_process_is_kept_out_of_the_trainers_tree() -> None:
    """The agent stops its trainer by signalling every descendant it has (supervisor.tree):
    a vendor tool running at that moment must not be one of them. (Before ``hide``, a
    restart in place SIGTERMed a running npu-smi: 'exit status -15' in the drill.)"""
    from ftagent.agent import supervisor

    seen: list[tuple[int, list[int]]] = []

    def hide(pid: int) -> None:
        supervisor.hide_from_tree(pid)
        seen.append((pid, supervisor.tree_pids()))

    tool = Tool(["sh", "-c", "sleep 0.2; echo ok"], "sh", hide=hide,
                show=supervisor.show_in_tree)
    assert tool.run([]) == (0, "ok\n", "")
    ((pid, tree),) = seen
    assert pid not in tree
    assert pid not in supervisor._hidden  # shown again once it exited


def test_a_hung_tool_call_is_no_sample_not_a_lost_device(tmp_path: Path) -> None:
    """npu-smi stuck on one NPU: that device has no sample this poll (no event), the other
    is read; only the tool saying the device is gone makes it lost."""
    from ftagent.sources.ascend import AscendBackend

    tl = tmp_path / "tl.txt"
    tl.write_text("devices 2\n")
    cfg = GpuConfig(accelerator="ascend", gpu_backend=f"simulated:{tl}")
    backend = make_backend("ascend", cfg)
    assert isinstance(backend, AscendBackend)
    backend.cmd.timeout = 1.5
    src = VendorSource(cfg, {}, backend)
    assert src.start()
    tl.write_text("devices 2\nt=0 npu=1 hang\n")
    assert src.poll() == [] and not src.gpus[1].lost
    assert [s.index for s in backend.sample([w.dev for w in src.gpus])] == [0]


@pytest.fixture(scope="module")
def fake_dcmi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/fixtures/fake_dcmi.c built into a shared library (needs a C compiler)."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (make deps installs gcc)")
    out = tmp_path_factory.mktemp("dcmi") / "libdcmi.so"
    src = Path(__file__).parent.parent / "fixtures" / "fake_dcmi.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(src)], check=True,
                   timeout=60)
    return out


def test_ascend_health_and_codes_through_the_dcmi_library(
        tmp_path: Path, fake_dcmi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the library loaded, health and codes are the library's (the simulated npu-smi
    says nothing wrong: what is raised can only have come from DCMI); a chip the library
    says does not exist is lost; a call that fails falls back to npu-smi."""
    state = tmp_path / "dcmi-state"
    state.write_text("0 0 0\n1 0 0\n")
    monkeypatch.setenv("FAKE_DCMI_STATE", str(state))
    tl = tmp_path / "tl.txt"
    tl.write_text("devices 2\n")
    cfg = GpuConfig(accelerator="ascend", gpu_backend=f"simulated:{tl}",
                    dcmi_library=str(fake_dcmi))
    from ftagent.sources.ascend import AscendBackend

    backend = make_backend("ascend", cfg)
    assert isinstance(backend, AscendBackend) and backend.dcmi is not None
    src = VendorSource(cfg, {}, backend)
    det = AccelDetector("ascend", devices=src.device)
    assert src.start() and src.poll() == []
    runs = backend.cmd.runs
    state.write_text("0 0 3 80CB8002 8C084E00\n1 0 0\n")
    events = src.poll()
    assert [(e.gpu, e.kind, e.xid) for e in events] == [
        (0, "vendor_code", 0x80CB8002), (0, "vendor_code", 0x8C084E00)]
    assert events[0].detail == "health critical"
    assert backend.cmd.runs == runs + 1  # the npu-smi table only: no health processes
    assert [f.evidence["action"] for e in events for f in det.observe(e)] == [
        "replace_node", "restart"]
    state.write_text("0 0 3 80CB8002 8C084E00\n1 0 4294967295\n")
    (lost,) = src.poll()
    assert (lost.gpu, lost.kind) == (1, "lost")
    state.write_text("")  # every call fails (-8005): npu-smi answers, nothing is lost
    assert src.poll() == [] and not src.gpus[0].lost


def test_a_dcmi_library_that_does_not_init_leaves_npu_smi(
        tmp_path: Path, fake_dcmi: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from ftagent.sources.ascend import AscendBackend

    monkeypatch.setenv("FAKE_DCMI_INIT_RC", "-8005")
    tl = tmp_path / "tl.txt"
    tl.write_text("devices 1\n")
    cfg = GpuConfig(accelerator="ascend", gpu_backend=f"simulated:{tl}",
                    dcmi_library=str(fake_dcmi))
    with caplog.at_level(logging.INFO, "ftagent.sources.accel"):
        backend = make_backend("ascend", cfg)
    assert isinstance(backend, AscendBackend) and backend.dcmi is None
    assert any("dcmi_init returned -8005" in r.message for r in caplog.records)
