"""ftagent.torch: the trainer-side aggregation (pure, injected clock), Megatron's timer
lines, the metrics it feeds, and bad input on a real small model that never raises."""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from ftagent import sdk
from ftagent.metrics import AgentMetrics, size_bucket
from ftagent.model import PhaseTiming, Progress
from ftagent.sources.progress import LogProgress
from ftagent.sources.sdk_socket import check_datagram

IDS = {"job_name": "j", "namespace": "n", "pod": "p", "node": "h", "rank": "0"}


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_aggregator_sums_per_op_world_and_size_bucket_and_flushes_a_few_times_a_second(
) -> None:
    from ftagent.torch import Aggregator

    clock = FakeClock()
    sent: list[tuple[object, ...]] = []
    agg = Aggregator(interval=0.25, clock=clock,
                     send_collectives=lambda *a: sent.append(("c", *a)),
                     send_phase=lambda *a: sent.append(("p", *a)))
    for _ in range(1000):  # a thousand collectives in one interval: nothing sent yet
        agg.collective("all_reduce", 3000, 0.001, 4)
    agg.collective("all_reduce", 4000, 0.002, 4)  # same power-of-two bucket (2048..4095)
    agg.collective("all_reduce", 1 << 20, 0.01, 4)  # another bucket
    agg.collective("all_reduce", 1 << 20, 0.01, 2)  # another group size
    agg.phase("forward", 0.5)
    assert sent == []
    clock.t = 0.3
    agg.phase("forward", 0.25)  # the interval passed: one flush
    assert ("p", "forward", 0.75, 2) in sent
    colls = sorted(s for s in sent if s[0] == "c")
    assert colls == sorted([("c", "all_reduce", 1001, 3_004_000, pytest.approx(1.002), 4),
                            ("c", "all_reduce", 1, 1 << 20, 0.01, 4),
                            ("c", "all_reduce", 1, 1 << 20, 0.01, 2)])
    assert len(sent) == 4


def test_a_flush_sends_a_bounded_number_of_datagrams_the_rest_wait() -> None:
    from ftagent.torch import Aggregator

    clock = FakeClock()
    sent: list[tuple[object, ...]] = []
    agg = Aggregator(interval=1.0, clock=clock, send_collectives=lambda *a: sent.append(a),
                     send_phase=lambda *a: sent.append(a))
    for k in range(20):
        agg.collective("broadcast", 1 << k, 0.001, 2)
    agg.flush(limit=6)
    assert len(sent) == 6 and len(agg.collectives) == 14  # the agent's queue holds 10
    agg.flush(limit=100)
    assert len(sent) == 20 and not agg.collectives


