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
import re
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

from ftagent.agent.redact import REDACTED, redact_argv, redact_secrets  # noqa: F401 (re-exported)
from ftagent.detect.liveness import Frame, ProcessSample, ThreadSample

MAX_STACK = 256 * 1024  # characters of py-spy output kept per process

# Secrets out of evidence (env dumps, flag pairs, bearer headers, URL credentials): the
# shapes and why are in agent/redact.py; re-exported here, where evidence is made.
MAX_THREADS = 16  # concurrent dumps
# The trainer's tree is every descendant of the agent, so it holds the agent's own py-spy
# while another capture runs (a verification sample beside a DUMP_STACKS answer): such an
# entry is left out, as the verification sampler leaves it out.
OWN_PY_SPY = "the agent's own py-spy"


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
            if fut.result()["error"] != OWN_PY_SPY:
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
            entry["cmdline"] = redact_argv(proc.cmdline())
    except psutil.NoSuchProcess:
        entry["error"] = "no such process (it exited)"
        return entry
    except psutil.AccessDenied as e:
        errors.append(f"process state: access denied ({e})")
    except Exception as e:  # noqa: BLE001 - evidence is best effort
        errors.append(f"process state: {e!r}")
    if entry["name"] == "py-spy":  # the agent's own dump of another process, not the trainer
        entry["error"] = OWN_PY_SPY
        return entry
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
    out, err = _py_spy(exe, ["dump", "--pid", str(pid)], pid, deadline)
    return (out[:MAX_STACK] if out is not None else None), err


ATTEMPTS = 8  # py-spy runs per process and capture, while the deadline allows
RETRY_PAUSE = 0.05  # seconds before the first retry, doubling up to RETRY_PAUSE_MAX
RETRY_PAUSE_MAX = 0.25  # all retries span ~1.3 s: another py-spy lets go within 0.1 s


def _py_spy(exe: str | None, args: list[str], pid: int, deadline: float
            ) -> tuple[str | None, str | None]:
    """(stdout, error) of ``py-spy ARGS`` on ``pid`` before ``deadline``; a failed
    attach is retried while the deadline allows.

    Why the retry: py-spy stops the process with ptrace, and a process has one tracer at a
    time. Another py-spy on the same pid (the verification window's sampler and the
    DUMP_STACKS answer, or an operator's own py-spy) makes the second attach fail at once
    with ``Failed to suspend process: EPERM`` -- measured here, about 1 in 7 of two dumps
    started together -- and a thread exiting during the attach fails it with ESRCH. Both are
    gone a few milliseconds later; without the retry a rank's capture had no frames and the
    arbiter could not name the culprit. A dump that timed out is not retried (the deadline
    is spent), nor one of a process that is gone.
    """
    if exe is None:
        return None, "py-spy not found (pip install py-spy, or pass its path)"
    why = "deadline passed before py-spy could run"
    for attempt in range(ATTEMPTS):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None, why if attempt == 0 else f"{why} ({attempt} attempts, deadline passed)"
        try:
            r = subprocess.run([exe, *args], capture_output=True,
                               stdin=subprocess.DEVNULL, timeout=remaining, check=False)
        except subprocess.TimeoutExpired:
            if attempt:  # the retries ran out of time: the reason is the earlier failure's
                return None, f"{why} ({attempt} attempts, then the deadline passed)"
            return None, f"py-spy dump timed out after {remaining:.1f}s"
        except OSError as e:
            return None, f"py-spy could not run: {e}"
        out = r.stdout.decode("utf-8", "replace").strip()
        if _STACK.search(out):
            return out, None
        if not psutil.pid_exists(pid):
            return None, "py-spy dump failed: no such process (it exited during the dump)"
        why = "py-spy dump failed: " + py_spy_error(r.stderr.decode("utf-8", "replace"))
        if _stopped(pid):  # SIGSTOP: every attach fails until SIGCONT; retrying only
            return None, f"{why} (the process is stopped: SIGSTOP)"  # spends the deadline
        if attempt + 1 < ATTEMPTS:
            if not _transient(why):
                break
            pause = min(RETRY_PAUSE * 2 ** attempt, RETRY_PAUSE_MAX)
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
    return None, why + (f" ({attempt + 1} attempts)" if attempt else "")


# What a dump that worked printed: a thread (text) or a list of threads (--json). A failed
# plain dump still prints its "Process P: CMD" and "Python vX" header on stdout before the
# error on stderr; counting that header as a stack gave captures without frames.
_STACK = re.compile(r"^Thread \S+|^\[", re.M)


def py_spy_error(stderr: str) -> str:
    """The reason in py-spy's stderr: its ``Error:`` line and the ``Caused by`` chain, not
    the Rust backtrace that follows them (whose last line, ``9: main``, says nothing)."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    parts: list[str] = []
    for ln in lines:
        if ln.startswith("Stack backtrace"):
            break
        if ln.startswith("Error:"):
            parts.append(ln.removeprefix("Error:").strip())
        elif parts and re.match(r"^\d+: ", ln):  # "0: Failed to suspend process"
            cause = ln.split(": ", 1)[1]
            if cause not in parts:
                parts.append(cause)
    why = ": ".join(parts)[:300] or (lines[-1][:300] if lines else "no output")
    denied = "ermission" in why or "ptrace" in why.lower() or "EPERM" in why
    if denied and "suspend" not in why:  # a tracer already attached is no missing capability
        why += " (py-spy needs ptrace: run the agent as root or add the SYS_PTRACE capability)"
    return why


def _stopped(pid: int) -> bool:
    """``pid`` is stopped by a signal (state T: SIGSTOP, SIGTSTP), not traced: no attach
    can succeed until it is continued. Each verification sample of a SIGSTOPped trainer
    used to retry until its whole dump deadline (2 s), so a DUMP_STACKS answer over 5
    samples took 10 s and more, past the arbiter's stacks deadline on a loaded machine."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except (psutil.Error, OSError):
        return False


def _transient(why: str) -> bool:
    """A failed attach that a retry can cure: the process was being traced by someone else
    or changing its threads (py-spy's 'Failed to suspend process', EPERM, ESRCH, a torn
    read of its memory)."""
    return any(s in why for s in ("suspend", "EPERM", "ESRCH", "No such process",
                                  "Failed to get stack traces", "Failed to copy",
                                  "failed to read"))


# --------------------------------------------------------------------------- verification


def sample_process(pid: int, exe: str | None, deadline: float,
                   clock: Any = time.monotonic, stacks: bool = True
                   ) -> tuple[ProcessSample, dict[str, Any]]:
    """One verification sample of ``pid``: the liveness sample and a ``capture`` entry.
    ``stacks`` False: /proc and psutil only (no py-spy), a cheap early sample.
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
    threads, text, err = None, None, None
    if stacks:
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
    out, err = _py_spy(exe, ["dump", "--json", "--locals", "--pid", str(pid)], pid, deadline)
    if out is None:
        return None, None, err
    try:
        threads = parse_py_spy_json(json.loads(out), tasks)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        return None, None, f"py-spy output not understood: {e!r}"
    return threads, render(pid, threads)[:MAX_STACK], None


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
