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
from ftagent.metrics import AgentMetrics, busbw
from ftagent.model import CollectiveSample, Observation, PhaseMarker, Progress, Resumed
from ftagent.sources.sdk_socket import (
    DROP_REASONS,
    MAX_DATAGRAM,
    SdkSocketSource,
    check_datagram,
    parse_datagram,
)
from ftagent.wire.limits import (
    MAX_LABEL_NAME,
    MAX_OPS,
    MAX_PHASES,
    MAX_PID,
    MAX_SECONDS,
    MAX_STEP,
    MAX_WORLD_SIZE,
    OTHER,
)

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
    got = [parse_datagram(raw_receiver.recv(4096), 0.0) for _ in range(3)]
    # no step and no collective to report: not sent (the agent would drop them)
    assert got[0] == PhaseMarker("_", True, source="sdk", ts=0.0)
    assert got[1] == PhaseMarker("_", False, source="sdk", ts=0.0)
    assert got[2] == Progress(step=5, loss=2.0, source="sdk", ts=0.0)


def test_sender_keeps_to_the_receivers_limits(raw_receiver: socket.socket) -> None:
    """What the SDK sends is within wire.limits: out-of-range steps and collectives are
    not sent, out-of-range counts become "-", names are cut and cleaned; and everything
    it sends is accepted by the receiver."""
    raw_receiver.settimeout(0.5)
    sdk.step(-1)
    sdk.step(MAX_STEP + 1)
    sdk.collective("all_reduce", -1, 0.1, 2)
    sdk.collective("all_reduce", 1, math.nan, 2)
    sdk.collective("all_reduce", 1, math.inf, 2)
    sdk.collective("all_reduce", 1, 0.1, 0)
    sdk.collective("all_reduce", 1, 0.1, MAX_WORLD_SIZE + 1)
    sdk.step(MAX_STEP, loss=math.inf, samples=MAX_STEP + 1, tokens=-3)
    sdk.step(7, loss=math.nan, samples=2.0, tokens=3)  # type: ignore[arg-type]
    with sdk.phase("é" * 40):  # 80 bytes: cut to 64 at a character boundary
        pass
    with sdk.phase("a\x00b\tc\u200bd\x7f"):  # control and format characters, whitespace
        pass
    sdk.collective("x" * 100, 1 << 20, 0.5, MAX_WORLD_SIZE)
    raw = []
    with pytest.raises(TimeoutError):
        while True:
            raw.append(raw_receiver.recv(4096))
    got = [parse_datagram(d, 0.0) for d in raw]
    assert None not in got, raw
    assert len(got) == 7
    first, second = got[0], got[1]
    assert isinstance(first, Progress) and isinstance(second, Progress)
    assert (first.step, first.loss, first.samples, first.tokens) == (
        MAX_STEP, math.inf, None, None)
    assert (second.step, second.samples, second.tokens) == (7, 2, 3)
    assert second.loss is not None and math.isnan(second.loss)
    assert [o.phase for o in got[2:6] if isinstance(o, PhaseMarker)] == [
        "é" * 32, "é" * 32, "a_b_c_d_", "a_b_c_d_"]
    assert got[6] == CollectiveSample("x" * MAX_LABEL_NAME, 1 << 20, 0.5, MAX_WORLD_SIZE,
                                      ts=0.0)
    assert sdk.NAME_MAX == MAX_LABEL_NAME


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
    (b"v1 9 r 1200", Resumed(1200, source="sdk", ts=1.0)),
    (b"v1 9 r -1", None), (b"v1 9 r 1 2", None), (b"v1 9 r %d" % (MAX_STEP + 1), None),
])
def test_parse_datagram(data: bytes, expected: Observation | None) -> None:
    assert parse_datagram(data, 1.0) == expected


N64 = b"n" * MAX_LABEL_NAME


