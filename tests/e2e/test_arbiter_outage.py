"""An arbiter that dies around a fault, on a real 2-rank PyTorch job (the field report).

2 ranks under an arbiter; the arbiter is SIGKILLed, rank 1 crashes during the outage, the
arbiter comes back on the same port with no state. Before the protocol reconciled
generations, the job sat at "generation 2: 1/2 arrived ... waiting for rank 1" for good.
Now the crash waits for the arbiter (it is back within --arbiter-fail-open-after), is
decided once, and every rank trains again at generation 1.
"""

from __future__ import annotations

from pathlib import Path

from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import wait_for
from tests.e2e.jobs import FAST, connected, kinds, needs_torch, start_job, status, timeline_text

pytestmark = needs_torch


def test_crash_while_the_arbiter_is_down_is_decided_once_when_it_is_back(
        tmp_path: Path) -> None:
    trigger = tmp_path / "crash-now"
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        job = start_job(tmp_path, 2, flags=["--arbiter", arb.address, "--job", "e2e",
                                            "--arbiter-fail-open-after", "30",
                                            "--max-restarts", "3"],
                        env={**FAST, "TRAIN_STEPS": "40", "FAULT_RANK": "1",
                             "FAULT_CRASH_ON_FILE": str(trigger)})
        try:
            wait_for(lambda: "step=20/" in job.log(0), 90, "training under way", interval=0.1)
            arb.kill()
            trigger.touch()  # rank 1 crashes at its next step, with no arbiter to hear it
            wait_for(lambda: job.faults(1, "crash"), 30, "rank 1's crash", interval=0.1)
            arb.start()  # same port, empty state: the agents are the truth
            wait_for(lambda: connected(arb.address) == 2, 15, "both agents re-registered",
                     interval=0.2)
            assert job.wait(150) == [0, 0], (job.log(0)[-1500:], job.log(1)[-1500:])
        finally:
            job.stop()
        st = status(arb.address)
    k = kinds(st)
    # one decision, however many faults were re-sent
    assert k.count("restart") == 1, timeline_text(st)
    assert k[-1] == "succeeded", k
    assert (st["generation"], st["restarts"]) == (1, 1), st
    for r in (0, 1):
        ev = job.events(r)
        runs = [e["generation"] for e in ev if e["event"] == "state" and e["kind"] == "running"]
        assert runs == [0, 1], (r, runs)  # no stale REJOIN killed the restarted trainer
        assert [e["generation"] for e in ev if e["kind"] == "released"] == [0, 1]
        assert "step=40/40" in job.log(r)
