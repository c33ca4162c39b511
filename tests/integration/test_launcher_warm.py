"""Warm restarts under ``ftagent run --nproc-per-node N``, against real processes.

Every worker keeps a standby of its own (started with that worker's environment); after
one local rank crashes, each worker's next trainer is its own standby, which sees the new
generation's environment, argv, working directory and ``sys.path[0]``; standbys are
started again for the next generation, and none outlives the agent however it ends.

A tiny script importing a light marker module for most cases (``import torch`` costs ~3 s
per process here); one real 2-rank gloo job with torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import types
from pathlib import Path
from typing import Any

import psutil
import pytest

from ftagent.agent import standby
from tests.conftest import free_port, ftagent_cmd, pid_gone, read_events, wait_for
from tests.e2e.jobs import TRAIN, needs_torch
from tests.integration.test_launcher import clean_env

# Imported by trainers and standbys alike: a marker named after the importing pid, and a
# thread started at import (as torch's import starts one). HOLD_IMPORT: a standby importing
# at idle priority stays inside the import until that priority is lifted (the go's job).
WARMMARK = """
import os, threading, time
MARK_PID = os.getpid()
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
open(os.path.join(os.environ["MARK_DIR"], "imported.%d" % MARK_PID), "w").close()
IDLE = getattr(os, "SCHED_IDLE", -1)
IDLE_AT_IMPORT = os.sched_getscheduler(0) == IDLE
if IDLE_AT_IMPORT and os.environ.get("HOLD_IMPORT"):
    deadline = time.monotonic() + 60
    while os.sched_getscheduler(0) == IDLE and time.monotonic() < deadline:
        time.sleep(0.01)
LIFTED_IN_IMPORT = IDLE_AT_IMPORT and os.sched_getscheduler(0) != IDLE
"""

# Attempt 0: local rank CRASH_RANK exits 3 once GO_DIR/crash exists, the others wait to be
# stopped. Attempt 1 waits for GO_DIR/finish. Each attempt dumps what the trainer sees.
WORKER = r"""
import os, sys
PRE = "warmmark" in sys.modules
import json, time
import warmmark

lr = int(os.environ["LOCAL_RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "FTAGENT_LOCAL_RANK",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE", "FTAGENT_SDK_SOCKET")
report = {"pre": PRE, "mark_pid": warmmark.MARK_PID, "pid": os.getpid(), "argv": sys.argv,
          "path0": sys.path[0], "cwd": os.getcwd(), "file": __file__,
          "env": {k: os.environ.get(k) for k in keys},
          "idle_at_import": warmmark.IDLE_AT_IMPORT, "lifted": warmmark.LIFTED_IN_IMPORT,
          "idle_threads": [t for t in os.listdir("/proc/self/task")
                           if os.sched_getscheduler(int(t)) == warmmark.IDLE]}
dump = os.environ["DUMP_DIR"]
with open(os.path.join(dump, ".%d.%d" % (lr, attempt)), "w") as f:
    json.dump(report, f)
os.rename(os.path.join(dump, ".%d.%d" % (lr, attempt)),
          os.path.join(dump, "%d.%d.json" % (lr, attempt)))

def wait(name):
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(os.environ["GO_DIR"], name)):
        if time.monotonic() > deadline:
            sys.exit("no %s within 120 s" % name)
        time.sleep(0.01)

if attempt == 0:
    print("step=1 loss=1.0", flush=True)  # the first step: the worker's standby starts
    wait("crash" if lr == int(os.environ["CRASH_RANK"]) else "never")
    sys.exit(3)
import ftagent.sdk  # learned, so imported by the standby: reaches this worker's agent
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(os.environ["GO_DIR"], "finish")):
    # stepping until told to finish: the events file keeps a step per 2 s at most, and
    # attempt 0's step may have been less than that before
    ftagent.sdk.step(100 + lr)
    if time.monotonic() > deadline:
        sys.exit("no finish within 120 s")
    time.sleep(0.05)
