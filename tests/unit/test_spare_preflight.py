"""A spare ASSIGNed a rank whose preflight then fails (agent/arbiter_decider.py checks
again before it arrives): the policy retires it, gives the rank to the next spare, and
state.apply hands the rank back from the retired spare's pod (so the rank's recreated
pod may take it). Before this, the assigned spare's fatal fault was only recorded and the
spare went on to run the rank on a broken device."""

from __future__ import annotations

from ftagent.arbiter.policy import decide_spare_fault
from ftagent.arbiter.state import Verdict, apply
from ftagent.model import Fault, FaultKind, Scope, Severity
from tests.unit.test_spares import NOW, decide, job, xid


def preflight_failed() -> Fault:
    return Fault(FaultKind.GPU, "preflight failed: accelerator: GPU 0 is lost",
                 Severity.FATAL, Scope.NODE, evidence={"preflight": True})


def test_an_assigned_spares_failed_preflight_retires_it_and_assigns_the_next() -> None:
    j = job(spares=(("s1", "node-8"), ("s2", "node-9")))
    decide(j, xid(1))
    assert j.spares["s1"].assigned == 1 and j.owners[1] == ("spare-s1", "uid-s1")
    ds = decide_spare_fault(j, j.spares["s1"], preflight_failed())
    assert [d.verdict for d in ds] == [Verdict.RETIRE_SPARE, Verdict.ASSIGN]
    assert "not used for rank 1" in ds[0].reason and "preflight failed" in ds[0].reason
    assert (ds[1].spare, ds[1].rank, ds[1].generation) == ("s2", 1, j.generation)
    for d in ds:
        apply(j, d, NOW)
    assert j.spares["s1"].assigned == -1
    assert j.spares["s2"].assigned == 1 and j.owners[1] == ("spare-s2", "uid-s2")


def test_with_no_other_spare_the_rank_is_left_to_its_own_recreated_pod() -> None:
    j = job()
    decide(j, xid(1))
    before = j.owners_print
    ds = decide_spare_fault(j, j.spares["s1"], preflight_failed())
    assert [d.verdict for d in ds] == [Verdict.RETIRE_SPARE]
    apply(j, ds[0], NOW)
    assert 1 not in j.owners and j.owners_print != before
    assert j.owners == {} and j.owners_print == 0  # the fingerprint follows the owners


def test_an_unassigned_or_a_harmless_spare_fault_is_as_before() -> None:
    j = job()
    ds = decide_spare_fault(j, j.spares["s1"], preflight_failed())
    assert [d.verdict for d in ds] == [Verdict.RETIRE_SPARE] and ds[0].rank is None
    j = job()
    decide(j, xid(1))
    warn = Fault(FaultKind.GPU, "throttled", Severity.WARNING)
    assert [d.verdict for d in decide_spare_fault(j, j.spares["s1"], warn)] == \
        [Verdict.ALERT_ONLY]
