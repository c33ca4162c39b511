"""The culprit as data, said the same way every time (issue 35, item 7).

The same job hang with the same flight-recorder evidence is decided twice, once reported
first by the waiting rank and once by the culprit itself: the decision carries the same
structured culprits and its message names them in the same words. On the old code the
second ended without the "culprit rank" clause (it was said only when the culprit was not
the reporting rank) and no decision had a culprit field at all.
"""

from __future__ import annotations

import pytest

from ftagent.arbiter.policy import (
    FaultReport,
    PolicyConfig,
    culprit_clause,
    decide_fault,
    decide_stacks,
)
from ftagent.arbiter.state import (
    Culprit,
    Decision,
    JobPhase,
    JobState,
    RankState,
    Verdict,
    apply,
)
from ftagent.model import Fault, FaultKind, Severity

CFG = PolicyConfig(max_restarts=3, stacks_timeout=15)
NOW = 1_000_000.0
WAITING = "wait (distributed_c10d.py:4000) < all_reduce (distributed_c10d.py:2800)"
STUCK = "hang_before_collective (train.py:120) < main (train.py:300)"


def summary(rank: int, enqueued: int, completed: int) -> dict:
    """A flight-recorder summary of one rank in process group 0 (agent/fr_summary.py:
    its last 8 collectives)."""
    entries = [{"seq": s, "op": "all_reduce", "in_sizes": [[4]], "dtypes": ["Float"]}
               for s in range(max(1, enqueued - 7), enqueued + 1)]
    return {"rank": rank, "groups": [{"name": "0", "enqueued": enqueued,
                                      "completed": completed, "entries": entries}]}


def hung_job(world: int, culprits: set[int], *, restarts: int = 0) -> JobState:
    j = JobState(job="j", world_size=world, phase=JobPhase.RUNNING, restarts=restarts,
                 max_restarts=3)
    for r in range(world):
        j.ranks[r] = RankState(rank=r, pod=f"train-{r}", node=f"node-{r // 8}",
                               connected=True, step=10, last_step_at=NOW - 60)
    return j


def decide_hang(world: int, culprits: set[int], reporter: int, *, with_fr: bool = True,
                restarts: int = 0) -> Decision:
    """A job hang reported by ``reporter``; every rank's stacks (and flight-recorder
    summary) arrive; the decision."""
    j = hung_job(world, culprits, restarts=restarts)
    f = Fault(FaultKind.HANG, "no progress", Severity.ERROR)
    (probe,) = decide_fault(j, FaultReport(f, reporter, 0), NOW, CFG)
    assert probe.verdict is Verdict.DUMP_STACKS
    apply(j, probe, NOW)
    for r in range(world):
        j.ranks[r].stack = STUCK if r in culprits else WAITING
        if with_fr:
            j.ranks[r].fr = summary(r, 24, 24) if r in culprits else summary(r, 25, 24)
    (d,) = decide_stacks(j, NOW + 1, CFG)
    return d


def clause_of(d: Decision) -> str:
    return d.reason[d.reason.index("culprit ranks"):].split(";")[0]


@pytest.mark.parametrize("with_fr", [True, False], ids=["flight-recorder", "stacks"])
def test_the_same_hang_names_its_culprit_whichever_rank_reported_it(with_fr: bool) -> None:
    by_waiter = decide_hang(4, {1}, reporter=0, with_fr=with_fr)
    by_culprit = decide_hang(4, {1}, reporter=1, with_fr=with_fr)
    for d in (by_waiter, by_culprit):
        assert d.verdict is Verdict.RESTART and d.rank == 1
        assert d.culprits == (Culprit(1, "train-1", "node-0"),)
        assert "; culprit ranks 1 (pod train-1, node node-0); every rank restarts" in d.reason
    assert by_waiter.reason == by_culprit.reason


def test_several_culprits_are_all_named_in_rank_order() -> None:
    d = decide_hang(16, {9, 3}, reporter=9)
    assert d.verdict is Verdict.RESTART and d.rank is None  # no single rank to target
    assert [c.rank for c in d.culprits] == [3, 9]
    assert clause_of(d) == "culprit ranks 3 (pod train-3, node node-0), " \
        "9 (pod train-9, node node-1)"


def test_a_spent_budget_stops_and_still_names_the_culprit() -> None:
    d = decide_hang(4, {2}, reporter=2, restarts=3)
    assert d.verdict is Verdict.STOP and d.culprits == (Culprit(2, "train-2", "node-0"),)
    assert "; culprit ranks 2 (pod train-2, node node-0); restart budget spent" in d.reason


