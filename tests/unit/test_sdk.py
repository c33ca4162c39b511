"""The SDK (trainer side) and its receiver (agent side), over real unix datagram sockets."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftagent import sdk
from ftagent.model import CollectiveSample, Observation, PhaseMarker, Progress
from ftagent.sources.sdk_socket import SdkSocketSource, busbw, parse_datagram

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sock_path(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "sdk.sock")
    yield path


@pytest.fixture
def raw_receiver(sock_path: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A plain bound socket, and this process's SDK pointed at it."""
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(sock_path)
    rx.settimeout(5.0)
    monkeypatch.setenv(sdk.ENV, sock_path)
    sdk.reconnect()
    yield rx
    rx.close()
    monkeypatch.delenv(sdk.ENV)
    sdk.reconnect()


def trainer(script: str, sock_path: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, **{sdk.ENV: sock_path, "PYTHONPATH": str(ROOT)})
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


async def receive(sock_path: str, script: str, count: int,
                  timeout: float = 20.0) -> tuple[list[Observation], SdkSocketSource]:
    """Run a real trainer process against a real SdkSocketSource until ``count`` arrive."""
    got: list[Observation] = []
    enough = asyncio.Event()

    def emit(o: Observation) -> None:
        got.append(o)
        if len(got) >= count:
            enough.set()

    src = SdkSocketSource(sock_path)
    src.bind()
    task = asyncio.create_task(src.run(emit))
    proc = trainer(script, sock_path)
    try:
        await asyncio.wait_for(enough.wait(), timeout)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err.decode()
    return got, src


# --------------------------------------------------------------------------- end to end


def test_trainer_process_reports_steps_phases_collectives(sock_path: str) -> None:
    script = """
        import ftagent
        ftagent.step(1, loss=0.5, samples=32, tokens=4096)
        with ftagent.phase("checkpoint"):
            pass
        @ftagent.phase("eval loop")
        def evaluate():
            return 7
        assert evaluate() == 7
        ftagent.collective("all_reduce", 1 << 20, 0.002, 8)
        ftagent.step(2, loss=float("nan"))
    """
    got, src = asyncio.run(receive(sock_path, script, 7))
    assert [type(o) for o in got] == [Progress, PhaseMarker, PhaseMarker, PhaseMarker,
                                      PhaseMarker, CollectiveSample, Progress]
    p1, p2 = got[0], got[6]
    assert isinstance(p1, Progress) and isinstance(p2, Progress)
    assert (p1.step, p1.loss, p1.samples, p1.tokens, p1.source) == (1, 0.5, 32, 4096, "sdk")
    assert p2.step == 2 and p2.loss is not None and math.isnan(p2.loss)
    assert [(o.phase, o.begin) for o in got[1:5] if isinstance(o, PhaseMarker)] == [
        ("checkpoint", True), ("checkpoint", False), ("eval_loop", True), ("eval_loop", False)]
    c = got[5]
    assert isinstance(c, CollectiveSample)
    assert (c.op, c.nbytes, c.seconds, c.world_size) == ("all_reduce", 1 << 20, 0.002, 8)
    assert all(o.ts > 0 for o in got) and src.garbage == 0
    assert not os.path.exists(sock_path)  # removed when the source stopped


def test_garbage_datagrams_are_counted_and_skipped(sock_path: str) -> None:
    script = f"""
        import socket, ftagent
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for junk in (b"", b"\\xff\\x00", b"v1 1 s x - - -", b"v2 1 s 1 - - -", b"v1 1 p x 2",
                     b"v1 1 c op -5 1 2", b"v1 1 s -1 - - -", b"v1 1 s 1 - - - extra" * 100):
            s.sendto(junk, {sock_path!r})
        ftagent.step(3)
    """
    got, src = asyncio.run(receive(sock_path, script, 1))
    assert got == [Progress(step=3, source="sdk", ts=got[0].ts)]
    assert src.garbage == 8 and src.received == 9


def test_fork_child_sends_its_own_pid(raw_receiver: socket.socket, sock_path: str) -> None:
    script = """
        import os, ftagent
        ftagent.step(1)
        pid = os.fork()
        if pid == 0:
            ftagent.step(2)
            os._exit(0)
        os.waitpid(pid, 0)
        print(pid, flush=True)
    """
    proc = trainer(script, sock_path)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    first = raw_receiver.recv(4096).split()
    second = raw_receiver.recv(4096).split()
    assert first[:4] == [b"v1", str(proc.pid).encode(), b"s", b"1"]
    assert second[:4] == [b"v1", out.strip(), b"s", b"2"]


# --------------------------------------------------------------------------- never raises


def test_no_op_without_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sdk.ENV, raising=False)
    sdk.reconnect()
    sdk.step(1, loss=0.1)
    with sdk.phase("checkpoint"):
        sdk.collective("all_reduce", 1, 0.1, 2)
    assert sdk._client.sock is None


def test_agent_gone_is_silent_and_retried(raw_receiver: socket.socket, sock_path: str) -> None:
    sdk.step(1)
    assert raw_receiver.recv(4096).startswith(b"v1 ")
    raw_receiver.close()
    os.unlink(sock_path)
    sdk.step(2)  # ECONNREFUSED: dropped, connection closed, retry later
    assert sdk._client.sock is None
    t0 = time.perf_counter()
    for i in range(1000):
        sdk.step(3 + i)  # within RETRY_SECONDS: not even a connect attempt
    assert (time.perf_counter() - t0) / 1000 < 50e-6
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # an agent comes back
    rx.bind(sock_path)
    rx.settimeout(5.0)
    sdk._client.retry_at = 0.0
    sdk.step(99)
    assert rx.recv(4096).split()[3] == b"99"
    rx.close()


