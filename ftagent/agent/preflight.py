"""Preflight at the edge: the checks of detect/preflight.py, run before every (re)start.

Awaited by the worker before it arrives at the barrier of the generation it is about to
start (``WorkerParts.before_barrier``): the checks run together, each bounded by its
budget (detect/preflight.py's table: the fast one for a warm restart), so a preflight
never holds a start longer than its slowest budget. The verdict is pure; a failure is
raised as a fault (``fault_of``) through the worker, so the decider -- the arbiter, or the
local policy -- replaces this rank's pod before the barrier releases, instead of the
whole job restarting into a rank that fails again.

* accelerator: the watch's own devices (``watch/gpu.py``'s source). NVML, real or
  ``--gpu-backend simulated:FILE``: ``nvmlDeviceGetUUID`` and ``nvmlDeviceGetMemoryInfo``
  on every watched GPU, straight on the backend (not through the watch's call wrapper,
  whose "lost" is an event of its own); a vendor tool (Ascend, Kunlunxin): one sample of
  every device. A device the watch already knows lost fails at once. No accelerator
  watch, or one still starting when the budget is spent: skipped (never a failed start
  for a slow ``nvmlInit``).
* nic: the links the NIC watch watches (its netlink view), each up with carrier -- when
  the job names them (``--nic``, ``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``); when
  the watch guessed (every link up at start), only all of them down fails.
  The device memory too (``memory_state``): a row remap failed or pending, or a page
  retirement pending, fails -- the GPU needs a reset or a replacement before a job uses it.
* storage: ``--preflight-checkpoint-dir``: a small file written, fsynced, read back and
  removed.
* peer: a TCP connect to the job's rendezvous (``MASTER_ADDR:MASTER_PORT``, ranks other
  than 0): connected or refused passes, no route from this pod (ENETUNREACH) fails
  (``peer_probe``). Not built: a collective among the restarting ranks, an RDMA probe.
* compute (not on a warm restart): every device stores and reads back a pattern and
  computes a known answer. Real NVML cannot run a kernel: ``agent/compute_probe.py`` in a
  child process where torch is importable (the agent never imports it), killed at the
  budget; the simulated backends answer from their script (``compute=wrong|error|hang``);
  a vendor tool (npu-smi, xpu-smi) or no torch/CUDA: no compute path, skipped and said
  so in the result, never a failure.

A blocking call (NVML, a file system) runs in a daemon thread of its own: one that never
returns is abandoned at its budget (it cannot be interrupted) and never holds the agent's
exit, as a pool thread would.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.util
import json
import logging
import os
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ftagent.detect.preflight import CheckResult, Verdict, budgets, verdict
from ftagent.waits import until_set

log = logging.getLogger("ftagent.agent")

T = TypeVar("T")
PROBE_BYTES = 4096
NIC_POLL = 0.05  # seconds between looks at a link that is down (within the budget)
GUESSED = "links up at start"  # sources/nic.py select_links' fallback: no link named


class TimedOut(Exception):
    pass


async def in_thread(fn: Callable[[], T], timeout: float) -> T:
    """``fn()`` in a daemon thread, its result or exception; TimedOut past ``timeout``."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        value: Any
        try:
            ok, value = True, fn()
        except BaseException as e:  # noqa: BLE001 - handed to the loop
            ok, value = False, e
        with contextlib.suppress(RuntimeError):  # the loop closed since: nobody waits
            loop.call_soon_threadsafe(settle, ok, value)

    # a probe abandoned at its budget may still settle: its outcome is read, never logged
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    threading.Thread(target=run, name="ftagent-preflight", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except asyncio.TimeoutError:
        raise TimedOut() from None


def _parts(watch: Any) -> dict[str, Any]:
    return {getattr(p, "name", ""): p for p in getattr(watch, "parts", ()) or ()}


def accelerator_probe(source: Any) -> Callable[[], str] | None:
    """A blocking probe of every device of ``source`` ('' when they all answer, else why
    not), or None when there is nothing to probe (no devices, the watch off)."""
    devices = list(getattr(source, "gpus", ()) or ())
    nvml: Any = getattr(getattr(source, "nv", None), "nvml", None)
    backend: Any = getattr(source, "backend", None)
    if not devices or (nvml is None and backend is None):
        return None

    def nvml_probe() -> str:
        import pynvml

        for g in devices:
            name = f"GPU {g.dev.index} ({g.dev.uuid or g.dev.pci_bus_id})"
            if g.lost:
                return f"{name} is lost (the GPU watch saw it go)"
            try:
                nvml.nvmlDeviceGetUUID(g.handle)
                nvml.nvmlDeviceGetMemoryInfo(g.handle)
            except pynvml.NVMLError_NotSupported:
                continue
            except pynvml.NVMLError as e:
                return f"{name} does not answer NVML ({type(e).__name__}: {e})"
            why = memory_state(nvml, g.handle, pynvml)
            if why:
                return f"{name}: {why}"
        return ""

    def vendor_probe() -> str:
        from ftagent.sources.accel import BackendUnavailable

        for w in devices:
            if w.lost:
                return f"device {w.dev.index} ({w.dev.uuid}) is lost (the watch saw it go)"
        try:
            samples = backend.sample([w.dev for w in devices])
        except BackendUnavailable as e:
            return f"{getattr(backend, 'tool', 'the vendor tool')} does not answer: {e}"
        by_index = {s.index: s for s in samples}
        for w in devices:
            s = by_index.get(w.dev.index)
            if s is None or s.lost:
                return f"device {w.dev.index} ({w.dev.uuid}) does not answer " \
                       f"{getattr(backend, 'tool', 'the vendor tool')}"
        return ""

    return nvml_probe if nvml is not None else vendor_probe


def memory_state(nvml: Any, handle: Any, pynvml: Any) -> str:
    """The device memory's state as NVML keeps it ('' when usable): a row remap that
    failed (the memory cannot be repaired: NVIDIA's guidance is to replace the GPU) or one
    pending (it takes effect only after a GPU reset: a job started now runs on the bad
    row); on GPUs without row remapping, dynamic page retirement pending likewise. A call
    the GPU does not support is no answer, never a failure."""
    try:
        _, _, pending, failure = nvml.nvmlDeviceGetRemappedRows(handle)
        if failure:
            return "a row remap failed (its memory cannot be repaired: replace the GPU)"
        if pending:
            return "a row remap is pending (the GPU needs a reset before a job uses it)"
        return ""
    except pynvml.NVMLError_NotSupported:
        pass
    except pynvml.NVMLError:
        return ""  # (a GPU lost since the calls above is the watch's to report)
    try:
        if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
            return "a page retirement is pending (the GPU needs a reset before a job uses it)"
    except pynvml.NVMLError:
        pass
    return ""


async def compute_check(source: Any, budget: float,
                        clock: Callable[[], float] = time.monotonic) -> CheckResult:
    """The compute check of a started GPU source's devices (also ``gpu_check``'s): the
    simulated backend's own, the CUDA child on real NVML where torch is importable, else
    no compute path (skipped, said so)."""
    t0 = clock()
    devices = list(getattr(source, "gpus", ()) or ())
    nvml: Any = getattr(getattr(source, "nv", None), "nvml", None)
    backend: Any = getattr(source, "backend", None)
    sim = getattr(nvml if nvml is not None else backend, "ftagent_compute_check", None)
    if sim is not None:  # a simulated backend: its script says how each device does
        probe = compute_sim_probe(sim, devices)
        try:
            why = await in_thread(probe, budget)
        except TimedOut:
            return CheckResult("compute", False, clock() - t0,
                               f"did not answer within {budget:g}s", timed_out=True)
        except Exception as e:  # a probe that raised: its message, one line
            why = f"{type(e).__name__}: {e}"
        return CheckResult("compute", not why, clock() - t0, why)
    if nvml is None or not isinstance(nvml, types.ModuleType):  # not pynvml itself
        tool = getattr(backend, "tool", "") or type(nvml).__name__
        return CheckResult("compute", True, clock() - t0,
                           f"no compute path through {tool} (not checked)", skipped=True)
    if importlib.util.find_spec("torch") is None:
        return CheckResult("compute", True, clock() - t0, "no compute path: torch is not "
                           "installed where the agent runs (not checked)", skipped=True)
    return await compute_child(budget, clock)


def compute_sim_probe(check: Callable[[Any], str], devices: Sequence[Any]
                      ) -> Callable[[], str]:
    """The simulated backends' compute check of every device ('' when all pass)."""
    def probe() -> str:
        import pynvml

        for g in devices:
            if getattr(g, "lost", False):
                continue  # the accelerator check names a lost device
            handle = getattr(g, "handle", None)
            try:
                why = check(handle if handle is not None else g.dev)
            except pynvml.NVMLError_GpuIsLost:
                continue  # likewise
            if why:
                dev = getattr(g, "dev", None)
                return f"device {getattr(dev, 'index', '?')}: {why}"
        return ""
    return probe


async def compute_child(budget: float, clock: Callable[[], float] = time.monotonic,
                        argv: Sequence[str] | None = None) -> CheckResult:
    """``agent/compute_probe.py`` in a child process, killed at ``budget``: its JSON
    lines judged. No compute path there, or torch still importing when the budget ends
    (a slow file system is not a device fault): skipped, said so. A device's why, a
    crash, or the device work past the budget: failed."""
    t0 = clock()
    cmd = list(argv or (sys.executable, "-m", "ftagent.agent.compute_probe"))
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, limit=1 << 16)
    except OSError as e:
        return CheckResult("compute", True, clock() - t0, f"no compute path: the probe "
                           f"could not start ({e.strerror or e})", skipped=True)
    assert proc.stdout is not None and proc.stderr is not None
    tail = bytearray()

    async def drain(stream: asyncio.StreamReader) -> None:  # never a full pipe: its tail
        while chunk := await stream.read(1 << 14):
            tail.extend(chunk)
            del tail[:-4096]

    drainer = asyncio.ensure_future(drain(proc.stderr))
    seen: dict[str, Any] = {}  # "ready", "result"

    async def read(stdout: asyncio.StreamReader) -> None:
        while line := await stdout.readline():
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if isinstance(msg, dict):
                    seen["ready" if "ready" in msg else "result"] = msg
        await proc.wait()

    try:
        await asyncio.wait_for(read(proc.stdout), budget)
    except (asyncio.TimeoutError, ValueError):  # the budget, or a line past the limit
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), 1.0)
        if "ready" not in seen:
            return CheckResult("compute", True, clock() - t0, f"no compute path within "
                               f"{budget:g}s: torch and CUDA were still starting "
                               "(not checked)", skipped=True)
        return CheckResult("compute", False, clock() - t0,
                           f"did not answer within {budget:g}s", timed_out=True)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(drainer, 1.0)
    took = clock() - t0
    got = seen.get("result")
    if not isinstance(got, dict):
        last = tail.decode(errors="replace").strip().splitlines()[-1:]
        return CheckResult("compute", False, took, f"the compute probe exited with "
                           f"{proc.returncode}" + (f": {last[0][:200]}" if last else ""))
    if got.get("path") == "none":
        return CheckResult("compute", True, took,
                           f"no compute path: {str(got.get('why', ''))[:200]} (not checked)",
                           skipped=True)
    bad = [f"CUDA device {d.get('index')}: {str(d.get('why'))[:200]}"
           for d in got.get("devices") or [] if isinstance(d, dict) and d.get("why")]
    return CheckResult("compute", not bad, took, "; ".join(bad[:4]))


