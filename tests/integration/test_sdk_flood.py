"""A hostile trainer floods the real agent's SDK socket: the agent's series, its /metrics
and its memory stay bounded, and every bad datagram is counted by reason.

The trainer is ``bench/sdk_flood.py --trainer N`` (the benchmark runs it with 1,000,000):
unique phase and op names (some through the SDK itself), huge and negative numbers,
NaN and inf, unknown versions, malformed and oversize datagrams, names that are not
UTF-8. It sends with blocking sockets, so every datagram reaches the agent and the test
waits for the agent's own count."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from ftagent.sources.sdk_socket import DROP_REASONS
from ftagent.wire.limits import MAX_OPS, MAX_PHASES
from tests.conftest import PY, ROOT, ftagent_cmd, popen, read_events, wait_for
from tests.integration.test_sdk_agent import scrape

DATAGRAMS = 50_000


def samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            out[head[len(name):]] = float(value)
    return out


def label(key: str, name: str) -> str:
    return key.split(f'{name}="', 1)[1].split('"', 1)[0]


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def test_hostile_datagrams_leave_the_agent_bounded(tmp_path: Path) -> None:
    events, done = tmp_path / "ev.jsonl", tmp_path / "done.json"
    agent = popen(ftagent_cmd("--progress", "sdk", "--metrics-port", "0",
                              "--metrics-addr", "127.0.0.1", "--hang-action", "alert",
                              "--hang-timeout-min", "3600", "--log-level", "error",
                              "--events-file", str(events),
                              cmd=[PY, str(ROOT / "bench" / "sdk_flood.py"), "--trainer",
                                   str(DATAGRAMS)]),
                  env={"FLOOD_DONE": str(done)},
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = wait_for(lambda: next((e["metrics_port"] for e in read_events(events)
                                      if e.get("kind") == "metrics"), None), 30, "port")
        sent = wait_for(lambda: done.exists() and json.loads(done.read_text()), 120,
                        "the trainer to send everything")
        expected = sent["raw"] + sent["sdk"]
        assert sent["raw"] == DATAGRAMS and sent["sdk"] > 0
        text = wait_for(lambda: (t := scrape(port)) and sum(samples(
            t, "ftagent_sdk_datagrams_received_total").values()) == expected and t, 120,
                        f"the agent to read all {expected} datagrams")
        assert agent.poll() is None
        body = text.encode()
        assert len(body) <= 1024 * 1024
        lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
        assert len(lines) <= 2000
        phases = {label(k, "phase") for k in
                  samples(text, "ftagent_phase_duration_seconds_count")}
        ops = {label(k, "op") for k in samples(text, "ftagent_collective_duration_seconds_count")}
        assert len(phases) == MAX_PHASES + 1 and "other" in phases
        assert len(ops) == MAX_OPS + 1 and "other" in ops
        dropped = {label(k, "reason"): v for k, v in
                   samples(text, "ftagent_sdk_datagrams_dropped_total").items()}
        assert set(dropped) == set(DROP_REASONS)
        assert all(v > 0 for v in dropped.values()), dropped
        folded = {label(k, "label"): v for k, v in
                  samples(text, "ftagent_label_values_folded_total").items()}
        assert folded["phase"] > 0 and folded["op"] > 0 and folded["kind"] == 0
        # no timing asserted; memory only against unbounded growth (the bench has the goal)
        assert peak_rss(agent.pid) < 100 * 1024 * 1024
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
