"""Faults whose evidence nests deeply (issue 33, "the rest"): on the code before, 200 such
faults got 0 acknowledgements and 200 tracebacks (json.loads' RecursionError escaped the
handler). Now each fault is decided and acknowledged, its evidence one clear error."""

from __future__ import annotations

import json

from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.timeline import Timeline
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import limits
from ftagent.wire.convert import fault_from_proto


def _acks(conn: Connection) -> list[pb.FaultAck]:
    out = []
    while not conn.outbox.empty():
        item = conn.outbox.get_nowait()
        if isinstance(item, tuple):
            m = pb.ArbiterMessage.FromString(item[0])
            if m.WhichOneof("body") == "fault_ack":
                out.append(m.fault_ack)
    return out


def test_two_hundred_deeply_nested_faults_are_each_acknowledged() -> None:
    reg = Registry(PolicyConfig(max_restarts=1000), Timeline(), None, "arb")
    conn = Connection("peer")
    reg.hello(conn, pb.Hello(job="j", namespace="ns", rank=0, world_size=1,
                             agent_instance="i0"))
    deep = "[" * 100_000 + "]" * 100_000  # within MAX_EVIDENCE (256 KiB)
    assert len(deep) <= limits.MAX_EVIDENCE
    for i in range(200):
        f = pb.Fault(id=f"deep-{i}", kind=pb.FAULT_KIND_STRAGGLER,
                     severity=pb.SEVERITY_WARNING, scope=pb.SCOPE_PROCESS, message="slow",
                     evidence_json=deep if i % 2 else '{"a":' * 5000 + "1" + "}" * 5000)
        reg.handle(conn, pb.AgentMessage(fault=f), float(i))
    acks = _acks(conn)
    assert {a.fault_id for a in acks} == {f"deep-{i}" for i in range(200)}


def test_the_evidence_says_why_it_is_gone_and_honest_evidence_is_kept() -> None:
    from ftagent.wire.convert import too_deep

    f = fault_from_proto(pb.Fault(id="x", kind=pb.FAULT_KIND_CRASH,
                                  evidence_json="[" * 5000 + "]" * 5000))
    assert f.evidence == {"error": f"evidence nested deeper than {limits.MAX_EVIDENCE_DEPTH} "
                                   "levels: dropped"}
    honest = {"stacks": [{"frames": [["train.py", 10], ["torch", 3]]}], "text": "[[[{{{"}
    f = fault_from_proto(pb.Fault(id="y", kind=pb.FAULT_KIND_CRASH,
                                  evidence_json=json.dumps(honest)))
    assert f.evidence == honest
    assert not too_deep("[" * 64 + "]" * 64, 64) and too_deep("[{" * 33 + "}]" * 33, 64)
    assert not too_deep(json.dumps({"s": "[" * 1000}), 64)  # brackets in strings
