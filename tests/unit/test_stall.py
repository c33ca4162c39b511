"""The stall policy's table (detect/stall.py): one parametrized case per row, the module's
purity, and the verdict's wire form (untrusted input becomes ``undecided``)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ftagent.detect import stall
from ftagent.detect.stall import Act, Blocked, Budget, Peers, State, Verdict, Window, decide

STEP = Budget(stalled_for=4.0, step_budget=3.0, rank=3)
PHASE = Budget(stalled_for=70.0, step_budget=3.0, phase="checkpoint", rank=3)
STILL = Window(motion="hung", motion_reason="every thread parked", where="open (save.py:9)",
               seconds=2.0, moved=False, cpu_seconds=0.0, io_bytes=0, all_blocked=True)
DEAD = Window(motion="hung", motion_reason="every thread parked", where="open (save.py:9)",
              seconds=61.0, moved=False, cpu_seconds=0.0, io_bytes=0, all_blocked=True)
COLL = Window(motion="hung", where="all_reduce (distributed_c10d.py:2)", in_collective=True,
              seconds=2.0, moved=False)
SOCK = Blocked(pid=10, tid=10, syscall="recvfrom", kind="remote", target="tcp 127.0.0.9:9000")
NFS = Blocked(pid=11, tid=11, syscall="read", kind="netfs", target="/mnt/nfs/shard-3")
PIPE = Blocked(pid=11, tid=11, syscall="read", kind="pipe", target="pipe:[77]")


def b(**kw: object) -> Budget:
    return Budget(**{**STEP.__dict__, **kw})


def w(base: Window = STILL, **kw: object) -> Window:
    return Window(**{**base.__dict__, **kw})


CASES = [
    # row, budget, window, peers, phase_check, state, act
    ("U1", STEP, w(errors=("/proc/7/task vanished mid-read",)), None, False,
     State.UNDECIDED, Act.RECHECK),
    ("U1", STEP, w(errors=("flight-recorder dump of generation 2, job is at 3",)), None,
     False, State.UNDECIDED, Act.RECHECK),
    ("U2", b(stalled_for=2000.0), w(errors=("stacks contradict /proc",)), None, False,
     State.HUNG, Act.DECLARE),
    ("F1", STEP, w(stopped=("pid 7 (state T, wchan do_signal_stop)",)), None, False,
     State.FROZEN, Act.DECLARE),
    ("F1", PHASE, w(stopped=("pid 7 (state t)",)), None, True, State.FROZEN, Act.DECLARE),
    ("F2", STEP, w(uninterruptible=("pid 7 (state D, wchan rwsem_down)",)), None, False,
     State.FROZEN, Act.DECLARE),
    ("P1", STEP, COLL, Peers(busy_rank=1, busy_in="save (ckpt.py:4)", arbiter=True), False,
     State.WAITING_ON_PEER, Act.RECHECK),
    ("I1", STEP, w(blocked=(SOCK,)), None, False, State.WAITING_ON_IO, Act.RECHECK),
    ("I1", STEP, w(blocked=(NFS,)), None, False, State.WAITING_ON_IO, Act.RECHECK),
    ("I2", b(stalled_for=400.0), w(blocked=(SOCK,)), None, False, State.HUNG, Act.DECLARE),
    ("I3", b(last_io=(SOCK,), last_where="read_shard (data.py:3)"), STILL, None, False,
     State.WAITING_ON_IO, Act.RECHECK),
    ("D1", PHASE, DEAD, None, True, State.DEAD_STILL, Act.DECLARE),
    ("D1", b(stalled_for=70.0, first_step=True), DEAD, None, True, State.DEAD_STILL,
     Act.DECLARE),
    ("D2", PHASE, w(DEAD, cpu_seconds=5.0), None, True, State.UNDECIDED, Act.NONE),
    ("D2", PHASE, w(DEAD, motion="alive", moved=True), None, True, State.PROGRESSING,
     Act.NONE),
    ("A1", STEP, w(motion="alive", moved=True), None, False, State.PROGRESSING, Act.RECHECK),
    ("A2", STEP, w(motion="alive", by_io=True), None, False, State.BUSY, Act.RECHECK),
    ("A3", b(stalled_for=2000.0), w(motion="alive", by_io=True), None, False, State.HUNG,
     Act.DECLARE),
    ("S1", STEP, w(motion="spinning"), None, False, State.SPINNING, Act.RECHECK),
    ("S2", b(stalled_for=200.0), w(motion="spinning"), None, False, State.HUNG, Act.DECLARE),
    ("C1", STEP, COLL, Peers(arbiter=True), False, State.WAITING_ON_PEER, Act.ASK),
    ("C2", STEP, COLL, Peers(arbiter=True, asked_for=3.0), False, State.WAITING_ON_PEER,
     Act.RECHECK),
    ("H1", STEP, STILL, None, False, State.HUNG, Act.DECLARE),
    ("H1", STEP, COLL, Peers(arbiter=True, asked_for=30.0), False, State.HUNG, Act.DECLARE),
    ("H1", STEP, w(blocked=(PIPE,)), None, False, State.HUNG, Act.DECLARE),
    ("H2", STEP, w(motion="unknown", moved=None), None, False, State.HUNG, Act.DECLARE),
]


@pytest.mark.parametrize(("row", "budget", "window", "peers", "phase_check", "state", "act"),
                         CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_row_of_the_table(row: str, budget: Budget, window: Window, peers: Peers | None,
                               phase_check: bool, state: State, act: Act) -> None:
    v = decide(budget, window, peers, phase_check=phase_check)
    assert (v.rule, v.state, v.act) == (row, state, act), v.reason
    assert v.reason
    if v.hung:
        assert v.culprits == (3,)  # this rank, as a structured field
    else:
        assert v.culprits == ()
    assert Verdict.from_json(json.loads(json.dumps(v.to_json()))) == v


def test_every_row_has_a_case_and_a_line_in_the_docs() -> None:
    assert {c[0] for c in CASES} == set(stall.ROWS)
    doc = stall.__doc__ or ""
    page = (Path(__file__).resolve().parents[2] / "docs" / "hangs.md").read_text()
    for row in stall.ROWS:
        assert f"\n{row}  " in doc, row
        assert f"| {row} " in page, row


def test_the_arbiters_rows_have_a_line_in_the_docs_and_a_test() -> None:
    doc = stall.__doc__ or ""
    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "hangs.md").read_text()
    tests = (root / "tests" / "unit" / "test_fr_verdict.py").read_text()
    for row in stall.FR_ROWS:
        assert f"\n{row}  " in doc and f"| {row} " in page, row
        assert f'"{stall.FR_KINDS[row]}"' in tests, row


def test_one_verdict_type() -> None:
    """The agent's policy and the arbiter's flight-recorder rows return the same class;
    the motion judge returns evidence (``Motion``), no verdict of its own (issue 35)."""
    from ftagent.arbiter import fr_verdict
    from ftagent.detect import liveness

    assert fr_verdict.Verdict is Verdict
    assert isinstance(fr_verdict.decide({}), Verdict)
    assert not hasattr(liveness, "Verdict")
    v = fr_verdict.decide({0: {"groups": [{"name": "0", "enqueued": 4, "completed": 3}]},
                           1: {"groups": [{"name": "0", "enqueued": 3, "completed": 3}]}})
    assert (v.state, v.act, v.rule, v.kind, v.culprits) == (
        State.HUNG, Act.DECLARE, "R2", "behind", (1,))
    assert Verdict.from_json(v.to_json()).culprits == (1,)


def test_the_verdict_names_what_matters() -> None:
    io = decide(STEP, w(blocked=(SOCK,)))
    assert io.budget_flag == "--hang-io-timeout" and "127.0.0.9:9000" in io.reason
    peer = decide(STEP, COLL, Peers(busy_rank=1, busy_in="save (ckpt.py:4)"))
    assert peer.waiting_on == 1 and "waiting on rank 1 (busy in save" in peer.reason
    dead = decide(PHASE, DEAD, phase_check=True)
    assert "open (save.py:9)" in dead.reason and "checkpoint" in dead.reason
    frozen = decide(STEP, w(stopped=("pid 7 (state T)",)))
    assert frozen.kill and "pid 7" in frozen.reason


def test_a_pipe_nothing_writes_is_not_io_and_a_worker_still_working_is_not_waiting() -> None:
    assert decide(STEP, w(blocked=(PIPE,))).state is State.HUNG
    v = decide(STEP, w(motion="alive", moved=True, blocked=(SOCK,), working_threads=1))
    assert v.state is State.PROGRESSING


def test_the_look_after_a_read_ended_is_granted_once_and_only_then() -> None:
    """Row I3 (the rule verify.py's ``_io_grace`` held before issue 35's item 1): the read
    the last I1 verdict saw ended inside this window -- one more look; not when the thread
    is still where it was, nor past --hang-io-timeout, nor without a previous I1."""
    after = b(last_io=(SOCK,), last_where="read_shard (data.py:3)")
    assert decide(after, STILL).rule == "I3"
    assert decide(b(last_io=(SOCK,), last_where=STILL.where), STILL).rule == "H1"
    assert decide(b(last_io=(SOCK,), last_where="x", stalled_for=400.0), STILL).rule == "H1"
    assert decide(STEP, STILL).rule == "H1"
    assert decide(after, w(motion="alive", moved=True)).rule == "A1"


def test_the_next_look_comes_from_the_policy() -> None:
    assert decide(b(recheck_every=5.0), w(motion="alive", moved=True)).recheck_in == 5.0
    spin = decide(b(recheck_every=5.0, stalled_for=118.0), w(motion="spinning"))
    assert spin.recheck_in == 2.0  # the spin budget (120 s) comes first
    io = decide(b(recheck_every=5.0), w(blocked=(SOCK,)))
    assert io.recheck_in == 3.0  # a budgeted wait: every step budget


def test_a_fault_message_has_one_form_per_row() -> None:
    hung = decide(STEP, STILL)
    assert stall.fault_message(hung, "no progress for 4.0s") == \
        f"no progress for 4.0s; {hung.reason}"
    spin = decide(b(stalled_for=200.0), w(motion="spinning"))
    assert stall.fault_message(spin, "no progress").startswith("spinning in open (save.py:9)")
    io = decide(STEP, w(blocked=(SOCK,)))
    assert stall.peer_state(io, "hung") == "alive" and stall.peer_state(hung, "hung") == "hung"
    assert stall.label(spin, "spinning") == "spinning" and stall.label(io, "hung") == \
        "waiting_on_io"


def test_a_sign_of_life_keeps_the_phase_budget() -> None:
    for alive in (w(DEAD, cpu_seconds=3.0), w(DEAD, io_bytes=4096), w(DEAD, moved=True),
                  w(DEAD, all_blocked=False), w(DEAD, seconds=30.0),
                  w(DEAD, in_collective=True), w(DEAD, waits_on_peer=True),
                  w(DEAD, timed_wait=True)):
        assert decide(PHASE, alive, phase_check=True).act is Act.NONE


@pytest.mark.parametrize("bad", [
    None, [], {"state": "exploded"}, {"state": "hung", "culprits": "all"},
    {"state": "hung", "culprits": [True]}, {"state": "hung", "culprits": list(range(100))},
    {"state": "hung", "culprits": [-1]}, {"state": "waiting_on_peer", "waiting_on": "0"},
])
def test_a_verdict_from_a_peer_that_does_not_parse_is_undecided(bad: object) -> None:
    v = Verdict.from_json(bad)
    assert v.state is State.UNDECIDED and v.act is Act.RECHECK and v.missing


def test_a_peers_verdict_is_bounded() -> None:
    v = Verdict.from_json({"state": "hung", "act": "declare", "reason": "x" * 10_000,
                           "where": "y" * 10_000, "budget_seconds": float("nan"),
                           "missing": ["z"] * 1000})
    assert len(v.reason) <= 300 and v.where is not None and len(v.where) <= 300
    assert v.budget_seconds is None and len(v.missing) <= 8


def test_the_policy_is_pure() -> None:
    tree = ast.parse(Path(stall.__file__).read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
            for a in n.names}
    mods |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom)}
    assert mods <= {"__future__", "enum", "dataclasses", "typing"}, mods


@pytest.mark.parametrize(("row", "budget", "window", "peers", "phase_check", "state", "act"),
                         [c for c in CASES if not c[4]],
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES) if not c[4]])
def test_one_ruling_names_the_verdict_as_the_four_questions_did(
        row: str, budget: Budget, window: Window, peers: Peers | None, phase_check: bool,
        state: State, act: Act) -> None:
    """``ruling_of`` is ``decide`` with the verdict's label, fault message and json: the
    verifier's one question instead of four about the same verdict."""
    got = stall.ruling_of(budget, window, peers, budget_message="no step for 4.0s")
    v = decide(budget, window, peers)
    assert got.verdict == v and got.verdict.rule == row
    assert got.label == stall.label(v, window.motion)
    assert got.message == stall.fault_message(v, "no step for 4.0s")
    assert got.json == v.to_json()
