"""Counters -> rates (sources/netstats.py): injected clocks, resets, sysfs readers."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftagent.sources.netstats import (
    CounterRate,
    LinkRates,
    read_ib_data_counters,
    read_sysfs_counters,
)


def test_rate_over_the_window() -> None:
    r = CounterRate(window=10.0)
    assert r.update(1_000, 0.0) == 0.0  # one reading: no rate yet
    assert r.update(2_000, 1.0) == pytest.approx(1_000.0)
    assert r.update(5_000, 2.0) == pytest.approx(2_000.0)  # (5000-1000)/2
    assert r.total == 4_000 and r.last_value == 5_000


def test_old_samples_leave_the_window_but_one_anchor_stays() -> None:
    r = CounterRate(window=2.0)
    for t in range(0, 6):  # 100 B/s for 5 s ...
        r.update(100 * t, float(t))
    r.update(500 + 1_000, 6.0)  # ... then 1000 B/s for one second
    # window (4, 6]: anchor at t=4 (400), newest t=6 (1500)
    assert r.rate == pytest.approx((1_500 - 400) / 2)


def test_counter_going_backwards_is_a_reset_not_a_negative_rate() -> None:
    r = CounterRate(window=10.0)
    r.update(10_000, 0.0)
    r.update(12_000, 1.0)
    r.update(500, 2.0)  # driver reload: counts restarted, 500 since then
    assert r.resets == 1
    assert r.total == 2_500
    assert r.rate == pytest.approx(2_500 / 2)


def test_same_instant_readings_do_not_divide_by_zero() -> None:
    r = CounterRate()
    r.update(0, 5.0)
    r.update(100, 5.0)
    assert r.rate == 0.0
    r.update(300, 6.0)
    assert r.rate == pytest.approx(200.0)  # the 100 counted at t=5 is the anchor


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        CounterRate(window=0)


def test_link_rates_pair() -> None:
    lr = LinkRates(window=5.0)
    lr.update(0, 0, 0.0)
    lr.update(1_000, 4_000, 2.0)
    assert (lr.receive.rate, lr.transmit.rate) == (500.0, 2_000.0)


@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.floats(0.001, 5.0)), min_size=1,
                max_size=60))
def test_rate_is_never_negative_and_total_only_grows(readings: list[tuple[int, float]]) -> None:
    r = CounterRate(window=7.0)
    now, last_total = 0.0, 0
    for value, dt in readings:
        now += dt
        assert r.update(value, now) >= 0.0
        assert r.total >= last_total
        last_total = r.total


def test_sysfs_link_counters(tmp_path: Path) -> None:
    stats = tmp_path / "eth0" / "statistics"
    stats.mkdir(parents=True)
    (stats / "rx_bytes").write_text("123\n")
    (stats / "tx_bytes").write_text("456\n")
    assert read_sysfs_counters(str(tmp_path), "eth0") == (123, 456)
    assert read_sysfs_counters(str(tmp_path), "eth1") is None
    (stats / "tx_bytes").write_text("garbage\n")
    assert read_sysfs_counters(str(tmp_path), "eth0") is None


def test_ib_counters_are_four_byte_words(tmp_path: Path) -> None:
    counters = tmp_path / "counters"
    counters.mkdir()
    (counters / "port_rcv_data").write_text("1000\n")
    (counters / "port_xmit_data").write_text("250\n")
    assert read_ib_data_counters(str(tmp_path)) == (4_000, 1_000)
    assert read_ib_data_counters(str(tmp_path / "missing")) is None
