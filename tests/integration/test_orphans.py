"""No orphans: after a SIGKILL of ``ftagent run`` no process of the trainer's tree survives.

Real processes: the trainer builds every tree shape (plain child, grandchild, setsid child,
double-forked daemon, a process in its own group), writes each pid to a file, and the test
SIGKILLs the agent and waits, with a deadline, until every one of them is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftagent.agent.containment import WATCHDOG_TAG
from tests.conftest import ftagent_cmd, pid_gone, popen, wait_for

DEADLINE = 10.0

# argv: the directory to write "<shape>" files holding pids into, then the shapes to make.
TRAINER = textwrap.dedent(r'''
    import os, subprocess, sys, time

    out, shapes = sys.argv[1], sys.argv[2:]

    def note(name, pid):
        tmp = os.path.join(out, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(pid))
        os.rename(tmp, os.path.join(out, name))

    SLEEP = ["sleep", "1000"]
    note("trainer", os.getpid())
    if "child" in shapes:
        note("child", subprocess.Popen(SLEEP).pid)
    if "grandchild" in shapes:
        subprocess.Popen(["sh", "-c", 'sleep 1000 & echo $! > "$1.tmp"; mv "$1.tmp" "$1"; wait',
                          "sh", os.path.join(out, "grandchild")])
    if "setsid" in shapes:
        note("setsid", subprocess.Popen(SLEEP, start_new_session=True).pid)
    if "pgroup" in shapes:
        note("pgroup", subprocess.Popen(SLEEP, process_group=0).pid)
    if "clean_env_child" in shapes:  # no marker, but still in the trainer's session
        note("clean_env_child", subprocess.Popen(["/bin/sleep", "1000"], env={}).pid)
    for name in ("daemon", "clean_env_daemon"):
        if name not in shapes:
            continue
        pid = os.fork()
        if pid == 0:  # the classic daemon: fork, setsid, fork, the middle one exits
            os.setsid()
            if os.fork() == 0:
                note(name, os.getpid())
                env = {} if name == "clean_env_daemon" else os.environ
                os.execve("/bin/sleep", ["sleep", "1000"], env)
            os._exit(0)
        os.waitpid(pid, 0)
    sys.stdout.write("tree ready\n")
    sys.stdout.flush()
    time.sleep(1000)
''')

SHAPES = ["child", "grandchild", "setsid", "daemon", "pgroup"]


def start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class Tree:
    """One ``ftagent run`` whose trainer builds ``shapes``; kills what is left at the end."""

    def __init__(self, tmp: Path, shapes: list[str], env: dict[str, str] | None = None,
                 cmd: list[str] | None = None) -> None:
        self.dir = tmp
        self.dir.mkdir(parents=True, exist_ok=True)
        script = tmp / "trainer.py"
        script.write_text(TRAINER)
        self.names = ["trainer", *shapes]
        cmd = cmd or [sys.executable, str(script), str(tmp), *shapes]
        self.agent = popen(ftagent_cmd("--progress", "none", "--stop-timeout", "2", cmd=cmd),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or {})
        self.seen: dict[int, int] = {}  # pid -> start time: only these are cleaned up

    def pids(self) -> dict[str, int]:
        def ready() -> dict[str, int] | None:
            if self.agent.poll() is not None:
                raise AssertionError(f"agent exited early: {self.agent.returncode}")
            files = {n: self.dir / n for n in self.names}
            if not all(f.exists() for f in files.values()):
                return None
            return {n: int(f.read_text()) for n, f in files.items()}

        pids: dict[str, int] = wait_for(ready, 30, "every process of the tree to start")
        for pid in pids.values():
            st = start_time(pid)
            if st is not None:
                self.seen[pid] = st
        dead = [n for n, p in pids.items() if pid_gone(p)]
        assert not dead, f"died before the test: {dead}"
        return pids

    def watchdog(self) -> tuple[int, list[str]]:
        """The agent's watchdog: its pid and argv."""
        def find() -> tuple[int, list[str]] | None:
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
                    if WATCHDOG_TAG.encode() in argv:
                        i = argv.index(WATCHDOG_TAG.encode())
                        if argv[i + 1] == str(self.agent.pid).encode():
                            return int(name), [a.decode() for a in argv[i:]]
            return None

        found: tuple[int, list[str]] = wait_for(find, 10, "the watchdog")
        return found

    def cleanup(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.agent.kill()
        self.agent.wait(timeout=30)
        for pid, st in self.seen.items():  # only the very processes seen (no reused pid)
            if start_time(pid) == st:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def trees(tmp_path: Path) -> Iterator[list[Tree]]:
    made: list[Tree] = []
    yield made
    for t in made:
        t.cleanup()


def wait_all_gone(pids: dict[str, int], timeout: float = DEADLINE) -> float:
    """Seconds until every pid is gone (absent or a zombie); fails naming the survivors."""
    t0 = time.monotonic()
    while True:
        alive = {n: p for n, p in pids.items() if not pid_gone(p)}
        if not alive:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"survived the agent's SIGKILL for {timeout}s: {alive}")
        time.sleep(0.005)


