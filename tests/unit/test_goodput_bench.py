"""bench/goodput.py's measurement from the outside: pure functions over stamped log lines,
the arbiter's ledger block and its timeline (the bench itself needs root and runs for
minutes; these pin what it computes)."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import goodput as gb  # noqa: E402


def step(t: float, rank: int, n: int, seconds: float) -> str:
    return (f"{t:.3f} [rank{rank}] step={n}/100000000 loss=0.1 "
            f"samples_per_second={gb.BATCH / seconds:.1f}")


class Logs:
    """The part of tests.lab.Lab that the measurement reads: each rank's stamped output."""

    def __init__(self, lines: list[str]) -> None:
        self.text = "\n".join(lines) + "\n"

    def log(self, r: int) -> str:
        return self.text if r == 0 else ""


def test_kept_seconds_count_each_steps_last_run_and_slow_steps_in_full() -> None:
    # steps 1-6 at 0.1 s; a restart from step 4 (5 and 6 are redone, 0.2 s each); step 8
    # is slow (load, 1.0 s): time spent training, not a fault's cost
    first = [(10.0 + 0.1 * i, i, 0.1) for i in range(1, 7)]
    again = [(20.2, 5, 0.2), (20.4, 6, 0.2), (20.5, 7, 0.1), (21.5, 8, 1.0), (21.6, 9, 0.1)]
    kept = gb.kept_printed_seconds(first + again, [])
    # steps 2-4 of the first run, 5-9 of the second (step 1 opens the window)
    assert kept == pytest.approx(0.3 + 0.2 + 0.2 + 0.1 + 1.0 + 0.1)
    run = gb.Run("x", start=10.1, end=21.6, kept=8, kept_seconds=kept,
                 step_seconds=0.1)
    assert run.goodput == pytest.approx(1.9 / 11.5)
    # the median-based figure counts the slow step as 0.1 s, and the redone steps at the
    # median too: on a loaded machine it is lower for reasons no launcher controls
    assert run.goodput_median == pytest.approx(0.8 / 11.5)


def test_a_kept_step_spanning_the_link_outage_counts_only_outside_it() -> None:
    steps = [(1.0, 1, 0.1), (1.1, 2, 0.1), (14.0, 3, 12.9), (14.1, 4, 0.1)]
    # the link was down 2.0 -> 12.0: 10 s of step 3 made no progress
    assert gb.kept_printed_seconds(steps, [(2.0, 12.0)]) == pytest.approx(0.1 + 2.9 + 0.1)
    assert gb.kept_printed_seconds(steps, []) == pytest.approx(0.1 + 12.9 + 0.1)


def started(t: float, from_step: int) -> str:
    return f"{t:.3f} [rank0] started: world=2 attempt=1 steps=100000000 from_step={from_step}"


def test_kept_time_is_wall_clock_even_where_printed_durations_add_up_to_more() -> None:
    """Issue 24: a step line every 0.1 s whose trainer prints 0.12 s per step (its own
    timing, on a loaded machine): the printed durations add up to more than the wall time
    there was; the stamps' gaps cannot. The first line opens the window."""
    lines = [step(10.0 + 0.1 * i, 0, i, 0.12) for i in range(0, 101)]  # 10.0 .. 20.0
    steps = gb.steps(Logs(lines))
    assert gb.kept_printed_seconds(steps, []) == pytest.approx(12.0, rel=1e-3)  # 12 s in 10
    assert gb.kept_wall_seconds(lines, [], 10.0, 20.0) == pytest.approx(10.0)
    # a window shorter than the lines: never more than the window
    assert gb.kept_wall_seconds(lines, [], 10.0, 15.0) == pytest.approx(5.0)
    # rank 1's lines and other output are not rank 0's steps
    assert gb.kept_wall_seconds([*lines, step(25.0, 1, 200, 0.1), "25.1 [agent] x"], [],
                                10.0, 30.0) == pytest.approx(10.0)


