"""The worker as a reconciler (issue 36 item 1): the link's core moves the rank's desired
state in the worker's lifecycle (the newest decision, the released barrier), the worker
and the barrier are woken by that change in the same loop, and one comparison
(``Lifecycle.due``) says what to carry out. No command queue, no forwarder task, no
0.25 s poll at the barrier.

On the old code a command went link -> queue -> forwarder task -> the worker's queue, and
the barrier looked for its RELEASE (and for a stop signal) every 0.25 s: the loop-turn
tests below fail there (the barrier is still waiting after the turns), and the lifecycle
had no desired state (``due``, ``want``)."""

from __future__ import annotations

import asyncio
import signal

from ftagent.agent.arbiter_decider import ArbiterDecider
from ftagent.agent.lifecycle import Lifecycle
from ftagent.agent.link_protocol import LinkProtocol
from ftagent.agent.pod import PodAgent
from ftagent.agent.worker import Worker, WorkerSpec, wait_at_barrier
from ftagent.cmd.run import parse
from ftagent.config import IdentityConfig
from ftagent.model import Action, ActionKind, Origin
from ftagent.v1 import ftagent_pb2 as pb

TURNS = 20  # loop turns: far less than the old 0.25 s poll, enough for any wake-up


def command(cid: str, kind: int, generation: int, **kw: int) -> pb.ArbiterMessage:
    return pb.ArbiterMessage(command=pb.Command(id=cid, kind=kind, generation=generation,
                                                **kw))


def test_the_links_command_is_the_desired_state_and_one_comparison_dedups() -> None:
    changes: list[int] = []
    life = Lifecycle(lambda: 0.0, on_change=lambda: changes.append(1))
    link = LinkProtocol(IdentityConfig(job="j", rank=0, world_size=2), lifecycle=life)
    link.arrive(0)
    link.started(0, released=True)
    assert life.due() is None
    link.on_message(command("c1", pb.COMMAND_KIND_RESTART, 1, restarts=1))
    first = life.due()
    assert first is not None and first.kind is ActionKind.RESTART and changes
    # a newer decision replaces the one not carried out yet (no queue of both)
    link.on_message(command("c2", pb.COMMAND_KIND_RESTART, 2, restarts=2))
    newest = life.due()
    assert newest is not None and newest.generation == 2
    life.restart(newest)
    assert life.due() is None and (life.generation, life.restarts) == (2, 2)
    # a repeated or stale rejoin is moot by the same comparison
    link.on_message(command("c3", pb.COMMAND_KIND_RESTART, 2, restarts=2))
    assert life.due() is None
    # requests (minor actions) are kept in order, before the decision, carried out once
    link.on_message(command("d1", pb.COMMAND_KIND_DUMP_STACKS, 2))
    link.on_message(command("s1", pb.COMMAND_KIND_STOP, 2))
    dump = life.due()
    assert dump is not None and dump.kind is ActionKind.DUMP_STACKS
    life.decided(dump)
    stop = life.due()
    assert stop is not None and stop.kind is ActionKind.STOP
    # the RELEASE is desired state too: the barrier reads it there
    link.on_message(command("r1", pb.COMMAND_KIND_RELEASE_BARRIER, 2))
    assert life.released == link.released_generation == 2


def test_a_dismissed_decision_wanted_again_is_due_again() -> None:
    """The local group's standing decision, superseded for a worker whose trainer exited
    by itself after its hang, is given again for its crash: due again, carried out once."""
    life = Lifecycle(lambda: 0.0)
    restart = Action(ActionKind.RESTART, "group", generation=1, origin=Origin.LOCAL)
    life.want(restart)
    life.dismiss(restart)
    assert life.due() is None
    life.want(restart)
    assert life.due() is restart
    life.restart(restart)
    life.want(restart)
    assert life.due() is None


def seated(*flags: str) -> tuple[ArbiterDecider, Worker]:
    decider = ArbiterDecider()
    pod = PodAgent(decider)
    w = pod.add(WorkerSpec(parse(["--arbiter", "127.0.0.1:9", *flags, "--", "true"], {})))
    link = decider.session(w).link
    link.connected = True  # as if welcomed: no arbiter runs, the stream is not needed
    link._up.set()  # the core posts while a stream is up
    link.offline_since = None
    return decider, w


