"""Preflight before every (re)start, with the real ``ftagent run`` (2 ranks, a real arbiter,
``--gpu-backend simulated:FILE``): a restarted generation whose rank finds its device
broken is stopped at preflight -- the rank is named with its reason before the barrier
releases and the arbiter replaces its pod -- instead of starting a trainer that would
crash again after the barrier. The GPU watch's poll is slowed so that only preflight can
see the loss (the watch and its own replace are tests/e2e/test_gpu_job.py's)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from ftagent.model import EXIT_REPLACE
from tests.arbiter_helpers import ArbiterProcess
from tests.conftest import PY, free_port, ftagent_cmd, read_events, wait_for
from tests.e2e.test_gpu_job import decisions, status

JOB = "e2e-gpu"  # test_gpu_job's status helpers read this job
TRAINER = """\
import os, sys, time
again = os.environ.get("FTAGENT_RESTART_COUNT", "0") != "0"
steps = int(os.environ.get("STEPS", "30"))
for i in range(1, steps + 1):
    print(f"step={i}/{steps} loss={1.0 / i:.4f}", flush=True)
    if os.environ.get("CRASH_ONCE") == "1" and not again and i == 12:
        sys.exit(3)  # a crash: the arbiter restarts every rank
    time.sleep(0.1)
"""


def start(tmp: Path, address: str, name: str, rank: int, timeline: Path,
          extra: tuple[str, ...] = (), crash: bool = False) -> subprocess.Popen[bytes]:
    out = (tmp / f"{name}.out").open("wb")
    cmd = ftagent_cmd("--events-file", str(tmp / f"{name}.jsonl"), "--rank", str(rank),
                      "--world-size", "2", "--arbiter", address, "--job", JOB,
                      "--metrics-port", "-1", "--gpu-backend", f"simulated:{timeline}",
                      "--gpu-poll-interval", "3600", "--progress", "log",
                      "--hang-verify-window", "0", "--no-warm-restart", *extra,
                      cmd=[PY, str(tmp / "train.py")])
    env = {**os.environ, "MASTER_PORT": str(free_port()), "CRASH_ONCE": "1" if crash else "0"}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    out.close()
    return proc


def test_a_restarted_rank_with_a_broken_device_is_stopped_at_preflight_and_replaced(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAINER)
    timeline = tmp_path / "gpus.txt"
    timeline.write_text("gpus 1\nt=0.5s rank=1 gpu=0 lost\n")  # lost while it trains
    clean = tmp_path / "clean.txt"
    clean.write_text("gpus 1\n")
    procs: list[subprocess.Popen[bytes]] = []
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        try:
            r0 = start(tmp_path, arb.address, "rank0", 0, clean, crash=True)
            r1 = start(tmp_path, arb.address, "rank1", 1, timeline)
            procs += [r0, r1]
            assert r1.wait(90) == EXIT_REPLACE, (tmp_path / "rank1.out").read_text()[-3000:]
            st = status(arb.address)
            # the replaced pod's successor arrives; the job trains again and succeeds
            new1 = start(tmp_path, arb.address, "rank1-new", 1, clean)
            procs.append(new1)
            assert new1.wait(90) == 0 and r0.wait(90) == 0
            st = status(arb.address)
        except BaseException:
            for n in ("rank0", "rank1", "rank1-new"):
                out = tmp_path / f"{n}.out"
                print(f"--- {n}\n{out.read_text()[-3000:] if out.exists() else ''}")
            raise
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    msgs = [e["message"] for e in st["timeline"]]
    assert len(decisions(st, "restart")) == 1  # rank 0's crash: generation 1 for everyone
    (replace,) = decisions(st, "replace")  # rank 1 at preflight, before the barrier
    assert "replacing rank 1" in replace["message"], msgs
    assert "preflight failed: accelerator: GPU 0" in replace["message"], msgs
    assert "NVMLError_GpuIsLost" in replace["message"], msgs
    assert decisions(st, "succeeded"), msgs
    ev1 = read_events(tmp_path / "rank1.jsonl")
    # rank 1 never started a trainer of the restarted generation: it stopped at preflight
    runs = [e["generation"] for e in ev1 if e["event"] == "state" and e["kind"] == "running"]
    assert runs == [0], runs
    pre = [e for e in ev1 if e["event"] == "state" and e["kind"] == "preflight"]
    assert pre[0]["ok"] is True and pre[0]["fast"] is False  # the first start: full budgets
    assert pre[-1]["ok"] is False and pre[-1]["failed"] == ["accelerator"]
    assert pre[-1]["fast"] is True and pre[-1]["preflight_seconds"] < 2.0
    faults = [e for e in ev1 if e["event"] == "fault" and e.get("preflight")]
    assert len(faults) == 1 and faults[0]["severity"] == "fatal"
    # no watch fault raced it (the poll is slowed): the preflight found the loss
    assert not [e for e in ev1 if e["event"] == "fault" and not e.get("preflight")
                and e["kind"] == "gpu"]
    assert any(e["event"] == "action" and e["kind"] == "replace" for e in ev1)


def test_no_preflight_starts_without_checking(tmp_path: Path) -> None:
    """--no-preflight: no check, no preflight event (the opt-out)."""
    (tmp_path / "train.py").write_text("print('step=1/1 loss=1.0', flush=True)\n")
    clean = tmp_path / "clean.txt"
    clean.write_text("gpus 1\n")
    cmd = ftagent_cmd("--events-file", str(tmp_path / "ev.jsonl"), "--metrics-port", "-1",
                      "--gpu-backend", f"simulated:{clean}", "--no-preflight",
                      "--preflight-checkpoint-dir", str(tmp_path / "missing"),
                      cmd=[PY, str(tmp_path / "train.py")])
    r = subprocess.run(cmd, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not [e for e in read_events(tmp_path / "ev.jsonl") if e.get("kind") == "preflight"]


def test_an_unwritable_checkpoint_dir_stops_the_start_with_one_line_and_exit_replace(
        tmp_path: Path) -> None:
    """No arbiter (the local policy): the first start fails preflight -> the trainer never
    runs; the agent exits with the replace status so the pod moves; one clear line."""
    marker = tmp_path / "ran"
    (tmp_path / "train.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    t0 = time.monotonic()
    cmd = ftagent_cmd("--events-file", str(tmp_path / "ev.jsonl"), "--metrics-port", "-1",
                      "--gpu-backend", "none", "--preflight-checkpoint-dir",
                      str(tmp_path / "missing"), cmd=[PY, str(tmp_path / "train.py")])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_REPLACE, r.stderr[-2000:]
    assert not marker.exists()
    line = [ln for ln in r.stderr.splitlines() if "preflight failed" in ln]
    assert line and "storage: " in line[0] and "is not a directory" in line[0], r.stderr
    assert time.monotonic() - t0 < 30


def test_a_spare_that_fails_preflight_is_never_used_and_the_timeline_says_why(
        tmp_path: Path) -> None:
    """A warm spare whose node cannot serve (its checkpoint directory is missing) fails
    its preflight: the arbiter retires it (it exits with the replace status, its pod
    moves), the reason is on the job's timeline, and the job itself is untouched (no
    restart, no budget spent)."""
    (tmp_path / "train.py").write_text(TRAINER)
    clean = tmp_path / "clean.txt"
    clean.write_text("gpus 1\n")
    procs: list[subprocess.Popen[bytes]] = []
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        try:
            r0 = start(tmp_path, arb.address, "rank0", 0, clean)
            r1 = start(tmp_path, arb.address, "rank1", 1, clean)
            spare = start(tmp_path, arb.address, "spare", 0, clean, extra=(
                "--spare", "--preflight-checkpoint-dir", str(tmp_path / "not-mounted")))
            procs += [r0, r1, spare]
            assert spare.wait(60) == EXIT_REPLACE, (tmp_path / "spare.out").read_text()[-3000:]
            assert r0.wait(90) == 0 and r1.wait(90) == 0
            st = status(arb.address)
        except BaseException:
            for n in ("rank0", "rank1", "spare"):
                out = tmp_path / f"{n}.out"
                print(f"--- {n}\n{out.read_text()[-3000:] if out.exists() else ''}")
            raise
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    msgs = [e["message"] for e in st["timeline"]]
    retired = [m for m in msgs if "retired as a spare" in m]
    assert retired and "preflight failed: storage: " in retired[0], msgs
    assert "not-mounted is not a directory" in retired[0], msgs
    assert not decisions(st, "restart") and not decisions(st, "replace"), msgs
    assert not decisions(st, "assign"), msgs
    assert decisions(st, "succeeded"), msgs


def serving(events: Path) -> bool:
    try:
        return any(e["event"] == "state" and e["kind"] == "spare" for e in read_events(events))
    except ValueError:  # a line being written
        return False


def test_a_spare_whose_device_broke_while_it_waited_is_stopped_at_preflight_on_assign(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm spare passes preflight when it joins; its GPU is lost while it waits (the
    watch's poll slowed: only preflight can see it). Rank 1 is replaced (its own preflight
    after a restart fails) and the spare is ASSIGNed the rank: it checks again before it
    arrives, fails, is retired (exits with the replace status) and never runs a trainer;
    the rank's own recreated pod takes it and the job succeeds."""
    (tmp_path / "train.py").write_text(TRAINER.replace("i == 12", "i == 40"))
    assert "i == 40" in (tmp_path / "train.py").read_text()
    timeline = tmp_path / "gpus.txt"
    timeline.write_text("gpus 1\nt=0.5s rank=1 gpu=0 lost\n")
    spare_gpus = tmp_path / "spare-gpus.txt"
    spare_gpus.write_text("gpus 1\nt=3s gpu=0 lost\n")  # after its first preflight
    monkeypatch.setenv("STEPS", "60")  # rank 0 crashes 4 s into training: after that
    clean = tmp_path / "clean.txt"
    clean.write_text("gpus 1\n")
    names = ("rank0", "rank1", "spare", "rank1-new")
    procs: list[subprocess.Popen[bytes]] = []
    with ArbiterProcess(log_dir=str(tmp_path)) as arb:
        try:
            # (a spare on the replaced rank's node is never picked: its own node here)
            spare = start(tmp_path, arb.address, "spare", 0, spare_gpus,
                          extra=("--spare", "--node", "spare-node"))
            procs.append(spare)
            wait_for(lambda: serving(tmp_path / "spare.jsonl"), 30, "the spare to serve",
                     interval=0.1)
            r0 = start(tmp_path, arb.address, "rank0", 0, clean, crash=True)
            r1 = start(tmp_path, arb.address, "rank1", 1, timeline)
            procs += [r0, r1]
            assert r1.wait(90) == EXIT_REPLACE, (tmp_path / "rank1.out").read_text()[-3000:]
            assert spare.wait(60) == EXIT_REPLACE, (tmp_path / "spare.out").read_text()[-3000:]
            new1 = start(tmp_path, arb.address, "rank1-new", 1, clean)
            procs.append(new1)
            assert new1.wait(90) == 0 and r0.wait(90) == 0
            st = status(arb.address)
        except BaseException:
            for n in names:
                out = tmp_path / f"{n}.out"
                print(f"--- {n}\n{out.read_text()[-3000:] if out.exists() else ''}")
            raise
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    msgs = [e["message"] for e in st["timeline"]]
    assert len(decisions(st, "assign")) == 1, msgs  # the spare was picked for rank 1 ...
    retired = [m for m in msgs if "not used for rank 1" in m]
    assert retired and "preflight failed: accelerator: GPU 0" in retired[0], msgs
    assert decisions(st, "succeeded"), msgs
    ev = read_events(tmp_path / "spare.jsonl")
    states = [e["kind"] for e in ev if e["event"] == "state"]
    assert "assigned" in states and "running" not in states, states  # ... and never ran
    pre = [e for e in ev if e["event"] == "state" and e["kind"] == "preflight"]
    assert pre[0]["ok"] is True and pre[-1]["ok"] is False, pre
