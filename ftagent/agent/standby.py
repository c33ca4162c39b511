"""Warm restarts: one standby interpreter per worker, already past Python's and the
trainer's imports, that becomes the next attempt's trainer.

About 5.5 s of a restart is the job's own start-up, 3 s of it ``import torch`` (FIELD-NOTES):
no launcher can restart faster than that by detecting or respawning faster. So while
attempt g trains, :class:`WarmStarter` keeps a standby for each worker slot: the trainer's
own interpreter and flags running ``standby_boot.py`` (stdlib only; the trainer's Python
cannot import the agent's code, which may be a bundle), started through the same exec
shim as a cold trainer (PDEATHSIG, its own session, the trainer's cgroup, the tree
marker) with its stdout/stderr already the pipes the agent will pump. It imports what the
trainer needs (``--warm-imports``, else learned from the script: see ``standby_boot``)
under SCHED_IDLE where the priority can be restored, then blocks on a pipe.

On restart :meth:`WarmStarter.start` hands that process the go -- argv, working
directory, and the environment's difference from the one it started with -- and it
becomes the trainer in place: same pid and session as the cold path, ``sys.argv``,
``sys.path[0]``, ``__main__.__file__`` and signal dispositions as a fresh start has them.
It is never used stale: a standby that died, or whose environment would differ in a
variable outside :data:`PER_ATTEMPT` (anything torch, CUDA, OpenMP or Python itself may
read at start-up: ``PYTHON*``, ``LD_*``, ``OMP_*``, ``CUDA_*``, ...), is replaced by a
cold spawn; one whose inputs changed (the script, the interpreter, a ``sys.path``
directory such as the venv's site-packages, a loaded module's file) or whose warm import
failed ``exec``s the command itself -- a cold start with the same pid, so the import
error comes from the trainer as it would. Only Python commands are warmed (``python
[FLAGS] SCRIPT``, ``python -m MODULE``, an executable ``.py`` with a Python shebang);
``-c``, ``-i``, ``-x``, stdin and anything else start cold.

Known differences from a cold start, by design: ``sys.modules`` already holds the warm
modules (and the bootstrap's few stdlib modules: ast, json, ctypes, atexit, select); a warm
module read the *previous* attempt's values of the :data:`PER_ATTEMPT` variables if it
looked at them at import (torch does not); an environment variable the script sets
itself *before* importing a warm module (``os.environ["OMP_NUM_THREADS"] = ...`` above
``import torch``) is not seen by that import -- set such variables in the pod's
environment, or use ``--no-warm-restart``; ``/proc/PID/cmdline`` shows the bootstrap.

When: the standby for attempt g+1 is started once attempt g reached its first step (a
progress line or an SDK step: :class:`FirstStep`), or :data:`STANDBY_AFTER_SECONDS`
after g started without one, never beside the trainer's own start-up: its imports would
compete with the trainers' for the CPU and slow every job's first start (issue 26).

Cost: one idle interpreter with the warm modules per worker (measured by bench/restart.py:
the standby's PSS, ~230 MB with torch; the gauge ``ftagent_standby_memory_bytes``),
kept only while a restart can follow the running attempt (an arbiter, or
``--max-restarts`` not spent yet), and started only if the container's memory cgroup
can afford it (``standby_memory.StandbyBudget``, ``--warm-restart-memory-share``). The
agent closes its standbys when it ends (its ``WorkerParts.on_close``: killed and reaped); if it
is SIGKILLed, the standby dies with it (PDEATHSIG, and the watchdog's sweep of its
session and marker).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ftagent.agent import containment, supervisor
from ftagent.agent.standby_memory import StandbyBudget, pss_bytes
from ftagent.agent.store_wait import store_to_wait_for, wait_for_store
from ftagent.agent.supervisor import ChildReaper, Started
from ftagent.agent.worker_parts import WorkerParts
from ftagent.model import ProcessExit, Progress

log = logging.getLogger("ftagent.standby")

# Variables a launcher sets per attempt or per worker; a standby may be handed a new value
# of these at the go. Any other difference means a cold start (see the module docstring).
PER_ATTEMPT_PREFIXES = ("FTAGENT_", "TORCHELASTIC_")
PER_ATTEMPT = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
})
MAX_GO_BYTES = 1 << 20  # the go message (argv + env difference) must fit the pipe
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?[dmt]?")
_NO_ARG_FLAGS = set("bBdEIOPqsSuv")  # python flags that take no argument and are safe
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

Record = Callable[..., None]  # events.write(event, kind, message, **fields)
# A start without any step this long is given its standby anyway (--progress none, or
# output no log format reads): the trainer's own start-up is most likely past by then.
STANDBY_AFTER_SECONDS = 30.0


@dataclass
class _Pending:
    """A standby to start once the attempt it follows reached its first step."""

    command: tuple[str, ...]
    env: dict[str, str]
    reaper: ChildReaper
    exited: asyncio.Future[ProcessExit]  # the attempt's trainer: no standby once it ended
    timer: asyncio.TimerHandle


@dataclass(frozen=True)
class PythonCommand:
    """A trainer command a standby can become: the interpreter part, and what it runs."""

    interpreter: tuple[str, ...]  # argv that starts the interpreter with the command's flags
    kind: str  # "script" | "module"
    target: str  # the script as the trainer's sys.argv[0] sees it, or the module name
    skip: int  # entries of the command before the script or "-m"


def python_command(command: Sequence[str], env: Mapping[str, str]) -> PythonCommand | None:
    """The command as a warmable Python invocation, or None (it then always starts cold)."""
    if not command:
        return None
    first = os.path.basename(command[0])
    if _PYTHON.fullmatch(first):
        return _parse_flags(command)
    if first.endswith(".py"):
        return _shebang(command, env)
    return None


def warmable(command: Sequence[str]) -> bool:
    """Whether a standby could ever become ``command``'s trainer: a Python interpreter
    with safe flags run on a script or a module, or a ``.py`` run by its shebang. What a
    file says (the script is there, the shebang names Python) is read each time a standby
    is prepared (:func:`python_command`); this is the part that never changes, so the
    worker's starter is chosen once (``warm_restart_parts``): a command no standby can
    become is started cold, with no warm starter on its path."""
    if not command:
        return False
    first = os.path.basename(command[0])
    if _PYTHON.fullmatch(first):
        return _parse_flags(command, isfile=lambda _: True) is not None
    return first.endswith(".py")


def _parse_flags(command: Sequence[str],
                 isfile: Callable[[str], bool] = os.path.isfile) -> PythonCommand | None:
    i = 1
    while i < len(command):
        a = command[i]
        if a == "-m":
            if i + 1 >= len(command) or not _MODULE.fullmatch(command[i + 1]):
                return None
            return PythonCommand(tuple(command[:i]), "module", command[i + 1], i)
        if a == "--check-hash-based-pycs":
            i += 2
            continue
        if a == "-" or a.startswith("--"):
            return None  # stdin, --help, --version, unknown long options
        if a.startswith("-"):
            letters = a[1:]
            takes_next = False
            for j, ch in enumerate(letters):
                if ch in "WX":
                    takes_next = j == len(letters) - 1
                    break
                if ch not in _NO_ARG_FLAGS:
                    return None  # -c, -i, -x, -h, -V, -m attached, unknown
            i += 2 if takes_next else 1
            continue
        if not isfile(a):
            return None  # the cold start reports it, as python would
        return PythonCommand(tuple(command[:i]), "script", a, i)
    return None


def _shebang(command: Sequence[str], env: Mapping[str, str]) -> PythonCommand | None:
    """An executable script run directly: the kernel would run its ``#!`` interpreter."""
    name = command[0]
    path = name if "/" in name else shutil.which(name, path=env.get("PATH", os.defpath))
    if path is None or not os.path.isfile(path) or not os.access(path, os.X_OK):
        return None
    try:
        with open(path, "rb") as f:
            line = f.readline(256)
    except OSError:
        return None
    if not line.startswith(b"#!"):
        return None
    text = line[2:].decode("utf-8", "replace").strip()
    interp, _, arg = text.partition(" ")
    arg = arg.strip()
    parts = (interp, arg) if arg else (interp,)
    py = arg if os.path.basename(interp) == "env" else os.path.basename(interp)
    if not py or not _PYTHON.fullmatch(os.path.basename(py.split()[0])):
        return None
    # argv of the standby: the kernel passes [interp, arg, path, ...] for a shebang
    return PythonCommand(parts, "script", path, 0)


