"""`make demo` (ftagent demo) finishes on its own, recovers, and leaves nothing behind."""

from __future__ import annotations

import subprocess

import psutil

from tests.conftest import PY
from tests.e2e.jobs import needs_torch

pytestmark = needs_torch


def test_demo_recovers_from_crash_and_hang_and_cleans_up() -> None:
    before = {p.pid for p in psutil.process_iter()}
    r = subprocess.run([PY, "-m", "ftagent", "demo", "--steps", "30"], capture_output=True,
                       text=True, timeout=180)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-2000:]
    assert "result: job succeeded" in out
    assert "culprit rank 1" in out and "dump_stacks" in out
    assert out.count(" restart ") >= 2  # the crash, then the hang
    leftovers = [p for p in psutil.process_iter(["pid", "cmdline"])
                 if p.pid not in before and any("train.py" in c or "ftagent" in c
                                                for c in (p.info["cmdline"] or []))]
    assert not leftovers, leftovers
