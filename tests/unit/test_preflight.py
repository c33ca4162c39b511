"""Preflight: the pure verdict (detect/preflight.py) and the checks at the edge
(agent/preflight.py) against the simulated NVML, a real directory, and a probe that hangs."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ftagent.agent.preflight import Preflight, TimedOut, in_thread, storage_probe
from ftagent.config import GpuConfig
from ftagent.detect.preflight import CheckResult, budgets, fault_of, verdict
from ftagent.model import FaultKind, NicStats, Scope, Severity
from ftagent.sources import gpu_script
from ftagent.sources.gpu import GpuSource
from ftagent.sources.gpu_sim import SimulatedNvml


def test_all_passing_or_skipped_passes_and_reports_the_longest_check() -> None:
    v = verdict([CheckResult("nic", True, 0.2), CheckResult("accelerator", True, 0.5),
                 CheckResult("storage", True, 0.0, "none", skipped=True)])
    assert v.ok and v.reason == "" and v.failed == () and v.seconds == 0.5


def test_a_failure_and_a_timeout_are_named_in_check_order() -> None:
    v = verdict([CheckResult("storage", False, 5.0, "did not answer within 5s",
                             timed_out=True),
                 CheckResult("accelerator", False, 0.1, "GPU 0 is lost")])
    assert not v.ok and v.failed == ("accelerator", "storage")
    assert v.reason == ("preflight failed: accelerator: GPU 0 is lost; storage: did not "
                        "answer within 5s")
    f = fault_of(v, 3)
    assert (f.kind, f.severity, f.scope) == (FaultKind.GPU, Severity.FATAL, Scope.NODE)
    assert f.evidence["preflight"] is True and f.evidence["generation"] == 3
    nic = fault_of(verdict([CheckResult("nic", False, 0.0, "eth0 is down")]), 1)
    assert (nic.kind, nic.scope) == (FaultKind.NODE, Scope.POD)  # never cordons a node
    assert fault_of(v, 3).id != f.id  # a new fault every time (a new pod: decided again)


def test_odd_values_stay_bounded() -> None:
    v = verdict([CheckResult("nic", False, float("nan"), "x" * 10_000)])
    assert v.seconds == 0.0 and len(v.reason) < 400
    assert budgets(fast=True)["accelerator"] < budgets(fast=False)["accelerator"]


def test_a_probe_that_hangs_is_abandoned_at_its_budget() -> None:
    gate = threading.Event()

    async def body() -> float:
        t0 = time.monotonic()
        with pytest.raises(TimedOut):
            await in_thread(gate.wait, 0.3)
        return time.monotonic() - t0

    try:
        took = asyncio.run(body())
    finally:
        gate.set()
    assert 0.25 <= took < 2.0


@dataclass
class Dev:
    index: int = 0
    uuid: str = "GPU-x"
    pci_bus_id: str = "0000:18:00.0"


@dataclass
class Hung:
    dev: Dev = field(default_factory=Dev)
    handle: Any = None
    lost: bool = False


class HangingNvml:
    def __init__(self) -> None:
        self.gate = threading.Event()

    def nvmlDeviceGetUUID(self, handle: Any) -> str:  # noqa: N802 - pynvml's name
        self.gate.wait()
        return "GPU-x"


class Part:
    def __init__(self, name: str, source: Any) -> None:
        self.name, self.source = name, source


class Watch:
    def __init__(self, *parts: Part) -> None:
        self.parts = list(parts)


def test_an_accelerator_that_hangs_fails_within_its_budget_not_forever() -> None:
    nvml = HangingNvml()

    class Source:
        ready = asyncio.Event()
        gpus = [Hung()]

        class nv:  # noqa: N801 - the shape of GpuSource.nv
            pass

    Source.nv.nvml = nvml  # type: ignore[attr-defined]

    async def body() -> Any:
        Source.ready.set()
        return await Preflight(Watch(Part("gpu", Source()))).run(warm=True)

    t0 = time.monotonic()
    try:
        v = asyncio.run(body())
    finally:
        nvml.gate.set()
    assert time.monotonic() - t0 < budgets(fast=True)["accelerator"] + 1.5
    assert not v.ok and v.failed == ("accelerator",)
    assert "did not answer within 2s" in v.reason


def test_a_lost_simulated_gpu_fails_and_a_healthy_one_passes(tmp_path: Path) -> None:
    script = tmp_path / "gpus.txt"
    script.write_text("gpus 2\nt=300ms gpu=1 lost\n")
    sim = SimulatedNvml(gpu_script.load(str(script)))
    source = GpuSource(GpuConfig(gpu_backend=f"simulated:{script}"), {}, lambda: sim)

    async def body() -> tuple[Any, Any]:
        assert await asyncio.get_running_loop().run_in_executor(None, source._start)
        source.ready.set()
        pre = Preflight(Watch(Part("gpu", source)))
        first = await pre.run()
        await asyncio.sleep(0.4)  # noqa: ASYNC110 -- the script's clock: past t=300ms
        return first, await pre.run()

    try:
        first, second = asyncio.run(body())
    finally:
        source.stop()
    assert first.ok, first.reason
    assert not second.ok and "GPU 1" in second.reason and "GpuIsLost" in second.reason
    assert second.failed == ("accelerator",)


def test_no_watch_skips_and_a_link_down_fails() -> None:
    class Nic:
        ready = None

        def __init__(self, links: list[NicStats]) -> None:
            self.links = links

        def snapshot(self) -> list[NicStats]:
            return self.links

    up = NicStats("eth0", True, True, 0, 0, 0, 0.0, 0.0)
    down = NicStats("eth1", True, False, 0, 0, 0, 0.0, 0.0)
    assert asyncio.run(Preflight().run()).ok
    assert asyncio.run(Preflight(Watch(Part("nic", Nic([up])))).run()).ok
    named = Nic([up, down])
    named.selection = Selection("--nic eth0,eth1")  # type: ignore[attr-defined]
    v = asyncio.run(Preflight(Watch(Part("nic", named))).run())
    assert not v.ok and v.reason == "preflight failed: nic: eth1 is without carrier"
    # links the watch guessed (none named): one down is not the job's path down; all are
    guessed = Nic([up, down])
    guessed.selection = Selection("links up at start")  # type: ignore[attr-defined]
    assert asyncio.run(Preflight(Watch(Part("nic", guessed))).run()).ok
    guessed.links = [down]
    assert not asyncio.run(Preflight(Watch(Part("nic", guessed))).run()).ok


@dataclass
class Selection:
    why: str


def test_storage_writable_passes_missing_or_read_only_fails(tmp_path: Path) -> None:
    assert storage_probe(str(tmp_path))() == ""
    assert list(tmp_path.iterdir()) == []  # its probe file removed
    assert "is not a directory" in storage_probe(str(tmp_path / "nope"))()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        assert "not writable" in storage_probe(str(ro))()
    finally:
        ro.chmod(0o700)


def test_the_checks_run_together_within_the_slowest_budget(tmp_path: Path) -> None:
    v = asyncio.run(Preflight(None, str(tmp_path)).run())
    assert v.ok and {r.name for r in v.results} == {"accelerator", "nic", "storage", "peer",
                                                     "compute"}


def test_a_link_that_flaps_back_within_the_budget_passes() -> None:
    class Flapping:
        ready = None
        selection = Selection("--nic eth0")

        def __init__(self) -> None:
            self.calls = 0

        def snapshot(self) -> list[NicStats]:
            self.calls += 1
            up = self.calls > 3  # down for the first looks, then back
            return [NicStats("eth0", True, up, 0, 0, 0, 0.0, 0.0)]

    src = Flapping()
    v = asyncio.run(Preflight(Watch(Part("nic", src))).run(warm=True))
    assert v.ok and src.calls == 4


def test_a_failed_or_pending_row_remap_fails_the_memory_check(tmp_path: Path) -> None:
    """The device-memory check through NVML (memory_state): a GPU whose row remap is
    pending needs a reset before a job uses it, one whose remap failed a replacement."""
    script = tmp_path / "gpus.txt"
    script.write_text("gpus 2\nt=200ms gpu=1 remap_pending=1\nt=400ms gpu=0 remap_failure=1\n")
    sim = SimulatedNvml(gpu_script.load(str(script)))
    source = GpuSource(GpuConfig(gpu_backend=f"simulated:{script}"), {}, lambda: sim)

    async def body() -> list[Any]:
        assert await asyncio.get_running_loop().run_in_executor(None, source._start)
        source.ready.set()
        pre = Preflight(Watch(Part("gpu", source)))
        out = [await pre.run()]
        await asyncio.sleep(0.25)  # noqa: ASYNC110 -- the script's clock: past t=200ms
        out.append(await pre.run())
        await asyncio.sleep(0.25)  # noqa: ASYNC110 -- past t=400ms
        out.append(await pre.run())
        return out

    try:
        clean, pending, failed = asyncio.run(body())
    finally:
        source.stop()
    assert clean.ok, clean.reason
    assert not pending.ok and "GPU 1" in pending.reason
    assert "a row remap is pending (the GPU needs a reset" in pending.reason
    assert not failed.ok and "GPU 0" in failed.reason and "a row remap failed" in failed.reason


def test_the_peer_probe_passes_a_refusal_or_a_listener_and_skips_rank_0() -> None:
    from ftagent.agent.preflight import peer_probe, rendezvous

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        assert peer_probe("127.0.0.1", srv.getsockname()[1], 1.0)() == ""
    with socket.socket() as s:  # a port nobody listens on: the host answered (refused)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert peer_probe("127.0.0.1", port, 1.0)() == ""
    assert peer_probe("no-such-host.invalid", port, 1.0)() == ""  # said, not failed
    env = {"MASTER_ADDR": "llm-master-0.llm", "MASTER_PORT": "29500"}
    assert rendezvous(env, 1) == ("llm-master-0.llm", 29500)
    assert rendezvous(env, 0) is None  # the master itself
    for bad in ({"MASTER_ADDR": "x"}, {**env, "MASTER_PORT": "99999"},
                {**env, "MASTER_ADDR": "localhost"}, {**env, "MASTER_PORT": "2e3"}):
        assert rendezvous(bad, 3) is None


def test_a_pod_with_no_route_to_its_rendezvous_fails_the_peer_check() -> None:
    """In a network namespace with only its loopback up (a pod whose network is gone):
    the connect fails with ENETUNREACH at once, no packet leaves, the check fails and
    names the address."""
    from tests.netns import ip, namespaces, require_netns

    require_netns()
    code = ("from ftagent.agent.preflight import peer_probe; "
            "print(repr(peer_probe('10.255.255.1', 29500, 1.0)()))")
    with namespaces(1) as (ns,):
        ip("-n", ns, "link", "set", "lo", "up")
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no route from this pod to 10.255.255.1:29500" in r.stdout, r.stdout


def test_the_peer_check_runs_with_the_others_and_its_failure_is_the_pods() -> None:
    v = verdict([CheckResult("peer", False, 0.01, "no route from this pod to m:1 (x)")])
    assert not v.ok and v.failed == ("peer",) and "peer: no route" in v.reason
    f = fault_of(v, 3)
    assert f.kind is FaultKind.NODE and f.scope is Scope.POD  # never cordons on it
    assert budgets(fast=True)["peer"] <= budgets(fast=False)["peer"]


def _sim_source(tmp_path: Path, text: str) -> tuple[Any, Any]:
    script = tmp_path / "gpus.txt"
    script.write_text(text)
    sim = SimulatedNvml(gpu_script.load(str(script)))
    return sim, GpuSource(GpuConfig(gpu_backend=f"simulated:{script}"), {}, lambda: sim)


def test_a_device_that_computes_wrong_fails_cold_and_is_skipped_on_a_warm_restart(
        tmp_path: Path) -> None:
    """The device-memory and compute check through the simulated NVML (compute=wrong):
    a cold start fails it as a GPU fault of the node; a warm restart skips it (fast)."""
    _, source = _sim_source(tmp_path, "gpus 2\nt=0s gpu=1 compute=wrong\n")

    async def body() -> tuple[Any, Any]:
        assert await asyncio.get_running_loop().run_in_executor(None, source._start)
        source.ready.set()
        pre = Preflight(Watch(Part("gpu", source)))
        return await pre.run(), await pre.run(warm=True)

    try:
        cold, warm = asyncio.run(body())
    finally:
        source.stop()
    assert not cold.ok and cold.failed == ("compute",)
    assert "compute: device 1: compute: a 256x256 matmul of ones is wrong" in cold.reason
    f = fault_of(cold, 0)
    assert f.kind is FaultKind.GPU and f.scope is Scope.NODE
    assert warm.ok, warm.reason
    (skipped,) = [r for r in warm.results if r.name == "compute"]
    assert skipped.skipped and "warm restart" in skipped.detail


def test_a_compute_check_that_hangs_fails_within_its_budget(tmp_path: Path,
                                                             monkeypatch: Any) -> None:
    import ftagent.agent.preflight as pf
    _, source = _sim_source(tmp_path, "gpus 1\nt=0s gpu=0 compute=hang\n")
    monkeypatch.setattr(pf, "budgets", lambda fast: {**budgets(fast), "compute": 0.5})

    async def body() -> Any:
        assert await asyncio.get_running_loop().run_in_executor(None, source._start)
        source.ready.set()
        return await Preflight(Watch(Part("gpu", source))).run()

    t0 = time.monotonic()
    try:
        v = asyncio.run(body())
    finally:
        source.stop()
    assert time.monotonic() - t0 < 3.0
    assert not v.ok and v.failed == ("compute",) and "did not answer within" in v.reason


def test_no_compute_path_is_said_not_failed() -> None:
    """A backend that is neither pynvml nor a simulator (a vendor tool): skipped, said so."""
    class Vendor:
        tool = "npu-smi"

    @dataclass
    class Src:
        gpus: list[Any] = field(default_factory=lambda: [Hung()])
        backend: Any = field(default_factory=Vendor)
        ready: Any = None

    async def body() -> Any:
        s = Src()
        s.ready = asyncio.Event()
        s.ready.set()
        return await Preflight(Watch(Part("gpu", s)))._compute(1.0)

    r = asyncio.run(body())
    assert r.ok and r.skipped and r.detail == "no compute path through npu-smi (not checked)"


@pytest.mark.parametrize(("code", "ok", "skipped", "says"), [
    ('print(\'{"path": "none", "why": "torch sees no CUDA device"}\')', True, True,
     "no compute path: torch sees no CUDA device"),
    ('print(\'{"path": "cuda", "devices": [{"index": 0, "why": ""}, '
     '{"index": 1, "why": "memory: a pattern did not read back"}]}\')', False, False,
     "CUDA device 1: memory: a pattern did not read back"),
    ("import sys; sys.stderr.write('Segmentation fault\\n'); sys.exit(139)", False, False,
     "the compute probe exited with 139: Segmentation fault"),
    ("import time; print('{\"ready\": 1}', flush=True); time.sleep(30)", False, False,
     "did not answer within 3s"),
    ("import time; time.sleep(30)", True, True,  # torch still importing: not a device fault
     "no compute path within 3s: torch and CUDA were still starting"),
])
def test_the_compute_child_is_judged_by_its_line_and_killed_at_its_budget(
        code: str, ok: bool, skipped: bool, says: str) -> None:
    from ftagent.agent.preflight import compute_child
    t0 = time.monotonic()
    # 3 s: a loaded machine may take a second to start a Python that prints one line
    r = asyncio.run(compute_child(3.0, argv=[sys.executable, "-c", code]))
    assert (r.ok, r.skipped) == (ok, skipped) and says in r.detail, r
    assert time.monotonic() - t0 < 8.0


def test_the_compute_probe_itself_on_the_cpu() -> None:
    """compute_probe.py's checks run for real (torch on the CPU: the same code a GPU runs),
    and without CUDA it says there is no compute path."""
    from ftagent.agent import compute_probe
    got = compute_probe.run(1 << 20, "cpu")
    assert got == {"path": "cpu", "devices": [{"index": 0, "why": ""}]}
    assert compute_probe.run(1 << 20, "cuda") == {"path": "none",
                                                  "why": "torch sees no CUDA device"}


def test_the_simulator_refuses_an_unknown_compute_outcome(tmp_path: Path) -> None:
    script = tmp_path / "gpus.txt"
    script.write_text("gpus 1\nt=0s gpu=0 compute=slow\n")
    with pytest.raises(gpu_script.ScriptError, match="compute must be one of ok, wrong"):
        gpu_script.load(str(script))
