"""Suspect -> verify -> declare: the agent's side of hang verification.

When the hang detector's budget runs out it only *suspects* a hang. ``Verifier`` samples
the trainer's whole tree ``--hang-verify-samples`` times (``TreeSampler``: psutil CPU and
I/O counters, /proc thread states, NVML where present, and ``py-spy dump --json`` for the
later samples) and asks the pure verdict (``detect/liveness.py``) what the samples say.
The samples are taken *while the budget runs down*: ``prepare`` (on every tick) starts them
over the last ``--hang-verify-window`` seconds of the budget, no earlier than
``--hang-verify-from`` of it (``detect/hang.verify_plan``: cheap samples first, stacks
towards the end), so the verdict is judged the moment the budget runs out, and the
flight-recorder dump (``window_dump``) is taken in the same window. Steps resuming drop
the samples: nothing was written, nothing is learned. With ``--hang-verify-from 1`` the
samples are taken after the budget ran out, over the window (the verdict a window later).

* **alive** -- not a fault. The detector is told to suspect again one step budget later
  (``HangDetector.defer``); the stall is an *undeclared long phase*. When steps resume it is
  recorded (events file ``{"event": "phase", "kind": "undeclared", ...}``, metrics
  ``ftagent_undeclared_phases_total`` and ``ftagent_undeclared_phase_budget_seconds{where}``)
  and learned (``PhaseBook``): the next stall whose stack runs in the same place is
  recognised from the first sample and gets ``2 x`` the longest duration seen there as its
  budget, with no verification window;
* **spinning** -- alive until the stall has lasted the spin budget (learned at that place,
  else ``--hang-spin-timeout``), then a hang "spinning in f (file:line)";
* **hung** or **unknown** -- the HANG fault is raised with the verdict as evidence
  (``verification``: the still stacks, the CPU that did not advance, what was missing).

A stall that was declared hung and then resumed by itself (a rank waiting in a collective
for a peer busy in its undeclared phase, which the arbiter did not restart) is learned too.
Every verification is one ``{"event": "verify", "kind": VERDICT}`` line with the agent's
own CPU cost of it (``agent_cpu_seconds``, py-spy included).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import resource
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from ftagent.agent.evidence import MAX_THREADS, find_py_spy, sample_process
from ftagent.agent.hang_parts import HangParts, Ranked
from ftagent.agent.stall_window import window_of
from ftagent.config import HangConfig
from ftagent.detect.hang import HangDetector, Observed, Sample, verify_plan
from ftagent.detect.liveness import (
    GpuSample,
    Learned,
    Liveness,
    Motion,
    PhaseBook,
    ProcessSample,
    Snapshot,
    Thresholds,
    judge,
    stacks_of,
)
from ftagent.detect.stall import (
    IO_KINDS,
    Act,
    Blocked,
    Budget,
    Peers,
    Ruling,
    State,
    Verdict,
    Window,
    decide,
    peer_state,
    ruling_of,
)
from ftagent.model import (
    Fault,
    FaultKind,
    Observation,
    PhaseMarker,
    ProcessExit,
    Progress,
    Severity,
    TrainerStart,
)

log = logging.getLogger("ftagent.verify")

MAX_WHERE = 120  # characters of the metric's `where` label
MAX_PLACES = 8  # learned places (and `where` label values: metrics.UNDECLARED_PLACES)
LEAD = 1.0  # seconds before its first sample the early sampling starts (ticks are 0.5 s apart)
# How long a rank verified waiting in a collective leaves the verdict to a connected arbiter
# before it declares the hang itself: the arbiter's default --stacks-timeout (15 s: it may
# wait that long for a rank's stacks) and a margin. Under load the arbiter's BUSY answer
# took 3.2 s, and a one-budget wait (2 s) declared a rank that only waited (seen in
# tests/e2e/test_fr_verdict.py). A real hang is the arbiter's to restart meanwhile.
ARBITER_ANSWER_WAIT = 20.0
_RANK = re.compile(r"(?:local )?rank (\d{1,7})\b")  # the busy rank in BUSY's words


class GpuProbe(Protocol):
    """GPU activity of the trainer's GPUs; None when there is nothing to say."""

    def sample(self, pids: Sequence[int]) -> GpuSample | None: ...


class NvmlProbe:
    """Utilization of the visible GPUs through NVML; absent NVML is said once, not raised.
    GPU busy is never life on its own (a kernel spinning in a hung NCCL collective is busy):
    the verdict records it beside the stacks."""

    def __init__(self) -> None:
        self.error: str | None = None
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as e:  # noqa: BLE001 - no NVML, no GPU: normal on CPU nodes
            self.error = f"GPU activity: NVML not available ({type(e).__name__})"

    def sample(self, pids: Sequence[int]) -> GpuSample | None:
        nv = self._nvml
        if nv is None:
            return None
        try:
            util = [nv.nvmlDeviceGetUtilizationRates(nv.nvmlDeviceGetHandleByIndex(i))
                    for i in range(nv.nvmlDeviceGetCount())]
        except Exception as e:  # noqa: BLE001
            self.error = f"GPU activity: NVML failed ({e})"
            return None
        if not util:
            return None
        return GpuSample(float(max(u.gpu for u in util)), float(max(u.memory for u in util)))