def env_blockers(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """Variables whose change (set, changed or unset) rules out a standby started with
    ``old`` for a trainer that must see ``new``: all but :data:`PER_ATTEMPT`."""
    keys = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
    return sorted(k for k in keys
                  if k not in PER_ATTEMPT and not k.startswith(PER_ATTEMPT_PREFIXES))


def parse_warm_imports(values: Sequence[str]) -> tuple[str, ...]:
    """``--warm-imports torch,transformers`` (repeatable) -> module names; ValueError names
    the first that is not a dotted module name."""
    out: list[str] = []
    for v in values:
        for name in (p.strip() for p in v.split(",")):
            if not name:
                continue
            if not _MODULE.fullmatch(name) or len(name) > 200:
                raise ValueError(f"{name[:60]!r} is not a module name")
            if name not in out:
                out.append(name)
    return tuple(out)


class Standby:
    """One standby process: its pipes to the agent and what it was started for."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], py: PythonCommand,
                 boot: str, imports: tuple[str, ...], reaper: ChildReaper,
                 record: Record | None,
                 on_ready: Callable[[Standby], None] | None = None) -> None:
        self.command = tuple(command)
        self._on_ready = on_ready  # once its imports are done (the budget measures it)
        self.env = dict(env)
        self.py = py
        self.cwd = os.getcwd()
        self.ready: dict[str, Any] | None = None
        self.outcome: str | None = None  # "warm" | "cold REASON", once it was told to go
        self._record = record
        go_r, self._go_w = os.pipe()
        self._status_r, status_w = os.pipe()
        spec = {"go": go_r, "status": status_w, "agent": os.getpid(),
                "imports": list(imports), "learn": not imports, "idle": True}
        argv = [*py.interpreter, boot, py.kind, py.target, json.dumps(spec)]
        try:
            self.popen = supervisor.spawn(argv, env, pass_fds=(go_r, status_w))
        finally:
            os.close(go_r)
            os.close(status_w)
        self.pid = self.popen.pid
        supervisor.hide_from_tree(self.pid)
        self.exited: asyncio.Future[ProcessExit] = reaper.watch(self.pid)
        self.exited.add_done_callback(self._gone)
        self._buf = b""
        self._loop = asyncio.get_running_loop()
        os.set_blocking(self._status_r, False)
        self._loop.add_reader(self._status_r, self._on_status)

    @property
    def alive(self) -> bool:
        return not self.exited.done() and self._go_w >= 0

    def go(self, command: Sequence[str], env: Mapping[str, str]) -> bool:
        """Hand over: it becomes the trainer (or execs it cold). False: could not tell it."""
        unset = sorted(k for k in self.env if k not in env)
        changed = {k: v for k, v in env.items() if self.env.get(k) != v}
        msg = json.dumps({"argv": list(command), "cwd": os.getcwd(), "set": changed,
                          "unset": unset, "interp": self.py.skip,
                          "script_argv0": self.py.target}).encode()
        if len(msg) > MAX_GO_BYTES:
            return False
        try:
            grow_go_pipe(self._go_w, len(msg))
            os.set_blocking(self._go_w, False)
            sent = os.write(self._go_w, msg)
        except OSError:
            return False
        finally:
            self._close_go()
        if sent != len(msg):  # a partial message fails the standby's JSON: it exits
            return False
        supervisor.show_in_tree(self.pid)
        leave_idle(self.pid)
        return True

    def kill(self) -> None:
        """Drop it (unfit, or the agent is done): it never becomes a trainer."""
        self._close_go()  # EOF: it exits by itself even if the signal is lost
        if not self.exited.done():
            supervisor.signal_group(self.pid, signal.SIGKILL)
        supervisor.show_in_tree(self.pid)
        for pipe in (self.popen.stdout, self.popen.stderr):  # nobody will pump them
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def started(self) -> Started:
        assert self.popen.stdout is not None
        return Started(self.popen, self.exited, "standby")

    def _close_go(self) -> None:
        if self._go_w >= 0:
            with contextlib.suppress(OSError):
                os.close(self._go_w)
            self._go_w = -1

    def _on_status(self) -> None:
        try:
            data = os.read(self._status_r, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_status()
            return
        *lines, self._buf = (self._buf + data).split(b"\n")
        for raw in lines:
            self._on_line(raw.decode("utf-8", "replace")[:4096])
        if len(self._buf) > 65536:  # bounded: a line this long is not ours
            self._buf = b""

    def _on_line(self, line: str) -> None:
        word, _, rest = line.partition(" ")
        if word == "ready":
            with contextlib.suppress(ValueError):
                self.ready = json.loads(rest)
            log.debug("standby %d ready: %s", self.pid, rest[:300])
            if self._on_ready is not None:
                try:
                    self._on_ready(self)
                except Exception:
                    log.exception("standby ready hook failed")
        elif word in ("warm", "cold"):
            self.outcome = line
            how = "warm start" if word == "warm" else f"cold start ({rest})"
            log.info("trainer pid %d: %s", self.pid, how)
            if self._record is not None:
                seconds = (self.ready or {}).get("seconds", {})
                self._record("standby", word, f"trainer {how}", pid=self.pid,
                             reason=rest or None,
                             warm_imports=list(seconds)[:50] if isinstance(seconds, dict)
                             else [])

    def _close_status(self) -> None:
        if self._status_r >= 0:
            self._loop.remove_reader(self._status_r)
            with contextlib.suppress(OSError):
                os.close(self._status_r)
            self._status_r = -1

    def _gone(self, fut: asyncio.Future[ProcessExit]) -> None:
        supervisor.show_in_tree(self.pid)
        containment.trainer_exited(self.pid)
        self._close_go()
        if not fut.cancelled():
            self.popen.returncode = fut.result().exit_status
        # the status pipe is read to its EOF by _on_status: every writer is gone now


class WarmStarter:
    """Starts trainers: from the slot's standby when it is fit, cold otherwise, and keeps
    a fresh standby per slot for the next attempt. ``warm=False``: always cold."""

    def __init__(self, *, warm: bool = True, imports: tuple[str, ...] = (),
                 record: Record | None = None, workdir: str | None = None,
                 wanted: Callable[[], bool] = lambda: True,
                 budget: StandbyBudget | None = None,
                 after: float = STANDBY_AFTER_SECONDS) -> None:
        self.warm = warm
        self.imports = imports
        self._wanted = wanted  # can the attempt being started be followed by a restart?
        self._record = record
        self._workdir = workdir  # where the bootstrap copy goes (None: a temp dir of its own)
        self._budget = budget  # may the container afford one more standby? (None: yes)
        self._after = after  # seconds after a start without a step before preparing anyway
        self._standbys: dict[int, Standby] = {}
        self._pending: dict[int, _Pending] = {}  # slot -> the standby to start at its step
        self._dir: str | None = None
        self._boot: str | None = None
        self._closed = False
        self._refused = False  # the budget said no once (recorded once)
        self.last_how: dict[int, str] = {}  # slot -> "standby" | "cold: REASON"
        if budget is not None:
            budget.add(self)

    def has_standby(self, slot: int = 0) -> bool:
        """A standby waits for ``slot``'s next attempt (whether it is fit is decided when
        the attempt starts)."""
        return slot in self._standbys

    def start(self, command: Sequence[str], env: Mapping[str, str], reaper: ChildReaper,
              slot: int = 0) -> Started:
        """The attempt's trainer process (raises SpawnError as ``supervisor.spawn``)."""
        sb = self._standbys.pop(slot, None)
        why = self._unfit(sb, command, env)
        started: Started | None = None
        if sb is not None and why is None:
            if sb.go(command, env):
                started = sb.started()
            else:
                why = "the standby could not be told to go"
        if started is None:
            if sb is not None:
                sb.kill()
            started = supervisor.ColdStarter().start(command, env, reaper, slot)
        self.last_how[slot] = "standby" if why is None else f"cold: {why}"
        if why is not None and sb is not None:
            log.info("cold start: %s", why)
            if self._record is not None:
                self._record("standby", "cold", f"trainer cold start ({why})",
                             pid=started.popen.pid, reason=why)
        self._defer(slot, command, env, reaper, started.exited)
        return started

    def _defer(self, slot: int, command: Sequence[str], env: Mapping[str, str],
               reaper: ChildReaper, exited: asyncio.Future[ProcessExit]) -> None:
        """The next standby starts when this attempt reached its first step
        (:meth:`stepped`), or ``after`` seconds without one: never beside the trainer's
        own start-up (its imports, model, rendezvous), which it would slow (issue 26)."""
        old = self._pending.pop(slot, None)
        if old is not None:
            old.timer.cancel()
        if not (self.warm and self._wanted()) or self._closed:
            return
        timer = asyncio.get_running_loop().call_later(self._after, self._due, slot)
        self._pending[slot] = _Pending(tuple(command), dict(env), reaper, exited, timer)

    def stepped(self) -> None:
        """The running attempt reached a step: its standbys may start now."""
        for slot in list(self._pending):
            self._due(slot)

    def _due(self, slot: int) -> None:
        p = self._pending.pop(slot, None)
        if p is None:
            return
        p.timer.cancel()
        if p.exited.done() or self._closed or not self.warm:
            return  # that attempt is over: a standby now is no faster than a cold start
        if self._budget is not None and not self._budget.allow():
            if not self._refused and self._record is not None:  # once per worker
                self._record("standby", "off", "no standby: the container's memory is "
                             "tight (--warm-restart-memory-share); restarts start cold",
                             expected_bytes=self._budget.expected)
            self._refused = True
            return
        self._prepare(slot, p.command, p.env, p.reaper)

    def prepare_now(self, command: Sequence[str], env: Mapping[str, str],
                    reaper: ChildReaper, slot: int = 0) -> None:
        """A warm spare's standby (``--spare``): started at once -- a spare runs no trainer
        whose start-up it could slow -- if the container can afford it; ``start`` hands it
        the spare's first trainer (RANK and WORLD_SIZE may differ: PER_ATTEMPT)."""
        if not self.warm or self._closed or slot in self._standbys:
            return
        if self._budget is not None and not self._budget.allow():
            if self._record is not None:
                self._record("standby", "off", "no standby for this spare: the container's "
                             "memory is tight (--warm-restart-memory-share); it starts cold",
                             expected_bytes=self._budget.expected)
            return
        self._prepare(slot, command, env, reaper)

    def _unfit(self, sb: Standby | None, command: Sequence[str],
               env: Mapping[str, str]) -> str | None:
        if sb is None:
            return "no standby"
        died = _death(sb)
        if died is not None:
            return "the standby died" + died
        if tuple(command) != sb.command:
            return "the command changed"
        if os.getcwd() != sb.cwd:
            return "the working directory changed"
        blockers = env_blockers(sb.env, env)
        if blockers:
            more = f" and {len(blockers) - 3} more" if len(blockers) > 3 else ""
            return f"environment changed: {', '.join(blockers[:3])}{more}"
        return None

    def _prepare(self, slot: int, command: Sequence[str], env: Mapping[str, str],
                 reaper: ChildReaper) -> None:
        py = python_command(command, env)
        boot = self._bootstrap() if py is not None else None
        if py is None or boot is None:
            return
        try:
            self._standbys[slot] = Standby(command, env, py, boot, self.imports, reaper,
                                           self._record, self._measure)
        except (OSError, supervisor.SpawnError) as e:
            log.warning("no standby for the next restart (%s): it will start cold", e)

    def _bootstrap(self) -> str | None:
        """A private copy of ``standby_boot.py`` (the trainer's Python runs it by path)."""
        if self._boot is not None:
            return self._boot
        try:
            source = resources.files("ftagent.agent").joinpath("standby_boot.py").read_bytes()
        except Exception as e:  # a bundle without the file (packaging must add it as data)
            log.warning("warm restarts off: standby_boot.py is not available (%s)", e)
            self.warm = False
            return None
        self._dir = tempfile.mkdtemp(prefix="ftagent-standby-", dir=self._workdir)
        path = os.path.join(self._dir, "ftagent_standby.py")
        with open(path, "wb") as f:
            f.write(source)
        self._boot = path
        return path

    def standby_pids(self) -> dict[int, int]:
        """slot -> pid of the live standbys (tests, the bench)."""
        return {s: sb.pid for s, sb in self._standbys.items() if sb.alive}

    def importing(self) -> int:
        """Live standbys not ready yet: memory the cgroup may not show yet."""
        return sum(1 for sb in self._standbys.values() if sb.alive and sb.ready is None)

    def memory_bytes(self) -> float:
        """PSS of the live standbys (the ``ftagent_standby_memory_bytes`` gauge, read at
        scrape time)."""
        return float(sum(pss_bytes(sb.pid) for sb in list(self._standbys.values())
                         if sb.alive))

    def _measure(self, sb: Standby) -> None:
        """A standby is ready, its imports done: what the next ones are expected to cost."""
        if self._budget is not None:
            self._budget.measured(pss_bytes(sb.pid))

    def close(self) -> list[asyncio.Future[ProcessExit]]:
        """Kill every standby, start no more, remove the bootstrap copy (the agent is
        done); returns the standbys' exits, to wait for (:meth:`aclose`)."""
        self._closed = True
        for p in self._pending.values():
            p.timer.cancel()
        self._pending.clear()
        exits = []
        for sb in self._standbys.values():
            sb.kill()
            exits.append(sb.exited)
        self._standbys.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = self._boot = None
        return exits

    async def aclose(self, timeout: float = 5.0) -> None:
        """:meth:`close`, then wait until every standby is reaped: the agent leaves
        nothing for the containment watchdog's last-resort sweep."""
        exits = [f for f in self.close() if not f.done()]
        if exits:
            await asyncio.wait(exits, timeout=timeout)


