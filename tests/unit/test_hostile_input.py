"""What one peer sends cannot stall the arbiter or lock other agents out (issue 20).

Each test reproduces a finding against the real Registry and policy (no server: the
registry is what the server runs for every message on its event loop).
"""

from __future__ import annotations

import json
import time

import grpc
import pytest

from ftagent.arbiter import policy
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.state import HangProbe
from ftagent.arbiter.timeline import Timeline
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import limits
from ftagent.wire.checks import Refused, check_message

# 36 KB of whitespace lines in py-spy text: the message that froze the arbiter 2.4-4.4 s
WHITESPACE_STACKS = json.dumps({"processes": [{"pid": 1, "stack": " \n" * 18_000}]})


def hello(rank: int, generation: int = 0, **kw: object) -> pb.Hello:
    base: dict[str, object] = {"job": "j", "rank": rank, "world_size": 2,
                               "agent_instance": f"a{rank}", "generation": generation}
    return pb.Hello(**{**base, **kw})


def two_ranks(clock: list[float]) -> tuple[Registry, list[Connection]]:
    reg = Registry(PolicyConfig(max_restarts=5), Timeline(), None, "arb",
                   clock=lambda: clock[0])
    conns = [Connection(f"p{r}") for r in range(2)]
    for r, c in enumerate(conns):
        reg.hello(c, hello(r))
    return reg, conns


def test_a_stack_signature_of_whitespace_lines_is_linear() -> None:
    """Today's pattern ran ``\\s+`` across lines: 36 KB took seconds (7 s on this
    machine), 100 times more than the bound; a linear parser takes milliseconds."""
    t0 = time.perf_counter()
    sig = policy.stack_signature(WHITESPACE_STACKS)
    took = time.perf_counter() - t0
    assert sig.startswith(policy.NO_STACK)
    assert took < 0.25, f"36 KB of whitespace lines took {took:.2f}s"


def test_py_spy_text_frames_are_still_read() -> None:
    text = ("Thread 12 (idle): \"MainThread\"\n"
            "    wait (torch/distributed/distributed_c10d.py:3000)\n"
            "    all_reduce (torch/distributed/distributed_c10d.py:2500)\n"
            "    step (/app/train.py:42)\n")
    sig = policy.stack_signature(json.dumps({"processes": [{"stack": text}]}))
    assert sig == ("wait (distributed_c10d.py:3000) < all_reduce (distributed_c10d.py:2500)"
                   " < step (train.py:42)")


def test_unsolicited_stacks_are_dropped_before_they_are_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    reg, conns = two_ranks(clock)
    parsed: list[str] = []

    def parse(stacks_json: str, frames_per_thread: int = 4) -> str:
        parsed.append(stacks_json)
        return "x"

    monkeypatch.setattr(policy, "stack_signature", parse)
    before = len(reg.timeline.entries("j", ""))
    reg.handle(conns[0], pb.AgentMessage(stacks=pb.Stacks(command_id="c",
                                                          json=WHITESPACE_STACKS)), 0.0)
    assert parsed == []
    assert reg.jobs[("", "j")].ranks[0].stack is None
    assert len(reg.timeline.entries("j", "")) == before  # not even a timeline entry


def test_oversized_stacks_count_as_a_capture_without_frames() -> None:
    clock = [1000.0]
    reg, conns = two_ranks(clock)
    job = reg.jobs[("", "j")]
    job.hang_probe = HangProbe("f", 0, clock[0] + 15, command_id="c")  # stacks asked for
    huge = json.dumps({"stack": "x" * (policy.MAX_STACKS + 1)})
    reg.handle(conns[0], pb.AgentMessage(stacks=pb.Stacks(command_id="c", json=huge)), 0.0)
    assert job.ranks[0].stack is not None
    assert job.ranks[0].stack.startswith(policy.NO_STACK)
    # a second answer of the same rank in the same probe is unsolicited
    reg.handle(conns[0], pb.AgentMessage(stacks=pb.Stacks(command_id="c", json="[]")), 0.0)
    assert "over" in job.ranks[0].stack


