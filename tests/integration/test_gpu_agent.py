"""``ftagent run`` and the GPU flags: a bad timeline is exit 2 naming the line; no driver or
no GPU is one line and the trainer runs as if nothing were watched."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, ftagent_cmd

TRAINER = ["-c", "print('step=1 loss=1.0'); print('done')"]


def run(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ftagent_cmd(*flags, cmd=[PY, *TRAINER]), capture_output=True,
                          text=True, timeout=60)


def test_a_malformed_timeline_is_one_line_naming_the_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "gpus.txt"
    bad.write_text("gpus 2\nt=2s gpu=1 xid=79\nt=5s gpu=0 ecc_dbe+=one\n")
    r = run("--gpu-backend", f"simulated:{bad}")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"{bad}:3: ecc_dbe=one is not a number: 't=5s gpu=0 ecc_dbe+=one'" in r.stderr
    assert run("--gpu-backend", "simulated:/nonexistent").returncode == 2


@pytest.mark.parametrize(("flags", "words"), [
    (["--gpu-backend", "simulated"], "--gpu-backend: 'simulated' is not auto, nvml"),
    (["--gpu-xid-action", "79=reboot"], "--gpu-xid-action: '79=reboot' is not XID=ACTION"),
    (["--gpu-poll-interval", "0"], "--gpu-poll-interval: '0' must be in [0.05"),
])
def test_bad_gpu_flags(flags: list[str], words: str) -> None:
    r = run(*flags)
    assert r.returncode == 2 and words in r.stderr, r.stderr


@pytest.mark.parametrize("timeline", ["driver missing\n", "driver not_loaded\n"])
def test_no_driver_is_one_line_and_training_goes_on(tmp_path: Path, timeline: str) -> None:
    sim = tmp_path / "gpus.txt"
    sim.write_text(timeline)
    r = run("--gpu-backend", f"simulated:{sim}")
    assert r.returncode == 0 and r.stdout == "step=1 loss=1.0\ndone\n"
    off = [ln for ln in r.stderr.splitlines() if "GPU watch off" in ln]
    assert len(off) == 1 and "the agent carries on" in off[0], r.stderr


def test_this_machine_without_a_gpu_under_auto() -> None:
    r = run()  # --gpu-backend auto: no NVML library here (or no GPU): one line, carry on
    assert r.returncode == 0 and r.stdout == "step=1 loss=1.0\ndone\n"
    assert len([ln for ln in r.stderr.splitlines() if "GPU watch off" in ln]) <= 1
    assert "Traceback" not in r.stderr
