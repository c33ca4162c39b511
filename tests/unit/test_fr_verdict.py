"""Flight-recorder summaries and the verdict, on dumps recorded from real gloo jobs
(tests/fixtures/flight_recorder/record.py says how) and on hand-built summaries."""

from __future__ import annotations

import copy
import json
import os
import pickle
from typing import Any

import pytest

from ftagent.agent.fr_summary import DumpError, load_dump, summarize
from ftagent.arbiter.fr_verdict import decide

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "flight_recorder")


def recorded(scenario: str) -> dict[int, dict[str, Any]]:
    d = os.path.join(FIX, scenario)
    out = {}
    for name in sorted(os.listdir(d)):
        rank = int(name.removeprefix("rank").removesuffix(".pkl"))
        with open(os.path.join(d, name), "rb") as f:
            out[rank] = summarize(load_dump(f.read()), rank)
    return out


def test_summary_of_a_real_dump_is_bounded_plain_json() -> None:
    s = recorded("behind")[0]
    (g,) = s["groups"]
    assert (g["name"], g["enqueued"], g["completed"]) == ("0", 4, 3)
    assert [e["seq"] for e in g["entries"]] == [1, 2, 3, 4]
    last = g["entries"][-1]
    assert (last["op"], last["in_sizes"], last["dtypes"]) == ("all_reduce", [[4]], ["Float"])
    assert last["frames"][0].endswith("record.py:70 _rank_main")  # the call, not torch's
    assert json.loads(json.dumps(s)) == s


def test_rank_that_never_enqueued_the_collective_is_named() -> None:
    v = decide(recorded("behind"), world=2)
    assert (v.kind, v.culprits) == ("behind", (1,))
    assert "rank 1 at #3 never reached collective #4 (all_reduce) of process group 0" \
        in v.reason


def test_op_mismatch_names_both_calls() -> None:
    v = decide(recorded("mismatch_op"), world=2)
    assert (v.kind, v.culprits) == ("mismatch", (0, 1))
    assert "mismatch (op) at #4" in v.reason
    assert "rank 0 all_reduce([4] Float)" in v.reason
    assert "rank 1 all_gather([4] Float)" in v.reason


def test_recorded_size_mismatch_is_named_before_the_rank_behind() -> None:
    # a real gloo job (record.py): rank 0 completed its 1M half and waits in #5, rank 1
    # waits in #4 for the rest of its 2M: the mismatch at #4, not "rank 1 behind"
    s = recorded("mismatch_sizes")
    v = decide(s, world=2)
    assert (v.kind, v.culprits) == ("mismatch", (0, 1))
    assert "collective mismatch (sizes) at #4 of process group 0: rank 0 " \
        "all_reduce([1000000] Float) at " in v.reason, v.reason
    assert "but rank 1 all_reduce([2000000] Float) at " in v.reason, v.reason
    assert v.key.startswith("0#4: ")
    assert any(f.kind == "behind" and f.ranks == (1,) for f in v.findings)


def test_size_mismatch_names_both_sizes() -> None:
    # gloo aborts on a size mismatch before a dump (record.py): NCCL hangs; build it
    s = recorded("behind")
    s[1] = copy.deepcopy(s[0])
    s[1]["rank"] = 1
    s[1]["groups"][0]["entries"][-1]["in_sizes"] = [[8]]
    v = decide(s, world=2)
    assert (v.kind, v.culprits) == ("mismatch", (0, 1))
    assert "mismatch (sizes) at #4" in v.reason and "all_reduce([8] Float)" in v.reason


def test_inner_group_culprit_found_before_the_world_group() -> None:
    v = decide(recorded("inner"), world=4)
    assert (v.kind, v.culprits) == ("behind", (3,))
    assert "rank 3 at #1 never reached collective #2 (all_reduce) of process group 2" \
        in v.reason
    waiting = [f for f in v.findings if f.kind == "waiting"]
    assert [(f.group, f.ranks) for f in waiting] == [("0", (2,))]


def _group(name: str, enq: int, done: int, op: str = "all_reduce",
           sizes: list[list[int]] | None = None) -> dict[str, Any]:
    return {"name": name, "desc": "", "ranks": [], "enqueued": enq, "started": -1,
            "completed": done,
            "entries": [{"seq": enq, "op": op, "in_sizes": sizes or [[4]], "out_sizes": [],
                         "dtypes": ["Float"], "state": "scheduled", "frames": []}]}


