"""Before a warm restart of a rank that dials the job's rendezvous store: wait until it
listens.

With ``init_process_group``'s env:// rendezvous, rank 0's trainer hosts the TCPStore at
``MASTER_ADDR:MASTER_PORT`` and every other rank's trainer dials it. After a restart every
rank's trainer starts at the same moment (the barrier releases them together), so a
client often dials a few milliseconds before rank 0's new store listens; torch then sleeps
a jittered backoff (250-750 ms, measured: ``ExponentialBackoffWithJitter``, 500 ms ± 50 %)
before it dials again, and the whole job waits for it. So before a *warm* start (the
standby has imported everything: the trainer reaches ``init_process_group`` at once) a
client rank's agent probes the store's port (a TCP connect, closed at once: the store takes
it as a client that left) every ``POLL`` seconds, for at most ``MAX_WAIT``; the store
usually listens within tens of milliseconds. Never for rank 0, a cold start (its imports
would be serialised behind rank 0's), or a trainer without both variables (another
rendezvous). Past ``MAX_WAIT`` the trainer starts anyway: the wait can cost at most about
what it saves, never a start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

log = logging.getLogger("ftagent.agent")

POLL = 0.01  # seconds between probes
MAX_WAIT = 0.5  # about the mean of the backoff it saves (500 ms ± 50 %)
PROBE_TIMEOUT = 0.2  # one connect (a dropped SYN: the link is down, no point waiting)


def store_to_wait_for(env: Mapping[str, str]) -> tuple[str, int] | None:
    """The store a trainer with ``env`` dials as a client, or None when it hosts it
    (RANK 0), torchrun's agent hosts it, or its address is not in the environment."""
    addr = env.get("MASTER_ADDR", "").strip()
    port_s = env.get("MASTER_PORT", "").strip()
    rank = env.get("RANK", "").strip()
    # digits only, and few (int() of thousands of digits raises): the trainer's own env
    if not addr or not port_s.isdigit() or len(port_s) > 5 or not rank.isdigit() \
            or not rank.strip("0"):
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true":
        return None
    port = int(port_s)
    return (addr, port) if 0 < port < 65536 else None


async def _listening(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                           PROBE_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def wait_for_store(host: str, port: int, max_wait: float = MAX_WAIT) -> float | None:
    """Probe ``host:port`` until it accepts a connection, for at most ``max_wait`` seconds:
    the seconds it took, or None when it did not listen in time."""
    t0 = time.monotonic()
    while True:
        if await _listening(host, port):
            return time.monotonic() - t0
        left = max_wait - (time.monotonic() - t0)
        if left <= 0:
            log.debug("store %s:%d not listening after %.2fs: starting anyway",
                      host, port, max_wait)
            return None
        await asyncio.sleep(min(POLL, left))
