"""One worker: one trainer process, supervised until it succeeds, is stopped, or its
decider ends it.

A :class:`Worker` is built from a :class:`WorkerSpec` (what to run and how: the
configuration, the environment, the local rank under the launcher, the per-attempt
environment and where the output goes) and the pod's process-wide parts it is given (the
SIGCHLD reaper, its decider); pod.py's ``PodAgent`` holds the N workers of one agent
process. Everything flows one way (DESIGN.md): the trainer's output and the sources
produce observations -> detectors turn them into faults -> the decider (the local policy,
or the arbiter's commands) turns faults into actions -> the control loop here carries
actions out on the trainer. Generation, restart count, trainer state and who decided are
the lifecycle's (lifecycle.py); this module reads them and reports what happens to it.
One asyncio loop; the output pumps and blocking libraries are threads that hand their
results to it.

The worker's parts, each a list it iterates, filled in by the composition root
(cmd/run.py): ``sources`` (``async run(emit)``), ``detectors`` (``observe(obs) -> faults``,
``tick(now) -> faults``), ``observers`` (``observe(obs)``, e.g. the metrics sink),
``line_handlers`` and ``fault_hooks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from ftagent.agent import stop_grace, supervisor
from ftagent.agent.decider import Decider, LocalDecider
from ftagent.agent.events import EventsFile, ProgressLog
from ftagent.agent.evidence import redact_secrets
from ftagent.agent.lifecycle import Lifecycle, Step
from ftagent.agent.supervisor import ChildReaper, SpawnError, TrainerProcess
from ftagent.agent.tee import BACKLOG_BYTES, BACKLOG_LINES, LastLines, LineBacklog, Writer
from ftagent.config import RunConfig
from ftagent.model import (
    MINOR_ACTIONS,
    Action,
    ActionKind,
    Fault,
    FaultKind,
    Observation,
    ProcessExit,
    Scope,
    TrainerStart,
    TrainerState,
)
from ftagent.timegrid import sleep_on_grid
from ftagent.watch.loop import Detector, Source  # one definition of a source and a detector

if TYPE_CHECKING:
    from ftagent.metrics import AgentMetrics

log = logging.getLogger("ftagent.agent")

TICK_SECONDS = 0.5
EVIDENCE_LINES = 50  # last lines attached to a fault (the events file keeps them too)
EVIDENCE_STDERR_LINES = 20  # and the last of stderr alone: where tracebacks are
DRAIN_BATCHES = 16  # output batches handled per loop callback before timers get a turn
WORKER_VAR = "FTAGENT_LOCAL_RANK"  # marks a worker's processes, for orphans that left its session


class Observer(Protocol):
    def observe(self, obs: Observation) -> None: ...


def no_attempt_env(attempt: int) -> dict[str, str]:
    """No per-attempt variables (alone; the launcher adds torchrun's)."""
    return {}


def console(attempt: int) -> tuple[int | Writer, int | Writer]:
    """The trainer's output goes to the agent's own stdout and stderr, as is."""
    return 1, 2


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker runs and how (torch elastic's spec, apart from the running
    state): a value, built once by cmd/run.py and never changed."""

    cfg: RunConfig
    environ: Mapping[str, str] = field(default_factory=dict)
    local_rank: int | None = None  # under the launcher (--nproc-per-node); None: alone
    # per attempt: environment on top of the worker's own (torchrun's restart count)
    attempt_env: Callable[[int], Mapping[str, str]] = no_attempt_env
    # per attempt: where stdout/stderr go (fds as is, or the launcher's WorkerOutput)
    outputs: Callable[[int], tuple[int | Writer, int | Writer]] = console


class Worker:
    """Supervises one trainer command until it succeeds, is stopped, or its decider ends it."""

    def __init__(self, spec: WorkerSpec, *, reaper: ChildReaper | None = None,
                 decider: Callable[[Worker], Decider] | None = None,
                 metrics: AgentMetrics | None = None) -> None:
        """``reaper``: the pod's (one per process); ``decider`` builds this worker's
        decider (default: the local policy alone); ``metrics``: its series, if any."""
        self.spec = spec
        self.cfg = cfg = spec.cfg
        self.environ = dict(spec.environ)
        self.ident = cfg.identity
        sup = cfg.supervisor
        static: dict[str, Any] = {"rank": self.ident.rank, "job": self.ident.job}
        if spec.local_rank is not None:
            static["local_rank"] = spec.local_rank
        self.events = EventsFile(sup.events_file, static)
        self.last_lines = LastLines(sup.log_lines)
        self.reaper = reaper if reaper is not None else ChildReaper()
        self.metrics = metrics
        self.actions: asyncio.Queue[Action] = asyncio.Queue()
        self.sources: list[Source] = []
        self.detectors: list[Detector] = []
        self.observers: list[Observer] = [ProgressLog(self.events)] if sup.events_file else []
        # (stream, blob of complete lines joined by b"\n", monotonic time of the read)
        self.line_handlers: list[Callable[[str, bytes, float], None]] = []
        self.fault_hooks: list[Callable[[Fault], None]] = []  # metrics, reporter
        self.evidence: Callable[[Fault, list[int]], Any] | None = None  # async enrich hook
        self.trainer: TrainerProcess | None = None
        # generation, restarts, trainer state, who decided: their one owner (lifecycle.py)
        self.lifecycle = Lifecycle()
        self.stop_signal: int | None = None
        self._stop_event = asyncio.Event()
        self._stop_deadline = 0.0
        self._tasks: list[asyncio.Task[Any]] = []
        self.extra_env: dict[str, str] = {}
        self._inflight: set[asyncio.Task[Any]] = set()
        self._armed: set[tuple[int, float]] = set()  # (id(detector), deadline) timers
        self._backlog: LineBacklog | None = None  # the running trainer's output on its way
        self._hang_faults: set[str] = set()  # ids of this attempt's hang faults
        # this trainer's processes: the agent's whole tree alone, its own under the launcher
        self.tree: Callable[[], list[psutil.Process]] = supervisor.tree \
            if spec.local_rank is None else worker_tree(self, spec.local_rank)
        # who decides: the local policy alone, unless the spec's builder chose another
        self.decider: Decider = decider(self) if decider is not None else LocalDecider(self)
        # the one place a trainer is spawned: the seam warm standbys replace
        self.spawn_trainer: Callable[..., TrainerProcess] = TrainerProcess
        # awaited when this worker's supervision ends, however it ends (the standbys'
        # close): what they started is gone before the agent exits
        self.on_close: list[Callable[[], Awaitable[None]]] = []

    # ----------------------------------------------------------------- lifecycle

    @property
    def generation(self) -> int:
        """The generation this worker's trainer runs or waits for (read-only: lifecycle)."""
        return self.lifecycle.generation

    @property
    def restarts(self) -> int:
        """Restarts carried out by this worker (read-only: lifecycle)."""
        return self.lifecycle.restarts

    @property
    def state(self) -> TrainerState:
        return self.lifecycle.state

    async def run(self) -> int:
        """Supervise this trainer to its end; the pod installed the reaper and signals."""
        self.decider.start()
        try:
            for src in self.sources:
                self._tasks.append(asyncio.create_task(self._run_source(src)))
            self._tasks.append(asyncio.create_task(self._ticker()))
            try:
                code = await self._control_loop()
            finally:
                for t in self._tasks:
                    t.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                if self.tree():  # nothing of this trainer outlives its worker
                    await supervisor.kill_tree(self.trainer.pgid if self.trainer else None,
                                               procs=self.tree)
                for close in self.on_close:
                    try:
                        await close()
                    except Exception:
                        log.exception("closing %r failed", close)
            self.events.write("exit", self.state.value, f"ftagent exits with {code}",
                              exit_status=code, restarts=self.restarts)
            self.events.close()
            return code
        finally:
            await self.decider.close()

    # ----------------------------------------------------------------- the deciders' port
    # What a decider (decider.py, arbiter_decider.py) may do to a worker: read its
    # lifecycle, deliver an action, await its stopping, record; nothing else.

    def deliver(self, action: Action) -> None:
        """An action for this worker's control loop (carried out in order)."""
        self.actions.put_nowait(action)

    def take_delivered(self) -> list[Action]:
        """Actions delivered and not carried out yet, taken off the queue."""
        out = []
        while not self.actions.empty():
            out.append(self.actions.get_nowait())
        return out

    async def stopping(self) -> None:
        """Return once the agent was told to stop (a signal)."""
        await self._stop_event.wait()

    @property
    def stop_requested(self) -> bool:
        return self.stop_signal is not None

    def record(self, action: Action) -> None:
        """An action carried out outside the control loop (a STOP at the barrier, the
        group's decision for a worker that succeeded): the events file and lifecycle."""
        self._record_action(action)

    def spawn(self, coro: Any) -> None:
        """A task of this worker's (a decision watchdog), kept until it is done."""
        self._spawn(coro)

    def tree_pids(self) -> list[int]:
        """The pids of this trainer's tree (evidence, verification, DUMP_STACKS)."""
        return [p.pid for p in self.tree()]

    async def _run_source(self, src: Source) -> None:
        name = type(src).__name__
        try:
            await src.run(self.observe)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken source must not take training down
            log.exception("source %s failed; continuing without it", name)
            self.events.write("fault", FaultKind.AGENT.value, f"source {name} failed: {e}")

    async def _ticker(self) -> None:
        # On the process's grid (timegrid.py): the launcher's N workers tick in one loop
        # wake-up, not N, and the NIC and GPU polls share it.
        while True:
            await sleep_on_grid(TICK_SECONDS)
            if self._backlog is not None and len(self._backlog):
                self._drain_lines(self._backlog, DRAIN_BATCHES)  # see _lines_threadsafe
            now = self.detector_now()
            for d in self.detectors:
                self._tick_detector(d, now)

    def _tick_detector(self, d: Detector, now: float) -> None:
        try:
            faults = d.tick(now)
        except Exception:
            log.exception("detector %s failed", type(d).__name__)
            return
        for f in faults:
            self._spawn(self.raise_fault(f))

    def _arm_deadlines(self) -> None:
        """Tick a detector exactly when its next deadline (a NIC grace) expires, instead of
        at the next periodic tick, up to TICK_SECONDS later. Detectors whose deadlines move
        with every step (hang) keep the periodic tick: seconds of budget, no timer churn."""
        loop = asyncio.get_running_loop()
        for d in self.detectors:
            next_deadline = getattr(d, "next_deadline", None)
            when = next_deadline() if next_deadline is not None else None
            if when is not None and (id(d), when) not in self._armed:
                self._armed.add((id(d), when))
                # +1 ms: a timer may fire a hair early, and the detector wants now > deadline
                loop.call_later(max(0.0, when - time.monotonic()) + 0.001, self._tick_at, d, when)

    def _tick_at(self, d: Detector, when: float) -> None:
        self._armed.discard((id(d), when))
        self._tick_detector(d, time.monotonic())

    def detector_now(self, now: float | None = None) -> float:
        """The detectors' "now": the clock, or while output read earlier still waits in the
        backlog, that output's read time. Observations carry the time their line was read;
        a loop that is behind must not call a hang on data it has not looked at yet."""
        now = time.monotonic() if now is None else now
        oldest = self._backlog.oldest_ts() if self._backlog is not None else None
        return now if oldest is None else min(now, oldest)

    def _spawn(self, coro: Any) -> None:
        """Run a coroutine as a task the agent keeps a reference to until it is done."""
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    # ----------------------------------------------------------------- observations and faults

    def on_lines(self, stream: str, blob: bytes, ts: float) -> None:
        """Called on the loop with complete lines of the trainer's output (one blob)."""
        self.last_lines.add(stream, blob)
        for h in self.line_handlers:
            try:
                h(stream, blob, ts)
            except Exception:
                log.exception("line handler failed")

    def observe(self, obs: Observation) -> None:
        for o in self.observers:
            try:
                o.observe(obs)
            except Exception:
                log.exception("observer %s failed", type(o).__name__)
        for d in self.detectors:
            try:
                faults = d.observe(obs)
            except Exception:
                log.exception("detector %s failed on %s", type(d).__name__, type(obs).__name__)
                continue
            for f in faults:
                self._spawn(self.raise_fault(f))
        self._arm_deadlines()

    def tail(self, n: int = EVIDENCE_LINES, stream: str | None = None) -> list[str]:
        """The last output lines as text; stderr lines are marked unless asked for alone."""
        lines = [(s, redact_secrets(b.decode("utf-8", "replace")))
                 for s, b in self.last_lines.tail(n, stream)]
        if stream is not None:
            return [text for _, text in lines]
        return [f"{s}: {text}" if s == "stderr" else text for s, text in lines]

    async def raise_fault(self, fault: Fault, *, decide: bool = True) -> None:
        """Record a fault (with evidence) and ask the decider what to do about it.

        ``decide`` False: a decision is already at hand (it arrived with the trainer's
        exit); the fault is recorded and reported, not decided again."""
        if fault.kind == FaultKind.HANG and self._exited_by_itself():
            return
        attempt = self.trainer
        if self.evidence is not None and fault.kind == FaultKind.HANG and attempt:
            try:
                fault = await self.evidence(fault, self.tree_pids())
            except Exception:
                log.exception("capturing evidence failed")
            if self.trainer is not attempt:
                # a decision (a restart for another rank's fault) ended the attempt while
                # the evidence was gathered: this hang is of a trainer that is gone, and
                # reported now it would count against the next generation's
                log.info("hang of a previous attempt dropped: %s", fault.message)
                return
            if self._exited_by_itself():  # during the capture: the exit wins
                return
        if fault.kind == FaultKind.HANG:
            self._hang_faults.add(fault.id)
        log.warning("fault %s: %s", fault.kind.value, fault.message)
        self.events.write("fault", fault.kind.value, fault.message, fault_id=fault.id,
                          severity=fault.severity.value, scope=fault.scope.value,
                          **fault.evidence)
        for hook in self.fault_hooks:
            try:
                hook(fault)
            except Exception:
                log.exception("fault hook failed")
        if decide:
            self.decider.decide(fault)
        else:
            self.decider.report(fault)

    def _exited_by_itself(self) -> bool:
        """The trainer's own exit wins over a hang raised after it, or while the exit is
        still waiting for the loop (the SIGCHLD not handled yet: a peek, not a reap)."""
        t = self.trainer
        if t is None:
            return False
        gone = not t.running or _zombie(t.pid)
        if gone:
            log.info("hang fault dropped: the trainer (pid %d) exited by itself", t.pid)
        return gone

    # ----------------------------------------------------------------- the control loop

    async def _control_loop(self) -> int:
        while True:
            if self.stop_signal is not None:
                return 128 + self.stop_signal
            self._apply(self.lifecycle.waiting())
            go = await self.decider.before_start()
            if go is not None:  # the arbiter said STOP/REPLACE before we started
                return self._exit_code_of(go, None)
            if self.stop_signal is not None:
                return 128 + self.stop_signal
            try:
                self.trainer = self._start()
            except SpawnError as e:
                log.error("%s", e)
                self.events.write("fault", FaultKind.CRASH.value, str(e),
                                  exit_status=e.exit_status)
                return e.exit_status
            action, exit_ = await self._supervise(self.trainer)
            if action is None and exit_ is not None and exit_.ok:
                action = await self.decider.finished()  # a peer's failure restarts all
            if action is None:  # finished: success, or stopped by a signal
                assert exit_ is not None
                return exit_.exit_status
            if action.kind == ActionKind.RESTART:
                # the arbiter names the job's new generation; a local restart counts up
                self._apply(self.lifecycle.restart(action))
                await self._interruptible_sleep(action.backoff_seconds)
                continue
            return self._exit_code_of(action, exit_)

    def _exit_code_of(self, action: Action, exit_: ProcessExit | None) -> int:
        """The worker ends on ``action``: its exit status (lifecycle.exit_status_of)."""
        sup = self.cfg.supervisor
        code, step = self.lifecycle.failed(action, exit_, exit_replace=sup.exit_replace,
                                           exit_stop=sup.exit_stop)
        self._apply(step)
        return code

    def _start(self) -> TrainerProcess:
        env = dict(self.environ)
        env["FTAGENT_RESTART_COUNT"] = str(self.restarts)
        env["FTAGENT_GENERATION"] = str(self.generation)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(self.extra_env)
        env.update(self.spec.attempt_env(self.restarts))
        self._hang_faults.clear()
        out, err = self.spec.outputs(self.restarts)
        trainer = self.spawn_trainer(self.cfg.command, env, self.reaper,
                                     self._lines_threadsafe(), stdout_fd=out, stderr_fd=err,
                                     output_interval=self.cfg.supervisor.output_interval)
        self._apply(self.lifecycle.running(trainer.pid))
        self.observe(TrainerStart(trainer.pid, self.restarts, self.generation,
                                  ts=trainer.started))
        return trainer

    def _lines_threadsafe(self) -> Callable[[str, bytes, float], None]:
        """The pumps' callback: queue the batch in a bounded backlog, never block.

        The loop is not woken per batch: the ticker drains the backlog every
        TICK_SECONDS, on the grid every worker shares, so N workers' output costs one
        loop wake-up per tick instead of one self-pipe write and read per line (the
        launcher's own CPU against torchrun's: bench/restart.py --overhead). What that
        delays is only the *handling*: each batch keeps its read time, the detectors'
        "now" stays at the oldest batch not yet handled (detector_now), and a trainer's
        exit drains everything before its crash is judged. A backlog growing past an
        eighth of its bounds wakes the loop at once; a drain handles at most
        ``DRAIN_BATCHES`` and yields (timers, the trainer's exit, signals get their turn);
        past the backlog's bounds the oldest batches are dropped, never the trainer slowed.
        """
        loop = asyncio.get_running_loop()
        backlog = self._backlog = LineBacklog(wake_bytes=BACKLOG_BYTES // 8,
                                              wake_lines=BACKLOG_LINES // 8)

        def hop(stream: str, blob: bytes, ts: float) -> None:
            if backlog.put(stream, blob, ts):
                loop.call_soon_threadsafe(self._drain_lines, backlog, DRAIN_BATCHES)

        return hop

    def _drain_lines(self, backlog: LineBacklog, n: int) -> None:
        """Hand up to ``n`` queued batches to ``on_lines``; reschedule if more wait."""
        for batch in backlog.take(n):
            self.on_lines(*batch)
        dropped = backlog.new_drops()
        if dropped:
            self._count_skipped("backlog", dropped)
            if dropped == backlog.dropped_lines:  # the first drop of this trainer
                log.warning("the agent's loop fell behind the trainer's output: the oldest "
                            "lines go unparsed (ftagent_log_lines_skipped_total)")
        if n < 1 << 30 and len(backlog):
            asyncio.get_running_loop().call_soon(self._drain_lines, backlog, n)

    def _drain_all(self) -> None:
        """Everything the pumps have queued, handled now (the trainer's exit)."""
        if self._backlog is not None:
            self._drain_lines(self._backlog, 1 << 30)

    def _count_skipped(self, reason: str, lines: int) -> None:
        """Output lines not parsed for progress, in ``ftagent_log_lines_skipped_total``."""
        if self.metrics is not None:
            self.metrics.log_lines_skipped.labels(**self.metrics.identity,
                                                  reason=reason).inc(lines)

    async def _supervise(
        self, trainer: TrainerProcess
    ) -> tuple[Action | None, ProcessExit | None]:
        """Run until the trainer exits or an action ends this attempt."""
        stop_wait = asyncio.create_task(self._stop_event.wait())
        try:
            while True:
                get_action = asyncio.create_task(self.actions.get())
                waits: set[asyncio.Future[Any]] = {trainer.exited, get_action, stop_wait}
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if get_action not in done:
                    get_action.cancel()
                # An action that arrives with (or just after) the trainer's own exit is
                # held, not lost: the exit is handled first (its crash is recorded with its
                # evidence), then the action is carried out -- unless it answered this
                # attempt's hang, which the exit supersedes.
                held: Action | None = None
                if get_action in done:
                    held = get_action.result()
                    if self.lifecycle.carried_out(held.id):  # delivered twice: done once
                        held = None
                        if trainer.exited not in done and stop_wait not in done:
                            continue
                if held is not None:
                    if trainer.exited not in done and _zombie(trainer.pid):
                        await asyncio.shield(trainer.exited)
                        done = {trainer.exited}
                    if trainer.exited in done and held.fault_id in self._hang_faults:
                        log.info("action %s superseded: the trainer exited by itself",
                                 held.kind.value)
                        held = None
                if trainer.exited in done:
                    exit_ = trainer.exited.result()
                    await self._after_exit(trainer, exit_)
                    if self.stop_signal is not None:
                        self._apply(self.lifecycle.stopped(exit_.exit_status,
                                                           self.stop_signal))
                        return None, exit_
                    if exit_.ok:
                        self._apply(self.lifecycle.succeeded())
                        return None, exit_
                    await self.raise_fault(self._crash_fault(exit_), decide=held is None)
                    return await self._next_action(held), exit_
                if stop_wait in done:
                    exit_ = await self._stop_trainer(trainer, self._stop_deadline)
                    self._apply(self.lifecycle.stopped(exit_.exit_status, self.stop_signal))
                    return None, exit_
                assert held is not None
                action = held
                self._record_action(action)
                if action.kind in MINOR_ACTIONS:
                    await self.decider.on_minor_action(action)
                    continue
                exit_ = await self._stop_trainer(
                    trainer, time.monotonic() + self.cfg.supervisor.stop_timeout)
                return action, exit_
        finally:
            stop_wait.cancel()

    async def _next_action(self, held: Action | None = None) -> Action:
        """The decision that ends this attempt after the trainer exited by itself (``held``:
        one that arrived with the exit); minor actions are carried out on the way, and
        decisions on this attempt's hangs (raised before the exit was handled) are
        superseded by the exit's own."""
        while True:
            if held is not None:
                action, held = held, None
            else:
                action = await self.actions.get()
            if self.lifecycle.carried_out(action.id):  # delivered twice: done once
                continue
            if action.fault_id in self._hang_faults:
                log.info("action %s superseded: the trainer exited by itself",
                         action.kind.value)
                continue
            self._record_action(action)
            if action.kind not in MINOR_ACTIONS:
                return action
            await self.decider.on_minor_action(action)

    def _record_action(self, action: Action) -> None:
        self.lifecycle.decided(action)
        log.info("action %s (%s): %s", action.kind.value, action.origin.value, action.reason)
        self.events.write("action", action.kind.value, action.reason, action_id=action.id,
                          generation=action.generation, fault_id=action.fault_id,
                          origin=action.origin.value,
                          backoff_seconds=action.backoff_seconds, exit_code=action.exit_code)

    def _crash_fault(self, exit_: ProcessExit) -> Fault:
        how = (f"killed by signal {exit_.signal} ({signal.Signals(exit_.signal).name})"
               if exit_.signal is not None else f"exited with code {exit_.code}")
        return Fault(FaultKind.CRASH, f"trainer (pid {exit_.pid}) {how}", scope=Scope.PROCESS,
                     evidence={"exit_status": exit_.exit_status, "exit_code": exit_.code,
                               "signal": exit_.signal, "attempt": self.restarts,
                               "last_lines": self.tail(),
                               # the traceback, whatever order the two pipes were read in
                               "last_stderr_lines": self.tail(EVIDENCE_STDERR_LINES, "stderr")})

    async def _after_exit(self, trainer: TrainerProcess, exit_: ProcessExit) -> None:
        """The main process is gone: clean up what it left, read its last output."""
        self._drain_all()  # what it printed before it exited comes first
        self.observe(exit_)
        self.events.write("state", "exited", f"trainer exited with status {exit_.exit_status}",
                          exit_status=exit_.exit_status, exit_code=exit_.code,
                          signal=exit_.signal, pid=exit_.pid)
        if self.tree():
            deadline = self._stop_deadline if self.stop_signal is not None else \
                time.monotonic() + self.cfg.supervisor.stop_timeout
            killed = await supervisor.stop_tree(None, max(0.0, deadline - time.monotonic()),
                                                procs=self.tree)
            if killed:
                log.warning("SIGKILLed %d leftover process(es) of the trainer", killed)
        if not await trainer.drain(2.0):
            log.warning("trainer output did not reach EOF; last lines may be missing")
        self._drain_all()  # the last lines before the crash fault's evidence

    async def _stop_trainer(self, trainer: TrainerProcess, deadline: float) -> ProcessExit:
        """SIGTERM the trainer's group and tree, SIGKILL whatever is left at ``deadline``."""
        if trainer.running:
            log.info("stopping trainer (pid %d)", trainer.pid)
            if self.stop_signal is None:  # our own stop: SIGTERM the group and the tree
                trainer.send_signal(signal.SIGTERM)
                supervisor.signal_tree(signal.SIGTERM, self.tree())
            # a stop signal was already forwarded as-is: the trainer's handler decides, for
            # as long as it is installed (stop_grace: not the torch teardown after it)
            if self.stop_signal is None:
                await stop_grace.wait_stopped(trainer.exited,
                                              lambda: [p.pid for p in self.tree()],
                                              signal.SIGTERM, deadline)
            else:
                await stop_grace.wait_stopped(trainer.exited, lambda: [trainer.pid],
                                              self.stop_signal, deadline)
        if trainer.running:
            killed = await supervisor.kill_tree(trainer.pgid, procs=self.tree)
            log.warning("trainer ignored SIGTERM for %.1fs: SIGKILLed %d process(es)",
                        self.cfg.supervisor.stop_timeout, killed)
        exit_ = await trainer.exited
        await self._after_exit(trainer, exit_)
        return exit_

    async def _interruptible_sleep(self, seconds: float) -> bool:
        """Sleep unless a stop signal arrives; True if the sleep completed."""
        if seconds <= 0:
            return self.stop_signal is None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop_event.wait(), seconds)
        return self.stop_signal is None

    # ----------------------------------------------------------------- signals and state

    def on_signal(self, sig: int) -> None:
        """A stop signal to the agent (the pod forwards it to every worker)."""
        if self.stop_signal is not None:  # a second signal: no more grace
            log.warning("second %s: killing the trainer's tree now", signal.Signals(sig).name)
            self._stop_deadline = time.monotonic()
            self._spawn(supervisor.kill_tree(self.trainer.pgid if self.trainer else None,
                                             procs=self.tree))
            return
        self.stop_signal = sig
        self._stop_deadline = time.monotonic() + self.cfg.supervisor.stop_timeout
        log.info("received %s: forwarding to the trainer, stop timeout %.0fs",
                 signal.Signals(sig).name, self.cfg.supervisor.stop_timeout)
        if self.trainer is not None and self.trainer.running:
            self.trainer.send_signal(sig)
        self._stop_event.set()

    def _apply(self, step: Step) -> None:
        """Carry out a lifecycle step at the edges: the events file, the observers."""
        self.events.write("state", step.state.value, f"trainer {step.state.value}",
                          restarts=step.restarts, generation=step.generation, **step.fields)
        for o in self.observers:
            hook = getattr(o, "on_state", None)
            if hook is not None:
                try:
                    hook(step.state, step.restarts)
                except Exception:
                    log.exception("state hook failed")


def _zombie(pid: int) -> bool:
    """``pid`` has exited and waits to be reaped (WNOWAIT: the reaper still gets it)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return info is not None and info.si_pid == pid


def worker_tree(worker: Worker, local_rank: int) -> Callable[[], list[psutil.Process]]:
    """The processes of one worker's trainer: its session (the trainer leads one), and
    what carries the worker's marker (an orphan that called setsid, a previous attempt's
    leftover); never a peer worker's."""
    mark = str(local_rank)

    def tree() -> list[psutil.Process]:
        sid = worker.trainer.pid if worker.trainer is not None else None
        mine = []
        for p in supervisor.tree():
            try:
                in_session = sid is not None and (p.pid == sid or os.getsid(p.pid) == sid)
                if in_session or p.environ().get(WORKER_VAR) == mark:
                    mine.append(p)
            except (psutil.Error, OSError):
                continue
        return mine

    return tree
