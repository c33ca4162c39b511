"""``ftagent run`` against real processes: exit codes, signals, process trees, restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import PY, ftagent_cmd, pid_gone, popen, read_events, wait_for


def run(*flags: str, cmd: list[str], timeout: float = 60, **kw: object) -> \
        subprocess.CompletedProcess[bytes]:
    return subprocess.run(ftagent_cmd(*flags, cmd=cmd), capture_output=True, timeout=timeout,
                          **kw)  # type: ignore[call-overload]


def py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


# ------------------------------------------------------------------ exit status


def test_exit_code_propagates() -> None:
    assert run(cmd=["sh", "-c", "exit 7"]).returncode == 7
    assert run(cmd=["true"]).returncode == 0


def test_signal_death_is_128_plus_n() -> None:
    assert run(cmd=["sh", "-c", "kill -KILL $$"]).returncode == 128 + 9
    assert run(cmd=py("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
               ).returncode == 128 + signal.SIGSEGV


def test_command_not_found_is_127() -> None:
    r = run(cmd=["/nonexistent/trainer"])
    assert r.returncode == 127
    assert b"command not found" in r.stderr


# ------------------------------------------------------------------ signals and stopping


def _start(tmp_path: Path, code: str, *flags: str) -> subprocess.Popen[bytes]:
    ready = tmp_path / "ready"
    proc = popen(ftagent_cmd(*flags, cmd=py(code)), stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, env={"READY": str(ready)})
    wait_for(ready.exists, 30, "trainer ready")
    return proc


def test_sigterm_is_forwarded_and_handlers_exit_code_returned(tmp_path: Path) -> None:
    proc = _start(tmp_path, """
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))
        open(os.environ["READY"], "w").close()
        time.sleep(60)
    """)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 42


def test_sigint_is_forwarded_as_sigint(tmp_path: Path) -> None:
    proc = _start(tmp_path, """
        import os, sys, time
        open(os.environ["READY"], "w").close()
        try:
            time.sleep(60)
        except KeyboardInterrupt:
            sys.exit(17)
    """)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 17


def test_trainer_ignoring_sigterm_is_killed_after_grace(tmp_path: Path,
                                                        events_file: Path) -> None:
    proc = _start(tmp_path, """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.environ["READY"], "w").close()
        while True:
            time.sleep(1)
    """, "--stop-timeout", "0.5", "--events-file", str(events_file))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGKILL
    states = [e["kind"] for e in read_events(events_file) if e["event"] == "state"]
    assert "stopped" in states


def test_grandchild_in_own_session_is_killed_on_stop(tmp_path: Path) -> None:
    gc = tmp_path / "grandchild.pid"
    proc = _start(tmp_path, f"""
        import os, subprocess, time
        p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        open({str(gc)!r}, "w").write(str(p.pid))
        open(os.environ["READY"], "w").close()
        time.sleep(60)
    """, "--stop-timeout", "5")
    grandchild = int(gc.read_text())
    assert not pid_gone(grandchild)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert pid_gone(grandchild), "setsid grandchild survived the agent"


def test_leftover_grandchild_is_killed_when_trainer_crashes(tmp_path: Path) -> None:
    gc = tmp_path / "grandchild.pid"
    r = run("--stop-timeout", "2", cmd=py(f"""
        import subprocess, sys
        p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        open({str(gc)!r}, "w").write(str(p.pid))
        sys.exit(1)
    """))
    assert r.returncode == 1
    assert pid_gone(int(gc.read_text()))


def test_sigkill_of_agent_kills_trainer(tmp_path: Path) -> None:
    pidfile = tmp_path / "trainer.pid"
    proc = _start(tmp_path, f"""
        import os, time
        open({str(pidfile)!r}, "w").write(str(os.getpid()))
        open(os.environ["READY"], "w").close()
        time.sleep(60)
    """)
    trainer = int(pidfile.read_text())
    proc.kill()
    proc.wait(timeout=10)
    wait_for(lambda: pid_gone(trainer), 10, "trainer to die with the agent")


def test_orphans_are_reparented_to_the_agent_and_reaped(tmp_path: Path) -> None:
    """A grandchild whose parent died is re-parented to the agent (sub-reaper), which
    reaps it when it exits: no zombies, even as PID 1 in a container."""
    gc = tmp_path / "orphan.pid"
    go = tmp_path / "go"
    proc = _start(tmp_path, f"""
        import os, time
        if os.fork() == 0:          # child: fork a grandchild, then die at once
            if os.fork() == 0:
                open({str(gc)!r} + ".tmp", "w").write(str(os.getpid()))
                os.rename({str(gc)!r} + ".tmp", {str(gc)!r})
                while not os.path.exists({str(go)!r}):
                    time.sleep(0.01)
                os._exit(0)
            os._exit(0)
        os.wait()
        open(os.environ["READY"], "w").close()
        time.sleep(60)
    """)
    orphan = int(wait_for(lambda: gc.exists() and gc.read_text(), 10, "orphan pid"))

    def ppid() -> int:
        with open(f"/proc/{orphan}/status") as f:
            for line in f:
                if line.startswith("PPid:"):
                    return int(line.split()[1])
        return -1

    wait_for(lambda: ppid() == proc.pid, 10, "orphan re-parented to the agent")
    go.touch()
    wait_for(lambda: not os.path.exists(f"/proc/{orphan}"), 10, "orphan to be reaped")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


# ------------------------------------------------------------------ restarts


def test_restarts_count_backoff_and_env(events_file: Path) -> None:
    r = run("--max-restarts", "2", "--restart-backoff", "0.2", "--events-file",
            str(events_file),
            cmd=["sh", "-c", 'echo "attempt=$FTAGENT_RESTART_COUNT"; exit 9'])
    assert r.returncode == 9
    assert r.stdout.decode().split() == ["attempt=0", "attempt=1", "attempt=2"]
    events = read_events(events_file)
    restarts = [e for e in events if e["event"] == "action" and e["kind"] == "restart"]
    # the first failure restarts at once; a repeat within the window backs off, doubling
    assert [e["backoff_seconds"] for e in restarts] == [0.0, 0.2]
    stop = [e for e in events if e["event"] == "action" and e["kind"] == "stop"]
    assert len(stop) == 1 and stop[0]["exit_code"] == 9
    # each restart waited at least its backoff: exit of attempt n -> start of attempt n+1
    exits = [e["ts"] for e in events if e["event"] == "state" and e["kind"] == "exited"]
    starts = [e["ts"] for e in events if e["event"] == "state" and e["kind"] == "running"]
    assert len(starts) == 3
    for i, wait in enumerate([0.0, 0.2]):
        assert starts[i + 1] - exits[i] >= wait


def test_no_restart_on_success(events_file: Path) -> None:
    r = run("--max-restarts", "3", "--events-file", str(events_file), cmd=["true"])
    assert r.returncode == 0
    assert not [e for e in read_events(events_file) if e["event"] == "action"]


def test_crash_fault_in_events_file_has_code_and_last_lines(events_file: Path) -> None:
    r = run("--events-file", str(events_file), cmd=py("""
        import sys
        for i in range(300):
            print(f"line {i}")
        print("Traceback: the last words", file=sys.stderr)
        sys.exit(3)
    """))
    assert r.returncode == 3
    faults = [e for e in read_events(events_file) if e["event"] == "fault"]
    assert len(faults) == 1
    f = faults[0]
    assert f["kind"] == "crash" and f["exit_code"] == 3 and f["exit_status"] == 3
    # stdout and stderr are separate pipes read by separate threads: their relative order
    # in last_lines is not defined, so the traceback is also kept per stream
    assert f["last_stderr_lines"] == ["Traceback: the last words"]
    assert "line 299" in f["last_lines"][-2:]
    assert len(f["last_lines"]) == 50  # the fault carries the last 50 of --log-lines 200
    assert f["ts"] > 0 and f["time"].endswith("Z")


# ------------------------------------------------------------------ flags


def test_unknown_flag_is_one_line_and_exit_2() -> None:
    r = run("--no-such-flag", cmd=["true"])
    assert r.returncode == 2
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "--no-such-flag" in lines[0] and "Traceback" not in lines[0]


def test_bad_values_and_env_are_exit_2() -> None:
    r = run("--max-restarts", "many", cmd=["true"])
    assert r.returncode == 2 and b"--max-restarts" in r.stderr
    r = subprocess.run(ftagent_cmd(cmd=["true"]), capture_output=True, timeout=30,
                       env=dict(os.environ, FTAGENT_STOP_TIMEOUT="-3"))
    assert r.returncode == 2 and b"FTAGENT_STOP_TIMEOUT" in r.stderr
    r = subprocess.run([PY, "-m", "ftagent", "run"], capture_output=True, timeout=30)
    assert r.returncode == 2 and b"no command" in r.stderr


def test_env_variables_configure_flags() -> None:
    r = subprocess.run(ftagent_cmd(cmd=["sh", "-c", 'echo $FTAGENT_RESTART_COUNT; exit 1']),
                       capture_output=True, timeout=60,
                       env=dict(os.environ, FTAGENT_MAX_RESTARTS="1",
                                FTAGENT_RESTART_BACKOFF="0"))
    assert r.returncode == 1 and r.stdout.split() == [b"0", b"1"]


def test_help_documents_every_flag_with_its_env_variable() -> None:
    from ftagent.config import RUN_GROUPS

    r = subprocess.run([PY, "-m", "ftagent", "run", "--help"], capture_output=True,
                       timeout=30)
    assert r.returncode == 0
    text = r.stdout.decode()
    import dataclasses

    for _, cls in RUN_GROUPS.values():
        for f in dataclasses.fields(cls):
            assert f.metadata["flag"] in text
            assert f.metadata["env"] in text, f.metadata["env"]


# ------------------------------------------------------------------ one attempt's stop


def _session(sid: int) -> list[Any]:
    """The live processes of session ``sid``: the trainer's tree as a test lists it (the
    test process is no sub-reaper, so an orphan is not its descendant any more)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


