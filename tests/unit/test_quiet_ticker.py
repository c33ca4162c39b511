"""The worker's ticker leaves the output grid while nothing is printed (issue 36, the hang
path): a look that finds no output waiting sets ``LineFeed.quiet``, the ticker then sleeps
until its detectors' due time (or a wake), and the pumps wake it with the next batch,
handled at once. On the old ticker every 0.5 s grid point woke it, through a whole hang's
budget and verification, to find nothing (2 calls into waits.py each on the hang walk),
and a batch waited for the next grid point."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from ftagent.agent import worker as worker_module
from ftagent.agent.worker import Worker, WorkerSpec
from ftagent.cmd.run import parse
from tests.conftest import until


def _worker() -> Worker:
    return Worker(WorkerSpec(parse(["--max-restarts", "0", "--", "true"], {})))


def test_a_quiet_ticker_sleeps_past_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """No output, nothing due: one wait with no time limit, not one per grid point (0.05 s
    here: about 8 in 0.4 s on the old ticker)."""
    waits: list[float | None] = []
    real = worker_module.until_set

    async def counted(ev: asyncio.Event, timeout: float | None) -> bool:
        waits.append(timeout)
        return await real(ev, timeout)

    monkeypatch.setattr(worker_module, "TICK_SECONDS", 0.05)
    monkeypatch.setattr(worker_module, "until_set", counted)

    async def main() -> None:
        w = _worker()
        w.feed.pumps_callback()  # a trainer's backlog, empty
        task = asyncio.create_task(w._ticker())
        await asyncio.wait({task}, timeout=0.4)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert len(waits) <= 2 and waits[-1] is None, waits


def test_the_first_batch_after_a_quiet_spell_is_handled_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pump's batch while the ticker is quiet wakes it: the line reaches the worker
    long before the next grid point (60 s here; the old ticker waited for it)."""
    monkeypatch.setattr(worker_module, "TICK_SECONDS", 60.0)

    async def main() -> list[Any]:
        w = _worker()
        hop = w.feed.pumps_callback()
        task = asyncio.create_task(w._ticker())
        for _ in range(3):
            await asyncio.sleep(0)  # parked in its quiet wait
        t = threading.Thread(target=hop, args=("stdout", b"step 1 loss 1.0\n", 0.0))
        t.start()
        t.join()
        try:
            return await until(lambda: w.last_lines.tail(5), timeout=5.0,
                               what="the batch handled")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    assert asyncio.run(main()) == [("stdout", b"step 1 loss 1.0")]


class _AlwaysDue:
    """A detector whose next tick is always now (a broken one is ticked every time)."""

    def __init__(self) -> None:
        self.ticks = 0

    def observe(self, obs: Any) -> list[Any]:
        return []

    def tick(self, now: float) -> list[Any]:
        self.ticks += 1
        return []

    def next_tick(self, now: float) -> float:
        return now


def test_a_quiet_ticker_keeps_the_grid_when_a_tick_leaves_something_due(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Quiet or not, a tick that leaves something due at once waits for the grid point:
    never a spin (a first quiet ticker took no grid then: thousands of ticks)."""
    from ftagent.agent.worker_parts import WorkerParts

    monkeypatch.setattr(worker_module, "TICK_SECONDS", 0.05)
    det = _AlwaysDue()

    async def main() -> None:
        w = Worker(WorkerSpec(parse(["--max-restarts", "0", "--", "true"], {})),
                   parts=lambda w: WorkerParts(detectors=(det,)))
        task = asyncio.create_task(w._ticker())
        await asyncio.wait({task}, timeout=0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert 1 <= det.ticks <= 12, det.ticks