def test_three_groups_hand_built_inner_culprit() -> None:
    # world {0..3}; dp {0,1} and {2,3}. Rank 0 never enqueues dp-1 #7: rank 1 waits in
    # it; ranks 2,3 (done with their dp) wait in world #5, where 0 and 1 are behind.
    s = {0: {"rank": 0, "groups": [_group("0", 4, 4), _group("1", 6, 6)]},
         1: {"rank": 1, "groups": [_group("0", 4, 4), _group("1", 7, 6)]},
         2: {"rank": 2, "groups": [_group("0", 5, 4), _group("2", 7, 7)]},
         3: {"rank": 3, "groups": [_group("0", 5, 4), _group("2", 7, 7)]}}
    v = decide(s, world=4)
    assert (v.kind, v.culprits) == ("behind", (0,))
    assert "process group 1" in v.reason
    world = [f for f in v.findings if f.group == "0"]
    assert {(f.kind, f.ranks) for f in world} == {("waiting", (1,)), ("behind", (0,))}


def test_everyone_inside_the_same_collective_is_a_stall() -> None:
    s = {r: {"rank": r, "groups": [_group("0", 9, 8)]} for r in range(2)}
    v = decide(s, world=2)
    assert (v.kind, v.culprits) == ("stall", (0, 1))
    assert "inside collective #9" in v.reason


def test_rank_without_a_dump_is_unresponsive() -> None:
    s: dict[int, Any] = {0: {"rank": 0, "groups": [_group("0", 9, 8)]}, 1: None}
    v = decide(s, world=3)
    assert (v.kind, v.culprits) == ("unresponsive", (1, 2))


def test_no_one_stuck_is_no_verdict() -> None:
    s = {r: {"rank": r, "groups": [_group("0", 9, 9)]} for r in range(2)}
    assert decide(s, world=2).kind == "none"


@pytest.mark.parametrize("junk", [None, 7, "x", {"groups": "x"}, {"groups": [None, 3]},
                                  {"groups": [{"name": 5, "enqueued": "9", "entries": 4}]}])
def test_junk_summaries_are_no_dump_not_a_crash(junk: Any) -> None:
    good = {"rank": 0, "groups": [_group("0", 9, 8)]}
    v = decide({0: good, 1: junk}, world=2)
    assert v.kind in ("unresponsive", "stall", "behind")


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/ftagent-fr-pwned",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Any) -> None:
    data = pickle.dumps({"entries": [], "x": _Boom()})
    with pytest.raises(DumpError, match="names a callable"):
        load_dump(data)
    assert not os.path.exists("/tmp/ftagent-fr-pwned")


@pytest.mark.parametrize("data", [b"", b"not a pickle", pickle.dumps([1, 2]),
                                  pickle.dumps({"entries": 3})])
def test_unreadable_dumps_are_a_clear_error(data: bytes) -> None:
    with pytest.raises(DumpError):
        load_dump(data)


def test_oversized_dump_is_refused_before_parsing(monkeypatch: Any) -> None:
    from ftagent.agent import fr_summary

    monkeypatch.setattr(fr_summary, "MAX_DUMP_BYTES", 100)
    with pytest.raises(DumpError, match="over the 100 limit"):
        load_dump(pickle.dumps({"entries": [], "pad": "x" * 200}))


def test_summary_bounds_a_huge_dump() -> None:
    e = {"collective_seq_id": 1, "profiling_name": "gloo:" + "a" * 10_000, "pg_id": 0,
         "process_group": ("0", "default_pg"), "input_sizes": [[1] * 100] * 100,
         "input_dtypes": ["Float"] * 100, "frames": [{"filename": "f", "line": 1}] * 100}
    s = summarize({"entries": [e] * 1000, "pg_status": {str(i): {} for i in range(500)}}, 0)
    assert len(s["groups"]) == 64
    g = s["groups"][0]
    assert len(g["entries"]) == 4
    assert len(g["entries"][0]["op"]) <= 160 and len(g["entries"][0]["in_sizes"]) == 8
    assert len(g["entries"][0]["frames"]) == 6 and g["entries"][0]["frames"][0] == "f:1 "


# ------------------------------------------------------------------ at the arbiter


