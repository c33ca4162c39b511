"""The snapshot's load copies each tensor once, from the verified mapping into the state
(storage.SnapshotReader._read_in_place), with DCP's own read only as the fallback: the
values, dtypes, views and non-tensors are what DCP's read gives, and a corrupt shard is
still refused before any byte reaches the state."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from ftagent.checkpoint import layout
from ftagent.checkpoint.snapshots import Settings, Snapshotter

JOB = "job-load"


def _snap(root: str) -> Snapshotter:
    return Snapshotter(Settings(root=root, job=JOB, rank=0, world_size=1),
                       report_held=lambda steps: None, report_resumed=lambda s, src: None)


def _state(k: float) -> dict[str, object]:
    base = torch.arange(40, dtype=torch.float64).reshape(5, 8) * k
    return {"model": {"w": torch.full((3, 7), k), "half": torch.arange(5).to(torch.float16) * k,
                      "ids": torch.arange(9, dtype=torch.int64) + int(k),
                      "flag": torch.tensor([True, False, bool(k)]),
                      "empty": torch.zeros(0, 4), "scalar": torch.tensor(k),
                      "col": base[:, 3], "t": base.t(), "tail": base[2:]},
            "optim": {"state": {0: {"exp_avg": torch.ones(6) * k}},
                      "param_groups": [{"lr": 0.1 * k, "params": [0]}]},
            "step": int(k), "name": f"run-{k}"}


def _like(state: object) -> object:
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, 0) if state.numel() else torch.empty_like(state)
    if isinstance(state, dict):
        return {k: _like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_like(v) for v in state]
    return state


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def test_the_load_copies_from_the_mapping_without_dcps_read(tmp_path, monkeypatch):
    saved = _state(3.0)
    s = _snap(str(tmp_path))
    assert s.save(3, saved) and s.wait(30)

    def no(*a: object, **k: object) -> None:
        raise AssertionError("DCP's own read was used")
    monkeypatch.setattr(FileSystemReader, "read_data", no)
    target = _like(saved)
    w = target["model"]["w"]  # type: ignore[index]
    assert _snap(str(tmp_path)).load(target) == 3  # type: ignore[arg-type]
    assert target["model"]["w"] is w  # type: ignore[index]
    assert _same(target, saved), target


def test_a_record_it_cannot_place_falls_back_to_dcps_read(tmp_path, monkeypatch):
    saved = _state(2.0)
    s = _snap(str(tmp_path))
    assert s.save(2, saved) and s.wait(30)
    real = torch.load

    def no_offset(*a: object, **k: object) -> object:
        got = real(*a, **k)
        if k.get("map_location") == "meta":
            got.untyped_storage()._checkpoint_offset = None
        return got
    monkeypatch.setattr(torch, "load", no_offset)
    target = _like(saved)
    assert _snap(str(tmp_path)).load(target) == 2  # type: ignore[arg-type]
    assert _same(target, saved)


def test_a_corrupt_shard_leaves_the_state_untouched(tmp_path):
    saved = _state(5.0)
    s = _snap(str(tmp_path))
    assert s.save(5, saved) and s.wait(30)
    d = layout.step_dir(str(tmp_path), JOB, 0, 5)
    data = os.path.join(d, "__0_0.distcp")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:  # one byte in the middle flipped, the size unchanged
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    target = _like(saved)
    before = _like(saved)
    assert _snap(str(tmp_path)).load(target) is None  # type: ignore[arg-type]
    assert _same(target, before)


@pytest.mark.parametrize("gib", [0.03])
def test_a_larger_state_of_many_tensors_loads_exactly(tmp_path, gib):
    n = int(gib * (1 << 30) / 4 / 8)
    saved = {f"p{i}": torch.randn(n) for i in range(8)}
    s = _snap(str(tmp_path))
    assert s.save(1, saved) and s.wait(60)
    target = {k: torch.empty_like(v) for k, v in saved.items()}
    assert _snap(str(tmp_path)).load(target) == 1
    assert all(torch.equal(target[k], saved[k]) for k in saved)
