"""A job's end is known even when the arbiter missed it (issue 36, item 6).

A job whose last ranks exited while the arbiter was down read "gone: no agent for 21s
(was running)" although every rank exited 0. Outside Kubernetes the agents that could not
deliver the exit leave it in the arbiter's --state-dir (``wire/exit_note.py``); the next
arbiter reads it there. In the cluster the pods' terminal status says it
(``kube/cluster_faults.terminal_status``; the cluster side is in
tests/integration/test_kube_pod_exits.py). Both fail on the old code: nothing read them,
so status said "gone".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ftagent.arbiter.history import History
from ftagent.arbiter.history_file import FileHistory
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.state import Exited, JobPhase, JobState, Revived, apply
from ftagent.arbiter.timeline import Timeline
from ftagent.kube.cluster_faults import terminal_status
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import exit_note


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def registry(state_dir: Path, clock: Clock) -> Registry:
    return Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock,
                    history=History(FileHistory(str(state_dir))))


def running(state_dir: Path, clock: Clock, world: int = 2) -> None:
    """Every rank registered and released at generation 0; the arbiter is then SIGKILLed
    (its history file is all that is left: no disconnect is ever heard)."""
    reg = registry(state_dir, clock)
    conns = [Connection(f"peer-{r}") for r in range(world)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="j", rank=r, world_size=world, pod=f"pod-{r}", node="n",
                              agent_instance=f"i{r}"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    assert reg.jobs[("", "j")].phase is JobPhase.RUNNING


def status(reg: Registry) -> str:
    job = reg.find_any("j", "")
    assert job is not None
    return reg.info(job, ranks=False).state


def test_exits_left_in_the_state_dir_make_the_next_arbiter_say_succeeded(
        tmp_path: Path) -> None:
    clock = Clock()
    running(tmp_path, clock)
    clock.now += 17  # the ranks exit while no arbiter runs; their agents give up waiting
    for r in range(2):
        assert exit_note.leave(str(tmp_path), "", "j", r, 0, 0, at=clock.now)
    clock.now += 4
    reg = registry(tmp_path, clock)
    assert status(reg).startswith("gone")  # before its first tick: what it knew so far
    reg.tick()
    assert status(reg) == "succeeded"
    texts = [e.message for e in reg.timeline.entries("j", "")]
    assert any("read from the exit notes its agents left" in t for t in texts), texts
    assert texts[-1] == "every rank exited 0: job succeeded at generation 0"
    assert not list((tmp_path / exit_note.DIR).glob("*.json"))  # each read once
    # the record says so too: a third arbiter reads succeeded from the history alone
    reg.history.close()
    third = registry(tmp_path, clock)
    assert status(third) == "succeeded"


def test_an_exit_that_was_not_0_makes_it_failed_not_gone(tmp_path: Path) -> None:
    clock = Clock()
    running(tmp_path, clock)
    exit_note.leave(str(tmp_path), "", "j", 0, 0, 0)
    exit_note.leave(str(tmp_path), "", "j", 1, 0, 3)
    reg = registry(tmp_path, clock)
    reg.tick()
    assert status(reg) == "stopped: failed: rank 1 exited with code 3 while no arbiter " \
        "heard it"


def test_one_rank_s_exit_alone_ends_nothing(tmp_path: Path) -> None:
    clock = Clock()
    running(tmp_path, clock)
    exit_note.leave(str(tmp_path), "", "j", 1, 0, 0)
    reg = registry(tmp_path, clock)
    reg.tick()
    job = reg.jobs[("", "j")]
    assert job.phase is JobPhase.RUNNING and job.ranks[1].state == "succeeded"
    assert status(reg).startswith("gone")
    # its agent-less rank 0 comes back and says it itself: succeeded as ever
    conn = Connection("peer-0")
    reg.hello(conn, pb.Hello(job="j", rank=0, world_size=2, pod="pod-0", node="n",
                             agent_instance="i0", state="exited"))
    reg.handle(conn, pb.AgentMessage(exit=pb.TrainerExit(generation=0, exit_code=0)), 0.0)
    assert status(reg) == "succeeded"


def test_exit_notes_are_checked_where_they_enter(tmp_path: Path) -> None:
    """Peer input: a note that is not one is removed unread, a link is not followed, and a
    note about a finished or unknown job changes nothing."""
    where = tmp_path / exit_note.DIR
    where.mkdir()
    (where / "big.json").write_text(json.dumps({"t": "x", "job": "j" * 10_000, "rank": 0,
                                                "generation": 0, "status": 0}))
    (where / "neg.json").write_text(json.dumps({"t": "x", "job": "j", "rank": -1,
                                                "generation": 0, "status": 0}))
    (where / "status.json").write_text(json.dumps({"t": "x", "job": "j", "rank": 0,
                                                   "generation": 0, "status": 999}))
    secret = tmp_path / "secret"
    secret.write_text(json.dumps({"t": "x", "job": "j", "rank": 0, "generation": 0,
                                  "status": 0}))
    os.symlink(secret, where / "link.json")
    assert exit_note.take(str(tmp_path)) == []
    assert sorted(p.name for p in where.iterdir()) == []
    assert secret.exists()
    assert not exit_note.leave(str(tmp_path), "", "", 0, 0, 0)  # refused before written
    clock = Clock()
    reg = registry(tmp_path, clock)
    exit_note.leave(str(tmp_path), "", "nobody", 0, 0, 0)
    reg.tick()
    assert reg.find_any("nobody", "") is None


def test_a_pod_s_terminal_status_is_its_trainer_s_exit() -> None:
    """The kubelet's fields (core/v1 PodStatus, ContainerStateTerminated)."""
    def pod(phase: str, *containers: tuple[str, dict[str, int]], **status: str) -> dict:
        return {"metadata": {"name": "p"}, "status": {"phase": phase, **status,
                "containerStatuses": [{"name": n, "state": {"terminated": t}}
                                      for n, t in containers]}}

    assert terminal_status(pod("Succeeded", ("trainer", {"exitCode": 0}))) == 0
    assert terminal_status(pod("Running")) is None
    assert terminal_status(pod("Failed", ("side", {"exitCode": 0}),
                               ("trainer", {"exitCode": 3})), "trainer") == 3
    assert terminal_status(pod("Failed", ("side", {"exitCode": 2}),
                               ("trainer", {"exitCode": 137, "signal": 9})), "trainer") == 137
    assert terminal_status(pod("Failed", ("side", {"exitCode": 2}))) == 2
    assert terminal_status(pod("Failed")) == 1
    assert terminal_status(pod("Failed", reason="Evicted")) is None  # a fault, not an end


