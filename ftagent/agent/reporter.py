"""The agent's link to the arbiter: one gRPC stream, kept open, never in the way.

``ArbiterLink.run()`` connects, says Hello, and reconnects forever with jittered
exponential backoff (capped at 4 s, so a restarted arbiter sees every agent again
within ~5 s). It fails open: nothing here raises into the supervisor; while
``connected`` is False the supervisor's local policy decides, and what must not be lost
is kept and re-sent on the next stream:

* faults, until the arbiter's FaultAck says they are settled (``final``), or a command
  covers them; repeats are ignored by id;
* the barrier arrival, until the barrier of that generation is released;
* the latest progress, coalesced: one ProgressSummary per ``progress_interval`` (5 s),
  sooner only when the hung flag changes, for a new trainer's first step, and for the
  steps of one that ended (with its exit, and those read from its pipe after it); steady
  state is one small message per 5 s.
  It carries where a step's time goes (``StepTimes``: seconds per step, in collectives
  and waiting for data, over the last steps), for the arbiter's straggler check.

Commands move the rank's desired state in the worker's lifecycle (``Lifecycle.want``,
``Lifecycle.release``: link_protocol.py), which wakes the worker in this same loop: no
queue and no forwarder between the read loop and the worker. A link used alone (no
lifecycle given: tests, benches) also puts them as ``model.Action`` on ``commands``
(RESTART, STOP, REPLACE, DUMP_STACKS), de-duplicated (a RESTART to a generation the agent
runs or waits for already is dropped); RELEASE_BARRIER is not an Action but the end of a
wait: ``wait_released(generation)``. What is kept, sent and accepted is decided by
``LinkProtocol`` (link_protocol.py, no I/O); this module only moves it over gRPC. The
trainer's exit and start, a fault and an arrival go to the core directly (the worker's
observers, the decider): it posts what they say in its outbox (``LinkProtocol.out``),
which this shell's writer empties onto the stream; the shell keeps what needs a clock or
a task of its own (the progress summaries' pace and content, the stream's life).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from ftagent import __version__
from ftagent.agent.lifecycle import Lifecycle
from ftagent.agent.link_protocol import LinkProtocol
from ftagent.agent.seat import no_hang_state
from ftagent.config import ArbiterClientConfig, ConfigError, IdentityConfig
from ftagent.model import (
    Action,
    CollectiveSample,
    Fault,
    Observation,
    PhaseMarker,
    PhaseTiming,
    ProcessExit,
    Progress,
    Resumed,
    SnapshotsHeld,
)
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.waits import until_set
from ftagent.wire.convert import fill_resume_and_phases, fill_step_times
from ftagent.wire.credentials import bearer, current_token
from ftagent.wire.shard import pick_arbiter
from ftagent.wire.tls_files import ChannelFiles

log = logging.getLogger("ftagent.reporter")


PROGRESS_INTERVAL = 5.0
BACKOFF_FIRST = 0.2
BACKOFF_CAP = 4.0
WELCOME_TIMEOUT = 5.0  # a Hello unanswered this long: try a fresh connection
CLOSE_GRACE = 0.8  # closing: each of the half-close and the arbiter's end of stream
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 0),
]


STEP_TIMES_KEPT = 64  # steps the means of a summary are over
DATA_PHASES = frozenset({"data", "data_loading", "dataloader"})  # PhaseTiming names of the
# wait for the next batch (instrument(dataloader=...) reports "data")


@dataclass(slots=True)
class _StepTime:
    seconds: float
    collective: float
    data: float


class StepTimes:
    """Where the last steps' time went, as means per step (no I/O, no clock of its own).

    A step's time is the interval between consecutive steps' arrival (or the trainer's
    own ``step_seconds``); the collective and data seconds observed between them
    (``CollectiveSample``, ``PhaseTiming`` of a data phase) are that step's waits. The
    last ``STEP_TIMES_KEPT`` steps are kept, so any summary -- whenever it is sent --
    carries a mean over recent steps. A step that does not move forward (a new attempt
    starts over) forgets the previous attempt's steps.
    """

    def __init__(self, keep: int = STEP_TIMES_KEPT) -> None:
        self._steps: deque[_StepTime] = deque(maxlen=keep)
        self._last: tuple[int, float] | None = None
        self._collective = 0.0
        self._data = 0.0

    def observe(self, obs: Observation) -> None:
        """Account a collective or a data wait to the step in progress."""
        if isinstance(obs, CollectiveSample):
            self._collective += max(0.0, obs.seconds)
        elif isinstance(obs, PhaseTiming) and obs.phase in DATA_PHASES:
            self._data += max(0.0, obs.seconds)

    def step(self, p: Progress) -> None:
        """A step completed at ``p.ts``: close the interval since the previous one."""
        last = self._last
        if last is not None and p.step <= last[0]:
            self._steps.clear()  # a new attempt, or a redraw: start over
        elif last is not None:
            n = p.step - last[0]
            took = p.step_seconds if p.step_seconds and n == 1 else (p.ts - last[1]) / n
            if took > 0:
                for _ in range(min(n, self._steps.maxlen or 1)):
                    self._steps.append(_StepTime(took, self._collective / n, self._data / n))
        self._last = (p.step, p.ts)
        self._collective = self._data = 0.0

    def means(self) -> tuple[float, float, float, int]:
        """(step, collective, data) seconds per step over the kept steps, and their count."""
        n = len(self._steps)
        if n == 0:
            return 0.0, 0.0, 0.0, 0
        return (sum(s.seconds for s in self._steps) / n,
                sum(s.collective for s in self._steps) / n,
                sum(s.data for s in self._steps) / n, n)


CHECKPOINT_PHASES = frozenset({"checkpoint", "checkpointing", "checkpoint_save", "save"})
PHASES_OPEN = 8  # phases open at once (nested) a trainer is believed about
# an undeclared phase whose stack ran in a function or file named with one of these is a
# save (torch.save's frames are in torch/serialization.py)
SAVE_WORDS = ("save", "checkpoint", "ckpt", "serialization.py")


class TrainerSays:
    """What the trainer of this generation said about itself, for the arbiter's ledger:
    the step it resumed after (``Resumed``: a "loaded checkpoint" line, ``ftagent.resumed``)
    and the seconds it spent in declared phases (``PhaseMarker`` begin..end), checkpoint
    saves apart from the rest. No clock of its own: ``now`` is passed in (monotonic). A
    phase still open counts up to ``now``; an end without a begin counts nothing."""

    def __init__(self, core: LinkProtocol | None = None) -> None:
        """``core``: the link's, whose ``starts`` says which trainer this is of (what a
        trainer said is forgotten when the next one starts); None: ``reset`` by hand."""
        self._core = core
        self._of = core.starts if core is not None else 0
        self.reset()

    def _fresh(self) -> None:
        core = self._core
        if core is not None and core.starts != self._of:
            self._of = core.starts
            self.reset()

    def reset(self) -> None:
        """A new trainer (generation): it has said nothing yet."""
        self.resumed: int | None = None
        self.resumed_from = ""  # memory | peer | disk (ftagent.checkpoint), "" : not said
        self._open: dict[str, float] = {}
        self._closed = {"checkpoint": 0.0, "other": 0.0}

    def observe(self, obs: Observation, now: float) -> None:
        self._fresh()
        if isinstance(obs, Resumed):
            if obs.origin or obs.step != self.resumed:  # a log line repeating the SDK's
                self.resumed_from = obs.origin          # step keeps its source
            self.resumed = obs.step
        elif isinstance(obs, PhaseMarker):
            if obs.begin:
                if obs.phase not in self._open and len(self._open) < PHASES_OPEN:
                    self._open[obs.phase] = now
            else:
                began = self._open.pop(obs.phase, None)
                if began is not None:
                    self._closed[_phase_kind(obs.phase)] += max(0.0, now - began)

    def learned(self, seconds: float, where: str) -> None:
        """A phase the trainer did not declare but the hang detector learned (a stall
        verified alive, agent/verify.py) took ``seconds`` once steps resumed: counted as a
        declared one, a checkpoint where its stack ran in a save (``where`` names one:
        ``SAVE_WORDS``), else as other. The agent's own measure (a finite, positive
        number is believed; the arbiter caps it at the training time)."""
        self._fresh()
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) \
                and 0 < seconds < float("inf"):
            low = where.lower()
            kind = "checkpoint" if any(w in low for w in SAVE_WORDS) else "other"
            self._closed[kind] += float(seconds)

    def phase_seconds(self, now: float) -> tuple[float, float]:
        """(checkpoint, other) seconds in phases so far, open ones up to ``now``."""
        self._fresh()
        out = dict(self._closed)
        for phase, began in self._open.items():
            out[_phase_kind(phase)] += max(0.0, now - began)
        return out["checkpoint"], out["other"]


def _phase_kind(phase: str) -> str:
    return "checkpoint" if phase.lower() in CHECKPOINT_PHASES else "other"


def backoff(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds before reconnect attempt ``attempt`` (0-based): doubling, capped, jittered."""
    r = rng or random
    return min(BACKOFF_CAP, BACKOFF_FIRST * 2 ** min(attempt, 16)) * r.uniform(0.5, 1.0)


