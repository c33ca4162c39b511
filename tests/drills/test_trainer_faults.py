"""Trainer faults on a 2-node lab, in sequence on one long-running job.

One job, one arbiter, Prometheus scraping both agents and the arbiter; the faults come one
after the other, each at a moment the drill picks (a trigger file the trainer reads at its
next step), and each is checked for detection (the fault on the timeline, from the right
rank), decision (one restart, or none), recovery (every rank resumed from the last
checkpoint and trained past it) and what it leaves in the metrics:

1. a crash of rank 1            -> restart; resumed from the last checkpoint
2. rank 1 hangs before a collective -> stacks dumped, rank 1 named, restart
3. rank 0's data loader stalls, logging "waiting for data" every second -> the logs are not
   progress: a hang, rank 0 named, restart
4. both ranks crash at once     -> one decision, one restart
5. rank 1 runs 4x slower        -> named a straggler, no restart
6. the arbiter is SIGKILLed and restarted mid-run -> training never stops, both agents
   re-register, nothing restarts
7. SIGTERM to every agent, as Kubernetes deletes the pods -> every rank stops at one step
   inside the grace period, rank 0 writes a checkpoint there, agents exit 143

The steps are shared because each drill needs a trained, checkpointed job to start from,
and a fresh job per fault would cost 10-20 s of start-up each on 2 cores. A failing step
fails the test with every log tail and the timeline.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.drills.conftest import (
    before_last_resume,
    decisions,
    generation,
    ready,
    require_lab,
    resumed,
    trained_past,
)
from tests.lab import Lab, line_of, wait

pytestmark = pytest.mark.timeout(600)

CKPT_EVERY = 10
ARBITER = ["--max-restarts", "20", "--straggler-window", "3", "--straggler-ratio", "0.6",
           "--stacks-timeout", "20"]
AGENT = ["--hang-timeout-min", "2", "--max-restarts", "20", "--stop-timeout", "30"]
ENV = {"TRAIN_STEPS": "1000000", "CHECKPOINT_EVERY": str(CKPT_EVERY), "INSTRUMENT": "1"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    require_lab()
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus missing: `make deps` installs Debian's prometheus package")
    with Lab(tmp_path_factory.mktemp("lab"), 2, arbiter_args=ARBITER, prometheus=True) as lab:
        lab.start_job(ENV, AGENT)
        yield lab


def faults(lab: Lab, kind: str) -> list[dict[str, Any]]:
    return [e for e in lab.timeline() if e["kind"] == "fault"
            and str(e["message"]).startswith(f"{kind} ")]


FAULT_LINE = re.compile(r"\] step (\d+): (?:\(fault\)|waiting for data)")


def hit(lab: Lab) -> int | None:
    """The step a fault hit, from the dead attempt's own line (``step N: (fault) ...``,
    ``step N: waiting for data``) on either rank: read once both resumed, so the logs,
    which trail the trainers by the agent's output batching, hold that attempt whole."""
    found = [int(n) for r in (0, 1) for n in FAULT_LINE.findall(before_last_resume(lab, r))]
    return max(found) if found else None


def recovered(lab: Lab, gen: int, before: int) -> int:
    """Generation ``gen`` released, both ranks resumed from one checkpoint at or below the
    step the fault hit (``before`` as read when it was triggered, or later: the trainer
    may be a few steps past its log) and trained past it; that checkpoint's step."""
    wait(lambda: generation(lab) >= gen, 120, f"generation {gen} released", lab)
    wait(lambda: all(len(resumed(lab, r)) >= gen for r in (0, 1)), 120,
         f"both ranks resumed in generation {gen}", lab)
    step = resumed(lab, 0)[-1]
    assert resumed(lab, 1)[-1] == step, lab.dump()
    top = max(before, hit(lab) or 0)
    assert 0 < step <= top and step % CKPT_EVERY == 0, (step, before, top)
    assert top - step <= CKPT_EVERY + 2, (step, top)  # lost steps: one interval at most
    # past the hang detector's warm-up (--hang-warmup-steps 5) of the new attempt, so the
    # next drill's hang is judged on the learned budget, not the first-step one
    trained_past(lab, step + 8)
    return step


