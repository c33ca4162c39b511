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
        text = scrape(port)
        assert value(text, "ftagent_hang") == 1.0  # declared (verified hung)
        assert value(text, "ftagent_hang_suspected") == 0.0
        # from the budget's expiry to the fault: a tick (0.5 s) and the stacks, at most
        assert value(text, "ftagent_detection_latency_seconds_count") == 1
        assert 'kind="hang"' in next(ln for ln in text.splitlines()
                                     if ln.startswith("ftagent_detection_latency_seconds_count"))
        assert 0 <= (value(text, "ftagent_detection_latency_seconds_sum") or -1) < 5
        assert "_created" not in text
        assert value(text, "ftagent_sdk_datagrams_received_total") == 40 * 2 + 2
        assert 'ftagent_sdk_datagrams_dropped_total{' in text
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)


RESTARTED = textwrap.dedent("""
    import os, time
    attempt = int(os.environ["FTAGENT_RESTART_COUNT"])
    if attempt == 0:
        print("step=10 loss=0.5000 samples_per_second=100.0", flush=True)
        while not os.path.exists(os.environ["GO"]):
            time.sleep(0.01)
        raise SystemExit(3)
    open(os.environ["DONE"], "w").close()
    while True:          # the second attempt has not reported a step yet
        time.sleep(1)
""")


def test_crash_latency_and_progress_reset_on_restart(tmp_path: Path) -> None:
    events = tmp_path / "ev.jsonl"
    go, done = tmp_path / "go", tmp_path / "done"
    agent = popen(ftagent_cmd("--metrics-port", "0", "--metrics-addr", "127.0.0.1",
                              "--max-restarts", "1", "--restart-backoff", "0",
                              "--events-file", str(events), cmd=[PY, "-c", RESTARTED]),
                  env={"GO": str(go), "DONE": str(done)},
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = wait_for(lambda: next((e["metrics_port"] for e in read_events(events)
                                      if e.get("kind") == "metrics"), None), 30, "port")
        wait_for(lambda: value(scrape(port), "ftagent_training_step") == 10, 30, "step 10")
        text = scrape(port)
        assert value(text, "ftagent_training_samples_per_second") == 100.0
        go.touch()
        wait_for(done.exists, 30, "the second attempt")
        text = wait_for(lambda: (t := scrape(port)) and
                        value(t, "ftagent_restarts_total") == 1 and t, 10, "the restart")
        for name in ("ftagent_training_step", "ftagent_training_loss",
                     "ftagent_training_samples_per_second"):
            assert value(text, name) is None, name  # not the first attempt's values
        assert value(text, "ftagent_trainer_running") == 1
        # the lifecycle's, read at scrape time: the first attempt's exit, the new generation
        assert value(text, "ftagent_trainer_last_exit_code") == 3
        assert value(text, "ftagent_job_generation") == 1
        count = [ln for ln in text.splitlines()
                 if ln.startswith("ftagent_detection_latency_seconds_count{")]
        assert len(count) == 1 and 'kind="crash"' in count[0] and count[0].endswith(" 1.0")
        # the exit → the fault, after draining the output: well under the 2 s drain cap
        assert 0 <= (value(text, "ftagent_detection_latency_seconds_sum") or -1) < 2.5
        assert "_created" not in text
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
