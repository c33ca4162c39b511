"""No orphans: nothing of the trainer's tree outlives the agent, even a SIGKILLed agent.

While the agent lives, its sub-reaper makes every descendant findable and its stop path
kills them all (see ``supervisor``). This module covers the agent's own sudden death
(SIGKILL, the OOM killer, a crash of the interpreter), after which orphans re-parent to
the next sub-reaper or init and nobody would stop them. ``PR_SET_PDEATHSIG`` kills only
the trainer itself; its children, ``setsid`` children and double-forked daemons stay.

Three layers, the best one available is used, chosen once per agent (``current()``):

1. **The agent is PID 1 of its PID namespace** (a container's entrypoint, without
   ``shareProcessNamespace``): when it dies the kernel SIGKILLs every process of the
   namespace. Nothing to add; no watchdog is started.
2. **A watchdog process** otherwise: ``python -I -S`` running ``WATCHDOG`` (no site, no
   third-party import, about 10 MB RSS, blocked in ``poll`` at no CPU), started at the
   first spawn in its own session (terminal signals and group kills of the agent do not
   reach it), a child of the agent but *not* dying with it. It waits for the agent's end:
   EOF on a pipe only the agent holds, and a pidfd of the agent. Then it sweeps: SIGKILL
   every process that carries the per-agent marker ``FTAGENT_TREE_<token>=<agent pid>``
   in ``/proc/PID/environ`` (inherited through fork, exec, ``setsid`` and double forks),
   or that is still in the session of a trainer (the agent reports each trainer's
   session, and forgets it once that tree is empty, so a reused pid is never taken for
   it); it repeats until a scan finds none (a process forked during the sweep is found
   by the next scan). Each kill goes through a pidfd opened *before* the match is
   re-checked, so a pid reused meanwhile is never signalled. It then exits. After a
   normal exit of the agent (which killed the tree already) the sweep finds nothing.
3. **A cgroup v2 of the trainer's own**, on top of the watchdog, when the agent's cgroup
   is writable (root, a delegated or writable ``/sys/fs/cgroup``): the exec shim moves
   the trainer into ``<agent's cgroup>/ftagent-<pid>-<token>`` before it execs, so every
   descendant is born in it and cannot leave without write access to cgroupfs; the
   watchdog's sweep writes ``cgroup.kill`` (Linux >= 5.14; before that it SIGKILLs each
   pid of ``cgroup.procs``) and removes the directory. The child cgroup enables no
   controller: the container's limits and accounting still apply above it; only the
   trainer's ``/proc/self/cgroup`` names the child.

What is guaranteed where:

* PID 1 of a PID namespace: everything, by the kernel.
* cgroup available (root in a VM or on bare metal, privileged containers): everything
  the kernel can kill, including processes that scrub their environment *and* leave the
  session; only a process that moves itself out of the cgroup (needs write access to
  cgroupfs) escapes, and a process in uninterruptible sleep dies when it wakes.
* watchdog only (an unprivileged pod or user, cgroupfs read-only): every process that
  kept the marker or stayed in a trainer's session. A process that **both** leaves the
  session (``setsid``, a daemon's double fork) **and** drops the marker escapes: started
  with a scrubbed environment (``env={}``, ``env -i``, ``os.environ.clear()`` before
  spawning it), or one that overwrites its own environment block (``setproctitle``
  tools). So does a process the watchdog may not inspect or signal (a setuid program,
  another user), which an unprivileged agent could not kill anyway.
* Everywhere: if the watchdog itself is SIGKILLed together with the agent (a kill of the
  whole cgroup or container), the kernel or the runtime already kills the tree with it;
  a leftover empty child cgroup is then removed with the container's.

Measured (root in a Firecracker VM, Linux 6.18, 2 cores): every process of a tree with a
plain child, a grandchild, a setsid child, a double-forked daemon and a process that
changed its group was gone 0-25 ms after the agent's SIGKILL (10 runs), with and without
the cgroup, and as root with every capability dropped (no cgroup then: the watchdog path).
``unshare(CLONE_NEWPID)`` for the trainer was weighed and not taken: it needs
CAP_SYS_ADMIN (EPERM unprivileged; only with a user namespace, which changes the
trainer's uids and is blocked by default container seccomp profiles), and it alters the
trainer: as PID 1 of its namespace it ignores SIGTERM/SIGINT without a handler (breaks
the forwarding of stop signals), must reap its orphans, and its ``os.getpid()`` no longer
matches ``/proc`` (``psutil.Process(os.getpid())`` looks at another process).

``FTAGENT_CONTAINMENT`` chooses: ``auto`` (default: cgroup if possible, watchdog),
``watchdog`` (no cgroup), ``off`` (neither: PDEATHSIG of the trainer only).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Collection, Mapping

log = logging.getLogger("ftagent.containment")

WATCHDOG_TAG = "ftagent-watchdog"  # argv[1] of the watchdog: how ps and tests find it
MARKER_PREFIX = "FTAGENT_TREE_"
MODES = ("auto", "watchdog", "off")
SWEEP_SECONDS = 10.0

# argv: WATCHDOG_TAG, agent pid, marker entry ("NAME=VALUE"), cgroup directory or "".
# stdin: the read end of a pipe only the agent holds; lines "S <sid>" (a trainer's
# session to sweep too) and "F <sid>" (forget it: its tree is empty).
WATCHDOG = f"""
import os, select, signal, sys, time
for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
agent, marker, cg = int(sys.argv[2]), sys.argv[3].encode(), sys.argv[4]
me = os.getpid()
sessions = set()
buf = b""

