"""ftagent.torch.instrument() on real gloo jobs (CPU): what it sends through the SDK socket
matches the collectives run, async work is timed to completion, and a real agent wrapping
examples/train.py (INSTRUMENT=1) exports busbw/algbw and phase series."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from ftagent.metrics import busbw
from ftagent.sources.sdk_socket import check_datagram
from tests.conftest import PY, free_port, ftagent_cmd, popen, read_events, wait_for

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]

RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist
    import ftagent.torch as ft
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    inst = ft.instrument(flush_seconds=0.05)
    ft.instrument()                      # twice: one warning, no harm
    ft.instrument(model=lambda x: x)     # a wrong argument: one warning, no harm
    n = dist.get_world_size()
    x = torch.ones(1 << 20)              # 4 MiB
    hand = {}
    for _ in range(5):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        hand["all_reduce"] = hand.get("all_reduce", 0.0) + time.perf_counter() - t0
    dist.all_gather_into_tensor(torch.zeros(n << 18), torch.ones(1 << 18))
    dist.reduce_scatter_tensor(torch.zeros(1 << 18), torch.ones(n << 18))
    dist.broadcast(torch.ones(1 << 16), src=0)
    dist.all_to_all_single(torch.zeros(n << 16), torch.ones(n << 16))
    # async, timed to completion: rank 1 joins 0.5 s late, rank 0's work waits for it
    if rank == 1:
        time.sleep(0.5)
    t0 = time.perf_counter()
    work = dist.all_reduce(torch.ones(1 << 10), async_op=True)
    work.wait()
    hand["async"] = time.perf_counter() - t0
    solo = dist.new_group([0])           # a sub-group of size 1 (rank 0 only)
    if rank == 0:
        dist.all_reduce(torch.ones(1 << 12), group=solo)
    inst.flush()
    print(json.dumps(hand), flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def drain(sock: socket.socket) -> list[object]:
    out = []
    while True:
        try:
            data = sock.recv(1024)
        except BlockingIOError:
            return out
        obs = check_datagram(data, 0.0)
        assert not isinstance(obs, str), (obs, data)
        out.append(obs)


def test_gloo_collectives_report_what_ran_with_busbw_from_their_timings(tmp_path: Path) -> None:
    world = 2
    socks, procs = [], []
    port = free_port()
    for rank in range(world):
        path = str(tmp_path / f"sdk{rank}.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(path)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        s.setblocking(False)
        socks.append(s)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "FTAGENT_SDK_SOCKET": path, "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    got: list[list[object]] = [[] for _ in range(world)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (_out, err) in enumerate(outs):
        assert procs[rank].returncode == 0, err.decode()[-3000:]
        got[rank] = drain(socks[rank])
        warnings = [ln for ln in err.decode().splitlines() if "ftagent.torch" in ln]
        assert len(warnings) == 1 and "torch.nn.Module" in warnings[0], warnings
    hand = json.loads(outs[0][0].decode().strip().splitlines()[-1])
    by_op: dict[tuple[str, int], list[float]] = {}
    for o in got[0]:
        key = (o.op, o.world_size)  # type: ignore[attr-defined]
        acc = by_op.setdefault(key, [0, 0, 0.0])
        acc[0] += o.count  # type: ignore[attr-defined]
        acc[1] += o.nbytes  # type: ignore[attr-defined]
        acc[2] += o.seconds  # type: ignore[attr-defined]
    # every op, with nccl-tests' byte counts (all_gather/reduce_scatter: the total)
    assert by_op[("all_reduce", 2)][:2] == [5 + 1, 5 * (4 << 20) + 4096]
    assert by_op[("all_gather_into_tensor", 2)][:2] == [1, 2 * (1 << 20)]
    assert by_op[("reduce_scatter_tensor", 2)][:2] == [1, 2 * (1 << 20)]
    assert by_op[("broadcast", 2)][:2] == [1, 1 << 18]
    assert by_op[("all_to_all_single", 2)][:2] == [1, 2 << 18]
    assert by_op[("all_reduce", 1)][:2] == [1, 1 << 14]  # the sub-group's own size
    # busbw from the reported timings, as the agent computes it, is the hand formula
    count, nbytes, seconds = by_op[("all_reduce", 2)]
    algbw, bus = busbw("all_reduce", int(nbytes), seconds, 2)
    assert algbw == pytest.approx(nbytes / seconds) and bus == pytest.approx(algbw * 2 * 1 / 2)
    # and the reported time is the trainer's own (sync all_reduces + the async one),
    # within 20 %: the wrapper adds microseconds to millisecond collectives
    assert seconds == pytest.approx(hand["all_reduce"] + hand["async"], rel=0.2)
    # the async all-reduce was timed to its completion (rank 1 came 0.5 s late), not
    # to its launch
    assert seconds > 0.4
    assert by_op[("all_reduce", 2)][2] - hand["all_reduce"] > 0.4


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def test_agent_wrapping_examples_train_exports_busbw_and_phases(tmp_path: Path) -> None:
    port = free_port()
    agents, events = [], []
    for rank in range(2):
        ev = tmp_path / f"ev{rank}.jsonl"
        events.append(ev)
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "INSTRUMENT": "1", "TRAIN_STEPS": "100000",
               "TRAIN_STEP_SLEEP": "0.01"}
        agents.append(popen(ftagent_cmd(
            "--metrics-port", "0" if rank == 0 else "-1", "--metrics-addr", "127.0.0.1",
            "--events-file", str(ev), "--rank", str(rank), "--job", "inst",
            cmd=[PY, str(ROOT / "examples" / "train.py")]), env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        mport = wait_for(lambda: next((e["metrics_port"] for e in read_events(events[0])
                                       if e.get("kind") == "metrics"), None), 60, "port")

        def ready() -> str | None:
            t = scrape(mport)
            need = ('ftagent_collective_busbw_bytes_per_second{', 'op="all_reduce_ddp"',
                    'phase="forward"', 'phase="backward"', 'phase="optimizer"',
                    'phase="data"')
            return t if all(n in t for n in need) else None

        text = wait_for(ready, 180, "busbw and phase series in /metrics")
        lines = text.splitlines()
        bus = [ln for ln in lines if ln.startswith("ftagent_collective_busbw_bytes_per_second{")
               and 'op="all_reduce_ddp"' in ln]
        # DDP's one bucket of this model: (32*64 + 64 + 64 + 1) floats = 8708 bytes
        assert bus and 'size="8192"' in bus[0] and 'rank="0"' in bus[0]
        assert 'job_name="inst"' in bus[0]
        assert float(bus[0].rsplit(" ", 1)[1]) > 0
        assert any(ln.startswith("ftagent_collective_algbw_bytes_per_second{") for ln in lines)
        for phase in ("forward", "backward", "optimizer", "data"):
            count = next(ln for ln in lines if ln.startswith(
                "ftagent_phase_duration_seconds_count{") and f'phase="{phase}"' in ln)
            assert float(count.rsplit(" ", 1)[1]) >= 1
    finally:
        for a in agents:
            a.terminate()
        for a in agents:
            try:
                a.wait(60)
            except subprocess.TimeoutExpired:
                a.kill()
