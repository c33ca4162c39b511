"""The timeline's watchers: a follower that falls behind, and one whose arbiter stops
leading, each get the end of their stream (None), told apart by ``ended`` (pure)."""

from __future__ import annotations

import asyncio

from ftagent.arbiter.timeline import WATCH_QUEUE, Timeline


def add(t: Timeline, n: int) -> None:
    for i in range(n):
        t.add(float(i), "j", "", 0, "agent", f"entry {i}")


def test_a_watcher_that_falls_behind_loses_its_stream() -> None:
    async def body() -> None:
        t = Timeline()
        w = t.watch("j", "")
        add(t, WATCH_QUEUE + 1)
        assert w.queue.get_nowait() is None and w.ended == ""  # "fell behind"
        add(t, 1)
        assert w.queue.empty(), "no more entries for it"
    asyncio.run(body())


def test_ending_the_watches_comes_after_what_was_sent_even_on_a_full_queue() -> None:
    async def body() -> None:
        t = Timeline()
        keeping_up, full = t.watch("j", ""), t.watch("j", "")
        add(t, 2)
        while not full.queue.full():
            full.queue.put_nowait(None)
        t.end_watches("stepped down")
        got = [keeping_up.queue.get_nowait() for _ in range(3)]
        assert [e.message for e in got[:2] if e] == ["entry 0", "entry 1"] and got[2] is None
        assert full.queue.get_nowait() is None and full.queue.empty()
        assert keeping_up.ended == full.ended == "stepped down"
        add(t, 1)
        assert keeping_up.queue.empty()
    asyncio.run(body())


def test_a_watch_replays_one_jobs_timeline_at_most() -> None:
    """Issue 20: a WatchEvents replay sorted every job's entries on the event loop (500
    jobs x 1000 entries for every new watcher). It is one job's worth now: the newest
    KEEP_PER_JOB matching entries, oldest first, whatever the number of jobs."""
    from ftagent.arbiter.timeline import KEEP_PER_JOB

    t = Timeline()
    for i in range(3 * KEEP_PER_JOB):
        t.add(float(i), f"job-{i % 3}", "ns" if i % 2 else "other", 0, "agent", f"m{i}")
    mine = t.replay("job-1", "ns")
    assert [e.message for e in mine] == [f"m{i}" for i in range(3 * KEEP_PER_JOB)
                                         if i % 3 == 1 and i % 2][-KEEP_PER_JOB:]
    every = t.replay("", "")
    assert len(every) == KEEP_PER_JOB
    assert [e.seq for e in every] == list(range(2 * KEEP_PER_JOB + 1, 3 * KEEP_PER_JOB + 1))
    assert [e.job for e in t.replay("job-2", "")] == ["job-2"] * KEEP_PER_JOB
    assert t.replay("nobody", "") == []


def test_an_entry_keeps_a_bounded_escaped_message() -> None:
    """A job's timeline is 1000 entries; a peer's 4 KiB fault messages (or their escapes,
    four times longer) would make it 16 MB a job: each message is cut at 1000."""
    from ftagent.arbiter.timeline import MAX_ENTRY_MESSAGE

    t = Timeline()
    e = t.add(1.0, "j", "", 0, "fault", "\x1b" * 4096)
    assert len(e.message) == MAX_ENTRY_MESSAGE and e.message.startswith("\\x1b\\x1b")
    assert e.message.endswith("…")
    assert t.add(2.0, "j", "", 0, "fault", "short").message == "short"
