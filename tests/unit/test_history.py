"""Job history (arbiter/history.py, history_file.py): retention, restarts, bad files (pure,
injected clock; the file store on a temporary directory)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ftagent.arbiter.history import History, JobRecord
from ftagent.arbiter.history_file import FILE, FileHistory
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import FORGET_AFTER, Connection, Registry
from ftagent.arbiter.state import Decision, Verdict
from ftagent.arbiter.timeline import Entry, Timeline
from ftagent.model import Fault, FaultKind
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.convert import fault_to_proto


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def registry(clock: Clock, history: History) -> Registry:
    return Registry(PolicyConfig(max_restarts=3), Timeline(), None, "a", clock=clock,
                    history=history)


def run_job(reg: Registry, clock: Clock, job: str, *, stop: bool = False) -> None:
    """Two ranks: start, a crash restarts them (2 s lost), then success or a stop."""
    conns = [Connection(f"peer-{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job=job, rank=r, world_size=2, agent_instance=f"i{r}"))
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    clock.now += 1
    f = fault_to_proto(Fault(FaultKind.CRASH, "boom"), 0, exit_status=1)
    reg.handle(conns[1], pb.AgentMessage(fault=f), 0.0)
    clock.now += 2
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=1)), 0.0)
    clock.now += 1
    if stop:
        stop_it = Decision(Verdict.STOP, "out of patience", 1, exit_code=1)
        reg.execute(reg.jobs[("", job)], [stop_it], clock.now)
    else:
        for c in conns:
            reg.handle(c, pb.AgentMessage(exit=pb.TrainerExit(generation=1, exit_code=0)), 0.0)
    for c in conns:
        reg.disconnect(c)


def test_a_finished_job_outlives_its_agents_until_retention_then_goes() -> None:
    clock = Clock()
    reg = registry(clock, History(retention=7200.0))
    run_job(reg, clock, "done")
    run_job(reg, clock, "halted", stop=True)
    assert {reg.info(j, ranks=False).state for j in reg.listing()} == {
        "succeeded", "stopped: out of patience"}
    snap = {s.job: s for s in reg.job_snapshots()}
    assert snap["done"].restarts_by_reason == {"crash": 1}
    assert snap["done"].seconds_lost == pytest.approx(2.0)
    assert snap["halted"].state == "stopped"

    clock.now += FORGET_AFTER + 1
    reg.tick()
    assert not reg.jobs and {r.job for r in reg.history.records()} == {"done", "halted"}
    found = reg.find_any("done", "")
    assert isinstance(found, JobRecord)
    info = reg.info(found, ranks=True)
    assert info.state == "succeeded" and info.generation == 1 and info.restarts == 1
    assert any("job succeeded" in e.message for e in info.timeline)
    assert {s.job: s.seconds_lost for s in reg.job_snapshots()}["done"] == pytest.approx(2.0)

    clock.now += 7200.0 - FORGET_AFTER
    reg.tick()
    assert not list(reg.listing()) and not reg.timeline.entries("done", "")


def test_a_job_gone_without_finishing_says_so_and_a_new_hello_takes_over() -> None:
    clock = Clock()
    reg = registry(clock, History())
    c = Connection()
    reg.hello(c, pb.Hello(job="lost", rank=0, world_size=1, agent_instance="x"))
    reg.disconnect(c)
    clock.now += 42
    info = reg.info(reg.listing()[0], ranks=False)
    assert info.state == "gone: no agent for 42s (was starting)"
    assert reg.job_snapshots()[0].state == "gone"
    clock.now += FORGET_AFTER
    reg.tick()
    assert reg.history.past and not reg.jobs
    reg.hello(Connection(), pb.Hello(job="lost", rank=0, world_size=1, agent_instance="y"))
    assert not reg.history.past  # the live job supersedes the record; it decides as today
    assert [j.connected for j in reg.listing()] == [1]  # type: ignore[union-attr]


def test_history_survives_a_restart_through_the_state_dir(tmp_path: Path) -> None:
    clock = Clock()
    reg = registry(clock, History(FileHistory(str(tmp_path))))
    run_job(reg, clock, "done")
    before = [e.message for e in reg.timeline.entries("done", "")]
    reg.history.close()

    reg2 = registry(clock, History(FileHistory(str(tmp_path))))
    [job] = reg2.listing()
    assert isinstance(job, JobRecord) and job.phase == "succeeded"
    info = reg2.info(job, ranks=True)
    assert [e.message for e in info.timeline] == before
    assert reg2.job_snapshots()[0].restarts_by_reason == {"crash": 1}
    # new entries number after the kept ones
    c = Connection()
    reg2.hello(c, pb.Hello(job="next", rank=0, world_size=1, agent_instance="n"))
    assert reg2.timeline.entries("next", "")[0].seq > max(e.seq for e in info.timeline)


def test_a_corrupt_or_truncated_last_line_is_skipped_with_one_log_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    reg = registry(clock, History(FileHistory(str(tmp_path))))
    run_job(reg, clock, "done")
    reg.history.close()
    path = tmp_path / FILE
    with path.open("ab") as f:
        f.write(b'{"t":"e","seq":99,"ts":1.0,"job":"done","gen')  # torn by a SIGKILL
    with caplog.at_level(logging.WARNING, "ftagent.arbiter.history"):
        reg2 = registry(clock, History(FileHistory(str(tmp_path))))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "skipped 1 unreadable line" in warnings[0].getMessage()
    assert "truncated" in warnings[0].getMessage()
    assert [j.job for j in reg2.listing()] == ["done"]
    assert path.read_bytes().endswith(b"\n")  # compacted: the next append is a clean line
    reg2.history.close()
    caplog.clear()
    with path.open("ab") as f:
        f.write(b"not json at all\n")
        f.write(b'{"t":"j","job":""}\n')  # a record that is not one
    with caplog.at_level(logging.WARNING, "ftagent.arbiter.history"):
        registry(clock, History(FileHistory(str(tmp_path))))
    assert [r.getMessage() for r in caplog.records].count(
        next(r.getMessage() for r in caplog.records)) == 1
    assert "skipped 2 unreadable lines" in caplog.records[0].getMessage()


def test_the_file_stays_bounded_and_entries_per_job_are_capped(tmp_path: Path) -> None:
    store = FileHistory(str(tmp_path), keep_per_job=50, max_bytes=200_000)
    for i in range(20_000):
        store.record(Entry(i + 1, 1000.0 + i, f"job-{i % 7}", "", 0, "agent", "x" * 40))
        assert (tmp_path / FILE).stat().st_size <= 200_000 + 300
    got = store.load()
    per_job: dict[str, int] = {}
    for e in got.entries:
        per_job[e.job] = per_job.get(e.job, 0) + 1
    assert set(per_job.values()) == {50}
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE]  # no .tmp left behind
    lines = (tmp_path / FILE).read_text().splitlines()
    assert all(json.loads(line)["t"] == "e" for line in lines)


def test_a_forgotten_job_does_not_come_back_after_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    reg = registry(clock, History(FileHistory(str(tmp_path)), retention=10.0))
    run_job(reg, clock, "done")
    clock.now += 11
    reg.tick()
    assert not list(reg.listing())
    reg.history.close()
    assert not list(registry(clock, History(FileHistory(str(tmp_path)))).listing())


def test_a_running_job_rebuilt_after_a_restart_keeps_its_counters_not_its_decisions(
        tmp_path: Path) -> None:
    clock = Clock()
    reg = registry(clock, History(FileHistory(str(tmp_path))))
    conns = [Connection() for _ in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, pb.Hello(job="live", rank=r, world_size=2, agent_instance=f"i{r}"))
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    f = fault_to_proto(Fault(FaultKind.GPU, "xid 79"), 0)
    reg.handle(conns[0], pb.AgentMessage(fault=f), 0.0)
    clock.now += 3
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=1)), 0.0)
    reg.history.close()  # SIGKILL: no goodbye

    reg2 = registry(clock, History(FileHistory(str(tmp_path))))
    assert reg2.info(reg2.listing()[0], ranks=False).state.startswith("gone: no agent")
    for r in range(2):  # the agents come back: the job is theirs, as today
        reg2.hello(Connection(), pb.Hello(job="live", rank=r, world_size=2, generation=1,
                                          released_generation=1, restart_count=1,
                                          agent_instance=f"i{r}"))
    [snap] = reg2.job_snapshots()
    assert (snap.state, snap.generation, snap.restarts) == ("running", 1, 1)
    assert snap.restarts_by_reason == {"gpu": 1} and snap.seconds_lost == pytest.approx(3.0)
    assert not reg2.history.past


def test_the_collector_names_restarts_it_did_not_see_unknown() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from ftagent.metrics import ArbiterMetrics, JobSnapshot

    prom = CollectorRegistry()
    ArbiterMetrics(prom).watch_jobs(lambda: [JobSnapshot("j", "ns", "running", 4, 3,
                                                         {"crash": 1}, 2.5, 8, 8, 7)])
    text = generate_latest(prom).decode()
    assert 'ftagent_job_restarts_total{job_name="j",namespace="ns",reason="crash"} 1.0' in text
    assert 'ftagent_job_restarts_total{job_name="j",namespace="ns",reason="unknown"} 2.0' in text
    assert 'ftagent_job_state{job_name="j",namespace="ns",state="running"} 1.0' in text
    assert 'ftagent_job_ranks{job_name="j",kind="running",namespace="ns"} 7.0' in text
    assert 'ftagent_job_seconds_lost_to_faults_total{job_name="j",namespace="ns"} 2.5' in text

    def broken() -> list[JobSnapshot]:
        raise RuntimeError("registry exploded")
    prom2 = CollectorRegistry()
    ArbiterMetrics(prom2).watch_jobs(broken)
    assert "ftagent_arbiter_jobs" in generate_latest(prom2).decode()  # the scrape survives
