"""Test helpers around a real arbiter: simulated agents (real ArbiterLinks) and polling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from ftagent.agent.reporter import ArbiterLink
from ftagent.arbiter.process import ArbiterProcess, ftagent_cmd
from ftagent.config import ArbiterClientConfig, IdentityConfig

__all__ = ["ArbiterProcess", "all_released", "ftagent_cmd", "running_links", "wait_until"]


async def all_released(links: Sequence[ArbiterLink], generation: int = 0,
                       timeout: float = 5.0) -> bool:
    """Every link arrives at ``generation``'s barrier: True once each was released."""
    for lk in links:
        lk.arrive(generation)
    return all(await asyncio.gather(*(lk.wait_released(generation, timeout) for lk in links)))


async def wait_until(cond: Callable[[], bool | Awaitable[bool]], timeout: float,
                     what: str = "condition", interval: float = 0.02) -> None:
    """Poll ``cond`` until true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


@asynccontextmanager
async def running_links(address: str, job: str, world_size: int, *, ranks: Sequence[int] = (),
                        token: str = "", tls_ca: str = "", tls_cert: str = "",
                        tls_key: str = "", connect_timeout: float = 10.0,
                        node: str = "", gpus: Sequence[str] = (),
                        **kwargs: Any) -> AsyncIterator[list[ArbiterLink]]:
    """Simulated agents: one running ArbiterLink per rank, connected before the body runs.

    Rank r runs in pod-r on ``node`` (default node-r), its pod holding ``gpus``.
    ``kwargs`` go to ArbiterLink (max_restarts, alert_only, progress_interval).
    """
    client = ArbiterClientConfig(arbiter=address, token=token, tls_ca=tls_ca,
                                 tls_cert=tls_cert, tls_key=tls_key)
    links = [ArbiterLink(client,
                         IdentityConfig(job=job, rank=r, world_size=world_size, pod=f"pod-{r}",
                                        node=node or f"node-{r}", gpus=tuple(gpus)), **kwargs)
             for r in (ranks or range(world_size))]
    tasks = [asyncio.create_task(link.run()) for link in links]
    try:
        await wait_until(lambda: all(link.connected for link in links), connect_timeout,
                         f"{len(links)} links of {job} to connect")
        yield links
    finally:
        for link in links:
            await link.close()
        await asyncio.gather(*tasks, return_exceptions=True)
