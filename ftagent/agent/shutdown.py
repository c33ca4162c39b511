"""A bounded exit: the agent's own cleanup after the trainer's last exit takes at most
``--exit-timeout`` seconds, then the agent exits with the trainer's status all the same.

Why: the pod's phase and exit code reach Kubernetes only when ``ftagent run`` exits. A
task of the agent that does not end when cancelled (CPython gh-86296's lost cancellation,
stop 42), an executor thread blocked in a call that never returns (NVML on a wedged GPU,
a file system), or a goodbye to an arbiter that never answers would otherwise keep a pod
whose trainer is done "Running" forever. The trainer's output and exit code come first.

Three layers, each bounded by the same deadline (``cleanup_deadline``):

1. ``Worker.run`` (worker.py) cancels its tasks and waits for them until the deadline
   (``settle``), then kills what is left of its trainer's tree and runs its closes, each
   at most until the deadline (``within``: at least ``FLOOR``, so a deadline eaten by a
   stuck task still lets the standbys be closed), and the decider's goodbye, which keeps
   its own wait for an arbiter that is away (``goodbye_deadline``). Its "exit" event
   names the tasks that did not end.
2. The event loop's own end (``run_bounded``, in place of ``asyncio.run``, whose cleanup
   awaits every task and the default executor's threads without a bound): the tasks left
   are cancelled and waited for until the deadline; the default executor is shut down
   without waiting for its threads.
3. The interpreter's exit joins every non-daemon thread (executor threads included),
   without a bound. ``guard_exit`` arms a daemon thread that, past the deadline, with the
   main thread already exiting (the interpreter is joining threads), names the threads
   still running and ends the process with ``os._exit`` after flushing the log handlers
   and the standard streams (the events file is closed by then: layer 1 wrote the exit).
   ``os._exit`` because nothing else ends a process whose exit waits on a thread: a thread
   cannot be cancelled or killed in Python.

Whatever did not end is named in one error line (``stuck_line``): each task's name and
where it is suspended (file:line of each coroutine it awaits through, outermost first),
or each thread's name and the line it is at. The exit status is the normal path's
(``RunResult.exit_status``: the first failing worker's code, 128+N for signal N): the
bounded path changes when the agent exits, never with what.

The trainer's tree is gone before the agent exits either way: layer 1 and the pod kill
it before the loop ends; ``hard_exit`` SIGKILLs anything of it still there; and the
containment watchdog (containment.py) sweeps after any end of the agent, ``os._exit``
included, as after a SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

log = logging.getLogger("ftagent")

T = TypeVar("T")

# The least a cleanup step is given even past the deadline (a close of the standbys after
# a stuck task ate the budget), and the least the normal cleanup gets after a stop signal
# whose --stop-timeout the trainer used up: a normal cleanup takes milliseconds.
FLOOR = 1.0
# A goodbye to the arbiter waits up to --arbiter-fail-open-after by design
# (ArbiterDecider.close); its bound is that plus this.
GOODBYE_SLACK = 1.0
# How long after arming the exit guard waits at least: the main thread's return into the
# interpreter's exit, which the guard must see begun before it may end the process.
GUARD_SLACK = 1.0
# What the tasks first cancelled at the loop's end get past the deadline (a task that
# ends when cancelled takes a loop step or two; the workers' own had the whole bound).
LAST_LOOK = 0.25
MAX_NAMED = 12  # stuck tasks or threads named in the line (then "and N more")
MAX_FRAMES = 4  # frames per task (the outermost and the innermost kept)


# ----------------------------------------------------------------------------- pure


def cleanup_deadline(now: float, bound: float, stop_deadline: float | None = None) -> float:
    """When the agent's cleanup must be over, the trainer having exited at ``now``:
    ``bound`` (--exit-timeout) later. After a stop signal (``stop_deadline``: the signal's
    time + --stop-timeout, which matches the pod's terminationGracePeriodSeconds, after
    which the kubelet SIGKILLs the agent and its exit code is lost) no later than that,
    but never less than ``FLOOR`` (capped by ``bound``) after ``now``: the trainer's grace
    is never cut (the bound starts at its exit), and the agent's is cut to what is left."""
    end = now + bound
    if stop_deadline is not None:
        end = min(end, max(stop_deadline, now + min(bound, FLOOR)))
    return end


