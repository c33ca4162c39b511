"""The cordon circuit breaker and the node-scope evidence rules: pure, with the clock
passed in."""

from __future__ import annotations

from ftagent.kube.breaker import CordonBreaker, Held
from ftagent.kube.node_scope import NodeEvidence
from ftagent.kube.uncordon import NodeHealth


def test_a_bad_rule_cannot_hold_more_than_the_fraction_of_a_job_cordoned() -> None:
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
    # no hour makes room: the two nodes are still held cordoned
    assert not b.check("n5", "ns/j", 8, 100, now=10 * 3600.0).allowed
    # the operator uncordons n0 (the node watch shows it): one more is allowed
    b.observe("n0", None, now=10 * 3600.0)
    assert b.check("n5", "ns/j", 8, 100, now=10 * 3600.0).allowed


def test_a_slow_rule_cannot_cordon_a_hundred_nodes_in_ten_hours() -> None:
    """On the code before, the breaker was a sliding hour: one cordon every 6 minutes over
    10 hours stayed within --max-cordons 10 and took 100 nodes."""
    b = CordonBreaker(max_fraction=1.0, max_nodes=10)
    made = 0
    for i in range(100):
        now = i * 360.0
        if b.check(f"n{i}", f"ns/j{i}", 1, 1000, now).allowed:
            b.record(f"n{i}", f"ns/j{i}", now)
            b.observe(f"n{i}", Held(f"ns/j{i}", now, False), now)  # the watch shows it
            made += 1
    assert made == 10 and len(b.cordoned()) == 10


def test_the_cluster_limit_holds_across_jobs_and_a_node_already_cordoned_is_free() -> None:
    b = CordonBreaker(max_fraction=0.5)
    for j in range(2):
        assert b.check(f"n{j}", f"job{j}", job_nodes=2, cluster_nodes=4, now=0.0).allowed
        b.record(f"n{j}", f"job{j}", 0.0)
    v = b.check("n2", "job2", job_nodes=2, cluster_nodes=4, now=1.0)
    assert not v.allowed and "cluster's 4 nodes" in v.reason
    assert b.check("n1", "job2", job_nodes=2, cluster_nodes=4, now=1.0).allowed
    assert b.cordoned() == ["n0", "n1"]


def test_small_jobs_may_lose_one_node_and_zero_turns_cordoning_off() -> None:
    b = CordonBreaker(max_fraction=0.1)
    assert b.check("n0", "j", job_nodes=2, cluster_nodes=3, now=0.0).allowed
    off = CordonBreaker(max_fraction=0.0)
    v = off.check("n0", "j", job_nodes=100, cluster_nodes=100, now=0.0)
    assert not v.allowed and "off" in v.reason
    assert CordonBreaker.limit(0.1, 100) == 10 and CordonBreaker.limit(0.3, 10) == 3


def test_held_cordons_come_from_the_node_watch_and_node_evidence_has_its_own_budget() -> None:
    b = CordonBreaker(max_fraction=1.0, max_nodes=2, max_confirmed=1)
    b.seed("n0", "ns/a", at=100.0, now=200.0)  # a predecessor's cordon, from annotations
    b.seed("n0", "ns/a", at=100.0, now=200.0)  # the same node again: counted once
    assert b.cordoned() == ["n0"]
    assert b.check("n1", "ns/b", 10, 1000, now=200.0).allowed
    b.record("n1", "ns/b", 200.0)
    v = b.check("n2", "ns/c", 10, 1000, now=201.0)
    assert not v.allowed and "--max-cordons 2" in v.reason
    # node evidence is not refused by the corroborated pool, only by its own
    assert b.check("n2", "ns/c", 10, 1000, now=201.0, confirmed=True).allowed
    b.record("n2", "ns/c", 201.0, confirmed=True)
    v = b.check("n3", "ns/c", 10, 1000, now=202.0, confirmed=True)
    assert not v.allowed and "--max-confirmed-cordons 1" in v.reason
    # a cordon made here that the watch shows without it: kept until it settles
    b.observe("n1", None, now=210.0)
    assert "n1" in b.cordoned()
    b.observe("n1", None, now=300.0)
    assert "n1" not in b.cordoned()
    b.release("n2")
    assert b.cordoned() == ["n0"]


