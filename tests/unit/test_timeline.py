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
