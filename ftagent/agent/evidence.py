"""Evidence of a hang, captured before anything is killed: Python stacks and process state.

For every pid of the trainer's tree: ``py-spy dump --pid P`` (the Python stack of every
thread; a rank stuck in a collective shows the call it is stuck in) and psutil's view
(status, CPU time, threads, command line). The dumps run concurrently under one deadline,
and nothing here raises: a vanished process, a missing py-spy, a dump that times out or is
denied ptrace becomes an ``error`` string in that process's entry.

``sample_process`` is the same, for one sample of a hang verification
(``agent/verify.py``): ``py-spy dump --json`` parsed into frames, CPU and storage I/O
counters, and every thread's /proc state and CPU time, as ``detect.liveness`` samples (and
the same text entry ``capture`` gives, so a fault's evidence reads the same).

Why threads and ``subprocess.run`` instead of ``asyncio.create_subprocess_exec``: the
agent reaps its children with its own SIGCHLD handler (``waitpid(-1)``), which fights
asyncio's child watcher. The reaper may also take py-spy's exit status, so the return code
can read 0 after a failure: a dump counts only if it printed a stack.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from ftagent.detect.liveness import Frame, ProcessSample, ThreadSample

MAX_STACK = 256 * 1024  # characters of py-spy output kept per process
MAX_THREADS = 16  # concurrent dumps


def find_py_spy(name: str = "py-spy") -> str | None:
    """``name`` on PATH, else next to this Python (a virtualenv's bin/), else None."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else None


async def capture(pids: Sequence[int], deadline_seconds: float,
                  py_spy: str = "py-spy") -> dict[str, Any]:
    """Stacks and state of ``pids`` within ``deadline_seconds``; JSON-serialisable::

        {"processes": [{"pid", "name", "cmdline", "status", "num_threads", "cpu_times",
                        "cpu_percent", "stack", "error"}, ...], "seconds": elapsed}
    """
    start = time.monotonic()
    deadline = start + max(deadline_seconds, 0.0)
    exe = find_py_spy(py_spy)
    pids = list(dict.fromkeys(pids))
    if not pids:
        return {"processes": [], "seconds": 0.0}
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=min(len(pids), MAX_THREADS),
                              thread_name_prefix="ftagent-evidence")
    futures = [loop.run_in_executor(pool, _capture_one, pid, exe, deadline) for pid in pids]
    try:
        # subprocess.run enforces the deadline; the +1 s only guards against a stuck thread
        done, _ = await asyncio.wait(futures, timeout=max(deadline - time.monotonic(), 0) + 1.0)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    processes = []
    for pid, fut in zip(pids, futures, strict=True):
        if fut in done and fut.exception() is None:
            processes.append(fut.result())
        else:
            entry = _empty(pid)
            entry["error"] = f"evidence capture did not finish within {deadline_seconds:g}s"
            processes.append(entry)
    return {"processes": processes, "seconds": round(time.monotonic() - start, 3)}


def _empty(pid: int) -> dict[str, Any]:
    return {"pid": pid, "name": None, "cmdline": None, "status": None, "num_threads": None,
            "cpu_times": None, "cpu_percent": None, "stack": None, "error": None}


def _read_state(proc: psutil.Process, entry: dict[str, Any]) -> float:
    """Name, status, threads and CPU times of ``proc`` into ``entry``; its CPU seconds.
    Call inside ``proc.oneshot()``; psutil's errors go to the caller."""
    entry["name"] = proc.name()
    entry["status"] = proc.status()
    entry["num_threads"] = proc.num_threads()
    ct = proc.cpu_times()
    entry["cpu_times"] = {"user": ct.user, "system": ct.system}
    return float(ct.user + ct.system)


def _capture_one(pid: int, exe: str | None, deadline: float) -> dict[str, Any]:
    entry = _empty(pid)
    errors: list[str] = []
    proc: psutil.Process | None = None
    before: tuple[float, float] | None = None
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            before = (time.monotonic(), _read_state(proc, entry))
            entry["cmdline"] = proc.cmdline()
    except psutil.NoSuchProcess:
        entry["error"] = "no such process (it exited)"
        return entry
    except psutil.AccessDenied as e:
        errors.append(f"process state: access denied ({e})")
    except Exception as e:  # noqa: BLE001 - evidence is best effort
        errors.append(f"process state: {e!r}")
    entry["stack"], stack_error = _dump(pid, exe, deadline)
    if stack_error:
        errors.append(stack_error)
    if proc is not None and before is not None:
        try:  # CPU use over the capture window (py-spy pauses the process briefly)
            ct = proc.cpu_times()
            window = time.monotonic() - before[0]
            if window > 0:
                entry["cpu_percent"] = round(100.0 * (ct.user + ct.system - before[1]) / window, 1)
        except Exception:  # noqa: BLE001
            pass
    entry["error"] = "; ".join(errors) or None
    return entry


def _dump(pid: int, exe: str | None, deadline: float) -> tuple[str | None, str | None]:
    """(stack, error) from ``py-spy dump --pid``."""
    if exe is None:
        return None, "py-spy not found (pip install py-spy, or pass its path)"
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return None, "deadline passed before py-spy could run"
    try:
        r = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True,
                           stdin=subprocess.DEVNULL, timeout=remaining, check=False)
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump timed out after {remaining:.1f}s"
    except OSError as e:
        return None, f"py-spy could not run: {e}"
    out = r.stdout.decode("utf-8", "replace").strip()
    if out:
        return out[:MAX_STACK], None
    err = r.stderr.decode("utf-8", "replace").strip().splitlines()
    why = err[-1] if err else "no output"
    if "ermission" in why or "ptrace" in why.lower():
        why += " (py-spy needs ptrace: run the agent as root or add the SYS_PTRACE capability)"
    if not psutil.pid_exists(pid):
        why = "no such process (it exited during the dump)"
    return None, f"py-spy dump failed: {why}"


