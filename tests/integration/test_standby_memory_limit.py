"""Tight memory: the agent in a real memory cgroup with a limit (a child of the test's own,
v1 or v2 as the machine has it) runs without standbys and says so once (issue 26)."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftagent.agent.standby_memory import memory_cgroup
from tests.conftest import PY, ftagent_cmd, read_events, wait_for
from tests.integration.test_launcher import clean_env

# Attempt 0 steps, and waits until the agent wrote down why it keeps no standby (what it
# decides at that step), then crashes; attempt 1 likewise crashes; attempt 2 says whether
# it was a standby (its imports done before its first line) and succeeds.
TRAINER = """
import os, sys, time
PRE = "json" in sys.modules
import json
n = int(os.environ["FTAGENT_RESTART_COUNT"])
print("step=1 loss=1.0", flush=True)
if n == 0:
    deadline = time.monotonic() + 60
    while '"kind": "off"' not in open(sys.argv[1]).read():
        if time.monotonic() > deadline:
            sys.exit("the agent never said why it keeps no standby")
        time.sleep(0.01)
if n < 2:
    sys.exit(3)
print("warm" if PRE else "cold", flush=True)
"""

LIMIT = 1 << 30
SHARE = "0.2"  # 205 MiB: below one standby's expected 256 MiB whatever the agent uses


@contextlib.contextmanager
def limited_cgroup() -> Iterator[str]:
    """A child of this process's memory cgroup, limited to LIMIT; its ``cgroup.procs``."""
    found = memory_cgroup()
    if os.geteuid() != 0 or found is None:
        pytest.skip("needs root and a memory cgroup (v1 or v2) in view")
    base, version = found
    d = os.path.join(base, f"ftagent-test-{secrets.token_hex(4)}")
    try:
        os.mkdir(d)
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here ({e})")
    try:
        limit_file = os.path.join(d, "memory.max" if version == 2 else "memory.limit_in_bytes")
        try:
            with open(limit_file, "w") as f:
                f.write(str(LIMIT))
        except OSError as e:
            pytest.skip(f"cannot limit a memory cgroup here ({e})")
        yield os.path.join(d, "cgroup.procs")
    finally:
        # the agent's watchdog outlives it by its sweep: the cgroup empties a moment later
        wait_for(lambda: not _procs(d), 30, "the limited cgroup empty")
        os.rmdir(d)


def _procs(d: str) -> list[str]:
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def test_tight_memory_runs_without_standbys_and_says_so_once(tmp_path: Path) -> None:
    script, events = tmp_path / "train.py", tmp_path / "events.jsonl"
    script.write_text(TRAINER)
    events.touch()
    with limited_cgroup() as procs:
        cmd = ftagent_cmd("--max-restarts", "2", "--restart-backoff", "0", "--events-file",
                          str(events), "--warm-restart-memory-share", SHARE,
                          "--warm-imports", "json", cmd=[PY, str(script), str(events)])
        r = subprocess.run(["sh", "-c", 'echo $$ > "$0" && exec "$@"', procs, *cmd],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           env=clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1] == "cold"  # the last attempt was no standby
    said = [ln for ln in r.stderr.splitlines() if "warm restarts off for now" in ln]
    assert len(said) == 1, r.stderr[-3000:]  # two refusals, one message
    assert f"of {LIMIT >> 20} MiB" in said[0] and "--warm-restart-memory-share 0.20" in said[0]
    sb = [e for e in read_events(events) if e["event"] == "standby"]
    assert [e["kind"] for e in sb] == ["off"], sb  # no standby started, said once
