"""The GPU source (sources/gpu.py) on the simulated NVML: its threads, its poll, its calls.

The source's code is the same on a GPU node; only ``factory`` differs (pynvml itself)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ftagent.config import GpuConfig
from ftagent.detect.gpu import GpuDetector
from ftagent.metrics import GpuCollector
from ftagent.model import Fault, GpuEvent, GpuHealth, Observation
from ftagent.sources.gpu import GpuSource, open_backend
from tests.conftest import until


def aio(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """An async test run on its own loop (fixtures pass through)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))
    return run


LABELS = {"job_name": "j", "namespace": "", "pod": "p", "node": "n", "rank": "0"}


class Run:
    def __init__(self, source: GpuSource, detector: GpuDetector) -> None:
        self.source = source
        self.detector = detector
        self.observed: list[Observation] = []
        self.faults: list[Fault] = []

    def emit(self, obs: Observation) -> None:
        self.observed.append(obs)
        self.faults += self.detector.observe(obs)

    def events(self, kind: str) -> list[GpuEvent]:
        return [o for o in self.observed if isinstance(o, GpuEvent) and o.kind == kind]

    def metrics(self) -> str:
        reg = CollectorRegistry()
        reg.register(GpuCollector(LABELS, self.source.readings, self.detector.xid_counts,
                                  self.detector.healthy, lambda: dict(self.source.event_counts)))
        return generate_latest(reg).decode()


@asynccontextmanager
async def running(tmp_path: Path, timeline: str, env: dict[str, str] | None = None,
                  **cfg: object) -> AsyncIterator[Run]:
    path = tmp_path / "gpus.txt"
    path.write_text(timeline)
    gcfg = GpuConfig(gpu_backend=f"simulated:{path}", gpu_poll_interval=0.05,
                     **cfg)  # type: ignore[arg-type]
    factory, feed = open_backend(gcfg)
    source = GpuSource(gcfg, env or {}, factory, feed)
    run = Run(source, GpuDetector(devices=source.device))
    task = asyncio.create_task(source.run(run.emit))
    try:
        await until(source.ready.is_set, 5, "the GPU source to start")
        yield run
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# the source's own threads (sources/gpu.py, kmsg.py, gpu_sim.py); not every "ftagent-"
# thread: a test run before this one in the same xdist worker may leave its own (a
# preflight's compute check that never finishes, a snapshot pool), which is not this source's
GPU_THREADS = ("ftagent-nvml-events", "ftagent-kmsg", "ftagent-kmsg-sim")


def gpu_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in GPU_THREADS]


@aio
async def test_an_xid_from_nvml_and_the_kernel_log_is_one_fault(tmp_path: Path) -> None:
    async with running(tmp_path, "gpus 2\nt=100ms gpu=1 xid=79\n") as run:
        await until(lambda: len(run.events("xid")) == 2, 5, "the Xid from both paths")
        assert {e.source for e in run.events("xid")} == {"nvml", "kmsg"}
        assert len(run.faults) == 1 and "Xid 79" in run.faults[0].message
        assert run.detector.xid_counts() == {(1, 79): 1}
        assert run.source.registered[1][:3] == ["xid", "ecc_dbe", "ecc_sbe"]
        text = run.metrics()
        assert 'ftagent_gpu_xid_errors_total{UUID="GPU-00000000-0000-4000-8000-000000000001"' \
            in text
        assert 'gpu="1",job_name="j",modelName="NVIDIA H100 80GB HBM3",namespace="",node="n",' \
            'pci_bus_id="00000000:2A:00.0",pod="p",rank="0",xid="79"} 1.0' in text
        assert 'ftagent_gpu_healthy{UUID="GPU-00000000-0000-4000-8000-000000000001"' in text
    assert gpu_threads() == []  # both threads stopped with the source


@aio
async def test_gpu_lost_mid_run_is_a_fault_of_its_own(tmp_path: Path) -> None:
    async with running(tmp_path, "gpus 2\nt=150ms gpu=0 lost\n") as run:
        await until(lambda: run.events("lost"), 5, "the lost GPU")
        polls = len([o for o in run.observed if isinstance(o, GpuHealth) and o.gpu == 1])
        await until(lambda: len([o for o in run.observed if isinstance(o, GpuHealth)
                                 and o.gpu == 1]) > polls + 2, 5, "more polls")
        assert len(run.events("lost")) == 1  # reported once, then the GPU is left alone
        (fault,) = run.faults
        assert fault.scope.value == "node" and "GPU is lost" in fault.message
        assert not [o for o in run.observed if isinstance(o, GpuHealth) and o.gpu == 0
                    and o.ts > run.events("lost")[0].ts]
        assert 'ftagent_gpu_healthy{UUID="GPU-00000000-0000-4000-8000-000000000000"' \
            in run.metrics()
        assert "} 0.0" in [ln for ln in run.metrics().splitlines()
                           if ln.startswith("ftagent_gpu_healthy") and 'gpu="0"' in ln][0]


