"""The trainer's process tree: spawn it, reap it, signal it, and stop all of it.

Three kernel features carry this module:

* ``PR_SET_CHILD_SUBREAPER`` on the agent: any descendant whose parent dies (a DataLoader
  worker, a process that called ``setsid`` to escape its group) is re-parented to the
  agent instead of PID 1. So "the trainer's tree" is simply *every descendant of the
  agent*, found with psutil even after middle processes died, and nothing escapes a stop.
* ``PR_SET_PDEATHSIG(SIGKILL)`` in the trainer (set by ``EXEC_SHIM`` before it execs the
  command): if the agent is SIGKILLed (OOM killer, ``kubectl delete --grace-period=0``)
  the kernel kills the trainer, which would otherwise run on unsupervised holding GPUs.
* One SIGCHLD handler that reaps *every* child with ``waitpid(-1)``: the trainer (its
  status resolves the future returned by :meth:`ChildReaper.watch`) and the orphans the
  sub-reaper adopts, which would otherwise stay zombies — exactly what PID 1 in a
  container must do. Consequence: nothing else in the agent may wait for children
  (no ``asyncio.create_subprocess_*``); helper processes run with ``subprocess`` in a
  thread and must not rely on their return code.

PDEATHSIG kills only the trainer. The rest of its tree, when the agent dies suddenly, is
``containment``'s (spawn() readies it): the kernel where the agent is PID 1 of its PID
namespace, else a watchdog process, and a cgroup of the trainer's own where the agent's
is writable (``FTAGENT_CONTAINMENT=auto|watchdog|off``; what each covers, and the
measurements, in its docstring).

The stop of one attempt (``terminate``: SIGTERM, the handler's grace, SIGKILL) and the
look after its exit (``clear_leftovers``) are here too: they work a
:class:`TrainerProcess` and the tree, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

import psutil

from ftagent.agent import containment, stop_grace
from ftagent.agent.tee import MAX_LINE, LinesCallback, Writer, trainer_pumps
from ftagent.model import ProcessExit

log = logging.getLogger("ftagent.supervisor")

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def set_child_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux >= 3.4)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


class ChildReaper:
    """Reaps every child of the agent on SIGCHLD; hands out the statuses it was asked for."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: dict[int, asyncio.Future[ProcessExit]] = {}
        self.orphans_reaped = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_signal_handler(signal.SIGCHLD, self.reap)
        self.reap()

    def uninstall(self) -> None:
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGCHLD)

    def watch(self, pid: int) -> asyncio.Future[ProcessExit]:
        """A future for ``pid``'s exit. Call it right after spawning, before any ``await``:
        the SIGCHLD callback runs on the loop, so it cannot reap ``pid`` in between."""
        assert self._loop is not None, "install() first"
        fut: asyncio.Future[ProcessExit] = self._loop.create_future()
        self._watched[pid] = fut
        return fut

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            if not (os.WIFSIGNALED(status) or os.WIFEXITED(status)):
                continue  # stopped/continued: not an exit
            fut = self._watched.pop(pid, None)
            if fut is None or fut.done():
                # an orphan the sub-reaper adopted, a helper (py-spy): reaped, its status
                # read by nobody, so no ProcessExit is made of it
                self.orphans_reaped += 1
                log.debug("reaped orphan %d (wait status %#x)", pid, status)
                continue
            if os.WIFSIGNALED(status):
                fut.set_result(ProcessExit(pid, None, os.WTERMSIG(status), ts=time.monotonic()))
            else:
                fut.set_result(ProcessExit(pid, os.WEXITSTATUS(status), None,
                                           ts=time.monotonic()))


