"""A simulated agent whose decisions go through the shipped ``ArbiterDecider``.

harness.SimAgent models the decider in a few lines; this agent runs the real class
(agent/arbiter_decider.py, failing open to the real decider.LocalDecider) on an event
loop of the world's own, with the world's clock and a fake transport:

* ``SimLink`` is the face of ``ArbiterLink`` the decider uses, over the sim's stream and
  the shipped ``LinkProtocol``: its waits (connected, released, settled) return when the
  world next moves, never after real time, and its offline clock is the world's;
* ``SimWorker`` is the worker's port (seat.py ``Seat``: the lifecycle, cfg, changed,
  stopping, write) and the supervisor around it: a reconciler as worker.py is, it
  carries out what the shipped lifecycle says is due (``Lifecycle.due``: the desired
  state the link's core and the deciders moved, against what it observes), starts a
  trainer when the shipped ``wait_at_barrier`` returns, and tells the link's core (an
  observer of its own) of state changes.

After every step the world's loop runs until nothing is ready (``World.settle``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ftagent.agent.arbiter_decider import ArbiterDecider
from ftagent.agent.seat import RankHooks
from ftagent.agent.worker import wait_at_barrier
from ftagent.cmd.run import parse
from ftagent.model import (
    MINOR_ACTIONS,
    Action,
    ActionKind,
    Fault,
    FaultKind,
    Observation,
    ProcessExit,
    TrainerState,
)
from ftagent.v1 import ftagent_pb2 as pb
from tests.sim.harness import FAIL_OPEN, Phase, SimAgent

if TYPE_CHECKING:
    from tests.sim.harness import World

SETTLE_ROUNDS = 64  # loop turns per settle: enough for a command to reach the supervisor


class Loop:
    """The world's event loop, turned by hand: ``changed()`` is what every wait awaits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._waiters: list[asyncio.Future[None]] = []

    def changed(self) -> asyncio.Future[None]:
        fut = self.loop.create_future()
        self._waiters.append(fut)
        return fut

    def settle(self) -> None:
        """Wake every wait (the world moved), then run until nothing is ready."""
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)
        for _ in range(SETTLE_ROUNDS):
            self.loop.run_until_complete(asyncio.sleep(0))

    def close(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for t in tasks:
            t.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()


def world_loop(world: World) -> Loop:
    loop = getattr(world, "decider_loop", None)
    if loop is None:
        loop = Loop()
        world.decider_loop = loop  # type: ignore[attr-defined]
    return loop


class SimLink:
    """What the ArbiterDecider uses of an ArbiterLink, over the simulated stream."""

    def __init__(self, agent: DeciderAgent) -> None:
        self.agent = agent
        self.proto = agent.proto
        self.hang_state: Any = None

    # -- the trainer observed: its progress (ArbiterLink.observe; the sim has none); its
    # exit and start are the shipped core's (LinkProtocol.observe, on_state), an observer
    # of its own
    def observe(self, obs: Observation) -> None:
        pass

    # -- state
    @property
    def connected(self) -> bool:
        return self.agent.connected

    @property
    def arbiter_id(self) -> str:
        return self.proto.arbiter_id

    @property
    def released_generation(self) -> int:
        return self.proto.released_generation

    @property
    def trainer_state(self) -> str:
        return self.proto.trainer_state

    def offline_for(self) -> float:
        return self.agent.offline_for()

    def pending(self) -> bool:
        return bool(self.proto.faults) or bool(self.proto.later)

    # -- the link's task: the world moves the stream, nothing to run
    def starting(self) -> None:
        pass

    async def run(self) -> None:
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass

    # -- waits: until the world next moves
    async def _moved(self) -> None:
        await world_loop(self.agent.world).changed()

    async def wait_connected(self, timeout: float) -> None:
        if not self.connected:
            await self._moved()

    async def wait_released(self, generation: int, timeout: float) -> bool:
        if self.proto.released_generation < generation:
            await self._moved()
        return self.proto.released_generation >= generation

    async def wait_settled(self, timeout: float) -> None:
        await self._moved()

    # -- agent -> arbiter (the decider posts its events in the core: LinkProtocol.post)
    def outcome(self, fault_id: str) -> str | None:
        return self.proto.outcomes.get(fault_id)

    def report_stacks(self, command_id: str, stacks_json: str) -> None:
        self.agent.send(pb.AgentMessage(stacks=pb.Stacks(command_id=command_id,
                                                         json=stacks_json)), keep=True)

    def report_progress(self, *args: Any, **kwargs: Any) -> None:
        pass

    def observe_timing(self, obs: Observation) -> None:
        pass

    def observe_trainer(self, obs: Observation) -> None:
        pass


class _Events:
    def write(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}


class SimWorker:
    """The worker's port to the decider, and the supervisor's side of it."""

    def __init__(self, agent: DeciderAgent) -> None:
        self.agent = agent
        self.cfg = parse(["--arbiter", "sim:1", "--arbiter-fail-open-after", str(FAIL_OPEN),
                          "--max-restarts", str(agent.world.budget), "--restart-backoff", "0",
                          "--restart-backoff-window", "0", "--", "true"], {})
        self.lifecycle = agent.lifecycle
        self.events = _Events()
        self.observers: list[Any] = []

    @property
    def generation(self) -> int:
        return self.lifecycle.generation

    @property
    def restarts(self) -> int:
        return self.lifecycle.restarts

    # the port
    async def changed(self, timeout: float | None = None) -> None:
        await world_loop(self.agent.world).changed()  # until the world next moves

    async def stopping(self) -> None:
        await asyncio.Event().wait()

    def write(self, event: str, kind: str, message: str, **fields: Any) -> Any:
        return self.events.write(event, kind, message, **fields)


async def no_stacks() -> dict[str, Any]:
    return {}


class DeciderAgent(SimAgent):
    """A rank whose decisions are the shipped ArbiterDecider's (module docstring)."""

    def __init__(self, world: World, rank: int) -> None:
        super().__init__(world, rank)
        self.proto.arrival = None  # the decider arrives (SimAgent's model did it here)
        # the core's outbox goes on the simulated stream while one is up (as the shell's
        # writer moves it over gRPC), kept for the next one when it must not be lost
        self.proto.is_up = lambda: self.connected
        self.proto.wake = self._written
        self.worker = SimWorker(self)
        self.decider = ArbiterDecider(link=lambda w: SimLink(self),  # type: ignore[arg-type,return-value]
                                      clock=lambda: world.now)
        self.worker.observers.extend(self.decider.add(self.worker, RankHooks(stacks=no_stacks)))
        self.session = self.decider.session(self.worker)
        self.link: SimLink = self.session.link  # type: ignore[assignment]
        self._barrier: asyncio.Task[Action | None] | None = None
        loop = world_loop(world)

        async def start() -> None:
            self.decider.start(self.worker)

        loop.loop.run_until_complete(start())
        self._wait_at_barrier()

    def _written(self) -> None:
        out = self.proto.out
        while out:
            assert self.stream is not None
            self.stream.up.append(out.popleft())

    # -- the supervisor
    def _state(self, state: TrainerState) -> None:
        for o in self.worker.observers:
            hook = getattr(o, "on_state", None)
            if hook is not None:
                hook(state, self.restarts)

    def _observe(self, obs: Observation) -> None:
        for o in self.worker.observers:
            o.observe(obs)

    def _wait_at_barrier(self) -> None:
        self.phase = Phase.WAITING
        self.lifecycle.waiting()
        self._state(TrainerState.WAITING)
        self._barrier = world_loop(self.world).loop.create_task(
            wait_at_barrier(self.decider, self.worker))

    @property
    def undecided(self) -> Fault | None:
        return self.session.undecided if hasattr(self, "session") else None

    @undecided.setter
    def undecided(self, value: Fault | None) -> None:
        pass  # the decider's to keep (RankSession.undecided)

    def command(self, action: Action) -> None:
        pass  # the link's core moved the lifecycle's desired state (Lifecycle.want)

    def crash(self) -> None:
        if self.phase is not Phase.RUNNING:
            return
        self.phase = Phase.DEAD
        self._observe(self.exited(ProcessExit(pid=1, code=3, signal=None)))
        self._decide(Fault(FaultKind.CRASH, f"rank {self.rank} crashed",
                           evidence={"exit_status": 3}))
        self.tick()

    def hang(self) -> None:
        if self.phase is not Phase.RUNNING or self.undecided is not None:
            return
        self._decide(Fault(FaultKind.HANG, f"rank {self.rank} hung"))
        self.tick()

    def _decide(self, fault: Fault) -> None:
        """The decider decides on the world's loop, as on the worker's (its watchdog is a
        task of that loop)."""
        async def on_loop() -> None:
            self.decider.decide(self.worker, fault)

        world_loop(self.world).loop.run_until_complete(on_loop())

    def tick(self) -> None:
        loop = world_loop(self.world)
        for _ in range(8):
            loop.settle()
            if self.phase is Phase.EXITED or not self._step():
                return

    def _step(self) -> bool:
        """One thing the worker's control loop does with what it has; False: nothing."""
        if self.phase is Phase.WAITING:
            b = self._barrier
            if b is None or not b.done():
                return False
            self._barrier = None
            go = b.result()
            if go is not None:  # STOP/REPLACE at the barrier: recorded as it ends on it
                self._end(go)
                return True
            self.started_released = self.session.released_start
            self.phase = Phase.RUNNING
            self.lifecycle.running(1)
            self._state(TrainerState.RUNNING)
            return True
        a = self.lifecycle.due()  # desired against observed, as worker.py
        if a is None:
            return False
        if a.kind in MINOR_ACTIONS:
            self.lifecycle.decided(a)
            world_loop(self.world).loop.create_task(
                self.decider.on_minor_action(self.worker, a))
            return True
        if a.kind is ActionKind.RESTART:
            assert a.generation > self.generation, (
                f"rank {self.rank} at generation {self.generation} was told to restart "
                f"into generation {a.generation}")
            if a.fault_id is not None and a.origin.value == "local":
                self.world.restarted_into.add(a.generation)
            if self.phase is Phase.RUNNING:
                self._observe(self.exited(ProcessExit(pid=1, code=None, signal=15)))
            self.lifecycle.restart(a)
            self._state(TrainerState.RESTARTING)
            self._wait_at_barrier()
            return True
        self._end(a)
        return True

    def _end(self, action: Action) -> None:
        """The worker ends on ``action`` (lifecycle.failed, as worker.py)."""
        sup = self.worker.cfg.supervisor
        code, _ = self.lifecycle.failed(action, None, exit_replace=sup.exit_replace,
                                        exit_stop=sup.exit_stop)
        self.exit(code)

    def exit(self, code: int) -> None:
        super().exit(code)
        self._state(TrainerState.FAILED)