@pytest.mark.parametrize(("data", "reason"), [
    (b"v1 9 p " + b"x" * MAX_DATAGRAM + b" 1", "oversize"),
    (b"v2 9 s 1 - - -", "version"), (b"\xff\x00", "version"), (b"hello", "version"),
    (b"", "malformed"), (b"v1 9 s", "malformed"), (b"v1 9 s 1 - -", "malformed"),
    (b"v1 9 s 1 - - - -", "malformed"), (b"v1 x s 1 - - -", "malformed"),
    (b"v1 9 s - - - -", "malformed"), (b"v1 9 s +1 - - -", "malformed"),
    (b"v1 9 s 1_0 - - -", "malformed"), (b"v1 9 s \xd9\xa3 - - -", "malformed"),
    (b"v1 9 s -1 - - -", "malformed"), (b"v1 9 s 1 x - -", "malformed"),
    (b"v1 9 s 1 " + b"1" * 40 + b" - -", "malformed"), (b"v1 9 p x 2", "malformed"),
    (b"v1 9 q 1 2 3", "malformed"), (b"v1 9 c op 1 2", "malformed"),
    (b"v1 9 s  1 - -", "malformed"),
    (b"v1 0 s 1 - - -", "range"), (b"v1 %d s 1 - - -" % (MAX_PID + 1), "range"),
    (b"v1 9 s %d - - -" % (MAX_STEP + 1), "range"), (b"v1 9 s " + b"9" * 400 + b" - - -", "range"),
    (b"v1 9 s 1 - %d -" % (MAX_STEP + 1), "range"), (b"v1 9 s 1 - - %d" % 2**64, "range"),
    (b"v1 9 c op %d 1 2" % (MAX_STEP + 1), "range"), (b"v1 9 c op 1 inf 2", "range"),
    (b"v1 9 c op 1 nan 2", "range"), (b"v1 9 c op 1 -0.5 2", "range"),
    (b"v1 9 c op 1 %r 2" % (MAX_SECONDS * 2), "range"), (b"v1 9 c op 1 1 0", "range"),
    (b"v1 9 c op 1 1 %d" % (MAX_WORLD_SIZE + 1), "range"),
    (b"v1 9 p " + N64 + b"n 1", "name"), (b"v1 9 p \xff\xfe 1", "name"),
    (b"v1 9 p a\x01b 1", "name"), (b"v1 9 p \x7f 0", "name"), (b"v1 9 p  1", "name"),
    (b"v1 9 c \xe2\x80\x8b 1 1 2", "name"),  # U+200B: not printable
])
def test_invalid_datagrams_are_dropped_with_a_reason(data: bytes, reason: str) -> None:
    assert reason in DROP_REASONS
    assert check_datagram(data, 1.0) == reason


@pytest.mark.parametrize(("data", "expected"), [
    (b"v1 %d s %d nan %d %d" % (MAX_PID, MAX_STEP, MAX_STEP, MAX_STEP), (MAX_STEP, "nan")),
    (b"v1 9 s 0 inf 0 0", (0, "inf")), (b"v1 9 s 3 -inf - -", (3, "-inf")),
    (b"v1 9 s 3 1e308 - -", (3, "1e+308")),
])
def test_loss_may_be_nan_or_infinite(data: bytes, expected: tuple[int, str]) -> None:
    obs = check_datagram(data, 1.0)
    assert isinstance(obs, Progress) and (obs.step, repr(obs.loss)) == expected


def test_longest_valid_names_and_numbers_are_accepted() -> None:
    assert check_datagram(b"v1 9 p " + N64 + b" 1", 1.0) == PhaseMarker(
        N64.decode(), True, source="sdk", ts=1.0)
    name = "é" * 32  # 64 bytes, 32 characters
    assert check_datagram(b"v1 9 c %s %d %r %d" % (name.encode(), MAX_STEP, MAX_SECONDS,
                                                    MAX_WORLD_SIZE), 1.0) == CollectiveSample(
        name, MAX_STEP, MAX_SECONDS, MAX_WORLD_SIZE, ts=1.0)


