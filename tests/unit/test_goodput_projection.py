"""bench/goodput_projection.py: a pure model; its arithmetic and its overrides."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import goodput_projection as gp  # noqa: E402


def test_one_strategy_by_hand() -> None:
    s = gp.Strategy("x", detect_crash=2, detect_hang=102, decide=3, restart_in_place=10,
                    restart_new_node=110)
    i = gp.Inputs(gpus=1000, interruptions=86.4, days=1, reference_gpus=1000,
                  hardware_share=0.5, hang_share=0.5, checkpoint_interval=100,
                  checkpoint_save=0, checkpoint_load=5, strategies=(s,))
    # detect 52 + decide 3 + restart 60 + recompute 50 + load 5 = 170 s per fault
    assert gp.per_fault(i, s) == pytest.approx(170.0)
    (r,) = gp.project(i)
    assert r.interruptions_per_day == pytest.approx(86.4)
    assert r.lost_to_faults == pytest.approx(86.4 / gp.DAY * 170)
    assert r.ettr == pytest.approx(1 - 86.4 / gp.DAY * 170)
    # twice the GPUs, twice the interruptions
    assert gp.project(gp.with_overrides(i, ["gpus=2000"]))[0].interruptions_per_day == \
        pytest.approx(172.8)


def test_faster_recovery_never_projects_less_and_bad_input_is_refused() -> None:
    i = gp.Inputs()
    by = {r.strategy: r.ettr for r in gp.project(i)}
    assert by["ftagent"] >= by["torchrun --max-restarts"] >= by["scheduler recreates the job"]
    slower = gp.with_overrides(i, ["ftagent.detect_hang=6000"])
    assert gp.project(slower)[0].ettr < by["ftagent"]
    for bad in (["nope=1"], ["ftagent.name=1"], ["ftagent.detect_hang"], ["x.decide=1"]):
        with pytest.raises(ValueError):
            gp.with_overrides(i, bad)


def test_the_output_says_it_is_a_projection_and_prints_its_inputs() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "goodput_projection.py"),
                        "--json"], capture_output=True, text=True, timeout=30)
    out = json.loads(r.stdout)
    assert out["projection"] is True and out["inputs"]["gpus"] == 16384
    assert len(out["results"]) == 3
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "goodput_projection.py")],
                       capture_output=True, text=True, timeout=30)
    assert r.stdout.startswith("PROJECTION") and "ASSUMPTIONS" in r.stdout
