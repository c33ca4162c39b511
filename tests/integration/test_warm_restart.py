"""Warm restarts against real processes: ``ftagent run --max-restarts`` with a trainer that
crashes on its first attempt; the second attempt is the standby (or a cold start when the
standby must not be used), checked from inside the trainer and from the events file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import PY, ftagent_cmd, pid_gone, popen, read_events, wait_for

# A module whose import leaves a marker (its importing pid) beside it: the test and the
# trainer can tell whether it was imported in the standby, before the go.
WARMMARK = """
import os
MARK_PID = os.getpid()
with open(os.environ["MARK_DIR"] + "/imported." + str(MARK_PID), "w"):
    pass
"""

# Attempt 0 waits until a standby has imported warmmark (a marker with another pid), then
# runs ON_READY (modify the script, ...) and crashes; attempt 1 reports what it sees.
SCRIPT = """
import os, sys
PRE = "warmmark" in sys.modules
import json, time
import warmmark

def standbys():  # the agent's standbys: siblings of this trainer
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/stat" % pid, "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                if ppid == os.getppid() and b"ftagent_standby" in f.read():
                    out.append(int(pid))
        except (OSError, IndexError, ValueError):
            pass
    return out

def main():
    attempt = int(os.environ["FTAGENT_RESTART_COUNT"])
    if attempt == 0:
        # no standby beside the trainer's own start-up: it comes at the first step
        with open(os.environ["MARK_DIR"] + "/../early", "w") as f:
            f.write(str(len(standbys())))
        print("step=1 loss=1.0", flush=True)
        deadline = time.monotonic() + 60
        mark = os.environ["MARK_DIR"]
        while not [f for f in os.listdir(mark) if f != "imported.%d" % os.getpid()
                   and f.startswith("imported.")]:
            if time.monotonic() > deadline:
                sys.exit("no standby imported warmmark within 60 s")
            time.sleep(0.01)
        exec(os.environ.get("ON_READY", ""))
        sys.exit(3)
    report = {"pre": PRE, "mark_pid": warmmark.MARK_PID, "pid": os.getpid(),
              "argv": sys.argv, "path0": sys.path[0], "file": __file__, "name": __name__,
              "attempt": os.environ["FTAGENT_RESTART_COUNT"],
              "generation": os.environ["FTAGENT_GENERATION"],
              "sid": os.getsid(0) == os.getpid(), "pgid": os.getpgid(0) == os.getpid(),
              "signals": {str(int(s)): str(__import__("signal").getsignal(s))
                          for s in __import__("signal").valid_signals()},
              "orig_argv": getattr(sys, "orig_argv", None)}
    exec(os.environ.get("ON_RUN", ""))
    with open(os.environ["REPORT"], "w") as f:
        json.dump(report, f)

if __name__ == "__main__":
    main()
