"""Accelerator drills beyond NVIDIA: the real ``ftagent run`` with ``--accelerator ascend``
or ``kunlunxin`` (``FTAGENT_ACCELERATOR``) and ``--gpu-backend simulated:FILE``, so each
agent runs the simulated ``npu-smi`` / ``xpu-smi`` and parses its output; 2 ranks, a real
arbiter (tests/e2e/test_gpu_job.py's harness).

* a recoverable error on rank 1, raised and cleared 6 times in 11 s (a flood
  that several polls see): one
  fault, the arbiter restarts every rank in place once (the agents are stopped once the
  flood is counted); /metrics shows the code under
  the same ``ftagent_gpu_*`` families with ``accelerator``;
* a fatal one on rank 1 (Ascend: a SeparateNPU code; Kunlunxin: the XPU falls off the
  bus): the arbiter replaces rank 1, and a new rank 1 (a rescheduled pod) takes over.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ftagent.model import EXIT_REPLACE
from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import wait_for
from tests.e2e.test_gpu_job import Agents, decisions, status, status_soon

# (accelerator, recoverable code with the health it comes with, its label in metrics)
RECOVERABLE = {
    "ascend": ("8C084E00", "Alarm", "8C084E00"),  # RestartBusiness (faultCode.json)
    "kunlunxin": ("1A2B", "OK", "0x1A2B"),  # a code on a healthy XPU: restart in place
}
FATAL = {
    "ascend": ("fault=80CB8002 health=Critical", "code:80CB8002", "replace_node", "node"),
    "kunlunxin": ("lost", "lost", "replace_node", "node"),
}


def xid_count(text: str) -> float:
    lines = [ln for ln in text.splitlines() if ln.startswith("ftagent_gpu_xid_errors_total{")]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def counted(agents: Agents) -> str:
    """Rank 1's metrics once they count more than one occurrence of the code, else ''."""
    try:
        text = agents.metrics("rank1")
    except OSError:
        return ""
    return text if xid_count(text) >= 2 else ""


def flood(code: str, health: str) -> str:
    out = []
    for i in range(6):  # raised for 1 s, cleared for 0.8 s: longer than a poll, each
        t = 1.5 + i * 1.8
        out.append(f"t={t:.1f}s rank=1 dev=0 fault={code} health={health}\n")
        out.append(f"t={t + 1.0:.1f}s rank=1 dev=0 clear\n")
    return "".join(out)


@pytest.mark.parametrize("accelerator", ["ascend", "kunlunxin"])
def test_a_recoverable_error_flood_is_one_fault_and_one_restart_in_place(
        tmp_path: Path, accelerator: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTAGENT_ACCELERATOR", accelerator)
    code, health, label = RECOVERABLE[accelerator]
    timeline = tmp_path / "devices.txt"
    timeline.write_text("devices 1\n" + flood(code, health))
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        agents = Agents(tmp_path, arb.address, timeline)
        try:
            r0, r1 = agents.start("rank0", 0, steps=150), agents.start("rank1", 1,
                                                                   steps=150)
            wait_for(lambda: decisions(status_soon(arb.address), "restart"), 60,
                     "the arbiter's restart", interval=0.2)
            wait_for(lambda: [e for e in agents.events("rank1") if e["event"] == "state"
                              and e["kind"] == "running" and e["generation"] == 1], 30,
                     "rank 1 running generation 1", interval=0.1)
            text = wait_for(lambda: counted(agents), 30,
                            "the flood counted", interval=0.3)
            assert r0.poll() is None and r1.poll() is None  # training on, no second fault
        except BaseException:
            agents.dump()
            raise
        finally:
            agents.stop()
        st = status(arb.address)
    (restart,) = decisions(st, "restart")
    assert restart["generation"] == 1
    (fault,) = agents.faults("rank1")
    assert (fault["cause"], fault["action"], fault["severity"]) == (
        f"code:{label}", "restart", "error")
    assert agents.faults("rank0") == []
    xid = next(ln for ln in text.splitlines()
               if ln.startswith("ftagent_gpu_xid_errors_total{"))
    assert f'accelerator="{accelerator}"' in xid and f'xid="{label}"' in xid, xid
    assert 'gpu="0"' in xid and 'rank="1"' in xid
    assert xid_count(text) >= 2  # the flood was counted, not faulted twice
    assert f'ftagent_gpu_temperature_celsius{{UUID="SIM000000000000",accelerator=' \
        f'"{accelerator}"' in text


# Steps of the job once rank 1 is replaced (rank 0's restarted trainer, STEPS_AGAIN in
# test_gpu_job's TRAINER, and the new rank 1): rank 0 used to redo all 60 (6 s).
AGAIN = 10


@pytest.mark.parametrize("accelerator", ["ascend", "kunlunxin"])
def test_a_fatal_error_replaces_the_rank(tmp_path: Path, accelerator: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTAGENT_ACCELERATOR", accelerator)
    monkeypatch.setenv("STEPS_AGAIN", str(AGAIN))  # rank 0's restarted run
    event, cause, action, scope = FATAL[accelerator]
    timeline = tmp_path / "devices.txt"
    timeline.write_text(f"devices 1\nt=1.5s rank=1 dev=0 {event}\n")
    clean = tmp_path / "clean.txt"
    clean.write_text("devices 1\n")
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        agents = Agents(tmp_path, arb.address, timeline)
        try:
            r0, r1 = agents.start("rank0", 0, steps=60), agents.start("rank1", 1, steps=60)
            assert r1.wait(60) == EXIT_REPLACE, agents.log("rank1")[-2000:]
            new1 = agents.start("rank1-new", 1, timeline=clean, steps=AGAIN)
            assert new1.wait(90) == 0 and r0.wait(90) == 0
        except BaseException:
            agents.dump()
            raise
        finally:
            agents.stop()
        st = status(arb.address)
    (replace,) = decisions(st, "replace")
    assert "replacing rank 1" in replace["message"] and decisions(st, "succeeded")
    (fault,) = agents.faults("rank1")
    assert (fault["cause"], fault["severity"], fault["scope"], fault["action"]) == (
        cause, "fatal", scope, action)
    assert fault["uuid"] == "SIM000000000000"
    assert agents.faults("rank1-new") == []
