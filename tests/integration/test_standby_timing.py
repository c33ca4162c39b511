"""When a WarmStarter starts the next standby (issue 26), against real processes: not with
the trainer, but at the attempt's first step, or ``after`` seconds without one; never for
an attempt that has ended; and ``aclose`` leaves no standby unreaped."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from ftagent.agent.standby import WarmStarter
from ftagent.agent.standby_memory import DEFAULT_STANDBY_BYTES, StandbyBudget
from ftagent.agent.supervisor import ChildReaper
from tests.conftest import pid_gone


async def started(tmp: Path, after: float, *, step: bool, wait_exit: bool = False,
                  budget: StandbyBudget | None = None
                  ) -> tuple[WarmStarter, dict[int, int], int, bool]:
    """Start a sleeping trainer through a WarmStarter; optionally report a step or let
    the trainer end first; return the starter, its standbys once settled, the trainer's
    pid and whether every standby was reaped after ``aclose``."""
    script = tmp / "train.py"
    script.write_text("import json, sys, time\nif sys.argv[1] == 'sleep':\n"
                      "    time.sleep(60)\n")
    loop = asyncio.get_running_loop()
    reaper = ChildReaper()
    reaper.install(loop)
    starter = WarmStarter(workdir=str(tmp), after=after, budget=budget)
    try:
        arg = "exit" if wait_exit else "sleep"
        s = starter.start([sys.executable, str(script), arg], {"PATH": "/usr/bin:/bin"},
                          reaper)
        assert starter.standby_pids() == {}  # nothing beside the trainer's start-up
        if wait_exit:
            await s.exited
        if step:
            starter.stepped()
        else:  # the fallback timer: a standby no sooner than ``after``
            t0 = loop.time()
            while not starter.standby_pids() and loop.time() - t0 < after + 30:
                await asyncio.sleep(0.01)
            assert loop.time() - t0 >= after * 0.9  # a timer may fire a hair early
        pids = starter.standby_pids()
        if budget is not None:  # its imports done, the standby is measured
            t0 = loop.time()
            while starter.importing() and loop.time() - t0 < 30:
                await asyncio.sleep(0.01)
        await starter.aclose()
        reaped = all(pid_gone(p) for p in pids.values())
        if s.exited.done() is False:
            s.popen.kill()
            await s.exited
        return starter, pids, s.popen.pid, reaped
    finally:
        reaper.uninstall()


def test_the_first_step_starts_the_standby_and_aclose_reaps_it(tmp_path: Path) -> None:
    budget = StandbyBudget(0.9, read=lambda: None)
    starter, pids, _, reaped = asyncio.run(started(tmp_path, 60.0, step=True, budget=budget))
    assert list(pids) == [0] and reaped
    assert starter.standby_pids() == {}
    # measured once ready: a Python that imported json, far below torch's default guess
    assert 0 < budget.expected < DEFAULT_STANDBY_BYTES // 4


def test_without_a_step_the_standby_starts_after_the_delay(tmp_path: Path) -> None:
    _, pids, _, reaped = asyncio.run(started(tmp_path, 0.3, step=False))
    assert list(pids) == [0] and reaped


def test_no_standby_for_an_attempt_that_already_ended(tmp_path: Path) -> None:
    _, pids, _, _ = asyncio.run(started(tmp_path, 60.0, step=True, wait_exit=True))
    assert pids == {}
