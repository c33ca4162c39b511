from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ftagent.agent.tee import LastLines, LineSplitter, lines_of


def feed(s: LineSplitter, data: bytes) -> list[bytes]:
    return lines_of(s.feed(data))


def test_splits_on_newline_and_carriage_return() -> None:
    s = LineSplitter()
    assert feed(s, b"a\nb\rc") == [b"a", b"b"]
    assert feed(s, b"d\r\n") == [b"cd"]
    assert feed(s, b"") == []
    assert s.flush() == b""


def test_partial_line_is_kept_until_terminator() -> None:
    s = LineSplitter()
    assert feed(s, b"step=1 lo") == []
    assert feed(s, b"ss=0.5\n") == [b"step=1 loss=0.5"]


def test_long_lines_are_capped() -> None:
    s = LineSplitter(max_line=4)
    assert feed(s, b"abcdefgh") == []
    assert feed(s, b"ij\nxy\n") == [b"abcd", b"xy"]
    assert feed(s, b"123") == []
    assert feed(s, b"456\nok\n") == [b"1234", b"ok"]


@given(st.lists(st.binary(max_size=50), max_size=20))
def test_chunking_does_not_change_lines(chunks: list[bytes]) -> None:
    whole = b"".join(chunks)
    a = LineSplitter(max_line=1 << 20)
    got = [ln for c in chunks for ln in feed(a, c)] + lines_of(a.flush())
    expected = [ln for ln in whole.replace(b"\r", b"\n").split(b"\n") if ln]
    assert got == expected


def test_last_lines_keeps_the_last_n_in_order_across_blobs() -> None:
    ring = LastLines(5)
    ring.add("stdout", b"a\nb\nc")
    ring.add("stderr", b"d")
    ring.add("stdout", b"e\n\nf")
    assert ring.tail(10) == [("stdout", b"b"), ("stdout", b"c"), ("stderr", b"d"),
                             ("stdout", b"e"), ("stdout", b"f")]
    assert ring.tail(2) == [("stdout", b"e"), ("stdout", b"f")]
    for i in range(1000):
        ring.add("stdout", b"\n".join([b"x%d" % i] * 3))
    assert ring.held()[0] <= 5
    assert ring.tail(5)[-1] == ("stdout", b"x999")
    ring.add("stdout", b"\n".join(b"%d" % i for i in range(100)))
    assert [ln for _, ln in ring.tail(5)] == [b"95", b"96", b"97", b"98", b"99"]


def test_last_lines_memory_is_bounded_by_bytes_and_lines_are_cut() -> None:
    ring = LastLines(200, max_bytes=1000, max_line=10)
    for _ in range(100):
        ring.add("stdout", b"z" * 900)  # one long line per blob
    assert ring.held()[1] <= 1000 + 900
    assert ring.tail(5) == [("stdout", b"z" * 10)]


def test_a_stdout_burst_delivered_late_does_not_evict_the_stderr_traceback() -> None:
    ring = LastLines(5)
    ring.add("stderr", b"Traceback: the last words")
    ring.add("stdout", b"\n".join(b"line %d" % i for i in range(300)))
    assert ring.tail(5, "stderr") == [("stderr", b"Traceback: the last words")]
    assert ring.tail(2) == [("stdout", b"line 298"), ("stdout", b"line 299")]
    assert ring.tail(5)[0] == ("stdout", b"line 295")
