"""Network namespaces and veth pairs for tests and benchmarks: unique names, always removed.

Namespace names carry the process id and a counter, so parallel test runs (and
pytest-xdist workers) never collide; interface names only need to be unique inside
their namespace, so tests can use readable ones (``eth0``, ``peer0``). Deleting a
namespace destroys the veth ends inside it, which is the whole cleanup.

Index trick: a veth whose peer has the *same* ifindex is, to the kernel's linkwatch, like
a physical NIC -- its carrier changes are batched (up to ~1 s late). Give the two ends
different indices (the default here) to get carrier events at once, which keeps tests
fast; ``same_index=True`` reproduces the physical-NIC timing.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

_counter = itertools.count()
_index = itertools.count(100)  # fresh namespaces start at ifindex 2; stay clear of it


def unique_name(prefix: str = "fta") -> str:
    return f"{prefix}{os.getpid()}n{next(_counter)}"


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS`` and return its stdout; raise with its stderr on failure."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


async def aip(*args: str) -> None:
    """``ip ARGS`` without blocking the event loop (a source under test shares it)."""
    proc = await asyncio.create_subprocess_exec(
        "ip", *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {err.decode().strip()}")


@cache
def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here (the skip reason), or None if they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = unique_name("ftaprobe")
    try:
        ip("netns", "add", name)
    except (RuntimeError, OSError) as e:
        return f"cannot create a network namespace (needs root / CAP_NET_ADMIN): {e}"
    ip("netns", "del", name, check=False)
    return None


@contextmanager
def namespaces(count: int = 2, prefix: str = "fta") -> Iterator[list[str]]:
    """``count`` fresh network namespaces, deleted on exit whatever happens."""
    names: list[str] = []
    try:
        for _ in range(count):
            name = unique_name(prefix)
            ip("netns", "add", name)
            names.append(name)
        yield names
    finally:
        for name in names:
            ip("netns", "del", name, check=False)


def veth(ns_a: str, if_a: str, ns_b: str, if_b: str, *, up: bool = True,
         same_index: bool = False) -> None:
    """A veth pair ``ns_a/if_a`` <-> ``ns_b/if_b``, brought up unless ``up=False``."""
    idx_a = str(next(_index))
    idx_b = idx_a if same_index else str(next(_index))
    ip("link", "add", if_a, "index", idx_a, "netns", ns_a, "type", "veth",
       "peer", "name", if_b, "index", idx_b, "netns", ns_b)
    if up:
        ip("-n", ns_a, "link", "set", if_a, "up")
        ip("-n", ns_b, "link", "set", if_b, "up")


def link_up(ns: str, ifname: str) -> bool:
    """Whether ``ifname`` in ``ns`` has IFF_UP and LOWER_UP (as `ip` reports them)."""
    out = ip("-n", ns, "-o", "link", "show", "dev", ifname, check=False)
    flags = out.partition("<")[2].partition(">")[0].split(",")
    return "UP" in flags and "LOWER_UP" in flags


def require_netns() -> None:
    """Skip the calling test where namespaces are impossible; fail instead when
    ``FTAGENT_REQUIRE_NETNS=1`` (CI runs as root and must not skip these silently)."""
    import pytest

    reason = netns_unavailable()
    if reason is None:
        return
    if os.environ.get("FTAGENT_REQUIRE_NETNS", "") not in ("", "0"):
        pytest.fail(f"FTAGENT_REQUIRE_NETNS is set but {reason}")
    pytest.skip(reason)