def test_sdk_aggregate_datagrams_round_trip_and_bad_values_are_not_sent(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    srv.settimeout(5)
    old = os.environ.get(sdk.ENV)
    os.environ[sdk.ENV] = path
    sdk.reconnect()
    try:
        sdk.collectives("all_gather_into_tensor", 3, 3 << 20, 0.03, 8)
        sdk.phase_time("data", 0.5, 10)
        for bad in ((-1, 10, 0.1, 2), (1, 10, math.nan, 2), (1, 10, 0.1, 0), ("x", 1, 1, 1)):
            sdk.collectives("all_reduce", *bad)  # type: ignore[arg-type]
        sdk.phase_time("forward", math.inf)
        sdk.phase_time("forward", 1.0, 0)
        sdk.phase_time("x" * 500, 1.0)  # a long name is cut, not refused
        got = [check_datagram(srv.recv(1024), 1.0) for _ in range(3)]
        srv.setblocking(False)
        with pytest.raises(BlockingIOError):
            srv.recv(1024)
    finally:
        if old is None:
            os.environ.pop(sdk.ENV, None)
        else:
            os.environ[sdk.ENV] = old
        sdk.reconnect()
    c, t, long = got
    assert (c.op, c.count, c.nbytes, c.seconds, c.world_size) == (  # type: ignore[union-attr]
        "all_gather_into_tensor", 3, 3 << 20, 0.03, 8)
    assert t == PhaseTiming("data", 0.5, 10, "sdk", 1.0)
    assert isinstance(long, PhaseTiming) and len(long.phase) == 64


def test_metrics_keep_exact_sums_and_counts_and_label_sizes_by_power_of_two() -> None:
    reg = CollectorRegistry()
    m = AgentMetrics(reg, IDS)
    m.observe_phase("forward", 0.75, 3)
    m.observe_collectives("all_reduce", 3 * 8708, 0.03, 4, count=3)
    get = reg.get_sample_value
    assert get("ftagent_phase_duration_seconds_count", {**IDS, "phase": "forward"}) == 3
    assert get("ftagent_phase_duration_seconds_sum", {**IDS, "phase": "forward"}) == 0.75
    assert get("ftagent_phase_duration_seconds_bucket",
               {**IDS, "phase": "forward", "le": "0.25"}) == 3
    assert get("ftagent_collective_duration_seconds_count", {**IDS, "op": "all_reduce"}) == 3
    bus = get("ftagent_collective_busbw_bytes_per_second",
              {**IDS, "op": "all_reduce", "size": "8192"})
    assert bus == pytest.approx(3 * 8708 / 0.03 * 2 * 3 / 4)
    assert [size_bucket(n) for n in (0, 1023, 1024, 8708, 1 << 40)] == [
        "1024", "1024", "1024", "8192", str(1 << 34)]


MEGATRON = b"""\
 [2025-08-01 07:19:50] iteration       10/    5000 | consumed samples: 1280 | elapsed time per \
iteration (ms): 12936.1 | throughput per GPU (TFLOP/s/GPU): 118.7 | lm loss: 1.044022E+01 |
 [2025-08-01 07:21:50] iteration       20/    5000 | consumed samples: 2560 | elapsed time per \
iteration (ms): 12936.1 | throughput per GPU (TFLOP/s/GPU): 121.5 | lm loss: 9.9E+00 |
(min, max) time across ranks (ms):
    forward-backward ...............................: (26094.39, 26095.09)
    optimizer ......................................: (3407.56, 3409.92)
    save-checkpoint ................................: (18450.20, 18512.90)
    some-future-timer ..............................: (1.00, 2.00)
max time across ranks (ms):
    batch-generator ................................: 12.50
"""


def test_megatron_timer_lines_and_tflops_from_the_log() -> None:
    obs = LogProgress(unlimited=True).parse_blob(MEGATRON, 5.0)
    steps = [o for o in obs if isinstance(o, Progress)]
    assert [s.tflops_per_gpu for s in steps] == [118.7, 121.5]
    timings = [o for o in obs if isinstance(o, PhaseTiming)]
    # per-iteration averages over the log interval (10): the interval's totals, the
    # slowest rank's (max); setup/checkpoint and unknown timers are not exported
    assert [(t.phase, t.count) for t in timings] == [
        ("forward-backward", 10), ("optimizer", 10), ("data", 10)]
    assert timings[0].seconds == pytest.approx(260.9509)
    assert all(t.source == "megatron" for t in timings)


@pytest.mark.parametrize("line", [
    b"    forward-backward ....: (1" + b"9" * 5000 + b", 2)",
    b"    optimizer " + b"." * 100_000 + b": 1.0",
    b"    forward-backward ....: (nan, inf)",
])
def test_hostile_timer_lines_are_not_timings(line: bytes) -> None:
    assert not [o for o in LogProgress(unlimited=True).parse_blob(line, 1.0)
                if isinstance(o, PhaseTiming)]


@pytest.fixture
def sdk_socket(tmp_path: Path) -> Iterator[socket.socket]:
    path = str(tmp_path / "sdk.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    srv.setblocking(False)
    old = os.environ.get(sdk.ENV)
    os.environ[sdk.ENV] = path
    sdk.reconnect()
    yield srv
    import ftagent.torch as ft

    if ft._active is not None:
        ft._active.close()
    ft._warned.clear()
    if old is None:
        os.environ.pop(sdk.ENV, None)
    else:
        os.environ[sdk.ENV] = old
    sdk.reconnect()


def received(srv: socket.socket) -> list[object]:
    out = []
    while True:
        try:
            out.append(check_datagram(srv.recv(1024), 0.0))
        except BlockingIOError:
            return out


def test_outside_ftagent_run_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import ftagent.torch as ft

    monkeypatch.delenv(sdk.ENV, raising=False)
    assert ft.instrument(model=object()) is None and ft._active is None


def test_phase_hooks_on_a_real_model_and_bad_input_never_raises(
        sdk_socket: socket.socket, caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    import ftagent.torch as ft

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8)),
                                         batch_size=8)
    with caplog.at_level(logging.WARNING, logger="ftagent.torch"):
        inst = ft.instrument(model=model, optimizer=opt, dataloader=loader, collectives=False)
        assert inst is not None and inst.dataloader is loader  # timed in place
        assert ft.instrument(model=model, optimizer=opt, dataloader=loader) is inst  # twice
        ft.instrument(model=torch.nn.ReLU())  # a model with no parameters
        ft.instrument(model="not a model", optimizer=42, dataloader=7)  # type: ignore[arg-type]
        batches = ft.instrument(dataloader=[torch.randn(8, 8)] * 3)  # a list: a wrapper
        assert batches is not None
        listed = list(batches.dataloader)
        assert len(listed) == 3
        for (x,) in loader:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            model(torch.randn(2, 8))  # an eval forward: no backward to time
        torch.nn.ReLU()(torch.randn(3))
        inst.flush()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == len(set(warnings)) == 6, warnings  # one line per wrong use
    timings = [o for o in received(sdk_socket) if isinstance(o, PhaseTiming)]
    # a phase may come in more than one datagram (a periodic flush under load): summed
    count: dict[str, int] = {}
    for o in timings:
        count[o.phase] = count.get(o.phase, 0) + o.count
    assert count["forward"] == 8 + 1 and count["backward"] == 8
    assert count["optimizer"] == 8 and count["data"] == 8 + 3
    assert all(0 < o.seconds < 10 for o in timings)