def feed(data):
    global buf
    *lines, buf = (buf + data).split(b"\\n")
    for line in lines:
        op, _, arg = line.partition(b" ")
        if not arg.isdigit():
            continue
        if op == b"S":
            sessions.add(int(arg))
        elif op == b"F":
            sessions.discard(int(arg))

def say(text):
    try:
        sys.stderr.write("ftagent watchdog: " + text + "\\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass

def wait_for_agent():
    try:
        pidfd = os.pidfd_open(agent)
    except (AttributeError, OSError):
        pidfd = -1
    if os.getppid() != agent:  # gone before the pidfd was opened
        return
    poller = select.poll()
    poller.register(0, select.POLLIN)
    if pidfd >= 0:
        poller.register(pidfd, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == pidfd:
                return
            data = os.read(0, 65536)
            if not data:
                return
            feed(data)

def drain():
    os.set_blocking(0, False)
    while True:
        try:
            data = os.read(0, 65536)
        except OSError:
            return
        if not data:
            return
        feed(data)

def alive_sid(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[3])

def ours(pid):
    if pid in (me, agent, 1):
        return False
    sid = alive_sid(pid)
    if sid is None:
        return False
    if sid in sessions:
        return True
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return marker in f.read().split(b"\\0")
    except OSError:
        return False

def in_cgroup():
    try:
        with open(cg + "/cgroup.procs") as f:
            return [p for p in map(int, f.read().split()) if alive_sid(p) is not None]
    except (OSError, ValueError):
        return []

def kill(pid, check):
    try:
        fd = os.pidfd_open(pid)
    except AttributeError:
        fd = -1
    except OSError:
        return False
    try:
        if check and not ours(pid):  # checked after the pidfd pins the process
            return False
        if fd >= 0:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)

def sweep():
    deadline = time.monotonic() + {SWEEP_SECONDS}
    if cg:
        try:
            with open(cg + "/cgroup.kill", "w") as f:
                f.write("1")
        except OSError:
            pass
    killed = set()
    while True:
        found = [(p, True) for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                 if ours(p)]
        if cg:
            found += [(p, False) for p in in_cgroup() if p != me]
        if not found:
            break
        if time.monotonic() > deadline:
            say("still alive after SIGKILL: %s" % sorted(p for p, _ in found))
            break
        for p, check in found:
            if kill(p, check):
                killed.add(p)
        time.sleep(0.005)
    while cg and time.monotonic() < deadline:
        try:
            os.rmdir(cg)
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.01)
    if killed:
        say("agent %d is gone; killed %d process(es) of its trainer's tree"
            % (agent, len(killed)))

