"""``make gpu-check`` (ftagent/gpu_check.py): here on the simulated NVML; on a GPU machine
the same script runs the real one."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import PY


def check(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "ftagent.gpu_check", *flags], capture_output=True,
                          text=True, timeout=60)


def test_it_reports_devices_calls_events_and_metrics(tmp_path: Path) -> None:
    timeline = tmp_path / "gpus.txt"
    timeline.write_text("gpus 2\ndevice gpu=1 nvlinks=0 unsupported=nvmlDeviceGetRemappedRows\n"
                        "t=0.2s gpu=0 xid=13\n")
    r = check("--seconds", "1", "--gpu-poll-interval", "0.2", "--gpu-backend",
              f"simulated:{timeline}")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "2 GPU(s) watched:" in out and "GPU 1: NVIDIA H100 80GB HBM3" in out
    assert "compute check: passed in" in out
    assert "events registered: xid, ecc_dbe, ecc_sbe" in out
    assert "FAULT (error, process): GPU 0" in out and "Xid 13" in out
    lines = out.splitlines()
    assert any(ln.split()[2:] == ["nvmlDeviceGetRemappedRows", "not", "supported"]
               for ln in lines if ln.startswith("  GPU 1 ")), out
    assert any(ln.split()[2:] == ["nvmlDeviceGetRetiredPages", "ok"]
               for ln in lines if ln.startswith("  GPU 1 ")), out
    assert '  ftagent_gpu_xid_errors_total{UUID="GPU-00000000-0000-4000-8000-000000000000"' in out


def test_exit_1_when_nvml_cannot_be_used(tmp_path: Path) -> None:
    timeline = tmp_path / "gpus.txt"
    timeline.write_text("driver not_loaded\n")
    r = check("--seconds", "0", "--gpu-backend", f"simulated:{timeline}")
    assert r.returncode == 1 and "NVML could not be used" in r.stdout
    assert "NVMLError_DriverNotLoaded" in r.stdout


def test_a_bad_timeline_is_exit_2(tmp_path: Path) -> None:
    timeline = tmp_path / "gpus.txt"
    timeline.write_text("t=1s gpu=0 melt\n")
    r = check("--seconds", "0", "--gpu-backend", f"simulated:{timeline}")
    assert r.returncode == 2 and f"{timeline}:1:" in r.stderr


def test_the_ascend_check_on_the_simulated_npu_smi(tmp_path: Path) -> None:
    timeline = tmp_path / "npus.txt"
    timeline.write_text("devices 2\ndevice npu=1 serial=2102312NNA10N5000123\n"
                        "t=0 npu=1 fault=80CB8002 health=Critical\n")
    r = check("--seconds", "0.5", "--gpu-poll-interval", "0.2", "--accelerator", "ascend",
              "--gpu-backend", f"simulated:{timeline}")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "ascend: simulated npu-smi" in out and "driver 23.0.6; 2 device(s) watched:" in out
    assert "device 1: Ascend 910B3, serial 2102312NNA10N5000123, bus 0000:01:00.0" in out
    assert "event: device 1 vendor_code code=80CB8002 health critical" in out
    assert "FAULT (fatal, node): GPU 1 (Ascend 910B3" in out
    assert 'accelerator="ascend"' in out and 'xid="80CB8002"} 1.0' in out


def test_the_kunlunxin_check_exits_1_without_the_driver(tmp_path: Path) -> None:
    timeline = tmp_path / "xpus.txt"
    timeline.write_text("driver not_loaded\n")
    r = check("--seconds", "0", "--accelerator", "kunlunxin", "--gpu-backend",
              f"simulated:{timeline}")
    assert r.returncode == 1, r.stderr
    assert "could not be used: simulated xpu-smi" in r.stdout
    assert "cannot reach the XPU driver (xpu-smi: failed to initialize" in r.stdout


def test_it_runs_preflights_compute_check_and_names_a_device_that_computes_wrong(
        tmp_path: Path) -> None:
    timeline = tmp_path / "gpus.txt"
    timeline.write_text("gpus 2\nt=0s gpu=1 compute=wrong\n")
    r = check("--seconds", "0", "--gpu-backend", f"simulated:{timeline}")
    assert r.returncode == 0, r.stderr  # the compute check does not change the status
    assert "compute check: FAILED in" in r.stdout
    assert "device 1: compute: a 256x256 matmul of ones is wrong" in r.stdout