def test_full_queue_drops_without_blocking(raw_receiver: socket.socket) -> None:
    raw_receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    t0 = time.monotonic()
    for i in range(20_000):  # nobody reads: the queue fills up
        sdk.step(i, loss=1.0)
    assert time.monotonic() - t0 < 10.0
    assert sdk._client.sock is not None  # EAGAIN keeps the connection


def test_phase_waits_briefly_for_room_then_drops(raw_receiver: socket.socket) -> None:
    for i in range(1000):  # nobody reads: the queue is full
        sdk.step(i)
    t0 = time.monotonic()
    for _ in range(20):
        with sdk.phase("checkpoint"):
            pass
    assert time.monotonic() - t0 < 40 * sdk.PHASE_WAIT + 1.0  # bounded, never stuck
    assert sdk._client.sock is not None


def test_phase_marker_survives_a_full_queue(raw_receiver: socket.socket) -> None:
    import threading

    for i in range(1000):
        sdk.step(i)
    got: list[bytes] = []

    def drain() -> None:
        while b" p " not in b"".join(got[-1:]):
            got.append(raw_receiver.recv(4096))

    reader = threading.Thread(target=drain)
    reader.start()
    with sdk.phase("eval"):
        pass
    reader.join(10)
    assert not reader.is_alive() and got[-1].split()[2:] == [b"p", b"eval", b"1"]


def test_bad_values_never_raise(raw_receiver: socket.socket) -> None:
    class Weird:
        def __float__(self) -> float:
            raise RuntimeError("no")

        def __str__(self) -> str:
            raise RuntimeError("no")

    sdk.step(Weird(), loss=Weird(), samples="x", tokens=None)  # type: ignore[arg-type]
    sdk.collective(Weird(), Weird(), Weird(), Weird())  # type: ignore[arg-type]
    with sdk.phase(Weird()):  # type: ignore[arg-type]
        pass
    sdk.step(5, loss=2)
    got = [parse_datagram(raw_receiver.recv(4096), 0.0) for _ in range(5)]
    assert got[0] is None  # step "-" is rejected by the receiver, not by the trainer
    assert got[1] is None  # op "_" with nbytes "-"
    assert got[2] == PhaseMarker("_", True, source="sdk", ts=0.0)
    assert got[4] == Progress(step=5, loss=2.0, source="sdk", ts=0.0)


# --------------------------------------------------------------------------- receiver


def test_stale_socket_is_replaced_and_other_files_refused(tmp_path: Path) -> None:
    stale = tmp_path / "s.sock"
    old = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    old.bind(str(stale))
    old.close()  # the file stays: a dead agent's socket
    src = SdkSocketSource(str(stale))
    src.bind()
    src.close()
    assert not stale.exists()
    plain = tmp_path / "file"
    plain.write_text("data")
    with pytest.raises(FileExistsError, match="not a socket"):
        SdkSocketSource(str(plain)).bind()
    assert plain.read_text() == "data"


def test_close_leaves_a_newer_agents_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    first = SdkSocketSource(path)
    first.bind()
    second = SdkSocketSource(path)
    second.bind()  # a new agent took the path over
    first.close()
    assert os.path.exists(path)
    second.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize(("data", "expected"), [
    (b"v1 9 s 12 0.25 32 -", Progress(step=12, loss=0.25, samples=32, source="sdk", ts=1.0)),
    (b"v1 9 p checkpoint 0", PhaseMarker("checkpoint", False, source="sdk", ts=1.0)),
    (b"v1 9 c all_gather 100 0.5 4", CollectiveSample("all_gather", 100, 0.5, 4, ts=1.0)),
    (b"v1 9 s 1 - - - -", None),
    (b"v1 x s 1 - - -", None),
    (b"v1 9 c op 1 inf 2", None),
    (b"v1 9 c op 1 1 0", None),
    (b"v1 9 q 1 2 3", None),
])
def test_parse_datagram(data: bytes, expected: Observation | None) -> None:
    assert parse_datagram(data, 1.0) == expected


# --------------------------------------------------------------------------- bandwidth


@pytest.mark.parametrize(("op", "n", "factor"), [
    ("all_reduce", 8, 2 * 7 / 8), ("allreduce", 2, 1.0), ("all_reduce_coalesced", 4, 1.5),
    ("reduce_scatter", 8, 7 / 8), ("reduce_scatter_tensor", 4, 0.75),
    ("all_gather", 8, 7 / 8), ("all_gather_into_tensor", 2, 0.5),
    ("all_to_all", 4, 0.75), ("all_to_all_single", 8, 7 / 8),
    ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("send", 2, 1.0), ("all_reduce", 1, 0.0),
])
def test_busbw_factors(op: str, n: int, factor: float) -> None:
    algbw, bus = busbw(op, 4_000_000, 0.002, n)
    assert algbw == pytest.approx(2e9)
    assert bus == pytest.approx(2e9 * factor)


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.inf, math.nan])
def test_busbw_invalid_time(seconds: float) -> None:
    assert busbw("all_reduce", 100, seconds, 8) == (0.0, 0.0)