def _job_hang_with(stacks_json: dict[int, str], job: Any = None) -> Any:
    from ftagent.arbiter.fr_verdict import summary_of
    from ftagent.arbiter.policy import PolicyConfig, decide_stacks, stack_signature
    from ftagent.arbiter.state import HangProbe, JobPhase, JobState, RankState, apply

    j = job or JobState(job="j", world_size=len(stacks_json), max_restarts=3,
                        phase=JobPhase.RUNNING)
    j.hang_probe = HangProbe(fault_id="f", rank=0, deadline=1e9)
    for r, sj in stacks_json.items():
        j.ranks[r] = RankState(rank=r, connected=True, step=10)
        j.ranks[r].stack = stack_signature(sj)
        j.ranks[r].fr = summary_of(sj, r)
    (d,) = decide_stacks(j, 0.0, PolicyConfig(max_restarts=3))
    apply(j, d, 0.0)
    return d


WAITING = {"processes": [{"stack": "Thread 1 (idle): \"MainThread\"\n    all_reduce "
                                   "(torch/distributed/distributed_c10d.py:3252)\n"}]}


def test_arbiter_names_a_mismatch_the_stacks_cannot() -> None:
    # both ranks wait in a collective: by stacks, "no single culprit" (issue 22)
    s = recorded("mismatch_op")
    plain = {r: json.dumps(WAITING) for r in s}
    assert "no single culprit" in _job_hang_with(plain).reason
    with_fr = {r: json.dumps({**WAITING, "flight_recorder": {"summaries": [s[r]]}})
               for r in s}
    d = _job_hang_with(with_fr)
    assert "flight recorder: collective mismatch (op) at #4" in d.reason
    assert "rank 1 all_gather" in d.reason


def test_arbiter_names_the_rank_behind_from_the_flight_recorder() -> None:
    s = recorded("behind")
    d = _job_hang_with({r: json.dumps({**WAITING, "flight_recorder": {"summaries": [s[r]]}})
                        for r in s})
    assert d.rank == 1 and "flight recorder: rank 1 at #3 never reached" in d.reason


def test_summary_of_takes_only_the_senders_own_rank() -> None:
    from ftagent.arbiter.fr_verdict import summary_of

    s = recorded("behind")
    sj = json.dumps({"flight_recorder": {"summaries": [s[1]]}})
    assert summary_of(sj, 1) == s[1]
    assert summary_of(sj, 0) == {}  # a claim for another rank: no dump of its own
    assert summary_of(json.dumps(WAITING), 0) is None  # recorder off: stacks decide
    assert summary_of("not json", 0) is None


def test_stack_signature_ignores_the_flight_recorder() -> None:
    from ftagent.arbiter.policy import stack_signature

    s = recorded("behind")
    assert stack_signature(json.dumps({**WAITING, "flight_recorder": {"summaries": [s[0]]}})) \
        == stack_signature(json.dumps(WAITING))


def test_the_same_mismatch_after_a_restart_stops_the_job() -> None:
    from ftagent.arbiter.state import JobPhase, JobState, Verdict

    s = recorded("mismatch_op")
    answers = {r: json.dumps({**WAITING, "flight_recorder": {"summaries": [s[r]]}})
               for r in s}
    j = JobState(job="j", world_size=2, max_restarts=3, phase=JobPhase.RUNNING)
    first = _job_hang_with(answers, j)
    assert first.verdict is Verdict.RESTART and first.mismatch and j.mismatch == first.mismatch
    again = _job_hang_with(answers, j)
    assert again.verdict is Verdict.STOP and again.exit_code == 1
    assert "the same collective mismatch as before the last restart" in again.reason
    assert "rank 1 all_gather([4] Float) at " in again.reason


def test_a_different_mismatch_or_another_hang_between_restarts_again() -> None:
    from ftagent.arbiter.state import JobPhase, JobState, Verdict

    s = recorded("mismatch_op")
    answers = {r: json.dumps({**WAITING, "flight_recorder": {"summaries": [s[r]]}})
               for r in s}
    j = JobState(job="j", world_size=2, max_restarts=10, phase=JobPhase.RUNNING)
    _job_hang_with(answers, j)
    b = recorded("behind")
    behind = _job_hang_with({r: json.dumps({**WAITING, "flight_recorder": {
        "summaries": [b[r]]}}) for r in b}, j)
    assert behind.verdict is Verdict.RESTART and j.mismatch == ""  # the memory is cleared
    assert _job_hang_with(answers, j).verdict is Verdict.RESTART
    s[1]["groups"][0]["entries"][-1]["op"] = "broadcast"  # another mismatch: restart
    other = {r: json.dumps({**WAITING, "flight_recorder": {"summaries": [s[r]]}}) for r in s}
    assert _job_hang_with(other, j).verdict is Verdict.RESTART


