"""The step a restarted generation had reached (arbiter/ledger.py ``_late``): its agents'
last summaries come after the restart (lines read once the trainer was stopped), and
count where the generation never trained in the ledger's eyes too (pure, injected times).
"""

from __future__ import annotations

import pytest

from ftagent.arbiter.ledger import CATEGORIES, Ledger


def test_steps_a_generation_did_only_after_the_fault_still_count_as_redone() -> None:
    """A fatal Xid came 1.5 s after the agents started; on a loaded node neither trainer
    had printed a step by then. Both printed steps 1..2 before they were stopped, read
    after the restart: the ledger, with no training stretch of generation 0, dropped them
    and the incident's steps redone were unknown (None) instead of 2 (the e2e Xid 79
    drill under load)."""
    led = Ledger(0.0, world_size=2)
    led.restart(1, 5.0, kind="gpu", onset=4.9, detected=4.9)
    led.progress(1, 0, 2, 5.1)  # each rank's last lines, read after its trainer stopped
    led.progress(0, 0, 1, 5.2)
    led.resumed(1, 0)
    led.released(1, 8.0)
    for s in range(1, 6):
        for r in range(2):
            led.progress(r, 1, s, 8.0 + s)
    b = led.breakdown(14.0)
    assert sum(b.seconds.values()) == pytest.approx(b.wall) == pytest.approx(14.0)
    assert set(b.seconds) == set(CATEGORIES)
    (inc,) = b.incidents
    assert (inc.reached, inc.resumed, inc.resume_source) == (2, 0, "reported")
    assert b.recomputed_steps == inc.recomputed_steps == 2
    assert b.seconds["recomputed"] == 0.0  # no training time before the fault to move
    assert b.seconds["startup"] == pytest.approx(4.9)


def test_a_late_step_of_an_older_generation_than_the_last_that_trained_is_not_taken() -> None:
    """Generation 0 trained to step 20, generation 1 (resumed after 10) to 14; a summary of
    generation 0 still on its way after the second restart is not the step the job had
    reached, whichever is higher."""
    led = Ledger(0.0, world_size=1)
    for s in range(1, 21):
        led.progress(0, 0, s, float(s))
    led.restart(1, 21.0, kind="crash", onset=20.5, detected=20.5)
    led.released(1, 22.0)
    for s in range(11, 15):
        led.progress(0, 1, s, 12.0 + s)
    led.restart(2, 27.0, kind="crash", onset=26.5, detected=26.5)
    led.progress(0, 0, 25, 27.1)  # generation 0's, not 1's
    led.progress(0, 1, 15, 27.2)  # generation 1's last line, read after the exit
    led.released(2, 28.0)
    led.progress(0, 2, 11, 29.0)
    first, second = led.breakdown(30.0).incidents
    assert (first.reached, first.resumed) == (20, 10)
    assert (second.reached, second.resumed) == (15, 10)
