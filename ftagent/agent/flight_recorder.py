"""PyTorch's flight recorder on, for every trainer, with no change to the training script.

Env (:func:`fr_env`, pure): the trace buffer (``TORCH_FR_BUFFER_SIZE`` and the pre-2.8
``TORCH_NCCL_TRACE_BUFFER_SIZE``), NCCL's dump on timeout, the dump file prefix
(``TORCH_FR_DUMP_TEMP_FILE`` / ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``: torch appends the
global rank), NCCL's dump pipe (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``: ``<prefix><rank>.pipe``,
its directory must exist before ``init_process_group``), ``TORCH_INCLUDE_STACK_TRACE=0``
(capturing Python frames needs the GIL) -- each only where the user's environment does
not set it (for a renamed pair: neither name). ``--fr-buffer-size 0`` turns all of it off.

Per attempt: the prefixes point into ``FR_DIR/current/``, a symlink the agent re-points
to ``FR_DIR/attempt_N/`` before each start. The variables stay the same across attempts,
so a warm standby (started before the attempt's values are known) is not ruled out by
them (standby.py's ``env_blockers``), and each attempt's dumps stay apart.

The trigger: ``fr_boot.py`` runs as ``sitecustomize`` in the trainer's Python (its copy
in ``FR_DIR/site`` is first on ``PYTHONPATH``) and serves a FIFO per process in
``FR_DIR/trigger``; :meth:`FlightRecorder.snapshot` writes a byte to each, waits until
each process answered (``<fifo>.done``: its dump's path, or none) or 2 s passed, and
returns bounded summaries (``fr_summary.py``). It joins the hang
fault's evidence and the DUMP_STACKS answer (``flight_recorder`` key) the arbiter reads.
A trainer run with ``python -I``/``-S`` does not read it: stacks only, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from importlib import resources
from typing import Any

from ftagent.agent.evidence import capture
from ftagent.agent.fr_summary import MAX_DUMP_BYTES, DumpError, load_dump, summarize
from ftagent.agent.worker_parts import WorkerParts

log = logging.getLogger(__name__)

PAIRS = (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
         ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))
DUMP_PREFIX = "rank_"
PIPE_PREFIX = "pipe_"
SNAPSHOT_TIMEOUT = 2.0  # seconds a snapshot waits for the dumps
POLL = 0.05
_RANK_FILE = re.compile(r"(\d{1,7})")


def fr_env(environ: Mapping[str, str], buffer_size: int, fr_dir: str) -> dict[str, str]:
    """The variables to add to the trainer's environment (module docstring); {} when off."""
    if buffer_size <= 0:
        return {}
    cur = os.path.join(fr_dir, "current")
    want = {
        PAIRS[0]: str(buffer_size),
        PAIRS[1]: os.path.join(cur, DUMP_PREFIX),
    }
    out: dict[str, str] = {}
    legacy = []
    for names, value in want.items():
        if not any(n in environ for n in names):
            out.update({n: value for n in names})
            legacy.append(names[1])
    if legacy:  # fr_boot drops them under torch >= 2.8, which warns about each
        out["FTAGENT_FR_LEGACY"] = ",".join(legacy)
    for name, value in (("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                        ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", os.path.join(cur, PIPE_PREFIX)),
                        ("TORCH_INCLUDE_STACK_TRACE", "0")):
        if name not in environ:
            out[name] = value
    out["FTAGENT_FR_DIR"] = fr_dir
    site = os.path.join(fr_dir, "site")
    old = environ.get("PYTHONPATH", "")
    out["PYTHONPATH"] = site + (os.pathsep + old if old else "")
    return out


def dump_prefix(env: Mapping[str, str]) -> str:
    return env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or ""


