"""The pod's decider when an arbiter decides for the job (``ftagent run --arbiter HOST:PORT``).

One ``ArbiterDecider`` per pod, as the local policy is one (decider.py): inside it a
:class:`RankSession` per worker -- its own ``ArbiterLink`` (the wire is one stream per
rank: the arbiter thinks in ranks, and its barrier holds every rank of the job, this
pod's included) and that rank's hooks -- and the pod's one ``LocalDecider``, to which
every rank fails open. What changes against the local policy, and only this:

* **Barrier**: before every (re)start the agent arrives at the job barrier of its
  generation once its previous trainer has fully exited, and starts only when the arbiter
  releases it, so every rank starts together and no new trainer meets the previous
  attempt's rendezvous store.
* **Decisions**: faults go to the arbiter, whose commands (RESTART, STOP, REPLACE,
  DUMP_STACKS) become the agent's actions. The restart budget is the job's.
* **Fail open**: if the arbiter is unreachable — at start, during a barrier, or while a
  decision is awaited — for ``--arbiter-fail-open-after`` seconds, the agent goes on
  alone: it starts the trainer, and its local policy decides about faults. A fault raised
  while the arbiter is briefly away waits for it (it is usually back within seconds, and
  a decision taken alone splits the job's generations); it is decided locally only once
  the link has been down that long. Faults stay kept in the link and reach the arbiter
  (or its successor) when it is back, until settled. A trainer started without the
  barrier says so in the agent's Hello, and the arbiter reconciles (barrier.reconcile).
  Alone is the node's local group with ``--nproc-per-node N``: a decision taken alone
  stops and restarts every local worker together, and a start without the arbiter waits
  at the group's barrier for every local worker's previous trainer to be gone.
* **Spare** (``--spare``, or told SPARE by the arbiter): before its first trainer the
  agent serves as the job's warm spare -- its warm standby prepared (``prepare_spare``),
  no trainer, never failing open (a spare has no rank to train as) -- until the arbiter
  ASSIGNs it a replaced rank; then it is that rank (the link's core moves the lifecycle,
  ``Lifecycle.assign``: every part reads the rank there) and arrives
  at the new generation's barrier like any rank, and its first trainer is the standby.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from ftagent.agent.decider import Barrier, LocalDecider, Look
from ftagent.agent.evidence import capture
from ftagent.agent.reporter import ArbiterLink
from ftagent.agent.seat import RankHooks
from ftagent.model import (
    Action,
    ActionKind,
    Fault,
    FaultKind,
    Severity,
)
from ftagent.wire import exit_note
from ftagent.wire.convert import stacks_json

if TYPE_CHECKING:
    from ftagent.agent.seat import Seat
    from ftagent.agent.worker_parts import Observer

log = logging.getLogger("ftagent.arbiter_decider")

POLL = 0.25  # the shortest wait for the fail-open time (no polling: waits are woken)
ASSIGNED_WAIT = 30.0  # seconds an assigned spare whose preflight failed waits for the arbiter


class RankSession:
    """One rank's seat at the pod's arbiter decider: its link (one stream per rank: the
    arbiter thinks in ranks) and that rank's hooks (seat.py ``RankHooks``), given when
    it is made and never set afterwards."""

    def __init__(self, link: ArbiterLink, hooks: RankHooks) -> None:
        self.link = link
        # hang_state (progress summaries), stacks (DUMP_STACKS: cmd/run.py adds the liveness
        # verdict, the flight recorder its dumps), on_busy (peer_wait.py), prepare_spare
        self.hooks = hooks
        self.undecided: Fault | None = None
        self.tasks: list[asyncio.Task[Any]] = []  # the link's
        self.watchdogs: set[asyncio.Task[Any]] = set()  # decisions awaited
        # the barrier's generation this rank waits at (None: not waiting) and since when
        self.waiting_at: int | None = None
        self.waiting_since = 0.0

    @property
    def released_start(self) -> bool:
        """The current trainer was started by the barrier (the link's core says so when
        it starts: ``LinkProtocol.released_start``)."""
        return bool(self.link.proto.released_start)

    def spawn(self, coro: Awaitable[Any]) -> None:
        """A task of this rank's (a decision watchdog), kept until it is done."""
        task = asyncio.ensure_future(coro)
        self.watchdogs.add(task)
        task.add_done_callback(self.watchdogs.discard)


