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


# --------------------------------------------------------------------------- the backlog

def test_backlog_is_bounded_and_accounts_for_every_line() -> None:
    from ftagent.agent.tee import LineBacklog

    bl = LineBacklog(max_bytes=10_000, max_lines=500, sample_bytes=100)
    put_lines = 0
    woke = 0
    for i in range(1000):
        blob = b"\n".join(b"step=%d loss=0.5" % (i * 10 + j) for j in range(10))
        woke += bl.put("stdout", blob, float(i))
        put_lines += 10
        nbytes, nlines = bl.held()
        assert nbytes <= 10_000 + len(blob) and nlines <= 500 + 10
    assert woke == 1  # only the first put found it empty: one wake-up for the whole burst
    assert bl.oldest_ts() is not None and bl.oldest_ts() < 999.0
    taken = bl.take(1 << 30)
    got = sum(b.count(b"\n") + 1 for _, b, _ in taken)
    assert got + bl.dropped_lines == put_lines and bl.dropped_lines > 0
    assert bl.new_drops() == bl.dropped_lines and bl.new_drops() == 0
    # the sample of the newest dropped batch comes first, with its read time and last lines
    stream, sample, ts = taken[0]
    assert stream == "stdout" and len(sample) <= 100 and sample.endswith(b"loss=0.5")
    assert ts < taken[1][2] and [t for _, _, t in taken[1:]] == sorted(t for _, _, t in taken[1:])
    assert taken[-1][2] == 999.0 and taken[-1][1].endswith(b"step=9999 loss=0.5")
    assert bl.oldest_ts() is None and len(bl) == 0 and bl.put("stderr", b"x", 1000.0)


def test_backlog_with_wake_marks_wakes_only_when_it_grows_past_one() -> None:
    """The agent's ticker drains the backlog; the pump wakes the loop only when output
    piles up past a mark, once per crossing, not on every batch into an empty backlog."""
    from ftagent.agent.tee import LineBacklog

    bl = LineBacklog(wake_bytes=100, wake_lines=20)
    assert not bl.put("stdout", b"step=1", 0.0)  # empty, but below the marks: no wake
    assert not bl.put("stdout", b"step=2", 0.1)
    assert bl.put("stdout", b"x" * 100, 0.2)  # past the byte mark: wake
    assert not bl.put("stdout", b"step=3", 0.3)  # still past it: no second wake
    bl.take(1 << 30)
    assert not bl.put("stdout", b"step=4", 0.4)
    assert bl.put("stdout", b"\n".join([b"l"] * 25), 0.5)  # past the line mark
    plain = LineBacklog()
    assert plain.put("stdout", b"step=1", 0.0) and not plain.put("stdout", b"step=2", 0.1)


def test_coalescing_pump_reads_after_its_interval_or_at_once_when_hurried() -> None:
    """With an interval the pump waits after a short read, so lines printed meanwhile
    arrive as one batch; ``hurry`` (the trainer exited) ends the wait at once."""
    import os
    import threading
    import time

    from ftagent.agent.tee import OutputPump

    r, w = os.pipe()
    sink_r, sink_w = os.pipe()
    batches: list[bytes] = []
    got = threading.Event()

    def on_lines(stream: str, blob: bytes, ts: float) -> None:
        batches.append(blob)
        got.set()

    pump = OutputPump(r, sink_w, "stdout", on_lines, interval=60.0)
    pump.start()
    os.write(w, b"step=1\n")
    assert got.wait(10)  # the first line after a quiet spell passes at once
    os.write(w, b"step=2\n")
    os.write(w, b"step=3\n")
    time.sleep(0.2)  # not a synchronisation: lines written while the pump waits
    assert batches == [b"step=1"]  # still waiting out its interval
    pump.hurry.set()
    os.close(w)
    assert pump.eof.wait(10)
    assert batches == [b"step=1", b"step=2\nstep=3"]
    os.close(sink_w)
    assert os.read(sink_r, 1 << 16) == b"step=1\nstep=2\nstep=3\n"
    os.close(sink_r)


