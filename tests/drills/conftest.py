"""Drills: every fault class end to end on a real job spread over simulated nodes.

Each module runs one lab (tests/lab) and, where honest, one long-running job with its
faults in sequence, so the set stays within a few minutes on 2 cores. Run the set with
``pytest tests/drills`` (or ``-m drill``). Without CAP_NET_ADMIN a drill is skipped with the
reason; with ``FTAGENT_REQUIRE_NETNS=1`` (CI, as root) that is a failure instead.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from tests.e2e.jobs import HAVE_TORCH
from tests.lab import Lab, wait
from tests.netns import require_netns


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "drill: a fault drill on the lab (tests/drills)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/drills/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.drill)
            item.add_marker(pytest.mark.netns)
            item.add_marker(pytest.mark.torch)


def require_lab() -> None:
    """Skip (or, with FTAGENT_REQUIRE_NETNS=1, fail) where a lab cannot run."""
    if not HAVE_TORCH:
        pytest.skip("needs torch (make venv installs it)")
    require_netns()


# What every drill module reads off its lab


def decisions(lab: Lab, action: str) -> list[dict[str, Any]]:
    return [e for e in lab.timeline() if e["kind"] == "decision" and e["action"] == action]


def generation(lab: Lab) -> int:
    """The job's generation, from the last barrier the arbiter released (-1: none yet)."""
    return max((int(e["generation"]) for e in lab.timeline()
                if e.get("action") == "release_barrier"), default=-1)


def ready(lab: Lab, checkpoint_every: int) -> None:
    """The job settled and past its first checkpoint: where every drill starts, so that a
    drill run alone (``pytest tests/drills -k NAME``) finds what one run after the others
    does. Counts a drill checks (generations, decisions, restarts) are taken from here on."""
    lab.settled()
    trained_past(lab, checkpoint_every + 3, timeout=180)


def trained_past(lab: Lab, step: int, timeout: float = 120) -> None:
    wait(lambda: all(lab.steps(r) > step for r in (0, 1)), timeout,
         f"both ranks past step {step}", lab)


def resumed(lab: Lab, r: int) -> list[int]:
    """The steps rank ``r``'s attempts resumed from (examples/train.py's checkpoint line)."""
    return [int(s) for s in re.findall(r"resumed from checkpoint at step (\d+)", lab.log(r))]


def before_last_resume(lab: Lab, r: int) -> str:
    """Rank ``r``'s log up to its latest resume: the attempts before it, whole once it
    resumed (the log trails the trainer by the agent's output batching)."""
    text = lab.log(r)
    return text[:text.rfind("] resumed from checkpoint at step ")]


def ledger_accounts(lab: Lab, kind: str) -> dict[str, Any]:
    """The arbiter's goodput ledger right after a fault of ``kind`` was restarted from
    (issue 24): its categories sum to the job's wall time (first registration to now,
    within 1 %), and the newest incident is that fault's, resumed after the step the
    trainers printed ("resumed from checkpoint at step N", reported by the agents) with
    the steps redone that rank 0's log shows: the last step it printed before that resume
    minus that step. Returns the incident."""
    stamp = min(float(e["ts"]) for e in lab.timeline())
    t0 = time.time()
    st = lab.status()
    t1 = time.time()
    g = st["goodput"]
    assert g is not None, st
    assert abs(sum(g["seconds"].values()) - g["wall_seconds"]) < 1e-6, g
    # the job's wall starts at its first registration: no later than the timeline's first
    # entry (the last rank's), up to a loaded agent's start-up earlier than it
    first = float(g["started_at"])
    assert first <= stamp, (first, stamp)
    assert 0.99 * (t0 - first) <= g["wall_seconds"] <= 1.01 * (t1 - first), (g, t0 - first)
    inc = g["per_incident"][-1]
    # the last step printed before the latest resume: the step the job had reached (an
    # attempt stopped before its first step moved it nowhere)
    reached = int(re.findall(r"\] step=(\d+)/", before_last_resume(lab, 0))[-1])
    assert inc["kind"] == kind and inc["resume_source"] == "reported", (inc, lab.dump())
    assert inc["resumed_step"] == resumed(lab, 0)[-1], (inc, resumed(lab, 0))
    assert inc["recomputed_steps"] == reached - inc["resumed_step"], (inc, reached)
    return dict(inc)
