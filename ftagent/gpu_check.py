"""``make gpu-check``: run the real NVML GPU source for a while and say what worked.

``python -m ftagent.gpu_check [--seconds 30] [--gpu-backend nvml|simulated:FILE]``
builds the GPU part the agents build (watch/gpu.py: the same ``GpuSource`` and Xid
detector; default: the real NVML through nvidia-ml-py), runs it in the same watch loop
(watch/loop.py), and prints:

* the driver, the GPUs NVML shows and the ones this process may use (and why: the
  ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES`` rules), with index, UUID, PCI bus id,
  model and MIG devices;
* per GPU, the NVML event types registered, and whether the kernel log is read;
* every NVML event, health sample change and fault seen during ``--seconds``;
* per GPU, each NVML call the source makes and its outcome: ``ok``, ``not supported``
  (turned off for that GPU, as the agent does) or the error;
* the Prometheus samples the GPU collector produces.
* preflight's device-memory and compute check (agent/preflight.py ``compute_check``: on
  real NVML ``agent/compute_probe.py`` in a child where torch with CUDA is importable,
  else said to have no compute path); it does not change the exit status.

With ``--accelerator ascend|kunlunxin`` (``make gpu-check ACCELERATOR=ascend``) it runs
the vendor source instead (sources/accel.py: ``npu-smi`` / ``xpu-smi``, or their
simulators with ``--gpu-backend simulated:FILE``) and prints the tool's driver, the
devices it shows and the ones this process may use (``ASCEND_VISIBLE_DEVICES`` /
``ASCEND_RT_VISIBLE_DEVICES``, ``XPU_VISIBLE_DEVICES``), every event and fault, how many
tool calls were made and what each device's last sample said, and the metrics.

Exit status 0 when NVML (or the vendor tool) was usable and at least one device was
watched, 1 when not (no library or tool, no driver, no permission, no device for this
process), 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

from prometheus_client import CollectorRegistry, generate_latest

from ftagent.config import GpuConfig
from ftagent.detect.accel import code_label
from ftagent.model import Fault, GpuEvent, GpuHealth, Observation
from ftagent.sources.accel import VendorSource
from ftagent.sources.gpu import GpuSource
from ftagent.sources.vendor_tool import TOOL_TIMEOUT
from ftagent.waits import until_set
from ftagent.watch import gpu as gpu_part
from ftagent.watch.context import WatchContext
from ftagent.watch.gpu import GpuWatch
from ftagent.watch.loop import WatchLoop


async def check(cfg: GpuConfig, seconds: float, out: TextIO) -> int:
    def say(text: str = "") -> None:
        out.write(text + "\n")
        out.flush()

    watch = gpu_part.build(WatchContext(cfg, environ=os.environ, trainer_environ=os.environ))
    if watch is None:
        say("--gpu-backend none: nothing to check")
        return 1
    if watch.accelerator != "nvidia":
        return await check_vendor(cfg, watch, seconds, say)
    source = watch.source
    assert isinstance(source, GpuSource)
    seen: list[Observation] = []
    last_health: dict[int, GpuHealth] = {}
    started = time.monotonic()

    def emit(obs: Observation) -> None:
        seen.append(obs)
        at = f"[+{time.monotonic() - started:6.2f}s]"
        if isinstance(obs, GpuEvent):
            say(f"{at} event: GPU {obs.gpu} {obs.kind} xid={obs.xid} from {obs.source} "
                f"x{obs.count} {obs.detail[:100]}")
        elif isinstance(obs, GpuHealth):
            before = last_health.get(obs.gpu)
            if before is None or before.__dict__ | {"ts": 0} != obs.__dict__ | {"ts": 0}:
                say(f"{at} health: {obs}")
            last_health[obs.gpu] = obs

    task = asyncio.create_task(loop_of(watch, emit, started, say).run())
    await source.ready.wait()
    if source.off_reason or not source.gpus:
        say(f"NVML could not be used: {source.off_reason or 'no GPU'}")
        await stop(task)
        return 1
    nvml = source.nv.nvml
    driver = nvml.nvmlSystemGetDriverVersion() if nvml is not None else "?"
    say(f"driver {driver}; {len(source.gpus)} GPU(s) watched:")
    for g in source.gpus:
        d = g.dev
        say(f"  GPU {d.index}: {d.name}, {d.uuid}, PCI {d.pci_bus_id}"
            + (f", MIG {', '.join(d.mig)}" if d.mig else "")
            + f"; NVLink links {list(g.links) or 'none'}")
        say(f"    events registered: {', '.join(source.registered.get(d.index, [])) or 'none'}")
    say(f"kernel log: {source.feed.path if source.feed is not None else 'not read'}")
    from ftagent.agent.preflight import compute_check

    r = await compute_check(source, 10.0)  # preflight's (agent/compute_probe.py on CUDA)
    say(f"compute check: {'skipped' if r.skipped else 'passed' if r.ok else 'FAILED'} in "
        f"{r.seconds:.1f}s" + (f": {r.detail}" if r.detail else ""))
    say(f"running for {seconds:g}s (poll every {cfg.gpu_poll_interval:g}s)...")
    await asyncio.sleep(seconds)
    registry = CollectorRegistry()
    registry.register(watch.collector({"job_name": "gpu-check"}))
    metrics = generate_latest(registry).decode()
    for g in source.gpus:  # the calls the poll makes only when needed: try each once
        for link in g.links[:1]:
            source.nv.call(g, "nvmlDeviceGetNvLinkErrorCounter", link, 0)
        source.nv.call(g, "nvmlDeviceGetRetiredPagesPendingStatus")
    await stop(task)
    polls = len([o for o in seen if isinstance(o, GpuHealth)])
    events = len([o for o in seen if isinstance(o, GpuEvent)])
    say(f"{polls} health samples, {events} GPU events")
    say("NVML calls:")
    for gpu in sorted({k[0] for k in source.calls}):
        for (index, call), outcome in sorted(source.calls.items()):
            if index == gpu:
                say(f"  GPU {gpu}  {call:45} {outcome}")
    say("metrics:")
    for line in metrics.splitlines():
        if line and not line.startswith("#"):
            say("  " + line)
    return 0


def loop_of(watch: GpuWatch, emit: Callable[[Observation], None], started: float,
            say: Callable[[str], None]) -> WatchLoop:
    """The watch loop over the one GPU part: ``emit`` prints each observation, then the
    detector's faults are printed (what the agents send to their deciders)."""

    def fault(f: Fault) -> None:
        say(f"[+{time.monotonic() - started:6.2f}s] FAULT ({f.severity.value}, "
            f"{f.scope.value}): {f.message}")

    return WatchLoop([watch], fault, observers=[emit])


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def check_vendor(cfg: GpuConfig, watch: GpuWatch, seconds: float,
                       say: Callable[[str], None]) -> int:
    """The vendor source for ``seconds``: devices, events, faults, samples, metrics."""
    accelerator = watch.accelerator
    source = watch.source
    assert isinstance(source, VendorSource) and source.backend is not None
    backend = source.backend
    started = time.monotonic()

    def emit(obs: Observation) -> None:
        at = f"[+{time.monotonic() - started:6.2f}s]"
        if isinstance(obs, GpuEvent):
            code = code_label(accelerator)(obs.xid) if obs.xid is not None else "-"
            say(f"{at} event: device {obs.gpu} {obs.kind} code={code} {obs.detail[:100]}")

    task = asyncio.create_task(loop_of(watch, emit, started, say).run())
    await source.ready.wait()
    if source.off_reason or not source.gpus:
        say(f"{backend.tool} could not be used: {source.off_reason or 'no device'}")
        await stop(task)
        return 1
    say(f"{accelerator}: {backend.tool}, driver {source.driver or '?'}; "
        f"{len(source.gpus)} device(s) watched:")
    for w in source.gpus:
        say(f"  device {w.dev.index}: {w.dev.name}, serial {w.dev.uuid or '?'}, "
            f"bus {w.dev.pci_bus_id or '?'}")
    say(f"running for {seconds:g}s (poll every {cfg.gpu_poll_interval:g}s)...")
    await asyncio.sleep(seconds)
    # at least one whole poll, however slow the tool
    if not await until_set(source.polled, 4 * TOOL_TIMEOUT):
        say(f"no poll finished in {4 * TOOL_TIMEOUT:g}s")
    await stop(task)
    runs = getattr(getattr(backend, "cmd", None), "runs", 0)
    say(f"{runs} {backend.tool} calls")
    for r in source.readings():
        say(f"  device {r.gpu}: lost={r.lost} temperature={r.temperature_celsius} "
            f"power={r.power_watts} utilization={r.utilization} "
            f"memory={r.memory_used_bytes}/{r.memory_total_bytes}")
    registry = CollectorRegistry()
    registry.register(watch.collector({"job_name": "gpu-check"}))
    say("metrics:")
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            say("  " + line)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ftagent.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--gpu-backend", default="nvml", help="nvml (default) or simulated:FILE")
    ap.add_argument("--gpu-poll-interval", type=float, default=5.0)
    ap.add_argument("--kmsg", default="auto")
    ap.add_argument("--accelerator", default=os.environ.get("FTAGENT_ACCELERATOR", "nvidia"),
                    choices=("auto", "nvidia", "ascend", "kunlunxin"),
                    help="nvidia (default; NVML), ascend (npu-smi), kunlunxin (xpu-smi), "
                    "or auto (what this machine has)")
    args = ap.parse_args(argv)
    if not 0 <= args.seconds <= 3600 or not 0.05 <= args.gpu_poll_interval <= 3600:
        ap.error("--seconds in [0, 3600] and --gpu-poll-interval in [0.05, 3600]")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[gpu-check %(asctime)s] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    backend = args.gpu_backend
    if args.accelerator in ("ascend", "kunlunxin", "auto") and backend == "nvml":
        backend = "auto"  # the vendor's tool (nvml is NVIDIA's)
    cfg = GpuConfig(gpu_backend=backend, gpu_poll_interval=args.gpu_poll_interval,
                    kmsg=args.kmsg, accelerator=args.accelerator)
    try:
        return asyncio.run(check(cfg, args.seconds, sys.stdout))
    except ValueError as e:  # a malformed simulated:FILE (ConfigError)
        sys.stderr.write(f"gpu-check: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