def test_kept_wall_time_after_a_restart_counts_each_steps_last_run() -> None:
    """Steps 1-6 every 0.1 s; a crash; the next attempt starts at 15.0 from the checkpoint
    at step 4 and prints its first step (5, 0.2 s by its own timing) at 17.0 after 2 s of
    start-up: 5 and 6 of the first attempt were redone, the start-up is not training."""
    first = [step(10.0 + 0.1 * i, 0, i, 0.1) for i in range(1, 7)]  # 10.1 .. 10.6
    again = [started(15.0, 4), step(17.0, 0, 5, 0.2), step(17.1, 0, 6, 0.1),
             step(17.3, 0, 7, 0.1), step(18.3, 0, 8, 0.1)]  # 8: slow (load), 1.0 s of wall
    kept = gb.kept_wall_seconds(first + again, [], 10.1, 18.3)
    # steps 2-4 of the first attempt (0.3 s), then 0.2 (its printed time) + 0.1 + 0.2 + 1.0
    assert kept == pytest.approx(0.3 + 0.2 + 0.1 + 0.2 + 1.0)
    # a first step whose printed time exceeds its attempt's age: the wall clock caps it
    late = [*first[:4], started(15.0, 4), step(15.1, 0, 5, 3.0)]
    assert gb.kept_wall_seconds(late, [], 10.1, 15.1) == pytest.approx(0.3 + 0.1)


