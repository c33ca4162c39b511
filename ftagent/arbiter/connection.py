"""One agent's open stream, as the registry sees it: an outbox its writer drains.

The registry runs on the server's event loop and never blocks: sending is a queue put;
the stream's writer task (server.py) does the I/O. A command to many streams carries one
``FanOut`` that observes the time until the last of them was written.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire import limits

MAX_OUTCOME = 200  # characters of a FaultAck's outcome


class FanOut:
    """One command written to many streams: observes the time until the last write."""

    __slots__ = ("left", "started", "observe")

    def __init__(self, left: int, started: float, observe: Callable[[float], None]) -> None:
        self.left, self.started, self.observe = left, started, observe

    def done(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.observe(time.monotonic() - self.started)


@dataclass(frozen=True)
class Reject:
    """End the stream with an error status (queued so that the stream's owner ends it)."""

    code: grpc.StatusCode
    details: str
    reason: str  # label of ftagent_arbiter_rejected_requests


Outgoing = tuple[bytes, FanOut | None] | Reject | None


class Connection:
    """One agent's open stream: serialized messages queued for the stream's writer.

    ``None`` in the outbox ends the stream normally (superseded by a newer stream of the
    same rank), a ``Reject`` ends it with an error status.
    """

    __slots__ = ("id", "peer", "key", "rank", "outbox", "pod_uid", "spare")

    def __init__(self, peer: str = "", pod_uid: str = "") -> None:
        self.id = uuid.uuid4().hex[:8]
        self.peer = peer
        # The verified pod (TokenReview) this stream speaks for; "" when the credential
        # names no pod (HMAC job token, admin). A rank first registered by a pod stays that
        # pod's while the pod exists.
        self.pod_uid = pod_uid
        self.key: tuple[str, str] | None = None  # (namespace, job) once Hello was accepted
        self.rank = -1
        self.spare = ""  # a spare's stream (no rank yet): its agent instance
        self.outbox: asyncio.Queue[Outgoing] = asyncio.Queue()

    def send(self, data: bytes, fanout: FanOut | None = None) -> None:
        self.outbox.put_nowait((data, fanout))

    def reject(self, code: grpc.StatusCode, details: str, reason: str) -> None:
        self.outbox.put_nowait(Reject(code, details, reason))

    def close(self) -> None:
        self.outbox.put_nowait(None)

    def ack(self, fault_id: str, final: bool, outcome: str) -> None:
        """A FaultAck: ``final`` once the fault's decision is made (the agent forgets it)."""
        if len(outcome) > MAX_OUTCOME:  # a verdict's name fits; a reason may not
            outcome = limits.clip(outcome, MAX_OUTCOME)
        self.send(pb.ArbiterMessage(fault_ack=pb.FaultAck(
            fault_id=fault_id, final=final, outcome=outcome)).SerializeToString())


def send_all(sends: Iterable[tuple[Connection, bytes]], fanout: FanOut | None = None,
             then: Iterable[tuple[Connection, bytes]] = ()) -> None:
    """One command to many streams (commands.send): each its bytes, one ``fanout``; then
    ``then`` (the final FaultAcks the decision settled), each after it on its stream and
    outside the fan-out's count."""
    for conn, data in sends:
        conn.outbox.put_nowait((data, fanout))
    for conn, data in then:
        conn.outbox.put_nowait((data, None))


def live(conn: object | None) -> Connection | None:
    """A rank's connection (``RankState.conn``) as a Connection, None when it has none."""
    return conn if isinstance(conn, Connection) else None