def test_exits_read_by_the_arbiter_end_a_job_only_with_no_agent_left() -> None:
    job = JobState(job="j", world_size=2)
    apply(job, Revived(2), 0.0)
    apply(job, Exited(0, 2, 0, via="pods"), 0.0)
    assert job.phase is JobPhase.RUNNING
    apply(job, Exited(1, 2, 1, via="pods"), 0.0)
    assert job.phase is JobPhase.STOPPED and "rank 1 exited with code 1" in job.stop_reason


def test_ranks_that_never_reached_this_arbiter_are_heard_from_their_notes(
        tmp_path: Path) -> None:
    """After a restart rank 0's agent came back, then left; rank 1's never came (its
    trainer had ended): both exits known, the job succeeded, not "gone"."""
    clock = Clock()
    running(tmp_path, clock)
    reg = registry(tmp_path, clock)
    conn = Connection("peer-0")
    reg.hello(conn, pb.Hello(job="j", rank=0, world_size=2, pod="pod-0", node="n",
                             agent_instance="i0", generation=0, released_generation=0))
    reg.disconnect(conn)
    exit_note.leave(str(tmp_path), "", "j", 0, 0, 0)
    exit_note.leave(str(tmp_path), "", "j", 1, 0, 0)
    reg.tick()
    assert status(reg) == "succeeded"
