"""A real Prometheus server scrapes a real agent: the series arrive with their labels."""

from __future__ import annotations

import shutil
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import PY, free_port, ftagent_cmd, popen, prom_query, read_events, wait_for

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="prometheus missing: `make deps` installs Debian's prometheus package")


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    events = tmp_path / "events.jsonl"
    trainer = textwrap.dedent("""
        import time
        step = 0
        while True:
            step += 1
            print(f"step={step} loss={1/step:.4f} samples_per_second=100.0", flush=True)
            time.sleep(0.05)
    """)
    proc = popen(ftagent_cmd("--metrics-port", "0", "--metrics-addr", "127.0.0.1",
                             "--job", "promtest", "--rank", "3", "--world-size", "4",
                             "--events-file", str(events),
                             cmd=[PY, "-c", trainer]),
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port = wait_for(lambda: next((e["metrics_port"] for e in read_events(events)
                                  if e.get("kind") == "metrics"), None), 30, "metrics port")
    yield proc, port
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def test_prometheus_scrapes_agent_series(agent: tuple[subprocess.Popen[bytes], int],
                                         tmp_path: Path) -> None:
    _, port = agent
    prom_port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(textwrap.dedent(f"""
        global:
          scrape_interval: 1s
        scrape_configs:
          - job_name: ftagent   # no honor_labels: the training job is `job_name`
            static_configs:
              - targets: ["127.0.0.1:{port}"]
    """))
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        running = wait_for(lambda: prom_query(
            prom_port, 'ftagent_trainer_running{job_name="promtest"}', timeout=5), 60,
            "Prometheus to scrape the agent")
        labels = running[0]["metric"]
        assert labels["rank"] == "3" and labels["job_name"] == "promtest"
        # Prometheus' own `job` stays the scrape job: nothing of ours was renamed
        assert labels["job"] == "ftagent" and "exported_job" not in labels
        assert running[0]["value"][1] == "1"
        info = prom_query(prom_port, "ftagent_agent_info", timeout=5)
        assert info and info[0]["metric"]["version"]
    finally:
        prom.terminate()
        prom.wait(timeout=30)


# The dashboard's queries (parse, name exported series, return data from a real job):
# tests/integration/test_dashboard.py.
