"""The leader-election core (ftagent.kube.lease.Election): client-go's rules with a fake
clock — acquire when free or expired, renew, step down past the renew deadline, the
record's fields, and that two candidates never both lead."""

from __future__ import annotations

import random

import pytest

from ftagent.kube.lease import (
    Election,
    ElectionConfig,
    LeaseRecord,
    identity,
    micro_time,
)

CFG = ElectionConfig(lease_duration=15, renew_deadline=10, retry_period=2)


def elect(name: str, cfg: ElectionConfig = CFG) -> Election:
    return Election(ElectionConfig(name=cfg.name, namespace=cfg.namespace, identity=name,
                                   lease_duration=cfg.lease_duration,
                                   renew_deadline=cfg.renew_deadline,
                                   retry_period=cfg.retry_period))


def test_no_lease_is_created_with_the_full_record() -> None:
    e = elect("a")
    plan = e.plan(None, now=100.0, wall=1_700_000_000.5)
    assert plan.create and plan.record is not None
    rec = plan.record
    assert rec.holder == "a" and rec.duration == 15 and rec.transitions == 0
    assert rec.acquire_time == rec.renew_time == "2023-11-14T22:13:20.500000Z"
    assert rec.spec() == {"holderIdentity": "a", "leaseDurationSeconds": 15,
                          "leaseTransitions": 0, "acquireTime": rec.acquire_time,
                          "renewTime": rec.renew_time}
    assert e.written(rec, 100.0) is True and e.leading
    assert e.written(rec, 101.0) is False  # already leading: no second "became leader"


def test_a_held_lease_is_waited_for_until_it_expires_on_our_own_clock() -> None:
    e = elect("b")
    held = LeaseRecord("a", 15, "t0", "t0", 3)
    assert e.plan(held, now=1000.0, wall=0).record is None
    # The same record, unchanged for 14.9 s as seen here: still held.
    assert e.plan(held, now=1014.9, wall=0).record is None
    # The holder renews (renewTime changes): the expiry restarts from when we saw that.
    renewed = LeaseRecord("a", 15, "t0", "t1", 3)
    assert e.plan(renewed, now=1014.95, wall=0).record is None
    assert e.plan(renewed, now=1029.0, wall=0).record is None
    plan = e.plan(renewed, now=1030.0, wall=5.0)
    assert plan.record is not None and not plan.create and "expired" in plan.why
    assert plan.record.holder == "b" and plan.record.transitions == 4
    assert plan.record.acquire_time == plan.record.renew_time == micro_time(5.0)


def test_the_record_duration_not_ours_decides_expiry() -> None:
    e = elect("b")
    held = LeaseRecord("a", 40, "", "", 0)
    e.plan(held, now=0.0, wall=0)
    assert e.plan(held, now=39.0, wall=0).record is None
    assert e.plan(held, now=40.0, wall=0).record is not None


def test_a_free_lease_is_taken_at_once_and_a_release_frees_it() -> None:
    a, b = elect("a"), elect("b")
    rec = a.plan(None, 0.0, 0.0).record
    assert rec is not None
    a.written(rec, 0.0)
    released = a.release(rec, 1.0)
    assert released is not None and released.holder == "" and released.duration == 1
    assert released.transitions == rec.transitions
    plan = b.plan(released, now=1.0, wall=1.0)
    assert plan.record is not None and plan.why == "free"
    assert plan.record.transitions == 1
    assert b.release(released, 2.0) is None  # not ours to give up


def test_the_leader_renews_keeping_acquire_time_and_transitions() -> None:
    e = elect("a")
    mine = LeaseRecord("a", 15, "acq", "r1", 7)
    e.written(mine, 0.0)
    plan = e.plan(mine, now=2.0, wall=3.0)
    assert plan.record is not None and plan.why == "renew"
    assert plan.record.acquire_time == "acq" and plan.record.transitions == 7
    assert plan.record.renew_time == micro_time(3.0)


