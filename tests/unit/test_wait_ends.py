"""A wait that ends is no hang: the false restart bench/hang_quiet.py found at the end of a
30 s silent save. Rank 0 saves, rank 1 waits for it in the next all-reduce (the arbiter
answered BUSY); the save ends, rank 0 joins the all-reduce, and rank 1's last verification
sample catches it *leaving* the wait -- out of the collective, no step line yet (it came
0.1 s later). The verdict said "moved only between waits": an error-level hang, and the
arbiter, on the stacks of that instant, blamed rank 1 for "not being in a collective"
while rank 0 waited in one, and restarted the job.

The exact sequence, deterministic: the Verifier on an injected clock with scripted samples
(test_liveness's rig), the pure verdict, and the arbiter's policy with ``state.apply``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ftagent.agent.peer_wait import PeerWait
from ftagent.arbiter.policy import PolicyConfig, decide_stacks, stack_signature
from ftagent.arbiter.state import (
    Decision,
    JobPhase,
    JobState,
    RankState,
    Verdict,
    apply,
)
from ftagent.detect.liveness import Frame, Liveness, ProcessSample, Snapshot, judge
from ftagent.model import JobBusy, Severity
from tests.unit.test_liveness import Rig, proc, thread, window
from tests.unit.test_peer_wait import busy

MODULE = Frame("<module>", "train.py", 600)
# rank 1 in DDP's all-reduce inside backward (train.py:458), as py-spy shows it
BACKWARD = (Frame("_engine_run_backward", "graph.py", 979, True),
            Frame("backward", "__init__.py", 353, True),
            Frame("backward", "_tensor.py", 648, True),
            Frame("main", "train.py", 458), MODULE)
# the same thread a moment later: backward returned, the optimizer steps (train.py:459)
STEPPING = (Frame("_use_grad", "optimizer.py", 79, True), Frame("main", "train.py", 459),
            MODULE)
SLEEPING = (Frame("sleep", "train.py", 437), Frame("main", "train.py", 437), MODULE)


def stacks(*frames: tuple[Frame, ...]) -> list[Snapshot]:
    return window([[proc(i * 0.5, 0.01 * i, [thread(f, active=f is not BACKWARD)])]
                   for i, f in enumerate(frames)])


# --------------------------------------------------------------------------- the verdict


def test_a_thread_that_left_the_collective_it_sat_in_is_alive_there() -> None:
    v = judge(stacks(BACKWARD, BACKWARD, STEPPING))
    assert v.state is Liveness.ALIVE, v.reason
    assert "left the collective it waited in" in v.reason
    # its place is the wait it left (what a stall there teaches), not "main"
    assert v.where == "_engine_run_backward (graph.py:979) from main (train.py:458)"
    assert judge(stacks(BACKWARD, STEPPING, SLEEPING)).state is Liveness.ALIVE


def test_a_thread_that_only_waits_or_goes_back_into_a_collective_is_still_hung() -> None:
    assert judge(stacks(*[BACKWARD] * 3)).state is Liveness.HUNG  # the victim, still
    # a loop polling with a collective goes back in: judged as any wait loop
    assert judge(stacks(BACKWARD, SLEEPING, BACKWARD, SLEEPING)).state is Liveness.HUNG
    # entering a collective is no exit from one
    assert judge(stacks(SLEEPING, SLEEPING, BACKWARD)).state is Liveness.HUNG
    # a sample with no frames shows nothing leaving
    assert judge(stacks(BACKWARD, BACKWARD, ())).state is Liveness.HUNG


# --------------------------------------------------------------------------- the agent


class Leaving:
    """Rank 1's trainer as the agent samples it: parked in the all-reduce until call
    ``leave_at`` (counted from 0), out of it from there on. Early samples without stacks
    are cheap, as TreeSampler's."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.calls = 0
        self.leave_at: int | None = None

    async def sample(self, stacks: bool = True, pids: Any = None
                     ) -> tuple[Snapshot, list[dict[str, Any]]]:
        out = self.leave_at is not None and self.calls >= self.leave_at
        self.calls += 1
        frames = STEPPING if out else BACKWARD
        threads = (thread(frames, active=out),) if stacks else None
        p = ProcessSample(10, self.clock[0], 1.0 + 0.001 * self.calls, 0, threads)
        return Snapshot(self.clock[0], (p,)), [{"pid": 10, "stack": "..." if stacks else None}]