class FlightRecorder:
    """One agent's (one worker's) flight-recorder directory, trigger and reader."""

    def __init__(self, fr_dir: str, env: Mapping[str, str], *,
                 clock: Callable[[], float] = time.time) -> None:
        self.dir = fr_dir
        self.prefix = dump_prefix(env)
        self.clock = clock
        self._told = False
        self._inflight: asyncio.Future[dict[str, Any]] | None = None

    def prepare(self) -> bool:
        """Create the directories and the ``sitecustomize`` copy; False (logged) if not."""
        try:
            source = resources.files("ftagent.agent").joinpath("fr_boot.py").read_bytes()
            for sub in ("site", "trigger"):
                os.makedirs(os.path.join(self.dir, sub), mode=0o700, exist_ok=True)
            with open(os.path.join(self.dir, "site", "sitecustomize.py"), "wb") as f:
                f.write(source)
        except Exception as e:  # a bundle without the file, a read-only dir: stacks only
            log.warning("flight-recorder trigger unavailable (%s); hang evidence from "
                        "stacks only", e)
            return False
        return True

    def begin_attempt(self, attempt: int) -> None:
        """Point ``current`` at this attempt's directory (created: NCCL's pipe needs it)."""
        real = os.path.join(self.dir, f"attempt_{attempt}")
        os.makedirs(real, mode=0o700, exist_ok=True)
        link = os.path.join(self.dir, "current")
        tmp = f"{link}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.symlink(os.path.basename(real), tmp)
        os.replace(tmp, link)  # atomic: a dump never lands between two attempts' dirs

    def trigger(self) -> tuple[list[str], set[str]]:
        """A byte to every trainer process's FIFO, after removing its last answer: the
        FIFOs of the processes asked (their answers are awaited), and those of them not
        reached yet. A FIFO with no reader is removed when its process is gone; a live
        process with no reader yet (its trigger thread not in ``open()``: starting, or
        stopped before it got there) is asked again while the answers are awaited."""
        tdir = os.path.join(self.dir, "trigger")
        asked: list[str] = []
        pending: set[str] = set()
        try:
            names = os.listdir(tdir)
        except OSError:
            return [], set()
        for name in names[:4096]:
            if not name.endswith(".fifo"):
                continue
            path = os.path.join(tdir, name)
            with contextlib.suppress(OSError):
                os.unlink(path + ".done")
            sent = _send(path)
            if sent is None:  # no reader, and its process is gone
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            asked.append(path)
            if not sent:
                pending.add(path)
        return asked, pending

    def _answer(self, fifo: str) -> tuple[bool, int | None]:
        """(answered, the rank of its dump): a path is taken only if it is this attempt's
        dump file (``<prefix><rank>``), whatever the trainer wrote."""
        try:
            with open(fifo + ".done", encoding="utf-8") as f:
                path = f.read(4096)
        except OSError:
            return False, None
        if self.prefix and path.startswith(self.prefix):
            m = _RANK_FILE.fullmatch(path[len(self.prefix):])
            if m:
                return True, int(m.group(1))
        return True, None

    async def snapshot(self, timeout: float = SNAPSHOT_TIMEOUT,
                       sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep
                       ) -> dict[str, Any]:
        """Trigger, wait until every process reached answered (or ``timeout``), read the
        dumps safely: ``{"summaries": [...], "errors": [...], "seconds": ...}``. A call
        while one is under way (the hang verifier's window dump, then the arbiter's
        DUMP_STACKS) shares its answer: two triggers would take each other's answers."""
        if self._inflight is not None and not self._inflight.done():
            return await asyncio.shield(self._inflight)
        task = asyncio.ensure_future(self._snapshot(timeout, sleep))
        self._inflight = task
        return await asyncio.shield(task)

    async def _snapshot(self, timeout: float,
                        sleep: Callable[[float], Awaitable[Any]]) -> dict[str, Any]:
        t0 = self.clock()
        reached, pending = self.trigger()
        answers: dict[str, int | None] = {}
        while len(answers) < len(reached) and self.clock() - t0 < timeout:
            await sleep(POLL)
            for fifo in list(pending):  # its reader may be there now
                if _send(fifo) is not False:
                    pending.discard(fifo)
            for fifo in reached:
                if fifo not in answers:
                    done, rank = self._answer(fifo)
                    if done:
                        answers[fifo] = rank
        summaries, errors = [], []
        for rank in sorted({r for r in answers.values() if r is not None}):
            try:
                with open(f"{self.prefix}{rank}", "rb") as f:
                    summaries.append(summarize(load_dump(f.read(MAX_DUMP_BYTES + 1)), rank))
            except (OSError, DumpError) as e:
                errors.append(f"rank {rank}: {e}"[:300])
        silent = len(reached) - len(answers)
        if silent:
            errors.append(f"{silent} trainer process(es) did not answer within {timeout}s "
                          "(a stuck interpreter holding the GIL?)")
        if not summaries and not self._told:
            self._told = True
            log.warning("no flight-recorder dump came (%d trainer process(es) reached, %d "
                        "answered): torch without a flight recorder, no process group yet, "
                        "or a stuck interpreter; hang evidence from stacks only",
                        len(reached), len(answers))
        return {"summaries": summaries, "errors": errors,
                "seconds": round(self.clock() - t0, 3)}