"""


class Job:
    """One ``ftagent run --nproc-per-node N`` of WORKER, and what it leaves on disk."""

    def __init__(self, tmp: Path, n: int, *flags: str, module: bool = False,
                 max_restarts: int = 2, **extra: str) -> None:
        self.tmp, self.n = tmp, n
        (tmp / "lib").mkdir()
        (tmp / "lib" / "warmmark.py").write_text(WARMMARK)
        for d in ("mark", "dump", "go"):
            (tmp / d).mkdir()
        self.script = tmp / "worker.py"
        self.script.write_text(WORKER)
        self.events = tmp / "events.jsonl"
        cmd = ["worker" if module else str(self.script), "--lr", "3"]
        flags = ("-m", *flags) if module else flags  # python -m worker, sys.path[0] the cwd
        env = clean_env(MARK_DIR=str(tmp / "mark"), DUMP_DIR=str(tmp / "dump"),
                        GO_DIR=str(tmp / "go"), CRASH_RANK="1", **extra)
        env["PYTHONPATH"] += os.pathsep + str(tmp / "lib")
        self.log = open(tmp / "agent.log", "wb")  # noqa: SIM115 - closed in stop()
        self.agent = subprocess.Popen(
            ftagent_cmd("--events-file", str(self.events), "--nproc-per-node", str(n),
                        "--max-restarts", str(max_restarts), "--restart-backoff", "0",
                        "--log-level", "warning", *flags, cmd=cmd),
            cwd=tmp, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return (self.tmp / "agent.log").read_text(errors="replace")[-4000:]

    def dumps(self, attempt: int) -> dict[int, dict[str, Any]]:
        """local rank -> what its trainer of ``attempt`` saw."""
        out = {}
        for lr in range(self.n):
            p = self.tmp / "dump" / f"{lr}.{attempt}.json"
            if p.exists():
                out[lr] = json.loads(p.read_text())
        return out

    def wait_dumps(self, attempt: int) -> dict[int, dict[str, Any]]:
        return wait_for(lambda: len(self.dumps(attempt)) == self.n and self.dumps(attempt),
                        90, f"every worker's trainer of attempt {attempt}")

    def standbys(self, trainers: set[int]) -> dict[int, psutil.Process]:
        """local rank -> the agent's waiting standby for that worker: a child running the
        bootstrap that is no trainer (a warm trainer keeps the bootstrap's cmdline)."""
        out: dict[int, psutil.Process] = {}
        for p in psutil.Process(self.agent.pid).children(recursive=True):
            try:
                if p.pid in trainers or not any("ftagent_standby" in a for a in p.cmdline()):
                    continue
                out[int(p.environ()["FTAGENT_LOCAL_RANK"])] = p
            except (psutil.Error, KeyError):
                continue
        return out

    def wait_standbys(self, trainers: set[int]) -> dict[int, psutil.Process]:
        """Every worker's standby, each past its warm imports (its marker is there)."""
        def ready() -> dict[int, psutil.Process] | None:
            sb = self.standbys(trainers)
            marks = set(os.listdir(self.tmp / "mark"))
            if len(sb) == self.n and all(f"imported.{p.pid}" in marks for p in sb.values()):
                return sb
            return None

        return wait_for(ready, 90, "a ready standby per worker")

    def touch(self, name: str) -> None:
        (self.tmp / "go" / name).touch()

    def stop(self) -> None:
        if self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait(30)
        self.log.close()


def standby_events(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """local rank -> its (one) standby event."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["event"] == "standby":
            assert e["local_rank"] not in out, events
            out[e["local_rank"]] = e
    return out


def check_started_for(sb: dict[int, psutil.Process], n: int, attempt: int) -> None:
    """One standby per worker, each started with that worker's environment."""
    assert sorted(sb) == list(range(n)) and len({p.pid for p in sb.values()}) == n
    for lr, p in sb.items():
        env = p.environ()
        assert (env["LOCAL_RANK"], env["RANK"], env["FTAGENT_LOCAL_RANK"]) == \
            (str(lr), str(lr), str(lr))
        assert env["TORCHELASTIC_RESTART_COUNT"] == str(attempt)


@pytest.mark.parametrize(("n", "end", "module"), [
    (2, "exit", False), (4, "sigterm", False), (3, "sigkill", True)])
def test_every_worker_restarts_from_its_own_standby(tmp_path: Path, n: int, end: str,
                                                    module: bool) -> None:
    job = Job(tmp_path, n, module=module)
    try:
        first = job.wait_dumps(0)
        sb0 = job.wait_standbys({d["pid"] for d in first.values()})
        check_started_for(sb0, n, 0)
        job.touch("crash")  # local rank 1 exits 3: the group restarts all n
        second = job.wait_dumps(1)
        for lr, d in second.items():
            assert d["pid"] == sb0[lr].pid, (lr, d)  # its own standby, none shared
            assert d["pre"] is True and d["mark_pid"] == d["pid"]  # imported before the go
            env = d["env"]
            assert (env["LOCAL_RANK"], env["RANK"], env["FTAGENT_LOCAL_RANK"]) == \
                (str(lr), str(lr), str(lr))
            assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(n), str(n))
            assert env["TORCHELASTIC_RESTART_COUNT"] == "1"
            assert f"worker{lr}{os.sep}attempt_1" in env["TORCHELASTIC_ERROR_FILE"]
            old = first[lr]
            for key in ("argv", "path0", "cwd", "file"):  # as the cold first attempt's
                assert d[key] == old[key], (lr, key)
            assert d["argv"][1:] == ["--lr", "3"] and d["cwd"] == str(tmp_path)
            assert d["path0"] == str(tmp_path)
            assert d["idle_threads"] == []  # none left at the imports' idle priority
        # each warm trainer's SDK steps reach its own worker (its socket, its rank)
        wait_for(lambda: {e["local_rank"]: e["step"] for e in read_events(job.events)
                          if e["event"] == "progress"} == {lr: 100 + lr for lr in range(n)},
                 30, "an SDK step from every warm trainer")
        for lr, d in second.items():
            assert d["env"]["FTAGENT_SDK_SOCKET"] == first[lr]["env"]["FTAGENT_SDK_SOCKET"]
            assert d["env"]["FTAGENT_SDK_SOCKET"].endswith(f"worker{lr}{os.sep}sdk.sock")
        # standbys for the next generation, one per worker again
        sb1 = job.wait_standbys({d["pid"] for d in second.values()})
        check_started_for(sb1, n, 1)
        assert not {p.pid for p in sb1.values()} & {p.pid for p in sb0.values()}
        ev = standby_events(read_events(job.events))
        assert sorted(ev) == list(range(n))
        assert {e["kind"] for e in ev.values()} == {"warm"}, ev
        assert all(ev[lr]["pid"] == sb0[lr].pid for lr in ev)
        assert all("warmmark" in e["warm_imports"] for e in ev.values())

        procs = [psutil.Process(d["pid"]) for d in second.values()] + list(sb1.values())
        if end == "exit":
            job.touch("finish")
            assert job.agent.wait(60) == 0, job.output()
        else:
            job.agent.send_signal(signal.SIGTERM if end == "sigterm" else signal.SIGKILL)
            job.agent.wait(60)
        wait_for(lambda: all(pid_gone(p.pid) for p in procs), 30,
                 f"no trainer or standby left after the agent's {end}")
    finally:
        job.stop()


def test_a_dead_standby_means_a_cold_start_for_its_worker_only(tmp_path: Path) -> None:
    job = Job(tmp_path, 3, "--warm-imports", "warmmark")
    try:
        first = job.wait_dumps(0)
        sb0 = job.wait_standbys({d["pid"] for d in first.values()})
        sb0[2].kill()
        wait_for(lambda: pid_gone(sb0[2].pid), 30, "the standby of local rank 2 killed")
        job.touch("crash")
        second = job.wait_dumps(1)
        assert second[2]["pid"] != sb0[2].pid and second[2]["pre"] is False  # cold
        assert [second[lr]["pid"] for lr in (0, 1)] == [sb0[0].pid, sb0[1].pid]
        assert second[2]["env"]["LOCAL_RANK"] == "2"
        ev = wait_for(lambda: len(standby_events(read_events(job.events))) == 3 and
                      standby_events(read_events(job.events)), 30, "3 standby events")
        assert (ev[0]["kind"], ev[1]["kind"], ev[2]["kind"]) == ("warm", "warm", "cold")
        assert ev[2]["reason"] == "the standby died (killed by signal 9, SIGKILL)", ev[2]
        assert ev[2]["pid"] == second[2]["pid"]
        # --warm-imports: only what it names (learning would also bring json)
        assert ev[0]["warm_imports"] == ev[1]["warm_imports"] == ["warmmark"]
        # the cold worker gets a standby for the next generation like the others
        check_started_for(job.wait_standbys({d["pid"] for d in second.values()}), 3, 1)
        job.touch("finish")
        assert job.agent.wait(60) == 0, job.output()
    finally:
        job.stop()


def test_a_standby_dead_before_its_sigchld_is_handled_is_known_dead() -> None:
    """The race the events above cannot show: the standby died, the loop has not reaped
    it yet (its exit future is pending), and the restart asks whether it is fit."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        loop = asyncio.new_event_loop()
        sb = types.SimpleNamespace(pid=child.pid, exited=loop.create_future(), alive=True)
        assert standby._death(sb) is None  # type: ignore[arg-type]
        child.send_signal(signal.SIGKILL)
        wait_for(lambda: pid_gone(child.pid), 30, "sleep killed")
        assert standby._death(sb) == " (killed by signal 9, SIGKILL)"  # type: ignore[arg-type]
        assert child.poll() == -signal.SIGKILL  # the peek left it to be reaped
        loop.close()
    finally:
        child.kill()
        child.wait()


def test_a_go_during_the_warm_imports_lifts_their_idle_priority(tmp_path: Path) -> None:
    job = Job(tmp_path, 2, HOLD_IMPORT="1")
    try:
        first = job.wait_dumps(0)
        sb0 = job.wait_standbys({d["pid"] for d in first.values()})  # inside the import
        job.touch("crash")
        second = job.wait_dumps(1)
        assert {d["pid"] for d in second.values()} == {p.pid for p in sb0.values()}
        if not all(d["idle_at_import"] for d in second.values()):
            pytest.skip("standbys import at normal priority here (no CAP_SYS_NICE and "
                        "an RLIMIT_NICE that does not allow leaving SCHED_IDLE)")
        # the go lifted it while the import still ran: not left to finish at idle
        assert [d["lifted"] for d in second.values()] == [True, True]
        assert [d["idle_threads"] for d in second.values()] == [[], []]
        job.touch("finish")
        assert job.agent.wait(60) == 0, job.output()
    finally:
        job.stop()


def test_no_standby_is_kept_once_the_restart_budget_is_spent(tmp_path: Path) -> None:
    job = Job(tmp_path, 2, max_restarts=1)
    try:
        first = job.wait_dumps(0)
        sb0 = job.wait_standbys({d["pid"] for d in first.values()})
        job.touch("crash")
        second = job.wait_dumps(1)
        assert {d["pid"] for d in second.values()} == {p.pid for p in sb0.values()}
        # a standby is spawned in the same loop callback as the attempt's first step is
        # written to the events file: none once every worker's step is, as no restart can
        # follow this attempt
        wait_for(lambda: {e["local_rank"] for e in read_events(job.events)
                          if e["event"] == "progress" and e["step"] >= 100} == {0, 1},
                 30, "an SDK step from every warm trainer")
        assert job.standbys({d["pid"] for d in second.values()}) == {}
        job.touch("finish")
        assert job.agent.wait(60) == 0, job.output()
    finally:
        job.stop()


def standby_count(agent: int) -> int:
    n = 0
    for p in psutil.Process(agent).children():
        try:
            n += any("ftagent_standby" in a for a in p.cmdline())
        except psutil.Error:
            continue
    return n


@needs_torch
def test_real_gloo_job_of_two_workers_heals_warm(tmp_path: Path) -> None:
    events, logs = tmp_path / "events.jsonl", tmp_path / "logs"
    cmd = ftagent_cmd("--events-file", str(events), "--nproc-per-node", "2",
                      "--master-port", str(free_port()), "--max-restarts", "1",
                      "--restart-backoff", "0", "--log-dir", str(logs), "--tee", "3",
                      cmd=[TRAIN])
    crash = tmp_path / "crash"
    env = clean_env(TRAIN_STEPS="40", TRAIN_STEP_SLEEP="0.05", FAULT_RANK="1",
                    FAULT_CRASH_ON_FILE=str(crash), TRAIN_PG_TIMEOUT="60")
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        # the standbys start at the workers' first step, not beside their start-up: rank 1
        # crashes once both exist (a crash before that restarts cold)
        wait_for(lambda: agent.poll() is not None or standby_count(agent.pid) == 2,
                 120, "a standby per worker after the first step")
        crash.touch()
        _, err = agent.communicate(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, err[-4000:]
    ev = read_events(events)
    crashes = [e for e in ev if e["event"] == "fault" and e["kind"] == "crash"]
    assert [(e["local_rank"], e["exit_code"]) for e in crashes] == [(1, 3)]
    sb = standby_events(ev)
    assert sorted(sb) == [0, 1] and {e["kind"] for e in sb.values()} == {"warm"}, sb
    assert all("torch" in e["warm_imports"] for e in sb.values())
    done = [e for e in ev if e["event"] == "state" and e["kind"] == "succeeded"]
    assert sorted(e["local_rank"] for e in done) == [0, 1]
    assert {e["pid"] for e in sb.values()} == \
        {e["pid"] for e in ev if e["event"] == "state" and e["kind"] == "running"
         and e["attempt"] == 1}
    (root,) = logs.iterdir()
    for lr in (0, 1):  # both ranks trained again, to the last step
        out = (root / "attempt_1" / str(lr) / "stdout.log").read_text()
        assert f"[rank{lr}] step=40/40" in out, out[-2000:]
