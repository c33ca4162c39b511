"""wire/: what one side sends, the other accepts; what no agent sends is refused (pure)."""

from __future__ import annotations

import json
import math

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftagent.agent.link_protocol import LinkProtocol
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.timeline import Timeline
from ftagent.config import IdentityConfig
from ftagent.model import Fault, FaultKind, Progress
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import limits
from ftagent.wire.checks import Refused, check_fault, check_hello, progress_in_range
from ftagent.wire.convert import evidence_json, fault_to_proto, progress_to_proto


def hello(**kw: object) -> pb.Hello:
    base: dict[str, object] = {"job": "j", "rank": 0, "world_size": 2, "agent_instance": "a"}
    return pb.Hello(**{**base, **kw})


@pytest.mark.parametrize("bad", [
    {"generation": 2**63 - 1}, {"generation": -1}, {"restart_count": -3},
    {"max_restarts": -1}, {"released_generation": 2**40}, {"job": "x" * 300},
    {"job": "a\nb"}, {"pod": "\x00"}, {"rank": 2}, {"rank": -1}, {"world_size": 0},
    {"world_size": 2_000_000}, {"job": ""}, {"agent_instance": "i" * 500},
    {"gpus": [f"GPU-{i}" for i in range(65)]}, {"gpus": ["GPU-" + "f" * 100]},
    {"gpus": ["GPU-1\x00"]},
])
def test_hellos_no_agent_sends_are_refused_with_the_field_named(bad: dict[str, object]) -> None:
    with pytest.raises(Refused) as e:
        check_hello(hello(**bad))
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    named = next(iter(bad))
    assert named.split("_")[0] in str(e.value) or "rank" in str(e.value) or "job" in str(
        e.value)


def test_the_pods_gpus_go_in_the_hello_and_are_accepted() -> None:
    gpus = ("GPU-00000000-0000-4000-8000-000000000001", "3")
    h = LinkProtocol(IdentityConfig(job="j", rank=0, world_size=1, gpus=gpus)).hello()
    assert tuple(h.gpus) == gpus
    check_hello(h)
    reg = Registry(PolicyConfig(), Timeline(), None, "arb")
    reg.hello(Connection("p"), h)
    assert reg.jobs[("", "j")].ranks[0].gpus == gpus


def test_a_huge_generation_never_becomes_state_and_the_listing_still_works() -> None:
    reg = Registry(PolicyConfig(), Timeline(), None, "a")
    reg.hello(Connection(), hello(job="ok"))
    with pytest.raises(Refused):
        reg.hello(Connection(), hello(job="victim", generation=2**63 - 1))
    assert [j.job for j in reg.jobs.values()] == ["ok"]
    info = reg.job_info(reg.jobs[("", "ok")], ranks=True)
    assert info.SerializeToString()  # no "Value out of range" anywhere


@settings(max_examples=200, deadline=None)
@given(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
       st.floats(allow_nan=True, allow_infinity=True) | st.none(),
       st.floats(allow_nan=True, allow_infinity=True) | st.none())
def test_any_progress_the_agent_has_is_sendable_and_accepted(
        step: int, since: float, rate: float | None, loss: float | None) -> None:
    m = progress_to_proto(Progress(step=step, loss=loss, samples_per_second=rate,
                                   tokens_per_second=rate), since, False, 0.0)
    m = pb.ProgressSummary.FromString(m.SerializeToString())
    assert progress_in_range(m)
    assert m.step == min(max(step, -1), limits.MAX_STEP)
    if loss is not None and math.isnan(loss):
        assert math.isnan(m.loss)  # a NaN loss is news, it travels


def test_a_fault_with_huge_evidence_is_shrunk_to_fit_not_refused() -> None:
    stacks = [{"pid": i, "frames": ["f" * 200] * 50} for i in range(100)]  # ~1 MB
    f = Fault(FaultKind.HANG, "m" * 10_000, evidence={"processes": stacks, "last_step": 7})
    m = fault_to_proto(f, 2**40, exit_status=2**40)
    check_fault(m)
    ev = json.loads(m.evidence_json)
    assert ev["last_step"] == 7 and ev["processes"]["truncated"] is True
    assert len(m.message) == limits.MAX_MESSAGE and m.generation == limits.MAX_GENERATION
    assert not m.HasField("exit_status")


def test_evidence_within_the_limit_is_untouched() -> None:
    ev = {"exit_status": 3, "last_lines": ["a", "b"]}
    assert json.loads(evidence_json(ev)) == ev