def grow_go_pipe(fd: int, size: int) -> None:
    """Make the go pipe hold ``size`` bytes, so the go's one write never blocks."""
    if size > 65536:
        with contextlib.suppress(OSError):
            import fcntl

            fcntl.fcntl(fd, 1031, size)  # F_SETPIPE_SZ


def leave_idle(pid: int) -> int:
    """At the go: every thread of the standby back from SCHED_IDLE to the agent's own
    policy (the one the standby inherited), its main thread first; returns how many.
    A go that comes while its imports still run would otherwise finish them at idle
    priority, behind any busy process of the node; it restores its threads itself once
    they are done (``standby_boot._restore_threads``)."""
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is None:
        return 0
    try:
        policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
        tids = sorted((int(t) for t in os.listdir(f"/proc/{pid}/task")), key=lambda t: t != pid)
    except (OSError, ValueError):
        return 0
    moved = 0
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that ended, or no permission
            if os.sched_getscheduler(tid) == idle:
                os.sched_setscheduler(tid, policy, param)
                moved += 1
    return moved


def _death(sb: Standby) -> str | None:
    """How the standby died (`` (killed by signal 9, SIGKILL)``, or ``""`` when unknown),
    or None while it lives. Also when its SIGCHLD is not handled yet: a peek (WNOWAIT),
    the reaper still reaps it; without it such a standby would be told to go, fail, and
    be reported as one that could not be told."""
    if sb.exited.done():
        if sb.exited.cancelled():
            return ""
        e = sb.exited.result()
        return _described(e.signal, e.code)
    try:
        info = os.waitid(os.P_PID, sb.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        info = None
    if info is not None and info.si_pid == sb.pid:
        if info.si_code == os.CLD_EXITED:
            return _described(None, info.si_status)
        return _described(info.si_status, None)
    return None if sb.alive else ""


def _described(sig: int | None, code: int | None) -> str:
    if sig is not None:
        with contextlib.suppress(ValueError):
            return f" (killed by signal {sig}, {signal.Signals(sig).name})"
        return f" (killed by signal {sig})"
    return f" (exit status {code})"


def warm_restart_parts(worker: Any, cfg: Any, rundir: str, parts: WorkerParts,
                       budget: StandbyBudget | None = None) -> WorkerParts:
    """``parts`` with one worker's (or launcher worker's) trainers started through a
    WarmStarter: warm when ``--warm-restart`` and a restart can follow the attempt being
    started (an arbiter, or ``--max-restarts`` not spent yet; a standby nobody will use
    costs memory and CPU for nothing), each started at the attempt's first step if
    ``budget`` (the process's, shared by the launcher's workers) says the container can
    afford it. The bootstrap copy lives in ``rundir``; the worker closes the standbys when
    it ends (their ``on_close``), and they die with it if it is killed (PDEATHSIG, the
    watchdog); ``worker.metrics.standby_memory`` (if any) reads their PSS.

    The starter is chosen here, once: a worker that can never have a standby (warm
    restarts off, no restart possible, a command no standby can become: ``warmable``)
    keeps ``parts`` as they are -- its trainers start cold, straight from the exec shim,
    with no warm starter consulted (and falling back) at every start."""
    sup = cfg.supervisor
    arbiter = bool(cfg.arbiter.arbiter)
    restarts_possible = sup.max_restarts > 0 or arbiter
    if not (sup.warm_restart and restarts_possible and warmable(cfg.command)):
        return parts
    starter = WarmStarter(imports=parse_warm_imports(sup.warm_imports),
                          record=worker.events.write, workdir=rundir,
                          wanted=lambda: arbiter or worker.restarts < sup.max_restarts,
                          budget=budget)
    gauge = getattr(getattr(worker, "metrics", None), "standby_memory", None)
    if gauge is not None:
        gauge.set_function(starter.memory_bytes)
    if cfg.identity.spare:  # --spare: warm at once (the rank's hook, seat.py RankHooks)
        parts = parts.with_(prepare_spare=lambda: starter.prepare_now(
            cfg.command, worker.next_env(), worker.reaper))
    async def store_first(env: Mapping[str, str]) -> None:
        """A warm start of a rank that dials the rendezvous store waits (briefly) for it
        to listen (store_wait.py): torch's own retry sleeps 250-750 ms."""
        where = store_to_wait_for(env) if starter.has_standby(0) else None
        if where is not None:
            took = await wait_for_store(*where)
            log.debug("store %s:%d %s", *where, "not listening yet" if took is None
                      else f"listening after {took:.3f}s")

    return parts.plus(observers=[FirstStep(starter)], on_close=[starter.aclose],
                      before_start=[store_first]).with_(
        spawn=functools.partial(supervisor.TrainerProcess, starter=starter))


class FirstStep:
    """An agent observer: the attempt's first step (a log line or the SDK) lets its
    standby start (``WarmStarter.stepped``)."""

    observes = (Progress,)  # what the watch loop hands it (watch/loop.py ``_route``)

    def __init__(self, starter: WarmStarter) -> None:
        self.starter = starter

    def observe(self, obs: object) -> None:
        if isinstance(obs, Progress):
            self.starter.stepped()
