"""From one verification window's samples to the stall policy's ``Window`` (detect/stall.py).

The motion judge (``detect/liveness.judge``) says whether the stacks moved; this adds what
/proc says over the same samples: processes stopped (``T``/``t``) or in uninterruptible
sleep (``D``) in every sample, every thread off-CPU, the tree's CPU and storage bytes over
the window, and the Python threads blocked on a file descriptor (read by
``agent/proc_wait.py``; native threads are left out: gloo's loop thread waits on its
peers' sockets in every job). Pure: samples in, a value out.

Contradicting samples are named, never smoothed over: a process whose CPU seconds or I/O
bytes went backwards (another process reusing the pid, or a lie), or one /proc says is
stopped while py-spy found a thread running in the same sample.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ftagent.detect.liveness import Motion, ProcessSample, Snapshot
from ftagent.detect.stall import Blocked, Window

STOPPED = frozenset({"stopped", "tracing-stop"})  # psutil's names of T and t
DISK_SLEEP = "disk-sleep"  # D
# a still thread here waits for its peers (a rendezvous, the store), not on a dead resource
PEER_WAIT = re.compile(r"rendezvous|init_process_group|_store_based_barrier|TCPStore|"
                       r"\bstore\b|_create_c10d_store|wait_for_workers|\bbarrier\b", re.I)
TIMED = re.compile(r"^_?sleep\b")
OFF_CPU = frozenset({"S", "D", "T", "t", "I"})  # /proc thread states of a thread not running


def window_of(motion: Motion, snaps: Sequence[Snapshot],
              blocked: Sequence[Blocked] = ()) -> Window:
    """The policy's view of ``snaps`` (time order) judged ``motion``."""
    snaps = sorted(snaps, key=lambda s: s.ts)
    by_pid: dict[int, list[ProcessSample]] = {}
    for s in snaps:
        for p in s.processes:
            if not p.gone:
                by_pid.setdefault(p.pid, []).append(p)
    errors: list[str] = []
    stopped: list[str] = []
    disk: list[str] = []
    cpu = 0.0
    cpu_known = False
    io = 0
    all_blocked = bool(by_pid)
    for pid, ps in by_pid.items():
        states = [p.status for p in ps]
        if len(ps) >= 2 and all(st in STOPPED for st in states):
            stopped.append(f"pid {pid} (state {'t' if states[-1] == 'tracing-stop' else 'T'}: "
                           "stopped)")
        elif len(ps) >= 2 and all(st == DISK_SLEEP for st in states):
            disk.append(f"pid {pid} (state D)")
        cpus = [p.cpu for p in ps if p.cpu is not None]
        if len(cpus) >= 2:
            if any(b < a - 1e-6 for a, b in zip(cpus, cpus[1:], strict=False)):
                errors.append(f"pid {pid}: CPU seconds went backwards between samples")
            cpu += max(0.0, cpus[-1] - cpus[0])
            cpu_known = True
        ios = [p.io for p in ps if p.io is not None]
        if len(ios) >= 2:
            if any(b < a for a, b in zip(ios, ios[1:], strict=False)):
                errors.append(f"pid {pid}: I/O bytes went backwards between samples")
            io += max(0, ios[-1] - ios[0])
        for p in ps:
            threads = p.threads or ()
            if p.status in STOPPED and any(t.active for t in threads):
                errors.append(f"pid {pid}: /proc says stopped, its stacks say running")
            if p.status not in STOPPED and p.status not in ("sleeping", DISK_SLEEP, "idle"):
                all_blocked = False
            if any(t.state is not None and t.state not in OFF_CPU for t in threads):
                all_blocked = False
    # only Python threads count (py-spy saw them): native loops (gloo's epoll thread on
    # its peers' sockets, NCCL's proxies) wait on sockets in every healthy or hung job
    python = {(p.pid, t.tid) for s in snaps for p in s.processes for t in (p.threads or ())}
    blocked = [b for b in blocked if (b.pid, b.tid) in python]
    moved = _moved(motion)
    return Window(
        motion=motion.state.value, motion_reason=motion.reason, where=motion.where,
        by_io=motion.by_io,
        in_collective=motion.in_collective,
        seconds=motion.window_seconds, moved=moved,
        cpu_seconds=cpu if cpu_known else None, io_bytes=io, all_blocked=all_blocked,
        stopped=tuple(stopped), uninterruptible=tuple(disk), blocked=tuple(blocked),
        working_threads=sum(1 for p in motion.processes for t in p.threads
                            if t.state in ("working", "resumed", "spinning")),
        waits_on_peer=bool(motion.where and PEER_WAIT.search(motion.where)),
        timed_wait=bool(motion.where and TIMED.search(motion.where)),
        errors=tuple(dict.fromkeys(errors)))


def _moved(motion: Motion) -> bool | None:
    threads = [t for p in motion.processes for t in p.threads]
    if not threads:
        return None
    return any(t.moved for t in threads)
