"""The standbys' memory budget: the container's limit and working set as the kernel writes
them (cgroup v2 and v1 files in a directory tree laid out as cgroupfs, /proc/PID/cgroup
and mountinfo in the kernel's format), and the decision taken on them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ftagent.agent.standby_memory import (
    DEFAULT_STANDBY_BYTES,
    CgroupMemory,
    StandbyBudget,
    container_memory,
    fits,
)

MiB = 1 << 20


def test_fits_is_share_of_the_limit_and_off_without_one() -> None:
    mem = CgroupMemory(limit=1000 * MiB, working_set=500 * MiB, path="/x")
    assert fits(mem, 0.9, 400 * MiB)  # 900 of 1000 * 0.9
    assert not fits(mem, 0.9, 401 * MiB)
    assert fits(mem, 0.0, 10_000 * MiB)  # 0: the check is off
    assert fits(None, 0.5, 10_000 * MiB)  # no limit known


def write(base: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = base / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def fake_proc(tmp: Path, cgroup: str, mountinfo: str) -> str:
    proc = tmp / "proc"
    write(proc, {"cgroup": cgroup, "mountinfo": mountinfo})
    return str(proc)


V2_STAT = "anon 1000\nfile 2000\ninactive_file {}\nactive_file 5\n"


def test_v2_the_tightest_limit_up_to_the_mount_and_its_working_set(tmp_path: Path) -> None:
    mnt = tmp_path / "cg"
    # a pod cgroup limited at 2 GiB, the container below it at 1 GiB, the agent's own
    # (a leaf the runtime made) unlimited: the container's limit and usage count
    write(mnt, {
        "kubepods/pod1/memory.max": str(2 << 30) + "\n",
        "kubepods/pod1/memory.current": str(900 * MiB) + "\n",
        "kubepods/pod1/memory.stat": V2_STAT.format(0),
        "kubepods/pod1/ctr/memory.max": str(1 << 30) + "\n",
        "kubepods/pod1/ctr/memory.current": str(700 * MiB) + "\n",
        "kubepods/pod1/ctr/memory.stat": V2_STAT.format(100 * MiB),
        "kubepods/pod1/ctr/leaf/memory.max": "max\n",
        "kubepods/pod1/ctr/leaf/memory.current": str(600 * MiB) + "\n",
        "kubepods/pod1/ctr/leaf/memory.stat": V2_STAT.format(0),
        "memory.max": str(1 << 20) + "\n",  # above the mount's root: never read
    })
    proc = fake_proc(tmp_path, "0::/kubepods/pod1/ctr/leaf\n",
                     f"30 23 0:26 / {mnt} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    mem = container_memory(proc)
    assert mem == CgroupMemory(1 << 30, 600 * MiB, str(mnt / "kubepods/pod1/ctr"))


def test_v2_under_a_cgroup_namespace_and_without_any_limit(tmp_path: Path) -> None:
    mnt = tmp_path / "cg"
    write(mnt, {"memory.max": "max\n", "memory.current": "123\n",
                "memory.stat": V2_STAT.format(0)})
    ns = fake_proc(tmp_path, "0::/\n", f"30 23 0:26 / {mnt} rw - cgroup2 cgroup2 rw\n")
    assert container_memory(ns) is None  # no limit: no check
    (mnt / "memory.max").write_text(str(512 * MiB) + "\n")
    assert container_memory(ns) == CgroupMemory(512 * MiB, 123, str(mnt))
    # a cgroup outside the namespace's view
    out = fake_proc(tmp_path / "o", "0::/../../other\n",
                    f"30 23 0:26 / {mnt} rw - cgroup2 cgroup2 rw\n")
    assert container_memory(out) is None


def test_v1_memory_controller_of_a_hybrid_mount(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    mem_mnt = root / "memory"
    write(mem_mnt, {
        "docker/abc/memory.limit_in_bytes": str(4 << 30) + "\n",
        "docker/abc/memory.usage_in_bytes": str(3 << 30) + "\n",
        "docker/abc/memory.stat": "cache 10\ninactive_file 7\ntotal_inactive_file "
                                  f"{1 << 30}\n",
        "docker/memory.limit_in_bytes": "9223372036854771712\n",  # unlimited
        "docker/memory.usage_in_bytes": "1\n",
    })
    (root / "unified").mkdir(parents=True)
    proc = fake_proc(
        tmp_path, "12:pids:/docker/abc\n5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n"
        "0::/docker/abc\n",
        f"41 31 0:38 / {root / 'unified'} rw,relatime - cgroup2 cgroup2 rw\n"
        f"35 31 0:32 / {mem_mnt} rw,relatime - cgroup cgroup rw,memory\n")
    assert container_memory(proc) == CgroupMemory(4 << 30, 2 << 30,
                                                   str(mem_mnt / "docker/abc"))


def test_no_memory_cgroup_in_view_means_no_check(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "1:name=systemd:/\n", "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
    assert container_memory(proc) is None
    assert container_memory(str(tmp_path / "absent")) is None


class Starter:
    def __init__(self, n: int) -> None:
        self.n = n

    def importing(self) -> int:
        return self.n


def test_budget_reserves_importing_standbys_learns_their_size_and_says_no_once(
        caplog: pytest.LogCaptureFixture) -> None:
    mem = CgroupMemory(limit=1000 * MiB, working_set=400 * MiB, path="/cg")
    budget = StandbyBudget(0.9, read=lambda: mem)
    assert budget.expected == DEFAULT_STANDBY_BYTES
    assert budget.allow()  # 400 + 256 <= 900
    budget.add(Starter(1))  # one still importing: not in the working set yet
    assert not budget.allow()  # 400 + 2 * 256 > 900
    budget.measured(100 * MiB)  # a ready standby's PSS: the next cost that much
    assert budget.allow()  # 400 + 2 * 100
    budget.add(Starter(5))
    with caplog.at_level(logging.WARNING, "ftagent.standby"):
        assert not budget.allow() and not budget.allow()
    said = [r.getMessage() for r in caplog.records if "warm restarts off" in r.getMessage()]
    assert len(said) == 1 and "--warm-restart-memory-share 0.90" in said[0], said
    assert "/cg" in said[0] and budget.refusals == 3
    assert StandbyBudget(0.0, read=lambda: mem).allow()  # 0: no check at all