def test_kept_wall_time_leaves_out_the_link_outage_and_batching_changes_nothing() -> None:
    """A step whose gap spans the link's outage (2.0 -> 12.0) counts only the part outside
    it; lines that reach the bench in batches (one stamp for several lines) add up to the
    same."""
    lines = [step(1.0, 0, 1, 0.1), step(1.1, 0, 2, 0.1), step(14.0, 0, 3, 0.1),
             step(14.1, 0, 4, 0.1)]
    assert gb.kept_wall_seconds(lines, [(2.0, 12.0)], 1.0, 14.1) == pytest.approx(
        0.1 + 2.9 + 0.1)
    each = [step(1.0 + 0.1 * i, 0, i, 0.1) for i in range(0, 51)]  # 1.0 .. 6.0
    batched = [step(1.0 + 0.5 * (i // 5 + (i % 5 > 0)), 0, i, 0.1) for i in range(0, 51)]
    assert gb.kept_wall_seconds(batched, [], 1.0, 6.0) == pytest.approx(
        gb.kept_wall_seconds(each, [], 1.0, 6.0)) == pytest.approx(5.0)


def test_lost_steps_come_from_the_furthest_step_before_the_restart() -> None:
    """Output reaches the bench in batches (ftagent's --output-interval): at the injection
    the last line seen was step 3 while the trainer was at step 10; the restart resumed
    from the checkpoint at step 8, so 2 steps were lost, not 0."""
    lines = [step(100.0, 0, n, 0.05) for n in (1, 2, 3)]
    lines += [step(100.5, 0, n, 0.05) for n in range(4, 11)]
    lines += ["105.000 [rank0] started: world=2 attempt=1 steps=100000000 from_step=8",
              step(106.0, 0, 9, 0.05), step(106.1, 0, 10, 0.05)]
    f = gb.Fault("crash", at=100.2, before=3)
    assert gb.training_again(Logs(lines), f)
    assert (f.back, f.resumed, f.before, f.lost) == (106.0, 8, 10, 2)


def test_training_again_waits_for_a_step_of_the_new_attempt() -> None:
    lines = [step(100.0, 0, n, 0.05) for n in (1, 2, 3)]
    lines.append("105.000 [rank0] started: world=2 attempt=1 steps=100000000 from_step=0")
    f = gb.Fault("crash", at=100.2, before=3)
    assert not gb.training_again(Logs(lines), f)
    assert f.back is None


def test_ledger_row_is_the_same_window_as_the_outside_measurement() -> None:
    run = gb.Run("ftagent")
    run.ledger = {"wall_seconds": 620.0, "ratio": 0.77,
                  "seconds": {"startup": 20.0, "productive": 480.0, "decision": 50.0,
                              "restart": 70.0}}
    row = gb.ledger_row(run)
    assert row is not None
    whole, window, secs = row
    assert whole == pytest.approx(480 / 620)
    assert window == pytest.approx(480 / 600)  # the startup is before the first step
    assert secs["restart"] == 70.0
    run.ledger = {"error": "ftagent status failed"}
    assert gb.ledger_row(run) is None


def test_phases_come_from_the_arbiters_timeline() -> None:
    timeline = [
        {"ts": 9.0, "kind": "barrier", "action": "release_barrier", "message": "gen 0"},
        {"ts": 20.2, "kind": "fault", "action": "", "message": "crash (error ...)"},
        {"ts": 20.2, "kind": "decision", "action": "restart", "message": "..."},
        {"ts": 25.1, "kind": "barrier", "action": "release_barrier", "message": "gen 1"},
        {"ts": 72.8, "kind": "decision", "action": "dump_stacks", "message": "..."},
        {"ts": 74.9, "kind": "decision", "action": "restart", "message": "..."},
        {"ts": 82.4, "kind": "barrier", "action": "release_barrier", "message": "gen 2"},
    ]
    crash, hang = gb.Fault("crash", at=20.0, before=0), gb.Fault("hang", at=67.4, before=0)
    gb.phases(timeline, [crash, hang])
    assert (crash.decided, crash.released) == (20.2, 25.1)
    assert (hang.decided, hang.released) == (74.9, 82.4)  # a stack probe is no decision


def test_the_random_schedule_puts_one_fault_in_each_slot_the_same_for_every_launcher() -> None:
    import random
    a = gb.fault_times(3, 600, 20, 60, random.Random(7))
    assert a == gb.fault_times(3, 600, 20, 60, random.Random(7))  # same draws: same faults
    span = (600 - 60 - 20) / 3
    for j, t in enumerate(a):
        assert 20 + j * span <= t < 20 + (j + 1) * span
    assert a != gb.fault_times(3, 600, 20, 60, random.Random(8))
    # a 5-minute disk interval at 65 ms a step; a step time of 0 is refused, not divided by
    assert gb.disk_interval_steps(300, 0.065) == 4615
    assert gb.disk_interval_steps(300, 0.0) == 1


def test_redone_work_is_each_faults_steps_since_the_resumed_step() -> None:
    fs = [gb.Fault("crash", 0.0, 130, back=5.0, resumed=120),
          gb.Fault("hang", 10.0, 4700, back=20.0, resumed=4690),
          gb.Fault("xid", 30.0, 9000, back=None)]  # never back: not counted
    r = gb.redone(fs, 0.1, 4615)
    assert [f["lost_steps"] for f in r["faults"]] == [10, 10]
    assert [f["since_disk_checkpoint"] for f in r["faults"]] == [130, 85]
    assert r["mean_steps"] == 10 and r["max_steps"] == 10
    assert r["mean_seconds"] == pytest.approx(1.0)
    assert gb.redone([], 0.1, 10)["max_steps"] is None


def test_a_step_line_with_an_agents_line_run_into_it_still_parses() -> None:
    # the trainer and its agent share the output: an agent's line can follow a step line
    # without a newline between them (a ten-minute run with replicas died of it: float()
    # of "70.2[ftagent")
    lines = [step(100.0, 0, 1, 0.1),
             "100.200 [rank0] step=2/100000000 loss=0.1 samples_per_second=70.2[ftagent "
             "rank0 06:18:45] INFO replicated rank 0's snapshot of step 2 in 0.01s"]
    assert [(s, round(dt, 3)) for _, s, dt in gb.steps(Logs(lines))] == \
        [(1, 0.1), (2, round(gb.BATCH / 70.2, 3))]