def test_a_rank_whose_trainer_gives_no_dump_is_named_while_its_peer_waits() -> None:
    # a SIGSTOPped trainer: its agent answers (stacks, no dump of its rank); rank 0's dump
    # shows it inside all_reduce #4. The stacks alone cannot tell (both "wait").
    s = recorded("behind")
    answers = {0: json.dumps({**WAITING, "flight_recorder": {"summaries": [s[0]]}}),
               1: json.dumps({**WAITING, "flight_recorder": {"summaries": []}})}
    d = _job_hang_with(answers)
    assert d.rank == 1, d.reason
    assert "flight recorder: rank 1 gave no flight-recorder dump (its agent answered, its " \
        "trainer did not: stopped, or a main thread holding the GIL) while rank 0 waits " \
        "in collective #4 (all_reduce) of process group 0" in d.reason, d.reason
    assert "stall" not in d.reason  # rank 1 may be behind: no one can say "none is behind"


def test_a_rank_that_sends_nothing_by_the_deadline_is_named_dead_or_unresponsive() -> None:
    # a frozen pod (agent and trainer): its stream is open, its answer never comes
    from ftagent.arbiter.fr_verdict import summary_of
    from ftagent.arbiter.policy import PolicyConfig, decide_stacks, stack_signature
    from ftagent.arbiter.state import HangProbe, JobPhase, JobState, RankState

    s = recorded("behind")
    j = JobState(job="j", world_size=2, max_restarts=3, phase=JobPhase.RUNNING)
    j.hang_probe = HangProbe(fault_id="f", rank=0, deadline=1e9)
    sj = json.dumps({**WAITING, "flight_recorder": {"summaries": [s[0]]}})
    j.ranks[0] = RankState(rank=0, connected=True, step=10, stack=stack_signature(sj),
                           fr=summary_of(sj, 0))
    j.ranks[1] = RankState(rank=1, connected=True, step=10)
    cfg = PolicyConfig(max_restarts=3)
    assert decide_stacks(j, 0.0, cfg) == []  # rank 1 may still answer
    (d,) = decide_stacks(j, 0.0, cfg, force=True)
    assert d.rank == 1 and "flight recorder: rank 1 sent nothing (dead, or its pod " \
        "unresponsive) while rank 0 waits in collective #4 (all_reduce)" in d.reason, d.reason


def test_no_rank_with_a_dump_leaves_the_verdict_to_the_stacks() -> None:
    # torch without a recorder: every agent answers with no dump; silence names no one
    answers = {r: json.dumps({**WAITING, "flight_recorder": {"summaries": []}})
               for r in range(2)}
    assert "flight recorder" not in _job_hang_with(answers).reason
    v = decide({0: {}, 1: {}}, world=2)
    assert v.kind == "unresponsive" and "waits in" not in v.reason


def test_a_rank_waiting_in_a_collective_is_never_the_culprit_of_others_progressing() -> None:
    # rank 0 waits inside the all-reduce for rank 1 (SIGSTOPped just after its last
    # summary, so its last step looks fresher): collect stacks, do not blame rank 0
    from ftagent.arbiter.policy import FaultReport, PolicyConfig, decide_fault
    from ftagent.arbiter.state import JobPhase, JobState, RankState, Verdict
    from ftagent.model import Fault, FaultKind, Severity

    now = 1000.0
    j = JobState(job="j", world_size=2, max_restarts=3, phase=JobPhase.RUNNING)
    j.ranks[0] = RankState(rank=0, connected=True, step=10, last_step_at=now - 4.2)
    j.ranks[1] = RankState(rank=1, connected=True, step=10, last_step_at=now - 0.5)
    # (main's agents send this as a WARNING suspicion, decided by _hang as here)
    waits = Fault(FaultKind.HANG, "waiting in a collective", severity=Severity.ERROR,
                  evidence={"waiting_in_collective": True})
    (d,) = decide_fault(j, FaultReport(waits, 0, 0), now, PolicyConfig(max_restarts=3))
    assert d.verdict is Verdict.DUMP_STACKS, d.reason
    plain = Fault(FaultKind.HANG, "no step progress")  # no such evidence: as before
    (d,) = decide_fault(j, FaultReport(plain, 0, 0), now, PolicyConfig(max_restarts=3))
    assert d.verdict is Verdict.RESTART and d.rank == 0 and "other ranks progress" in d.reason
