"""The node agent's side of the wire: ``ReportNode`` to every arbiter shard, re-sent until acked.

Why unary calls and not the pod agents' stream: a node agent has nothing to receive
(no commands, no barrier), sends rarely (a fault is an event of the node, not of a
step), and must reach *every* shard -- jobs are sharded over arbiter replicas by a hash
of the job (``wire.shard``), so the ranks on one node may belong to jobs of every shard.
A shard that knows no job on the node records the report and acknowledges it.

Per shard (``--arbiter A,B,...``): a queue of faults not yet acknowledged by that shard,
sent in batches of at most ``limits.MAX_NODE_FAULTS``; a failed call is retried with
jittered, capped backoff; an empty report every ``heartbeat`` seconds tells the agent
which shards are up and how many ranks each knows on the node (for metrics and logs).
Fault ids make it idempotent: a report repeated after a lost answer is decided once per
job. The queue is bounded (``MAX_PENDING``, oldest dropped with a log line) so an
arbiter that is away for a day cannot grow the agent. A report the arbiter refuses as
malformed (INVALID_ARGUMENT) is dropped with an error line instead of being retried forever.

A fault that *lasts* (a GPU marked unhealthy, a link still down: ``report(lasting=KEY)``
until ``settle(KEY)``) is sent again, same id, to a shard whose heartbeat says it knows
more ranks on the node than at its previous answer: pods that came later (a new job, a
replacement pod, agents re-registering with an arbiter that restarted) would otherwise
never hear of it -- the first report found no job there, or another arbiter took it.
Jobs that already received it answer "already received"; bounded (``MAX_LASTING``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from ftagent import __version__
from ftagent.model import Fault
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.waits import until_set
from ftagent.wire import limits
from ftagent.wire.convert import fault_to_proto
from ftagent.wire.credentials import bearer, current_token
from ftagent.wire.tls_files import ChannelFiles

log = logging.getLogger("ftagent.node.reports")

HEARTBEAT = 30.0
CALL_TIMEOUT = 10.0
MAX_PENDING = 1000  # per shard; a node raises a handful of faults a day
BACKOFF_FIRST, BACKOFF_CAP = 0.2, 10.0
KEPT_OUTCOMES = 1000
MAX_LASTING = 64  # faults that still hold (a node has <= 16 GPUs and a few links)


@dataclass
class Shard:
    """One arbiter replica as the node agent sees it."""

    address: str
    pending: OrderedDict[str, pb.Fault] = field(default_factory=OrderedDict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    arbiter_id: str = ""
    ranks: int = -1  # ranks the shard knows on this node (-1: not heard from yet)
    up: bool = False
    last_error: str = ""
    reports: int = 0  # successful calls
    failures: int = 0
    dropped: int = 0  # faults dropped (queue full, or refused as malformed)


class NodeReporter:
    """Sends node faults to every shard in ``addresses``. Create and use it on one loop."""

    def __init__(self, addresses: Sequence[str], node: str, instance: str, *, token: str = "",
                 token_file: str = "", tls_ca: str = "", tls_cert: str = "", tls_key: str = "",
                 heartbeat: float = HEARTBEAT, version: str = __version__,
                 rng: random.Random | None = None) -> None:
        """Raises ValueError for unusable TLS files (a start-up error)."""
        self.shards = [Shard(a.strip()) for a in addresses if a.strip()]
        self.node, self.instance, self.version = node, instance, version
        self.token, self.token_file = token, token_file
        self.heartbeat = heartbeat
        self._tls = ChannelFiles(tls_ca, tls_cert, tls_key)  # a rotated CA: next connection
        self._rng = rng or random.Random()
        self.outcomes: OrderedDict[tuple[str, str], str] = OrderedDict()  # (shard, id) ->
        self.lasting: OrderedDict[str, pb.Fault] = OrderedDict()  # key -> the fault
        self.resent = 0  # lasting faults sent again to a shard that knows more ranks
        self._tasks: list[asyncio.Task[None]] = []

    def report(self, fault: Fault, *, lasting: str = "") -> None:
        """Queue ``fault`` for every shard (sent at once unless a shard is backing off);
        with ``lasting``, it is kept under that key until ``settle``, for pods to come."""
        msg = fault_to_proto(fault, 0)
        if lasting:
            self.lasting.pop(lasting, None)
            self.lasting[lasting] = msg
            while len(self.lasting) > MAX_LASTING:
                self.lasting.popitem(last=False)
        for s in self.shards:
            s.pending[msg.id] = msg
            while len(s.pending) > MAX_PENDING:
                fid, _ = s.pending.popitem(last=False)
                s.dropped += 1
                log.error("arbiter %s unreachable with %d node faults queued: dropped the "
                          "oldest (%s)", s.address, MAX_PENDING, fid)
            s.wake.set()

    def settle(self, lasting: str) -> None:
        """The fault kept under ``lasting`` holds no more (the link is back)."""
        self.lasting.pop(lasting, None)

    def unacked(self) -> int:
        return sum(len(s.pending) for s in self.shards)

    async def run(self) -> None:
        self._tasks = [asyncio.create_task(self._shard(s)) for s in self.shards]
        try:
            await asyncio.gather(*self._tasks)
        finally:
            for t in self._tasks:
                t.cancel()

    async def _shard(self, s: Shard) -> None:
        creds = self._tls.current()
        if creds is None:
            channel = grpc.aio.insecure_channel(s.address)
        else:
            channel = grpc.aio.secure_channel(s.address, creds)
        stub = pb_grpc.ArbiterStub(channel)
        attempt = 0
        last_call = -1e18
        try:
            while True:
                now = time.monotonic()
                if s.pending or now - last_call >= self.heartbeat:
                    last_call = now
                    if await self._call(stub, s):
                        attempt = 0
                        if s.pending:
                            continue
                    else:
                        delay = min(BACKOFF_CAP, BACKOFF_FIRST * 2 ** min(attempt, 16))
                        attempt += 1
                        await asyncio.sleep(delay * self._rng.uniform(0.5, 1.0))
                        continue
                s.wake.clear()
                wait = max(0.0, last_call + self.heartbeat - time.monotonic())
                await until_set(s.wake, wait)  # cancellable when woken (waits.py)
        finally:
            await channel.close(grace=None)

    async def _call(self, stub: pb_grpc.ArbiterStub, s: Shard) -> bool:
        batch = list(s.pending.values())[:limits.MAX_NODE_FAULTS]
        req = pb.NodeReport(node=self.node, agent_instance=self.instance,
                            agent_version=self.version, faults=batch,
                            healthy=not batch and not self.lasting)
        try:
            token = current_token(self.token, self.token_file)  # fresh: the kubelet rotates it
            ack = await stub.ReportNode(req, timeout=CALL_TIMEOUT, metadata=bearer(token))
        except grpc.aio.AioRpcError as e:
            s.failures += 1
            code, details = e.code(), (e.details() or "")[:300]
            error = f"{code.name}: {details}"
            if code is grpc.StatusCode.INVALID_ARGUMENT and batch:
                for f in batch:
                    s.pending.pop(f.id, None)
                s.dropped += len(batch)
                log.error("arbiter %s refused a node report (%s): dropped its %d faults",
                          s.address, error, len(batch))
            elif error != s.last_error:
                level = logging.ERROR if code in (grpc.StatusCode.UNAUTHENTICATED,
                                                  grpc.StatusCode.PERMISSION_DENIED,
                                                  grpc.StatusCode.UNIMPLEMENTED) else \
                    logging.WARNING
                log.log(level, "arbiter %s: node report failed (%s); retrying", s.address,
                        error)
            s.up, s.last_error = False, error
            return False
        if not s.up:
            log.info("arbiter %s (%s) takes node reports for %s; it knows %d rank(s) here",
                     s.address, ack.arbiter_id, self.node, ack.ranks)
        s.up, s.last_error, s.reports = True, "", s.reports + 1
        before, s.arbiter_id, s.ranks = s.ranks, ack.arbiter_id, ack.ranks
        for a in ack.acks:
            if s.pending.pop(a.fault_id, None) is not None:
                log.info("arbiter %s: node fault %s: %s", s.address, a.fault_id, a.outcome)
                self.outcomes[(s.address, a.fault_id)] = a.outcome
                while len(self.outcomes) > KEPT_OUTCOMES:
                    self.outcomes.popitem(last=False)
        if before >= 0 and ack.ranks > before:
            again = [m for m in self.lasting.values() if m.id not in s.pending]
            for m in again:
                s.pending[m.id] = m
            if again:
                self.resent += len(again)
                log.info("arbiter %s knows %d rank(s) on %s (was %d): sending again the %d "
                         "node fault(s) that still hold", s.address, ack.ranks, self.node,
                         before, len(again))
        return True