def cgroup_of(argv: list[str]) -> str:
    return argv[3] if len(argv) > 3 else ""


# ------------------------------------------------------------------ SIGKILL of the agent


@pytest.mark.parametrize("mode", ["auto", "watchdog"])
def test_sigkill_of_agent_leaves_no_process_of_the_tree(tmp_path: Path, trees: list[Tree],
                                                        mode: str) -> None:
    shapes = [*SHAPES, "clean_env_child"]
    t = Tree(tmp_path, shapes, env={"FTAGENT_CONTAINMENT": mode})
    trees.append(t)
    pids = t.pids()
    _, argv = t.watchdog()
    if mode == "watchdog":
        assert cgroup_of(argv) == ""
    t.agent.kill()
    took = wait_all_gone(pids)
    print(f"{mode} ({cgroup_of(argv) or 'no cgroup'}): {len(pids)} processes gone "
          f"{took * 1000:.0f} ms after the agent's SIGKILL")


def test_cgroup_catches_a_daemon_that_scrubbed_its_environment(tmp_path: Path,
                                                               trees: list[Tree]) -> None:
    """setsid + no marker escapes the watchdog's scan; the cgroup still holds it."""
    t = Tree(tmp_path, ["clean_env_daemon"])
    trees.append(t)
    pids = t.pids()
    _, argv = t.watchdog()
    if not cgroup_of(argv):
        pytest.skip("no writable cgroup v2 here: the watchdog-only path cannot see it")
    t.agent.kill()
    wait_all_gone(pids)
    wait_for(lambda: not os.path.exists(cgroup_of(argv)), DEADLINE, "the cgroup removed")


def test_other_trees_and_unrelated_processes_are_untouched(tmp_path: Path,
                                                           trees: list[Tree]) -> None:
    unrelated = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    try:
        a = Tree(tmp_path / "a", SHAPES)
        b = Tree(tmp_path / "b", SHAPES)
        trees += [a, b]
        pids_a, pids_b = a.pids(), b.pids()
        wd_a, _ = a.watchdog()
        b.watchdog()
        a.agent.kill()
        wait_all_gone(pids_a)
        wait_for(lambda: pid_gone(wd_a), DEADLINE, "a's watchdog to finish")
        survivors = {n: p for n, p in pids_b.items() if pid_gone(p)}
        assert not survivors, f"another agent's tree was killed: {survivors}"
        assert unrelated.poll() is None, "an unrelated process was killed"
        b.agent.kill()
        wait_all_gone(pids_b)
        assert unrelated.poll() is None
    finally:
        unrelated.kill()
        unrelated.wait()


# ------------------------------------------------------------------ normal runs


def test_normal_exit_keeps_code_and_output_and_ends_the_watchdog(tmp_path: Path,
                                                                 trees: list[Tree]) -> None:
    go = tmp_path / "go"
    ready = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        subprocess.Popen(["sleep", "1000"], start_new_session=True)
        sys.stdout.buffer.write(b"partial \\xff\\r")
        sys.stdout.flush()
        open({str(ready)!r}, "w").close()
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        sys.stdout.write("last line\\n")
        sys.exit(5)
    """)
    t = Tree(tmp_path / "t", [], cmd=[sys.executable, "-c", code])
    trees.append(t)
    wait_for(ready.exists, 30, "trainer ready")
    wd, _ = t.watchdog()
    go.touch()
    out, err = t.agent.communicate(timeout=60)
    assert t.agent.returncode == 5, err.decode()
    assert out == b"partial \xff\rlast line\n"
    wait_for(lambda: pid_gone(wd), DEADLINE, "the watchdog to exit after the agent")
    assert b"watchdog: agent" not in err  # nothing was left for it to kill
