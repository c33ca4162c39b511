"""agent/stop_grace.py's pure parts: the /proc masks, and who is signalled again when."""

from __future__ import annotations

import asyncio
import signal

from ftagent.agent.stop_grace import CAUGHT, DEFAULT, IGNORED, disposition, wait_stopped

STATUS = "Name:\tpython\nSigBlk:\t0000000000000000\nSigIgn:\t{ign:016x}\nSigCgt:\t{cgt:016x}\n"
TERM = 1 << (signal.SIGTERM - 1)


def test_disposition_reads_the_signal_masks() -> None:
    assert disposition(STATUS.format(ign=0, cgt=TERM | 2), signal.SIGTERM) == CAUGHT
    assert disposition(STATUS.format(ign=TERM, cgt=2), signal.SIGTERM) == IGNORED
    assert disposition(STATUS.format(ign=0, cgt=2), signal.SIGTERM) == DEFAULT
    assert disposition(STATUS.format(ign=0, cgt=TERM), signal.SIGINT) == DEFAULT


def test_disposition_of_garbage_is_unknown() -> None:
    assert disposition("Name:\tx\n", signal.SIGTERM) is None
    assert disposition("SigIgn:\tzz\nSigCgt:\t0\n", signal.SIGTERM) is None
    assert disposition(STATUS.format(ign=0, cgt=0), 0) is None


def test_only_a_process_whose_handler_is_gone_is_signalled_again_and_once() -> None:
    now = [0.0]
    states: dict[int, list[str | None]] = {1: [CAUGHT, CAUGHT, DEFAULT, DEFAULT, DEFAULT],
                                           2: [IGNORED] * 5, 3: [None] * 5}
    sent: list[tuple[int, int]] = []

    def read(pid: int, sig: int) -> str | None:
        return states[pid].pop(0) if len(states[pid]) > 1 else states[pid][0]

    async def go() -> list[int]:
        exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def clock() -> float:
            now[0] += 1.0
            return now[0]

        return await wait_stopped(exited, lambda: [1, 2, 3], signal.SIGTERM, 8.0, poll=0.0,
                                  clock=clock, read=read, send=lambda p, s: sent.append((p, s)))

    assert asyncio.run(go()) == [1]
    assert sent == [(1, signal.SIGTERM)]  # not 2 (ignores it), not 3 (gone), 1 only once


def test_an_exited_trainer_ends_the_wait_at_once() -> None:
    async def go() -> list[int]:
        exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        exited.set_result(None)
        return await wait_stopped(exited, lambda: [1], signal.SIGTERM, 1e9,
                                  read=lambda p, s: DEFAULT, send=lambda p, s: None)

    assert asyncio.run(go()) == []


def test_the_tree_just_signalled_is_looked_at_first_not_listed_again() -> None:
    """``first``: the pids the stop has just listed and signalled; the first look reads
    their handlers without listing the tree again (the stop read it twice within a few
    milliseconds: trainer_exec -> supervisor.tree x2 on the hang walk); later looks list
    it."""
    listed: list[int] = []
    sent: list[int] = []

    async def go() -> list[int]:
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        looks = [0]

        def read(pid: int, sig: int) -> str:
            looks[0] += 1
            if looks[0] >= 2:
                exited.set_result(0)
            return DEFAULT

        def pids() -> list[int]:
            listed.append(1)
            return [5]

        return await wait_stopped(exited, pids, signal.SIGTERM, 1e9, poll=0.0, read=read,
                                  send=lambda p, s: sent.append(p), first=[4])

    assert asyncio.run(go()) == [4, 5]
    assert listed == [1] and sent == [4, 5]
