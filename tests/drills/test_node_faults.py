"""Faults of a node's link, GPU and agent on a 2-node lab, in sequence on one job.

1. rank 1's carrier drops for less than --nic-grace -> a flap: counted, no fault, no restart
2. it drops for longer than the grace, then returns -> the arbiter waits while it is down;
   once it is back, TCP resumes the stalled all-reduce and every rank's step advances: the
   outage is recorded and nothing restarts (the arbiter would restart every rank if the
   steps did not advance within the outage's length plus 5 s: tests/unit/test_policy.py);
   the goodput ledger books the stall as an incident without a restart (``outage``)
3. it stays down past --nic-replace-after -> rank 1 is replaced (its agent exits with the
   replace status, 215); the lab starts a new agent for rank 1 with the link back, as a
   controller reschedules the pod on a healthy node; the job trains again
4. a fatal Xid (79, fell off the bus) through the simulated GPU backend on that new rank 1
   -> replace path again, and another new agent takes over
5. rank 1's agent is SIGKILLed (the pod dies): its trainer dies with it; the job restarts
   when the lab starts a new agent for rank 1

Node NotReady, pod preemption and leader failover need the fake API server; see
test_cluster_faults.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from ftagent.model import EXIT_REPLACE
from tests.drills.conftest import (
    before_last_resume,
    decisions,
    generation,
    ledger_accounts,
    ready,
    require_lab,
    resumed,
    trained_past,
)
from tests.lab import Lab, line_of, wait

pytestmark = pytest.mark.timeout(600)

GRACE = 1.5  # --nic-grace
REPLACE_AFTER = 3.0  # --nic-replace-after
CKPT_EVERY = 10
ARBITER = ["--max-restarts", "20", "--nic-replace-after", str(REPLACE_AFTER)]
AGENT = ["--hang-timeout-min", "5", "--max-restarts", "20", "--nic-grace", str(GRACE)]
ENV = {"TRAIN_STEPS": "1000000", "CHECKPOINT_EVERY": str(CKPT_EVERY)}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_lab()
    with Lab(tmp_path_factory.mktemp("lab"), 2, arbiter_args=ARBITER) as lab:
        lab.start_job(ENV, AGENT)
        yield lab


def nic_faults(lab: Lab, severity: str = "error") -> list[dict[str, Any]]:
    return [e for e in lab.timeline() if e["kind"] == "fault"
            and str(e["message"]).startswith(f"nic ({severity}")]


def last_saved(lab: Lab) -> int | None:
    """The step of the last checkpoint rank 0 saved before its latest resume (None if
    none): what "resumed from the last checkpoint" must mean."""
    found = re.findall(r"checkpoint saved at step (\d+)", before_last_resume(lab, 0))
    return int(found[-1]) if found else None


def back_training(lab: Lab, gen: int, before: int) -> None:
    """Generation ``gen`` released, both ranks resumed from the last checkpoint saved (at
    most one interval behind ``before``, a step the test read while the fault held) and
    trained past it. No upper bound from ``before``: the checkpoint is the one written on
    the restart's SIGTERM, and a trainer may step on between the fault's end and that
    (a link back before the decision reaches it), and the log the test read trails it."""
    wait(lambda: generation(lab) >= gen, 120, f"generation {gen} released", lab)
    wait(lambda: len(resumed(lab, 0)) >= gen and len(resumed(lab, 1)) >= 1
         and resumed(lab, 0)[-1] == resumed(lab, 1)[-1], 120,
         f"both ranks resumed in generation {gen}", lab)
    step = resumed(lab, 0)[-1]
    assert step == last_saved(lab), (step, last_saved(lab), lab.dump())
    assert before - CKPT_EVERY - 2 <= step, (step, before)
    trained_past(lab, step + 8)


def test_1_carrier_loss_shorter_than_the_grace_is_a_flap_not_a_restart(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    faults, restarts = len(nic_faults(lab)), len(decisions(lab, "restart"))
    lab.link_down(1)
    time.sleep(0.3)  # the outage itself: a fixed, short length is what is drilled
    lab.link_up(1)
    wait(lambda: (lab.sample(1, "ftagent_nic_flaps_total") or 0) >= 1, 30,
         "the flap counted on rank 1's /metrics", lab)
    trained_past(lab, lab.steps(0) + 10)
    assert (len(nic_faults(lab)), len(decisions(lab, "restart"))) == (faults, restarts), \
        lab.dump()


def test_2_carrier_loss_longer_than_the_grace_waits_then_resumes_once_back(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    gen = generation(lab)
    faults, waits = len(nic_faults(lab)), len(decisions(lab, "wait"))
    restarts, alerts = len(decisions(lab, "restart")), len(decisions(lab, "alert_only"))
    at = lab.steps(1)
    lab.link_down(1)
    try:
        (down,) = wait(lambda: nic_faults(lab)[faults:], 30, "rank 1's NIC fault", lab)
        assert down["rank"] == 1 and "carrier" in down["message"], line_of(down)
        wait(lambda: [e for e in decisions(lab, "wait")[waits:] if e.get("rank") == 1], 30,
             "the arbiter waiting for the link", lab)
        assert len(decisions(lab, "restart")) == restarts, lab.dump()
    finally:
        lab.link_up(1)
    (resumed_,) = wait(lambda: [e for e in decisions(lab, "alert_only")[alerts:]
                                if "no restart" in str(e["message"])], 30,
                       "every rank stepping again once back, no restart", lab)
    assert "link back" in resumed_["message"] and resumed_["rank"] == 1, line_of(resumed_)
    assert len(decisions(lab, "restart")) == restarts and generation(lab) == gen, lab.dump()
    trained_past(lab, at + 10)
    assert (lab.sample(1, "ftagent_nic_carrier") or 0) == 1
    # the ledger (issue 24): the outage is an incident that restarted nothing, its stall
    # (onset -> link back -> the first step after it) the "outage" category
    g = lab.status()["goodput"]
    inc = g["per_incident"][-1]
    assert (inc["kind"], inc["no_restart"], inc["generation"]) == ("nic", True, gen), g
    assert inc["restart_seconds"] is None and inc["recomputed_steps"] == 0, g
    assert inc["detect_seconds"] >= GRACE and inc["decide_seconds"] is not None, g
    assert g["seconds"]["outage"] == pytest.approx(
        inc["detect_seconds"] + inc["decide_seconds"]), g
    assert abs(sum(g["seconds"].values()) - g["wall_seconds"]) < 1e-6, g


def test_3_link_down_past_the_replace_limit_replaces_the_rank(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    replaces = len(decisions(lab, "replace"))
    at = lab.steps(1)
    lab.link_down(1)
    try:
        (replace,) = wait(lambda: decisions(lab, "replace")[replaces:], REPLACE_AFTER + 40,
                          "the replace decision", lab)
        assert "rank 1" in replace["message"], line_of(replace)
        assert lab.agents[1].wait(60) == EXIT_REPLACE, lab.dump()
    finally:
        lab.link_up(1)  # the "new node" has a working link
    assert lab.agents[0].poll() is None  # rank 0 waits at the barrier for the new pod
    gen = generation(lab) + 1
    lab.start_rank(1)
    back_training(lab, gen, at + 2)


def test_4_fatal_xid_through_the_simulated_gpu_backend_replaces_the_rank(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    timeline = lab.tmp / "gpus.txt"
    # the backend's clock starts with the agent: the Xid comes once the job trains again
    timeline.write_text("gpus 1\nt=20s rank=1 gpu=0 xid=79\n")
    gen = generation(lab)
    before = len(decisions(lab, "replace"))
    lab.kill_agent(1)  # this drill's rank 1 runs on a GPU node: a fresh agent for it
    lab.start_rank(1, ["--gpu-backend", f"simulated:{timeline}", "--gpu-poll-interval", "0.2"])
    wait(lambda: len(decisions(lab, "replace")) > before, 120, "the Xid's replace", lab)
    replace = decisions(lab, "replace")[-1]
    assert "Xid 79" in replace["message"] and "rank 1" in replace["message"], line_of(replace)
    assert lab.agents[1].wait(60) == EXIT_REPLACE, lab.dump()
    xid = [e for e in lab.events(1) if e["event"] == "fault" and e["kind"] == "gpu"]
    assert xid and xid[-1]["xid"] == 79 and xid[-1]["severity"] == "fatal", xid
    at = lab.steps(0)
    lab.start_rank(1)  # the replacement pod, on a node with a healthy GPU
    back_training(lab, generation(lab) + 1 if generation(lab) > gen else gen + 1, at + 2)
    ledger_accounts(lab, "gpu")


def test_5_agent_sigkilled_its_trainer_dies_and_the_job_restarts_with_the_new_pod(
        lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    running = [e for e in lab.events(1) if e["event"] == "state" and e["kind"] == "running"]
    trainer = int(running[-1]["pid"])
    assert psutil.pid_exists(trainer)
    at, gen = lab.steps(1), generation(lab)
    lab.kill_agent(1)
    wait(lambda: not psutil.pid_exists(trainer) or
         psutil.Process(trainer).status() == psutil.STATUS_ZOMBIE, 30,
         "rank 1's trainer to die with its agent", lab)
    lab.start_rank(1)  # the controller's replacement pod
    back_training(lab, gen + 1, at + 2)
    restarts = [e for e in lab.timeline() if e["kind"] == "decision"
                and e["action"] in ("restart", "replace") and int(e["generation"]) == gen + 1]
    assert len(restarts) == 1, lab.dump()
