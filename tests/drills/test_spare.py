"""A warm spare takes over a replaced rank, on a lab of three nodes (two ranks, one spare).

A fatal Xid (79) on rank 1's simulated GPU makes the arbiter REPLACE rank 1 and ASSIGN
it to the spare on node 2 (``ftagent run --spare``, its trainer's warm standby ready):
the spare arrives at the new generation's barrier as rank 1, its trainer starts from
the standby (no cold import), and the job trains again without waiting for a new pod.
The replaced rank's pod, started again as Kubernetes would, claims rank 1 and is told to
serve as the job's spare. Everything is read off the arbiter's timeline and the agents'
events files, with deadlines, never sleeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ftagent.model import EXIT_REPLACE
from tests.drills.conftest import decisions, generation, require_lab
from tests.lab import Lab, line_of, wait
from tests.lab.lab import FAST_ENV

pytestmark = pytest.mark.timeout(300)

AGENT = ["--hang-timeout-min", "5", "--max-restarts", "5"]
ENV = {"TRAIN_STEPS": "1000000", "CHECKPOINT_EVERY": "10"}


def events(lab: Lab, r: int, event: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in lab.events(r) if e.get("event") == event and e.get("kind") == kind]


def test_a_fatal_xid_moves_the_rank_to_the_warm_spare(tmp_path: Path) -> None:
    require_lab()
    gpus = tmp_path / "gpus.txt"
    gpus.write_text("gpus 1\nt=15s rank=1 gpu=0 xid=79\n")  # the clock starts with the agent
    with Lab(tmp_path / "lab", 2, arbiter_args=["--max-restarts", "5"], spares=1) as lab:
        lab.env, lab.flags = {**FAST_ENV, **ENV}, AGENT
        lab.start_rank(0)
        lab.start_rank(1, ["--gpu-backend", f"simulated:{gpus}", "--gpu-poll-interval", "0.2"])
        lab.start_rank(2, spare=True)
        wait(lambda: events(lab, 2, "state", "spare"), 60, "the spare to serve", lab)
        wait(lambda: decisions(lab, "assign"), 120, "rank 1 assigned to the spare", lab)
        assign = decisions(lab, "assign")[-1]
        assert "spare lab-spare-2 on node node-2 takes rank 1" in assign["message"], \
            line_of(assign)
        assert lab.agents[1].wait(60) == EXIT_REPLACE, lab.dump()
        wait(lambda: generation(lab) >= 1 and lab.attempt_steps(0) >= 3
             and lab.attempt_steps(2) >= 3, 120, "the job training again with the spare", lab)
        assigned = events(lab, 2, "state", "assigned")
        assert assigned and assigned[-1]["rank"] == 1, assigned
        warm = events(lab, 2, "standby", "warm")
        assert warm and warm[0]["rank"] == 1 and warm[0]["ts"] >= assigned[-1]["ts"], \
            (warm, lab.dump())
        assert not events(lab, 2, "standby", "cold"), lab.dump()
        # its series say the rank it trains as now (they said rank="-1" while it served)
        wait(lambda: "ftagent_spare{" in lab.metrics(2), 30, "the spare's /metrics", lab)
        text = lab.metrics(2)
        spare = [ln for ln in text.splitlines() if ln.startswith("ftagent_spare{")]
        assert spare and all('rank="1"' in ln and ln.endswith(" 0.0") for ln in spare), spare
        assert 'rank="-1"' not in text, [ln for ln in text.splitlines() if 'rank="-1"' in ln]
        # the replaced pod comes back (a controller recreates it): it becomes the spare
        lab.start_rank(1)
        wait(lambda: events(lab, 1, "state", "spare"), 60, "the pod back to serve as spare",
             lab)
        said = [e["message"] for e in lab.timeline()]
        assert any("is held by spare lab-spare-2" in m for m in said), said