def goodbye_deadline(now: float, deadline: float, wait: float,
                     stop_deadline: float | None = None) -> float:
    """The bound of the goodbye to the arbiter (the decider's close), which waits up to
    ``wait`` (--arbiter-fail-open-after) by design for an arbiter that is away to hear
    how the rank ended: the later of ``deadline`` and that wait (+ ``GOODBYE_SLACK``);
    after a stop signal no later than ``stop_deadline`` (the kubelet's SIGKILL) unless
    ``deadline`` itself is later."""
    if wait <= 0:  # no arbiter: the local policy's close, within the bound
        return deadline
    end = max(deadline, now + wait + GOODBYE_SLACK)
    if stop_deadline is not None:
        end = min(end, max(stop_deadline, deadline))
    return end


@dataclass(frozen=True)
class Stuck:
    """A task or thread that did not end: its name and where it is (``file:line in
    function``, outermost first)."""

    name: str
    where: tuple[str, ...] = ()


def stuck_line(stuck: Sequence[Stuck], status: int, bound: float,
               signalled: bool = False) -> str:
    """The one error line of a bounded exit: what did not end, and where (``signalled``:
    the bound was the stop signal's grace, ``cleanup_deadline``)."""
    named = [f"{s.name!r} at {' -> '.join(s.where) if s.where else '(no frame)'}"
             for s in stuck[:MAX_NAMED]]
    more = f"; and {len(stuck) - MAX_NAMED} more" if len(stuck) > MAX_NAMED else ""
    cut = " (after a stop signal: by --stop-timeout's end at the latest)" if signalled else ""
    return (f"the agent's cleanup did not end within --exit-timeout {bound:g}s of the "
            f"trainer's exit{cut}: exiting with status {status} all the same; still "
            "running: " + "; ".join(named) + more)


def frame_at(filename: str, lineno: int | None, function: str) -> str:
    """``file:line in function``, a file of this package shown from the package's
    directory (``ftagent/watch/loop.py``)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shown = filename
    if filename.startswith(root + os.sep):
        shown = filename[len(root) + 1:]
    return f"{shown}:{lineno} in {function}"


def _at(frame: FrameType) -> str:
    """``frame_at`` of a live frame, its function by qualified name (``Class.method``)."""
    code = frame.f_code
    return frame_at(code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name))


def _kept(frames: list[str], *, inner: bool = False) -> tuple[str, ...]:
    """At most ``MAX_FRAMES``: the outermost ones and the innermost, with "..." between
    (``inner``: the innermost ones, a thread's: its outermost frames are threading's)."""
    if len(frames) <= MAX_FRAMES:
        return tuple(frames)
    if inner:
        return ("...", *frames[-(MAX_FRAMES - 1):])
    return (*frames[:MAX_FRAMES - 2], "...", frames[-1])


# ----------------------------------------------------------------------------- looking


def suspended_at(task: asyncio.Task[Any]) -> tuple[str, ...]:
    """Where ``task`` is suspended: each coroutine (or generator) it awaits through, from
    its own to the innermost (``Task.get_stack`` shows only the task's own frame before
    Python 3.12)."""
    frames: list[str] = []
    obj: Any = task.get_coro()
    for _ in range(64):  # an await chain is short; a cycle is not followed
        frame: FrameType | None = (getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
                                   or getattr(obj, "ag_frame", None))
        if frame is None:
            break
        frames.append(_at(frame))
        obj = (getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
               or getattr(obj, "ag_await", None))
    return _kept(frames)


def stuck_task(task: asyncio.Task[Any]) -> Stuck:
    """``task`` as named in the line: its name, with its coroutine's for an unnamed one."""
    name = task.get_name()
    coro = task.get_coro()
    qual = getattr(coro, "__qualname__", None)
    if name.startswith("Task-") and qual:
        name = f"{name} ({qual})"
    return Stuck(name, suspended_at(task))


def stuck_thread(thread: threading.Thread) -> Stuck:
    """``thread`` as named in the line, with the line its innermost frame is at."""
    frame = sys._current_frames().get(thread.ident or -1)
    frames: list[str] = []
    while frame is not None and len(frames) < 64:
        frames.append(_at(frame))
        frame = frame.f_back
    frames.reverse()
    return Stuck(thread.name, _kept(frames, inner=True))


def blocking_threads() -> list[threading.Thread]:
    """The threads the interpreter's exit would wait for: alive, not daemons, not the
    main thread (executor threads are such threads since Python 3.9)."""
    main = threading.main_thread()
    return [t for t in threading.enumerate()
            if t is not main and not t.daemon and t.is_alive()]


# ----------------------------------------------------------------------------- waiting


async def settle(tasks: Iterable[asyncio.Task[Any]], deadline: float) -> list[asyncio.Task[Any]]:
    """Wait for the (cancelled) ``tasks`` to end, until ``deadline`` (monotonic); the
    ones still running, which the caller leaves behind. The exceptions of those that
    ended are taken as ``gather(return_exceptions=True)`` took them (the caller's to
    look at; never "exception was never retrieved" at exit)."""
    tasks = list(tasks)
    waiting = [t for t in tasks if not t.done()]
    if waiting:
        await asyncio.wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()
    return [t for t in waiting if not t.done()]


