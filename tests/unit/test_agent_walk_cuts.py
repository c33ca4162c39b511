"""Issue 36, the agent's half of a crash: what the cuts on its path must keep doing.

The crash path (bench/fault_walk.py ``--agent``; its guard: tests/integration/
test_agent_walk.py) lost its calls to observers that ignore an observation, a link
observer told of every step, ``ProcessExit``'s status computed per read, the fault
series' labels folded per fault. Each test here pins the behaviour the cut must keep.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, generate_latest

from ftagent.agent.metrics_sink import MetricsSink
from ftagent.metrics import AgentMetrics
from ftagent.model import Fault, FaultKind, Observation, ProcessExit, Progress, TrainerStart
from ftagent.watch.loop import WatchLoop


class Reads:
    """An observer that says which observations it reads (``observes``)."""

    def __init__(self, *types: type) -> None:
        self.observes = types
        self.got: list[Observation] = []

    def observe(self, obs: Observation) -> None:
        self.got.append(obs)


def test_the_watch_loop_hands_an_observation_only_to_the_observers_that_read_its_type(
) -> None:
    progress, everything, exits = Reads(Progress), [], Reads(ProcessExit)
    loop = WatchLoop([], lambda f: None, tick_seconds=None,
                     observers=[progress.observe, everything.append, exits.observe])
    p, e, s = Progress(step=3, ts=1.0), ProcessExit(7, 1, ts=2.0), TrainerStart(7, 0)
    for obs in (p, e, s):
        loop.emit(obs)
    assert progress.got == [p] and exits.got == [e]
    assert everything == [p, e, s]  # one that says nothing takes every observation
    # an observer added after the first routing (the pod adds its own at run) is routed
    late = Reads(TrainerStart)
    loop.observers.append(late.observe)
    loop.emit(s)
    loop.emit(p)
    assert late.got == [s] and progress.got == [p, p]


def test_a_process_exit_carries_its_status_as_attributes_made_at_construction() -> None:
    killed, failed, ok = ProcessExit(1, None, 9), ProcessExit(1, 3), ProcessExit(1, 0)
    assert (killed.exit_status, killed.ok) == (137, False)
    assert (failed.exit_status, failed.ok) == (3, False)
    assert (ok.exit_status, ok.ok) == (0, True)
    moved = dataclasses.replace(ok, code=None, signal=15)  # derived again, never stale
    assert (moved.exit_status, moved.ok) == (143, False)
    assert ProcessExit(1, 3, ts=1.0) == ProcessExit(1, 3, ts=1.0)


def _faults(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("ftagent_faults_total{")]


def test_the_fault_series_follow_a_relabel_and_only_kinds_that_happened_appear() -> None:
    """The fault series' labels are folded once per identity: a spare that took rank 1
    counts its next fault as rank 1, with the one before it (AgentMetrics.relabel)."""
    reg = CollectorRegistry()
    m = AgentMetrics(reg, {"job_name": "j", "namespace": "ns", "pod": "p", "node": "n",
                           "rank": "-1"})
    sink = MetricsSink(m)
    text = generate_latest(reg).decode()
    assert _faults(text) == []  # no series for a kind that did not happen
    sink.on_fault(Fault(FaultKind.GPU, "xid 79"))
    m.relabel(rank="1")
    sink.on_fault(Fault(FaultKind.GPU, "xid 79 again"))
    sink.on_fault(Fault(FaultKind.CRASH, "exit 3"))
    faults = _faults(generate_latest(reg).decode())
    assert all('rank="1"' in ln for ln in faults), faults
    gpu = [ln for ln in faults if 'kind="gpu"' in ln]
    crash = [ln for ln in faults if 'kind="crash"' in ln]
    assert len(gpu) == 1 and gpu[0].endswith(" 2.0"), faults
    assert len(crash) == 1 and crash[0].endswith(" 1.0"), faults
