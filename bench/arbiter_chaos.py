"""The arbiter chaos soak: tests/integration/test_arbiter_chaos.py, 20 seeds.

    nice -n 10 .venv/bin/python bench/arbiter_chaos.py [--runs 20] [--rounds 4] [--seed 1]

Each run is the suite's chaos test for one seed (two real agents, shell trainers, the
arbiter SIGKILLed at seeded random moments: crashes inside outages, kills within a second
of a crash, quiet kills, a last kill while the trainers finish) with FTAGENT_CHAOS_ROUNDS
rounds and the seed ``--seed + i``; prints each run's result, crashes, restarts,
generation and state, then the counts (replay one with FTAGENT_CHAOS_SEEDS=SEED).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/integration/test_arbiter_chaos.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    failed = []
    for i in range(args.runs):
        seed = args.seed + i
        env = {**os.environ, "FTAGENT_CHAOS_SEEDS": str(seed),
               "FTAGENT_CHAOS_ROUNDS": str(args.rounds)}
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p",
                            "no:cacheprovider", "-o", "timeout=1800", TEST], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        ok = p.returncode == 0
        said = next((line.partition(": ")[2] for line in p.stdout.splitlines()
                     if line.startswith(f"chaos seed {seed}:")), "")
        print(f"run {i + 1}: seed {seed}, {args.rounds} rounds: "
              f"{'ok' if ok else 'FAILED'} ({time.monotonic() - t0:.0f} s) {said}",
              flush=True)
        if not ok:
            failed.append(seed)
            print(p.stdout[-4000:])
    print(f"{args.runs - len(failed)}/{args.runs} runs passed"
          + (f"; failed seeds: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
