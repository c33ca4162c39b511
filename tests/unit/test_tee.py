from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ftagent.agent.tee import LineSplitter


def test_splits_on_newline_and_carriage_return() -> None:
    s = LineSplitter()
    assert s.feed(b"a\nb\rc") == [b"a", b"b"]
    assert s.feed(b"d\r\n") == [b"cd"]
    assert s.feed(b"") == []
    assert s.flush() == []


def test_partial_line_is_kept_until_terminator() -> None:
    s = LineSplitter()
    assert s.feed(b"step=1 lo") == []
    assert s.feed(b"ss=0.5\n") == [b"step=1 loss=0.5"]


def test_long_lines_are_capped() -> None:
    s = LineSplitter(max_line=4)
    assert s.feed(b"abcdefgh") == []
    assert s.feed(b"ij\nxy\n") == [b"abcd", b"xy"]
    assert s.feed(b"123456\n") == [b"1234"]


@given(st.lists(st.binary(max_size=50), max_size=20))
def test_chunking_does_not_change_lines(chunks: list[bytes]) -> None:
    whole = b"".join(chunks)
    a = LineSplitter(max_line=1 << 20)
    got = [ln for c in chunks for ln in a.feed(c)] + a.flush()
    expected = [ln for ln in whole.replace(b"\r", b"\n").split(b"\n") if ln]
    assert got == expected


def test_last_lines_keeps_the_last_n_in_order_across_batches() -> None:
    from ftagent.agent.tee import LastLines

    ring = LastLines(5)
    ring.add("stdout", [b"a", b"b", b"c"])
    ring.add("stderr", [b"d"])
    ring.add("stdout", [b"e", b"f"])
    assert ring.tail(10) == [("stdout", b"b"), ("stdout", b"c"), ("stderr", b"d"),
                             ("stdout", b"e"), ("stdout", b"f")]
    assert ring.tail(2) == [("stdout", b"e"), ("stdout", b"f")]
    for i in range(1000):
        ring.add("stdout", [b"x%d" % i] * 3)
    assert sum(len(b) for _, b in ring._batches) <= 2 * 5
    assert ring.tail(5)[-1] == ("stdout", b"x999")
    ring.add("stdout", [b"%d" % i for i in range(100)])
    assert [ln for _, ln in ring.tail(5)] == [b"95", b"96", b"97", b"98", b"99"]
