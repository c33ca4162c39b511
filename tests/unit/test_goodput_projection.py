"""bench/goodput_projection.py: a pure model; its arithmetic and its overrides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


GOODPUT = {"bench": "goodput", "runs": [
    {"launcher": "ftagent", "faults": [{"kind": "crash", "back": 1.0},
                                       {"kind": "hang", "back": 4.0},
                                       {"kind": "xid", "back": 3.0}]},
    {"launcher": "ftagent-snapshots", "faults": [{"kind": "crash", "back": 2.0},
                                                 {"kind": "hang", "back": 5.0},
                                                 {"kind": "xid", "back": 9.0},
                                                 {"kind": "xid", "back": None}]}]}
SNAPSHOT = {"bench": "snapshot", "gib": 1.0, "methods": [
    {"method": "ftagent", "blocking": 0.5, "resume": 2.0},
    {"method": "dcp-async", "blocking": 0.9, "resume": 1.5}]}


def test_measured_costs_replace_ftagents_assumptions_and_add_a_snapshot_strategy() -> None:
    i = gp.from_measurements(gp.Inputs(), GOODPUT, SNAPSHOT, "a.json, b.json")
    by = {s.name: s for s in i.strategies}
    disk, snap = by["ftagent"], by["ftagent + snapshots"]
    assert (disk.restart_in_place, disk.detect_hang, disk.restart_new_node) == (1.0, 3.0, 3.0)
    assert disk.detect_crash == disk.decide == 0.0 and disk.snapshot_blocking is None
    assert (snap.restart_in_place, snap.detect_hang, snap.restart_new_node) == (2.0, 3.0, 9.0)
    assert (snap.snapshot_blocking, snap.snapshot_load) == (0.5, 2.0)
    assert by["torchrun --max-restarts"] == gp.Inputs().strategies[1]  # untouched
    # the interval: Young's optimum, never under the budget's floor (0.5 s / 1 % = 50 s)
    rate = gp.rate_per_second(i)
    iv = gp.snapshot_interval(i, snap)
    assert iv == pytest.approx(max(50.0, (2 * 0.5 / rate) ** 0.5))
    assert gp.save_share(i, snap) <= 0.01
    cost = 0.1 * 3.0 + 0.59 * 9.0 + 0.41 * 2.0 + iv / 2 + 2.0
    assert gp.per_fault(i, snap) == pytest.approx(cost)
    r = {x.strategy: x.ettr for x in gp.project(i)}
    assert r["ftagent + snapshots"] > r["ftagent"]
    with pytest.raises(ValueError):
        gp.from_measurements(gp.Inputs(), GOODPUT, {"bench": "snapshot", "methods": []})


def test_the_measured_projection_reads_the_benches_json_files(tmp_path: Path) -> None:
    a, b = tmp_path / "goodput.json", tmp_path / "snapshot.json"
    a.write_text(json.dumps(GOODPUT))
    b.write_text(json.dumps(SNAPSHOT))
    assert gp.main(["--from", str(a), "--from", str(b)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"bench": "other"}')
    assert gp.main(["--from", str(bad)]) == 2


def test_set_reaches_the_snapshot_strategy_by_its_whole_name() -> None:
    i = gp.from_measurements(gp.Inputs(), GOODPUT, SNAPSHOT)
    j = gp.with_overrides(i, ["ftagent+snapshots.restart_new_node=69"])
    by = {s.name: s for s in j.strategies}
    assert by["ftagent + snapshots"].restart_new_node == 69.0
    assert by["ftagent"].restart_new_node == 3.0  # the first word still means ftagent's
