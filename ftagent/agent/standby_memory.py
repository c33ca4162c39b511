"""What warm standbys cost in memory, and whether the container can afford another.

A standby is an idle interpreter holding the trainer's imports: 234 MB PSS with torch
(bench/restart.py), one per worker, all of it charged to the pod's memory limit like any
other process of the container. Before a standby is started, :class:`StandbyBudget` asks
the container's memory cgroup how close it is to its limit: the standby must fit, with
the ones still importing, under ``--warm-restart-memory-share`` of the limit, or the agent
runs without it (a cold restart costs seconds; an OOM kill of the pod costs the job).

The container's memory as the kubelet and the OOM killer see it: the limit is the lowest
``memory.max`` (cgroup v2) or ``memory.limit_in_bytes`` (v1) from the agent's own cgroup
up to the root of the hierarchy it sees (the container's, under a cgroup namespace), and
the use is that cgroup's working set, usage less inactive page cache (``memory.current``
minus ``inactive_file`` of ``memory.stat``; v1: ``memory.usage_in_bytes`` minus
``total_inactive_file``), as cAdvisor computes ``container_memory_working_set_bytes``.
No limit (or no memory cgroup visible): no check.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ftagent.standby")

DEFAULT_STANDBY_BYTES = 256 << 20  # before one was measured: torch's standby, rounded up
UNLIMITED = 1 << 62  # v1 reports "no limit" as a page-rounded LONG_MAX
MAX_READ = 1 << 16  # bytes read of any cgroup or /proc file


@dataclass(frozen=True)
class CgroupMemory:
    """The container's memory limit and working set, in bytes, and where they were read."""

    limit: int
    working_set: int
    path: str


def fits(mem: CgroupMemory | None, share: float, expected: int) -> bool:
    """Would ``expected`` more bytes keep the container under ``share`` of its limit?
    Pure; no limit known (``mem`` None) or ``share`` 0 (the check is off): yes."""
    if mem is None or share <= 0:
        return True
    return mem.working_set + expected <= share * mem.limit


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_READ).decode("ascii", "replace")
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    t = text.strip()
    return int(t) if t.isascii() and t.isdigit() and len(t) <= 20 else None


def _stat(text: str | None, key: str) -> int:
    m = re.search(rf"^{re.escape(key)} (\d{{1,20}})$", text or "", re.M)
    return int(m.group(1)) if m else 0


def _unescape(field: str) -> str:
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def _cgroup_dirs(proc: str) -> tuple[str | None, str | None, str | None]:
    """(v2 directory, v1 memory directory, mount point of the one found) of ``proc``'s
    cgroup; None where that hierarchy is not mounted or not in view."""
    cg, mi = _read(f"{proc}/cgroup"), _read(f"{proc}/mountinfo")
    if cg is None or mi is None:
        return None, None, None
    v2_path = v1_path = None
    for line in cg.splitlines():
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and ctrls == "":
            v2_path = path
        elif "memory" in ctrls.split(","):
            v1_path = path
    for line in mi.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or sep + 3 >= len(fields):  # fstype, source, super options
            continue
        fstype, opts = fields[sep + 1], fields[sep + 3].split(",")
        root, mnt = _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup" and "memory" in opts and v1_path is not None:
            d = _below(mnt, root, v1_path)
            if d is not None:
                return None, d, mnt
        if fstype == "cgroup2" and v2_path is not None and v1_path is None:
            d = _below(mnt, root, v2_path)
            if d is not None:
                return d, None, mnt
    return None, None, None


def _below(mnt: str, root: str, path: str) -> str | None:
    if path.startswith("/.."):  # outside our cgroup namespace's view
        return None
    if root == "/":
        rel = path
    elif path == root or path.startswith(root + "/"):
        rel = path[len(root):]
    else:
        return None
    return mnt.rstrip("/") + rel if rel not in ("", "/") else mnt


def memory_cgroup(proc: str = "/proc/self") -> tuple[str, int] | None:
    """(directory, cgroup version) of ``proc``'s memory cgroup, or None."""
    v2, v1, _ = _cgroup_dirs(proc)
    return (v2, 2) if v2 else (v1, 1) if v1 else None


def container_memory(proc: str = "/proc/self") -> CgroupMemory | None:
    """The tightest memory limit above ``proc``'s cgroup, and that cgroup's working set;
    None without a limit or a readable memory cgroup (module docstring)."""
    v2, v1, mnt = _cgroup_dirs(proc)
    d = v2 or v1
    if d is None or mnt is None:
        return None
    files = ("memory.max", "memory.current", "inactive_file") if v2 else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    best: CgroupMemory | None = None
    top = os.path.normpath(mnt)
    d = os.path.normpath(d)
    while True:
        limit = _int(_read(os.path.join(d, files[0])))  # "max" (v2): None, no limit here
        usage = _int(_read(os.path.join(d, files[1])))
        if limit is not None and limit < UNLIMITED and usage is not None and \
                (best is None or limit < best.limit):
            ws = max(0, usage - _stat(_read(os.path.join(d, "memory.stat")), files[2]))
            best = CgroupMemory(limit, ws, d)
        if d == top or len(d) <= len(top):
            return best
        d = os.path.dirname(d)


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (its fair share of pages it shares with the
    trainer: the page cache of torch's libraries), 0 once it is gone."""
    m = re.search(r"^Pss:\s+(\d{1,20}) kB", _read(f"/proc/{pid}/smaps_rollup") or "", re.M)
    return int(m.group(1)) * 1024 if m else 0


class StandbyBudget:
    """One per agent process (the launcher's workers share it): may another standby start?

    ``importing()`` counts the process's standbys still importing (of the starters
    ``add``-ed), whose memory the
    cgroup does not show yet: each is reserved at the expected size. The expected size is
    the largest PSS measured of a ready standby in this process, until then
    :data:`DEFAULT_STANDBY_BYTES`. A refusal is said once; the next standby is asked
    about again (memory may have been freed)."""

    def __init__(self, share: float, *, read: Callable[[], CgroupMemory | None] =
                 container_memory) -> None:
        self.share = share
        self._read = read
        self.expected = DEFAULT_STANDBY_BYTES
        self._measured = False
        self.refusals = 0
        self._starters: list[Any] = []  # WarmStarters: their importing() counts

    def add(self, starter: Any) -> None:
        """A worker's starter, whose standbys still importing are reserved for."""
        self._starters.append(starter)

    def importing(self) -> int:
        return sum(int(s.importing()) for s in self._starters)

    def measured(self, pss: int) -> None:
        """A ready standby's PSS: what the next ones are expected to cost."""
        if pss > 0:
            self.expected = max(pss, self.expected if self._measured else 0)
            self._measured = True

    def allow(self) -> bool:
        """True if one more standby fits; False (said once per process) if not."""
        if self.share <= 0:
            return True
        mem = self._read()
        need = self.expected * (1 + self.importing())
        if fits(mem, self.share, need):
            return True
        assert mem is not None
        self.refusals += 1
        if self.refusals == 1:
            log.warning(
                "warm restarts off for now: another standby (~%d MiB each, %d still "
                "starting) would take the container to %d of %d MiB, over "
                "--warm-restart-memory-share %.2f of its limit (%s); restarts start cold. "
                "Raise the pod's memory limit or the share, or set --no-warm-restart",
                self.expected >> 20, need // self.expected - 1,
                (mem.working_set + need) >> 20, mem.limit >> 20, self.share, mem.path)
        return False
