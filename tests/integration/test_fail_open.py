"""Without a reachable arbiter the agent fails open: training starts, local policy decides."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from tests.conftest import ftagent_cmd, read_events

TRAINER = ["sh", "-c", 'echo "attempt=$FTAGENT_RESTART_COUNT"; '
           '[ "$FTAGENT_RESTART_COUNT" = 0 ] && exit 5; exit 0']


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket closes


def test_unreachable_arbiter_training_starts_and_local_policy_restarts(tmp_path: Path) -> None:
    events = tmp_path / "ev.jsonl"
    r = subprocess.run(ftagent_cmd("--arbiter", f"127.0.0.1:{closed_port()}",
                                   "--arbiter-fail-open-after", "0.5", "--max-restarts", "1",
                                   "--restart-backoff", "0", "--events-file", str(events),
                                   cmd=TRAINER), capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert r.stdout.split() == [b"attempt=0", b"attempt=1"]
    ev = read_events(events)
    crash = [e for e in ev if e["event"] == "fault" and e["kind"] == "crash"]
    restart = [e for e in ev if e["event"] == "action" and e["kind"] == "restart"]
    assert len(crash) == 1 and len(restart) == 1  # decided locally, not waiting forever
    assert b"unreachable" in r.stderr or b"no arbiter" in r.stderr


def test_unreachable_arbiter_budget_spent_exits_with_trainer_code(tmp_path: Path) -> None:
    r = subprocess.run(ftagent_cmd("--arbiter", f"127.0.0.1:{closed_port()}",
                                   "--arbiter-fail-open-after", "0.5",
                                   cmd=["sh", "-c", "exit 9"]), capture_output=True, timeout=60)
    assert r.returncode == 9
