"""A trainer that reports through the SDK only: metrics and hang detection follow it."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import urllib.request
from pathlib import Path

from tests.conftest import PY, ftagent_cmd, popen, read_events, wait_for

TRAINER = textwrap.dedent("""
    import os, time
    import ftagent
    for i in range(1, 41):
        ftagent.step(i, loss=1.0 / i, samples=32, tokens=4096)
        if i == 20:
            with ftagent.phase("checkpoint"):
                time.sleep(0.3)
        ftagent.collective("all_reduce", 8 << 20, 0.01, 4)
        time.sleep(0.02)
    open(os.environ["DONE"], "w").close()
    while True:          # silent hang: no SDK step, no log line
        time.sleep(1)
""")


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_sdk_progress_metrics_and_hang(tmp_path: Path) -> None:
    events = tmp_path / "ev.jsonl"
    done = tmp_path / "done"
    agent = popen(ftagent_cmd("--progress", "sdk", "--metrics-port", "0",
                              "--metrics-addr", "127.0.0.1", "--hang-timeout-min", "1",
                              "--hang-action", "alert", "--events-file", str(events),
                              cmd=[PY, "-c", TRAINER]),
                  env={"DONE": str(done)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = wait_for(lambda: next((e["metrics_port"] for e in read_events(events)
                                      if e.get("kind") == "metrics"), None), 30, "port")
        wait_for(done.exists, 60, "trainer done stepping")
        text = wait_for(lambda: (t := scrape(port)) and value(t, "ftagent_training_step") == 40
                        and t, 10, "step 40 in /metrics")
        assert value(text, "ftagent_training_loss") == 1.0 / 40
        assert value(text, "ftagent_training_samples_total") == 32 * 40
        assert value(text, "ftagent_training_tokens_total") == 4096 * 40
        assert 'ftagent_phase_duration_seconds_count{' in text and 'phase="checkpoint"' in text
        assert (value(text, "ftagent_step_duration_seconds_count") or 0) > 20
        busbw = [ln for ln in text.splitlines()
                 if ln.startswith("ftagent_collective_busbw_bytes_per_second{")]
        assert busbw and float(busbw[0].rsplit(" ", 1)[1]) == (8 << 20) / 0.01 * 2 * 3 / 4
        fault = wait_for(lambda: [e for e in read_events(events)
                                  if e["event"] == "fault" and e["kind"] == "hang"],
                         30, "hang fault")[0]
        assert fault["last_step"] == 40
        assert value(scrape(port), "ftagent_hang") == 1.0
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