def test_world_size_one_ddp_buckets_and_a_users_own_comm_hook(
        sdk_socket: socket.socket, caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ftagent.torch as ft
    from tests.conftest import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ddp = DDP(torch.nn.Linear(8, 4))
        theirs = DDP(torch.nn.Linear(8, 4))
        calls = []

        def their_hook(state: object, bucket: object):  # type: ignore[no-untyped-def]
            calls.append(1)
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(bucket.buffer())  # type: ignore[attr-defined]
            return fut

        their_hook.__annotations__ = {}
        theirs.register_comm_hook(None, their_hook)
        with caplog.at_level(logging.WARNING, logger="ftagent.torch"):
            ft.instrument(model=ddp)
            ft.instrument(model=theirs)  # their hook stays, and is timed too: no warning
            for _ in range(3):
                for m in (ddp, theirs):
                    m(torch.randn(4, 8)).sum().backward()
            with ddp.no_sync():  # gradient accumulation: no reduction, not counted
                ddp(torch.randn(4, 8)).sum().backward()
            dist.all_reduce(torch.ones(256))  # world size 1: busbw 0, still reported
            ft._active.flush()  # type: ignore[union-attr]
        assert calls == [1, 1, 1]
        assert caplog.records == []
        # two models, each one bucket of (8*4 + 4) floats, 3 synced steps each: counts and
        # bytes exact; seconds from DDP's own sampled timer (> 0: it ran)
        got = [o for o in received(sdk_socket) if not isinstance(o, PhaseTiming)]
        ddp_rec = [o for o in got if o.op == "all_reduce_ddp"]  # type: ignore[attr-defined]
        colls = {o.op: o for o in got}  # type: ignore[attr-defined]
        assert sum(o.count for o in ddp_rec) == 6
        assert sum(o.nbytes for o in ddp_rec) == 6 * (8 * 4 + 4) * 4
        assert all(o.seconds > 0 for o in ddp_rec)
        assert colls["all_reduce"].world_size == 1
        # close() restores DDP's sampling; instrumenting it again is silent
        ft._active.close()  # type: ignore[union-attr]
        assert ft.instrument(model=ddp) is not None and caplog.records == []
        ft._active.close()  # type: ignore[union-attr]
    finally:
        dist.destroy_process_group()


class FakeDDPLogging:
    """What ``DistributedDataParallel._get_ddp_logging_data()`` returns (the keys and
    types of torch's: ints in ns, bucket sizes as a comma-separated string), scripted."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {"bucket_sizes": "8406016", "iteration": 0}

    def _get_ddp_logging_data(self) -> dict[str, object]:
        return dict(self.data)


def test_ddp_buckets_exact_counts_and_bytes_with_sampled_seconds_shared_by_bytes() -> None:
    from ftagent.torch import DDP_OP, Aggregator, _DDPTimer

    sent: list[tuple[Any, ...]] = []
    agg = Aggregator(clock=FakeClock(), send_collectives=lambda *a: sent.append(a),
                     send_phase=lambda *a: None)
    ddp = FakeDDPLogging()
    timer = _DDPTimer(ddp, world=4)
    timer.steps = 1
    timer.poll(agg)  # DDP has no sampled step yet: the step waits, nothing is invented
    agg.flush()
    assert sent == [] and timer.steps == 1
    # DDP rebuilt its buckets and timed a step: 2 ms from first launch to last completion
    ddp.data.update({"rebuilt_bucket_sizes": "1000, 3000", "iteration": 1,
                     "backward_comm_time": 2_000_000})
    timer.steps = 10
    timer.poll(agg)
    agg.flush()
    got = {nbytes: (op, count, seconds, world) for op, count, nbytes, seconds, world in sent}
    assert got == {10 * 1000: (DDP_OP, 10, pytest.approx(10 * 0.002 * 0.25), 4),
                   10 * 3000: (DDP_OP, 10, pytest.approx(10 * 0.002 * 0.75), 4)}
    # no new sample: the latest one stands for the next steps; a garbage value is ignored
    sent.clear()
    ddp.data["backward_comm_time"] = "junk"
    timer.steps = 5
    timer.poll(agg)
    agg.flush()
    assert sum(c for _, c, _, _, _ in sent) == 10  # 5 steps x 2 buckets
    assert sum(s for _, _, _, s, _ in sent) == pytest.approx(5 * 0.002)
