"""The per-job exporter: series scraped from a real arbiter's /metrics for a job through a
crash and a restart in place, read from the registry at scrape time."""

from __future__ import annotations

import asyncio
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from ftagent.model import Fault, FaultKind
from tests.arbiter_helpers import ArbiterProcess, running_links, wait_until

_METRICS = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name.startswith("ftagent_job_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def job_series(got: dict[tuple[str, tuple[tuple[str, str], ...]], float], job: str,
               name: str, **labels: str) -> float:
    want = tuple(sorted({"job_name": job, "namespace": "", **labels}.items()))
    return got[(name, want)]


def test_job_series_through_a_crash_and_restart() -> None:
    async def body(arbiter: ArbiterProcess, port: int) -> None:
        async with running_links(arbiter.address, "exported", 3) as links:
            for lk in links:
                lk.arrive(0)
            assert all(await asyncio.gather(*(lk.wait_released(0, 5) for lk in links)))
            got = scrape(port)
            assert job_series(got, "exported", "ftagent_job_state", state="running") == 1
            assert job_series(got, "exported", "ftagent_job_state", state="starting") == 0
            assert job_series(got, "exported", "ftagent_job_seconds_lost_to_faults_total") == 0

            links[2].report_fault(Fault(FaultKind.CRASH, "segfault"), exit_status=139)
            for lk in links:
                assert (await asyncio.wait_for(lk.commands.get(), 5)).generation == 1
            got = scrape(port)
            assert job_series(got, "exported", "ftagent_job_state", state="restarting") == 1
            for lk in links:
                lk.arrive(1)
            assert all(await asyncio.gather(*(lk.wait_released(1, 5) for lk in links)))

            got = scrape(port)
            series = {(k[0], dict(k[1]).get("state") or dict(k[1]).get("kind") or
                       dict(k[1]).get("reason")): v for k, v in got.items()
                      if dict(k[1])["job_name"] == "exported"}
            assert series[("ftagent_job_state", "running")] == 1
            assert sum(v for (n, _), v in series.items() if n == "ftagent_job_state") == 1
            assert series[("ftagent_job_generation", None)] == 1
            assert series[("ftagent_job_restarts_total", "crash")] == 1
            assert series[("ftagent_job_ranks", "expected")] == 3
            assert series[("ftagent_job_ranks", "connected")] == 3
            assert series[("ftagent_job_ranks", "running")] == 3
            lost = series[("ftagent_job_seconds_lost_to_faults_total", None)]
            assert 0 < lost < 10

        def gone() -> bool:
            return job_series(scrape(port), "exported", "ftagent_job_ranks",
                              kind="connected") == 0
        await wait_until(gone, 10, "the agents to leave")
        got = scrape(port)
        assert job_series(got, "exported", "ftagent_job_state", state="gone") == 1
        assert job_series(got, "exported", "ftagent_job_ranks", kind="expected") == 3
        assert job_series(got, "exported", "ftagent_job_seconds_lost_to_faults_total") == lost

    with ArbiterProcess("--metrics-port", "0", "--metrics-addr", "127.0.0.1") as arbiter:
        asyncio.run(wait_until(lambda: bool(_METRICS.search(arbiter.log_text())), 10,
                               "the metrics port in the log"))
        m = _METRICS.search(arbiter.log_text())
        assert m is not None
        asyncio.run(body(arbiter, int(m.group(1))))
