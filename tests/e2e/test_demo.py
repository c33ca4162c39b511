"""`make demo` (ftagent demo) finishes on its own, recovers, and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import uuid

import psutil

from tests.conftest import PY
from tests.e2e.jobs import needs_torch

pytestmark = needs_torch


def test_demo_recovers_from_crash_and_hang_and_cleans_up() -> None:
    tag = uuid.uuid4().hex  # every process the demo starts inherits it
    r = subprocess.run([PY, "-m", "ftagent", "demo", "--steps", "30", "--step-time", "0.05"],
                       capture_output=True,
                       text=True, timeout=180, env=dict(os.environ, FTAGENT_DEMO_TAG=tag))
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-2000:]
    assert "result: job succeeded" in out
    # the hung rank named: by the arbiter from every rank's stacks (DUMP_STACKS) -- the
    # flight recorder (it never reached the collective its peer waits in), or the stacks
    # where the dumps did not decide -- or, where rank 1's own verification ended before
    # its waiting peer asked (both budgets at the floor: a race either may win), by its
    # own verified hang, parked where the fault put it
    assert ("rank 1 at #" in out and "never reached collective" in out
            or "rank 1 is not in a collective" in out) and "dump_stacks" in out \
        or "rank 1: hang" in out and "parked in hang_before_collective" in out, out[-3000:]
    assert out.count(" restart ") >= 2  # the crash, then the hang
    assert not [p for p in psutil.process_iter() if tagged(p, tag)], "processes left behind"


def tagged(p: psutil.Process, tag: str) -> bool:
    try:
        return p.environ().get("FTAGENT_DEMO_TAG") == tag
    except psutil.Error:
        return False
