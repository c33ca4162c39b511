"""A clean exit closes the warm standbys itself (issue 26): the agent kills and reaps them
before it exits, so nothing of them outlives it and the containment watchdog's
last-resort sweep finds nothing to kill.

What outlives a process is seen by a sub-reaper above it: a small harness process
(PR_SET_CHILD_SUBREAPER) starts ``ftagent run --nproc-per-node 2``; whatever the agent
leaves behind when it exits is re-parented to the harness, which can then ``waitpid`` it.
A standby the agent reaped itself is no child of the harness (ECHILD). The watchdog is
re-parented too: the harness waits for it, so its log is complete when read.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import PY, ftagent_cmd
from tests.integration.test_launcher import clean_env

HARNESS = r"""
import ctypes, json, os, subprocess, sys, time
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # CHILD_SUBREAPER
cmd, go, log, n = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])

def children(ppid, word):
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/stat" % pid, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                if int(fields[1]) == ppid and fields[0] != b"Z" and word in f.read():
                    out.append(int(pid))
        except (OSError, IndexError, ValueError):
            pass
    return out

with open(log, "wb") as out:
    agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    seen = set()  # every standby seen: one may be replaced while we look (a slow boot)
    while True:
        now = children(agent.pid, b"ftagent_standby")
        seen.update(now)
        watchdog = children(agent.pid, b"ftagent-watchdog")
        if len(now) >= n and watchdog:
            break
        if agent.poll() is not None or time.monotonic() > deadline:
            print(json.dumps({"error": "no standby per worker", "rc": agent.poll()}))
            sys.exit(0)
        time.sleep(0.02)
    standbys = sorted(seen | set(children(agent.pid, b"ftagent_standby")))
    open(go, "w").close()  # the trainers finish: a normal exit
    rc = agent.wait(60)

left = []
for pid in standbys:
    try:
        os.waitpid(pid, 0)  # re-parented here: it outlived the agent
        left.append(pid)
    except ChildProcessError:
        pass  # reaped by the agent itself
for pid in watchdog:
    try:
        os.waitpid(pid, 0)  # its sweep is over, its last words written
    except ChildProcessError:
        pass
print(json.dumps({"rc": rc, "standbys": standbys, "left": left}))
"""

TRAINER = """
import os, sys, time
print("step=1 loss=1.0", flush=True)  # the first step: the standby starts now
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]):
    if time.monotonic() > deadline:
        sys.exit("never told to finish")
    time.sleep(0.01)
"""


def test_a_normal_exit_leaves_the_watchdog_nothing_to_kill(tmp_path: Path) -> None:
    script, go, log = tmp_path / "train.py", tmp_path / "finish", tmp_path / "agent.log"
    script.write_text(TRAINER)
    cmd = ftagent_cmd("--nproc-per-node", "2", "--max-restarts", "1", "--log-level", "info",
                      cmd=[str(script), str(go)])
    r = subprocess.run([PY, "-c", HARNESS, json.dumps(cmd), str(go), str(log), "2"],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path,
                       env=clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    out = log.read_text(errors="replace")
    assert "error" not in res, (res, out[-3000:])
    assert res["rc"] == 0, out[-3000:]
    assert len(res["standbys"]) >= 2  # one per worker at once (the harness waited for it)
    assert res["left"] == [], "standbys outlived the agent: " + out[-3000:]
    assert "ftagent watchdog:" not in out, out[-3000:]  # its sweep killed nothing
    assert "containment: watchdog pid" in out  # there was a watchdog to say it
