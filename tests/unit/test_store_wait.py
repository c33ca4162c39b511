"""A warm restart of a client rank waits for the rendezvous store to listen (real sockets,
a real TCPStore on loopback)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from ftagent.agent.store_wait import store_to_wait_for, wait_for_store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_only_a_client_rank_of_an_env_rendezvous_waits() -> None:
    base = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert store_to_wait_for({**base, "RANK": "1"}) == ("10.0.0.1", 29500)
    assert store_to_wait_for({**base, "RANK": "0"}) is None, "rank 0 hosts the store"
    assert store_to_wait_for({**base, "RANK": "1",
                              "TORCHELASTIC_USE_AGENT_STORE": "True"}) is None
    assert store_to_wait_for({"RANK": "1", "MASTER_PORT": "29500"}) is None
    assert store_to_wait_for({**base, "RANK": "x"}) is None
    assert store_to_wait_for({**base, "MASTER_PORT": "70000", "RANK": "1"}) is None


def test_waits_until_the_store_listens_and_gives_up_after_its_bound() -> None:
    port = free_port()

    async def main() -> tuple[float | None, float | None]:
        none = await wait_for_store("127.0.0.1", port, max_wait=0.2)
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        async with server:
            took = await wait_for_store("127.0.0.1", port, max_wait=5.0)
        return none, took

    none, took = asyncio.run(main())
    assert none is None
    assert took is not None and took < 1.0


def test_a_client_that_waited_for_the_store_connects_without_torchs_backoff() -> None:
    """The cost it removes: a TCPStore client that dials before the server listens sleeps
    250-750 ms (torch's jittered backoff) before it dials again. Here the server listens
    50 ms after the wait began; the client, started when the wait returns, connects at
    once and the store works (the probe's connection did not upset it)."""
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    held: dict[str, object] = {}

    def server() -> None:
        time.sleep(0.05)  # not a synchronisation: rank 0's trainer is a little late
        held["store"] = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)

    th = threading.Thread(target=server)
    th.start()
    took = asyncio.run(wait_for_store("127.0.0.1", port, max_wait=10.0))
    assert took is not None
    t0 = time.monotonic()
    client = dist.TCPStore("127.0.0.1", port, 2, False)
    assert time.monotonic() - t0 < 0.2, "no refused dial, no backoff"
    th.join()
    client.set("k", "v")
    assert held["store"].get("k") == b"v"  # type: ignore[attr-defined]


def test_an_absurd_port_or_rank_is_no_store_to_wait_for_not_an_error() -> None:
    """Digits the int parser refuses (over 4300 of them) or a port past 65535: the start
    goes on without waiting, as for an address not in the environment."""
    from ftagent.agent.store_wait import store_to_wait_for
    base = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1"}
    assert store_to_wait_for(base) == ("10.0.0.1", 29500)
    assert store_to_wait_for({**base, "MASTER_PORT": "9" * 5000}) is None
    assert store_to_wait_for({**base, "MASTER_PORT": "70000"}) is None
    assert store_to_wait_for({**base, "RANK": "7" * 5000}) == ("10.0.0.1", 29500)
    assert store_to_wait_for({**base, "RANK": "000"}) is None
