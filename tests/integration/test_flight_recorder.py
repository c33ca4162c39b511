"""The flight recorder with no change to the training script, against real processes:
the env the agent gives its trainer, the ``sitecustomize`` trigger (fr_boot.py) in a
real 2-rank gloo job whose main threads are blocked in a collective, the safe reader and
the verdict naming the rank that never enqueued the collective."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from ftagent.agent.flight_recorder import FlightRecorder, fr_env
from ftagent.arbiter.fr_verdict import decide
from tests.conftest import PY, free_port, ftagent_cmd, popen, wait_for

# A plain gloo script: nothing in it knows of ftagent. Rank 1 stops after 3 all_reduces.
TRAIN = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for _ in range(3):
    dist.all_reduce(torch.ones(4))
open(os.environ["READY"] + str(dist.get_rank()), "w").close()
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(4))
time.sleep(120)
"""


def test_fr_env_sets_only_what_the_user_did_not() -> None:
    env = fr_env({"PYTHONPATH": "/u", "TORCH_NCCL_TRACE_BUFFER_SIZE": "50",
                  "TORCH_INCLUDE_STACK_TRACE": "1"}, 2000, "/r/fr")
    assert "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    assert "TORCH_INCLUDE_STACK_TRACE" not in env
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == \
        "/r/fr/current/rank_"
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == "/r/fr/current/pipe_"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["PYTHONPATH"] == "/r/fr/site" + os.pathsep + "/u"
    assert env["FTAGENT_FR_LEGACY"] == "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"  # ours only
    full = fr_env({}, 100, "/r/fr")
    assert full["TORCH_FR_BUFFER_SIZE"] == full["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "100"
    assert full["TORCH_INCLUDE_STACK_TRACE"] == "0" and full["PYTHONPATH"] == "/r/fr/site"
    assert fr_env({}, 0, "/r/fr") == {}


def test_trigger_dumps_a_real_gloo_job_and_the_verdict_names_the_rank(tmp_path: Path) -> None:
    fr = FlightRecorder(str(tmp_path / "fr"), {})
    env = fr_env({}, 100, fr.dir)
    fr = FlightRecorder(fr.dir, env)
    assert fr.prepare()
    fr.begin_attempt(0)
    fr.begin_attempt(1)  # the attempt's own directory: earlier ones stay apart
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    port = free_port()
    procs = []
    for rank in range(2):
        e = dict(os.environ, **env, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), READY=str(tmp_path / "ready"))
        procs.append(popen([PY, str(script)], env=e, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE))
    try:
        wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in range(2)), 90,
                 "both ranks past 3 all_reduces")

        def rank0_in_collective_4() -> dict[str, Any] | None:
            got = asyncio.run(fr.snapshot(timeout=10))
            ranks = {s["rank"]: s for s in got["summaries"]}
            if len(ranks) == 2 and ranks[0]["groups"][0]["enqueued"] == 4:
                return got
            return None

        got = wait_for(rank0_in_collective_4, 30, "rank 0 inside all_reduce #4")
        assert got["errors"] == []
        v = decide({s["rank"]: s for s in got["summaries"]}, world=2)
        assert (v.kind, v.culprits) == ("behind", (1,))
        assert "never reached collective #4 (all_reduce)" in v.reason
        assert sorted(os.listdir(tmp_path / "fr" / "attempt_1")) == ["rank_0", "rank_1"]
        assert os.listdir(tmp_path / "fr" / "attempt_0") == []
        assert all(p.poll() is None for p in procs)  # the dump did not stop training
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p in procs:  # torch 2.13 warns of each pre-2.8 name set: fr_boot dropped ours
        assert p.stderr is not None
        assert b"is deprecated" not in p.stderr.read()


