"""Whether a trainer runs, as the link's Hello says it, is read from the worker's
lifecycle (issue 36 item 2: one owner per fact): the link keeps no flag of its own. The
arbiter reads ``Hello.trainer_running`` as "a trainer of the generation named runs" (its
reconcile, a spare's ``rank_taken`` refusal), so a RESTART delivered while the trainer is
still being stopped says "not running" at once, as the link's own flag did."""

from __future__ import annotations

from ftagent.agent.lifecycle import Lifecycle
from ftagent.agent.link_protocol import LinkProtocol
from ftagent.agent.reporter import ArbiterLink
from ftagent.config import ArbiterClientConfig, IdentityConfig
from ftagent.model import ProcessExit
from ftagent.v1 import ftagent_pb2 as pb


def command(cid: str, kind: int, generation: int = 0) -> pb.ArbiterMessage:
    return pb.ArbiterMessage(command=pb.Command(id=cid, kind=kind, generation=generation))


def worker_link() -> tuple[Lifecycle, LinkProtocol]:
    life = Lifecycle(lambda: 0.0)
    return life, LinkProtocol(IdentityConfig(job="j", rank=0, world_size=2), lifecycle=life)


def test_the_hello_says_what_the_lifecycle_says_of_the_trainer() -> None:
    """The worker moves its lifecycle; the link is told nothing in between. On the old
    code the link said its own flag (set by its ``started``): no trainer here."""
    life, link = worker_link()
    assert not link.hello().trainer_running
    life.running(42)
    assert link.hello().trainer_running
    life.exited(ProcessExit(pid=42, code=3))
    assert not link.hello().trainer_running


def test_a_restart_delivered_says_not_running_while_the_trainer_is_stopped() -> None:
    life, link = worker_link()
    life.running(42)
    link.started(0, released=True)
    link.on_message(command("r1", pb.COMMAND_KIND_RESTART, 1))
    assert life.trainer_running  # still being stopped by the worker ...
    hello = link.hello()
    assert not hello.trainer_running and hello.generation == 0  # ... not of this generation
    # a former spare holds the rank: told SPARE now, it serves as one (not refused)
    assert link.on_message(command("s1", pb.COMMAND_KIND_SPARE)).assigned
    assert life.spare


def test_spare_is_refused_while_a_trainer_of_the_generation_runs() -> None:
    life, link = worker_link()
    life.running(42)
    assert not link.on_message(command("s1", pb.COMMAND_KIND_SPARE)).assigned
    assert not life.spare
    life.exited(ProcessExit(pid=42, code=0))
    assert link.on_message(command("s2", pb.COMMAND_KIND_SPARE)).assigned


def test_a_link_used_alone_moves_its_own_lifecycle() -> None:
    """A simulated agent (tests' ArbiterLink, no worker): its ``started`` and
    ``report_exit`` move the lifecycle the Hello reads, as a worker moves its own."""
    lk = ArbiterLink(ArbiterClientConfig(arbiter="127.0.0.1:1"),
                     IdentityConfig(job="j", rank=0, world_size=1))
    lk.arrive(0)
    lk.started(0, released=True)
    assert lk.proto.hello().trainer_running and lk.proto.lifecycle.trainer_running
    lk.report_exit(ProcessExit(pid=1, code=0), 0)
    assert not lk.proto.hello().trainer_running
    assert lk.proto.lifecycle.trainer_exit == ProcessExit(pid=1, code=0)
