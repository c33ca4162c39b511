"""Which arbiter replica owns a job: the same answer in every agent, status and release."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def pick_arbiter(addresses: str | Sequence[str], job: str) -> str:
    """The replica that owns ``job``: sha256(job) mod n, the same in every agent and release.

    (Python's ``hash()`` is salted per process, so it cannot be used.)
    """
    if isinstance(addresses, str):
        addresses = addresses.split(",")
    replicas = [a.strip() for a in addresses if a.strip()]
    if not replicas:
        raise ValueError("no arbiter address")
    digest = hashlib.sha256(job.encode()).digest()
    return replicas[int.from_bytes(digest[:8], "big") % len(replicas)]