class ArbiterLink:
    """See the module docstring. Create and use it on the supervisor's event loop.

    A worker's link observes its trainer itself (``observe``: the worker carries it among
    its observers, arbiter_decider.py): its progress and timings here, its exit and start
    in the link's core (``proto``, an observer of its own: ``LinkProtocol.observe``,
    ``on_state``), which posts what they say in the outbox this shell writes: no call
    through the shell per event."""

    # what the watch loop hands it (watch/loop.py ``_route``): the types it acts on (the
    # trainer's exit and start: its core's)
    observes = (Progress, CollectiveSample, PhaseTiming, Resumed, PhaseMarker,
                SnapshotsHeld)

    def __init__(self, cfg: ArbiterClientConfig, identity: IdentityConfig, *,
                 max_restarts: int | None = None, version: str = __version__,
                 alert_only: bool = False,
                 progress_interval: float = PROGRESS_INTERVAL,
                 lifecycle: Lifecycle | None = None) -> None:
        """Raises ConfigError for an unusable --arbiter or TLS file (a startup error)."""
        try:
            self.address = pick_arbiter(cfg.arbiter, identity.job)
            self._tls = ChannelFiles(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)  # re-read
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.cfg = cfg
        self.identity = identity
        self._wake = asyncio.Event()
        self._up = asyncio.Event()  # set while a stream is up (Welcome read): no polling
        self.proto = LinkProtocol(identity, max_restarts=max_restarts, version=version,
                                  alert_only=alert_only, lifecycle=lifecycle,
                                  wake=self._wake.set, is_up=self._up.is_set)
        self.progress_interval = progress_interval
        # a link used alone queues its commands here; a worker's link moves the worker's
        # lifecycle instead, which wakes it (module docstring)
        self.commands: asyncio.Queue[Action] = asyncio.Queue()
        self._queue_commands = lifecycle is None
        self.connected = False
        self.offline_since: float | None = time.monotonic()  # None while connected
        self.step_times = StepTimes()
        self.trainer_says = TrainerSays(self.proto)  # of the trainer the core says started
        self._hung_sent = False
        # what is written on the stream, in order: the core's outbox (its ``post``)
        self._out = self.proto.out
        self._released = asyncio.Event()
        self._assigned = asyncio.Event()  # a spare was given a rank, or made a spare
        self._settled = asyncio.Event()
        self._closed = asyncio.Event()
        self._finishing = False  # finish(): half-close each stream once all is written
        self._confirmed = asyncio.Event()  # an arbiter read all this link wrote (finish)
        # the call half-closed with everything written to it (finish, close)
        self._ended: grpc.aio.StreamStreamCall | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_error = ""
        # the rank's hang state, said with each progress summary (seconds since progress,
        # hung: the rank's hook, seat.py RankHooks.hang_state, given by its decider)
        self.hang_state: Callable[[], tuple[float, bool]] = no_hang_state

    # The agent's side of the protocol state, for the supervisor and for status.
    @property
    def generation(self) -> int:
        return self.proto.generation

    @property
    def released_generation(self) -> int:
        return self.proto.released_generation

    @property
    def restarts(self) -> int:
        """The restart count the Hello reports: the worker's lifecycle's."""
        return self.proto.lifecycle.restarts

    @property
    def trainer_state(self) -> str:
        """Read-only: the worker's lifecycle says it (link_protocol.py)."""
        return self.proto.trainer_state

    @property
    def arbiter_id(self) -> str:
        return self.proto.arbiter_id

    def offline_for(self) -> float:
        """Seconds since the link was last up (0 while connected)."""
        since = self.offline_since
        return 0.0 if since is None else time.monotonic() - since

    # ------------------------------------------------------------------ the trainer observed

    def observe(self, obs: Observation) -> None:
        """An observation of the trainer's (``observes``): progress, its exit (of the
        generation its lifecycle names), where steps' time goes, what it said of itself."""
        if isinstance(obs, Progress):
            since, hung = self.hang_state()
            self.report_progress(obs, seconds_since_progress=since, hung=hung)
        elif isinstance(obs, ProcessExit):  # a worker's core hears it itself (observes)
            self.proto.observe(obs)
        elif isinstance(obs, (CollectiveSample, PhaseTiming)):
            self.observe_timing(obs)  # where the step's time goes: stragglers at the arbiter
        elif isinstance(obs, (Resumed, PhaseMarker, SnapshotsHeld)):
            self.observe_trainer(obs)  # the resume step and phase time: the goodput ledger;
            # the snapshots held: the arbiter's resume step

    # ------------------------------------------------------------------ supervisor API

    def report_fault(self, fault: Fault, *, generation: int | None = None,
                     exit_status: int | None = None) -> None:
        """Send ``fault`` (now or after reconnecting) until the arbiter settles it.

        ``generation``: of the trainer it happened in (default: ``self.generation``);
        ``exit_status``: for CRASH, else taken from evidence["exit_status"] if present.
        """
        self.proto.report_fault(fault, generation, exit_status)

    def outcome(self, fault_id: str) -> str | None:
        """How the arbiter settled ``fault_id`` (None: not yet)."""
        return self.proto.outcomes.get(fault_id)

    async def wait_settled(self, timeout: float) -> None:
        """Until some fault is settled or a command came, or ``timeout``."""
        self._settled.clear()
        await until_set(self._settled, timeout)

    def report_progress(self, p: Progress, *, seconds_since_progress: float,
                        hung: bool) -> None:
        """The latest progress; sent at most every ``progress_interval`` (at once if hung
        changed)."""
        self.step_times.step(p)
        ts, phases = time.time(), self.trainer_says.phase_seconds(time.monotonic())
        core = self.proto
        first, core.first_step_due = core.first_step_due, False
        low = min((s for s, _ in p.folded_losses if 0 <= s < p.step), default=None)
        if first and low is not None:
            # the generation's first lines were read together and folded into the last:
            # its first step goes first (the ledger's resume step when the trainer does
            # not say where it resumed), then the latest
            head = self.proto.progress(replace(p, step=low, folded_losses=()),
                                       seconds_since_progress, hung, ts)
            fill_resume_and_phases(head, self.trainer_says.resumed, *phases,
                                   source=self.trainer_says.resumed_from)
            core.post(pb.AgentMessage(progress=head))
        summary = core.progress_summary = core.progress(p, seconds_since_progress, hung, ts)
        fill_step_times(summary, *self.step_times.means())
        fill_resume_and_phases(summary, self.trainer_says.resumed, *phases,
                               source=self.trainer_says.resumed_from)
        if core.snapshots_due:
            core.flush_snapshots()
        if core.lifecycle.trainer_ended:
            # read after the trainer's exit: the last lines of its pipe, drained once
            # it was gone (worker._after_exit). No next slot comes for them: a replaced
            # rank's agent exits at once, and the goodput ledger's "reached" step (the
            # steps a restart redoes) came out one or more steps low. Sent now and kept
            # while offline, as the exit was.
            core.progress_new = False
            core.post(pb.AgentMessage(progress=summary), keep=True)
            return
        if not core.progress_new or hung != self._hung_sent:
            self._wake.set()  # the writer sleeps until the next due time, at most once
        core.progress_new = True

    def observe_timing(self, obs: Observation) -> None:
        """A collective's or a phase's timing (``CollectiveSample``, ``PhaseTiming``):
        the waits of the step in progress, summarised in the next ProgressSummary."""
        self.step_times.observe(obs)

    def observe_trainer(self, obs: Observation) -> None:
        """A ``Resumed`` or ``PhaseMarker`` of this generation's trainer: carried in its
        next ProgressSummaries (the ledger's resume step and phase time). A
        ``SnapshotsHeld`` goes to the arbiter at once (``SnapshotReport``, at most one per
        ``link_protocol.SNAPSHOT_REPORT_INTERVAL``; a newer one waits for the next summary
        or exit)."""
        if isinstance(obs, SnapshotsHeld):
            core = self.proto
            if obs.steps != core.snapshots:
                core.snapshots, core.snapshots_due = obs.steps, True
            core.flush_snapshots()
            return
        self.trainer_says.observe(obs, time.monotonic())

    def report_exit(self, exit: ProcessExit, generation: int) -> None:
        """The trainer exited (its core's ``report_exit``: its last progress first, then
        the exit; kept for the next stream while disconnected). For a link used alone (a
        simulated agent): it moves its lifecycle first, as the worker moves its own
        (``Lifecycle.exited``) before its link's core hears the exit."""
        self.proto.lifecycle.exited(exit)
        self.proto.report_exit(exit, generation)

    def report_stacks(self, command_id: str, stacks_json: str) -> None:
        """Answer a DUMP_STACKS action (``action.id``) with the trainer tree's stacks."""
        self._send(pb.AgentMessage(stacks=pb.Stacks(command_id=command_id, json=stacks_json)),
                   keep=True)

    def arrive(self, generation: int) -> None:
        """The previous trainer has fully exited; ready to start ``generation`` (its
        core's ``report_arrival``: re-sent after every reconnect until released, the
        stopped trainer's last progress first)."""
        self.proto.report_arrival(generation)

    def started(self, generation: int, *, released: bool) -> None:
        """A trainer of ``generation`` runs now (``released`` False: without the barrier;
        its core's ``start``). For a link used alone (a simulated agent, no process: pid
        0): it moves its lifecycle first, as the worker does (``Lifecycle.running``)."""
        self.proto.lifecycle.running(0)
        self.proto.start(generation, released=released)

    async def wait_released(self, generation: int, timeout: float | None = None) -> bool:
        """True once every rank arrived for ``generation`` (or a later one); False on
        timeout or close. On False with ``connected`` False, fall back to local policy."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.released_generation < generation:
            if self._closed.is_set():
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._released.clear()
            await until_set(self._released, left)
        return True

    async def wait_assigned(self, timeout: float) -> bool:
        """True once this spare was ASSIGNed a rank (``proto.assignment``), False on
        timeout or close."""
        if self.proto.assignment is None and not self._closed.is_set():
            self._assigned.clear()
            await until_set(self._assigned, timeout)
        return self.proto.assignment is not None

    async def wait_connected(self, timeout: float) -> bool:
        """True once a stream is up (Welcome received) within ``timeout`` seconds: woken
        by the Welcome, not a polling loop."""
        if not self.connected and not self._closed.is_set():
            await until_set(self._up, timeout)
        return self.connected

    async def finish(self, timeout: float) -> bool:
        """The agent is ending: write what is queued, half-close, and wait until an
        arbiter ends the stream (it does once it has read everything), reconnecting while
        it is away, for up to ``timeout`` seconds. True once one did: it heard the
        trainer's exit. Written is not read -- an arbiter SIGKILLed before the agent
        noticed takes what was written to it down with it -- so a broken stream is not
        the end: the next one says it again (``LinkProtocol.last_exit``)."""
        self._finishing = True
        self._wake.set()
        await until_set(self._confirmed, timeout)
        return self._confirmed.is_set()

    def pending(self) -> int:
        """Messages not yet written to the stream plus faults not yet acknowledged (e.g.
        to give the trainer's exit a moment to reach the arbiter before closing)."""
        return len(self._out) + len(self.proto.faults) + (
            0 if self.connected else len(self.proto.later))

    def starting(self) -> None:
        """The link is about to run: it counts as offline from now, not from when it was
        built. The launcher builds every worker (and local rank 0 the node's GPU and NIC
        sources) before any link runs; on a loaded node that took longer than
        --arbiter-fail-open-after, and rank 0, built first, started alone at once while
        its peers waited at the job's barrier for it."""
        if not self.connected:
            self.offline_since = time.monotonic()

    async def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._released.set()
        task = self._task
        if task is not None and task is not asyncio.current_task():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            if not task.done():
                task.cancel()

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Connect and reconnect until ``close()``; never raises (except cancellation)."""
        self._task = asyncio.current_task()
        attempt = 0
        while not self._closed.is_set() and not self._confirmed.is_set():
            welcomed = False
            try:
                welcomed = await self._session()
            except asyncio.CancelledError:
                if self._closed.is_set():
                    break
                raise
            except grpc.aio.AioRpcError as e:
                self._report_error(f"{e.code().name}: {e.details()}")
            except Exception as e:
                self._report_error(repr(e))
            self._down()
            if self._confirmed.is_set():
                break
            attempt = 0 if welcomed else attempt + 1
            await until_set(self._closed, backoff(attempt))

    def _down(self) -> None:
        was = self.connected
        if self.connected or self.offline_since is None:
            self.offline_since = time.monotonic()
        self.connected = False
        self._up.clear()
        if was:  # the fail-open clock starts now: the waits that time it recompute
            self._settled.set()
            self.proto.lifecycle.on_change()

    async def _session(self) -> bool:
        """One stream: Hello, Welcome, then read and write until it breaks. True if welcomed."""
        creds = self._tls.current()  # a rotated CA is used from the next connection on
        if creds is None:
            channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.secure_channel(self.address, creds, options=CHANNEL_OPTIONS)
        welcomed = False
        try:
            call = pb_grpc.ArbiterStub(channel).Connect(
                metadata=bearer(current_token(self.cfg.token, self.cfg.token_file)))
            await call.write(pb.AgentMessage(hello=self.proto.hello()))
            first = await asyncio.wait_for(call.read(), WELCOME_TIMEOUT)
            if first is grpc.aio.EOF:
                code, details = await call.code(), await call.details()
                raise ConnectionError(f"{code.name if code else '?'}: {details}")
            if first.WhichOneof("body") != "welcome":
                raise ConnectionError("the arbiter did not answer Hello with Welcome: is it "
                                      "an ftagent arbiter of the same version?")
            self._welcome(first.welcome)
            welcomed = True
            reader = asyncio.create_task(self._reader(call))
            tasks = [reader, asyncio.create_task(self._writer(call)),
                     asyncio.create_task(self._closed.wait())]
            writer = tasks[1]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if writer in done and not writer.cancelled() and \
                        writer.exception() is None and not reader.done():
                    # finishing: all written and half-closed; the arbiter ends the stream
                    # once it has read everything (or it breaks, or the link closes)
                    done, _ = await asyncio.wait([reader, tasks[2]],
                                                 return_when=asyncio.FIRST_COMPLETED)
                    done = done | {writer}
            except BaseException:
                for t in tasks:
                    t.cancel()
                self._down()
                raise
            for t in tasks[1:]:
                t.cancel()
            if self._closed.is_set() and not reader.done():
                # Closing: half-close, and read on until the arbiter ends the stream (it
                # does at end of input, once it has read everything). Cancelling the call
                # (or the read under way) at once could drop the last message written --
                # the trainer's exit -- unread, and the job never read "succeeded".
                with contextlib.suppress(Exception):  # closing: whatever ended the read
                    await asyncio.wait_for(call.done_writing(), CLOSE_GRACE)
                    if not any(m is self.proto.last_exit for m in self._out):
                        self._ended = call
                    await asyncio.wait_for(asyncio.shield(reader), CLOSE_GRACE)
            read_all = reader.done() and not reader.cancelled() and \
                reader.exception() is None
            reader.cancel()
            self._down()
            for t in done:
                exc = None if t.cancelled() else t.exception()
                if exc is not None:
                    raise exc
            read_all = read_all and call is self._ended
            if read_all and await call.code() == grpc.StatusCode.OK:
                # the arbiter ended the stream we half-closed: it read all we wrote
                self.proto.confirmed()
                self._confirmed.set()
                return welcomed
            if not self._closed.is_set():
                code = await call.code()
                details = await call.details()
                raise ConnectionError(f"stream ended: {code.name if code else '?'} {details}")
            call.cancel()
            return welcomed
        finally:
            await channel.close(grace=None)

    def _welcome(self, w: pb.Welcome) -> None:
        core = self.proto
        self._out.clear()
        self._out.extend(core.on_welcome(w))
        core.progress_new = core.progress_summary is not None
        core.progress_sent_at = -1e9
        self.connected = True
        self._up.set()
        if core.snapshots is not None:  # a new arbiter learns them from the agents
            core.snapshots_due = True
            core.flush_snapshots(force=True)
        self.offline_since = None
        self._last_error = ""
        log.info("connected to the arbiter %s (%s), job generation %d", self.address,
                 w.arbiter_id, w.generation)
        self._wake.set()

    async def _writer(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            while self._out:
                msg = self._out[0]  # still pending (``pending()``) until written
                await call.write(msg)
                if self._out and self._out[0] is msg:
                    self._out.popleft()
            if self._finishing:
                await call.done_writing()  # all written: the arbiter ends the stream
                self._ended = call
                return
            core = self.proto
            now = time.monotonic()
            due = core.progress_sent_at + self.progress_interval
            p = core.progress_summary
            if p is not None and core.progress_new and (now >= due or p.hung != self._hung_sent):
                core.progress_new = False
                core.progress_sent_at, self._hung_sent = now, p.hung
                await call.write(pb.AgentMessage(progress=p))
                continue
            self._wake.clear()
            wait = max(0.0, due - now) if core.progress_new else None
            await until_set(self._wake, wait)

    async def _reader(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            m = await call.read()
            if m is grpc.aio.EOF:
                return
            got = self.proto.on_message(m)
            if got.send:
                self._out.extend(got.send)
                self._wake.set()
            if self._queue_commands:
                for action in got.actions:
                    self.commands.put_nowait(action)
            if got.released:
                self._released.set()
            if got.assigned:
                self._assigned.set()
            if got.settled or got.actions:  # a command answers a decision's wait too
                self._settled.set()

    # ------------------------------------------------------------------ helpers

    def _send(self, msg: pb.AgentMessage, *, keep: bool = False) -> None:
        self.proto.post(msg, keep=keep)

    def _report_error(self, error: str) -> None:
        if error != self._last_error:
            log.warning("arbiter %s unreachable (%s); retrying, the local policy decides "
                        "meanwhile", self.address, error)
            self._last_error = error
        else:
            log.debug("arbiter %s still unreachable: %s", self.address, error)