class TreeSampler:
    """One snapshot of every process of the trainer's tree at a time (two py-spy attaching
    to one process at once fail, so an agent samples one snapshot after the other)."""

    def __init__(self, pids: Callable[[], Sequence[int]] | None = None,
                 dump_timeout: float = 2.0, py_spy: str = "py-spy",
                 gpu: GpuProbe | None = None, clock: Callable[[], float] = time.monotonic,
                 *, tree: Callable[[], Sequence[Any]] | None = None) -> None:
        """``pids``: the trainer's tree's pids; or ``tree``, its processes (anything with
        a ``pid``: the worker's ``tree``, read here without a hop through the worker)."""
        self.pids = pids
        self.tree = tree
        self.exe = find_py_spy(py_spy)
        self.dump_timeout = dump_timeout
        self.gpu = gpu
        self.clock = clock
        self._lock: asyncio.Lock | None = None

    async def sample(self, stacks: bool = True, pids: Sequence[int] | None = None
                     ) -> tuple[Snapshot, list[dict[str, Any]]]:
        """(snapshot, ``capture``-style process entries); never raises. ``stacks`` False:
        no py-spy (CPU, I/O and thread states only: an early, cheap sample). ``pids``: the
        processes to sample (a window's, listed by its first sample); None: the tree now."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await self._sample(stacks, pids)

    async def _sample(self, stacks: bool, given: Sequence[int] | None = None
                      ) -> tuple[Snapshot, list[dict[str, Any]]]:
        errors: list[str] = []
        try:
            listed = given if given is not None else [p.pid for p in self.tree()] \
                if self.tree is not None else self.pids() if self.pids is not None else []
            pids = list(dict.fromkeys(listed))
        except Exception as e:  # noqa: BLE001
            pids = []
            errors.append(f"the trainer's tree could not be listed: {e!r}")
        ts = self.clock()
        if not pids:
            return Snapshot(ts, (), errors=tuple(errors) or ("no trainer process",)), []
        deadline = time.monotonic() + self.dump_timeout
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(max_workers=min(len(pids), MAX_THREADS),
                                  thread_name_prefix="ftagent-verify")
        futures = [loop.run_in_executor(pool, sample_process, pid, self.exe, deadline,
                                        self.clock, stacks) for pid in pids]
        try:
            done, _ = await asyncio.wait(futures, timeout=self.dump_timeout + 1.0)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        procs: list[ProcessSample] = []
        entries: list[dict[str, Any]] = []
        for pid, fut in zip(pids, futures, strict=True):
            if fut in done and fut.exception() is None:
                sample, entry = fut.result()
                if entry.get("name") == "py-spy":
                    continue  # the agent's own sampler, not the trainer
                procs.append(sample)
                entries.append(entry)
            else:
                why = f"sampling did not finish within {self.dump_timeout:g}s"
                procs.append(ProcessSample(pid, self.clock(), None, errors=(why,)))
                entries.append({"pid": pid, "stack": None, "error": why})
        gpu = None
        if self.gpu is not None:
            try:
                gpu = self.gpu.sample(pids)
            except Exception as e:  # noqa: BLE001
                errors.append(f"GPU activity: {e!r}")
            err = getattr(self.gpu, "error", None)
            if gpu is None and err:
                errors.append(str(err))
        return Snapshot(ts, tuple(procs), gpu, tuple(errors)), entries


class Sampler(Protocol):
    async def sample(self, stacks: bool = True, pids: Sequence[int] | None = None
                     ) -> tuple[Snapshot, list[dict[str, Any]]]: ...


@dataclass
class Stall:
    """One stall over the budget, from the last progress until steps resume."""

    start: float  # when the last progress was seen (the detector's clock)
    step: int | None
    verified: bool = False  # a verification found it alive or spinning
    recognised: Learned | None = None  # it runs where a learned phase ran
    declared: bool = False  # a hang fault was raised for it
    verdict: Motion | None = None
    verifications: int = 0
    suspected: bool = False  # verified waiting in a collective: the arbiter was asked
    asked_at: float | None = None  # when (the verifier's clock)
    asking: bool = False  # that question is open: no verdict since, no BUSY answer
    waiting_on: str | None = None  # the arbiter judged the job busy: whom this rank waits on
    spin_cap: float | None = None  # the others wait on this spinning rank: its spin budget
    snaps: list[Snapshot] = dataclasses.field(default_factory=list)  # the last window's
    decision: Verdict | None = None  # the stall policy's last verdict
    entries: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # its stacks
    dump: dict[str, Any] | None = None  # the flight recorder's dump of its window
    io_blocked: tuple[Blocked, ...] = ()  # the remote reads the last I1 verdict saw (I3)


@dataclass
class Mark:
    """One cheap sample (CPU, I/O, thread states: no py-spy) taken ``LEAD`` into a stall
    whose verification window is still more than ``LEAD`` away, for one deadline: the
    start of the window a DUMP_STACKS answer is judged over, should the arbiter ask
    before this rank's own samples began (``Verifier._marked``)."""

    deadline: float
    snap: Snapshot | None = None
    task: asyncio.Task[None] | None = None


@dataclass
class Early:
    """Samples taken while one budget runs down (``verify_plan``), for one deadline."""

    deadline: float
    plan: tuple[Sample, ...]
    snaps: list[Snapshot] = dataclasses.field(default_factory=list)
    entries: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    usage: float = 0.0  # the agent's CPU seconds when sampling began


