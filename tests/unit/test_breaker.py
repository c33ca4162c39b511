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
