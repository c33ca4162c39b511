"""The trainer's last exit is kept by the link until an arbiter confirms it read it.

Handed to a stream is not read: an arbiter SIGKILLed before the agent noticed takes what
was written to it down with it (the chaos run that read "gone (was running)" for a job
whose ranks all exited 0). LinkProtocol says the exit again on every new stream until
``confirmed`` (an arbiter ended a stream the agent half-closed) or the agent moves on.
"""

from __future__ import annotations

from ftagent.agent.link_protocol import LinkProtocol
from ftagent.config import IdentityConfig
from ftagent.model import ProcessExit
from ftagent.v1 import ftagent_pb2 as pb

WELCOME = pb.Welcome(generation=0, arbiter_id="a")


def link() -> LinkProtocol:
    p = LinkProtocol(IdentityConfig(job="j", rank=0, world_size=1))
    p.on_welcome(WELCOME)
    p.started(0, released=True)
    return p


def exits(msgs: list[pb.AgentMessage]) -> list[tuple[int, int]]:
    return [(m.exit.generation, m.exit.exit_code) for m in msgs if m.HasField("exit")]


def test_an_exit_handed_to_a_stream_is_said_again_on_the_next_one() -> None:
    p = link()
    p.exit(ProcessExit(pid=1, code=0, signal=None), 0)  # written to a stream that broke
    assert exits(p.on_welcome(WELCOME)) == [(0, 0)]
    assert exits(p.on_welcome(WELCOME)) == [(0, 0)]  # and again, until confirmed
    p.confirmed()
    assert exits(p.on_welcome(WELCOME)) == []


def test_an_exit_kept_offline_is_said_once_per_stream() -> None:
    p = link()
    msg = p.exit(ProcessExit(pid=1, code=0, signal=None), 0)
    p.later.append(msg)  # made while offline (ArbiterLink keeps it)
    assert exits(p.on_welcome(WELCOME)) == [(0, 0)]


def test_the_next_barrier_or_trainer_makes_the_exit_moot() -> None:
    p = link()
    p.exit(ProcessExit(pid=1, code=3, signal=None), 0)
    p.arrive(1)  # the arrival says the previous trainer exited
    out = p.on_welcome(WELCOME)
    assert exits(out) == [] and [m.arrival.generation for m in out] == [1]
    p.exit(ProcessExit(pid=1, code=None, signal=9), 1)
    p.started(1, released=False)
    assert exits(p.on_welcome(WELCOME)) == []