wait_for_agent()
drain()
sweep()
"""


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def own_cgroup_dir(proc: str = "/proc/self") -> str | None:
    """The directory of this process's cgroup v2, or None (v1 only, not mounted, hidden)."""
    try:
        with open(f"{proc}/cgroup") as f:
            path = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        with open(f"{proc}/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    if path is None or path.startswith("/.."):  # outside our cgroup namespace's view
        return None
    for line in mounts:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep + 1 >= len(fields) or fields[sep + 1] != "cgroup2":
            continue
        root, mnt = _unescape(fields[3]), _unescape(fields[4])
        if root == "/":
            rel = path
        elif path == root or path.startswith(root + "/"):
            rel = path[len(root):]
        else:
            continue
        d = mnt.rstrip("/") + rel if rel != "/" else mnt
        if os.path.isfile(os.path.join(d, "cgroup.procs")):
            return d
    return None


def make_cgroup(token: str) -> str | None:
    """A child cgroup for the trainer, or None where this agent may not make or use one."""
    base = own_cgroup_dir()
    if base is None or not os.access(os.path.join(base, "cgroup.procs"), os.W_OK):
        return None
    d = os.path.join(base, f"ftagent-{os.getpid()}-{token[:8]}")
    try:
        os.mkdir(d)
    except OSError as e:
        log.debug("no cgroup for the trainer (%s): %s", d, e)
        return None
    if not os.access(os.path.join(d, "cgroup.procs"), os.W_OK):
        with contextlib.suppress(OSError):
            os.rmdir(d)
        return None
    return d


class Containment:
    """The per-agent marker, the trainer's cgroup and the watchdog (module docstring)."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in MODES:
            log.warning("FTAGENT_CONTAINMENT=%s is not one of %s; using auto", mode, MODES)
            mode = "auto"
        self.pid = os.getpid()
        self.token = secrets.token_hex(8)
        self.marker = (MARKER_PREFIX + self.token, str(self.pid))
        self.pid_namespace_init = self.pid == 1
        self.enabled = mode != "off" and not self.pid_namespace_init
        self.cgroup = make_cgroup(self.token) if self.enabled and mode == "auto" else None
        self.watchdog: subprocess.Popen[bytes] | None = None
        self._pipe = -1
        self._sessions: set[int] = set()  # trainers' sessions the watchdog sweeps
        self._exited: set[int] = set()  # trainers that exited; forget once the tree is empty
        if not self.enabled:
            what = "PID 1 of its PID namespace" if self.pid_namespace_init else "off"
            log.info("containment: %s; no watchdog", what)

    @property
    def cgroup_procs(self) -> str:
        """For the exec shim: the file it writes its pid to, or "" for none."""
        return os.path.join(self.cgroup, "cgroup.procs") if self.cgroup else ""

    @property
    def watchdog_pid(self) -> int | None:
        return self.watchdog.pid if self.watchdog is not None else None

    def trainer_env(self, env: Mapping[str, str]) -> dict[str, str]:
        out = dict(env)
        if self.enabled:
            out[self.marker[0]] = self.marker[1]
        return out

    def ensure_watchdog(self) -> None:
        """Start the watchdog unless it runs; call before spawning a trainer."""
        if not self.enabled:
            return
        # poll(): None while it runs; the agent's reaper may have collected it (0 then)
        if self.watchdog is not None and self._pipe >= 0 and self.watchdog.poll() is None:
            return
        self._close_pipe()
        r, w = os.pipe()  # both ends close-on-exec: no trainer holds the write end
        try:
            self.watchdog = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", WATCHDOG, WATCHDOG_TAG, str(self.pid),
                 "=".join(self.marker), self.cgroup or ""],
                stdin=r, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        except OSError as e:
            os.close(w)
            if self.cgroup is not None:  # no watchdog would ever kill or remove it
                with contextlib.suppress(OSError):
                    os.rmdir(self.cgroup)
                self.cgroup = None
            log.error("cannot start the watchdog (%s): a SIGKILL of the agent would leave "
                      "the trainer's children running", e)
            return
        finally:
            os.close(r)
        self._pipe = w
        log.info("containment: watchdog pid %d, %s", self.watchdog.pid,
                 f"cgroup {self.cgroup}" if self.cgroup else "environment marker + session")
        for sid in self._sessions:
            self._send(f"S {sid}")

    def for_spawn(self, env: Mapping[str, str]) -> tuple[str, dict[str, str], int | None]:
        """Before a trainer is spawned, in one call: the watchdog running, and the exec
        shim's cgroup.procs file, the trainer's environment and the watchdog's pid, which
        is no part of the trainer's tree (``cgroup_procs``, ``trainer_env``,
        ``watchdog_pid``)."""
        self.ensure_watchdog()
        return self.cgroup_procs, self.trainer_env(env), self.watchdog_pid

    def trainer_started(self, pid: int) -> None:
        if self.enabled:
            self._sessions.add(pid)
            self._send(f"S {pid}")

    def trainer_exited(self, pid: int) -> None:
        if pid in self._sessions:
            self._exited.add(pid)

    def tree_empty(self, keep: Collection[int] = ()) -> None:
        """The agent saw no process of the tree: every session but those of ``keep`` (the
        standbys waiting, which are no part of the tree) is empty -- its leader would be
        in the tree otherwise, exited or not told yet (``trainer_exited``) -- and their
        pids may be reused; the watchdog must forget them. Read from the tree in place:
        a trainer's exit needs no call of its own."""
        for pid in self._exited | (self._sessions - set(keep)):
            if pid in self._sessions:
                self._sessions.discard(pid)
                self._send(f"F {pid}")
        self._exited.clear()

    def _send(self, line: str) -> None:
        if self._pipe < 0:
            return
        try:
            os.write(self._pipe, line.encode() + b"\n")
        except OSError:  # the watchdog died: the next spawn starts another
            self._close_pipe()

    def _close_pipe(self) -> None:
        if self._pipe >= 0:
            with contextlib.suppress(OSError):
                os.close(self._pipe)
            self._pipe = -1