def restarts_metric(lab: Lab, at_least: float) -> float:
    """The arbiter's restart count for the job, as Prometheus scraped it."""
    return float(wait(lambda: (v := lab.value('sum(ftagent_job_restarts_total{job_name="lab"})'))
                      is not None and v >= at_least and v, 30,
                      f"ftagent_job_restarts_total >= {at_least} in Prometheus", lab))


def named(message: str, rank: int) -> bool:
    """The job-hang decision names ``rank`` as the culprit: from the flight recorder
    ("rank R at #N never reached collective #M"), or from the stacks ("rank R is not in a
    collective")); or the decision on the culprit's own verified hang names it as every
    hang decision does ("culprit ranks R")."""
    return bool(re.search(rf"flight recorder: rank {rank} at #\d+ never reached collective",
                          message)) or f"rank {rank} is not in a collective" in message \
        or message.startswith(f"rank {rank}: hang") and \
        bool(re.search(rf"culprit ranks {rank}\b", message))


def counts(lab: Lab) -> tuple[int, int]:
    """The job's generation and its restart decisions so far: what a drill adds to."""
    return generation(lab), len(decisions(lab, "restart"))


def test_1_crash_on_one_rank_restarts_every_rank_from_the_last_checkpoint(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    wait(lambda: len(lab.query('ftagent_trainer_running{job_name="lab"}')) == 2, 60,
         "Prometheus scraping both agents", lab)
    gen, restarts = counts(lab)
    at = lab.steps(1)
    lab.trigger("crash", 1)
    (crash,) = wait(lambda: [f for f in faults(lab, "crash") if f["generation"] == gen], 60,
                    "the crash on the timeline", lab)
    assert crash["rank"] == 1, line_of(crash)
    wait(lambda: len(decisions(lab, "restart")) > restarts, 30, "a restart decision", lab)
    recovered(lab, gen + 1, at + 2)
    assert len(decisions(lab, "restart")) == restarts + 1
    assert restarts_metric(lab, restarts + 1) == restarts + 1
    ev = [e for e in lab.events(1) if e["event"] == "fault" and e["kind"] == "crash"]
    assert ev and ev[-1]["exit_code"] == 3


def test_2_hang_in_a_collective_names_the_rank_and_restarts(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    gen, restarts = counts(lab)
    at = lab.steps(1)
    lab.trigger("hang", 1)
    restart = wait(lambda: len(decisions(lab, "restart")) > restarts and
                   decisions(lab, "restart"), 90, "a restart after the hang", lab)[-1]
    # the job hang (rank 0's question: the arbiter asks every rank for its stacks) or
    # rank 1's own verified hang, whichever ends first: both budgets sit at the floor here
    assert decisions(lab, "dump_stacks") or restart["message"].startswith("rank 1: hang"), \
        lab.dump()
    # named by the flight recorder (rank 1 never reached the collective rank 0 waits in)
    # or, where its dumps did not decide, by the stacks; the culprit's own frame either way
    assert named(restart["message"], 1), line_of(restart)
    assert "hang_before_collective" in restart["message"], line_of(restart)
    assert faults(lab, "hang"), lab.dump()
    recovered(lab, gen + 1, at + 2)
    assert restarts_metric(lab, restarts + 1) == restarts + 1
    # the agents' counter is scraped on their own schedule, not with the arbiter's: waited
    # for (read once, it could be the scrape before the fault)
    wait(lambda: (v := lab.value('sum(ftagent_faults_total{job_name="lab",kind="hang"})'))
         is not None and v >= 1, 30, "ftagent_faults_total{kind=hang} >= 1 in Prometheus", lab)


def test_3_data_stall_with_chatty_logs_is_a_hang_not_progress(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    gen, restarts = counts(lab)
    at = lab.steps(0)
    since = time.time()
    lab.trigger("stall", 0)
    restart = wait(lambda: len(decisions(lab, "restart")) > restarts and
                   decisions(lab, "restart"), 90, "a restart after the data stall", lab)[-1]
    assert "waiting for data" in lab.log(0)
    assert "job hang" in restart["message"], line_of(restart)
    # the arbiter names the stalled rank (the flight recorder: it never reached the
    # backward's all-reduce its peer waits in; or the stacks) and where it is, from the
    # stack it sent
    assert named(restart["message"], 0), line_of(restart)
    assert "in wait_for_data (train.py:" in restart["message"], line_of(restart)
    # Whichever rank's budget runs out first starts the job hang, and the restart can come
    # before the other's own detector fires (rank 1 first: CI, 2.9 s against rank 0's 5 s
    # budget). If rank 0 raised its own fault in this drill, it carries the loader's stack.
    hang = [e for e in lab.events(0) if e["event"] == "fault" and e["kind"] == "hang"
            and e["ts"] >= since]
    assert all("wait_for_data" in json.dumps(e) for e in hang), hang
    recovered(lab, gen + 1, at + 2)
    assert restarts_metric(lab, restarts + 1) == restarts + 1


def test_4_two_crashes_at_once_are_one_decision_and_one_restart(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    gen, restarts = counts(lab)
    at = min(lab.steps(0), lab.steps(1))
    # for this generation only: a rank stopped by its peer's crash before its next step
    # (waiting in the step's all-reduce) must not crash the next attempt instead (a
    # second decision: seen under load, stop 44)
    lab.trigger("crash", 0, f"generation={gen}")
    lab.trigger("crash", 1, f"generation={gen}")
    wait(lambda: len({e["rank"] for e in faults(lab, "crash") if e["generation"] == gen}) == 2
         or generation(lab) >= gen + 1, 60, "both crashes reported", lab)
    recovered(lab, gen + 1, at + 3)
    assert len(decisions(lab, "restart")) == restarts + 1, lab.dump()
    assert generation(lab) == gen + 1
    assert restarts_metric(lab, restarts + 1) == restarts + 1


def test_5_slow_rank_is_named_a_straggler_and_not_restarted(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    gen, restarts = counts(lab)
    lab.trigger("slow", 1, "4")
    try:
        found = wait(lambda: [e for e in lab.timeline() if "straggler" in str(e["message"])
                              and e.get("rank") == 1], 60, "rank 1 named a straggler", lab)
        assert found[0]["generation"] == gen
        wait(lambda: lab.value('max(ftagent_rank_straggler{job_name="lab",rank="1"})') == 1, 30,
             "ftagent_rank_straggler for rank 1", lab)
    finally:
        lab.clear_trigger("slow", 1)
    assert counts(lab) == (gen, restarts), lab.dump()


def test_6_arbiter_killed_and_restarted_mid_run_loses_nothing(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    gen, restarts = generation(lab), len(decisions(lab, "restart"))
    lab.kill_arbiter()
    at = lab.steps(0)
    trained_past(lab, at + 20, timeout=60)  # training goes on without the arbiter
    lab.start_arbiter()  # same port, empty state
    wait(lambda: lab.connected() == 2, 60, "both agents re-registered", lab)
    trained_past(lab, lab.steps(0) + 5)
    st = lab.status()
    assert int(st["generation"]) == gen, st
    for r in (0, 1):  # no agent was told to restart
        actions = [e for e in lab.events(r) if e["event"] == "action"
                   and e["kind"] == "restart"]
        assert len(actions) == restarts, actions


def test_7_sigterm_to_every_agent_stops_cleanly_with_a_checkpoint(lab: Lab) -> None:
    ready(lab, CKPT_EVERY)
    trained_past(lab, lab.steps(0) + 3)
    start = time.monotonic()
    lab.signal_agents(signal.SIGTERM)
    codes = lab.wait_agents(60)
    took = time.monotonic() - start
    assert codes == [143, 143], (codes, lab.dump())
    assert took < 30, took  # inside --stop-timeout: nothing was SIGKILLed
    stops = [re.findall(r"stopping at step (\d+) on SIGTERM", lab.log(r)) for r in (0, 1)]
    assert stops[0] and stops[0][-1:] == stops[1][-1:], stops
    assert f"checkpoint saved at step {stops[0][-1]}" in lab.log(0)
    import torch

    state = torch.load(Path(lab.ckpt_dir) / "ckpt.pt", weights_only=True)
    assert state["step"] == int(stops[0][-1])
    for r in (0, 1):  # the trainer's own exit: 143 after its checkpoint, not a SIGKILL
        (end,) = [e for e in lab.events(r) if e["event"] == "state" and e["kind"] == "stopped"]
        assert end["exit_status"] == 143, end
