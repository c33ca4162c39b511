"""The barrier is a look the worker makes when it wakes (issue 36, lane crash7): the
decider compares the desired state (the lifecycle's ``released``, moved by the arbiter's
RELEASE; a decision; a stop) with the generation the rank waits for and says go, end, or
how long the worker may sleep -- it awaits nothing of the worker's (``Decider.barrier``,
worker.py ``wait_at_barrier``). Pure looks here: no loop turns, no arbiter."""

from __future__ import annotations

import asyncio

from ftagent.agent.arbiter_decider import ArbiterDecider
from ftagent.agent.decider import LocalDecider
from ftagent.agent.pod import PodAgent
from ftagent.agent.worker import Worker, WorkerSpec
from ftagent.cmd.run import parse
from ftagent.model import ActionKind
from ftagent.v1 import ftagent_pb2 as pb


def seated(*flags: str) -> tuple[ArbiterDecider, Worker]:
    decider = ArbiterDecider()
    w = PodAgent(decider).add(WorkerSpec(parse(["--arbiter", "127.0.0.1:9",
                                                "--arbiter-fail-open-after", "30", *flags,
                                                "--", "true"], {})))
    link = decider.session(w).link
    link.connected = True  # as if welcomed: no arbiter runs, the stream is not needed
    link._up.set()
    link.offline_since = None
    return decider, w


def command(cid: str, kind: int, generation: int) -> pb.ArbiterMessage:
    return pb.ArbiterMessage(command=pb.Command(id=cid, kind=kind, generation=generation))


def test_a_look_arrives_once_then_says_wait_until_the_release_is_desired() -> None:
    decider, w = seated()
    core = decider.session(w).link.proto
    first = decider.barrier(w)
    assert isinstance(first, float) and first >= 30  # the fail-open time, the link up
    assert core.arrival is not None and core.arrival.generation == 0
    arrivals = [m for m in core.out if m.HasField("arrival")]
    again = decider.barrier(w)  # a wake-up with nothing new: no second arrival
    assert isinstance(again, float)
    assert [m for m in core.out if m.HasField("arrival")] == arrivals
    core.on_message(command("r", pb.COMMAND_KIND_RELEASE_BARRIER, 0))
    assert decider.barrier(w) is None and decider.session(w).released_start


def test_a_stop_desired_while_waiting_is_the_look_s_answer() -> None:
    decider, w = seated()
    assert isinstance(decider.barrier(w), float)
    decider.session(w).link.proto.on_message(command("s", pb.COMMAND_KIND_STOP, 0))
    got = decider.barrier(w)
    assert got is not None and not isinstance(got, float) and \
        getattr(got, "kind", None) is ActionKind.STOP


def test_a_local_group_of_one_goes_at_once() -> None:
    async def body() -> None:
        d = LocalDecider()
        w = PodAgent(d).add(WorkerSpec(parse(["--", "true"], {})))
        assert d.barrier(w) is None

    asyncio.run(body())
