"""Two revisions side by side: restart latency, launcher CPU, arbiter scale, with ratios.

    .venv/bin/python bench/side_by_side.py REV_A REV_B [--reps 2] [--only restart,overhead,scale]

Checks out both revisions into temporary git worktrees (removed at the end) and runs each
revision's own benchmarks with this interpreter (this venv: torch, grpc) and PYTHONPATH
pointed at that tree, so ``python -m ftagent`` in every child process is that revision's:

- restart: ``bench/restart.py --reps 1 --default-reps 0 --kinds ftagent-cold,ftagent-warm``
  (crash of a 2-rank gloo job -> every rank training again, the trainers' own clocks; and
  the first start -> first step)
- overhead: ``bench/restart.py --overhead --reps 1 --window W`` (the launcher's own CPU
  and PSS for 2 workers; torchrun's in the same run, as the load reference)
- scale: ``bench/arbiter_scale.py --levels 1000 --workers 2 --window W --rounds 2``

Each repetition runs A then B, the next B then A (load drift hits both alike). Prints every
run's figures as they come, then the medians of A and B and B/A. A figure a revision's
bench does not print is shown as "-".
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUM = r"([\d.]+)"


def section(text: str, start: str) -> str:
    """The lines of ``text`` from the one starting with ``start`` to the next blank line."""
    i = text.find(start)
    if i < 0:
        return ""
    j = text.find("\n\n", i)
    return text[i:] if j < 0 else text[i:j]


def parse_restart(out: str) -> dict[str, float]:
    got: dict[str, float] = {}
    for name, head in (("restart", "crash -> every rank training again"),
                       ("first start", "first start -> first step")):
        for kind, v in re.findall(rf"^\s+(ftagent-cold|ftagent-warm)\s+{NUM} s",
                                  section(out, head), re.M):
            got[f"{name} {kind.removeprefix('ftagent-')} s"] = float(v)
    return got


def parse_overhead(out: str) -> dict[str, float]:
    got: dict[str, float] = {}
    tail = section(out, "launcher's own steady state")
    for kind, cpu, pss in re.findall(rf"^\s+(torchrun|ftagent)\s+CPU\s+{NUM} %\s+PSS\s+{NUM} "
                                     "MiB", tail, re.M):
        got[f"launcher CPU % ({kind})"] = float(cpu)
        got[f"launcher PSS MiB ({kind})"] = float(pss)
    return got


def parse_scale(out: str) -> dict[str, float]:
    rows = re.findall(r"^\s*(\d+)" + r"\s+" + r"\s+".join([NUM] * 10) + r"\s*$", out, re.M)
    if not rows:
        return {}
    r = [float(x) for x in rows[-1]]
    return {"scale ramp s": r[1], "scale arbiter CPU %": r[2], "scale RSS MiB": r[3],
            "scale fault->restart p50 ms": r[5], "scale p99 ms": r[6],
            "scale barrier ms": r[9]}


def run(tree: Path, args: list[str], timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    try:
        p = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else ""
        return out + f"\n(timed out after {timeout:.0f} s)"
    if p.returncode != 0:
        sys.stderr.write(f"  {' '.join(args[:2])} in {tree.name} exited {p.returncode}: "
                         f"{p.stderr[-600:]}\n")
    return p.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("--reps", type=int, default=2, help="repetitions, alternated")
    ap.add_argument("--only", default="restart,overhead,scale")
    ap.add_argument("--window", type=float, default=10.0,
                    help="seconds of each steady-state window (overhead, scale)")
    args = ap.parse_args()
    parts = args.only.split(",")
    benches: list[tuple[str, list[str], Callable[[str], dict[str, float]], float]] = []
    if "restart" in parts:
        benches.append(("restart", ["bench/restart.py", "--reps", "1", "--default-reps", "0",
                                    "--kinds", "ftagent-cold,ftagent-warm"],
                        parse_restart, 600))
    if "overhead" in parts:
        benches.append(("overhead", ["bench/restart.py", "--overhead", "--reps", "1",
                                     "--window", f"{args.window:g}"], parse_overhead, 600))
    if "scale" in parts:
        benches.append(("scale", ["bench/arbiter_scale.py", "--levels", "1000", "--workers",
                                  "2", "--window", f"{args.window:g}", "--rounds", "2",
                                  "--max-seconds", "240"], parse_scale, 400))
    revs = {}
    for label, rev in (("A", args.rev_a), ("B", args.rev_b)):
        sha = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        revs[label] = (rev, sha)
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"A = {revs['A'][0]} ({revs['A'][1][:10]}), B = {revs['B'][0]} "
          f"({revs['B'][1][:10]}); {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
          flush=True)
    figures: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as tmp:
        trees = {k: Path(tmp) / k for k in revs}
        try:
            for k, (_, sha) in revs.items():
                subprocess.run(["git", "worktree", "add", "--detach", str(trees[k]), sha],
                               cwd=ROOT, check=True, capture_output=True)
            for rep in range(args.reps):
                for name, cmd, parse, timeout in benches:
                    for k in ("A", "B") if rep % 2 == 0 else ("B", "A"):
                        t0 = time.monotonic()
                        got = parse(run(trees[k], cmd, timeout))
                        for m, v in got.items():
                            figures[k].setdefault(m, []).append(v)
                        shown = ", ".join(f"{m} {v:g}" for m, v in got.items()) or "no figure"
                        print(f"  rep {rep + 1} {name:8s} {k}: {shown} "
                              f"({time.monotonic() - t0:.0f} s)", flush=True)
        finally:
            for t in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(t)], cwd=ROOT,
                               capture_output=True)
    print(f"\nmedians over {args.reps} alternated runs (B/A: < 1 is B lower)")
    print(f"  {'figure':34s} {'A':>10s} {'B':>10s} {'B/A':>7s}")
    names = list(dict.fromkeys([*figures["A"], *figures["B"]]))
    for m in names:
        a = statistics.median(figures["A"][m]) if m in figures["A"] else None
        b = statistics.median(figures["B"][m]) if m in figures["B"] else None
        ratio = f"{b / a:7.2f}" if a and b is not None else "      -"
        print(f"  {m:34s} {'-' if a is None else f'{a:.2f}':>10s} "
              f"{'-' if b is None else f'{b:.2f}':>10s} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
