"""The arbiter names a hang's culprit from PyTorch's flight recorder, on a real 2-rank
gloo DDP job (examples/train.py, unchanged), one ``ftagent run`` per rank: rank 1 stops
before its step's all-reduce, rank 0 waits inside it. The agents dump their ranks'
flight recorders through the sitecustomize trigger when the arbiter asks for stacks."""

from __future__ import annotations

from pathlib import Path

from tests.arbiter_helpers import ArbiterProcess
from tests.e2e.jobs import FAST, needs_torch, start_job, status

pytestmark = needs_torch

FLOOR = ["--hang-timeout-min", "2", "--output-interval", "0.1"]


def test_rank_that_never_enqueues_the_allreduce_is_named_by_the_flight_recorder(
        tmp_path: Path) -> None:
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        job = start_job(tmp_path, 2, flags=["--arbiter", arb.address, "--job", "e2e", *FLOOR],
                        env={**FAST, "TRAIN_STEPS": "30", "FAULT_RANK": "1",
                             "FAULT_HANG_AT_STEP": "20"})
        try:
            codes = job.wait(240)
        finally:
            job.stop()
        st = status(arb.address)
    assert codes == [0, 0], (job.log(0)[-2000:], job.log(1)[-2000:])
    restarts = [e for e in st["timeline"] if "flight recorder:" in str(e)]
    assert len(restarts) == 1, st["timeline"]
    text = str(restarts[0])
    assert "rank 1 at #" in text and "never reached collective #" in text, text
    assert "(all_reduce) of process group 0; rank 0 waits in it" in text, text
    # the agents' own hang faults carry the dumps' summaries as evidence too
    for r in (0, 1):
        (f,) = job.faults(r, "hang")
        fr = f["flight_recorder"]
        assert [s["rank"] for s in fr["summaries"]] == [r], fr
