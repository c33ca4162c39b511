"""The link to the arbiter keeps no restart count of its own (issue 23): its Hello says
the worker lifecycle's, and a RESTART is dropped by the lifecycle's generation."""

from __future__ import annotations

from ftagent.agent.lifecycle import Lifecycle
from ftagent.agent.link_protocol import LinkProtocol
from ftagent.config import IdentityConfig
from ftagent.v1 import ftagent_pb2 as pb


def restart_cmd(cid: str, generation: int, restarts: int) -> pb.ArbiterMessage:
    return pb.ArbiterMessage(command=pb.Command(id=cid, kind=pb.COMMAND_KIND_RESTART,
                                                generation=generation, restarts=restarts))


def test_the_hello_reports_the_lifecycles_count_across_arbiters() -> None:
    """The arbiter restarts the job (count 1); the same rejoin comes again, with a new
    id, before the worker carried out the first, and once more after; a Welcome says 3
    (the arbiter's own count: the agent does not copy it). The Hello says what the
    lifecycle carried out and adopted: 1. On the old code the link kept its own count
    (the Welcome raised it to 3) beside the lifecycle's (FTAGENT_RESTART_COUNT)."""
    lc = Lifecycle(lambda: 0.0)
    link = LinkProtocol(IdentityConfig(job="j", rank=0, world_size=2), lifecycle=lc)
    link.arrive(0)
    link.started(0, released=True)
    (a,) = link.on_message(restart_cmd("c1", 1, 1)).actions
    (b,) = link.on_message(restart_cmd("c2", 1, 1)).actions  # before the first is done
    lc.restart(a)
    assert lc.moot(b)  # ... and the worker drops it: one restart
    link.arrive(lc.generation)
    assert link.on_message(restart_cmd("c3", 1, 1)).actions == []  # there already
    link.on_welcome(pb.Welcome(arbiter_id="arbiter-2", restarts=3))
    assert link.hello().restart_count == lc.restarts == 1
    assert link.hello().generation == 1
