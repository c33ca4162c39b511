"""The Verifier acting on the stall policy's rows (detect/stall.py) with recorded samples
and an injected /proc reader: waiting on I/O is no fault until --hang-io-timeout, a
stopped trainer is frozen without stacks, the fault carries the verdict as data."""

from __future__ import annotations

import asyncio
from typing import Any

from ftagent.agent.proc_wait import Waits
from ftagent.detect.liveness import ProcessSample, Snapshot
from ftagent.detect.stall import Blocked
from tests.unit.test_verify_early import Rig


def remote_read(rig: Rig) -> Waits:
    snap = rig.sampler.snaps[-1]
    p = snap.processes[0]
    assert p.threads
    return Waits([Blocked(p.pid, p.threads[0].tid, "recvfrom", "remote",
                          "tcp 10.0.0.9:9000")])


def test_a_thread_blocked_on_a_remote_read_waits_on_io_and_raises_nothing() -> None:
    async def go() -> None:
        rig = Rig("data_stall")
        rig.v.waits = lambda pids: remote_read(rig)
        await rig.run_until(rig.now[0] + 20.0)
        assert rig.raised == [], [f.message for _, f in rig.raised]
        io = [f for e, k, f in rig.events if (e, k) == ("verify", "waiting_on_io")]
        assert io and io[0]["rule"] == "I1"

    asyncio.run(go())


def test_past_the_io_budget_it_is_a_hang_naming_the_budget() -> None:
    async def go() -> None:
        rig = Rig("data_stall", hang_io_timeout=8.0)
        rig.v.rank = 2
        rig.v.waits = lambda pids: remote_read(rig)
        await rig.run_until(rig.now[0] + 30.0)
        (_, f), = rig.raised
        assert f.evidence["rule"] == "I2" and f.evidence["culprits"] == [2]
        assert "--hang-io-timeout" in f.message and "tcp 10.0.0.9:9000" in f.message
        assert f.evidence["stall"]["budget_flag"] == "--hang-io-timeout"

    asyncio.run(go())


def test_without_the_reader_the_same_stall_is_a_hang_as_before() -> None:
    async def go() -> None:
        rig = Rig("data_stall")
        await rig.run_until(rig.now[0] + 10.0)
        (_, f), = rig.raised
        assert f.evidence["rule"] == "H1" and f.evidence["verdict"] == "hung"

    asyncio.run(go())


class Stopped:
    """A SIGSTOPped trainer: /proc says T; py-spy gives nothing."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    async def sample(self, stacks: bool = True, pids: Any = None
                     ) -> tuple[Snapshot, list[dict[str, Any]]]:
        t = self.clock[0]
        p = ProcessSample(7, t, 12.0, 0, None, "stopped",
                          errors=("py-spy dump failed (the process is stopped: SIGSTOP)",))
        return Snapshot(t, (p,)), [{"pid": 7, "stack": None}]


def test_a_stopped_trainer_is_frozen_and_its_restart_kills() -> None:
    async def go() -> None:
        rig = Rig("data_stall")
        rig.v.rank = 1
        rig.v.sampler = rig.sampler = Stopped(rig.now)  # type: ignore[assignment]
        await rig.run_until(rig.now[0] + 10.0)
        (_, f), = rig.raised
        assert f.evidence["verdict"] == "frozen" and f.evidence["rule"] == "F1", f.message
        assert f.evidence["kill"] is True and f.evidence["culprits"] == [1]
        assert "frozen: pid 7" in f.message

    asyncio.run(go())


def test_the_answer_to_the_arbiter_makes_a_rank_waiting_on_io_busy() -> None:
    async def go() -> None:
        rig = Rig("data_stall")
        rig.v.waits = lambda pids: remote_read(rig)
        await rig.run_until(rig.now[0] + 6.0)
        got = await rig.v.stacks_for_arbiter()
        live = got["liveness"]
        assert live["state"] == "alive" and live["stall"]["state"] == "waiting_on_io", live

    asyncio.run(go())