def peer_probe(host: str, port: int, timeout: float) -> Callable[[], str]:
    """A TCP connect to the job's rendezvous (MASTER_ADDR:MASTER_PORT) before the barrier:
    the path from this pod to its peers. A connection, or a refusal (the host answered:
    its store is not listening yet, as before every start), passes; "no route to the
    network" (ENETUNREACH: this pod has no route at all) fails. A name that does not
    resolve, a timeout or a host that does not answer is said but passes: the master's
    pod may be being replaced right now, and a false failure would replace this one."""
    def probe() -> str:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return ""  # (said by peer_note; the rendezvous fails loudly if it stays so)
        for family, kind, proto, _, addr in infos[:4]:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout)
                try:
                    sock.connect(addr)
                    return ""
                except ConnectionRefusedError:
                    return ""
                except OSError as e:
                    if e.errno == errno.ENETUNREACH:
                        return f"no route from this pod to {host}:{port} ({e.strerror})"
        return ""
    return probe


def rendezvous(environ: Mapping[str, str], rank: int) -> tuple[str, int] | None:
    """MASTER_ADDR and MASTER_PORT of a rank other than the master's, else None (rank 0,
    a single node, unset or odd values: nothing to probe)."""
    host = environ.get("MASTER_ADDR", "").strip()
    port = environ.get("MASTER_PORT", "").strip()
    if rank <= 0 or not host or len(host) > 253 or host in ("localhost", "127.0.0.1", "::1"):
        return None
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def storage_probe(directory: str) -> Callable[[], str]:
    def probe() -> str:
        if not os.path.isdir(directory):
            return f"{directory} is not a directory"
        path = os.path.join(directory, f".ftagent-preflight-{os.getpid()}-"
                                       f"{threading.get_ident()}")
        data = os.urandom(PROBE_BYTES)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            with open(path, "rb") as f:
                back = f.read(PROBE_BYTES + 1)
            if back != data:
                return f"{directory}: a file written there read back different"
        except OSError as e:
            return f"{directory} is not writable and readable ({e.strerror or e})"
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return ""
    return probe


