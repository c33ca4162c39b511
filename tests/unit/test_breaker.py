"""The cordon circuit breaker: pure, with the clock passed in."""

from __future__ import annotations

from ftagent.kube.breaker import CordonBreaker


def test_a_bad_rule_cannot_cordon_more_than_the_fraction_of_a_job_within_the_hour() -> None:
    b = CordonBreaker(max_fraction=0.25)
    allowed = []
    for i in range(8):  # a rule that blames every node of a 8-node job, one after another
        v = b.check(f"n{i}", "ns/j", job_nodes=8, cluster_nodes=100, now=float(i))
        if v.allowed:
            b.record(f"n{i}", "ns/j", float(i))
            allowed.append(i)
        else:
            assert "circuit breaker" in v.reason and "2 of the job's 8" in v.reason
    assert allowed == [0, 1]
    # an hour after the first cordon, one more is allowed again
    assert not b.check("n5", "ns/j", 8, 100, now=3599.0).allowed
    assert b.check("n5", "ns/j", 8, 100, now=3600.0).allowed


def test_the_cluster_limit_holds_across_jobs_and_a_node_already_cordoned_is_free() -> None:
    b = CordonBreaker(max_fraction=0.5)
    for j in range(2):
        assert b.check(f"n{j}", f"job{j}", job_nodes=2, cluster_nodes=4, now=0.0).allowed
        b.record(f"n{j}", f"job{j}", 0.0)
    v = b.check("n2", "job2", job_nodes=2, cluster_nodes=4, now=1.0)
    assert not v.allowed and "cluster's 4 nodes" in v.reason
    assert b.check("n1", "job2", job_nodes=2, cluster_nodes=4, now=1.0).allowed
    assert b.cordoned(1.0) == ["n0", "n1"]


def test_small_jobs_may_lose_one_node_and_zero_turns_cordoning_off() -> None:
    b = CordonBreaker(max_fraction=0.1)
    assert b.check("n0", "j", job_nodes=2, cluster_nodes=3, now=0.0).allowed
    off = CordonBreaker(max_fraction=0.0)
    v = off.check("n0", "j", job_nodes=100, cluster_nodes=100, now=0.0)
    assert not v.allowed and "off" in v.reason
    assert CordonBreaker.limit(0.1, 100) == 10 and CordonBreaker.limit(0.3, 10) == 3


def test_an_absolute_cap_beside_the_fraction_and_seeds_from_the_cluster() -> None:
    b = CordonBreaker(max_fraction=1.0, max_nodes=2)
    b.seed("n0", "ns/a", at=100.0, now=200.0)  # a predecessor's cordon, from annotations
    b.seed("n0", "ns/a", at=100.0, now=200.0)  # the same node again: counted once
    b.seed("old", "ns/a", at=-5000.0, now=200.0)  # outside the window: not counted
    assert b.cordoned(200.0) == ["n0"]
    assert b.check("n1", "ns/b", 10, 1000, now=200.0).allowed
    b.record("n1", "ns/b", 200.0)
    v = b.check("n2", "ns/c", 10, 1000, now=201.0)
    assert not v.allowed and "--max-cordons 2" in v.reason
    assert b.check("n2", "ns/c", 10, 1000, now=3700.0).allowed  # n0's hour is over


def test_node_scope_evidence_rules() -> None:
    from ftagent.kube.node_scope import NodeEvidence

    e = NodeEvidence(window=300.0)
    ok, why = e.verdict("n1", "ns/a", "gpu", "f1", now=0.0)
    assert not ok and "alone" in why
    assert not e.verdict("n1", "ns/a", "gpu", "f2", now=10.0)[0]  # the same job again
    assert not e.verdict("n1", "ns/a", "crash", "f3", now=10.0)[0]  # not a node kind
    ok, why = e.verdict("n1", "ns/b", "gpu", "f4", now=20.0)  # a second job: node-scope
    assert ok and "2 jobs" in why
    assert not e.verdict("n2", "ns/b", "nic", "f5", now=400.0)[0]
    assert not e.verdict("n2", "ns/c", "nic", "f6", now=800.0)[0]  # the first one expired
    # the node agent: its own fault ids, and a confirmation of pod reports of its kinds
    assert not e.verdict("n3", "ns/a", "gpu", "f7", now=1000.0)[0]
    confirmed = e.confirmations("n3", {"gpu"}, now=1100.0)
    assert [p.fault_id for p in confirmed] == ["f7"]
    assert e.confirmations("n3", {"gpu"}, now=1100.0) == []  # once
    e.node_agent("n3", {"gpu"}, ["agent-1"], now=1100.0)
    assert e.verdict("n3", "ns/x", "crash", "agent-1", now=1101.0)[0]  # its own report
    assert e.verdict("n3", "ns/a", "gpu", "f8", now=1200.0)[0]  # confirmed
    assert not e.verdict("n3", "ns/a", "gpu", "f9", now=1500.0)[0]  # confirmation expired
    assert not e.verdict("n4", "ns/x", "gpu", "agent-1", now=1101.0)[0]  # not n4's agent
