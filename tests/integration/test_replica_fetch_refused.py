"""A replaced pod's fetch from a holder that answers wrongly: over real TCP on loopback, a
holder that holds the job's key (a peer of the job, not an outsider) but sends a shard of
another job, another rank, fewer bytes than its marker says, bytes its marker's checksum
does not cover, or nothing at all (a stalled channel). Each time the fetch refuses it,
nothing is left in the pod's memory root, the agent says why, and the trainer's
``checkpoint.load`` passes the peer rung saying that reason and goes on to disk, where
the last persisted checkpoint is still loaded."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ftagent.checkpoint import layout, persist, replica, replica_agent
from ftagent.checkpoint import replica_protocol as rp
from ftagent.checkpoint.settings import Settings
from ftagent.checkpoint.snapshots import Snapshotter

JOB = "job-f"
KEY = rp.replica_key("the-job-token", JOB)

Serve = Callable[[socket.socket, layout.Marker, str, rp.Transcript], None]


def _state(v: float) -> dict[str, object]:
    return {"w": torch.full((32, 32), v)}


def _snap(root: str, rank: int, job: str = JOB, durable: str = "") -> Snapshotter:
    return Snapshotter(Settings(root=root, job=job, rank=rank, world_size=2, durable=durable),
                       report_held=lambda s: None, report_resumed=lambda s, src: None)


def _saved(root: str, step: int, rank: int, job: str = JOB) -> str:
    s = _snap(root, rank, job)
    assert s.save(step, _state(float(step))) and s.wait(30)
    s.close()
    return layout.step_dir(root, job, rank, step)


@pytest.fixture
def bad_holder(tmp_path: Path) -> Iterator[Callable[[Serve, str], tuple[str, int]]]:
    """A holder with the job's key whose answer to a fetch is ``serve``'s, for a shard
    made under ``src`` (its marker and directory)."""
    servers: list[socket.socket] = []

    def start(serve: Serve, shard: str) -> tuple[str, int]:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        servers.append(srv)
        marker = layout.read_marker(shard)

        def run() -> None:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                f = conn.makefile("rb")
                h = rp.parse_hello(f.readline(), job=JOB)
                sn = "2" * 32
                conn.sendall(rp.challenge(KEY, h.nonce, sn))
                rp.check_response(f.readline(), KEY, h.nonce, sn)
                serve(conn, marker, shard, rp.Transcript(KEY, h.nonce, sn))
        threading.Thread(target=run, daemon=True).start()
        return srv.getsockname()[:2]
    yield start
    for s in servers:
        s.close()


def _send(conn: socket.socket, marker: layout.Marker, shard: str, t: rp.Transcript,
          cut: int | None = None, flip: bool = False) -> None:
    line = rp.offer(marker)
    t.update(line)
    conn.sendall(line)
    for name in sorted(marker.files):
        with open(os.path.join(shard, name), "rb") as g:
            data = bytearray(g.read())
        if flip and data:
            data[len(data) // 2] ^= 0xFF
        if cut is not None:
            conn.sendall(bytes(data[:cut]))
            return  # ... and the holder's side ends
        t.update(bytes(data))
        conn.sendall(bytes(data))
    conn.sendall(t.digest())


def _another_job(tmp: Path) -> str:
    return _saved(str(tmp / "other"), 5, 1, job="job-other")


def _another_rank(tmp: Path) -> str:
    return _saved(str(tmp / "other"), 5, 0)


def _lying_size(tmp: Path) -> str:
    d = _saved(str(tmp / "other"), 5, 1)
    m = layout.read_marker(d)
    name = sorted(m.files)[-1]
    size, crc = m.files[name]
    files = {**m.files, name: (size + 4096, crc)}  # says more bytes than it sends
    layout.write_marker(d, dataclasses.replace(m, files=files))
    return d


@pytest.mark.parametrize("make, serve, why", [
    (_another_job, _send, "job 'job-other'"),
    (_another_rank, _send, "rank 0"),
    (_lying_size, _send, "torn"),
    (lambda tmp: _saved(str(tmp / "other"), 5, 1),
     lambda c, m, d, t: _send(c, m, d, t, cut=100), "torn"),
    (lambda tmp: _saved(str(tmp / "other"), 5, 1),
     lambda c, m, d, t: _send(c, m, d, t, flip=True), "checksum"),
    (lambda tmp: _saved(str(tmp / "other"), 5, 1),
     lambda c, m, d, t: threading.Event().wait(5), "timed out"),  # stalls, then closes
], ids=["another-job", "another-rank", "size-over-what-it-sends", "torn", "corrupt",
        "stalled"])
def test_a_wrong_answer_is_refused_and_the_ladder_goes_on_to_disk(
        tmp_path: Path, bad_holder: Callable[[Serve, str], tuple[str, int]],
        monkeypatch: pytest.MonkeyPatch, make: Callable[[Path], str], serve: Serve,
        why: str) -> None:
    monkeypatch.setattr(replica, "IO_TIMEOUT", 1.0)
    durable = str(tmp_path / "durable")
    old = _saved(str(tmp_path / "was"), 3, 1)  # the last persisted checkpoint: step 3
    persist.persist(old, durable, rank=1, step=3)
    address = bad_holder(serve, make(tmp_path))
    root = str(tmp_path / "new-pod")
    assert replica_agent.fetch_before_start(root, JOB, 1, KEY, address) is None
    assert not layout.complete_steps(root, JOB, 1)  # nothing half-written left to load
    note = layout.peer_missed(root, JOB, 1)
    assert why in note, note
    trainer = _snap(root, 1, durable=durable)
    state = _state(0.0)
    assert trainer.load(state) == 3  # the disk rung: the last persisted checkpoint
    step, source, said = trainer.last_load
    assert (step, source) == (3, "disk")
    assert any(w.startswith("peer: the replica at") and why in w for w in said), said
    assert torch.equal(state["w"], torch.full((32, 32), 3.0))  # type: ignore[call-overload]
    trainer.close()