def test_random_bytes_never_raise() -> None:
    import random

    rng = random.Random(7)
    pieces = [b"v1", b"9", b"s", b"p", b"c", b"-", b"nan", b"1", b"1e999", b"\xff", b" ",
              b"x" * 70, b"0", b"99999999999999999999999"]
    for _ in range(20_000):
        if rng.random() < 0.5:
            data = rng.randbytes(rng.randint(0, 80))
        else:
            data = b" ".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        obs = check_datagram(data, 0.0)
        assert obs in DROP_REASONS or isinstance(obs, (Progress, PhaseMarker, CollectiveSample))


def _drain_all(src: SdkSocketSource, datagrams: list[bytes]) -> list[Observation]:
    """Send ``datagrams`` to a bound source and handle them in this thread (no loop)."""
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    got: list[Observation] = []
    assert src._sock is not None
    for d in datagrams:
        try:
            tx.sendto(d, src.path)
        except BlockingIOError:  # the queue is full (max_dgram_qlen): read it, send again
            src._drain(src._sock, got.append)
            tx.sendto(d, src.path)
    src._drain(src._sock, got.append)
    tx.close()
    return got


def test_source_folds_names_and_counts_drops_without_metrics(sock_path: str) -> None:
    src = SdkSocketSource(sock_path)
    src.bind()
    try:
        got = _drain_all(src, [b"v1 9 p ckpt-%d 1" % i for i in range(100)]
                         + [b"v1 9 c op-%d 1 0.1 2" % i for i in range(100)]
                         + [b"junk", b"v1 9 s -5 - - -", b"v1 9 p " + b"x" * 600 + b" 1"])
    finally:
        src.close()
    phases = [o.phase for o in got if isinstance(o, PhaseMarker)]
    ops = [o.op for o in got if isinstance(o, CollectiveSample)]
    assert phases[:MAX_PHASES] == [f"ckpt-{i}" for i in range(MAX_PHASES)]
    assert set(phases[MAX_PHASES:]) == {OTHER}
    assert ops[:MAX_OPS] == [f"op-{i}" for i in range(MAX_OPS)]
    assert set(ops[MAX_OPS:]) == {OTHER}
    assert (src.phases.folded, src.ops.folded) == (100 - MAX_PHASES, 100 - MAX_OPS)
    assert src.received == 203 and src.garbage == 3
    assert src.dropped == {"oversize": 1, "version": 1, "malformed": 1, "range": 0, "name": 0}


def test_source_exports_drops_and_folds_through_the_agents_metrics(sock_path: str) -> None:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    m = AgentMetrics(reg, {"job_name": "j", "namespace": "", "pod": "p", "node": "n", "rank": "0"})
    src = SdkSocketSource(sock_path, phases=m.phase_names, ops=m.op_names)
    m.attach_sdk(src)
    src.bind()
    try:
        got = _drain_all(src, [b"v1 9 p ckpt-%d 1" % i for i in range(40)]
                         + [b"v1 9 s 1 - - -", b"v1 9 p a\x01 1", b"v2 1"])
    finally:
        src.close()
    assert src.phases is m.phase_names  # one set: the detector and the series agree
    assert len(got) == 41

    def value(name: str, **extra: str) -> float | None:
        return reg.get_sample_value(name, m.labels(**extra))

    assert value("ftagent_sdk_datagrams_received_total") == 43
    assert value("ftagent_sdk_datagrams_dropped_total", reason="name") == 1
    assert value("ftagent_sdk_datagrams_dropped_total", reason="version") == 1
    assert value("ftagent_sdk_datagrams_dropped_total", reason="range") == 0  # all there
    assert value("ftagent_label_values_folded_total", label="phase") == 40 - MAX_PHASES


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


def test_resumed_is_sent_and_bounded(raw_receiver: socket.socket) -> None:
    """``ftagent.resumed(step)``: one datagram the receiver turns into ``Resumed``; a step
    out of range is not sent."""
    raw_receiver.settimeout(0.5)
    sdk.resumed(-1)
    sdk.resumed(MAX_STEP + 1)
    sdk.resumed("x")  # type: ignore[arg-type]
    import ftagent

    ftagent.resumed(40)
    assert parse_datagram(raw_receiver.recv(4096), 2.0) == Resumed(40, source="sdk", ts=2.0)
    with pytest.raises(TimeoutError):
        raw_receiver.recv(4096)
