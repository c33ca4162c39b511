"""Waiting on an asyncio event with a timeout, cancellably, on every Python we run on.

``asyncio.wait_for(event.wait(), timeout)`` is the obvious spelling and a hang before
Python 3.12: a task cancelled in the loop step its event was set returns from it normally
-- the inner wait is done by the time the cancellation is delivered, and ``wait_for``
returns its result (CPython gh-86296, fixed in 3.12 by rewriting ``wait_for`` on
``asyncio.timeout``). A loop around such a wait then never ends, and whoever awaits the
cancelled task waits forever: the agent that never exited after its trainer exited 42
(stop 42, docs/hangs.md). ``asyncio.wait`` never swallows a cancellation. The package
runs on 3.10 and up (pyproject.toml), the image's agent on Debian's 3.11: the old
behaviour is the one to write for.
"""

from __future__ import annotations

import asyncio


async def until_set(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set (True) or ``timeout`` seconds passed (False; None: no
    limit), and stay cancellable: a cancellation is raised here even when the event was
    set in the same loop step. The inner wait is cancelled on every way out."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait((waiter,), timeout=timeout)
    finally:
        waiter.cancel()  # a no-op once it is done
    return bool(done)
