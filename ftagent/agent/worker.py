"""One worker: one trainer process, supervised until it succeeds, is stopped, or its
decider ends it.

A :class:`Worker` is built from a ``WorkerSpec`` (worker_spec.py: what to run and how: the
configuration, the environment, the local rank under the launcher, the per-attempt
environment and where the output goes) and the pod's process-wide parts it is given (the
SIGCHLD reaper, the pod's one decider); pod.py's ``PodAgent`` holds the N workers of
one agent process. Everything flows one way (DESIGN.md): the trainer's output and the sources
produce observations -> detectors turn them into faults -> the decider (the local policy,
or the arbiter's commands) turns faults into actions -> the control loop here carries
actions out on the trainer. Rank, generation, restart count, trainer state, the stop
request and who decided are the lifecycle's (lifecycle.py); this module reads them and
reports what happens to it: the trainer's RANK, the events' rank and the metrics' rank
label follow the lifecycle's rank (a spare taking over a rank), compared where used.
One asyncio loop; the output pumps and blocking libraries are threads that hand their
results to it.

The worker's parts (sources, detectors, observers, line handlers, fault hooks, evidence,
the trainer's extra environment, its spawn and what to close at the end) come in through
the constructor as one :class:`~ftagent.agent.worker_parts.WorkerParts` value, built by
the composition root (cmd/run.py): a worker is complete when built, and nothing outside
this module sets its attributes (tests/unit/test_worker_seams.py).

The worker is the composition; each job it does by way of a module of its own:
line_feed.py (the trainer's output from the pump threads to the loop, and the detectors'
"now"), trainer_exec.py (an attempt's environment, which processes are its trainer's),
supervisor.py (the trainer's process: its spawn, its exit, its stop),
worker_evidence.py (the last lines, the crash fault, the hang fault's enrichment),
worker_parts.py (what it is made of), and watch/loop.py (its sources -> observers ->
detectors -> faults: the loop the node's GPUs and links run in too). What stays here: the
control loop (start, supervise, carry out actions), the deciders' port (seat.py ``Seat``:
six members; deciders never import this module), fault intake (the evidence, the events
file, the decider), the signals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import signal
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ftagent.agent import supervisor
from ftagent.agent.decider import Decider, LocalDecider
from ftagent.agent.events import EventsFile, ProgressLog
from ftagent.agent.evidence import capture
from ftagent.agent.lifecycle import Lifecycle, Step
from ftagent.agent.line_feed import LineFeed
from ftagent.agent.shutdown import cleanup_deadline, goodbye_deadline, settle, within
from ftagent.agent.supervisor import (
    ChildReaper,
    SpawnError,
    TrainerProcess,
    Tree,
    clear_leftovers,
    exited,
    terminate,
    zombie,
)
from ftagent.agent.tee import LastLines
from ftagent.agent.trainer_exec import RESUME_VAR, attempt_env, worker_tree
from ftagent.agent.worker_evidence import EVIDENCE_LINES, crash_fault, tail
from ftagent.agent.worker_parts import (
    Close,
    Evidence,
    LineHandler,
    Observer,
    Spawn,
    TrainerWatch,
    WorkerParts,
)
from ftagent.agent.worker_spec import WorkerSpec, console, no_attempt_env
from ftagent.config import IdentityConfig
from ftagent.model import (
    MINOR_ACTIONS,
    Action,
    ActionKind,
    Fault,
    FaultKind,
    Observation,
    ProcessExit,
    TrainerStart,
    TrainerState,
)
from ftagent.waits import until_set  # cancellable when woken as it is cancelled
from ftagent.watch.loop import WatchLoop

if TYPE_CHECKING:
    from ftagent.agent.seat import Seat
    from ftagent.metrics import AgentMetrics

log = logging.getLogger("ftagent.agent")

TICK_SECONDS = 0.5


__all__ = ["Worker", "WorkerSpec", "console", "no_attempt_env"]  # the spec's own module


class Worker:
    """Supervises one trainer command until it succeeds, is stopped, or its decider ends it."""

    def __init__(self, spec: WorkerSpec, *, reaper: ChildReaper | None = None,
                 decider: Decider | None = None,
                 metrics: AgentMetrics | None = None,
                 parts: Callable[[Worker], WorkerParts] | None = None) -> None:
        """``reaper``: the pod's (one per process); ``decider``: the pod's, where this
        worker takes a seat (default: the local policy, for it alone); ``metrics``: its
        series, if any; ``parts`` builds its parts (worker_parts.py; default: none, a cold
        spawn), called once, with the worker seated at its decider: it reads the worker
        (the methods its parts call back, the events file, the decider's session) and
        returns a value; it sets nothing on it."""
        self.spec = spec
        self.cfg = cfg = spec.cfg
        self.environ = dict(spec.environ)
        sup = cfg.supervisor
        # rank, generation, restarts, trainer state, the stop request, who decided: their
        # one owner (lifecycle.py); everything here and in the parts reads them there
        # the desired state moving (a decision, a release, a stop) sets this event: the
        # control loop's one wake-up (the reconciler's), set in the loop by the link's read
        # loop or a decider, never a queue
        self._change = asyncio.Event()
        # the detectors' ticker's wake-up (_ticker): an observation moved the earliest due
        # time, or a part's next due time moved (HangParts.wake)
        self._tick_wake = asyncio.Event()
        self._tick_stale = False  # set with it by wake_ticker: refresh, not just re-sleep
        self.lifecycle = Lifecycle(rank=cfg.identity.rank, spare=cfg.identity.spare,
                                   on_change=self._change.set)
        fixed: dict[str, Any] = {"job": cfg.identity.job}
        if spec.local_rank is not None:
            fixed["local_rank"] = spec.local_rank
        self.events = EventsFile(sup.events_file, fixed, ranked=self.lifecycle)
        self.write = self.events.write  # type: ignore[method-assign]  # the seat's write
        self.last_lines = LastLines(sup.log_lines)
        self.reaper = reaper if reaper is not None else ChildReaper()
        self.metrics = metrics
        if metrics is not None:  # read at scrape time: the lifecycle says whether a spare
            metrics.spare.set_function(lambda: float(self.lifecycle.spare))
        # a list: the arbiter decider adds its link's observer as it is built (decider.py)
        self.observers: list[Observer] = [ProgressLog(self.events)] if sup.events_file else []
        self.trainer: TrainerProcess | None = None
        self._stop_event = asyncio.Event()
        self._stop_deadline = 0.0
        self._tasks: list[asyncio.Task[Any]] = []
        self._inflight: set[asyncio.Task[Any]] = set()
        # the trainer's output on its way from the pumps to on_lines (line_feed.py)
        self.feed = LineFeed(self.on_lines, self._count_skipped, wake=self._tick_wake.set)
        self._hang_faults: set[str] = set()  # ids of this attempt's hang faults
        # a decision to carry out whose action line goes with its state's (``_apply``)
        self._unrecorded: Action | None = None
        # this trainer's processes: the agent's whole tree alone, its own under the launcher
        self.tree: Tree = supervisor.tree if spec.local_rank is None \
            else worker_tree(lambda: self.trainer, spec.local_rank)
        # who decides: the pod's decider (one for all its workers), through the port below
        self.decider: Decider = decider if decider is not None else LocalDecider()
        # its parts, copied in once (worker_parts.py says what each is for)
        p = parts(self) if parts is not None else WorkerParts()
        hooks = p.hooks if p.hooks.stacks is not None else dataclasses.replace(
            p.hooks, stacks=self._stacks)
        if hooks.preflight is None:
            hooks = dataclasses.replace(hooks, preflight=self._preflight_again)
        # seated with the rank's hooks before the watch loop is made: the decider may add
        # an observer (the arbiter's link), which hears everything before the parts do
        self.observers.extend(self.decider.add(self, hooks))
        self.observers.extend(p.observers)
        self.detectors = p.detectors  # read-only: the wiring finds the hang verifiers here
        # its sources -> observers -> detectors -> raise_fault: the one watch loop's shape
        # (watch/loop.py); ticked by this worker (_ticker: after the output is handled)
        self.watch = WatchLoop([TrainerWatch("trainer", p.sources, self.detectors)],
                               self.raise_fault, observers=[o.observe for o in self.observers],
                               on_error=self._source_failed, tick_seconds=None,
                               wake=self._tick_wake)
        self.line_handlers: tuple[LineHandler, ...] = p.line_handlers
        self.fault_hooks: tuple[Callable[[Fault], None], ...] = p.fault_hooks  # metrics
        self.evidence: Evidence | None = p.evidence  # the hang fault's async enrichment
        self.before_start = p.before_start  # awaited just before each trainer starts
        self.before_barrier = p.before_barrier  # awaited before each barrier (preflight)
        self.extra_env: Mapping[str, str] = dict(p.env)
        # the step the arbiter's last RESTART said every rank's snapshot holds: the next
        # attempt's FTAGENT_RESUME_STEP (ftagent.checkpoint.load loads it)
        self.resume_step: int | None = None
        self.spawn_trainer: Spawn = p.spawn  # the one place a trainer is started
        # what the standbys started is gone before the agent exits
        self.on_close: tuple[Close, ...] = p.on_close
        # when this worker's cleanup must be over (shutdown.py): set as its trainer's last
        # exit ends the control loop; the process's end waits for the latest of them
        self.exit_deadline: float | None = None

    # ----------------------------------------------------------------- lifecycle

    @property
    def ident(self) -> IdentityConfig:
        """Who this worker is: as configured, with the lifecycle's rank (read-only)."""
        life = self.lifecycle
        return dataclasses.replace(self.cfg.identity, rank=life.rank, spare=life.spare)

    @property
    def stop_signal(self) -> int | None:
        """The stop signal the agent was sent (read-only: lifecycle)."""
        return self.lifecycle.stop_signal

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
        self.decider.start(self)
        stop = None
        try:
            self._tasks.append(asyncio.create_task(self.watch.run(), name=self._named("watch")))
            self._tasks.append(asyncio.create_task(self._ticker(), name=self._named("ticker")))
            try:
                code = await self._control_loop()
            finally:
                # the trainer is gone: the cleanup is bounded (shutdown.py), a task that
                # does not end when cancelled is left behind, named, not awaited forever
                stop = self._stop_deadline if self.stop_signal is not None else None
                self.exit_deadline = cleanup_deadline(
                    time.monotonic(), self.cfg.supervisor.exit_timeout, stop)
                for t in self._tasks:
                    t.cancel()
                stuck = await settle(self._tasks, self.exit_deadline)
                if self.tree():  # nothing of this trainer outlives its worker
                    await supervisor.kill_tree(self.trainer.pgid if self.trainer else None,
                                               procs=self.tree)
                for close in self.on_close:
                    try:
                        await within(close(), self.exit_deadline, self._named("close"))
                    except Exception:
                        log.exception("closing %r failed", close)
            more = {"stuck": [t.get_name() for t in stuck]} if stuck else {}
            self.events.write("exit", self.state.value, f"ftagent exits with {code}",
                              exit_status=code, restarts=self.restarts, **more)
            self.events.close()
            return code
        finally:
            now = time.monotonic()
            if self.exit_deadline is None:  # it broke before its control loop
                self.exit_deadline = cleanup_deadline(now, self.cfg.supervisor.exit_timeout)
            # the goodbye waits up to --arbiter-fail-open-after for an arbiter that is away
            arb = self.cfg.arbiter
            goodbye = goodbye_deadline(
                now, self.exit_deadline, arb.arbiter_fail_open_after if arb.arbiter else 0.0,
                stop)
            try:
                await within(self.decider.close(self), goodbye, self._named("goodbye"))
            except Exception:  # the trainer's exit status comes first, not this fault's
                log.exception("telling the decider how this rank ended failed")

    def _named(self, what: str) -> str:
        """A name for one of this worker's tasks (a stuck one is named at exit)."""
        local = self.spec.local_rank
        return f"{what} (worker {local})" if local is not None else what

    # ----------------------------------------------------------------- the deciders' port
    # What a decider (decider.py, arbiter_decider.py) may use of a worker (seat.py Seat):
    # lifecycle, cfg, changed, stopping, write; nothing else. A decision is delivered by
    # moving the lifecycle's desired state (Lifecycle.want), which wakes this worker.

    async def changed(self, timeout: float | None = None) -> None:
        """Return once the lifecycle's desired state moved since the last return (a
        decision wanted, a barrier released, a rank assigned, a stop), or after
        ``timeout`` seconds. The caller compares again: a wake-up may find nothing."""
        if not self._change.is_set():
            await until_set(self._change, timeout)  # cancellable: the seat may be ending
        self._change.clear()

    async def stopping(self) -> None:
        """Return once the agent was told to stop (a signal)."""
        await self._stop_event.wait()

    def write(self, event: str, kind: str, message: str, **fields: Any) -> Any:
        """One line of the events file (its rank: the lifecycle's). Replaced in the
        constructor by the events file's own ``write``: no hop through the worker."""
        return self.events.write(event, kind, message, **fields)

    async def _stacks(self) -> dict[str, Any]:
        """DUMP_STACKS without a verifier: the stacks of this trainer's tree."""
        return await capture(self.tree_pids(), self.cfg.hang.hang_dump_timeout)

    def tree_pids(self) -> list[int]:
        """The pids of this trainer's tree (evidence, verification, DUMP_STACKS)."""
        return [p.pid for p in self.tree()]

    def _source_failed(self, name: str, e: BaseException) -> None:
        """A broken source must not take training down: one event, the others go on."""
        self.events.write("fault", FaultKind.AGENT.value, f"source {name} failed: {e}")

    async def _ticker(self) -> None:
        # Two clocks. The trainer's output is drained on the process's grid (timegrid.py's
        # rule, here in place: the pumps never wake the loop while output flows, so the
        # launcher's N workers handle their output in one loop wake-up per 0.5 s, not one
        # per line). The detectors are deadline-driven: ticked when their earliest due
        # time comes (WatchLoop.due: the hang budget's end, the verifier's next sample,
        # the dead-still watch's next look; between two grid points too) or after a wake
        # (an observation that moved it earlier, a verdict, a deferred budget). A look
        # that finds no output waiting (a stall, a quiet phase) leaves the grid
        # (``LineFeed.quiet``): the ticker sleeps until the detectors' due time, and the
        # pumps wake it with the next batch, which is handled at once (before: a wake-up
        # every 0.5 s that found nothing, the whole of a hang's budget and verification).
        loop = asyncio.get_running_loop()
        feed, watch, wake = self.feed, self.watch, self._tick_wake
        lag = 0.0  # how far the detectors' clock (output not handled yet) is behind
        again = False  # the last tick left something due at once: the grid, never a spin
        while True:
            # the grid (output flows, or a polled detector) or the earliest due time,
            # whichever comes first; quiet: the due time alone (None: until a wake); +1 ms:
            # a budget ends when now > its deadline, and a timer may fire early
            until = watch.due + lag - time.monotonic() + 0.001
            # a polled detector keeps the grid; so does a tick that left something due at
            # once (``again``: the grid, never a spin)
            quiet = feed.quiet and not watch.polled and not again
            if quiet:
                wait: float | None = until if until < math.inf else None
            else:
                grid = TICK_SECONDS - loop.time() % TICK_SECONDS
                wait = grid if again else min(until, grid)
            if (wait is None or wait > 0) and not wake.is_set():
                # cancellable even when woken in the step it is cancelled in (until_set):
                # run() cancels it as the worker ends, perhaps right after a part woke it
                # (a verification ending at the exit), and awaits it
                await until_set(wake, wait)
            b = feed.backlog
            if wake.is_set():
                wake.clear()
                if self._tick_stale:  # a part's time moved: ask the detectors again
                    self._tick_stale = False  # (an observation asked them itself)
                    watch.refresh(time.monotonic())
                again = False
                if not quiet or feed.quiet or b is None or not b.pending:
                    continue
                # the pumps' first batch after a quiet spell (they cleared ``quiet``):
                # handled now, then the grid
            # the output waiting (LineFeed.pumps_callback), then the detectors' "now";
            # nothing waiting: the clock, without a call into the feed
            if b is not None and b.pending:
                now = feed.tick()
            else:
                now = time.monotonic()
                if not watch.polled:  # off the grid until the pumps say there is output
                    feed.quiet = True
                    if b is not None and b.pending:  # a batch came as it was set
                        feed.quiet = False
            lag = max(0.0, time.monotonic() - now)
            if watch.due <= now or watch.polled:
                watch.tick(now)
                again = watch.due <= now
            else:
                again = False

    def wake_ticker(self) -> None:
        """A detector's next due time moved outside an observation (a verdict came, a
        budget was deferred): the ticker asks again (HangParts.wake)."""
        self._tick_stale = True
        self._tick_wake.set()

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
        """An observation of this trainer's (its start, its exit, its progress lines):
        the observers, then the detectors (WatchLoop.emit)."""
        self.watch.emit(obs)

    def tail(self, n: int = EVIDENCE_LINES, stream: str | None = None) -> list[str]:
        """The last output lines as text (worker_evidence.tail)."""
        return tail(self.last_lines, n, stream)

    async def raise_fault(self, fault: Fault, *, decide: bool = True) -> None:
        """Record a fault (with evidence) and ask the decider what to do about it.

        ``decide`` False: a decision is already at hand (it arrived with the trainer's
        exit); the fault is recorded and reported, not decided again."""
        if fault.kind == FaultKind.HANG and self._exited_by_itself():
            return
        attempt = self.trainer
        if self.evidence is not None and fault.kind == FaultKind.HANG and attempt:
            # the tree listed only if the hook captures (a verified hang carries its stacks);
            # a capture that fails never loses the fault: it goes as it was
            try:
                fault = await self.evidence(fault, self.tree_pids)
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
        if fault.evidence.get("waiting_in_collective") is True:
            # a question to the arbiter (compare the ranks), not a fault: waiting is a
            # state (issue 35); the arbiter's answer (BUSY or a restart) is recorded
            log.info("asking the arbiter: %s", fault.message)
            self.events.write("peer", "asking", fault.message, fault_id=fault.id,
                              **fault.evidence)
        else:
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
            self.decider.decide(self, fault)
        else:
            self.decider.report(self, fault)

    def _exited_by_itself(self) -> bool:
        """The trainer's own exit wins over a hang raised after it, or while the exit is
        still waiting for the loop (the SIGCHLD not handled yet: a peek, not a reap)."""
        t = self.trainer
        if t is None:
            return False
        gone = exited(t)
        if gone:
            log.info("hang fault dropped: the trainer (pid %d) exited by itself", t.pid)
        return gone

    # ----------------------------------------------------------------- the control loop

    async def _control_loop(self) -> int:
        while True:
            if self.stop_signal is not None:
                return 128 + self.stop_signal
            self._apply(self.lifecycle.waiting())
            failed = await self._before_barrier()
            go = await wait_at_barrier(self.decider, self)
            if go is not None:  # the arbiter said STOP/REPLACE before we started
                self._record_action(go)  # a decider's hook returned it
            elif failed:
                go = self._decisive()  # the local policy's answer to it, already delivered
            if go is not None:
                return self._exit_code_of(go, None)
            if self.stop_signal is not None:
                return 128 + self.stop_signal
            env = self.next_env()  # this attempt's, once: the hooks and the spawn share it
            for hook in self.before_start:
                await hook(env)
            try:
                self.trainer = self._start(env)
            except SpawnError as e:
                log.error("%s", e)
                self.events.write("fault", FaultKind.CRASH.value, str(e),
                                  exit_status=e.exit_status)
                return e.exit_status
            action, exit_ = await self._supervise(self.trainer)
            if action is None and exit_ is not None and exit_.ok:
                action = await self.decider.finished(self)  # a peer's failure restarts all
                if action is not None:
                    self._record_action(action)
            if action is None:  # finished: success, or stopped by a signal
                assert exit_ is not None
                return exit_.exit_status
            if action.kind == ActionKind.RESTART:
                # the arbiter names the job's new generation; a local restart counts up
                self._apply(self.lifecycle.restart(action))
                # and the step every rank's snapshot holds (None: the trainer finds one)
                self.resume_step = action.resume_step
                await self._interruptible_sleep(action.backoff_seconds)
                continue
            return self._exit_code_of(action, exit_)

    async def _before_barrier(self) -> bool:
        """The before-barrier parts (preflight): a fault one returns is raised now, before
        this rank arrives at the barrier, so the decider answers it (REPLACE) before the
        barrier releases. True when one was raised. Fails open: a part that raises is
        logged and the start goes on."""
        return await self._preflight_again() is not None

    async def _preflight_again(self) -> Fault | None:
        """The before-barrier parts, in order, until one finds a fault: raised now (the
        decider answers it) and returned. Also a spare's check when ASSIGNed a rank
        (seat.py ``RankHooks.preflight``)."""
        for part in self.before_barrier:
            try:
                fault = await part(self)
            except Exception:
                log.exception("before-barrier part failed; starting all the same")
                continue
            if fault is not None:
                await self.raise_fault(fault)
                return fault
        return None

    def _decisive(self) -> Action | None:
        """The desired decision if it is a STOP or REPLACE not carried out yet (recorded
        now), else None."""
        found = self.lifecycle.decisive()
        if found is None or found.kind not in (ActionKind.STOP, ActionKind.REPLACE):
            return None
        self._record_action(found)
        return found

    def _exit_code_of(self, action: Action, exit_: ProcessExit | None) -> int:
        """The worker ends on ``action``: its exit status (lifecycle.exit_status_of)."""
        sup = self.cfg.supervisor
        code, step = self.lifecycle.failed(action, exit_, exit_replace=sup.exit_replace,
                                           exit_stop=sup.exit_stop)
        self._apply(step)
        return code

    def next_env(self) -> dict[str, str]:
        """The environment the next attempt's trainer gets (a spare's standby is started
        with it: agent/standby.py)."""
        per_attempt = self.spec.attempt_env(self.restarts) \
            if self.spec.attempt_env is not None else {}
        env = attempt_env(self._rank_environ(), restarts=self.restarts,
                          generation=self.generation, extra=self.extra_env,
                          per_attempt=per_attempt)
        env.pop(RESUME_VAR, None)  # only the arbiter's, for this attempt
        if self.resume_step is not None:
            env[RESUME_VAR] = str(self.resume_step)
        return env

    def _rank_environ(self) -> dict[str, str]:
        """The worker's environment with the lifecycle's rank: a spare that took over a
        rank (the arbiter's ASSIGN) starts its trainer as that rank -- RANK and
        WORLD_SIZE (and GROUP_RANK/PET_NODE_RANK where set) as the replaced rank's were.
        Compared, not copied: the environment as started is the spec's."""
        env = dict(self.environ)
        rank = self.lifecycle.rank
        if rank == self.cfg.identity.rank:
            return env
        env["RANK"] = str(rank)
        env["WORLD_SIZE"] = str(self.cfg.identity.world_size)
        for var in ("GROUP_RANK", "PET_NODE_RANK"):
            if var in env:
                env[var] = str(rank)
        return env

    def _reconcile_labels(self) -> None:
        """The metrics' rank label as the lifecycle says (a spare that took a rank exports
        as that rank from now on): observed against desired, before every attempt."""
        m = self.metrics
        if m is None:
            return
        rank = str(self.lifecycle.rank)
        if m.identity.get("rank") != rank:
            m.relabel(rank=rank)

    def _start(self, env: dict[str, str]) -> TrainerProcess:
        self._reconcile_labels()
        self._hang_faults.clear()
        out, err = self.spec.outputs(self.restarts) if self.spec.outputs is not None \
            else (1, 2)  # as is: the agent's own stdout and stderr
        trainer = self.spawn_trainer(self.cfg.command, env, self.reaper,
                                     self.feed.pumps_callback(), stdout_fd=out, stderr_fd=err,
                                     output_interval=self.cfg.supervisor.output_interval)
        self._apply(self.lifecycle.running(trainer.pid))
        self.observe(TrainerStart(trainer.pid, self.restarts, self.generation,
                                  ts=trainer.started))
        return trainer

    def _count_skipped(self, reason: str, lines: int) -> None:
        """Output lines not parsed for progress, in ``ftagent_log_lines_skipped_total``."""
        if self.metrics is not None:
            self.metrics.log_lines_skipped.labels(**self.metrics.identity,
                                                  reason=reason).inc(lines)

    async def _supervise(
        self, trainer: TrainerProcess
    ) -> tuple[Action | None, ProcessExit | None]:
        """Run until the trainer exits or an action ends this attempt: the reconciler.
        Woken by the trainer's exit, a stop signal or the desired state moving, it compares
        desired with observed (``Lifecycle.due``) and acts on what differs."""
        stop_wait = asyncio.create_task(self._stop_event.wait())
        try:
            while True:
                # An action that arrives with (or just after) the trainer's own exit is
                # held, not lost: the exit is handled first (its crash is recorded with its
                # evidence), then the action is carried out -- unless it answered this
                # attempt's hang, which the exit supersedes.
                held = self._due()
                if held is None:
                    self._change.clear()  # nothing due now: the next change wakes us
                    change = asyncio.create_task(self._change.wait())
                    waits: set[asyncio.Future[Any]] = {trainer.exited, change, stop_wait}
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    change.cancel()
                    if self._change.is_set():  # compare again only if something moved
                        self._change.clear()
                        held = self._due()
                done = {f for f in (trainer.exited, stop_wait) if f.done()}
                if held is not None:
                    if trainer.exited not in done and zombie(trainer.pid):
                        await asyncio.shield(trainer.exited)
                        done = {trainer.exited}
                    if trainer.exited in done and held.fault_id in self._hang_faults:
                        log.info("action %s superseded: the trainer exited by itself",
                                 held.kind.value)
                        self.lifecycle.dismiss(held)
                        held = None
                elif not done:
                    continue  # woken by a change that leaves nothing to do
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
                    await self.raise_fault(crash_fault(exit_, self.restarts, self.last_lines),
                                           decide=held is None)
                    return await self._next_action(held), exit_
                if stop_wait in done:
                    exit_ = await self._stop_trainer(trainer, self._stop_deadline)
                    self._apply(self.lifecycle.stopped(exit_.exit_status, self.stop_signal))
                    return None, exit_
                assert held is not None
                action = held
                self._record_action(action)
                if action.kind in MINOR_ACTIONS:
                    await self.decider.on_minor_action(self, action)
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
                due = self._due()  # desired against observed
                if due is None:
                    self._change.clear()
                    await self._change.wait()
                    self._change.clear()  # consumed: compare again now
                    continue
                action = due
            if action.fault_id in self._hang_faults:
                log.info("action %s superseded: the trainer exited by itself",
                         action.kind.value)
                self.lifecycle.dismiss(action)
                continue
            if action.kind not in MINOR_ACTIONS:
                # recorded with the step that carries it out (``_apply``, next): the action
                # line and its state line in one write
                self._unrecorded = action
                return action
            self._record_action(action)
            await self.decider.on_minor_action(self, action)

    def _due(self) -> Action | None:
        """``Lifecycle.due``: what to carry out now. Nothing desired and no request
        waiting is read in place (the common case after every wake-up that moved
        nothing of this rank's): no comparison to ask for."""
        life = self.lifecycle
        if life.desired is None and not life.requests:
            return None
        return life.due()

    def _record_action(self, action: Action) -> None:
        """The action's line in the events file; a minor one is carried out now (the
        lifecycle marks it). A major one is marked by the step that carries it out
        (``Lifecycle.restart`` or ``failed``), which the control loop takes next, once."""
        if action.kind in MINOR_ACTIONS:
            self.lifecycle.decided(action)
        self.events.write_lines(_action_line(action))

    async def _after_exit(self, trainer: TrainerProcess, exit_: ProcessExit, *,
                          cleared: bool = False) -> None:
        """The main process is gone: clean up what it left (``cleared``: the stop saw its
        tree empty, nothing can be left), read its last output."""
        self._drain_output()  # what it printed before it exited comes first
        self.lifecycle.exited(exit_)  # its one owner first: the metrics read it there
        self.observe(exit_)
        status = exit_.exit_status
        self.events.write("state", "exited", f"trainer exited with status {status}",
                          exit_status=status, exit_code=exit_.code,
                          signal=exit_.signal, pid=exit_.pid)
        if not cleared:  # one look at the tree; what it left is stopped
            await clear_leftovers(
                self.tree, self._stop_deadline if self.stop_signal is not None
                else time.monotonic() + self.cfg.supervisor.stop_timeout)
        if not await trainer.drain(2.0):
            log.warning("trainer output did not reach EOF; last lines may be missing")
        self._drain_output()  # the last lines before the crash fault's evidence

    def _drain_output(self) -> None:
        """The output the pumps queued, handled now (LineFeed.drain_all); an empty
        backlog is looked at, not called (as the ticker does)."""
        b = self.feed.backlog
        if b is not None and b.pending:
            self.feed.drain_all()

    async def _stop_trainer(self, trainer: TrainerProcess, deadline: float) -> ProcessExit:
        """Stop the trainer (supervisor.terminate; a stop signal was already forwarded
        as is), then clean up after its exit: no second look at a tree the stop saw
        empty."""
        cleared = await terminate(trainer, self.tree, deadline, forwarded=self.stop_signal,
                                  stop_timeout=self.cfg.supervisor.stop_timeout)
        exit_ = await trainer.exited
        await self._after_exit(trainer, exit_, cleared=cleared)
        return exit_

    async def _interruptible_sleep(self, seconds: float) -> bool:
        """Sleep unless a stop signal arrives; True if the sleep completed."""
        if seconds <= 0:
            return self.stop_signal is None
        await until_set(self._stop_event, seconds)
        return self.stop_signal is None

    # ----------------------------------------------------------------- signals and state

    def on_signal(self, sig: int) -> None:
        """A stop signal to the agent (the pod forwards it to every worker)."""
        if not self.lifecycle.stop(sig):  # a second signal: no more grace
            log.warning("second %s: killing the trainer's tree now", signal.Signals(sig).name)
            self._stop_deadline = time.monotonic()
            self._spawn(supervisor.kill_tree(self.trainer.pgid if self.trainer else None,
                                             procs=self.tree))
            return
        self._stop_deadline = time.monotonic() + self.cfg.supervisor.stop_timeout
        log.info("received %s: forwarding to the trainer, stop timeout %.0fs",
                 signal.Signals(sig).name, self.cfg.supervisor.stop_timeout)
        if self.trainer is not None and self.trainer.running:
            self.trainer.send_signal(sig)
        self._stop_event.set()

    def _apply(self, step: Step) -> None:
        """Carry out a lifecycle step at the edges: the events file (with the line of the
        decision it carries out, if not written yet: one write), the observers."""
        if step.state is TrainerState.WAITING:
            self._reconcile_labels()
        state = ("state", step.state.value, f"trainer {step.state.value}",
                 {"restarts": step.restarts, "generation": step.generation, **step.fields})
        action, self._unrecorded = self._unrecorded, None
        self.events.write_lines(*((_action_line(action),) if action is not None else ()), state)
        for o in self.observers:
            hook = getattr(o, "on_state", None)
            states = getattr(o, "states", None)  # the steps it acts on (None: every one)
            if hook is not None and (states is None or step.state in states):
                try:
                    hook(step.state, step.restarts)
                except Exception:
                    log.exception("state hook failed")


async def wait_at_barrier(decider: Decider, seat: Seat) -> Action | None:
    """Wait at the barrier before ``seat``'s next attempt: the decider looks
    (``Decider.barrier``) each time the worker wakes -- its desired state moved (a RELEASE,
    a decision, a stop) or the time the decider gave ran out -- as the worker's own loop
    compares desired with observed (``Lifecycle.due``); a wait of the decider's own (the
    local group's, a spare's) is awaited, then its answer taken as a look's. None: go; an
    Action: the STOP/REPLACE that ends the worker before it starts. The protocol
    simulation waits with this very function."""
    look = decider.barrier(seat)
    while True:
        if isinstance(look, float):
            await seat.changed(look)
            look = decider.barrier(seat)
        elif look is None or isinstance(look, Action):
            return look
        else:
            look = await look


def _action_line(action: Action) -> tuple[str, str, str, dict[str, Any]]:
    """An action's line in the events file (``EventsFile.write_lines``), logged as made."""
    log.info("action %s (%s): %s", action.kind.value, action.origin.value, action.reason)
    return ("action", action.kind.value, action.reason,
            {"action_id": action.id, "generation": action.generation,
             "fault_id": action.fault_id, "origin": action.origin.value,
             "backoff_seconds": action.backoff_seconds, "exit_code": action.exit_code})