def test_pump_hands_lines_over_before_writing_them() -> None:
    """The batch is handed over (stamped with its read time) before it is written, so a
    reader of the agent's output that blocks does not hide progress already read."""
    import os
    import threading

    from ftagent.agent.tee import OutputPump

    r, w = os.pipe()
    out_r, out_w = os.pipe()
    os.set_blocking(out_w, False)
    filled = 0
    try:
        while True:  # the agent's stdout is full: the pump's write will block
            filled += os.write(out_w, b"f" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(out_w, True)
    seen: list[bytes] = []
    got_lines = threading.Event()

    def on_lines(stream: str, blob: bytes, ts: float) -> None:
        seen.append(blob)
        got_lines.set()

    pump = OutputPump(r, out_w, "stdout", on_lines)
    pump.start()
    os.write(w, b"step=1 loss=0.5\n")
    os.close(w)
    assert got_lines.wait(10)  # while the write of the same bytes is blocked
    assert seen == [b"step=1 loss=0.5"]
    data = b""
    while len(data) < filled + 16:
        data += os.read(out_r, 1 << 16)
    assert pump.eof.wait(10) and data[filled:] == b"step=1 loss=0.5\n"
    os.close(out_r)
    os.close(out_w)


def test_after_a_quiet_spell_the_pumps_waits_ramp_up_from_an_eighth() -> None:
    """A restart's first lines: the trainer prints a line after a quiet spell (read at
    once), then its first step right after it. With a 4 s interval, the step is read
    after the ramp's first wait (0.5 s), not a whole interval later (the goodput bench's
    'training again' was 0.4 s late on every restart). Steady output after that is read
    once per interval again: three lines written at once are one batch."""
    import os
    import threading
    import time

    from ftagent.agent.tee import RAMP, OutputPump

    interval = 4.0
    r, w = os.pipe()
    sink_r, sink_w = os.pipe()
    batches: list[tuple[bytes, float]] = []
    got = threading.Condition()

    def on_lines(stream: str, blob: bytes, ts: float) -> None:
        with got:
            batches.append((blob, ts))
            got.notify_all()

    def delivered(n: int) -> bool:
        with got:
            return got.wait_for(lambda: len(batches) >= n, timeout=30)

    pump = OutputPump(r, sink_w, "stdout", on_lines, interval=interval)
    pump.start()  # a new trainer: its start is a quiet spell
    os.write(w, b"resumed from checkpoint\n")
    assert delivered(1)
    written = time.monotonic()
    os.write(w, b"step=1\n")
    assert delivered(2)
    assert batches[1][0] == b"step=1"
    assert batches[1][1] - written < interval / 2, f"read after the first wait, {interval / RAMP} s"
    os.write(w, b"step=2\nstep=3\n")
    os.write(w, b"step=4\n")
    pump.hurry.set()
    os.close(w)
    assert pump.eof.wait(30)
    assert [b for b, _ in batches[2:]] == [b"step=2\nstep=3\nstep=4"]
    os.close(sink_w)
    assert os.read(sink_r, 1 << 16).endswith(b"step=4\n")
    os.close(sink_r)


def test_both_tails_of_a_crash_in_one_call() -> None:
    """``LastLines.tails``: the merged tail and one stream's, as ``tail`` gives each."""
    ring = LastLines(10)
    ring.add("stdout", b"a\nb\n")
    ring.add("stderr", b"Traceback\nError\n")
    ring.add("stdout", b"c\n")
    assert ring.tails(3, 2, "stderr") == (ring.tail(3), ring.tail(2, "stderr"))
    assert ring.tails(3, 2, "stderr")[1] == [("stderr", b"Traceback"), ("stderr", b"Error")]
    assert LastLines(10).tails(3, 2, "stderr") == ([], [])