async def within(step: Awaitable[T], deadline: float, name: str) -> tuple[bool, T | None]:
    """Run ``step`` as a task named ``name`` until ``deadline`` (at least ``FLOOR``
    seconds): (True, its result) when it ended (its exception raised here), else (False,
    None) and it is cancelled and left behind (the loop's end names it if it stays)."""
    task = asyncio.ensure_future(step)
    if isinstance(task, asyncio.Task):
        task.set_name(name)
    await asyncio.wait({task}, timeout=max(FLOOR, deadline - time.monotonic()))
    if not task.done():
        task.cancel()
        return False, None
    return True, task.result()


def run_bounded(main: Coroutine[Any, Any, T], deadline: Callable[[], float],
                ) -> tuple[T, list[Stuck]]:
    """``asyncio.run(main)`` with a bounded end: once ``main`` returned, the tasks left
    are cancelled and waited for until ``deadline()`` (at least ``LAST_LOOK``), async
    generators closed as long, and the default executor shut down without waiting for
    its threads (``loop.close``). Returns main's result and what did not end by then.
    ``main``'s exception is raised after the same end."""
    loop = asyncio.new_event_loop()
    stuck: list[Stuck] = []
    try:
        asyncio.set_event_loop(loop)
        try:
            return loop.run_until_complete(main), stuck
        finally:
            stuck.extend(loop.run_until_complete(_end_tasks(deadline())))
    finally:
        asyncio.set_event_loop(None)
        loop.close()


async def _end_tasks(deadline: float) -> list[Stuck]:
    """The loop's end, bounded (``run_bounded``)."""
    me = asyncio.current_task()
    rest = [t for t in asyncio.all_tasks() if t is not me]
    for t in rest:
        t.cancel()
    left = await settle(rest, max(deadline, time.monotonic() + LAST_LOOK))
    for t in rest:
        if t.done() and not t.cancelled() and t.exception() is not None:
            log.error("a task failed at exit: %r", t.exception(), exc_info=t.exception())
    ended, _ = await within(asyncio.get_running_loop().shutdown_asyncgens(),
                            deadline, "shutdown_asyncgens")
    stuck = [stuck_task(t) for t in left]
    if not ended:
        stuck.append(Stuck("loop.shutdown_asyncgens"))
    return stuck


# ----------------------------------------------------------------------------- exiting


def hard_exit(status: int) -> None:
    """End the process now with ``status``: what is left of the trainer's tree SIGKILLed,
    the log handlers and the standard streams flushed, then ``os._exit`` (no thread is
    joined, no finalizer run)."""
    from ftagent.agent import supervisor

    with contextlib.suppress(Exception):
        supervisor.signal_tree(signal.SIGKILL)
    for h in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            h.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def guard_exit(status: int, deadline: float, bound: float, signalled: bool = False, *,
               exit_now: Callable[[int], None] = hard_exit) -> threading.Thread:
    """Arm the last layer: a daemon thread that, once the interpreter's exit has begun
    (``exiting``: a hook of threading's exit, which then joins every non-daemon thread,
    executor threads first), at ``deadline`` (``GUARD_SLACK`` from now at least) names
    the threads that exit still waits for, if any, and calls ``exit_now(status)``. An exit
    not begun by then (``main`` called in process, a test) is not the guard's: it returns.

    The hook is ``threading._register_atexit`` (concurrent.futures' own, since 3.9): the
    public ``atexit`` runs only after the threads were joined. Without it, the main
    thread's end is looked at instead (threading stops it before joining the rest)."""
    at = max(deadline, time.monotonic() + GUARD_SLACK)
    exiting = threading.Event()
    hook = getattr(threading, "_register_atexit", None)
    if hook is not None:
        hook(exiting.set)

    def begun() -> bool:
        return exiting.is_set() or not threading.main_thread().is_alive()

    def watch() -> None:
        exiting.wait(max(0.0, at - time.monotonic()))  # the exit begun, or ``at``
        if not begun():
            return
        threading.Event().wait(max(0.0, at - time.monotonic()))  # the rest of the bound
        threads = blocking_threads()
        if not threads:
            return
        log.error("%s", stuck_line([stuck_thread(t) for t in threads], status, bound,
                                   signalled))
        exit_now(status)

    guard = threading.Thread(target=watch, name="ftagent-exit-guard", daemon=True)
    guard.start()
    return guard
