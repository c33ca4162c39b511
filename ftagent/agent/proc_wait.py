"""What a blocked thread waits on, from /proc (issue 35, item 3: slow I/O is not a hang).

For every thread of the trainer's tree that the kernel has off-CPU (state S or D), this reads
the system call it sleeps in (``/proc/PID/task/TID/syscall``: its number and arguments) and,
for a read on a file descriptor (``read``, ``recvfrom``, ``poll`` on one or more fds --
Python's socket with a timeout polls first --, ``select``, ``epoll_wait``), what the fd
points at (``/proc/PID/fd/N``):

* a TCP socket: its inode is matched in the process's ``/proc/PID/net/tcp{,6}`` to the
  remote address; the job's store (``MASTER_ADDR:MASTER_PORT`` from the process's own
  environment) is a **peer**, any other remote is **remote** (a data server, an object
  store);
* a file on a network mount (``/proc/PID/mountinfo``: nfs, cifs, ceph, lustre, fuse, 9p...)
  is **netfs**;
* a pipe or a queue is **pipe**: not I/O (the policy waits on it only when a process of the
  tree is itself blocked on remote I/O: a DataLoader worker feeding the main process);
* anything else (a local file, a unix socket, an eventfd) is **local**.

A poll() that a stop interrupted shows as ``restart_syscall`` until it returns; its wait
channel says it is poll (``restarted``). A ``poll``/``select``'s fd list lives in the
process's memory: read from ``/proc/PID/mem`` (root, as py-spy needs) at the address the
syscall's arguments give, bounded. Nothing here raises: a thread or process vanishing
mid-read is skipped and said in ``errors``. Linux x86_64 and aarch64 system call numbers;
elsewhere nothing is classified (the verdict does not use what it cannot read).
"""

from __future__ import annotations

import os
import platform
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ftagent.detect.stall import Blocked

MAX_FDS = 64  # fds of one poll/select/epoll looked at
MAX_THREADS = 256  # threads per process
NETFS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "lustre", "glusterfs", "9p",
         "fuse", "afs", "beegfs", "gpfs", "orangefs", "ocfs2")

# name -> (x86_64, aarch64); "fd" says which argument is the fd (or how to find them)
SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    "read": (0, 63), "pread64": (17, 67), "readv": (19, 65), "recvfrom": (45, 207),
    "recvmsg": (47, 212), "poll": (7, None), "ppoll": (271, 73), "select": (23, None),
    "pselect6": (270, 72), "epoll_wait": (232, None), "epoll_pwait": (281, 22),
    "openat": (257, 56), "open": (2, None), "connect": (42, 203),
    "restart_syscall": (219, 128),
}
ARCH = {"x86_64": 0, "amd64": 0, "aarch64": 1, "arm64": 1}.get(platform.machine().lower())
BY_NUMBER = {nums[ARCH]: name for name, nums in SYSCALLS.items()
             if ARCH is not None and nums[ARCH] is not None}


@dataclass
class Waits:
    blocked: list[Blocked] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def blocked_threads(pids: Iterable[int], proc: str = "/proc") -> Waits:
    """The threads of ``pids`` blocked on a file descriptor, classified."""
    out = Waits()
    if ARCH is None:
        out.errors.append(f"system calls of {platform.machine()} not known: no I/O waits")
        return out
    for pid in pids:
        try:
            _process(pid, proc, out)
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited: it waits on nothing
        except OSError as e:
            out.errors.append(f"pid {pid}: /proc unreadable ({e.strerror or e})")
    return out