def test_a_hello_at_the_generation_ceiling_cannot_lock_the_real_agents_out() -> None:
    """A job token's Hello at generation 2**31-1 raised the job to the ceiling; the next
    restart commanded 2**31, and every real agent's arrival and re-Hello at that
    generation was then out of range: the job was locked out. Either the claim is refused,
    or the job keeps room for what the arbiter does next."""
    clock = [1000.0]
    reg = Registry(PolicyConfig(max_restarts=5), Timeline(), None, "arb",
                   clock=lambda: clock[0])
    real = Connection("real")
    reg.hello(real, hello(0))
    try:
        reg.hello(Connection("attacker"), hello(1, generation=2**31 - 1))
    except Refused as e:
        assert e.code is grpc.StatusCode.INVALID_ARGUMENT
        assert str(limits.MAX_CLAIMED_GENERATION) in str(e)
    job = reg.jobs[("", "j")]
    reg.handle(real, pb.AgentMessage(fault=pb.Fault(
        id="crash-1", kind=pb.FAULT_KIND_CRASH, severity=pb.SEVERITY_ERROR,
        generation=job.generation, message="exit 1")), 0.0)
    g = job.generation
    arrival = pb.AgentMessage(arrival=pb.BarrierArrival(generation=g))
    check_message(arrival)  # the server's edge check of the real agent's arrival
    reg.handle(real, arrival, 0.0)
    assert job.ranks[0].generation == g
    reg.disconnect(real)
    reg.hello(Connection("real-again"), hello(0, generation=g))  # its reconnect


def test_a_claim_up_to_the_peer_limit_is_adopted_and_leaves_headroom() -> None:
    clock = [1000.0]
    reg = Registry(PolicyConfig(max_restarts=5), Timeline(), None, "arb",
                   clock=lambda: clock[0])
    reg.hello(Connection("a"), hello(0, generation=limits.MAX_CLAIMED_GENERATION))
    c = Connection("b")
    reg.hello(c, hello(1, generation=limits.MAX_CLAIMED_GENERATION))
    job = reg.jobs[("", "j")]
    assert job.generation == limits.MAX_CLAIMED_GENERATION
    with pytest.raises(Refused):
        reg.hello(Connection("c"), hello(1, generation=limits.MAX_CLAIMED_GENERATION + 1,
                                         agent_instance="other"))
    assert limits.MAX_GENERATION - job.generation >= 2**30


ESCAPES = "rank 3 \x1b[2J\x1b[31mall good\x1b[0m\r\nrank 0: \u202eok\x07"