def test_a_hung_rank_while_the_others_progress_is_named_as_data_too() -> None:
    j = hung_job(4, {2})
    for r in (0, 1, 3):
        j.ranks[r].last_step_at = NOW - 0.5
    f = Fault(FaultKind.HANG, "no progress", Severity.ERROR)
    (d,) = decide_fault(j, FaultReport(f, 2, 0), NOW, CFG)
    assert d.verdict is Verdict.RESTART and d.culprits == (Culprit(2, "train-2", "node-0"),)
    assert "; culprit ranks 2 (pod train-2, node node-0); every rank restarts" in d.reason


def test_a_hang_without_a_culprit_carries_none() -> None:
    j = hung_job(2, set())
    (probe,) = decide_fault(j, FaultReport(Fault(FaultKind.HANG, "x"), 0, 0), NOW, CFG)
    apply(j, probe, NOW)
    for r in range(2):
        j.ranks[r].stack = WAITING
    (d,) = decide_stacks(j, NOW + 1, CFG)
    assert d.verdict is Verdict.RESTART and d.culprits == () and "culprit ranks" not in d.reason


def test_the_clause_is_bounded_and_marks_unknown_places() -> None:
    many = tuple(Culprit(r) for r in range(20))
    text = culprit_clause(many)
    assert text.startswith("culprit ranks 0 (pod -, node -), 1 (pod -, node -)")
    assert text.endswith("7 (pod -, node -) and 12 more")
    assert culprit_clause(()) == ""


# --------------------------------------------------------------------------- the same data out


def test_the_timeline_entry_carries_the_culprits_to_the_status_json() -> None:
    from ftagent.arbiter import convert
    from ftagent.arbiter.status_view import to_dict
    from ftagent.arbiter.timeline import Timeline

    d = decide_hang(4, {1}, reporter=0)
    e = Timeline().add(NOW, "j", "", 1, "decision", d.reason, rank=d.rank,
                       action=d.verdict.value, culprits=d.culprits)
    out = to_dict(convert.entry_to_proto(e))
    assert out["culprits"] == [{"rank": 1, "pod": "train-1", "node": "node-0"}]
    assert out["action"] == "restart" and "culprit ranks 1 (pod train-1" in out["message"]
    assert to_dict(convert.entry_to_proto(Timeline().add(NOW, "j", "", 0, "agent", "x"))
                   )["culprits"] == []


def test_the_history_keeps_an_entrys_culprits_and_drops_malformed_ones() -> None:
    from ftagent.arbiter.history_file import entry_from_json, entry_json
    from ftagent.arbiter.timeline import Timeline

    e = Timeline().add(NOW, "j", "", 1, "decision", "r", culprits=(Culprit(1, "p", "n"),
                                                                   Culprit(3)))
    assert entry_from_json(entry_json(e)) == e
    bad = dict(entry_json(e), culprits=[[True, "p", "n"], ["1", "p", "n"], [2, "p"], "x",
                                        [4, "p" * 1000, "n"]])
    assert entry_from_json(bad).culprits == (Culprit(4, "p" * 253, "n"),)
    assert entry_from_json(dict(entry_json(e), culprits={"a": 1})).culprits == ()
    old = entry_json(e)
    del old["culprits"]  # a history written before culprits were kept
    assert entry_from_json(old).culprits == ()


def test_the_culprit_counter_is_per_rank_and_bounded() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from ftagent.arbiter.history import CULPRIT_RANKS_KEPT
    from ftagent.arbiter.journal import JobStats
    from ftagent.metrics import JobCollector, JobSnapshot

    s = JobStats()
    for r in [1, 1, 3] + list(range(100, 200)):
        s.blamed(r)
    assert len(s.culprits) == CULPRIT_RANKS_KEPT + 1 and s.culprits[1] == 2
    assert s.culprits[-1] == 102 - CULPRIT_RANKS_KEPT  # 102 ranks named: the rest "other"
    reg = CollectorRegistry()
    snap = JobSnapshot("j", "ns", "running", 1, 1, {}, 0.0, 4, 4, 4,
                       culprits=tuple(sorted(s.culprits.items())))
    reg.register(JobCollector(lambda: [snap]))
    text = generate_latest(reg).decode()
    assert 'ftagent_job_culprits_total{job_name="j",namespace="ns",rank="1"} 2.0' in text
    assert 'ftagent_job_culprits_total{job_name="j",namespace="ns",rank="other"} 38.0' in text