def test_node_scope_evidence_rules() -> None:
    e = NodeEvidence(window=300.0)
    ok, why = e.verdict("n1", "ns/a", "gpu", "f1", now=0.0, namespace="ns", account="sa")
    assert not ok and "alone" in why
    assert not e.verdict("n1", "ns/a", "crash", "f3", now=10.0, namespace="ns",
                         account="sa")[0]  # not a node kind
    # another namespace with another ServiceAccount corroborates
    ok, why = e.verdict("n1", "other/b", "gpu", "f4", now=20.0, namespace="other",
                        account="trainer")
    assert ok and "2 namespaces" in why
    assert not e.verdict("n2", "x/b", "nic", "f5", now=400.0, namespace="x", account="a")[0]
    assert not e.verdict("n2", "y/c", "nic", "f6", now=800.0, namespace="y",
                         account="a")[0]  # the first one expired
    # the node agent: its own fault ids, and a confirmation of pod reports of its kinds
    assert not e.verdict("n3", "ns/a", "gpu", "f7", now=1000.0, namespace="ns")[0]
    confirmed = e.confirmations("n3", {"gpu"}, now=1100.0)
    assert [p.fault_id for p in confirmed] == ["f7"]
    assert e.confirmations("n3", {"gpu"}, now=1100.0) == []  # once
    e.node_agent("n3", {"gpu"}, ["agent-1"], now=1100.0)
    assert e.verdict("n3", "ns/x", "crash", "agent-1", now=1101.0)[0]  # its own report
    assert e.verdict("n3", "ns/a", "gpu", "f8", now=1200.0)[0]  # confirmed
    assert not e.verdict("n3", "ns/a", "gpu", "f9", now=1500.0)[0]  # confirmation expired
    assert not e.verdict("n4", "ns/x", "gpu", "agent-1", now=1101.0)[0]  # not n4's agent


def test_one_tenant_with_many_jobs_and_accounts_in_one_namespace_cordons_nothing() -> None:
    """On the code before, two "jobs" of one tenant on one node met the two-jobs rule."""
    e = NodeEvidence(window=300.0)
    for i in range(10):
        ok, _ = e.verdict("n1", f"t/job{i}", "gpu", f"f{i}", now=float(i), namespace="t",
                          account=f"sa{i}")
        assert not ok


def test_corroboration_is_rate_limited_per_namespace() -> None:
    e = NodeEvidence(window=300.0, per_namespace=2, namespace_window=3600.0)
    cordoned = []
    for n in range(5):  # one tenant holding two namespaces walks through the nodes
        e.verdict(f"n{n}", "a/j", "gpu", f"a{n}", now=n * 10.0, namespace="a", account="x")
        ok, why = e.verdict(f"n{n}", "b/j", "gpu", f"b{n}", now=n * 10.0 + 1, namespace="b",
                            account="y")
        if ok:
            cordoned.append(n)
        else:
            assert "already took part in 2 corroborated cordons" in why
    assert cordoned == [0, 1]
    # an hour later the namespaces may corroborate again
    e.verdict("n9", "a/j", "gpu", "a9", now=4000.0, namespace="a", account="x")
    assert e.verdict("n9", "b/j", "gpu", "b9", now=4001.0, namespace="b", account="y")[0]


def test_uncordon_after_the_node_agent_says_healthy_long_enough() -> None:
    h = NodeHealth(after=600.0, stale=120.0)
    h.report("n1", True, now=0.0)
    for t in range(60, 600, 60):
        h.report("n1", True, now=float(t))
    assert h.due(["n1"], now=599.0) == []
    h.report("n1", True, now=600.0)
    assert h.due(["n1"], now=600.0) == ["n1"]
    assert h.due([], now=600.0) == []  # not ftagent's cordon: not ours to undo
    h.report("n1", False, now=610.0)  # a fault: counting starts again
    h.report("n1", True, now=620.0)
    assert h.due(["n1"], now=1000.0) == []  # heartbeats stopped: stale
    assert NodeHealth(after=0.0).due(["n1"], now=1e9) == []  # off by default