def test_a_waiting_rank_sampled_leaving_the_all_reduce_is_not_declared_hung() -> None:
    """On the old code the verification that saw rank 1 leave the wait raised an
    error-level hang ("waiting in main (train.py:458): its stack moved only between
    waits")."""
    async def go() -> None:
        r = Rig([[]])
        sampler = Leaving(r.now)
        r.v.sampler = sampler
        r.v.ask_arbiter = lambda: True
        pw = PeerWait(1, r.v, r._record)
        start = r.now[0]
        (f,) = await r.run_until(start + 8.0)
        assert f.severity is Severity.WARNING  # the suspicion; the arbiter answers BUSY
        pw.on_action(busy())
        assert await r.run_until(start + 26.0) == []
        assert set(r.kinds("verify")[1:]) == {"waiting"}
        # rank 0's save ends: from the next verification's last sample on, rank 1 is out
        n = len(r.kinds("verify"))
        sampler.leave_at = sampler.calls + 4
        faults = []
        while len(r.kinds("verify")) == n:
            faults += await r.run_until(r.now[0] + 0.25)
        faults += await r.run_until(r.now[0] + 0.25)  # a fault raised is out by now
        assert faults == [], [x.message for x in faults]
        assert r.kinds("verify")[-1] == "alive", r.events[-1]
        assert not r.v.declared
        r.progress(0.1)  # its step line, a tenth of a second later
        (done,) = [e for e in r.events if e[:2] == ("peer", "waited")]
        assert "on rank 0 (busy in save" in done[2]
        (phase,) = [e for e in r.events if e[0] == "phase"]
        assert phase[3]["where"].startswith("_engine_run_backward (graph.py:979)")

    asyncio.run(go())


# --------------------------------------------------------------------------- the arbiter

SAVE = """Thread 7 (idle): "MainThread"
    silent_save (train.py:349)
    main (train.py:446)
"""
WAIT = """Thread 8 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:979)
    backward (torch/_tensor.py:648)
    main (train.py:458)
"""
LEFT = """Thread 8 (active): "MainThread"
    _use_grad (torch/optim/optimizer.py:79)
    main (train.py:459)
"""


def answer(text: str, state: str, where: str, declared: bool = False) -> str:
    return json.dumps({"processes": [{"pid": 1, "stack": text}], "seconds": 2.0,
                       "liveness": {"state": state, "where": where, "declared": declared}})


def probe(job: JobState, fault_id: str, answers: dict[int, str]) -> list[Decision]:
    """A job hang probe as the registry runs it: DUMP_STACKS applied, the answers in,
    then the decision."""
    apply(job, Decision(Verdict.DUMP_STACKS, "job hang", job.generation, rank=1,
                        fault_id=fault_id, until=100.0), 0.0)
    for r, text in answers.items():
        job.ranks[r].stack = stack_signature(text)
    return decide_stacks(job, 1.0, PolicyConfig())


def job() -> JobState:
    j = JobState(job="j", world_size=2, phase=JobPhase.RUNNING)
    for r in (0, 1):
        j.ranks[r] = RankState(rank=r, connected=True, step=30)
    return j


SWAPPED = {0: answer(WAIT, "hung", "_engine_run_backward (graph.py:979)"),
           1: answer(LEFT, "hung", "main (train.py:458)", declared=True)}


def test_the_arbiter_does_not_blame_a_rank_for_the_roles_swapping() -> None:
    """The same ranks, roles swapped at the instant of the stacks: rank 1 waited on rank 0
    (BUSY), now rank 0 waits in the collective and rank 1 is on its way out of it. On the
    old code: RESTART, culprit rank 1."""
    j = job()
    (d,) = probe(j, "f1", {0: answer(SAVE, "alive", "silent_save (train.py:349)"),
                           1: answer(WAIT, "hung", "_engine_run_backward (graph.py:979)")})
    assert d.verdict is Verdict.BUSY
    apply(j, d, 1.0)
    (d,) = probe(j, "f2", SWAPPED)
    assert d.verdict is Verdict.ALERT_ONLY, d.reason
    assert "the roles swapped" in d.reason and "rank 1 waited on rank 0" in d.reason
    apply(j, d, 2.0)
    assert j.hang_probe is None and j.busy == "" and j.busy_roles is None
    assert j.restarts == 0
    # once: a rank that really hangs after the swap is named on the next report
    (d,) = probe(j, "f3", SWAPPED)
    assert d.verdict is Verdict.RESTART and d.rank == 1
    assert "rank 1 is not in a collective" in d.reason


def test_without_a_busy_verdict_or_with_the_busy_rank_to_blame_the_culprit_stands() -> None:
    (d,) = probe(job(), "f1", SWAPPED)  # no BUSY before: a rank stuck before a collective
    assert d.verdict is Verdict.RESTART and d.rank == 1
    j = job()
    j.busy, j.busy_step = "job busy", 30
    j.busy_roles = JobBusy((0,), (1,), "spin (train.py:64)", "spinning", (0,))
    # the busy rank itself is the one not in a collective (a spinner declared hung)
    (d,) = probe(j, "f2", {0: answer(SAVE, "hung", "spin (train.py:64)", declared=True),
                           1: answer(WAIT, "hung", "_engine_run_backward (graph.py:979)")})
    assert d.verdict is Verdict.RESTART and d.rank == 0