async def _stopped(code: str, grace: float, *, died_first: bool = False
                   ) -> tuple[bool, list[int], float]:
    """Start ``code`` as a trainer, stop it as a restart does (``terminate``), then clear
    what it left: whether the stop saw its tree empty, what was left at its exit, and how
    long the clearing took. ``died_first``: the stop's look (the tree's first listing) is
    made once the trainer died of the SIGTERM, as it usually is -- not certainly: the look
    follows the signal at once, and on a loaded machine the trainer may not have run yet
    (a clean-clone CI run, stop 44)."""
    from ftagent.agent.supervisor import ChildReaper, TrainerProcess, clear_leftovers, terminate

    loop = asyncio.get_running_loop()
    reaper = ChildReaper()
    reaper.install(loop)
    lines: list[bytes] = []
    try:
        trainer = TrainerProcess(py(code), dict(os.environ), reaper,
                                 lambda stream, blob, ts: lines.append(blob),
                                 stdout_fd=lambda b: None, stderr_fd=lambda b: None)
        t0 = loop.time()
        while not lines and loop.time() - t0 < 30:  # its "ready" line
            await asyncio.sleep(0.01)
        assert lines, "trainer ready"
        sid = trainer.pid

        looks = [0]

        def tree() -> list[Any]:
            looks[0] += 1
            if died_first and looks[0] == 1:  # the stop's look, right after its SIGTERM
                wait_for(lambda: not _session(sid), 10, "the trainer died of the SIGTERM")
            return _session(sid)

        cleared = await terminate(trainer, tree, time.monotonic() + 10, forwarded=None,
                                  stop_timeout=10)
        await trainer.exited
        left = [p.pid for p in tree()]
        t1 = time.monotonic()
        await clear_leftovers(tree, time.monotonic() + grace)
        took = time.monotonic() - t1
        assert tree() == []
        return cleared, left, took
    finally:
        reaper.uninstall()


def test_a_stop_that_saw_the_tree_empty_leaves_nothing_to_clear() -> None:
    """A trainer without a handler dies of the SIGTERM: the stop's one look finds its tree
    empty, and the look after the exit (skipped by the worker then) would find nothing."""
    cleared, left, _ = asyncio.run(_stopped(
        "import time; print('ready', flush=True); time.sleep(60)", 5.0, died_first=True))
    assert cleared and left == []


def test_a_child_that_outlives_the_trainer_is_seen_and_cleared() -> None:
    """The trainer dies of the SIGTERM, its child ignores it: the stop's look lists the
    child (the trainer a zombie not reaped yet, or gone), so the look after the exit is
    made, and it SIGKILLs the child once the grace is over."""
    cleared, left, took = asyncio.run(_stopped("""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import signal, time; "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        time.sleep(0.5)
        print("ready", flush=True)
        time.sleep(60)
        """, 0.3))
    assert not cleared and len(left) == 1
    assert took >= 0.25  # its grace, then the SIGKILL