def test_no_torch_no_dump_and_the_trainers_own_sitecustomize_still_runs(
        tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    fr = FlightRecorder(str(tmp_path / "fr"), {})
    env = fr_env({"PYTHONPATH": str(user)}, 100, fr.dir)
    fr = FlightRecorder(fr.dir, env)
    assert fr.prepare()
    fr.begin_attempt(0)
    code = textwrap.dedent("""
        import os, sys, time
        print(os.environ.get("USER_SITE_RAN"), sys.modules["sitecustomize"].__file__,
              any(p.endswith("site") and "fr" in p for p in sys.path), flush=True)
        while not os.path.exists(os.environ["STOP"]):
            time.sleep(0.01)
        sys.exit(7)
    """)
    stop = tmp_path / "stop"
    p = popen([PY, "-c", code], env=dict(os.environ, **env, STOP=str(stop)),
              stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        line = p.stdout.readline().decode().split()
        # the user's sitecustomize ran; the trigger's directory is off the program's path
        assert line == ["1", str(user / "sitecustomize.py"), "False"]
        wait_for(lambda: os.listdir(tmp_path / "fr" / "trigger"), 10, "the trigger FIFO")
        got = asyncio.run(fr.snapshot(timeout=20))
        assert got["summaries"] == [] and got["errors"] == []
        # it answered "no dump" at once: the snapshot did not wait out its timeout
        assert got["seconds"] < 10, got
        stop.touch()
        assert p.wait(30) == 7  # the trainer's exit code, untouched
    finally:
        p.kill()
        p.wait()
    assert fr.trigger() == ([], set())  # its FIFO had no reader any more: removed
    assert os.listdir(tmp_path / "fr" / "trigger") == []


def test_the_wrapper_gives_its_trainer_the_flight_recorder_env(tmp_path: Path) -> None:
    show = ("import json, os, sys; json.dump({k: v for k, v in os.environ.items() "
            "if k.startswith(('TORCH_', 'FTAGENT_FR')) or k == 'PYTHONPATH'}, sys.stdout)")
    r = subprocess.run(ftagent_cmd("--progress", "none", "--log-level", "error",
                                   cmd=[PY, "-c", show]),
                       capture_output=True, timeout=60, cwd=tmp_path,
                       env=dict(os.environ, TORCH_FR_BUFFER_SIZE="77"))
    assert r.returncode == 0, r.stderr.decode()
    env = json.loads(r.stdout)
    assert env["TORCH_FR_BUFFER_SIZE"] == "77" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    fr_dir = env["FTAGENT_FR_DIR"]
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(fr_dir, "current", "rank_")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == os.path.join(fr_dir, "site")
    r = subprocess.run(ftagent_cmd("--progress", "none", "--log-level", "error",
                                   "--fr-buffer-size", "0", cmd=[PY, "-c", show]),
                       capture_output=True, timeout=60, cwd=tmp_path, env=dict(os.environ))
    assert r.returncode == 0, r.stderr.decode()
    assert not [k for k in json.loads(r.stdout) if k.startswith(("TORCH_FR", "FTAGENT_FR"))]


def test_an_answer_names_only_this_attempts_dump_file(tmp_path: Path) -> None:
    fr = FlightRecorder(str(tmp_path), {"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "rank_")})
    fifo = str(tmp_path / "1.fifo")
    assert fr._answer(fifo) == (False, None)  # not answered yet
    for path, rank in ((str(tmp_path / "rank_3"), 3), ("/etc/shadow", None),
                       (str(tmp_path / "rank_3/../../x"), None), ("", None),
                       (str(tmp_path / "rank_") + "9" * 20, None)):
        Path(fifo + ".done").write_text(path)
        assert fr._answer(fifo) == (True, rank), path


def test_a_stopped_trainer_costs_the_snapshot_its_timeout_and_nothing_else(
        tmp_path: Path) -> None:
    # SIGSTOP stands for an interpreter that cannot run the trigger thread (a main thread
    # holding the GIL in C code): no answer, an error in the snapshot, no hang of the agent
    import signal

    fr = FlightRecorder(str(tmp_path / "fr"), {})
    env = fr_env({}, 100, fr.dir)
    fr = FlightRecorder(fr.dir, env)
    assert fr.prepare()
    fr.begin_attempt(0)
    p = popen([PY, "-c", "import time\nwhile True: time.sleep(1)"], env=dict(os.environ, **env))
    try:
        wait_for(lambda: os.listdir(tmp_path / "fr" / "trigger"), 10, "the trigger FIFO")
        p.send_signal(signal.SIGSTOP)
        wait_for(lambda: all_threads_stopped(p.pid), 10, "every thread of the trainer stopped")
        got = asyncio.run(fr.snapshot(timeout=1.0))
        assert got["summaries"] == []
        assert got["errors"] == ["1 trainer process(es) did not answer within 1.0s "
                                 "(a stuck interpreter holding the GIL?)"]
        assert 1.0 <= got["seconds"] < 5.0
        p.send_signal(signal.SIGCONT)  # resumed, it answers the trigger it had missed
        got = asyncio.run(fr.snapshot(timeout=20))
        assert got["errors"] == [] and got["seconds"] < 10
    finally:
        p.kill()
        p.wait()


def all_threads_stopped(pid: int) -> bool:
    """SIGSTOP takes effect per thread (a thread woken in a syscall may run on a moment):
    every task of ``pid`` in state T."""
    tasks = os.listdir(f"/proc/{pid}/task")
    for t in tasks:
        with open(f"/proc/{pid}/task/{t}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "T":
                return False
    return bool(tasks)
