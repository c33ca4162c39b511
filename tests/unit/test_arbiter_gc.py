"""The arbiter process runs the cyclic collector rarely (``cmd/arbiter.collect_rarely``).

With CPython's default thresholds a 10,000-agent failover ran 11 full collections of a
~450 MB heap, each stopping the event loop for up to 0.9 s (``bench/arbiter_scale.py``'s
fault -> RESTART p99 outliers). The thresholds are set in ``main``, the process's entry,
never on import: tests and tools that import the module keep their interpreter's own."""

from __future__ import annotations

import subprocess
import sys

from ftagent.cmd import arbiter

PROGRAM = """
import gc, sys
before = gc.get_threshold()
import ftagent.cmd.arbiter as a
assert gc.get_threshold() == before, "importing the module changed the collector"
async def run(cfg):
    print(gc.get_threshold())
    return 0
a.run = run
a.end_process = lambda rc: rc
sys.exit(a.main(["--listen", "127.0.0.1:0", "--insecure", "--metrics-port", "-1"]))
"""


def test_the_arbiter_process_sets_rare_collection_before_it_serves() -> None:
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(arbiter.GC_THRESHOLDS)


def test_a_full_collection_still_runs_eventually() -> None:
    t0, t1, t2 = arbiter.GC_THRESHOLDS
    assert t0 > 700 * 10  # young collections at least ten times rarer than the default
    assert t0 * t1 * t2 <= 20_000_000  # cycles reclaimed within ~10 million net allocations