def test_failures_step_the_leader_down_only_past_the_renew_deadline() -> None:
    e = elect("a")
    rec = e.plan(None, 0.0, 0.0).record
    assert rec is not None
    e.written(rec, 0.0)
    assert e.failed(2.0) is False and e.leading
    assert e.failed(9.99) is False and e.leading
    e.written(rec, 9.99)  # one renewal in time resets the deadline
    assert e.failed(19.0) is False
    assert e.failed(20.0) is True and not e.leading
    assert e.failed(30.0) is False  # a follower has nothing to step down from


def test_a_request_never_outlasts_the_renew_deadline() -> None:
    e = elect("a")
    assert e.request_timeout(0.0) == 2.0
    rec = e.plan(None, 0.0, 0.0).record
    assert rec is not None
    e.written(rec, 0.0)
    assert e.request_timeout(1.0) == 2.0
    assert e.request_timeout(9.0) == pytest.approx(1.0)
    assert e.request_timeout(9.95) == pytest.approx(0.2)  # a floor, never 0 or negative


def test_followers_jitter_and_leaders_do_not() -> None:
    rng = random.Random(1)
    e = elect("a")
    waits = [e.wait(rng) for _ in range(100)]
    assert all(2.0 <= w <= 2.4 for w in waits) and len(set(waits)) > 50
    rec = e.plan(None, 0.0, 0.0).record
    assert rec is not None
    e.written(rec, 0.0)
    assert e.wait(rng) == 2.0


def test_two_candidates_never_lead_at_once() -> None:
    """Simulate two candidates against one Lease with optimistic concurrency, a leader that
    stops renewing (paused, as a partitioned or SIGSTOPped pod), and random interleaving:
    at no instant do both consider themselves leader with an unexpired deadline."""
    rng = random.Random(7)
    cands = {n: elect(n) for n in ("a", "b")}
    lease: LeaseRecord | None = None
    version = 0
    paused_until = {"a": 0.0, "b": 0.0}
    now = 0.0
    leaders_seen = set()
    while now < 400:
        now += rng.uniform(0.1, 1.0)
        for name, c in rng.sample(list(cands.items()), 2):
            if now < paused_until[name]:
                c.must_step_down(now)  # its own deadline still ticks
                continue
            if rng.random() < 0.02:
                paused_until[name] = now + rng.uniform(5, 30)
            read_version = version
            plan = c.plan(lease, now, now)
            if plan.record is None:
                continue
            if read_version != version or (plan.create and lease is not None):
                c.failed(now)  # 409
                continue
            lease, version = plan.record, version + 1
            c.written(plan.record, now)
        active = [n for n, c in cands.items()
                  if c.leading and now - c.renewed_at < c.cfg.renew_deadline]
        assert len(active) <= 1, (now, active)
        leaders_seen.update(active)
    assert leaders_seen == {"a", "b"}  # leadership did move


def test_a_lease_with_missing_or_wrong_fields_reads_as_absent_fields() -> None:
    assert LeaseRecord.from_spec(None) == LeaseRecord()
    rec = LeaseRecord.from_spec({"holderIdentity": 5, "leaseDurationSeconds": "15",
                                 "leaseTransitions": -1, "renewTime": 3})
    assert rec == LeaseRecord()
    assert LeaseRecord.from_spec({"holderIdentity": "x" * 10_000}).holder == "x" * 256
    assert LeaseRecord.from_spec({"leaseDurationSeconds": True}).duration == 0


def test_durations_are_checked_as_client_go_does() -> None:
    assert CFG.problem() == ""
    assert "greater than --leader-elect-renew-deadline" in ElectionConfig(
        lease_duration=10, renew_deadline=10).problem()
    assert "1.2 x --leader-elect-retry-period" in ElectionConfig(
        lease_duration=15, renew_deadline=2.4, retry_period=2).problem()


def test_identity_is_the_pod_name_plus_a_random_part() -> None:
    a = identity({"POD_NAME": "ftagent-arbiter-7d9f-x2"})
    b = identity({"POD_NAME": "ftagent-arbiter-7d9f-x2"})
    assert a.startswith("ftagent-arbiter-7d9f-x2_") and a != b
    assert len(identity({"POD_NAME": "p" * 500})) <= 128