_current: Containment | None = None


def current() -> Containment:
    """This agent process's containment, made on first use (and anew after a fork)."""
    global _current
    if _current is None or _current.pid != os.getpid():
        _current = Containment(os.environ.get("FTAGENT_CONTAINMENT", "auto") or "auto")
    return _current


def for_spawn(env: Mapping[str, str]) -> tuple[str, dict[str, str], int | None]:
    """This process's containment (made on first use) readied for a spawn, in one call
    (``Containment.for_spawn``), as ``trainer_exited`` and ``tree_empty`` are one."""
    return current().for_spawn(env)


def trainer_started(pid: int) -> None:
    """A trainer of this process's containment started (``Containment.trainer_started``:
    ``for_spawn`` made it)."""
    current().trainer_started(pid)


def trainer_exited(pid: int) -> None:
    """A trainer of this process's containment exited (``Containment.trainer_exited``)."""
    current().trainer_exited(pid)


def tree_empty(keep: Collection[int] = ()) -> None:
    """No process of the trainer's tree is left but ``keep`` (``Containment.tree_empty``),
    if a containment was made in this process."""
    c = peek()
    if c is not None:
        c.tree_empty(keep)


def peek() -> Containment | None:
    """The containment if one was made in this process, without making one."""
    return _current if _current is not None and _current.pid == os.getpid() else None
