"""agent/proc_wait.py on real processes: what a blocked thread waits on, from /proc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ftagent.agent.proc_wait import ARCH, blocked_threads, restarted
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(ARCH is None or not sys.platform.startswith("linux"),
                                reason="Linux x86_64/aarch64 system calls")

RECV = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
if sys.argv[2] == "timeout":
    s.settimeout(600)   # Python polls first, then reads
print("ready", flush=True)
s.recv(10)
"""
PIPE = """
import os
r, w = os.pipe()
print("ready", flush=True)
os.read(r, 1)
"""


@contextmanager
def server() -> Iterator[socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    try:
        yield srv
    finally:
        srv.close()


@contextmanager
def child(code: str, *args: str, env: dict[str, str] | None = None
          ) -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, **(env or {})})
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield p
    finally:
        p.kill()
        p.wait()


def waits(pid: int) -> list[tuple[str, str]]:
    got = blocked_threads([pid])
    return [(b.kind, b.syscall) for b in got.blocked if b.pid == pid]


@pytest.mark.parametrize("mode", ["plain", "timeout"])
def test_a_read_from_a_server_that_is_no_peer_is_remote_io(mode: str) -> None:
    with server() as srv, child(RECV, str(srv.getsockname()[1]), mode) as p:
        got = wait_for(lambda: [w for w in waits(p.pid) if w[0] == "remote"], 10,
                       "the remote read")
        assert got[0][1] in (("recvfrom", "read") if mode == "plain" else
                             ("poll", "ppoll")), got
        (b,) = [b for b in blocked_threads([p.pid]).blocked if b.kind == "remote"]
        assert b.target == f"tcp 127.0.0.1:{srv.getsockname()[1]}"


def test_a_poll_restarted_after_a_stop_is_still_remote_io() -> None:
    """A poll with a timeout that a stop interrupted (py-spy's ptrace stop when the agent
    samples the stacks, or SIGSTOP/SIGCONT) resumes as ``restart_syscall``: /proc then shows
    that number, not poll's, with poll's arguments still in the registers. Seen in
    bench/verdicts.py's slow-read rows: the reading rank declared hung, its read unseen."""
    import signal

    with server() as srv, child(RECV, str(srv.getsockname()[1]), "timeout") as p:
        wait_for(lambda: [w for w in waits(p.pid) if w[0] == "remote"], 10, "the remote read")
        os.kill(p.pid, signal.SIGSTOP)
        wait_for(lambda: _state(p.pid) == "T", 10, "the stop")
        os.kill(p.pid, signal.SIGCONT)
        wait_for(lambda: _state(p.pid) == "S" and _syscall(p.pid) == RESTART, 10,
                 "the restarted poll")
        assert waits(p.pid) == [("remote", "poll")]


@pytest.mark.parametrize(("wchan", "call"), [
    ("poll_schedule_timeout.constprop.0", "poll"), ("poll_schedule_timeout", "poll"),
    ("do_sys_poll\n", "poll"), ("futex_do_wait", None), ("futex_wait_queue", None),
    ("hrtimer_nanosleep", None), ("do_nanosleep", None), ("0", None), ("", None)])
def test_a_restarted_call_is_poll_only_by_its_wait_channel(wchan: str, call: str | None
                                                            ) -> None:
    assert restarted(wchan) == call


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _syscall(pid: int) -> int:
    with open(f"/proc/{pid}/syscall", encoding="ascii") as f:
        first = f.read().split()[0]
    return int(first) if first.lstrip("-").isdigit() else -1


RESTART = {"x86_64": 219, "amd64": 219, "aarch64": 128, "arm64": 128}.get(
    os.uname().machine.lower(), -2)


def test_the_jobs_store_is_a_peer_not_io() -> None:
    with server() as srv:
        port = str(srv.getsockname()[1])
        with child(RECV, port, "plain",
                   env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) as p:
            wait_for(lambda: waits(p.pid), 10, "the store read")
            assert {k for k, _ in waits(p.pid)} == {"peer"}


def test_a_pipe_nothing_writes_is_a_pipe() -> None:
    with child(PIPE) as p:
        wait_for(lambda: waits(p.pid), 10, "the pipe read")
        assert waits(p.pid) == [("pipe", "read")]


def test_a_vanished_process_is_skipped() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    got = blocked_threads([p.pid])
    assert got.blocked == [] and got.errors == []