def test_terminal_escapes_in_a_fault_reach_no_timeline_status_or_log(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 20: a fault message carried ESC sequences into ``ftagent status`` and the
    arbiter's log (clear the screen, forge a line, reverse the text)."""
    from ftagent.arbiter import status_view
    from ftagent.arbiter.convert import entry_to_proto

    clock = [1000.0]
    reg, conns = two_ranks(clock)
    with caplog.at_level("INFO", logger="ftagent.arbiter.timeline"):
        reg.handle(conns[1], pb.AgentMessage(fault=pb.Fault(
            id="f1", kind=pb.FAULT_KIND_HANG, severity=pb.SEVERITY_ERROR, message=ESCAPES)), 0.0)
    shown = [status_view.format_entry(entry_to_proto(e))
             for e in reg.timeline.entries("j", "")]
    info = reg.info(reg.jobs[("", "j")], ranks=True)
    shown.append(status_view.format_job(info))
    shown.append(caplog.text)
    for text in shown:
        for bad in ("\x1b", "\r", "\u202e", "\x07"):
            assert bad not in text, (bad, text)
    assert any("\\x1b[2J" in t for t in shown[:-2])  # escaped, still readable


def test_status_escapes_what_an_arbiter_sends() -> None:
    """An arbiter of another release (or a history written before) may hold raw text."""
    from ftagent.arbiter import status_view

    e = pb.TimelineEntry(ts=1.0, generation=1, kind="fault", message=ESCAPES)
    j = pb.JobInfo(job="j\x1b]0;pwned\x07", state="running\x1b[1A", barrier="x\x1b[2K")
    j.ranks.add(rank=0, pod="p\x1b[1m", last_fault="crash\x1b[2J")
    for text in (status_view.format_entry(e), status_view.format_job(j),
                 status_view.format_jobs([j])):
        assert "\x1b" not in text and "\x07" not in text and "\r" not in text


def test_report_pages_escape_control_characters() -> None:
    from ftagent.report import esc, from_job_info

    d = from_job_info({"job": "j", "timeline": [
        {"ts": 1.0, "kind": "fault", "message": ESCAPES, "fault_id": "f"}]}, 2.0)
    assert "\x1b" not in d.faults[0].message
    assert "\x1b" not in esc("a\x1b[31mb") and "&lt;" in esc("<")


def test_printable_is_linear_and_leaves_clean_text_alone() -> None:
    clean = "rank 0: Xid 79 — GPU fell off the bus (é, 漢字)"
    assert limits.printable(clean) is clean
    took = []
    for _ in range(3):  # the best of three: a descheduled run is not the function's time
        t0 = time.perf_counter()
        out = limits.printable("\x1b" * 100_000)  # 25 times the longest fault message
        took.append(time.perf_counter() - t0)
    assert min(took) < 1.0 and out == "\\x1b" * 100_000, took


def test_listing_jobs_of_the_largest_world_costs_what_their_ranks_sent() -> None:
    """Issue 20 (found by bench/hostile.py): a Hello of a 1,000,000-rank job made every
    ListJobs build a set of a million ranks per such job for the barrier's summary: a
    flood of such Hellos held ListJobs past its 2 s deadline. The largest world a Hello
    may claim is now --max-ranks-per-job (100,000): 200 such jobs."""
    from ftagent.arbiter import barrier
    from ftagent.arbiter.registry import MAX_RANKS_PER_JOB

    clock = [1000.0]
    reg = Registry(PolicyConfig(), Timeline(), None, "arb", clock=lambda: clock[0])
    for n in range(200):
        reg.hello(Connection(), pb.Hello(job=f"big-{n}", rank=n, world_size=MAX_RANKS_PER_JOB,
                                         agent_instance=f"a{n}"))
    took = []
    for _ in range(3):  # the best of three (a descheduled run is not the listing's time)
        t0 = time.perf_counter()
        infos = [reg.info(job, ranks=False) for job in reg.listing()]
        took.append(time.perf_counter() - t0)
    assert min(took) < 0.5, took  # the old summary: ~3.5 s of set work here
    assert "waiting for rank 0, 1, 2" in infos[1].barrier and infos[1].barrier.endswith("...")
    assert barrier.first_missing(5, {0, 2}, 10) == [1, 3, 4]


def test_an_agents_stacks_answer_fits_what_the_arbiter_reads() -> None:
    """The arbiter reads at most MAX_STACKS of a Stacks message (a larger one is a capture
    without frames), so the agent clips its answer: a big tree's stacks keep the frames
    the arbiter compares, and a usual one is sent unchanged."""
    from ftagent.wire.convert import stacks_json

    thread = ("Thread 7 (idle): \"MainThread\"\n"
              "    wait (torch/distributed/distributed_c10d.py:3000)\n"
              "    step (/app/train.py:42)\n" + "    deep (/app/lib.py:1)\n" * 4000)
    big = {"processes": [{"pid": p, "stack": thread * 3} for p in range(40)],
           "liveness": {"state": "hung"}}
    assert len(json.dumps(big)) > 4 * limits.MAX_STACKS
    sent = stacks_json(big)
    assert len(sent) <= limits.MAX_STACKS
    sig = policy.stack_signature(sent)
    assert sig.startswith("live=hung :: wait (distributed_c10d.py:3000) < step (train.py:42)")
    usual = {"processes": [{"pid": 1, "stack": thread[:200]}]}
    assert stacks_json(usual) == json.dumps(usual)
    few = stacks_json({"processes": [{"stack": "x"}] * 10}, limit=60)
    got = json.loads(few)
    assert len(few) <= 60 and got["left_out"] + len(got["processes"]) == 10