@aio
async def test_ecc_counter_increase_and_remap_from_the_poll(tmp_path: Path) -> None:
    timeline = ("device gpu=0 unsupported=nvmlDeviceRegisterEvents\n"  # poll only
                "t=100ms gpu=0 ecc_dbe+=3\nt=100ms gpu=0 remap_pending=1\n")
    async with running(tmp_path, timeline) as run:
        await until(lambda: len(run.faults) == 2, 5, "the ECC and remap faults")
        causes = sorted(f.evidence["cause"] for f in run.faults)
        assert causes == ["ecc_dbe", "remap_pending"]
        assert run.source.registered == {}  # no events: polling found them
        text = run.metrics()
        assert 'type="uncorrected"} 3.0' in text
        assert "ftagent_gpu_row_remap_pending{" in text


@aio
async def test_not_supported_calls_are_turned_off_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    timeline = ("device gpu=0 nvlinks=0 unsupported=nvmlDeviceGetRemappedRows,"
                "nvmlDeviceGetCurrentClocksEventReasons,NVML_FI_DEV_GET_GPU_RECOVERY_ACTION\n")
    with caplog.at_level(logging.INFO, "ftagent"):
        async with running(tmp_path, timeline) as run:
            await until(lambda: len([o for o in run.observed if isinstance(o, GpuHealth)]) > 3,
                        5, "a few polls")
            text = run.metrics()
    calls = run.source.calls
    for name in ("nvmlDeviceGetRemappedRows", "nvmlDeviceGetCurrentClocksEventReasons",
                 "nvmlDeviceGetNvLinkState"):
        assert calls[(0, name)] == "not supported", name
    assert calls[(0, "nvmlDeviceGetRetiredPagesPendingStatus")] == "ok"  # the fallback
    assert calls[(0, "nvmlDeviceGetTotalEccErrors")] == "ok"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "ftagent_gpu_row_remap_pending" not in text and "ftagent_gpu_retired_pages{" in text
    assert "ftagent_gpu_temperature_celsius{" in text


@aio
async def test_no_driver_is_one_line_and_the_source_ends(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "ftagent"):
        async with running(tmp_path, "driver missing\n") as run:
            pass
    lines = [r.getMessage() for r in caplog.records if "GPU watch off" in r.getMessage()]
    assert len(lines) == 1 and "NVMLError_LibraryNotFound" in lines[0], lines
    assert run.source.off_reason and run.observed == []


@aio
async def test_no_gpu_for_this_trainer(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                       ) -> None:
    with caplog.at_level(logging.INFO, "ftagent"):
        async with running(tmp_path, "gpus 2\n", env={"CUDA_VISIBLE_DEVICES": ""}) as run:
            pass
    assert "no GPU for this trainer (CUDA_VISIBLE_DEVICES=; NVML shows 2)" in caplog.text
    assert run.source.gpus == [] and gpu_threads() == []


@aio
async def test_kernel_log_xids_of_other_gpus_are_not_ours(tmp_path: Path) -> None:
    timeline = ("gpus 4\n"
                "t=50ms kmsg NVRM: Xid (PCI:0000:5d:00): 48, pid=1, name=x, DBE\n"  # GPU 3
                "t=60ms kmsg NVRM: Xid (PCI:0000:3a:00): 13, pid=1, name=x, SM\n")  # GPU 2
    async with running(tmp_path, timeline, env={"CUDA_VISIBLE_DEVICES": "2"}) as run:
        await until(lambda: run.source.feed is not None and run.source.feed.lines == 2, 5,
                    "both kernel-log lines")
        await until(lambda: run.events("xid"), 5, "GPU 2's Xid")
        await asyncio.sleep(0)  # let a (wrong) second hand-off drain, if there were one
        assert [(e.gpu, e.xid) for e in run.events("xid")] == [(2, 13)]


@aio
async def test_kmsg_path_is_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    async with running(tmp_path, "gpus 1\n", kmsg=str(fifo)) as run:
        fd = os.open(fifo, os.O_WRONLY)
        try:
            os.write(fd, b"NVRM: Xid (PCI:0000:18:00): 95, pid=1, name=x, Uncontained\n" * 1000)
            await until(lambda: sum(e.count for e in run.events("xid")) == 1000, 5,
                        "1,000 Xid lines")
        finally:
            os.close(fd)
        assert len(run.faults) == 1 and run.detector.xid_counts() == {(0, 95): 1000}
        assert len(run.events("xid")) < 1000  # merged on the way to the loop