class Verifier:
    """Sits between the hang detector's suspicion and the fault (see the module docstring)."""

    def __init__(self, detector: HangDetector, cfg: HangConfig, sampler: Sampler,
                 parts: HangParts | None = None, *,
                 record: Callable[..., Any] | None = None, metrics: Any = None,
                 emit: Callable[[Fault], Coroutine[Any, Any, Any]] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 thresholds: Thresholds | None = None,
                 now: Callable[[], float] | None = None,
                 learned: Callable[[float, str], None] | None = None) -> None:
        """``parts``: the hang parts, built first (agent/hang_parts.py: the rank, the
        flight recorder's snapshot, the arbiter's "can I ask?", the local peers, the /proc
        wait reader). ``now``: the detector's clock where it differs from ``clock`` (the
        worker's ``LineFeed.now``: no hang is called on output not looked at yet).
        ``record``: the events file's write; ``learned(seconds, where)``: told of each
        undeclared phase learned (the arbiter link's TrainerSays: the goodput ledger
        counts it as a phase), beside its record."""
        parts = parts or HangParts()
        self.waits = parts.waits
        self.detector = detector
        self.now = now or clock
        # the flight recorder's snapshot (agent/flight_recorder.py), taken in the window
        self.window_dump = parts.window_dump
        self._early: Early | None = None
        self._suspect: Fault | None = None  # a HANG the tick raised while sampling early
        self._anchor: float | None = None  # when a deferred budget began
        # prepare's plan and its anchor, per budget
        self._plan: tuple[tuple[Any, ...], Any, float] | None = None
        self._mark: Mark | None = None  # a cheap sample early in the stall (Mark)
        self._dump: asyncio.Task[dict[str, Any]] | None = None  # the last window's
        self.cfg = cfg
        self.sampler = sampler
        self.record = record
        self.learned = learned
        self.metrics = metrics
        self.emit = emit
        self.clock = clock
        self.sleep = sleep
        self.thresholds = thresholds or Thresholds()
        self.book = PhaseBook(max_places=MAX_PLACES)
        # True while an arbiter can compare the ranks: a rank verified waiting in a
        # collective then raises a WARNING suspicion, not the hang (agent/peer_wait.py)
        self.ask_arbiter = parts.ask_arbiter
        # launcher mode: this pod's local ranks' verifiers (this one joins them); without
        # an arbiter, a rank waiting in a collective asks them who is busy
        self.local_peers: Callable[[], Sequence[tuple[int, Verifier]]] | None = \
            parts.local_peers
        self._rank = parts.rank  # this rank, for the verdict's culprits (the lifecycle's)
        # the detectors' ticker sleeps until ``next_tick``: told when that moved outside an
        # observation (a verdict, a deferred budget, early samples whose budget moved)
        self.wake = parts.wake
        if parts.local_peers is not None and self.rank is not None:
            parts.local_peers.add(self.rank, self)
        self.stall: Stall | None = None
        # BUSY arrived before this rank's own budget ran out (no stall open yet): the
        # stall it is in is that wait; forgotten when steps resume
        self._waiting_hint: str | None = None
        self.verifications = 0
        self._task: asyncio.Task[None] | None = None
        # verdicts done between two ticks, raised at the next (read before ``on_faults``:
        # a tick with no fault and nothing ready calls nothing here)
        self.ready: list[Fault] = []
        self._emitting: set[asyncio.Task[Any]] = set()
        from ftagent.agent.dead_still import DeadStillWatch

        self.dead_still = DeadStillWatch(self)  # inside phases and before the first step
        # ``next_tick`` kept as a fact (``_publish``: after each observation, tick and
        # wake, the three moments the watch loop asked it): the loop reads it (HangWatch
        # ``timing``); -inf until the first: tick at once, as the loop did
        self.next_due: float | None = -math.inf

    @property
    def window(self) -> float:
        return float(self.cfg.hang_verify_window)

    @property
    def declared(self) -> bool:
        """A HANG fault was raised for the open stall (verified, or on the budget when
        verification failed): what ``ftagent_hang`` shows, not the suspicion before it."""
        stall = self.stall
        return stall is not None and stall.declared

    @property
    def asking(self) -> bool:
        """Verified waiting in a collective, the arbiter asked and not answered yet."""
        stall = self.stall
        return stall is not None and stall.asking and not stall.declared

    # ------------------------------------------------------------------ from HangWatch

    def tick(self, now: float) -> list[Fault]:
        """The hang watch's tick (HangWatch.tick with a verifier): ``prepare`` (samples
        while the budget runs down), the detector's tick, and a HANG it raises verified
        (``on_faults``); returns the faults to raise now, its next due time published."""
        faults = self._tick(now)
        self._publish(now)
        return faults

    def _publish(self, now: float) -> None:
        """``next_due``: ``next_tick(now)`` kept as a fact, so that the watch loop reads
        it instead of asking after every observation and tick (issue 36: 3 calls on the
        hang path, one per step in training). A ``next_tick`` that breaks is logged and
        ticked every time, as the loop did with one that raised."""
        try:
            self.next_due = self.next_tick(now)
        except Exception:
            log.exception("the hang verifier's next tick failed")
            self.next_due = now

    def _tick(self, now: float) -> list[Fault]:
        self.prepare(now)
        det = self.detector
        # the budget's end read in place (deadline_at): the detector is asked only once
        # it passed (a tick for the early sampling's start has nothing to ask it)
        due = det.deadline_at
        faults = det.tick(now) if not det.hung and due is not None and now > due else []
        if not faults and not self.ready:
            return faults  # nothing to judge or hand over
        return self.on_faults(faults, now)

    def prepare(self, now: float) -> None:
        """Before the detector's tick at ``now``: start sampling a budget that is running
        out (``verify_plan``), so its verdict is ready when it ends; drop samples taken
        for a deadline that moved (a phase began, a verdict deferred it). Inside a phase
        and before the first step the dead-still watch looks too (agent/dead_still.py)."""
        det = self.detector
        deadline = None if det.hung else det.deadline_at
        dead = self.dead_still
        if not dead.idle or self._dead_armed(deadline):  # off and idle: nothing to call
            dead.tick(now)
        if self.window <= 0 or self.cfg.hang_verify_from >= 1:
            return
        if det.hung:
            return  # the budget ran out: the samples under way (if any) are judged
        early = self._early
        if early is not None and early.deadline != deadline:
            self._drop_early()
        mark = self._mark
        if mark is not None and mark.deadline != deadline:
            self._drop_mark()
        if deadline is None or self._early is not None or now >= deadline:
            return
        if self._task is not None and not self._task.done():
            return  # a verdict is being judged (it defers or declares)
        plan, anchor = self._plan_for(now, deadline)
        if now < plan[0].at - LEAD:
            if now - anchor >= LEAD and self._mark is None:
                if self._askable():
                    self._take_mark(deadline)  # the window is far off: one cheap sample now
                else:  # asked once per budget: nobody to answer (next_tick looks no more)
                    self._mark = Mark(deadline)
            return  # not yet
        if plan[0].at >= deadline:
            return  # nothing before the deadline: after it, as before
        if self.stall is None:
            self.stall = Stall(start=min(now, det.last_progress),  # the last progress
                               step=det.last_step, waiting_on=self._waiting_hint)
        self._early = Early(deadline, plan, usage=_usage())
        self._suspect = None
        # no wake at its end: every end that moves ``next_tick`` says so itself (a
        # deferral, a verdict handed over, a budget that moved), in the task's last step
        self._task = asyncio.get_running_loop().create_task(self._sample_early(self._early))

    def _plan_for(self, now: float, deadline: float) -> tuple[tuple[Sample, ...], float]:
        """The plan of this budget (its deadline, where it began, the last step) and its
        anchor: made once per budget, not per tick."""
        det = self.detector
        key = (deadline, self._anchor, det.last_step)
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1], self._plan[2]
        began = self._anchor
        # else the last progress (det.seconds_since_progress's, read in place)
        anchor = began if began is not None and began < deadline else \
            min(now, det.last_progress)
        plan = verify_plan(deadline, deadline - anchor, self.window,
                           self.cfg.hang_verify_samples, self.cfg.hang_verify_from)
        self._plan = (key, plan, anchor)
        return plan, anchor

    def next_tick(self, now: float) -> float | None:
        """When the hang watch's tick (``prepare``, then the detector's) next has
        something to do, so the agent's ticker sleeps until then instead of ticking every
        0.5 s (watch/loop.py): ``now`` for a verdict ready or samples to drop; else the
        earliest of the dead-still watch's next look, this budget's mark and the start of
        its early sampling (``LEAD`` before the plan's first sample, as ``prepare``
        decides), and the budget's end (not while the early sampling runs: it ticks the
        detector itself at the end). None: nothing before an observation or a wake
        (``wake``: a verdict, a deferred budget, a budget that moved under the early
        samples). Mirrors
        ``prepare``: a tick before the time returned does nothing."""
        if self.ready:
            return now
        det = self.detector
        deadline = None if det.hung else det.deadline_at
        dead = self.dead_still
        # off and idle (a learned job between steps): nothing called
        due = dead.next_tick(now, deadline) if not dead.idle or self._dead_armed(deadline) \
            else None
        if deadline is None:
            held = self._early is not None or self._mark is not None
            return now if held and not det.hung else due
        at = self._prepare_at(now, deadline)
        early = self._early
        if early is not None and early.deadline == deadline and self._task is not None and \
                not self._task.done():
            # the budget's end is the early sampling's own: after its last sample
            # ``_budget_out`` ticks the detector itself, so the ticker need not wake for it
            # (it did, raised the HANG into ``_suspect`` for the task to pick up: a round
            # trip through the watch loop for a fault the task asks for anyway)
            return due
        return min(t for t in (due, at, deadline) if t is not None)

    def _prepare_at(self, now: float, deadline: float) -> float | None:
        """When ``prepare`` next acts on this budget (see ``next_tick``)."""
        if self.window <= 0 or self.cfg.hang_verify_from >= 1:
            return None
        early, mark = self._early, self._mark
        if (early is not None and early.deadline != deadline) or (
                mark is not None and mark.deadline != deadline):
            return now  # a budget that moved: its samples are dropped
        if early is not None or now >= deadline:
            return None
        if self._task is not None and not self._task.done():
            return None  # a verdict is being judged: what it moves wakes the ticker
        plan, anchor = self._plan_for(now, deadline)
        first = plan[0].at - LEAD
        if mark is None and anchor + LEAD < first:
            return max(now, anchor + LEAD)  # the mark (or finding nobody to ask)
        if plan[0].at >= deadline:
            return None  # nothing before the deadline: after it, as before
        return max(now, first)

    def _dead_armed(self, deadline: float | None) -> bool:
        """The dead-still watch is armed (``DeadStillWatch.armed``, asked here in place:
        between steps of a learned job it is neither armed nor holding anything)."""
        det = self.detector
        return deadline is not None and (det.last_step is None or bool(det.phases)) and \
            float(self.cfg.hang_dead_still_window or 0.0) > 0

    def woken(self, _task: object = None) -> None:
        """Tell the detectors' ticker that ``next_tick`` moved (also a task's done
        callback): ``next_due`` published first, for the loop to read."""
        self._publish(self.clock())
        if self.wake is not None:
            self.wake()

    def _defer(self, until: float) -> None:
        """The detector's ``defer``, and the ticker told: the budget's end moved."""
        self.detector.defer(until)
        self.woken()

    def _take_mark(self, deadline: float) -> None:
        """A stall ``LEAD`` old whose window begins more than ``LEAD`` later (a budget
        over 3 s): one cheap sample now, so that if the arbiter asks for this rank's
        stacks before its window began (a peer's budget ran out first), the answer is
        judged over CPU and I/O since now and two stacked samples, not over a window
        sampled from scratch after the question (2 s: the corpus's 5.1 s hangs). Only
        where someone may ask (an arbiter, local peers); a healthy 0.2 s step never
        lasts ``LEAD``: nothing is sampled then."""
        mark = Mark(deadline)

        async def sample() -> None:
            try:
                snap, _ = await self.sampler.sample(stacks=False)
            except Exception:  # noqa: BLE001 - evidence is best effort: no mark, no answer
                log.exception("the stall's mark sample failed")
                return
            mark.snap = snap

        mark.task = asyncio.get_running_loop().create_task(sample())
        self._mark = mark

    def _askable(self) -> bool:
        """Someone may ask for this rank's stacks mid-stall: an arbiter, or local peers."""
        ask = self.ask_arbiter
        return self.local_peers is not None or (ask is not None and bool(ask()))

    def _drop_mark(self) -> None:
        mark, self._mark = self._mark, None
        if mark is not None and mark.task is not None and not mark.task.done():
            mark.task.cancel()

    def _marked(self) -> list[Snapshot]:
        """The cheap samples of the stall in progress (its mark, and its window's samples
        so far, when none holds stacks yet), if the oldest is at least half a window old:
        the start of a DUMP_STACKS answer's window. Empty when there are none."""
        mark, early, deadline = self._mark, self._early, self.detector.deadline_at
        snaps: list[Snapshot] = []
        if mark is not None and mark.snap is not None and mark.deadline == deadline:
            snaps.append(mark.snap)
        if early is not None and early.deadline == deadline:
            snaps += early.snaps  # cheap ones so far (a window's first second)
        if not snaps or any(p.threads is not None for s in snaps for p in s.processes):
            return []  # stacks already: the window's own path (_recent)
        if self.clock() - snaps[0].ts < self.window / 2:
            return []
        return snaps

    def _drop_early(self) -> None:
        """Samples of a budget that did not run out: dropped, nothing written."""
        early, self._early = self._early, None
        if early is None:
            return
        self._drop_dump()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None

    async def _sample_early(self, early: Early) -> None:
        """The plan's samples up to the deadline, the flight-recorder dump beside the
        stacked ones, then the verdict at once (``verify`` on the samples). The budget's
        end is this task's to tick (``next_tick`` leaves it out while it runs): if it
        breaks, the ticker is told, and ticks the budget's end as without samples."""
        try:
            await self._sample_window(early)
        except Exception:
            log.exception("sampling the stall's window failed; verifying at the budget's end")
            if self._early is early:
                self._early = None
                self._drop_dump()
                self.woken()

    async def _sample_window(self, early: Early) -> None:
        stall = self.stall
        stacked = False
        # the window's processes: the trainer's tree as its first sample listed it, not
        # the tree read again per sample (a stalled tree does not grow; one that moves is
        # alive in the processes it had)
        pids: list[int] | None = None
        for s in early.plan:
            await self.sleep(max(0.0, s.at - self.clock()))
            snap, entries = await self.sampler.sample(stacks=s.stacks, pids=pids)
            if pids is None and snap.processes:
                pids = [p.pid for p in snap.processes if not p.gone] or None
            early.snaps.append(snap)
            if not s.stacks:
                continue
            early.entries = entries
            if not stacked:
                stacked = True
                self._drop_dump()
                if self.window_dump is not None:
                    self._dump = asyncio.get_running_loop().create_task(
                        _call(self.window_dump))
                if stall is not None and self._recognise(stall, snap, early.usage):
                    self._early = None
                    self._drop_dump()
                    return
        fault = await self._budget_out(early.deadline)
        if fault is None:  # the budget moved, or the hang was raised elsewhere
            self._early = None
            self._drop_dump()
            self.woken()  # the next budget's sampling may be due: the ticker asks again
            return
        self._early = None
        await self._verify_or_raise(fault, early)

    def _recheck_in(self, early: bool, step_budget: float | None = None) -> float:
        """Seconds from a verdict "alive" to the next one: a step budget, plus the window
        when it is sampled while the budget runs down -- verdicts as far apart as when the
        window came after the budget (one landing as a phase ends would teach the place
        the trainer moved on to, and each costs the agent's CPU)."""
        if step_budget is None:
            step_budget = self.detector.step_budget()
        return step_budget + (self.window if early else 0.0)

    def _drop_dump(self) -> None:
        dump, self._dump = self._dump, None
        if dump is not None:
            dump.cancel()

    async def window_dump_result(self) -> dict[str, Any] | None:
        """The flight recorder's dump taken in this stall's last verification window (for
        the hang fault's evidence), once; None when there is none."""
        dump, self._dump = self._dump, None
        if dump is None or dump.cancelled():
            return None
        try:
            got = await dump
        except asyncio.CancelledError:
            if not dump.cancelled():
                raise  # the caller is being cancelled, not the dump
            return None
        stall = self.stall
        if stall is not None and (stall.declared or stall.asking):
            stall.dump = got  # the arbiter's DUMP_STACKS answer takes this one too
        return got

    def _shared(self, stall: Stall | None) -> bool:
        """The open stall's last verification speaks for it now: it declared the hang or
        asked the arbiter (row C1), and its samples are no older than four windows."""
        return stall is not None and (stall.declared or stall.asking) and \
            stall.verdict is not None and bool(stall.snaps) and \
            self.clock() - stall.snaps[-1].ts <= max(self.window, 1.0) * 4

    async def stall_dump(self) -> dict[str, Any] | None:
        """The flight-recorder dump of the verification that declared the stall or asked
        the arbiter about it (awaited if still being taken): one capture per
        verification, for the fault's evidence and the arbiter's DUMP_STACKS alike (issue
        35); None when there is none, or it is stale."""
        stall = self.stall
        if stall is None or not self._shared(stall):
            return None
        dump = self._dump
        if stall.dump is None and dump is not None and not dump.cancelled():
            with contextlib.suppress(asyncio.CancelledError):
                got = await asyncio.shield(dump)
                if self.stall is stall:
                    stall.dump = got
        return stall.dump

    async def _budget_out(self, deadline: float) -> Fault | None:
        """The HANG fault for ``deadline``: the one the tick raised meanwhile, or the
        detector's own tick at once (the verdict need not wait for the next tick)."""
        for _ in range(40):  # up to ~2 s for the detector's clock (a backlog) to catch up
            if self._suspect is not None:
                fault, self._suspect = self._suspect, None
                return fault
            det = self.detector
            if det.hung or det.deadline_at != deadline:
                return None  # raised elsewhere, or the budget moved
            got = [f for f in det.tick(self.now()) if f.kind is FaultKind.HANG]
            if got:
                return got[0]
            await self.sleep(max(0.0, deadline - self.clock()) + 0.05)
        return None

    def on_faults(self, faults: list[Fault], now: float) -> list[Fault]:
        """The detector's faults at ``now``: a HANG starts a verification instead of being
        raised (or completes the one sampling its budget); returns the faults to raise
        now (others, and verdicts done meanwhile)."""
        out, self.ready = self.ready, []
        for f in faults:
            if f.kind is not FaultKind.HANG or self.window <= 0:
                out.append(f)
                continue
            if self._task is not None and not self._task.done():
                if self._early is not None:
                    self._suspect = f  # its samples are being taken: judged with them
                continue  # already verifying this stall
            # its end wakes nobody: a verdict that moves ``next_tick`` (a deferral, a
            # fault handed over) says so itself; a declared hang moves nothing
            self._task = asyncio.get_running_loop().create_task(self._verify_or_raise(f))
        return out

    async def _verify_or_raise(self, fault: Fault, early: Early | None = None) -> None:
        """``verify``; if verification itself fails, the hang is raised as it was."""
        try:
            await self.verify(fault, early)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("hang verification failed; declaring the hang on its budget")
            if self.stall is not None:
                self.stall.declared = True
            out = dataclasses.replace(fault, evidence={
                **fault.evidence, "verdict": "unknown",
                "verification": {"state": "unknown", "missing": [f"verification failed: {e!r}"]}})
            if self.emit is None:
                self.ready.append(out)
                self.woken()
            else:
                await self.emit(out)

    def observe(self, obs: Observation, seen: Observed | None) -> None:
        if isinstance(obs, (TrainerStart, ProcessExit)):
            self._end(None)
        elif isinstance(obs, PhaseMarker):
            # an end marker closes the stall (Megatron's "validation loss at iteration N"
            # after an evaluation it never announced); a begin marker hands it to a phase
            self._end(None if obs.begin else obs)
        elif isinstance(obs, Progress) and seen is not None and seen.new_progress:
            self._end(obs)
        self._publish(self.clock())  # the budget's end moved with the observation

    # ------------------------------------------------------------------ verification

    async def verify(self, fault: Fault, early: Early | None = None) -> None:
        """Judge the samples taken while the budget ran down (``early``), or sample over
        the window now; then defer (alive, spinning) or raise ``fault``."""
        det = self.detector
        now = self.clock()
        since = fault.evidence.get("seconds_since_progress")
        if not isinstance(since, (int, float)):
            since = det.seconds_since_progress(now)
        if self.stall is None:
            self.stall = Stall(start=now - float(since), step=det.last_step,
                               waiting_on=self._waiting_hint)
        stall = self.stall
        if early is not None and early.snaps:
            usage = early.usage
            snaps, entries = list(early.snaps), early.entries
        else:
            usage = _usage()
            snaps = []
            entries = []
            n = max(2, int(self.cfg.hang_verify_samples))
            t0 = self.clock()
            for i in range(n):
                if i:
                    await self.sleep(max(0.0, t0 + i * self.window / (n - 1) - self.clock()))
                snap, entries = await self.sampler.sample()
                snaps.append(snap)
                if i == 0 and self._recognise(stall, snap, usage):
                    return
        if self.stall is not stall:
            return  # steps resumed while sampling
        stall.snaps = snaps
        stall.entries = entries
        stall.asking = False  # a new verdict answers for the stall now
        verdict = judge(snaps, self.thresholds)
        cost = _usage() - usage
        stall.verdict = verdict
        stall.verifications += 1
        self.verifications += 1
        stalled = self.clock() - stall.start
        spin_budget = self._spin_budget(verdict)
        if stall.spin_cap is not None:
            spin_budget = min(spin_budget, stall.spin_cap)
        # the policy's window, /proc read right after the last sample; whether the still
        # thread waits in a collective is the window's (computed once, there)
        window = await self.window_of(verdict, snaps)
        waiting = window.in_collective
        # whether an arbiter can compare the ranks: its answer matters to a rank waiting
        # in a collective alone (rows C1/C2, the local peers' question), asked only then
        arbiter = waiting and self.ask_arbiter is not None and self.ask_arbiter()
        if waiting and stall.waiting_on is None and not stall.declared and not arbiter and \
                self.local_peers is not None:
            await self._local_wait(stall)  # sampling the local peers: before the policy
            if self.stall is not stall:
                return  # steps resumed while the peers were asked
        step_budget = det.step_budget()  # once per verdict: the budget and its recheck
        # one question to the policy: the verdict with its label, message and json
        ruling = ruling_of(self.budget(stall, stalled, spin_budget, self._recheck_in(
            early is not None, step_budget), step_budget), window, self._peers(stall, arbiter),
            budget_message=fault.message)
        got = stall.decision = ruling.verdict
        stall.io_blocked = tuple(b for b in window.blocked if b.kind in IO_KINDS) \
            if got.rule == "I1" else ()
        if got.act is Act.RECHECK and got.state is State.WAITING_ON_PEER and \
                got.rule == "P1":
            # the arbiter judged the job busy: waiting on that rank is not a hang (its own
            # agent declares it if it hangs); bounded by --hang-phase-timeout
            self._count("waiting")
            again = self.clock() + det.step_budget()
            self._defer(again)
            self._write("verify", "waiting", f"stalled {stalled:.1f}s waiting in "
                        f"{verdict.where} on {stall.waiting_on}: not a hang", verdict, cost,
                        stall, waiting_on=stall.waiting_on, rule=got.rule,
                        suspect_again_in=round(again - self.clock(), 3))
            return
        if got.rule == "C2":
            # still waiting in the collective, the arbiter still comparing the ranks: its
            # answer (BUSY, or a restart for a job hang) decides, not this rank alone
            stall.asking = True
            again = self.clock() + det.step_budget()
            self._defer(again)
            assert stall.asked_at is not None
            self._write("verify", "asking", f"stalled {stalled:.1f}s waiting in "
                        f"{verdict.where}; the arbiter has not answered for "
                        f"{self.clock() - stall.asked_at:.1f}s (it decides within "
                        f"{ARBITER_ANSWER_WAIT:.0f}s)", verdict, cost, stall, rule=got.rule,
                        suspect_again_in=round(again - self.clock(), 3))
            return
        if got.act is Act.ASK:
            self._count("suspect")
            stall.suspected = stall.asking = True
            stall.asked_at = self.clock()
            out = self._suspicion(fault, verdict, stalled, entries)
            self._defer(self.clock() + det.step_budget())  # not "hung" while it compares
            self._write("verify", "suspect", out.message, verdict, cost, stall, rule=got.rule)
            self._raise(out)
            return
        kind = ruling.label
        self._count(kind)
        if got.act is not Act.DECLARE:
            stall.verified = got.state is not State.UNDECIDED
            again = self.clock() + (got.recheck_in if got.recheck_in is not None
                                    else self._recheck_in(early is not None, step_budget))
            self._defer(again)
            self._anchor = self.clock()  # the next budget's samples count from here
            text = (self._alive_text(verdict, stall, stalled, spin_budget)
                    if got.rule[0] in "AS" else got.reason)
            self._write("verify", kind, text, verdict, cost, stall, rule=got.rule,
                        suspect_again_in=round(again - self.clock(), 3),
                        budget_seconds=fault.evidence.get("budget_seconds"))
            return
        stall.declared = True
        out = self._fault(fault, verdict, stalled, entries, ruling)
        # the evidence assembled once: the events line's verification is the fault's
        self._write("verify", kind, out.message, verdict, cost, stall, rule=got.rule,
                    motion=out.evidence["verification"])
        self._raise(out)

    def budget(self, stall: Stall | None, stalled: float, spin_budget: float,
               recheck_every: float | None = None, step_budget: float | None = None
               ) -> Budget:
        """The policy's budget input for this rank now (the dead-still watch's too);
        ``step_budget``: the detector's, when the caller has it already."""
        det = self.detector
        phase = det.current_phase() if det.phases else None  # none open: nothing to ask
        prev = stall.decision if stall is not None else None
        return Budget(stalled_for=stalled, step_budget=det.step_budget()
                      if step_budget is None else step_budget,
                      spin_budget=spin_budget,
                      phase_timeout=float(self.cfg.hang_phase_timeout),
                      io_timeout=float(self.cfg.hang_io_timeout),
                      dead_still_window=float(self.cfg.hang_dead_still_window),
                      phase=phase, phase_learned=phase is not None and
                      phase in det.phase_longest, first_step=det.last_step is None,
                      declared=stall is not None and stall.declared, rank=self.rank,
                      recheck_every=recheck_every,
                      last_io=stall.io_blocked if stall is not None else (),
                      last_where=prev.where if prev is not None else None)


    def _peers(self, stall: Stall, arbiter: bool) -> Peers:
        asked = None
        if stall.suspected and stall.asked_at is not None:
            asked = self.clock() - stall.asked_at
        busy = None
        if stall.waiting_on is not None:
            m = _RANK.match(stall.waiting_on)
            busy = int(m.group(1)) if m else None
        return Peers(busy_rank=busy, busy_in=stall.waiting_on, arbiter=arbiter,
                     asked_for=asked, answer_wait=ARBITER_ANSWER_WAIT)

    def _raise(self, out: Fault) -> None:
        if self.emit is None:
            self.ready.append(out)
            self.woken()
        else:
            task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(self.emit(out))
            self._emitting.add(task)
            task.add_done_callback(self._emitting.discard)

    # ------------------------------------------------------------------ the arbiter's word

    def peer_busy(self, waiting_on: str) -> bool:
        """The arbiter judged the job busy and this rank waits on ``waiting_on`` ("rank 0
        (busy in save ...)"): this stall is waiting, not hanging, until steps resume or
        --hang-phase-timeout. False when no stall is open yet (its budget has not run out:
        the stall it opens adopts the wait, until steps resume)."""
        stall = self.stall
        if stall is None:
            self._waiting_hint = waiting_on
            return False
        stall.waiting_on = waiting_on
        stall.asking = False
        self._defer(self.clock() + self.detector.step_budget())
        return True

    async def _local_wait(self, stall: Stall) -> None:
        """No arbiter, launcher mode: ask the local peers' verifiers for their liveness (a
        verdict from their last window, or a window now) and, if one is busy, this stall
        waits on it (``peer_wait.local_busy_peer``); a spinning one gets the culprit spin
        budget, as the arbiter's BUSY gives it."""
        from ftagent.agent.peer_wait import local_busy_peer, local_waiting_text

        assert self.local_peers is not None
        peers = [(r, v) for r, v in self.local_peers() if v is not self]
        if not peers:
            return
        answers = await asyncio.gather(*(_liveness_of(v) for _, v in peers),
                                       return_exceptions=True)
        live = {r: a for (r, _), a in zip(peers, answers, strict=True) if isinstance(a, dict)}
        got = local_busy_peer(live)
        if got is None or self.stall is not stall:
            return
        rank, state, where = got
        stall.waiting_on = local_waiting_text(rank, state, where)
        fields: dict[str, Any] = {"waiting_on": stall.waiting_on, "local": True,
                                  "busy_ranks": [rank], "state": state}
        if state == "spinning":
            peer = dict(peers)[rank]
            peer.spin_culprit(float(self.cfg.hang_culprit_spin_timeout))
            fields["culprit_spin_budget_seconds"] = float(self.cfg.hang_culprit_spin_timeout)
        msg = f"waiting on {stall.waiting_on}: a local peer is busy, not hung (no arbiter)"
        log.warning("%s", msg)
        if self.record is not None:
            self.record("peer", "waiting", msg, **fields)

    def recent_liveness(self) -> dict[str, Any] | None:
        """The open stall's verdict if its samples are no older than a window (no new
        sample: seven ranks of a node asking each other stay cheap); else None."""
        stall = self.stall
        if stall is None or stall.verdict is None or not stall.snaps:
            return None
        if self.clock() - stall.snaps[-1].ts > self.window:
            return None
        v = stall.verdict
        return {"state": v.state.value, "where": v.where, "declared": stall.declared}

    def spin_culprit(self, budget: float) -> float | None:
        """The others wait on this rank in a collective while it spins: its spin budget
        becomes ``budget`` (--hang-culprit-spin-timeout) from the stall's start. Returns
        the seconds until it is checked again (None: no stall open)."""
        stall = self.stall
        if stall is None:
            return None
        stall.spin_cap = budget
        at = max(self.clock() + 0.5, stall.start + budget)
        self._defer(at)
        return at - self.clock()

    def _recognise(self, stall: Stall, snap: Snapshot, usage: float) -> bool:
        """The first sample runs where a learned phase ran: its budget, no window."""
        if stall.recognised is not None or stall.verified or not self.book.places:
            return False  # (nothing learned yet: no stack to read, no book to ask)
        got = self.book.match(stacks_of(snap))
        if got is None:
            return False
        budget = self.book.budget(got, self.detector.step_budget())
        if self.clock() - stall.start >= budget:
            return False  # over the learned budget too: verify
        stall.recognised = got
        self._defer(stall.start + budget)
        self._count("recognised")
        step = "no step yet" if stall.step is None else f"step {stall.step}"
        self._write("verify", "recognised",
                    f"stall after {step} runs in {got.where}, an undeclared phase learned "
                    f"before (longest {got.longest:.1f}s, seen {got.count}x): budget "
                    f"{budget:.1f}s from the last step, no verification window", None,
                    _usage() - usage, stall, where=got.where, learned_budget_seconds=round(
                        budget, 3))
        return True

    def _spin_budget(self, verdict: Motion) -> float:
        # nothing learned yet (read in place): the flag's budget, no book to ask
        learned = self.book.at(verdict.place) if self.book.places else None
        if learned is not None:
            return self.book.budget(learned, self.detector.step_budget())
        return float(self.cfg.hang_spin_timeout)

    @property
    def rank(self) -> int | None:
        """This rank, as the worker's lifecycle says it now (HangParts.rank: read in
        place)."""
        r = self._rank
        if r is None or isinstance(r, int):
            return r
        return r() if callable(r) else r.rank

    @rank.setter
    def rank(self, value: int | Ranked | Callable[[], int] | None) -> None:
        self._rank = value

    async def stacks_for_arbiter(self, pids: Sequence[int] = ()) -> dict[str, Any]:
        """The DUMP_STACKS answer: this rank's stacks plus a ``liveness`` field (a fresh
        verdict over the window, or the hang this agent already declared), so the arbiter
        can tell ranks busy in a phase from ranks waiting in a collective."""
        try:
            return await self._stacks_for_arbiter()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the arbiter still gets stacks, without the verdict
            log.exception("liveness for the arbiter failed")
            from ftagent.agent.evidence import capture

            got = await capture(list(pids), self.cfg.hang_dump_timeout)
            return {**got, "liveness": {"state": "unknown", "declared": False,
                                        "missing": [f"verification failed: {e!r}"]}}

    async def _stacks_for_arbiter(self) -> dict[str, Any]:
        t = self.clock()
        stall = self.stall
        if stall is not None and stall.verdict is not None and self._shared(stall) and \
                stall.entries:
            # the verification that declared the hang or asked the arbiter: its own
            # capture and verdict, not taken twice (issue 35)
            entries = stall.entries
            live = {**_brief(stall.verdict), "declared": stall.declared}
            if stall.decision is not None:
                live["stall"] = stall.decision.to_json()
                state = peer_state(stall.decision, live["state"])
                if state != live["state"]:
                    live.update(state=state, reason=stall.decision.reason)
        elif stall is not None and stall.declared and stall.verdict is not None:
            _, entries = await self.sampler.sample()  # the declaration's capture is stale
            live = {**_brief(stall.verdict), "declared": True}
            if stall.decision is not None:
                live["stall"] = stall.decision.to_json()
        elif stall is not None and self._recent(stall):
            # samples of this stall's window (taken while its budget ran down): one more
            # now, and the verdict over them, without waiting a window
            snap, entries = await self.sampler.sample()
            snaps = [*self._recent(stall), snap]
            verdict = judge(snaps, self.thresholds)
            live = await self._answer(verdict, snaps, stall)
        elif marked := self._marked():
            # asked before this rank's window took stacks (its budget runs out later than
            # the peer's that asked): CPU and I/O since the mark, two stacked samples a
            # sample period apart -- not a window from scratch (issue 35)
            snaps = list(marked)
            n = max(2, int(self.cfg.hang_verify_samples))
            t0 = self.clock()
            entries = []
            for i in range(2):
                if i:
                    await self.sleep(max(0.0, t0 + self.window / (n - 1) - self.clock()))
                snap, entries = await self.sampler.sample()
                snaps.append(snap)
            verdict = judge(snaps, self.thresholds)
            live = await self._answer(verdict, snaps, self.stall)
        else:
            snaps = []
            n = max(2, int(self.cfg.hang_verify_samples))
            t0 = self.clock()
            entries = []
            for i in range(n):
                if i:
                    await self.sleep(max(0.0, t0 + i * self.window / (n - 1) - self.clock()))
                snap, entries = await self.sampler.sample()
                snaps.append(snap)
            verdict = judge(snaps, self.thresholds)
            live = await self._answer(verdict, snaps, stall)
        return {"processes": entries, "seconds": round(self.clock() - t, 3), "liveness": live}

    async def _answer(self, verdict: Motion, snaps: list[Snapshot],
                      stall: Stall | None) -> dict[str, Any]:
        """The liveness the arbiter reads: the motion verdict, and the stall policy's over
        the same samples; a rank waiting on remote I/O is busy to its peers (alive), not
        hung: the arbiter answers BUSY and the peers wait (issue 35)."""
        live: dict[str, Any] = {**_brief(verdict), "declared": False}
        stalled = 0.0 if stall is None else max(0.0, self.clock() - stall.start)
        got = decide(self.budget(stall, stalled, self._spin_budget(verdict)),
                     await self.window_of(verdict, snaps))
        live["stall"] = got.to_json()
        state = peer_state(got, verdict.state.value)
        if state != live["state"]:
            live.update(state=state, reason=got.reason)
        return live

    async def window_of(self, verdict: Motion, snaps: Sequence[Snapshot]) -> Window:
        """The policy's window over ``snaps``, with what /proc says the still threads wait
        on (agent/proc_wait.py: read once, on the tree of the last sample)."""
        if self.waits is None or not snaps:
            return window_of(verdict, snaps)
        pids = [p.pid for p in snaps[-1].processes if not p.gone]
        try:
            got = self.waits(pids)  # a few /proc files per blocked thread: milliseconds
        except Exception:  # noqa: BLE001 - evidence is best effort; never the verdict's end
            log.exception("reading what the trainer's threads wait on failed")
            return window_of(verdict, snaps)
        return window_of(verdict, snaps, got.blocked)

    def _recent(self, stall: Stall) -> list[Snapshot]:
        """This stall's samples from the last window (the one being taken, else the last
        judged), if they are no older than the window and hold stacks (motion needs two
        stacked samples with the one taken now): the newest ``samples - 1``."""
        early = self._early
        snaps = early.snaps if early is not None and early.snaps else stall.snaps
        if not snaps or self.clock() - snaps[-1].ts > self.window:
            return []
        n = max(2, int(self.cfg.hang_verify_samples))
        recent = list(snaps[-(n - 1):])
        if not any(p.threads is not None for s in recent for p in s.processes):
            return []  # cheap samples only so far: a window of its own
        return recent

    # ------------------------------------------------------------------ the end of a stall

    def declare_now(self, fault: Fault, start: float, motion: Motion,
                    got: Verdict) -> None:
        """A hang the dead-still watch declared inside a phase (its budget not run out)."""
        self.stall = Stall(start=start, step=self.detector.last_step, declared=True,
                           verdict=motion, decision=got)
        self._count(got.state.value)
        self._write("verify", got.state.value, fault.message, motion, 0.0, self.stall,
                    rule=got.rule)
        self._raise(fault)

    def _end(self, obs: Progress | PhaseMarker | None) -> None:
        if not self.dead_still.idle:
            self.dead_still.reset()
        stall, self.stall = self.stall, None
        self._waiting_hint = None
        self._drop_early()
        self._drop_dump()
        self._suspect = None
        self._anchor = None
        self._drop_mark()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None
        if stall is None or obs is None:
            return
        if stall.waiting_on is not None and self.record is not None:
            seconds = max(0.0, obs.ts - stall.start)
            self.record("peer", "waited", f"waited {seconds:.1f}s on {stall.waiting_on}; "
                        "steps resumed (waiting, not hanging)", step=stall.step,
                        seconds=round(seconds, 3), waiting_on=stall.waiting_on)
        if stall.suspected and stall.waiting_on is None and not stall.declared:
            return  # a suspicion nobody answered: nothing known to learn
        if not (stall.verified or stall.recognised or stall.declared or stall.waiting_on):
            return  # steps resumed before anything was verified
        seconds = max(0.0, obs.ts - stall.start)
        place = stall.verdict.place if stall.verdict is not None else None
        where = stall.verdict.where if stall.verdict is not None else None
        if place is None and stall.recognised is not None:
            place, where = stall.recognised.place, stall.recognised.where
        learned, evicted = self.book.learn(place, where, seconds, stall.step)
        budget = self.book.budget(learned, self.detector.step_budget())
        how = ("recognised from a learned phase" if stall.recognised is not None else
               "declared hung, then resumed by itself" if stall.declared else
               "waited on a busy local rank" if stall.waiting_on and
               stall.waiting_on.startswith("local rank") else
               "waited on a rank the arbiter judged busy" if stall.waiting_on else
               "verified alive")
        step = "before the first step" if stall.step is None else f"at step {stall.step}"
        msg = (f"undeclared phase {step}, {seconds:.1f} s, in {learned.where} ({how}; "
               f"learned budget {budget:.1f} s; declare it with ftagent.phase() to skip "
               "verification)")
        log.info("%s", msg)
        if self.record is not None:
            self.record("phase", "undeclared", msg, step=stall.step,
                        seconds=round(seconds, 3), where=learned.where,
                        learned_budget_seconds=round(budget, 3), occurrences=learned.count,
                        verified=stall.verified, recognised=stall.recognised is not None,
                        declared=stall.declared, verifications=stall.verifications,
                        waited=stall.waiting_on is not None)
        if self.learned is not None:
            self.learned(round(seconds, 3), learned.where)
        m = self.metrics
        if m is not None:
            with contextlib.suppress(Exception):
                m.undeclared_phases.inc()
                m.undeclared_phase_budget.labels(**m.labels(
                    where=learned.where[:MAX_WHERE])).set(budget)
                for e in evicted:
                    m.undeclared_phase_budget.remove(*m.labels(
                        where=e.where[:MAX_WHERE]).values())

    # ------------------------------------------------------------------ helpers

    def _fault(self, fault: Fault, verdict: Motion, stalled: float,
               entries: list[dict[str, Any]], ruling: Ruling | None = None) -> Fault:
        """``fault`` with the verification as evidence; ``ruling``: the stall policy's
        (``stall.ruling_of``: its message, label and json), None for a suspicion."""
        got = ruling.verdict if ruling is not None else None
        msg = fault.message if ruling is None else ruling.message
        evidence = {**fault.evidence, "verification": verdict.to_json(),
                    "verdict": verdict.state.value if ruling is None else ruling.label,
                    "where": (got.where if got is not None else None) or verdict.where,
                    "stall_seconds": round(stalled, 3), "processes": entries}
        if ruling is not None and got is not None:
            evidence.update(stall=ruling.json, rule=got.rule, culprits=list(got.culprits))
            if got.kill:
                evidence["kill"] = True  # a stopped process ignores SIGTERM
        return dataclasses.replace(fault, message=msg, evidence=evidence)

    def _suspicion(self, fault: Fault, verdict: Motion, stalled: float,
                   entries: list[dict[str, Any]]) -> Fault:
        """A rank verified waiting in a collective: a WARNING the arbiter decides as a
        hang (policy.suspected_hang) once it has compared the ranks."""
        out = self._fault(fault, verdict, stalled, entries)
        return dataclasses.replace(
            out, severity=Severity.WARNING,
            message=f"waiting in a collective for {stalled:.1f}s ({verdict.where}): a hang "
                    "only if no peer is busy; the arbiter compares the ranks",
            evidence={**out.evidence, "waiting_in_collective": True})

    def _alive_text(self, verdict: Motion, stall: Stall, stalled: float,
                    spin_budget: float) -> str:
        step = "no step yet" if stall.step is None else f"last step {stall.step}"
        if verdict.state is Liveness.SPINNING:
            return (f"stalled {stalled:.1f}s ({step}) but spinning in {verdict.where}: a hang "
                    f"if it still spins at {spin_budget:.0f}s; {verdict.reason}")
        return (f"stalled {stalled:.1f}s ({step}) but alive: {verdict.reason}; an "
                "undeclared phase, not a hang")

    def _write(self, event: str, kind: str, message: str, verdict: Motion | None,
               cost: float, stall: Stall, motion: dict[str, Any] | None = None,
               **fields: Any) -> None:
        """One events line; ``motion``: the verdict's ``to_json()``, when made already."""
        log.info("hang verification: %s", message)
        if self.record is None:
            return
        extra: dict[str, Any] = {"step": stall.step,
                                 "stall_seconds": round(self.clock() - stall.start, 3),
                                 "agent_cpu_seconds": round(cost, 4), **fields}
        if verdict is not None:
            extra.update(where=verdict.where, window_seconds=round(verdict.window_seconds, 3),
                         samples=verdict.samples, verification=_brief(verdict, motion))
        self.record(event, kind, message, **extra)

    def _count(self, verdict: str) -> None:
        m = self.metrics
        if m is not None:
            with contextlib.suppress(Exception):
                m.hang_verifications.labels(**m.labels(verdict=verdict)).inc()


async def _liveness_of(peer: Verifier) -> dict[str, Any]:
    """A local peer's liveness: its last window's verdict, else the arbiter's answer (one
    sample more, or a window now)."""
    recent = peer.recent_liveness()
    if recent is not None:
        return recent
    got = await peer.stacks_for_arbiter()
    live = got.get("liveness")
    return live if isinstance(live, dict) else {}


async def _call(fn: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """``fn()``; a failure is an answer with its error, never an exception."""
    try:
        return await fn()
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - evidence is best effort
        return {"summaries": [], "errors": [f"flight-recorder dump failed: {e!r}"[:300]]}


def _brief(v: Motion, whole: dict[str, Any] | None = None) -> dict[str, Any]:
    """The verdict without per-thread detail beyond the first few threads per process;
    ``whole``: its ``to_json()`` made already (copied here, never changed)."""
    out = dict(v.to_json() if whole is None else whole)
    out["processes"] = [{**p, "threads": p["threads"][:8]} for p in out["processes"][:16]]
    return out


def _usage() -> float:
    """CPU seconds of this agent and its reaped children (py-spy) so far."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