def _process(pid: int, proc: str, out: Waits) -> None:
    base = f"{proc}/{pid}"
    tids = sorted(int(t) for t in os.listdir(f"{base}/task") if t.isdigit())[:MAX_THREADS]
    store = _store(base)
    sockets: dict[int, tuple[str, int]] | None = None
    mounts: list[tuple[str, str]] | None = None
    for tid in tids:
        try:
            with open(f"{base}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state not in ("S", "D"):
                continue
            with open(f"{base}/task/{tid}/syscall", encoding="ascii") as f:
                fields = f.read().split()
        except (OSError, IndexError):
            continue  # the thread ended, or is running now
        if len(fields) < 7 or not fields[0].lstrip("-").isdigit():
            continue
        name = BY_NUMBER.get(int(fields[0]))
        if name is None:
            continue
        if name == "restart_syscall":
            name = restarted(_wchan(f"{base}/task/{tid}"))
            if name is None:
                continue  # a sleep or a futex wait resumed: no fd
        args = [int(a, 16) for a in fields[1:7]]
        if name in ("open", "openat"):
            path = _read_path(pid, args[1 if name == "openat" else 0])
            if path is not None:
                if mounts is None:
                    mounts = _mounts(base)
                kind = "netfs" if _fstype(path, mounts) else "local"
                out.blocked.append(Blocked(pid, tid, name, kind, path[:200]))
            continue
        for fd in _fds(pid, name, args):
            try:
                target = os.readlink(f"{base}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                if sockets is None:
                    sockets = _tcp(base)
                inode = int(target[8:-1]) if target[8:-1].isdigit() else -1
                remote = sockets.get(inode)
                if remote is None or remote[1] == 0:  # a unix socket, or listening
                    kind, what = "local", target
                else:
                    kind = "peer" if _is_store(remote, store) else "remote"
                    what = f"tcp {remote[0]}:{remote[1]}"
            elif target.startswith(("pipe:[", "anon_inode:")):
                kind, what = "pipe", target
            else:
                if mounts is None:
                    mounts = _mounts(base)
                kind, what = ("netfs" if _fstype(target, mounts) else "local"), target
            out.blocked.append(Blocked(pid, tid, name, kind, what[:200]))


# wait channels of a poll() sleeping again after its restart (fs/select.c)
POLL_WCHANS = ("poll_schedule_timeout", "do_poll", "do_sys_poll")


def restarted(wchan: str) -> str | None:
    """The call a ``restart_syscall`` resumes, from the thread's wait channel, or None.

    A poll() with a timeout that a stop interrupted (py-spy's ptrace stop while the agent
    samples the stacks, a SIGSTOP/SIGCONT) does not come back as poll: the kernel resumes it
    as ``restart_syscall``, and /proc shows that number for the rest of the wait, poll's own
    arguments still in the registers. Python polls before every read on a socket with a
    timeout, so without this a slow remote read is unseen once the stacks were sampled.
    Of the calls read here only poll() restarts this way (select, ppoll and epoll_wait are
    re-issued under their own numbers); a sleep or a futex wait is no fd wait: None. An
    unreadable wait channel ("0" without kallsyms) says nothing: None, never a guess."""
    fn = wchan.strip().split(".", 1)[0]
    return "poll" if fn in POLL_WCHANS else None


def _wchan(task: str) -> str:
    try:
        with open(f"{task}/wchan", encoding="ascii", errors="replace") as f:
            return f.read(128)
    except OSError:
        return ""


def _fds(pid: int, name: str, args: Sequence[int]) -> list[int]:
    """The fds a blocked ``name`` call waits on (from its arguments, or its memory)."""
    if name in ("read", "pread64", "readv", "recvfrom", "recvmsg", "connect"):
        return [args[0]]
    if name in ("poll", "ppoll"):
        n = min(args[1], MAX_FDS)
        raw = _mem(pid, args[0], 8 * n)
        return [struct.unpack_from("i", raw, 8 * i)[0] for i in range(len(raw) // 8)
                if struct.unpack_from("i", raw, 8 * i)[0] >= 0]
    if name in ("select", "pselect6"):
        n = min(args[0], 1024)
        raw = _mem(pid, args[1], (n + 7) // 8) if args[1] else b""
        return [i for i in range(n) if i // 8 < len(raw) and raw[i // 8] >> (i % 8) & 1][
            :MAX_FDS]
    if name in ("epoll_wait", "epoll_pwait"):
        try:
            with open(f"/proc/{pid}/fdinfo/{args[0]}", encoding="ascii") as f:
                return [int(line.split()[1]) for line in f.read().splitlines()
                        if line.startswith("tfd:")][:MAX_FDS]
        except (OSError, IndexError, ValueError):
            return []
    return []


def _mem(pid: int, addr: int, n: int) -> bytes:
    if n <= 0 or addr <= 0:
        return b""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
            f.seek(addr)
            return f.read(n)
    except (OSError, OverflowError, ValueError):
        return b""


def _read_path(pid: int, addr: int) -> str | None:
    raw = _mem(pid, addr, 4096)
    if not raw:
        return None
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace") or None


def _tcp(base: str) -> dict[int, tuple[str, int]]:
    """inode -> (remote address, port) of the process's TCP sockets (its namespace)."""
    out: dict[int, tuple[str, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{base}/net/{name}", encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines[:65536]:
            cols = line.split()
            if len(cols) < 10 or not cols[9].isdigit():
                continue
            addr, _, port = cols[2].partition(":")
            try:
                out[int(cols[9])] = (_ip(addr), int(port, 16))
            except ValueError:
                continue
    return out


def _ip(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
    b = b"".join(words)
    if b[:12] == b"\0" * 10 + b"\xff\xff":  # v4-mapped
        return ".".join(str(x) for x in b[12:])
    return ":".join(b[i:i + 2].hex() for i in range(0, 16, 2))


def _store(base: str) -> tuple[str, int] | None:
    """MASTER_ADDR:MASTER_PORT from the process's own environment (its peers' store)."""
    try:
        with open(f"{base}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read(1 << 16).split(b"\0") if b"=" in kv)
        port = int(env.get(b"MASTER_PORT", b"").decode("ascii", "replace") or "0")
        addr = env.get(b"MASTER_ADDR", b"").decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    return (addr, port) if addr and 0 < port < 65536 else None


def _is_store(remote: tuple[str, int], store: tuple[str, int] | None) -> bool:
    if store is None or remote[1] != store[1]:
        return False
    addr = store[0]
    local = ("localhost", "127.0.0.1", "::1")
    return remote[0] == addr or (addr in local and remote[0].startswith(("127.", "::1"))) \
        or not addr[0].isdigit()  # a name: the port alone identifies the store


def _mounts(base: str) -> list[tuple[str, str]]:
    """(mount point, fstype), longest mount point first."""
    out: list[tuple[str, str]] = []
    try:
        with open(f"{base}/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f.read().splitlines()[:4096]:
                left, _, right = line.partition(" - ")
                cols, rcols = left.split(), right.split()
                if len(cols) >= 5 and rcols:
                    out.append((cols[4].replace("\\040", " "), rcols[0]))
    except OSError:
        pass
    return sorted(out, key=lambda m: len(m[0]), reverse=True)


def _fstype(path: str, mounts: Sequence[tuple[str, str]]) -> bool:
    """``path`` is on a network file system."""
    for point, fstype in mounts:
        if path == point or path.startswith(point.rstrip("/") + "/"):
            return fstype.split(".")[0] in NETFS
    return False
