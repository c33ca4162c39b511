"""LAST_WORDS (the arbiter's answer to a planned disruption of the rank's node): the
command reaches the agent as a minor action (the trainer keeps running), and
``cmd/run.last_words_now`` persists the rank's newest complete in-memory snapshot to
--checkpoint-dir now (checkpoint/lastwords.py), said as a state event."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ftagent.checkpoint import persist
from ftagent.cmd.run import last_words_now, parse
from ftagent.model import MINOR_ACTIONS, ActionKind
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import command_to_action

torch = pytest.importorskip("torch")


@dataclass
class Ident:
    rank: int


@dataclass
class Events:
    got: list[tuple[str, str, str, dict[str, Any]]] = field(default_factory=list)

    def write(self, event: str, kind: str, message: str, **extra: Any) -> None:
        self.got.append((event, kind, message, extra))


@dataclass
class Worker:
    ident: Ident
    events: Events = field(default_factory=Events)


def test_the_command_is_a_minor_action_delivered_once_and_acknowledged() -> None:
    from ftagent.agent.link_protocol import LinkProtocol
    from ftagent.config import IdentityConfig

    a = command_to_action(pb.Command(id="c", kind=pb.COMMAND_KIND_LAST_WORDS, reason="r"))
    assert a is not None and a.kind is ActionKind.LAST_WORDS and a.kind in MINOR_ACTIONS
    p = LinkProtocol(IdentityConfig(job="j", rank=1, world_size=2))
    msg = pb.ArbiterMessage(command=pb.Command(id="lw1", kind=pb.COMMAND_KIND_LAST_WORDS,
                                               reason="last words: node n DrainInProgress"))
    got = p.on_message(msg)
    assert [x.kind for x in got.actions] == [ActionKind.LAST_WORDS]
    assert [m.ack.command_id for m in got.send] == ["lw1"]
    assert not p.final_delivered  # the trainer keeps running
    assert p.on_message(msg).actions == []  # a re-send (after a reconnect): once


def test_last_words_now_persists_the_newest_complete_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftagent.checkpoint.settings import Settings
    from ftagent.checkpoint.snapshots import Snapshotter

    snaps, durable = tmp_path / "shm", tmp_path / "durable"
    snap = Snapshotter(Settings(root=str(snaps), job="lw", rank=1, world_size=2))
    try:
        for step in (10, 20):
            assert snap.save(step, {"w": torch.full((64,), float(step))})
            assert snap.wait(30)
    finally:
        snap.close()
    cfg = parse(["--job", "lw", "--snapshot-dir", str(snaps), "--checkpoint-dir",
                 str(durable), "--", "true"], {})
    w = Worker(Ident(1))
    asyncio.run(last_words_now(cfg, w))  # type: ignore[arg-type]
    assert 20 in persist.complete_steps(str(durable), "lw", 1)
    (ev,) = [e for e in w.events.got if e[1] == "last_words"]
    assert ev[3]["persisted"][0] == 20 and "persisted step(s) 20" in ev[2]
    # a spare (no rank) or nothing held: nothing done, no failure
    asyncio.run(last_words_now(cfg, Worker(Ident(-1))))  # type: ignore[arg-type]
    w0 = Worker(Ident(0))
    asyncio.run(last_words_now(cfg, w0))  # type: ignore[arg-type]
    assert "no complete snapshot to persist" in w0.events.got[0][2]


def test_the_arbiter_decider_hands_last_words_to_its_hook_and_survives_a_failure() -> None:
    from types import SimpleNamespace

    from ftagent.agent.arbiter_decider import ArbiterDecider, RankSession
    from ftagent.agent.seat import RankHooks
    from ftagent.model import Action

    calls: list[str] = []
    class W:  # the one field the session reads (a Worker is hashable by identity)
        cfg = SimpleNamespace(hang=SimpleNamespace(hang_dump_timeout=1.0))

    worker: Any = W()
    d = ArbiterDecider()
    d.sessions[worker] = RankSession(None, RankHooks())  # type: ignore[arg-type]
    action = Action(ActionKind.LAST_WORDS, "last words: node n DrainInProgress")
    asyncio.run(d.on_minor_action(worker, action))  # no hook (no --checkpoint-dir): a line

    async def hook() -> None:
        calls.append("persist")
        raise OSError("disk full")

    d.sessions[worker] = RankSession(None, RankHooks(on_last_words=hook))  # type: ignore[arg-type]
    asyncio.run(d.on_minor_action(worker, action))  # the failure is one line, not a crash
    assert calls == ["persist"]
