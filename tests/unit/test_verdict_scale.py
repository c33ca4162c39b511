"""bench/verdict_scale.py, small: simulated ranks' stacks and flight-recorder summaries
fed to the real registry name exactly the stuck ranks (issue 35, item 8).

``test_more_process_groups_than_64`` fails on the old code: the verdict kept the first 64
distinct process groups of the whole job, so in a job of 68 tensor-parallel pairs the
groups past the 64th were dropped (the stuck rank's pair among them), the waiting rank
of that pair looked "behind" in the world group and was named with the stuck one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "verdict_scale.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("verdict_scale_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seed", [0, 1])
def test_64_ranks_two_culprits_are_named(bench: ModuleType, seed: int) -> None:
    culprits = bench.pick_culprits(64, 2, 8, seed)
    got = bench.Rig(64).hang(culprits, 8, seed)
    assert got.verdict == "restart" and got.named == tuple(sorted(culprits)), got.reason
    assert len(culprits) == 2
    pods = ", ".join(f"{r} (pod scale-worker-{r}, node node-{r // 8})" for r in sorted(culprits))
    assert f"culprit ranks {pods}; every rank restarts" in got.reason, got.reason


def test_more_process_groups_than_64(bench: ModuleType) -> None:
    got = bench.Rig(136).hang({131}, 2, 0)  # 68 pairs and the world group: tp65
    assert got.verdict == "restart" and got.named == (131,), got.reason
    assert "never reached collective #400 (all_reduce) of process group tp65" in got.reason
