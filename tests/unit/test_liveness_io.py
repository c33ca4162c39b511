"""I/O is life (issue 22, item 5): a silent save or scan whose storage bytes advance is
alive, not spinning, for as long as they advance and at most --hang-phase-timeout; a save
whose bytes stopped with a still stack is a hang, as before. Pure: synthetic samples and
the Verifier on an injected clock (tests/unit/test_liveness.py's rig)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from ftagent.agent.stall_window import window_of
from ftagent.detect.liveness import Frame, Liveness, Snapshot, judge
from ftagent.detect.stall import Act, Budget, decide
from ftagent.model import FaultKind
from tests.unit.test_liveness import MAIN, Rig, proc, thread, window

SAVE = (Frame("save", "serialization.py", 966, True), Frame("checkpoint", "train.py", 77)) \
    + MAIN
WRITE = (Frame("write", "serialization.py", 1002, True),
         Frame("checkpoint", "train.py", 77)) + MAIN
MIB = 1 << 20


def test_a_save_spinning_at_one_line_with_bytes_advancing_is_alive_by_io() -> None:
    snaps = window([[proc(i * 0.5, i * 0.45, [thread(SAVE)], io=i * 40 * MIB)]
                    for i in range(5)])
    v = judge(snaps)
    assert v.state is Liveness.ALIVE and v.by_io, v.reason
    assert "storage I/O advancing at 80.0 MiB/s" in v.reason and "spinning" in v.reason
    assert v.to_json()["by_io"] is True


def test_the_same_save_with_its_bytes_stopped_spins_as_before() -> None:
    snaps = window([[proc(i * 0.5, i * 0.45, [thread(SAVE)], io=7 * MIB)] for i in range(5)])
    v = judge(snaps)
    assert v.state is Liveness.SPINNING and not v.by_io


def test_a_write_parked_on_a_dead_mount_is_hung_and_alive_while_bytes_flow() -> None:
    stuck = window([[proc(i * 0.5, 0.0, [thread(WRITE, active=False)], io=3 * MIB)]
                    for i in range(5)])
    assert judge(stuck).state is Liveness.HUNG
    flowing = window([[proc(i * 0.5, 0.0, [thread(WRITE, active=False)], io=i * 8 * MIB)]
                      for i in range(5)])
    v = judge(flowing)
    assert v.state is Liveness.ALIVE and v.by_io


def test_a_trickle_below_io_busy_is_no_life() -> None:
    """A chatty logger's bytes (64 KiB/s) do not keep a still stack alive."""
    snaps = window([[proc(i * 0.5, 0.0, [thread(WRITE, active=False)], io=i * 32 * 1024)]
                    for i in range(5)])
    assert judge(snaps).state is Liveness.HUNG


def test_io_in_another_process_of_the_tree_keeps_the_tree_alive() -> None:
    snaps = window([[proc(i * 0.5, 0.0, [thread(WRITE, active=False)], pid=10),
                     proc(i * 0.5, 0.0, None, pid=11, io=i * 20 * MIB)] for i in range(5)])
    v = judge(snaps)
    assert v.state is Liveness.ALIVE and v.by_io and "pid 11" in v.reason


def test_alive_by_io_is_bounded_by_the_phase_budget() -> None:
    snaps = window([[proc(i * 0.5, i * 0.45, [thread(SAVE)], io=i * 40 * MIB)]
                    for i in range(5)])
    v = judge(snaps)
    seen = window_of(v, snaps)  # the stall policy's rows A2/A3 decide (detect/stall.py)
    assert decide(Budget(100.0, 3.0, phase_timeout=1800.0), seen).rule == "A2"
    got = decide(Budget(1800.0, 3.0, phase_timeout=1800.0), seen)
    assert (got.rule, got.act) == ("A3", Act.DECLARE)


def test_a_silent_save_longer_than_the_spin_budget_is_no_fault_until_the_phase_budget() -> None:
    """Scaled down: a 3 s spin budget, a 40 s save doing I/O, --hang-phase-timeout 60 s."""

    async def go() -> None:
        saving = [[proc(0, i * 0.45, [thread(SAVE)], io=0)] for i in range(5)]
        r = Rig(saving, hang_spin_timeout=3.0, hang_phase_timeout=60.0)
        # the fake sampler stamps samples with the rig's clock; I/O grows with each call
        calls = [0]
        sample = r.sampler.sample

        async def with_io() -> tuple[Snapshot, list[dict[str, Any]]]:
            snap, entries = await sample()
            calls[0] += 1
            ps = tuple(dataclasses.replace(p, io=calls[0] * 40 * MIB) for p in snap.processes)
            return Snapshot(snap.ts, ps), entries

        r.sampler.sample = with_io  # type: ignore[method-assign]
        start = r.now[0]
        assert await r.run_until(start + 40.0) == []
        assert set(r.kinds("verify")) == {"alive"}
        # the bytes keep advancing past the phase budget: declared, saying why
        faults = await r.run_until(start + 75.0)
        (f,) = faults
        assert f.kind is FaultKind.HANG and "over --hang-phase-timeout (60s)" in f.message

    asyncio.run(go())


def test_the_same_save_without_io_is_declared_at_the_spin_budget() -> None:
    async def go() -> None:
        r = Rig([[proc(0, i * 0.45, [thread(SAVE)], io=0)] for i in range(5)],
                hang_spin_timeout=8.0)
        start = r.now[0]
        (f,) = await r.run_until(start + 15.0)
        assert f.message.startswith("spinning in save (serialization.py:966)")

    asyncio.run(go())



def test_a_paced_save_moving_between_its_writes_and_sleeps_is_alive_by_io() -> None:
    """examples/train.py's SILENT_SAVES: torch.save, fsync, then a sleep to hold the rate;
    most samples find it asleep."""
    nap = (Frame("sleep", "train.py", 120), Frame("silent_save", "train.py", 121)) + MAIN
    stacks = [nap, SAVE, nap, nap, SAVE]
    snaps = window([[proc(i * 0.5, 0.02 * i, [thread(s, active=s is SAVE)],
                          io=i * 4 * MIB)] for i, s in enumerate(stacks)])
    v = judge(snaps)
    assert v.state is Liveness.ALIVE and v.by_io and "storage I/O advancing" in v.reason