def _send(path: str) -> bool | None:
    """One trigger byte to ``path``'s reader: True sent, False no reader yet (its process
    lives), None no reader and no process (or the FIFO is gone)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO and _process_alive(
                os.path.basename(path)[:-len(".fifo")]):
            return False
        return None
    try:
        os.write(fd, b"d")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _process_alive(pid: str) -> bool:
    """``<pid>.fifo``'s process still exists (a zombie too: its agent reaps it)."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def prepare_recorder(worker: Any, cfg: Any, rundir: str) -> FlightRecorder | None:
    """One worker's flight recorder, prepared before its hang parts (the verifier takes
    its ``snapshot`` at construction: agent/hang_parts.py); None when it is off or
    cannot be prepared."""
    size = int(cfg.hang.fr_buffer_size)
    if size <= 0:
        return None
    fr_dir = os.path.join(rundir, "fr")
    fr = FlightRecorder(fr_dir, {**worker.environ, **fr_env(worker.environ, size, fr_dir)})
    return fr if fr.prepare() else None


def flight_recorder_parts(worker: Any, cfg: Any, rundir: str, parts: WorkerParts,
                          fr: FlightRecorder | None) -> WorkerParts:
    """``parts`` with one worker's flight recorder ``fr`` (``prepare_recorder``; ``parts``
    as they are without one): its trainer's env, the per-attempt directory before each
    start (a ``before_start`` step: the spawn itself is left alone), and the dumps in the
    hang fault's evidence (around ``parts.evidence``, the verifier's window dump when it
    took one) and the decider's DUMP_STACKS answer (the declared stall's dump: one
    capture per verification)."""
    if fr is None:
        return parts
    from ftagent.agent.hang_watch import HangWatch

    env = fr_env(worker.environ, int(cfg.hang.fr_buffer_size), fr.dir)

    async def attempt_directory(env: Mapping[str, str]) -> None:
        """``current`` re-pointed at the attempt about to start, the last step before its
        spawn: its dumps land there, apart from the previous attempt's."""
        try:
            fr.begin_attempt(worker.lifecycle.restarts)
        except OSError as e:  # never keeps the trainer from starting
            log.warning("flight-recorder attempt directory: %s", e)

    verifier = next((d.verifier for d in parts.detectors if isinstance(d, HangWatch)), None)
    enrich = parts.evidence
    evidence = None
    if enrich is not None:
        async def with_dumps(fault: Any, pids: Callable[[], Sequence[int]]) -> Any:
            import dataclasses

            early = await verifier.window_dump_result() if verifier is not None else None
            if early is not None:
                fault = await enrich(fault, pids)
                return dataclasses.replace(fault, evidence={**fault.evidence,
                                                            "flight_recorder": early})
            got, fault = await asyncio.gather(fr.snapshot(), enrich(fault, pids))
            return dataclasses.replace(fault, evidence={**fault.evidence,
                                                        "flight_recorder": got})

        evidence = with_dumps
    # the rank's DUMP_STACKS answer (seat.py RankHooks.stacks), around the one there
    base = parts.hooks.stacks

    async def stacks_of_tree() -> dict[str, Any]:
        return await capture(worker.tree_pids(), cfg.hang.hang_dump_timeout)

    stacks_only = base if base is not None else stacks_of_tree

    async def stacks_with_dumps() -> dict[str, Any]:
        taken = await verifier.stall_dump() if verifier is not None else None
        if taken is not None:  # the verification's window dump: one per verification
            return {**await stacks_only(), "flight_recorder": taken}
        got, stacks = await asyncio.gather(fr.snapshot(), stacks_only())
        return {**stacks, "flight_recorder": got}

    parts = parts.with_(stacks=stacks_with_dumps)
    return parts.plus(env=env, before_start=[attempt_directory]).with_(evidence=evidence)
