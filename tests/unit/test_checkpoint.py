"""ftagent.checkpoint: in-memory snapshots written with DCP, verified before loading.

Real torch, real DCP, real files (a temporary directory stands in for tmpfs); one process,
no process group (the multi-rank paths run in tests/integration/test_snapshot_restart.py).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ftagent import checkpoint, sdk
from ftagent.checkpoint import layout, persist
from ftagent.checkpoint.snapshots import Settings, Snapshotter, stage
from ftagent.checkpoint.storage import SnapshotReader

JOB = "job-a"


def _state(seed: float = 1.0) -> dict[str, object]:
    return {"model": {"w": torch.full((4, 3), seed), "b": torch.arange(3.0) * seed},
            "step": int(seed), "meta": {"lr": 0.1 * seed}}


def _zeros() -> dict[str, object]:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "step": 0,
            "meta": {"lr": 0.0}}


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _snap(root: str, rank: int = 0, world: int = 1, **kw: object) -> Snapshotter:
    held: list[list[int]] = []
    resumed: list[tuple[int, str]] = []
    s = Snapshotter(Settings(root=root, job=JOB, rank=rank, world_size=world, **kw),  # type: ignore[arg-type]
                    report_held=held.append,
                    report_resumed=lambda step, src: resumed.append((step, src)))
    s.held_reports, s.resumed_reports = held, resumed  # type: ignore[attr-defined]
    return s


def test_save_then_load_fills_the_state_in_place_and_says_the_step(tmp_path):
    s = _snap(str(tmp_path))
    assert s.save(7, _state(7.0))
    assert s.wait(30)
    target = _zeros()
    w = target["model"]["w"]  # type: ignore[index]
    assert _snap(str(tmp_path)).load(target) == 7
    assert target["model"]["w"] is w and torch.equal(w, torch.full((4, 3), 7.0))
    assert target["step"] == 7 and target["meta"] == {"lr": pytest.approx(0.7)}
    assert s.held_reports[-1] == [7]  # type: ignore[attr-defined]


def test_the_staged_copy_is_taken_before_save_returns(tmp_path):
    s = _snap(str(tmp_path))
    st = _state(1.0)
    assert s.save(1, st)
    st["model"]["w"].add_(100.0)  # type: ignore[index]  # training goes on
    s.wait(30)
    target = _zeros()
    assert _snap(str(tmp_path)).load(target) == 1
    assert torch.equal(target["model"]["w"], torch.full((4, 3), 1.0))  # type: ignore[index]


def test_stage_reuses_its_buffers():
    a = stage(_state(1.0))
    buf = a["model"]["w"]
    b = stage(_state(2.0), a)
    assert b["model"]["w"] is buf and torch.equal(buf, torch.full((4, 3), 2.0))


def test_newest_kept_and_older_ones_dropped_by_retention(tmp_path):
    s = _snap(str(tmp_path), keep=2)
    for step in (1, 2, 3):
        assert s.save(step, _state(float(step)))
        s.wait(30)
    assert layout.steps_in(s.my_dir) == [2, 3]
    target = _zeros()
    assert _snap(str(tmp_path)).load(target) == 3


@pytest.mark.parametrize("damage", ["no_marker", "truncated", "corrupt", "foreign_job",
                                    "foreign_step", "missing_file", "garbage_marker"])
def test_a_damaged_newest_shard_is_refused_and_the_load_says_why(tmp_path, damage, capsys):
    s = _snap(str(tmp_path), keep=3)
    for step in (1, 2):
        s.save(step, _state(float(step)))
        s.wait(30)
    d = layout.step_dir(str(tmp_path), JOB, 0, 2)
    data = next(n for n in os.listdir(d) if n.endswith(".distcp"))
    mpath = os.path.join(d, layout.MARKER)
    with open(mpath) as f:
        m = json.loads(f.read())
    if damage == "no_marker":
        os.remove(mpath)
    elif damage == "truncated":
        with open(os.path.join(d, data), "r+b") as f:
            f.truncate(10)
    elif damage == "corrupt":
        with open(os.path.join(d, data), "r+b") as f:
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 0xFF]))
    elif damage in ("foreign_job", "foreign_step"):
        m["job" if damage == "foreign_job" else "step"] = "other" if damage == "foreign_job" else 9
        _write(mpath, json.dumps(m))
    elif damage == "missing_file":
        os.remove(os.path.join(d, data))
    else:
        _write(mpath, "{not json")
    target = _zeros()
    loader = _snap(str(tmp_path), resume_step=2)  # the arbiter names step 2
    assert loader.load(target) is None  # never the damaged one; no disk rung configured
    assert torch.equal(target["model"]["w"], torch.zeros(4, 3))  # type: ignore[index]
    why = " ".join(loader.last_load[2])
    assert "memory: step 2" in why and "peer: no replica" in why
    # without the arbiter's step the newest complete one every rank holds is taken
    if damage in ("no_marker", "foreign_job", "foreign_step", "garbage_marker"):
        assert _snap(str(tmp_path)).load(_zeros()) == 1


def test_a_state_of_another_shape_is_refused(tmp_path):
    s = _snap(str(tmp_path))
    s.save(5, _state(5.0))
    s.wait(30)
    target = {"model": {"w": torch.zeros(8, 3), "b": torch.zeros(3)}, "step": 0,
              "meta": {"lr": 0.0}}
    loader = _snap(str(tmp_path))
    assert loader.load(target) is None
    assert "does not fit the state" in " ".join(loader.last_load[2])
    assert torch.equal(target["model"]["w"], torch.zeros(8, 3))


def test_a_half_written_shard_is_never_listed_and_is_cleared(tmp_path):
    s = _snap(str(tmp_path))
    s.save(1, _state(1.0))
    s.wait(30)
    tmp = os.path.join(s.my_dir, ".step-2.999999.tmp")  # a dead writer's leftover
    os.makedirs(tmp)
    _write(os.path.join(tmp, "__0_0.distcp"), "partial")
    assert s.held() == [1]
    s.save(3, _state(3.0))
    s.wait(30)
    assert not os.path.exists(tmp) and s.held() == [1, 3]


def test_completeness_needs_every_rank_of_the_step(tmp_path):
    r0, r1 = _snap(str(tmp_path), 0, 2), _snap(str(tmp_path), 1, 2)
    for step in (10, 20):
        r0.save(step, _state(float(step)))
        r0.wait(30)
    r1.save(10, _state(10.0))
    r1.wait(30)  # rank 1 died before its step 20 was complete
    target = _zeros()
    assert _snap(str(tmp_path), 0, 2).load(target) == 10
    assert r0.held() == [10]  # step 20 was another timeline's: dropped at the load


def test_load_reports_the_step_and_its_source(tmp_path):
    s = _snap(str(tmp_path))
    s.save(4, _state(4.0))
    s.wait(30)
    loader = _snap(str(tmp_path))
    loader.load(_zeros())
    assert loader.resumed_reports == [(4, "memory")]  # type: ignore[attr-defined]


def test_memory_cap_keeps_fewer_and_says_so_once(tmp_path, capsys):
    s = _snap(str(tmp_path), keep=5, max_bytes=1)
    s.save(1, _state(1.0))
    s.wait(30)
    assert s.held() == []  # larger than the cap: not kept
    s2 = _snap(str(tmp_path / "b"), keep=5)
    s2.save(1, _state(1.0))
    s2.wait(30)
    nbytes = s2.stats.last_bytes
    s3 = _snap(str(tmp_path / "c"), keep=5, max_bytes=int(nbytes * 2.5))
    for step in (1, 2, 3, 4):
        s3.save(step, _state(float(step)))
        s3.wait(30)
    assert s3.held() == [3, 4]
    err = capsys.readouterr().err
    assert "larger than the snapshot memory cap" in err
    assert err.count("reached: keeping") == 1 and "keeping 2 snapshot(s) instead of 5" in err


def test_the_agent_persists_every_nth_and_plain_dcp_loads_it(tmp_path):
    from ftagent.checkpoint.persister import BackgroundPersist, due
    from ftagent.model import SnapshotsHeld
    durable = str(tmp_path / "durable")
    s = _snap(str(tmp_path / "mem"), keep=2)
    bp = BackgroundPersist(str(tmp_path / "mem"), JOB, lambda: 0, durable, every=2,
                           seconds=0.0, keep=2)
    for step in range(1, 9):
        s.save(step, _state(float(step)))
        s.wait(30)
        bp.observe(SnapshotsHeld(tuple(s.held()), ts=0.0))
        bp.wait(30)
    assert [p for p, _ in bp.persisted] == [2, 4, 6, 8]  # every 2nd
    assert persist.complete_steps(durable, JOB, 0) == [6, 8]  # the newest 2 kept
    target = _zeros()
    dcp.load(target, checkpoint_id=persist.rank_dir(durable, 8, 0))  # no ftagent involved
    assert torch.equal(target["model"]["w"], torch.full((4, 3), 8.0))  # type: ignore[index]
    # the disk rung: memory gone (a new node)
    fresh = _zeros()
    loader = _snap(str(tmp_path / "empty"), durable=durable)
    assert loader.load(fresh) == 8 and loader.last_load[1] == "disk"
    # the rule: by count, by time, never without a new one
    assert due(2, 0.0, every=2, seconds=0.0) and not due(1, 5.0, every=2, seconds=0.0)
    assert due(1, 5.0, every=0, seconds=5.0) and not due(0, 99.0, every=1, seconds=1.0)


def test_a_torn_memory_shard_is_not_persisted_and_the_last_persisted_stays(tmp_path):
    from ftagent.checkpoint.persister import BackgroundPersist
    from ftagent.model import SnapshotsHeld
    durable = str(tmp_path / "durable")
    s = _snap(str(tmp_path / "mem"), keep=3)
    bp = BackgroundPersist(str(tmp_path / "mem"), JOB, lambda: 0, durable, every=1,
                           seconds=0.0)
    s.save(1, _state(1.0))
    s.wait(30)
    bp.observe(SnapshotsHeld((1,), ts=0.0))
    bp.wait(30)
    s.save(2, _state(2.0))
    s.wait(30)
    d = layout.step_dir(str(tmp_path / "mem"), JOB, 0, 2)
    data = next(n for n in os.listdir(d) if n.endswith(".distcp"))
    with open(os.path.join(d, data), "r+b") as f:
        f.truncate(5)
    bp.observe(SnapshotsHeld((1, 2), ts=0.0))
    bp.wait(30)
    assert persist.complete_steps(durable, JOB, 0) == [1]


def test_reader_refuses_before_dcp_reads(tmp_path):
    s = _snap(str(tmp_path))
    s.save(2, _state(2.0))
    s.wait(30)
    d = layout.step_dir(str(tmp_path), JOB, 0, 2)
    with pytest.raises(layout.SnapshotRejected, match="foreign snapshot"):
        SnapshotReader(d, job="other", rank=0, step=2).read_metadata()
    target = _zeros()
    with pytest.raises(CheckpointException, match="foreign snapshot"):
        dcp.load(target, storage_reader=SnapshotReader(d, job="other", rank=0, step=2))
    assert torch.equal(target["model"]["w"], torch.zeros(4, 3))  # type: ignore[index]


def test_plain_dcp_without_the_agent(tmp_path, monkeypatch):
    monkeypatch.delenv("FTAGENT_SNAPSHOT_DIR", raising=False)
    assert checkpoint.load(_zeros(), checkpoint_dir=str(tmp_path)) is None
    checkpoint.save(3, _state(3.0), checkpoint_dir=str(tmp_path))
    checkpoint.save(5, _state(5.0), checkpoint_dir=str(tmp_path))
    target = _zeros()
    assert checkpoint.load(target, checkpoint_dir=str(tmp_path)) == 5
    assert torch.equal(target["model"]["w"], torch.full((4, 3), 5.0))  # type: ignore[index]
    with pytest.raises(ValueError, match="checkpoint_dir"):
        checkpoint.save(1, _state())


def test_module_interface_under_the_agent(tmp_path, monkeypatch):
    monkeypatch.setenv("FTAGENT_SNAPSHOT_DIR", str(tmp_path))
    monkeypatch.setenv("FTAGENT_JOB", JOB)
    monkeypatch.delenv("FTAGENT_RESUME_STEP", raising=False)
    assert checkpoint.load(_zeros()) is None
    assert checkpoint.save(11, _state(11.0)) is True
    assert checkpoint.wait(30)
    target = _zeros()
    assert checkpoint.load(target) == 11
    assert os.path.isfile(os.path.join(layout.step_dir(str(tmp_path), JOB, 0, 11), layout.MARKER))


def test_sdk_datagrams_for_snapshots_parse(monkeypatch):
    from ftagent.model import Resumed, SnapshotsHeld
    from ftagent.sources.sdk_socket import check_datagram
    pid = str(os.getpid()).encode()
    assert check_datagram(b"v1 " + pid + b" k 2 10 20 4096", 1.0) == \
        SnapshotsHeld((10, 20), 1.0, 4096)
    assert check_datagram(b"v1 " + pid + b" k 0 0", 1.0) == SnapshotsHeld((), 1.0)
    assert isinstance(check_datagram(b"v1 " + pid + b" k 3 10 20 5", 1.0), str)
    assert isinstance(check_datagram(b"v1 " + pid + b" k 2 10 20", 1.0), str)
    assert isinstance(check_datagram(b"v1 " + pid + b" k 9 " + b" ".join([b"1"] * 10), 1.0),
                      str)
    assert isinstance(check_datagram(b"v1 " + pid + b" k 1 -5 0", 1.0), str)
    r = check_datagram(b"v1 " + pid + b" r 30 memory", 1.0)
    assert r == Resumed(30, "sdk", 1.0, "memory")
    assert isinstance(check_datagram(b"v1 " + pid + b" r 30 tape", 1.0), str)
    assert check_datagram(b"v1 " + pid + b" r 30", 1.0) == Resumed(30, "sdk", 1.0)
    assert sdk.MAX_SNAPSHOTS_HELD == 8 and sys.version_info >= (3, 10)


def test_two_snapshots_racing_the_second_is_skipped_and_said_once(tmp_path, capsys):
    import concurrent.futures
    s = _snap(str(tmp_path))
    busy: concurrent.futures.Future[None] = concurrent.futures.Future()
    s._inflight = busy  # the previous snapshot still being written
    assert s.save(1, _state(1.0)) is False and s.save(2, _state(2.0)) is False
    assert s.stats.skipped == 2
    assert capsys.readouterr().err.count("still being written") == 1
    busy.set_result(None)
    assert s.save(3, _state(3.0)) is True
    s.wait(30)
    assert s.held() == [3]


def test_the_interval_follows_the_blocking_budget(tmp_path):
    from ftagent.checkpoint.snapshots import interval_due
    # unknown costs: snapshot (to measure); 10 ms blocking, 0.1 s steps, 1 %: every 10 steps
    assert interval_due(1, None, 0.0, 0.01)
    assert not interval_due(9, 0.1, 0.01, 0.01) and interval_due(10, 0.1, 0.01, 0.01)
    assert interval_due(1, 0.1, 5.0, 0.0)  # no budget: every call
    s = _snap(str(tmp_path), budget=0.01)
    s.stats.last_blocking_seconds = 1.0  # as measured: 1 s per save
    s._step_seconds = 0.5  # and 0.5 s steps: due every 200 steps
    s._last_step = 0
    assert s.save(100, _state(1.0)) is False and s.stats.saves == 0
    s._seen, s._step_seconds = None, 0.5  # (the calls' own timing is the real run's)
    assert s.save(200, _state(2.0)) is True
    s.wait(30)
    assert s.held() == [200]


def test_bad_budget_env_is_ignored_in_one_line(capsys):
    assert Settings.from_env({"FTAGENT_SNAPSHOT_BUDGET": "nan"}).budget == 0.0
    assert Settings.from_env({"FTAGENT_SNAPSHOT_BUDGET": "0.02"}).budget == 0.02
    assert "not a share" in capsys.readouterr().err


def test_a_full_tmpfs_fails_the_snapshot_not_the_training(tmp_path, capsys):
    """A real tmpfs of 1 MiB: a snapshot that does not fit is not written (said once), the
    space it took is freed, the complete one before it stays and loads."""
    import subprocess
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        s = _snap(str(mnt), keep=2)
        assert s.save(1, _state(1.0))  # small: fits
        s.wait(30)
        big = {"model": {"w": torch.zeros(1 << 19), "b": torch.zeros(3)}, "step": 2,
               "meta": {"lr": 0.0}}  # 2 MiB
        assert s.save(2, big) is True  # the copy is taken; the write fails behind it
        s.wait(30)
        assert s.save(3, big) is True
        s.wait(30)
        err = capsys.readouterr().err
        assert err.count("snapshot of step") == 1 and "not written" in err, err
        assert s.held() == [1]
        assert not [n for n in os.listdir(s.my_dir) if n.endswith(".tmp")]
        target = _zeros()
        assert _snap(str(mnt)).load(target) == 1
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_the_load_reads_the_shard_once_and_dcp_loads_the_verified_bytes(tmp_path):
    # one pass: once check() has read and verified the files, DCP loads from those bytes;
    # the files may be gone (the old reader read them a second time and failed here)
    s = _snap(str(tmp_path))
    assert s.save(3, _state(3.0)) and s.wait(30)
    d = layout.step_dir(str(tmp_path), JOB, 0, 3)
    target = _zeros()
    reader = SnapshotReader(d, job=JOB, rank=0, step=3, fingerprint=layout.fingerprint(target))
    reader.check()
    for name in os.listdir(d):
        os.remove(os.path.join(d, name))
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["model"]["w"], torch.full((4, 3), 3.0))  # type: ignore[index]
    assert reader.fs.held == {}  # type: ignore[attr-defined]  # released after the load


@pytest.mark.parametrize("change", ["flip", "shorter", "longer"])
def test_map_checked_refuses_bytes_that_are_not_the_markers(tmp_path, change):
    p = tmp_path / "f"
    data = bytes(range(256)) * 9000  # > one chunk
    p.write_bytes(data)
    crc = layout.crc_of(str(p))
    assert bytes(layout.map_checked(str(p), len(data), crc)) == data
    if change == "flip":
        p.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif change == "shorter":
        p.write_bytes(data[:-1])
    else:
        p.write_bytes(data + b"x")
    with pytest.raises(layout.SnapshotRejected, match="corrupt" if change == "flip"
                       else "truncated"):
        layout.map_checked(str(p), len(data), crc)


def test_a_shard_corrupted_after_its_sizes_were_checked_is_refused_whole(tmp_path):
    # same size, one flipped byte: the one-pass read refuses it before DCP fills anything
    s = _snap(str(tmp_path))
    assert s.save(2, _state(2.0)) and s.wait(30)
    d = layout.step_dir(str(tmp_path), JOB, 0, 2)
    data = os.path.join(d, "__0_0.distcp")
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    target = _zeros()
    with pytest.raises(layout.SnapshotRejected, match="corrupt"):
        SnapshotReader(d, job=JOB, rank=0, step=2).check()
    assert _snap(str(tmp_path)).load(target) is None
    assert torch.equal(target["model"]["w"], torch.zeros(4, 3))  # type: ignore[index]
