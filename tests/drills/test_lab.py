"""The lab cleans up after itself: on close, on SIGTERM, and after a run that was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from tests.conftest import ROOT, wait_for
from tests.lab.net import Network, sweep
from tests.netns import ip, require_netns


def namespaces() -> list[str]:
    return [ln.split()[0] for ln in ip("netns", "list", check=False).splitlines() if ln.strip()]


def links() -> str:
    return ip("-o", "link", "show", check=False)


def test_sweep_removes_a_dead_runs_leftovers_and_keeps_a_live_ones() -> None:
    require_netns()
    dead = 4_194_304 + os.getpid() % 100_000  # above the largest pid_max: never alive
    ip("netns", "add", f"ftlab{dead}x0")
    ip("link", "add", f"ftlb{dead}d", "type", "bridge")
    mine = f"ftlab{os.getpid()}x9"
    ip("netns", "add", mine)
    try:
        removed = sweep()
        assert f"ftlab{dead}x0" in removed and f"ftlb{dead}d" in removed, removed
        assert f"ftlab{dead}x0" not in namespaces() and f"ftlb{dead}d" not in links()
        assert mine in namespaces()  # its creator (this process) is alive
    finally:
        ip("netns", "del", mine, check=False)
        ip("netns", "del", f"ftlab{dead}x0", check=False)
        ip("link", "del", f"ftlb{dead}d", check=False)


def test_close_kills_what_runs_inside_the_nodes_and_removes_the_network() -> None:
    require_netns()
    net = Network(2).create()
    try:
        stray = subprocess.Popen(["ip", "netns", "exec", net.namespaces[1], "sleep", "600"])
        wait_for(lambda: subprocess.run(["ip", "netns", "pids", net.namespaces[1]],
                                        capture_output=True, text=True).stdout.strip(), 10,
                 "the stray process inside node 1")
        names = list(net.namespaces)
    finally:
        net.close()
    assert stray.wait(10) == -signal.SIGKILL
    assert not set(names) & set(namespaces())
    assert f"ftlb{os.getpid()}d" not in links() and f"fl{os.getpid()}d0" not in links()


def test_sigterm_to_the_test_process_takes_its_lab_down() -> None:
    require_netns()
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        import tempfile
        from tests.lab import Lab
        lab = Lab(Path(tempfile.mkdtemp()), 2, arbiter=False).__enter__()
        print("ready", " ".join(lab.net.namespaces), flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert child.stdout is not None
    line = child.stdout.readline().decode().split()
    assert line[:1] == ["ready"], line
    made = line[1:]
    assert made and set(made) <= set(namespaces())
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM  # it still dies of the signal
    assert not set(made) & set(namespaces())
    assert f"ftlb{child.pid}d" not in links()