class Preflight:
    """The checks of one worker (its node's watch when it carries it, its checkpoint
    directory). ``run(warm)`` -> the verdict, within the budgets."""

    def __init__(self, watch: Any = None, checkpoint_dir: str = "", *,
                 full_on_warm: bool = False, peer: tuple[str, int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.watch = watch
        self.checkpoint_dir = checkpoint_dir
        self.full_on_warm = full_on_warm
        self.peer = peer  # the job's rendezvous to probe (rendezvous()), None: none
        self.clock = clock

    async def run(self, warm: bool = False) -> Verdict:
        limits = budgets(fast=warm and not self.full_on_warm)
        results = await asyncio.gather(self._accelerator(limits["accelerator"]),
                                       self._nic(limits["nic"]),
                                       self._storage(limits["storage"]),
                                       self._peer(limits["peer"]),
                                       self._compute(limits["compute"]))
        return verdict(results)

    async def _compute(self, budget: float) -> CheckResult:
        """The device-memory and compute check (module docstring): skipped on a warm
        restart (budget 0), without devices, or where there is no compute path."""
        if budget <= 0:
            return CheckResult("compute", True, 0.0, "skipped on a warm restart",
                               skipped=True)
        part = _parts(self.watch).get("gpu")
        source = getattr(part, "source", None)
        ready = getattr(source, "ready", None)
        t0 = self.clock()
        if source is not None and ready is not None and not ready.is_set():
            await until_set(ready, budget)
        devices = list(getattr(source, "gpus", ()) or ())
        if source is None or ready is None or not ready.is_set() or not devices:
            return CheckResult("compute", True, self.clock() - t0,
                               "no accelerator watched", skipped=True)
        left = max(0.1, budget - (self.clock() - t0))
        return await compute_check(source, left, self.clock)

    async def _peer(self, budget: float) -> CheckResult:
        if self.peer is None:
            return CheckResult("peer", True, 0.0, "no rendezvous to probe", skipped=True)
        host, port = self.peer
        # the connect's own timeout inside the budget: a host that does not answer passes
        return await self._timed("peer", peer_probe(host, port, budget * 0.8), budget)

    async def _timed(self, name: str, probe: Callable[[], str] | None, budget: float,
                     skip: str = "") -> CheckResult:
        if probe is None:
            return CheckResult(name, True, 0.0, skip, skipped=True)
        t0 = self.clock()
        try:
            why = await in_thread(probe, budget)
        except TimedOut:
            return CheckResult(name, False, self.clock() - t0,
                               f"did not answer within {budget:g}s", timed_out=True)
        except Exception as e:  # a probe that raised: its message, one line
            why = f"{type(e).__name__}: {e}"
        return CheckResult(name, not why, self.clock() - t0, why)

    async def _accelerator(self, budget: float) -> CheckResult:
        part = _parts(self.watch).get("gpu")
        source = getattr(part, "source", None)
        ready = getattr(source, "ready", None)
        t0 = self.clock()
        if source is not None and ready is not None and not ready.is_set():
            await until_set(ready, budget)  # the watch's NVML starting
        if source is None or ready is None or not ready.is_set():
            return await self._timed("accelerator", None, budget,
                                     "no accelerator watch (or it is still starting)")
        left = max(0.1, budget - (self.clock() - t0))
        return await self._timed("accelerator", accelerator_probe(source), left,
                                 "no devices watched")

    async def _nic(self, budget: float) -> CheckResult:
        part = _parts(self.watch).get("nic")
        source = getattr(part, "source", None)
        if source is None:
            return CheckResult("nic", True, 0.0, "no NIC watch", skipped=True)
        t0 = self.clock()
        ready = getattr(source, "ready", None)
        if ready is not None and not ready.is_set() and not await until_set(ready, budget):
            return CheckResult("nic", True, self.clock() - t0,
                               "the NIC watch is still starting", skipped=True)
        links: Sequence[Any] = source.snapshot()
        if not links:
            return CheckResult("nic", True, self.clock() - t0, "no links watched",
                               skipped=True)
        # a link down now may be a flap: looked at again until the budget is spent
        while any(not (n.up and n.carrier) for n in links) and \
                self.clock() - t0 + NIC_POLL < budget:
            await asyncio.sleep(NIC_POLL)
            links = source.snapshot()
        down = [f"{n.device} is {'down' if not n.up else 'without carrier'}"
                for n in links if not (n.up and n.carrier)]
        sel = getattr(source, "selection", None)
        if down and getattr(sel, "why", "") == GUESSED and len(down) < len(links):
            # the job named no links (--nic, NCCL_/GLOO_SOCKET_IFNAME): the watch guessed
            # every link up at start, so one of them down is not the job's path down
            return CheckResult("nic", True, self.clock() - t0,
                               f"{', '.join(down[:8])} (not named as the job's links)")
        return CheckResult("nic", not down, self.clock() - t0, ", ".join(down[:8]))

    async def _storage(self, budget: float) -> CheckResult:
        d = self.checkpoint_dir
        return await self._timed("storage", storage_probe(d) if d else None, budget,
                                 "no checkpoint directory given")
