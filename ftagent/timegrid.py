"""Periodic work on one grid of the loop's clock, so one process's timers share wake-ups.

Each wake-up of an idle agent costs more than the work it does (the interpreter and the
kernel: ~0.2-0.5 ms on a 2-core VM, bench/restart.py --overhead), so the detectors' tick,
the NIC counters and the GPU poll sleep to the next multiple of their period on the
loop's clock instead of ``period`` after their own last run: periods that divide each
other (0.5 s, 1 s) then run in the same loop iteration, and N workers' ticks in one.
The interval between two runs of one task stays ``period``.
"""

from __future__ import annotations

import asyncio


async def sleep_on_grid(period: float) -> None:
    """Sleep until the loop's clock is next a multiple of ``period`` (> 0)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(period - loop.time() % period)
