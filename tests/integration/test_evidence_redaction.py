"""Credentials a trainer prints stay in its output and out of the fault's evidence."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import PY, ftagent_cmd


def test_secret_values_are_redacted_in_last_lines_and_pass_through_the_output(
        tmp_path: Path) -> None:
    """Issue 20: last-lines evidence goes to the arbiter, its timeline, history and
    reports; an env dump in the trainer's log put HF_TOKEN there. The trainer's own output
    is untouched (it comes first), the evidence is redacted and keeps its line bound."""
    events = tmp_path / "ev.jsonl"
    code = ("import sys\n"
            "print('HF_TOKEN=hf_s3cr3t WORLD_SIZE=2 --db-password=hunter2 step=7')\n"
            "print('AWS_SECRET_ACCESS_KEY=' + 'k' * 70000)\n"
            "print('API_KEY=abc' + ' y' * 40000)\n"
            "sys.exit(1)\n")
    r = subprocess.run(ftagent_cmd("--log-lines", "5", "--events-file", str(events),
                                   cmd=[PY, "-c", code]), capture_output=True, timeout=60)
    assert r.returncode == 1
    assert b"HF_TOKEN=hf_s3cr3t" in r.stdout and b"hunter2" in r.stdout
    fault = [json.loads(x) for x in events.read_text().splitlines() if '"fault"' in x][0]
    first, second, third = fault["last_lines"][-3:]
    assert first == ("HF_TOKEN=[redacted] WORLD_SIZE=2 --db-password=[redacted] step=7")
    assert second == "AWS_SECRET_ACCESS_KEY=[redacted]"
    assert third.startswith("API_KEY=[redacted] y y") and len(third) <= 1 << 16
    assert "s3cr3t" not in events.read_text() and "hunter2" not in events.read_text()