def rank_link(worker: Seat) -> ArbiterLink:
    """A rank's link to the arbiter (one gRPC stream); its Hello's restart count and its
    RESTART dedup read the worker's lifecycle, and its commands move that lifecycle's
    desired state (which wakes the worker: no queue, no forwarder)."""
    cfg = worker.cfg
    return ArbiterLink(cfg.arbiter, cfg.identity,
                       max_restarts=cfg.supervisor.max_restarts or None,
                       lifecycle=worker.lifecycle)


class ArbiterDecider:
    """The arbiter as the pod's decider: a link session per rank inside it; ``local``
    (the pod's one local policy) decides when failing open. ``link`` builds a rank's
    link and ``clock`` times the barrier: the protocol simulation (tests/sim) passes its
    own transport and time, and drives this very class."""

    def __init__(self, local: LocalDecider | None = None, *,
                 link: Callable[[Seat], ArbiterLink] = rank_link,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.local = local if local is not None else LocalDecider()
        self.sessions: dict[Seat, RankSession] = {}
        self.fail_open_after = 0.0  # from the workers' configuration (one per pod)
        self._link = link
        self.clock = clock

    def add(self, worker: Seat, hooks: RankHooks | None = None) -> Sequence[Observer]:
        """A rank's session (its link, not yet running, and its ``hooks``) and its seat in
        the local group; the worker carries the link as an observer of its trainer: the
        shell for its progress (``ArbiterLink.observe``), the link's core for its exit and
        start (``LinkProtocol.observe``, ``on_state``), no adapter between them."""
        s = self.sessions[worker] = RankSession(self._link(worker), hooks or RankHooks())
        s.link.proto.replica_port = s.hooks.replica_port  # said in the Hello (before start)
        s.link.hang_state = s.hooks.hang_state  # said with each progress summary
        self.fail_open_after = worker.cfg.arbiter.arbiter_fail_open_after
        return (*self.local.add(worker), s.link, s.link.proto)

    def session(self, worker: Seat) -> RankSession:
        """``worker``'s rank session."""
        return self.sessions[worker]

    def link_of(self, worker: Seat) -> ArbiterLink | None:
        """``worker``'s link to the arbiter, once it has a seat (read when used, never
        kept: the parts are built before the seat is taken)."""
        s = self.sessions.get(worker)
        return s.link if s is not None else None

    def connected(self, worker: Seat) -> bool:
        """``worker`` has a stream up to the arbiter now (False before it has a seat): the
        hang verifier's "someone may ask for these stacks mid-stall" (HangParts.ask_arbiter),
        read here, not through a closure in the wiring."""
        s = self.sessions.get(worker)
        return s is not None and s.link.connected

    def start(self, worker: Seat) -> None:
        s = self.sessions[worker]
        s.link.starting()  # the fail-open clock starts now, before the first barrier
        s.tasks = [asyncio.create_task(s.link.run())]

    async def close(self, worker: Seat) -> None:
        """Tell the arbiter how this rank ended, then close its link.

        The link ends its stream and waits for the arbiter to confirm it read it all
        (``ArbiterLink.finish``): a connected arbiter does at once. One that is away
        (restarting, failing over -- or SIGKILLed with the exit written to it unread) is
        given ``--arbiter-fail-open-after`` to come back (what a fault waits before it is
        decided alone), and hears the exit on the new stream: otherwise a job that
        finished while its arbiter was away reads "gone (was running)", not succeeded.
        An arbiter never reached is not waited for. Past that wait the agent exits with
        the trainer's code all the same, and says so: the arbiter keeps the job as
        "gone: no agent for Ns (was running)", which is all it knows."""
        s = self.sessions[worker]
        link = s.link
        try:
            await self.local.close(worker)
            if s.tasks and (link.connected or link.arbiter_id):
                # it was reached once: if away, it may be back (a restart, a failover)
                if not link.connected:
                    log.warning("the arbiter is away at exit: waiting up to %.0fs for it "
                                "to hear how this rank ended", self.fail_open_after)
                if not await link.finish(self.fail_open_after):
                    log.warning("the arbiter did not confirm how this rank ended within "
                                "%.0fs: exiting all the same (its status may read \"gone\")",
                                self.fail_open_after)
                    _leave_exit(worker, link)
        finally:
            for dog in list(s.watchdogs):
                dog.cancel()
            if s.tasks:
                (link_task,) = s.tasks
                await link.close()
                link_task.cancel()
                await asyncio.gather(link_task, return_exceptions=True)

    # ------------------------------------------------------------------ the hooks

    def barrier(self, worker: Seat) -> Barrier:
        """One look at this rank's barrier, made by the worker each time it wakes while
        it waits there (worker.py ``wait_at_barrier``): the desired state -- the
        lifecycle's ``released``, which the arbiter's RELEASE moves; a decision; a stop --
        against the generation the rank waits for. Not yet: how long the worker may sleep
        before failing open can be due (it wakes sooner when the desired state moves). The
        first look arrives (the arrival kept and re-sent on every stream until released).
        A spare's wait, the first connection's and the local group's (failing open) are
        waits of their own, handed to the worker to await; never a polling loop."""
        s = self.sessions[worker]
        link, life, core = s.link, worker.lifecycle, s.link.proto
        gen = s.waiting_at
        if gen is None:  # arriving
            if life.spare:
                return self._as_spare(worker, s)
            self._arrive(worker, s)
            if not link.connected:
                return self._first_connection(worker, s)
            gen = self._waiting(worker, s)
        while True:
            if life.released >= gen:  # desired (the arbiter's RELEASE) against observed
                if life.released > life.generation:  # read in place: the worker is at
                    life.reached(life.released)  # ``gen`` already, moved only when above
                core.released_start = True  # the core says so when the trainer starts
                s.waiting_at = None
                worker.write("state", "released",
                             f"barrier of generation {gen} released",
                             generation=life.generation,
                             barrier_seconds=round(self.clock() - s.waiting_since, 3))
                return None
            if life.stop_signal is not None:
                s.waiting_at = None
                return None
            if life.spare:  # told SPARE: a former spare holds this rank now
                s.waiting_at = None
                return self._as_spare(worker, s)
            # a decision that came while waiting (none desired: read in place)
            decisive = life.decisive() if life.desired is not None else None
            if decisive is not None:
                if decisive.kind == ActionKind.RESTART and decisive.generation > gen:
                    life.dismiss(decisive)  # taken in here: this barrier moves up
                    life.reached(decisive.generation, decisive.restarts)
                    gen = s.waiting_at = life.generation
                    core.report_arrival(gen)
                    self._arrive_locally(worker)
                    continue
                if decisive.kind in (ActionKind.STOP, ActionKind.REPLACE):
                    s.waiting_at = None
                    return decisive  # the worker records it as it ends on it
            if not self._still_online(link):
                log.warning("arbiter unreachable for %.0fs during the barrier: starting "
                            "generation %d alone", self.fail_open_after, gen)
                s.waiting_at = None
                return self.local.barrier(worker)
            return self._fail_open_left(link)

    def _arrive(self, worker: Seat, s: RankSession) -> None:
        """At the barrier of the rank's generation: told to the link's core (kept and
        re-sent on every stream until released) and to the pod's local group."""
        s.link.proto.released_start = False
        s.link.proto.report_arrival(worker.lifecycle.generation)
        self._arrive_locally(worker)

    def _waiting(self, worker: Seat, s: RankSession) -> int:
        """The arbiter is there: the wait for its RELEASE begins (the events say so)."""
        gen = s.waiting_at = worker.lifecycle.generation
        s.waiting_since = self.clock()
        worker.write("state", "barrier", f"waiting at the barrier of generation {gen}",
                     generation=gen)
        return gen

    async def _first_connection(self, worker: Seat, s: RankSession) -> Look:
        """Arrived with no stream up: wait for one (woken by the Welcome), then look
        again; none for --arbiter-fail-open-after: start without the barrier."""
        if await self._online(s.link):
            self._waiting(worker, s)
            return 0.0  # look again at once
        log.warning("no arbiter for %.0fs: starting generation %d without the barrier",
                    self.fail_open_after, worker.lifecycle.generation)
        look = self.local.barrier(worker)
        return look if look is None or isinstance(look, (Action, float)) else await look

    async def _as_spare(self, worker: Seat, s: RankSession) -> Look:
        """Serve as the job's warm spare until ASSIGNed a rank (and its node checked
        again), then look again: it arrives as that rank. The arbiter's STOP/REPLACE of
        the spare ends it; a stop signal ends the wait (None)."""
        ended = await self._serve_as_spare(worker, s)
        if ended is None and not worker.lifecycle.stop_requested:
            ended = await self._preflight_assigned(worker, s)
        if ended is not None or worker.lifecycle.stop_requested:
            return ended
        return 0.0  # a rank now: look again at once (it arrives)

    async def _serve_as_spare(self, worker: Seat, s: RankSession) -> Action | None:
        """Wait as the job's warm spare (standby prepared, no trainer) until the arbiter
        ASSIGNs a rank, then take it (None). Returns early on a stop signal (None), or with
        the arbiter's REPLACE/STOP of this spare (a fatal fault of its own: the worker ends
        with it)."""
        link = s.link  # its Hello says "spare": the lifecycle's spare flag
        worker.write("state", "spare", f"serving as a warm spare of job "
                     f"{worker.cfg.identity.job}: no trainer until the arbiter assigns a rank")
        if s.hooks.prepare_spare is not None:
            s.hooks.prepare_spare()
        life = worker.lifecycle
        while not link.proto.assigned:  # woken by the ASSIGN (Lifecycle.assign), a stop
            if life.stop_signal is not None:
                return None
            decisive = life.decisive()
            if decisive is not None and decisive.kind in (ActionKind.STOP, ActionKind.REPLACE):
                return decisive  # the worker records it as it ends on it
            await worker.changed()
        # the link's core moved the lifecycle (Lifecycle.assign): rank, generation, count
        life = worker.lifecycle
        worker.write("state", "assigned", f"the arbiter assigned rank {life.rank} to this "
                     f"spare: it starts generation {life.generation} from its warm standby",
                     rank=life.rank, generation=life.generation)
        return None

    async def _preflight_assigned(self, worker: Seat, s: RankSession) -> Action | None:
        """A spare just ASSIGNed a rank checks its node again before it arrives (its last
        preflight may be hours old): the worker's before-barrier parts (the ``preflight``
        hook, which raises the fault it finds), the fast budgets. The fault goes to the
        arbiter from the spare's stream, which retires the spare (its pod moves) and gives
        the rank to the next spare or the rank's own pod: the arbiter's REPLACE is returned
        (the worker records it as it exits with it). No answer within ``ASSIGNED_WAIT``:
        the local policy's answer to a failed preflight (move the pod)."""
        if s.hooks.preflight is None:
            return None
        fault = await s.hooks.preflight()
        if fault is None:
            return None
        deadline = self.clock() + ASSIGNED_WAIT
        while self.clock() < deadline and not worker.lifecycle.stop_requested:
            decisive = worker.lifecycle.decisive()
            if decisive is not None and decisive.kind in (ActionKind.STOP, ActionKind.REPLACE):
                return decisive
            await worker.changed(max(POLL, deadline - self.clock()))
        if worker.lifecycle.stop_requested:
            return None
        log.warning("no answer from the arbiter to this spare's failed preflight within "
                    "%.0fs: exiting so that its pod moves", ASSIGNED_WAIT)
        return Action(ActionKind.REPLACE, fault.message, fault_id=fault.id)

    def decide(self, worker: Seat, fault: Fault) -> None:
        if not self._decide_remotely(worker, fault):
            self._decide_locally(worker, fault)

    def _decide_locally(self, worker: Seat, fault: Fault) -> None:
        """The local policy decides (the arbiter away or silent for this rank). A restart
        it decides is one of the job's restarts: the lifecycle counts it when it is
        carried out, and the next Hello tells the arbiter."""
        self.local.decide(worker, fault)

    def _decide_remotely(self, worker: Seat, fault: Fault) -> bool:
        """True when the arbiter will answer ``fault`` with a command (or the watchdog
        decides locally after all)."""
        s = self.sessions[worker]
        if fault.kind == FaultKind.HANG and worker.cfg.hang.hang_action == "alert":
            # --hang-action alert: the arbiter records a WARNING and decides nothing; the
            # local policy records ALERT_ONLY. (Crashes are still the arbiter's to decide.)
            evidence = {k: v for k, v in fault.evidence.items()
                        if k != "waiting_in_collective"}  # recorded, never probed
            s.link.proto.report_fault(dataclasses.replace(fault, severity=Severity.WARNING,
                                                          evidence=evidence),
                                      worker.lifecycle.generation)
            return False
        s.link.proto.report_fault(fault, worker.lifecycle.generation)  # the link's core
        if fault.evidence.get("recovered"):
            return True  # an all-clear: the arbiter may act on it, locally nothing to do
        if not self._still_online(s.link):
            return False  # failing open already: queued for the arbiter, decided here now
        s.undecided = fault
        life = worker.lifecycle
        s.spawn(self._decision_watchdog(worker, fault, (life.generation, life.restarts),
                                        s.link.proto.delivered))
        return True

    def report(self, worker: Seat, fault: Fault) -> None:
        self.sessions[worker].link.proto.report_fault(fault, worker.lifecycle.generation)

    async def _decision_watchdog(self, worker: Seat, fault: Fault,
                                 attempt: tuple[int, int], seen: int) -> None:
        """Decide locally after all if the arbiter stays away, or settles a crash without
        a command for this rank (alert only, say): a dead trainer must not wait forever.
        Once the attempt the fault was raised in is over (a decision that arrived with
        the trainer's exit was carried out), or any command came for this rank since the
        fault (``seen``: the link's count of commands delivered then), there is nothing
        left to decide."""
        s = self.sessions[worker]
        link, life = s.link, worker.lifecycle
        while s.undecided is fault:
            if (life.generation, life.restarts) != attempt or link.proto.delivered != seen:
                s.undecided = None
                return
            if not self._still_online(link):
                log.warning("arbiter unreachable for %.0fs before deciding about %s; "
                            "deciding locally", self.fail_open_after, fault.kind.value)
                s.undecided = None
                self._decide_locally(worker, fault)
                return
            outcome = link.proto.outcomes.get(fault.id)
            if outcome is not None:  # settled, and no command came (the count above)
                s.undecided = None
                log.info("the arbiter settled the %s without a command for this rank (%s)",
                         fault.kind.value, outcome)
                if fault.kind == FaultKind.CRASH:
                    self._decide_locally(worker, fault)  # the trainer is gone: local policy
                return
            await link.wait_settled(self._fail_open_left(link))

    async def on_minor_action(self, worker: Seat, action: Action) -> None:
        s = self.sessions[worker]
        if action.kind == ActionKind.DUMP_STACKS:
            if s.hooks.stacks is not None:
                captured = await s.hooks.stacks()
            else:  # no tree to read: an empty answer, never none
                captured = await capture([], worker.cfg.hang.hang_dump_timeout)
            s.link.report_stacks(action.id, stacks_json(captured))
        elif action.kind == ActionKind.LAST_WORDS:
            if s.hooks.on_last_words is None:
                log.info("%s: no --checkpoint-dir, nothing to persist", action.reason)
                return
            try:  # the trainer keeps running; a failure is one line, never the agent's end
                await s.hooks.on_last_words()
            except Exception as e:  # noqa: BLE001
                log.warning("last words failed: %s: %s", type(e).__name__, e)
        elif action.kind == ActionKind.BUSY and s.hooks.on_busy is not None:
            try:
                s.hooks.on_busy(action)
            except Exception:  # recording a verdict must never take the agent down
                log.exception("applying the arbiter's busy verdict failed")

    async def finished(self, worker: Seat) -> Action | None:
        """The trainer succeeded: the worker ends (the arbiter heard of the exit)."""
        return None

    # ------------------------------------------------------------------ helpers

    async def _online(self, link: ArbiterLink) -> bool:
        """True once connected; False when the link has been down --arbiter-fail-open-after.
        Woken by the Welcome (or the fail-open time), not a polling loop."""
        while not link.connected:
            left = self.fail_open_after - link.offline_for()
            if left <= 0:
                return False
            await link.wait_connected(left)
        return True

    def _arrive_locally(self, worker: Seat) -> None:
        """Tell the pod's local group this worker is at a barrier (a peer that starts
        alone, failing open, need not wait for it); a group of one has no peer to tell,
        and its own arrival is counted when it fails open (``LocalDecider.barrier``)."""
        if len(self.local.workers) > 1:
            self.local.arrive(worker)

    def _fail_open_left(self, link: ArbiterLink) -> float:
        """How long a wait may last before failing open can be due: the time left until
        the link has been down --arbiter-fail-open-after, or all of it while the link is up
        (if it drops meanwhile, the next look finds it down for less, and waits the rest:
        the local decision comes exactly that long after the drop). At least POLL."""
        if link.connected:
            return max(POLL, self.fail_open_after)
        return max(POLL, self.fail_open_after - link.offline_for())

    def _still_online(self, link: ArbiterLink) -> bool:
        """False once the link has been down for --arbiter-fail-open-after seconds."""
        return link.connected or link.offline_for() < self.fail_open_after


def _leave_exit(worker: Seat, link: ArbiterLink) -> None:
    """The exit the arbiter did not confirm, left in --exit-notes-dir (the arbiter's
    --state-dir) for the next arbiter (wire/exit_note.py). A spare, or a rank whose trainer
    never exited, leaves nothing."""
    directory = worker.cfg.arbiter.exit_notes_dir
    msg = link.proto.last_exit
    if not directory or msg is None or worker.lifecycle.spare:
        return
    e = msg.exit
    status = e.exit_code if e.HasField("exit_code") else \
        128 + e.signal if e.HasField("signal") else None
    if status is None or not 0 <= status <= 255:
        return
    ident = worker.cfg.identity
    if exit_note.leave(directory, ident.namespace, ident.job, worker.lifecycle.rank,
                       e.generation, status):
        log.warning("left this rank's exit (status %d) in %s for the next arbiter", status,
                    directory)