# --------------------------------------------------------------------------- verification


def sample_process(pid: int, exe: str | None, deadline: float,
                   clock: Any = time.monotonic) -> tuple[ProcessSample, dict[str, Any]]:
    """One verification sample of ``pid``: the liveness sample and a ``capture`` entry.
    Never raises; what could not be read is in ``errors``."""
    entry = _empty(pid)
    errors: list[str] = []
    cpu: float | None = None
    io: int | None = None
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            cpu = _read_state(proc, entry)
            try:
                ioc = proc.io_counters()
                io = int(ioc.read_bytes + ioc.write_bytes)
            except (psutil.AccessDenied, AttributeError, NotImplementedError) as e:
                errors.append(f"I/O counters unreadable ({type(e).__name__})")
    except psutil.NoSuchProcess:
        return ProcessSample(pid, clock(), None, gone=True,
                             errors=("no such process (it exited)",)), {
            **entry, "error": "no such process (it exited)"}
    except psutil.AccessDenied as e:
        errors.append(f"process state: access denied ({e})")
    except Exception as e:  # noqa: BLE001 - evidence is best effort
        errors.append(f"process state: {e!r}")
    ts = clock()
    tasks = _tasks(pid)
    threads, text, err = _dump_json(pid, exe, deadline, tasks)
    if err:
        errors.append(err)
    if threads is None and not psutil.pid_exists(pid):
        return ProcessSample(pid, ts, cpu, io, gone=True, errors=tuple(errors)), {
            **entry, "error": "; ".join(errors) or None}
    entry["stack"] = text
    entry["thread_states"] = dict(sorted(
        _count(state for state, _ in tasks.values()).items())) if tasks else None
    entry["error"] = "; ".join(errors) or None
    status = entry["status"] if isinstance(entry["status"], str) else None
    return ProcessSample(pid, ts, cpu, io, threads, status, tuple(errors)), entry


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _tasks(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (state letter, CPU seconds) from /proc/PID/task/*/stat; {} if unreadable."""
    out: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (fields[0], (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _dump_json(pid: int, exe: str | None, deadline: float,
               tasks: dict[int, tuple[str, float]]
               ) -> tuple[tuple[ThreadSample, ...] | None, str | None, str | None]:
    """(threads, py-spy-like text, error) from ``py-spy dump --json --pid``."""
    if exe is None:
        return None, None, "py-spy not found (pip install py-spy, or pass its path)"
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return None, None, "deadline passed before py-spy could run"
    try:
        r = subprocess.run([exe, "dump", "--json", "--locals", "--pid", str(pid)],
                           capture_output=True,
                           stdin=subprocess.DEVNULL, timeout=remaining, check=False)
    except subprocess.TimeoutExpired:
        return None, None, f"py-spy dump timed out after {remaining:.1f}s"
    except OSError as e:
        return None, None, f"py-spy could not run: {e}"
    out = r.stdout.decode("utf-8", "replace").strip()
    if out:
        try:
            threads = parse_py_spy_json(json.loads(out), tasks)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return None, None, f"py-spy output not understood: {e!r}"
        return threads, render(pid, threads)[:MAX_STACK], None
    err = r.stderr.decode("utf-8", "replace").strip().splitlines()
    why = err[-1] if err else "no output"
    if "ermission" in why or "ptrace" in why.lower():
        why += " (py-spy needs ptrace: run the agent as root or add the SYS_PTRACE capability)"
    if not psutil.pid_exists(pid):
        why = "no such process (it exited during the dump)"
    return None, None, f"py-spy dump failed: {why}"


LIB_PATH = ("site-packages", "dist-packages", "/lib/python")


def parse_py_spy_json(data: Any, tasks: dict[int, tuple[str, float]] | None = None
                      ) -> tuple[ThreadSample, ...]:
    """py-spy's ``dump --json`` (a list of threads) as liveness thread samples."""
    tasks = tasks or {}
    threads = []
    for th in data:
        frames = []
        sums: list[int | None] = []
        for fr in th.get("frames") or ():
            loc = fr.get("locals")
            sums.append(None if not isinstance(loc, list) else zlib.crc32(json.dumps(
                [[v.get("name"), v.get("repr")] for v in loc if isinstance(v, dict)]
            ).encode()))
            path = str(fr.get("filename") or "?")
            short = str(fr.get("short_filename") or path.rsplit("/", 1)[-1])
            frames.append(Frame(str(fr.get("name") or "?"), short.rsplit("/", 1)[-1],
                                int(fr.get("line") or 0),
                                any(p in path for p in LIB_PATH)))
        tid = int(th.get("os_thread_id") or th.get("thread_id") or 0)
        state, cpu = tasks.get(tid, (None, None))
        active = th.get("active")
        threads.append(ThreadSample(tid, str(th.get("thread_name") or ""),
                                    active if isinstance(active, bool) else None,
                                    tuple(frames), cpu, state,
                                    tuple(sums) if any(x is not None for x in sums) else None))
    return tuple(threads)


def render(pid: int, threads: Sequence[ThreadSample]) -> str:
    """The text ``py-spy dump`` prints, from parsed threads (what ``capture`` keeps)."""
    lines = [f"Process {pid}"]
    for t in threads:
        flag = "active" if t.active else "idle" if t.active is False else "?"
        lines.append(f"Thread {t.tid} ({flag}): \"{t.name}\"")
        lines += [f"    {f.name} ({f.file}:{f.line})" for f in t.frames]
    return "\n".join(lines)
