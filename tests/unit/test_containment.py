"""Containment helpers that need no processes: finding the cgroup v2 directory."""

from __future__ import annotations

from pathlib import Path

from ftagent.agent.containment import Containment, own_cgroup_dir

V1 = "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n"


def fake_proc(tmp: Path, cgroup: str, mountinfo: str) -> str:
    (tmp / "cgroup").write_text(cgroup)
    (tmp / "mountinfo").write_text(mountinfo)
    return str(tmp)


def make_cgroupfs(tmp: Path, rel: str) -> Path:
    d = tmp / "fs" / rel.strip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "cgroup.procs").write_text("")
    return d


def test_cgroup_dir_under_a_mount_of_the_whole_hierarchy(tmp_path: Path) -> None:
    d = make_cgroupfs(tmp_path, "/kubepods/pod1/c1")
    mnt = tmp_path / "fs"
    proc = fake_proc(tmp_path, "0::/kubepods/pod1/c1\n",
                     V1 + f"31 25 0:27 / {mnt} rw,nosuid - cgroup2 cgroup2 rw\n")
    assert own_cgroup_dir(proc) == str(d)


def test_cgroup_dir_under_a_bind_mount_of_a_subtree(tmp_path: Path) -> None:
    # the mount's root is /kubepods/pod1: the cgroup path is relative to it
    d = make_cgroupfs(tmp_path, "/c1")
    mnt = tmp_path / "fs"
    proc = fake_proc(tmp_path, "0::/kubepods/pod1/c1\n",
                     f"31 25 0:27 /kubepods/pod1 {mnt} rw - cgroup2 cgroup2 rw\n")
    assert own_cgroup_dir(proc) == str(d)


def test_cgroup_dir_is_the_mount_itself_at_a_namespace_root(tmp_path: Path) -> None:
    d = make_cgroupfs(tmp_path, "/")
    proc = fake_proc(tmp_path, "0::/\n", f"31 25 0:27 / {d} ro - cgroup2 cgroup2 rw\n")
    assert own_cgroup_dir(proc) == str(d)


def test_no_cgroup_dir_for_v1_only_or_a_path_outside_the_namespace(tmp_path: Path) -> None:
    assert own_cgroup_dir(fake_proc(tmp_path, "4:memory:/x\n", V1)) is None
    make_cgroupfs(tmp_path, "/")
    mnt = tmp_path / "fs"
    proc = fake_proc(tmp_path, "0::/../other\n", f"31 25 0:27 / {mnt} rw - cgroup2 c rw\n")
    assert own_cgroup_dir(proc) is None


def test_marker_and_sessions_without_a_watchdog() -> None:
    c = Containment("off")
    assert c.trainer_env({"A": "1"}) == {"A": "1"}  # off: the trainer's env as given
    c = Containment("watchdog")
    env = c.trainer_env({"A": "1"})
    assert env[c.marker[0]] == c.marker[1] and c.marker[0].startswith("FTAGENT_TREE_")
    assert c.cgroup is None and c.cgroup_procs == ""
    c.trainer_started(1234)
    c.trainer_exited(1234)
    assert c._sessions == {1234}  # exited, but its session may still have members
    c.tree_empty()
    assert c._sessions == set()


def test_an_empty_tree_forgets_every_session_but_a_waiting_standbys() -> None:
    """The tree read empty says every trainer's session is empty, told of its exit or not
    (the supervisor no longer tells each exit): forgotten, but for the standbys kept (no
    part of the tree while they wait)."""
    c = Containment("watchdog")
    c.trainer_started(1234)  # a trainer: exited, not told
    c.trainer_started(4321)  # a standby waiting (hidden from the tree)
    c.tree_empty(keep={4321})
    assert c._sessions == {4321}
    c.trainer_exited(4321)  # the standby died
    c.tree_empty(keep={4321})
    assert c._sessions == set()