async def turns(n: int = TURNS) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_the_barrier_is_released_in_the_loop_turn_its_release_is_read() -> None:
    async def body() -> None:
        decider, w = seated()
        link = decider.session(w).link
        waiting = asyncio.create_task(wait_at_barrier(decider, w))
        await turns()
        assert not waiting.done()
        link.proto.on_message(command("r0", pb.COMMAND_KIND_RELEASE_BARRIER, 0))
        await turns()
        assert waiting.done(), "the barrier did not wake on the RELEASE (a poll?)"
        assert waiting.result() is None and decider.session(w).released_start

    asyncio.run(body())


def test_a_stop_signal_or_a_stop_command_ends_the_barrier_wait_at_once() -> None:
    async def body() -> None:
        decider, w = seated()
        waiting = asyncio.create_task(wait_at_barrier(decider, w))
        await turns()
        w.on_signal(signal.SIGTERM)
        await turns()
        assert waiting.done() and waiting.result() is None

        decider, w = seated()
        waiting = asyncio.create_task(wait_at_barrier(decider, w))
        await turns()
        decider.session(w).link.proto.on_message(command("s", pb.COMMAND_KIND_STOP, 0))
        await turns()
        assert waiting.done()
        got = waiting.result()
        assert got is not None and got.kind is ActionKind.STOP

    asyncio.run(body())


def test_a_restart_to_a_higher_generation_at_the_barrier_moves_the_barrier_up() -> None:
    async def body() -> None:
        decider, w = seated()
        link = decider.session(w).link
        waiting = asyncio.create_task(wait_at_barrier(decider, w))
        await turns()
        link.proto.on_message(command("c", pb.COMMAND_KIND_RESTART, 2, restarts=1))
        await turns()
        assert not waiting.done() and w.generation == 2 and w.restarts == 1
        assert link.proto.arrival is not None and link.proto.arrival.generation == 2
        assert w.lifecycle.due() is None  # taken in by the barrier, not carried out again
        link.proto.on_message(command("r", pb.COMMAND_KIND_RELEASE_BARRIER, 2))
        await turns()
        assert waiting.done() and waiting.result() is None

    asyncio.run(body())


def test_the_decider_has_no_forwarder_task() -> None:
    async def body() -> None:
        decider, w = seated()
        decider.start(w)
        try:
            assert len(decider.session(w).tasks) == 1  # the link's own; no forwarder
        finally:
            link = decider.session(w).link
            link.connected, link.proto.arbiter_id = False, ""  # never reached: no wait
            await decider.close(w)

    asyncio.run(body())


def test_requests_made_before_a_trainer_runs_are_not_its() -> None:
    """A DUMP_STACKS or BUSY read while waiting at a barrier was about the previous
    attempt: the next trainer starts with none (the old barrier dropped them too)."""
    life = Lifecycle(lambda: 0.0)
    life.want(Action(ActionKind.BUSY, "rank 3 waits on rank 0"))
    assert life.due() is not None
    life.running(123)
    assert life.due() is None


def test_the_barrier_fails_open_the_fail_open_time_after_the_link_drops() -> None:
    """No poll, yet no later than before: a link that drops while the worker waits at
    the barrier wakes it (the fail-open clock starts), and it starts alone
    --arbiter-fail-open-after later."""
    import time

    async def body() -> None:
        decider, w = seated("--arbiter-fail-open-after", "0.5")
        link = decider.session(w).link
        waiting = asyncio.create_task(wait_at_barrier(decider, w))
        await turns()
        assert not waiting.done()
        t0 = time.monotonic()
        link._down()  # what the link does when its stream breaks
        assert await asyncio.wait_for(waiting, 5) is None
        took = time.monotonic() - t0
        assert 0.4 <= took < 2.0, took
        assert not decider.session(w).released_start  # started without the barrier

    asyncio.run(body())