"""


def setup(tmp: Path, script: str = SCRIPT) -> tuple[Path, dict[str, str]]:
    lib = tmp / "lib"
    lib.mkdir()
    (lib / "warmmark.py").write_text(WARMMARK)
    mark = tmp / "mark"
    mark.mkdir()
    path = tmp / "train.py"
    path.write_text(script)
    env = {"PYTHONPATH": str(lib), "MARK_DIR": str(mark), "REPORT": str(tmp / "report.json")}
    return path, env


def run_agent(tmp: Path, script: Path, env: dict[str, str], *flags: str,
              args: tuple[str, ...] = ("--lr", "3"), timeout: float = 120
              ) -> tuple[subprocess.CompletedProcess[bytes], list[dict[str, Any]]]:
    events = tmp / f"events{len(list(tmp.glob('events*')))}.jsonl"
    cmd = ftagent_cmd("--max-restarts", "1", "--events-file", str(events), "--log-level",
                      "error", *flags, cmd=[PY, str(script), *args])
    r = subprocess.run(cmd, capture_output=True, timeout=timeout, cwd=tmp,
                       env=dict(os.environ, **env))
    return r, read_events(events)


def standby_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "standby"]


def report(tmp: Path) -> dict[str, Any]:
    return json.loads((tmp / "report.json").read_text())  # type: ignore[no-any-return]


def test_warm_worker_is_the_standby_and_looks_like_a_fresh_start(tmp_path: Path) -> None:
    script, env = setup(tmp_path)
    r, events = run_agent(tmp_path, script, env)
    assert r.returncode == 0, r.stderr.decode()
    warm = report(tmp_path)
    assert [e["kind"] for e in standby_events(events)] == ["warm"]
    # the standby was started at the first step, not beside the trainer's start-up
    assert (tmp_path / "early").read_text() == "0"
    # warmmark was imported before the go, by this very process (learned from the script)
    assert warm["pre"] is True and warm["mark_pid"] == warm["pid"]
    assert (tmp_path / "mark" / f"imported.{warm['pid']}").exists()

    (tmp_path / "report.json").unlink()
    r, events = run_agent(tmp_path, script, env, "--no-warm-restart")
    assert r.returncode == 0, r.stderr.decode()
    cold = report(tmp_path)
    assert standby_events(events) == []
    assert cold["pre"] is False
    # what training code sees is the same as after a cold restart
    for key in ("argv", "path0", "file", "name", "attempt", "generation", "sid", "pgid",
                "signals", "orig_argv"):
        assert warm[key] == cold[key], key
    assert warm["argv"] == [str(script), "--lr", "3"] and warm["attempt"] == "1"
    assert warm["file"] == str(script) and warm["path0"] == str(tmp_path)


def test_output_and_exit_status_are_byte_identical_to_a_cold_start(tmp_path: Path) -> None:
    on_run = textwrap.dedent("""
        print("stdout line", sys.argv[1:], flush=True)
        print("stderr line", file=sys.stderr, flush=True)
        def inner():
            raise ValueError("bad batch")
        inner()
    """)
    script, env = setup(tmp_path)
    env["ON_RUN"] = on_run
    warm, ev = run_agent(tmp_path, script, env)
    assert [e["kind"] for e in standby_events(ev)] == ["warm"]
    cold, _ = run_agent(tmp_path, script, env, "--no-warm-restart")
    assert warm.returncode == cold.returncode == 1
    assert warm.stdout == cold.stdout
    assert warm.stderr == cold.stderr
    assert b"ValueError: bad batch" in warm.stderr and b"train.py" in warm.stderr
    assert b"ftagent_standby" not in warm.stderr  # no frame of the bootstrap


def test_multiprocessing_spawn_and_fork_work_in_the_warm_worker(tmp_path: Path) -> None:
    script, env = setup(tmp_path, SCRIPT.replace(
        'if __name__ == "__main__":',
        'def square(x):\n    return x * x\n\nif __name__ == "__main__":'))
    env["ON_RUN"] = textwrap.dedent("""
        import multiprocessing as mp
        for method in ("spawn", "fork"):
            with mp.get_context(method).Pool(2) as pool:
                report[method] = pool.map(square, [1, 2, 3])
    """)
    r, events = run_agent(tmp_path, script, env)
    assert r.returncode == 0, r.stderr.decode()
    assert [e["kind"] for e in standby_events(events)] == ["warm"]
    rep = report(tmp_path)
    assert rep["spawn"] == rep["fork"] == [1, 4, 9]


def test_a_modified_script_forces_a_cold_start(tmp_path: Path) -> None:
    script, env = setup(tmp_path)
    env["ON_READY"] = (f"open({str(script)!r}, 'a').write("
                       "'\\nprint(\"edited\", flush=True)\\n')")
    r, events = run_agent(tmp_path, script, env)
    assert r.returncode == 0, r.stderr.decode()
    sb = standby_events(events)
    assert [e["kind"] for e in sb] == ["cold"]
    assert "changed since the standby started" in sb[0]["reason"]
    assert str(script) in sb[0]["reason"]
    rep = report(tmp_path)
    assert rep["pre"] is False  # a fresh interpreter: the exec'd command
    assert b"edited" in r.stdout  # the new script ran


def test_a_failing_warm_import_starts_cold(tmp_path: Path) -> None:
    script, env = setup(tmp_path)
    (tmp_path / "lib" / "broken.py").write_text(
        "import warmmark\nraise RuntimeError('no GPU driver')\n")
    r, events = run_agent(tmp_path, script, env, "--warm-imports", "warmmark,broken")
    assert r.returncode == 0, r.stderr.decode()
    sb = standby_events(events)
    assert [e["kind"] for e in sb] == ["cold"]
    assert "warm import failed: broken: RuntimeError: no GPU driver" in sb[0]["reason"]
    assert report(tmp_path)["pre"] is False


def test_sigkill_of_the_agent_leaves_no_standby(tmp_path: Path) -> None:
    script, env = setup(tmp_path, "import time, warmmark\nprint('step=1 loss=1.0', "
                        "flush=True)\ntime.sleep(120)\n")
    agent = popen(ftagent_cmd("--max-restarts", "3", cmd=[PY, str(script)]), env=env,
                  cwd=tmp_path,
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        marks = wait_for(lambda: len(os.listdir(tmp_path / "mark")) >= 2 and
                         os.listdir(tmp_path / "mark"), 60, "trainer and standby imported")
        pids = [int(m.split(".")[1]) for m in marks]
        children = {p.pid for p in psutil.Process(agent.pid).children(recursive=True)}
        assert set(pids) <= children
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        wait_for(lambda: all(pid_gone(p) for p in pids), 30, "trainer and standby gone")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:  # pragma: no cover
    HAVE_TORCH = False


@pytest.mark.skipif(not HAVE_TORCH, reason="needs torch (make venv installs it)")
def test_the_standby_has_imported_torch_before_the_go_without_cuda(tmp_path: Path) -> None:
    script, env = setup(tmp_path, SCRIPT.replace("import warmmark\n", "import warmmark\n"
                                                 "import torch\n"))
    env["ON_RUN"] = ("report['torch_pre'] = PRE_TORCH\n"
                     "report['cuda'] = torch.cuda.is_initialized()\n")
    script.write_text(script.read_text().replace(
        'PRE = "warmmark" in sys.modules',
        'PRE = "warmmark" in sys.modules\nPRE_TORCH = "torch" in sys.modules'))
    r, events = run_agent(tmp_path, script, env, timeout=240)
    assert r.returncode == 0, r.stderr.decode()
    assert [e["kind"] for e in standby_events(events)] == ["warm"]
    rep = report(tmp_path)
    assert rep["torch_pre"] is True and rep["cuda"] is False
