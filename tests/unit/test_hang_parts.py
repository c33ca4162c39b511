"""The hang parts are built first and handed to the verifier's constructor as one value
(agent/hang_parts.py, issue 35): nothing assigns them afterwards, nothing probes for them."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from ftagent.agent.hang_parts import HangParts, LocalPeers
from ftagent.agent.verify import Verifier
from ftagent.config import HangConfig
from ftagent.detect.hang import HangDetector

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("window_dump", "ask_arbiter", "local_peers", "rank", "waits")


class NoSampler:
    async def sample(self, stacks: bool = True, pids: Any = None) -> Any:  # never called here
        raise AssertionError("not sampled")


def verifier(parts: HangParts) -> Verifier:
    cfg = HangConfig()
    return Verifier(HangDetector(cfg), cfg, NoSampler(), parts)


def test_the_constructor_reads_every_part() -> None:
    async def dump() -> dict[str, Any]:
        return {}

    peers = LocalPeers()
    v = verifier(HangParts(rank=3, window_dump=dump, ask_arbiter=lambda: True,
                           local_peers=peers, waits=lambda pids: None))  # type: ignore
    assert (v.rank, v.window_dump, v.local_peers) == (3, dump, peers)
    assert v.ask_arbiter is not None and v.ask_arbiter() and v.waits is not None


def test_the_rank_is_read_in_place_from_its_owner() -> None:
    """The wiring hands the lifecycle itself (cmd/run.py): a spare assigned rank 3 is rank
    3 to the verifier at once, with no callback through the wiring on the verdict."""
    from ftagent.agent.lifecycle import Lifecycle

    life = Lifecycle(rank=-1, spare=True)
    v = verifier(HangParts(rank=life))
    assert v.rank == -1
    life.assign(3, 1)
    assert v.rank == 3


def test_local_peers_join_when_built_and_answer_from_two_on() -> None:
    peers = LocalPeers()
    a = verifier(HangParts(rank=0, local_peers=peers))
    assert peers() == []  # one worker: nobody to ask
    b = verifier(HangParts(rank=1, local_peers=peers))
    assert list(peers()) == [(0, a), (1, b)]
    assert a.local_peers is not None and list(a.local_peers()) == [(0, a), (1, b)]


def _assigned_or_probed(path: Path) -> list[str]:
    """``x.PART = ...`` outside ``self.PART =``, and getattr/hasattr naming a hang part
    or ``verifier``, in one module."""
    tree = ast.parse(path.read_text())
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Attribute) and t.attr in PARTS and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self"):
                    out.append(f"{path.name}:{n.lineno} assigns .{t.attr}")
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and \
                n.func.id in ("getattr", "hasattr") and len(n.args) >= 2 and \
                isinstance(n.args[1], ast.Constant) and \
                n.args[1].value in (*PARTS, "verifier", "hang_io_timeout",
                                    "hang_dead_still_window", "fr_buffer_size"):
            out.append(f"{path.name}:{n.lineno} {n.func.id}({n.args[1].value!r})")
    return out


def test_no_hang_part_is_assigned_after_construction_or_probed_for() -> None:
    files = [ROOT / "ftagent" / "cmd" / "run.py", ROOT / "ftagent" / "agent" / "verify.py",
             ROOT / "ftagent" / "agent" / "dead_still.py",
             ROOT / "ftagent" / "agent" / "flight_recorder.py",
             ROOT / "ftagent" / "agent" / "hang_watch.py"]
    found = [f for p in files for f in _assigned_or_probed(p)]
    assert found == [], found
