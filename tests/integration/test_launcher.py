"""``ftagent run --nproc-per-node N``: real workers, real torchrun for the comparison.

A tiny script without torch for the env, crash and hang cases (4 x ``import torch`` on
two loaded cores would take most of the time); one real gloo job under the launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ftagent.agent.flight_recorder import fr_env
from tests.conftest import PY, ROOT, free_port, ftagent_cmd, read_events
from tests.e2e.jobs import TRAIN, needs_torch

TORCHRUN = str(Path(PY).parent / "torchrun")

WORKER = r'''
import json, os, sys, time
lr = int(os.environ["LOCAL_RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["DUMP_DIR"]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"{os.environ['RANK']}.{attempt}.json"), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv, "pid": os.getpid()}, f)
mode = os.environ.get("MODE", "")

def crash_here():
    raise RuntimeError(f"worker {lr} failed on purpose")

def stuck_here():
    while True:
        time.sleep(0.05)

if mode == "crash" and lr == 2 and attempt == 0:
    time.sleep(0.3)
    try:
        crash_here()
    except RuntimeError:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
if mode in ("crash", "hang"):
    for step in range(1, 1000):
        print(f"step={step} loss=0.5", flush=True)
        if mode == "hang" and lr == 1 and step == 8 and attempt == 0:
            stuck_here()
        if mode == "crash" and attempt == 0 and lr != 2:
            time.sleep(0.1)
            continue
        if step >= int(os.environ.get("STEPS", "3")):
            break
        time.sleep(0.1)
'''

# values that must differ between two launches (ports, temp paths, the launcher's own)
DIFFERENT = {"TORCHELASTIC_ERROR_FILE", "DUMP_DIR", "TORCHELASTIC_USE_AGENT_STORE"}


def script(tmp: Path) -> Path:
    p = tmp / "worker.py"
    p.write_text(WORKER)
    return p


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FTAGENT_", "PET_", "TORCHELASTIC_")) and k not in (
               "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
               "OMP_NUM_THREADS", "PYTHONUNBUFFERED")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def dumps(d: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in d.glob("*.json")}


def launch(tmp: Path, *flags: str, mode: str = "", timeout: float = 120,
           **env: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    events = tmp / "events.jsonl"
    cmd = ftagent_cmd("--events-file", str(events), "--nproc-per-node", "4", *flags,
                      cmd=[str(script(tmp))])
    r = subprocess.run(cmd, env=clean_env(DUMP_DIR=str(tmp / "ft"), MODE=mode, **env),
                       capture_output=True, text=True, timeout=timeout)
    return r, read_events(events) if events.exists() else []


def test_workers_see_exactly_torchruns_environment(tmp_path: Path) -> None:
    port = str(free_port())
    common = ["--nproc-per-node", "4", "--rdzv-backend", "static", "--master-addr",
              "127.0.0.1", "--master-port", port, "--max-restarts", "2"]
    worker = str(script(tmp_path))
    tr = subprocess.run([TORCHRUN, *common, worker, "a", "--b"], capture_output=True,
                        env=clean_env(DUMP_DIR=str(tmp_path / "tr")), text=True, timeout=120)
    assert tr.returncode == 0, tr.stderr
    ft = subprocess.run(ftagent_cmd(*common, cmd=[worker, "a", "--b"]), capture_output=True,
                        env=clean_env(DUMP_DIR=str(tmp_path / "ft")), text=True, timeout=120)
    assert ft.returncode == 0, ft.stderr
    theirs, ours = dumps(tmp_path / "tr"), dumps(tmp_path / "ft")
    assert sorted(theirs) == sorted(ours) == [f"{r}.0" for r in range(4)]
    for key in sorted(theirs):
        a, b = theirs[key]["env"], ours[key]["env"]
        # ftagent's own: its SDK socket, restart count, containment marker, unbuffered output
        # (torchrun passes python -u instead)
        b = {k: v for k, v in b.items() if not k.startswith("FTAGENT_")
             and k != "PYTHONUNBUFFERED"}
        # and the flight recorder's (agent/flight_recorder.py): torch's variables, its
        # trigger first on PYTHONPATH
        fr = fr_env({}, 1, "/x")
        assert b["TORCH_FR_BUFFER_SIZE"] == "2000" and "FTAGENT_FR_DIR" in ours[key]["env"]
        b = {k: v for k, v in b.items() if k not in fr or k == "PYTHONPATH"}
        b["PYTHONPATH"] = b["PYTHONPATH"].split(os.pathsep, 1)[1]
        assert set(a) == set(b), (key, set(a) ^ set(b))
        assert {k: a[k] for k in a if k not in DIFFERENT} == \
            {k: b[k] for k in b if k not in DIFFERENT}, key
        assert a["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # theirs: the agent's store
        assert b["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # ours: rank 0 hosts it
        assert theirs[key]["argv"][1:] == ours[key]["argv"][1:] == ["a", "--b"]


def test_crash_of_local_rank_2_reports_its_own_exit_and_restarts_all_four(
        tmp_path: Path) -> None:
    r, events = launch(tmp_path, "--max-restarts", "1", "--restart-backoff", "0",
                       "--tee", "3", "--log-dir", str(tmp_path / "logs"), mode="crash")
    assert r.returncode == 0, r.stderr[-3000:]
    crashes = [e for e in events if e["event"] == "fault" and e["kind"] == "crash"]
    assert len(crashes) == 1, crashes  # the peers were stopped, not crashed
    crash = crashes[0]
    assert (crash["local_rank"], crash["rank"], crash["exit_code"]) == (2, 2, 3)
    assert "exited with code 3" in crash["message"]
    assert any("worker 2 failed on purpose" in line for line in crash["last_stderr_lines"])
    assert any("crash_here" in line for line in crash["last_stderr_lines"])
    # every worker ran attempt 1, and none started before all of attempt 0 had exited
    runs = [e for e in events if e["event"] == "state" and e["kind"] == "running"]
    exits = [e for e in events if e["event"] == "state" and e["kind"] == "exited"]
    second = [e for e in runs if e["attempt"] == 1]
    assert sorted(e["local_rank"] for e in second) == [0, 1, 2, 3]
    first_exits = [e for e in exits if e["ts"] < min(s["ts"] for s in second)]
    assert sorted(e["local_rank"] for e in first_exits) == [0, 1, 2, 3]
    seen = dumps(tmp_path / "ft")
    assert all(seen[f"{r}.1"]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1" for r in range(4))
    # --tee: prefixed on the console, as is in the log files
    assert "[default2]:RuntimeError: worker 2 failed on purpose" in r.stderr
    (logdir,) = (tmp_path / "logs").iterdir()
    assert "worker 2 failed on purpose" in (logdir / "attempt_0" / "2" / "stderr.log"
                                            ).read_text()
    assert (logdir / "attempt_1" / "0" / "stdout.log").read_text().startswith("step=1")


def test_restart_budget_spent_exits_with_the_workers_own_code(tmp_path: Path) -> None:
    r, events = launch(tmp_path, "--max-restarts", "0", mode="crash")
    assert r.returncode == 3, r.stderr[-3000:]  # the worker's code, not torchrun's 1
    actions = [e for e in events if e["event"] == "action"]
    assert {e["kind"] for e in actions} == {"stop"} and len(actions) == 4


def test_hang_of_one_worker_is_that_workers_with_its_stack(tmp_path: Path) -> None:
    r, events = launch(tmp_path, "--max-restarts", "1", "--restart-backoff", "0",
                       "--hang-timeout-min", "1", "--hang-warmup-steps", "2",
                       "--hang-factor", "2", "--hang-verify-window", "0", "--stop-timeout",
                       "2", mode="hang", STEPS="12", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]  # restarted, all four, and healed
    hangs = [e for e in events if e["event"] == "fault" and e["kind"] == "hang"]
    assert hangs, r.stderr[-3000:]
    assert {e["local_rank"] for e in hangs} == {1}
    stacks = " ".join(p.get("stack") or "" for p in hangs[0]["processes"])
    assert "stuck_here" in stacks, hangs[0]["processes"]


def test_flag_errors_are_one_line(tmp_path: Path) -> None:
    for flags, cmd, message in (
            (["--nproc-per-node", "0"], ["x.py"], "must be at least 1"),
            (["--nproc-per-node", "2"], [str(tmp_path / "missing.py")], "script not found"),
            (["--nproc-per-node", "2", "--rdzv-conf", "a=1"], ["x.py"], "not supported")):
        r = subprocess.run(ftagent_cmd(*flags, cmd=cmd), capture_output=True, text=True,
                           env=clean_env(), timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, \
            r.stderr


@needs_torch
def test_real_gloo_job_of_four_workers_heals_after_a_crash(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    port = str(free_port())
    cmd = ftagent_cmd("--events-file", str(events), "--nproc-per-node", "4",
                      "--master-port", port, "--max-restarts", "1", "--restart-backoff", "0",
                      cmd=[TRAIN])
    env = clean_env(TRAIN_STEPS="8", TRAIN_STEP_SLEEP="0.05", FAULT_RANK="2",
                    FAULT_CRASH_AT_STEP="3", TRAIN_PG_TIMEOUT="60")
    # examples/train.py counts attempts by ftagent's variable; torchrun's is the same value
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    ev = read_events(events)
    crashes = [e for e in ev if e["event"] == "fault" and e["kind"] == "crash"]
    assert crashes and crashes[0]["local_rank"] == 2 and crashes[0]["exit_code"] == 3
    done = [e for e in ev if e["event"] == "state" and e["kind"] == "succeeded"]
    assert sorted(e["local_rank"] for e in done) == [0, 1, 2, 3]
    assert sys.executable  # the workers ran with this Python (torchrun's rule)