class SpawnError(Exception):
    """The command could not be started; ``exit_status`` follows the shell (126/127)."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


# Runs in the trainer's process before it becomes the trainer: set the death signal, make
# sure the agent did not die first, join the trainer's cgroup (argv[2], "" for none;
# before exec, so every descendant is born in it), then exec the command (PDEATHSIG
# survives exec).
# A separate tiny interpreter (-I: isolated from the trainer's PYTHON* variables, -S: no
# site) instead of ``preexec_fn``: Python code between fork and exec in a process that has
# threads (gRPC's, the output pumps) can deadlock or crash, and did (SIGSEGV with gRPC).
EXEC_SHIM = f"""
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, {int(signal.SIGKILL)}, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    os._exit(137)
if sys.argv[2]:
    try:
        with open(sys.argv[2], "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        pass
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as e:
    sys.stderr.write("ftagent: cannot start %s: %s\\n" % (sys.argv[3], e.strerror))
    os._exit(127 if isinstance(e, FileNotFoundError) else 126)
"""


def resolve(command: Sequence[str], env: Mapping[str, str]) -> str:
    """The executable ``command[0]`` names, checked now so the error is clear and at once."""
    name = command[0]
    path = name if "/" in name else shutil.which(name, path=env.get("PATH", os.defpath))
    if path is None or not os.path.exists(path):
        raise SpawnError(f"command not found: {name}", 127)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise SpawnError(f"permission denied: {name} is not an executable file", 126)
    return path


def spawn(command: Sequence[str], env: Mapping[str, str],
          pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session with pipes for stdout/stderr.

    Its own session (and so process group) lets the agent signal the whole group at once
    and keeps a terminal's Ctrl-C going to the agent, which decides what to forward.
    ``pass_fds``: kept open in the command (a standby's control pipes, see ``standby``).
    """
    resolve(command, env)
    global _watchdog
    procs_file, trainer_env, _watchdog = containment.for_spawn(env)
    shim = [sys.executable, "-I", "-S", "-c", EXEC_SHIM, str(os.getpid()), procs_file,
            *command]
    try:
        popen = subprocess.Popen(
            shim, env=trainer_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True, pass_fds=tuple(pass_fds),
        )
    except OSError as e:
        raise SpawnError(f"cannot start {command[0]}: {e.strerror or e}", 126) from None
    containment.trainer_started(popen.pid)
    return popen


# Standby interpreters (``standby``) waiting to become a trainer: the agent's children, but
# no part of the trainer's tree until they get the go, so a stop, an evidence capture or
# the end of an attempt never touches them. Per process, like the kernel's list of
# children it mirrors (and like ``containment.current()``).
_hidden: set[int] = set()
# the containment's watchdog (the agent's child, no part of the trainer's tree), as the
# last spawn started it: the tree is read without asking the containment each time
_watchdog: int | None = None


def hide_from_tree(pid: int) -> None:
    _hidden.add(pid)


def show_in_tree(pid: int) -> None:
    _hidden.discard(pid)


# a tree lister: the agent's whole tree (``tree``), or one launcher worker's
# (trainer_exec.worker_tree)
Tree = Callable[[], list[psutil.Process]]


def tree() -> list[psutil.Process]:
    """Every live descendant of the agent: the trainer and all it started (sub-reaper);
    not the watchdog, which is the agent's child but no part of the trainer's tree, nor
    the standbys waiting for a restart."""
    try:
        procs = [p for p in psutil.Process().children(recursive=True)
                 if p.pid != _watchdog and p.pid not in _hidden and _alive(p)]
    except psutil.Error:
        return []
    if not procs:  # every session is empty but a waiting standby's (containment.py)
        containment.tree_empty(_hidden)
    return procs


def tree_pids() -> list[int]:
    return [p.pid for p in tree()]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def signal_tree(sig: int, procs: Sequence[psutil.Process] | None = None) -> int:
    """Send ``sig`` to every process of the tree; returns how many were signalled."""
    n = 0
    for p in tree() if procs is None else procs:
        try:
            p.send_signal(sig)
            n += 1
        except psutil.Error:
            pass
    return n


async def clear_leftovers(procs: Tree, deadline: float, poll: float = 0.02) -> None:
    """The trainer's main process is gone: what it left of its tree (``procs``: the
    agent's whole tree, or one launcher worker's: trainer_exec.worker_tree) is SIGTERMed,
    given until ``deadline``, then SIGKILLed. The common case, nothing left, is this one look.

    Polls (with a deadline) because the tree includes processes that are not our
    children and cannot be waited on."""
    left = procs()
    if not left:
        return
    signal_tree(signal.SIGTERM, left)
    while (left := procs()) and time.monotonic() < deadline:
        if all(frozen(p) for p in left):
            break  # stopped (SIGSTOP, a frozen cgroup): SIGTERM waits for a SIGCONT
        await asyncio.sleep(poll)
    killed = await kill_tree(None, procs=procs)
    if killed:
        log.warning("SIGKILLed %d leftover process(es) of the trainer", killed)


def frozen(proc: psutil.Process | int) -> bool:
    """Stopped by a signal (SIGSTOP, state T): it cannot act on SIGTERM until continued,
    so a grace is only lost time (issue 35: a SIGSTOPped rank was restarted --stop-timeout
    late). Traced (t) is not frozen here: py-spy lets go within milliseconds."""
    try:
        p = psutil.Process(proc) if isinstance(proc, int) else proc
        return bool(p.status() == psutil.STATUS_STOPPED)
    except (psutil.Error, OSError):
        return False


async def kill_tree(pgid: int | None, poll: float = 0.01, timeout: float = 5.0,
                    procs: Tree = tree) -> int:
    """SIGKILL the whole tree (and group) and wait until it is gone."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        if pgid is not None:
            signal_group(pgid, signal.SIGKILL)
        left = procs()
        if not left:
            return len(killed)
        signal_tree(signal.SIGKILL, left)
        killed.update(p.pid for p in left)
        if time.monotonic() > deadline:
            log.error("processes survive SIGKILL: %s", [p.pid for p in left])
            return len(killed)
        await asyncio.sleep(poll)


class Started(NamedTuple):
    """A trainer process as a starter hands it over: started cold, or a standby's."""

    popen: subprocess.Popen[bytes]
    exited: asyncio.Future[ProcessExit]
    how: str  # "cold" | "standby"


class Starter(Protocol):
    """The spawn path's seam: a cold exec, or a warm standby (``standby.WarmStarter``).
    ``slot``: the worker's place (its local rank), one standby per slot."""

    def start(self, command: Sequence[str], env: Mapping[str, str], reaper: ChildReaper,
              slot: int = 0) -> Started: ...


class ColdStarter:
    """The exec shim, every time."""

    def start(self, command: Sequence[str], env: Mapping[str, str], reaper: ChildReaper,
              slot: int = 0) -> Started:
        popen = spawn(command, env)
        return Started(popen, reaper.watch(popen.pid), "cold")


class TrainerProcess:
    """One run of the trainer: the process, its exit future and its output pumps.

    ``starter`` picks the process (cold by default; ``standby.WarmStarter`` hands over a
    warm standby for ``slot``): the rest is the same for both."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], reaper: ChildReaper,
                 on_lines: LinesCallback, *, stdout_fd: int | Writer = 1,
                 stderr_fd: int | Writer = 2,
                 max_line: int = MAX_LINE, starter: Starter | None = None,
                 slot: int = 0, output_interval: float = 0.0) -> None:
        started = (starter or ColdStarter()).start(command, env, reaper, slot)
        self.popen = started.popen
        self.how = started.how
        self.pid = self.popen.pid
        self.pgid = self.pid  # start_new_session: the trainer leads its own group
        self.started = time.monotonic()
        self.exited: asyncio.Future[ProcessExit] = started.exited
        assert self.popen.stdout is not None and self.popen.stderr is not None
        out_fd = os.dup(self.popen.stdout.fileno())
        err_fd = os.dup(self.popen.stderr.fileno())
        self.popen.stdout.close()
        self.popen.stderr.close()
        # both pipes grown, the reads' interval chosen, a pump each: one call (tee.py)
        self.pumps = trainer_pumps(out_fd, err_fd, stdout_fd, stderr_fd, on_lines,
                                   max_line, output_interval)
        for p in self.pumps:
            p.start()
        self.exited.add_done_callback(self._mark_popen)

    def _mark_popen(self, fut: asyncio.Future[ProcessExit]) -> None:
        # The reaper collected the status; tell Popen so it does not wait or warn later.
        for p in self.pumps:  # its last output is wanted now (the crash's evidence)
            p.hurry.set()
        # (its containment session is forgotten once the tree is empty: tree_empty reads
        # that in place, no call per exit)
        if not fut.cancelled():
            self.popen.returncode = fut.result().exit_status

    @property
    def running(self) -> bool:
        return not self.exited.done()

    def send_signal(self, sig: int) -> None:
        """Forward a signal to the trainer's process group."""
        if self.running:
            signal_group(self.pgid, sig)

    async def drain(self, timeout: float) -> bool:
        """Wait until both pumps reached EOF (every writer of the pipes is gone)."""
        deadline = time.monotonic() + timeout
        for p in self.pumps:
            if p.eof.is_set():  # there already: no thread to wait in
                continue
            left = max(0.0, deadline - time.monotonic())
            if not await asyncio.to_thread(p.eof.wait, left):
                return False
        # the lines the pumps queued are the caller's to handle now (the worker drains
        # its feed's backlog next: LineFeed.drain_all), not a loop turn's
        return True


def zombie(pid: int) -> bool:
    """``pid`` has exited and waits to be reaped (WNOWAIT: the reaper still gets it)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return info is not None and info.si_pid == pid


def exited(trainer: TrainerProcess) -> bool:
    """The trainer is gone, or its exit waits for the loop (the SIGCHLD not handled yet):
    a peek, never a reap -- the reaper owns that."""
    return trainer.exited.done() or zombie(trainer.pid)  # (not ``running``: no call)


async def terminate(trainer: TrainerProcess, procs: Tree, deadline: float, *,
                    forwarded: int | None, stop_timeout: float) -> bool:
    """Our own stop (a restart): SIGTERM the trainer's group and its tree (``procs``), the
    grace being the handler's for as long as it is installed (stop_grace.py: not CPython's
    teardown after it; the attempt is discarded, its exit code is no one's). A stop signal
    ``forwarded`` as is (the pod going): the trainer's handler and its teardown decide,
    and its exit code is the user's, up to ``deadline``. SIGKILL whatever is left at
    ``deadline``.

    Returns True when the tree was seen empty after the SIGTERM (every process gone at
    once, no handler): no process of it is left to clear after the exit
    (``clear_leftovers`` would only look again), and none can come, a process being
    started only by a live one."""
    cleared = False
    if not trainer.exited.done():  # running
        log.info("stopping trainer (pid %d)", trainer.pid)
        if forwarded is None:  # our own stop: SIGTERM the group and the tree
            trainer.send_signal(signal.SIGTERM)
            listed = procs()
            cleared = not listed
            signal_tree(signal.SIGTERM, listed)
            if frozen(trainer.pid):  # stopped: SIGTERM waits for a SIGCONT
                log.warning("trainer (pid %d) is stopped (frozen): SIGKILL, no grace",
                            trainer.pid)
                deadline = time.monotonic()
            # its first look at the handlers: the tree just signalled, not listed again
            await stop_grace.wait_stopped(trainer.exited, lambda: [p.pid for p in procs()],
                                          signal.SIGTERM, deadline,
                                          first=[p.pid for p in listed])
        else:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(trainer.exited),
                                       max(0.0, deadline - time.monotonic()))
    if not trainer.exited.done():  # running
        killed = await kill_tree(trainer.pgid, procs=procs)
        log.warning("trainer ignored SIGTERM for %.1fs: SIGKILLed %d process(es)",
                    stop_timeout, killed)
    return cleared
