"""The arbiter's gRPC server (grpc.aio): agent streams, status API, health, metrics.

Handlers are registered with raw bytes in and out: the arbiter parses each message
itself so that garbage is answered with INVALID_ARGUMENT (not a generic error from the
framework), and a command fanned out to 10k ranks is serialised once. One event loop
runs everything; per stream there is one reader task and the handler itself, which
writes the stream's outbox and alone ends the call (normally or with a ``Reject``).

Every RPC but health is served through ``auth.Guard``: the call is authenticated before
its handler runs, and the handler asks ``auth.authorize`` before it touches a job (Connect
at Hello, GetJob and WatchEvents for the job asked, ListJobs and WatchEvents per job
shown). A Hello's fields (``wire.checks``) and the generations of later messages
(``wire.limits``) are range-checked here, where they enter, before the registry sees them.

ReportNode takes a node agent's faults (``ftagent node``): checked whole
(``check_node_report``), allowed for the admin and that node's token only
(``authorize_node``), then each fault is decided for every live job with ranks on the
node (``Registry.node_report``: the routing is the fault intake's, ``intake.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from ftagent import metrics_http
from ftagent.arbiter import convert
from ftagent.arbiter.auth import (
    ALL_NODES,
    MIN_SECRET,
    Authenticator,
    Guard,
    PodLookup,
    Principal,
    authenticator_for,
    authorize,
    authorize_node,
    has_credentials,
    identity_problem,
    listens_on_loopback,
    reads_of,
)
from ftagent.arbiter.history import RETENTION, History, HistoryStore, NoStore
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import (
    MAX_RANKS_PER_JOB,
    RESTART_CEILING,
    Connection,
    Registry,
    Reject,
)
from ftagent.arbiter.timeline import Entry, Timeline
from ftagent.metrics import ArbiterMetrics, JobSnapshot
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.wire.checks import Refused, check_hello, check_message, check_node_report
from ftagent.wire.limits import OutOfRange
from ftagent.wire.tls_files import server_credentials as reloading_credentials

log = logging.getLogger("ftagent.arbiter")

SERVICE = "ftagent.v1.Arbiter"
TICK_SECONDS = 0.5
MAX_STREAMS_PER_IDENTITY = 1024
# seconds a pod credential's call waits for the pod watch's first list (under the agent's
# 5 s Welcome timeout, so it gets a clean UNAVAILABLE and retries with backoff)
POD_SYNC_WAIT = 4.0
SERVER_OPTIONS = [
    # gRPC sets SO_REUSEPORT by default: a second arbiter on the same port would then
    # silently take half of the agents and decide for them on its own.
    ("grpc.so_reuseport", 0),
    # Notice agents that vanished without closing (node lost, partition) within ~40 s.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),  # stack dumps
    # Calls not yet picked up by the event loop: the defaults (1,000 soft, 3,000 hard)
    # strand part of a reconnect storm (10k agents after an arbiter restart) for good.
    ("grpc.server.max_pending_requests", 50_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
]


@dataclass(frozen=True)
class ServerSettings:
    """What the server needs from ``ftagent arbiter``'s flags (see cmd/arbiter.py)."""

    listen: str = "127.0.0.1:0"
    token: str = ""  # the secret: the admin credential, and the key of every job token
    previous_token: str = ""  # during a rotation: the old secret, accepted beside it
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    metrics_port: int = -1
    metrics_addr: str = "0.0.0.0"
    policy: PolicyConfig = PolicyConfig()
    # Serve beyond loopback without any credentials (everyone is the admin there).
    insecure: bool = False
    state_dir: str = ""  # job history across restarts (history_file.py); "" keeps it in memory
    history_retention: float = RETENTION
    # Start as a standby: serve nothing but health until lead() (the Lease is ours).
    leader_elect: bool = False
    # --kube: callers authenticate with pod-bound ServiceAccount tokens (TokenReview)
    kube_identity: bool = False
    restart_ceiling: int = RESTART_CEILING  # the most restarts a job's Hello gets
    max_ranks_per_job: int = MAX_RANKS_PER_JOB
    # Open agent streams per credential: a pod's or node agent's token (a job token: up to
    # max_ranks_per_job); the admin is not counted.
    max_streams_per_identity: int = MAX_STREAMS_PER_IDENTITY


def exposure_problem(s: ServerSettings) -> str:
    """Why these settings must not be served ("" when they may): an arbiter reachable from
    other machines without credentials lets anyone stop any job."""
    if s.insecure or s.kube_identity or has_credentials(s.token, s.tls_client_ca) \
            or listens_on_loopback(s.listen):
        return ""
    return (f"refusing to listen on {s.listen} without credentials: anyone who reaches it "
            "could stop any job. Set --token SECRET (env FTAGENT_TOKEN) and give agents "
            "`ftagent token --job NAME`, or --tls-client-ca; or listen on 127.0.0.1; or pass "
            "--insecure")


class ArbiterServer:
    def __init__(self, settings: ServerSettings,
                 authenticator: Authenticator | None = None,
                 history_store: HistoryStore | None = None) -> None:
        """``authenticator`` replaces the one ``settings`` imply (token, client CA);
        ``history_store`` the one ``--state-dir`` implies (e.g. kube/job_record.py)."""
        self.settings = settings
        self.arbiter_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.prom = CollectorRegistry()
        self.metrics = ArbiterMetrics(self.prom)
        store = history_store
        if store is None and settings.state_dir:  # raises OSError if the directory is unusable
            from ftagent.arbiter.history_file import FileHistory

            store = FileHistory(settings.state_dir)
        self._store = store
        # Leader election: a standby serves only health and holds an empty registry; each
        # term as leader starts from a fresh one (history read again, agents re-register),
        # so nothing of an earlier term can act. Cluster hooks re-attach via on_registry.
        self.leading = not settings.leader_elect
        self.metrics.leader.set_function(lambda: float(self.leading))
        self._term = 0
        self._conns: set[Connection] = set()
        self._streams: dict[str, int] = {}  # open Connect streams per principal name
        # --kube: the pod as the arbiter's watch sees it (kube/cluster.py); a pod
        # principal's job comes from it, and its Hello is checked against it.
        self.pod_lookup: PodLookup | None = None
        # --kube: resolves once the pod watch's first list is in (a cold start, a
        # failover): a pod credential's call waits for it, briefly, instead of every agent
        # retrying into the list
        self.pods_synced: Callable[[], Awaitable[None]] | None = None
        # A node agent's report for a node was accepted (node, fault ids, kinds), before
        # its faults are decided: node-scope evidence for the cluster (kube/cluster.py).
        self.on_node_report: list[Callable[[str, list[str], set[str]], None]] = []
        # (node, healthy) of every report a node agent's own credential made
        self.on_node_health: list[Callable[[str, bool], None]] = []
        self.on_registry: list[Callable[[Registry], None]] = []
        self.timeline, self.history, self.registry = self._new_registry(
            store if self.leading else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics.watch_jobs(self._job_snapshots)
        self.health = health.aio.HealthServicer()
        self.guard = Guard(authenticator or authenticator_for(
            settings.token, settings.tls_client_ca, settings.previous_token), self.metrics)
        self.port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._tick: asyncio.Task[None] | None = None
        self._metrics_http: Any = None

    def _new_registry(self, store: HistoryStore | None
                      ) -> tuple[Timeline, History, Registry]:
        """A registry with its timeline and history (reads the store: blocking)."""
        timeline = Timeline()
        history = History(store or NoStore(), retention=self.settings.history_retention)
        registry = Registry(self.settings.policy, timeline, self.metrics, self.arbiter_id,
                            history=history, restart_ceiling=self.settings.restart_ceiling,
                            max_ranks_per_job=self.settings.max_ranks_per_job)
        return timeline, history, registry

    def _install(self, parts: tuple[Timeline, History, Registry]) -> None:
        self.timeline, self.history, self.registry = parts
        for fn in self.on_registry:
            try:
                fn(self.registry)
            except Exception:  # a hook's bug must not keep the arbiter from leading
                log.exception("registry hook %r failed", fn)

    @property
    def ready(self) -> bool:
        """Ready for agents (/readyz): serving and, with --leader-elect, the leader."""
        return self.leading and self._server is not None

    @property
    def serving(self) -> bool:
        """Able to serve agents (/readyz of every replica): started; a standby too, so that
        a rollout and a drain proceed (the Service's leader label picks the leader)."""
        return self._server is not None

    async def lead(self) -> None:
        """The Lease is ours: load history, start deciding, report SERVING."""
        if self.leading:
            return
        self._term += 1
        term = self._term
        loop = asyncio.get_running_loop()
        parts = await loop.run_in_executor(None, self._new_registry, self._store)
        if term != self._term:  # stepped down while loading
            return
        self.leading = True  # first: the registry hooks (cluster) see a leader
        self._install(parts)
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.warning("leading: serving agents and deciding (%d job%s in history)",
                    len(self.history.past), "" if len(self.history.past) == 1 else "s")

    def step_down(self, why: str = "lost the leader lease") -> None:
        """Stop acting at once (sync, so it runs in the loop's next turn): NOT_SERVING,
        every agent stream ended with UNAVAILABLE (agents retry and reach the leader), no
        more ticks; the registry is dropped and unwritten history discarded."""
        self._term += 1
        was = self.leading
        self.leading = False
        for name in ("", SERVICE):
            asyncio.ensure_future(self.health.set(name,
                                                  health_pb2.HealthCheckResponse.NOT_SERVING))
        streams = len(self._conns)
        for conn in list(self._conns):
            conn.reject(grpc.StatusCode.UNAVAILABLE, f"this arbiter {why}: reconnect (the "
                        "Service sends you to the leader)", "not_leader")
        self.timeline.end_watches(f"this arbiter {why}: watch again (the Service sends you "
                                  "to the leader)")
        discard = getattr(self._store, "discard_pending", None)
        if callable(discard):
            discard()
        self._install(self._new_registry(None))
        if was:
            log.error("standing by (%s): closed %d agent stream%s, deciding nothing",
                      why, streams, "" if streams == 1 else "s")

    def _leader_only(self, fn: Any) -> Any:
        """A standby answers UNAVAILABLE: agents retry with backoff until the Service sends
        them to the leader."""
        async def call(request: Any, context: grpc.aio.ServicerContext,
                       principal: Principal) -> Any:
            if not self.leading:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "this arbiter is the "
                                    "standby (not the leader): retry; the Service sends "
                                    "you to the leader")
            if principal.pod is not None:
                principal = await self._pod_principal(principal, context)
            return await fn(request, context, principal)

        return call

    async def _pod_principal(self, p: Principal, context: grpc.aio.ServicerContext
                             ) -> Principal:
        """A pod's credential speaks for the job its pod belongs to as the watch sees it
        (never for what the caller names): the principal narrowed to that job."""
        facts = self.pod_lookup(p.namespace or "", p.pod or "") \
            if self.pod_lookup is not None else None
        if facts is None and self.pods_synced is not None and self.pod_lookup is not None:
            with contextlib.suppress(asyncio.TimeoutError):  # then UNAVAILABLE: retry
                await asyncio.wait_for(self.pods_synced(), POD_SYNC_WAIT)
            facts = self.pod_lookup(p.namespace or "", p.pod or "")
        if facts is None or facts.uid != p.pod_uid:
            why = "is not (yet) in the arbiter's watch of ftagent pods" if facts is None \
                else f"is now uid {facts.uid}, not the credentials' {p.pod_uid}"
            self.metrics.rejected.labels(reason="unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"pod {p.namespace}/{p.pod} "
                                f"{why}: retry")
        assert facts is not None
        return replace(p, job=facts.job, name=f"{p.name} (job {facts.job})")

    async def start(self) -> str:
        """Bind and serve; returns the bound HOST:PORT (port 0 picks a free one)."""
        s = self.settings
        problem = exposure_problem(s)
        if problem:
            raise ValueError(problem)
        if 0 < len(s.token) < MIN_SECRET:
            log.warning("the secret (--token) is %d characters long: job tokens are only as "
                        "strong as it is; use %d or more random characters", len(s.token),
                        MIN_SECRET)
        creds = reloading_credentials(s.tls_cert, s.tls_key, s.tls_client_ca)  # rotations
        self._loop = asyncio.get_running_loop()
        server = grpc.aio.server(options=SERVER_OPTIONS)
        guard = self.guard
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Connect": grpc.stream_stream_rpc_method_handler(
                guard(self._leader_only(self._connect))),
            # read-only: operators get what the cluster's RBAC grants (arbiter/operators.py)
            "ListJobs": grpc.unary_unary_rpc_method_handler(
                guard(self._leader_only(self._list_jobs), lambda raw: ("list", "", ""))),
            "GetJob": grpc.unary_unary_rpc_method_handler(
                guard(self._leader_only(self._get_job), reads_of(pb.GetJobRequest, "get"))),
            "WatchEvents": grpc.unary_stream_rpc_method_handler(
                guard(self._leader_only(self._watch),
                      reads_of(pb.WatchEventsRequest, "watch"))),
            "ReportNode": grpc.unary_unary_rpc_method_handler(
                guard(self._leader_only(self._report_node))),
        }),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        host = s.listen.rpartition(":")[0]
        try:
            if creds is None:
                self.port = server.add_insecure_port(s.listen)
            else:
                self.port = server.add_secure_port(s.listen, creds)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {s.listen} ({e}): is the port in use? pick "
                          "another with --listen") from None
        await server.start()
        self._server = server
        serving = health_pb2.HealthCheckResponse.SERVING if self.leading \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, serving)
        if s.metrics_port >= 0:
            self._metrics_http, _ = metrics_http.start_http_server(
                s.metrics_port, s.metrics_addr, registry=self.prom)
            self.metrics_port = self._metrics_http.server_port
        self._tick = asyncio.create_task(self._ticker())
        return f"{host}:{self.port}"

    async def stop(self, grace: float = 2.0) -> None:
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._tick:
            self._tick.cancel()
        if self._server:
            await self._server.stop(grace)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        self.history.close()
        if self._store is not None and self._store is not self.history.store:
            self._store.close()  # a standby's: its history is an empty NoStore

    def _job_snapshots(self) -> list[JobSnapshot]:
        """The registry's jobs for a scrape: read on the event loop, which alone touches
        the registry (the /metrics server calls this from its own thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return []
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return self.registry.job_snapshots()

        async def snap() -> list[JobSnapshot]:
            return self.registry.job_snapshots()

        return asyncio.run_coroutine_threadsafe(snap(), loop).result(timeout=5)

    async def wait(self) -> None:
        if self._server:
            await self._server.wait_for_termination()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            if not self.leading:
                continue
            try:
                self.registry.tick()
            except Exception:  # a bug in a deadline must not stop the others
                log.exception("tick failed")

    # ------------------------------------------------------------------ Connect

    async def _connect(self, _requests: Any, context: grpc.aio.ServicerContext,
                       principal: Principal) -> None:
        conn = Connection(context.peer(), principal.pod_uid)
        registry = self.registry  # this term's: a step-down installs another
        who = "" if principal.admin else principal.name
        # a pod's or a node agent's credential: a few streams; a job token is the job's
        # every rank: one stream per rank
        cap, flag = (self.settings.max_streams_per_identity, "--max-streams-per-identity") \
            if principal.pod is not None or principal.node is not None or principal.job is None \
            else (self.settings.max_ranks_per_job, "--max-ranks-per-job")
        if who and self._streams.get(who, 0) >= cap:
            self.metrics.rejected.labels(reason="too_many_streams").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"these credentials "
                                f"({principal.name}) have {cap} streams open already "
                                f"({flag})")
            return
        if who:
            self._streams[who] = self._streams.get(who, 0) + 1
        self._conns.add(conn)
        reader = asyncio.create_task(self._read_loop(conn, context, principal))
        try:
            while True:
                item = await conn.outbox.get()
                if item is None:
                    return
                if isinstance(item, Reject):
                    self.metrics.rejected.labels(reason=item.reason).inc()
                    log.info("stream from %s rejected: %s", conn.peer, item.details)
                    await context.abort(item.code, item.details)
                    return
                data, fan = item
                try:
                    await context.write(data)
                except Exception as e:  # the agent went away mid-write
                    log.debug("write to %s failed: %r", conn.peer, e)
                    return
                if fan is not None:
                    fan.done()
        finally:
            reader.cancel()
            self._conns.discard(conn)
            if who:
                left = self._streams.get(who, 1) - 1
                if left > 0:
                    self._streams[who] = left
                else:
                    self._streams.pop(who, None)
            registry.disconnect(conn)

    async def _read_loop(self, conn: Connection, context: grpc.aio.ServicerContext,
                         principal: Principal) -> None:
        """Parse and dispatch the agent's messages; problems end the stream via a Reject."""
        registry = self.registry  # this term's (see _connect)
        job = namespace = ""
        try:
            while True:
                raw = await context.read()
                if raw is grpc.aio.EOF:
                    conn.close()
                    return
                received = time.monotonic()
                try:
                    m = pb.AgentMessage.FromString(raw)
                except DecodeError:
                    m = None
                body = m.WhichOneof("body") if m is not None else None
                if m is None or body is None:
                    conn.reject(grpc.StatusCode.INVALID_ARGUMENT, "not an ftagent.v1."
                                "AgentMessage: is the client an ftagent agent of the same "
                                "protocol version?", "invalid_argument")
                    return
                if not job:
                    if body != "hello":
                        conn.reject(grpc.StatusCode.INVALID_ARGUMENT, "the stream must "
                                    f"start with Hello, got {body}", "no_hello")
                        return
                    h = m.hello
                    try:
                        check_hello(h)  # before authorize: its message names what it got
                    except Refused as e:
                        conn.reject(e.code, str(e), e.reason)
                        return
                    facts = self.pod_lookup(h.namespace, h.pod) \
                        if self.pod_lookup is not None and principal.pod is not None else None
                    # a spare claims no rank; one the arbiter ASSIGNed a rank owns it by
                    # the arbiter's record, whatever index its pod's labels say
                    assigned = principal.pod is not None and registry.owner_of(
                        h.namespace, h.job, h.rank) == (h.pod, principal.pod_uid)
                    problem, retry = identity_problem(
                        principal, h.namespace, h.pod, h.node, h.job, h.rank, h.world_size,
                        facts, spare=h.spare or assigned)
                    if problem:
                        conn.reject(grpc.StatusCode.UNAVAILABLE if retry else
                                    grpc.StatusCode.PERMISSION_DENIED, problem,
                                    "identity_mismatch")
                        return
                    if not authorize(principal, h.namespace, h.job):
                        self.metrics.rejected.labels(reason="permission_denied").inc()
                        conn.reject(grpc.StatusCode.PERMISSION_DENIED, f"these credentials "
                                    f"({principal.name}) speak for {principal.scope()}: they "
                                    f"may not register for job {_name(h.namespace, h.job)!r}",
                                    "permission_denied")
                        return
                    try:
                        registry.hello(conn, h)
                    except Refused as e:  # e.g. the rank is held by another live agent
                        conn.reject(e.code, str(e), e.reason)
                        return
                    except ValueError as e:
                        conn.reject(grpc.StatusCode.INVALID_ARGUMENT, str(e), "bad_hello")
                        return
                    job, namespace = m.hello.job, m.hello.namespace
                    continue
                other = m.job if m.job and m.job != job else ""
                if body == "hello" and (m.hello.job, m.hello.namespace) != (job, namespace):
                    other = m.hello.job
                if other:
                    conn.reject(grpc.StatusCode.PERMISSION_DENIED, f"this stream said Hello "
                                f"for job {job!r}; it may not send for job {other!r}",
                                "permission_denied")
                    return
                if body == "hello":
                    continue  # a repeated Hello for the same job changes nothing
                try:
                    check_message(m)
                except OutOfRange as e:
                    conn.reject(grpc.StatusCode.INVALID_ARGUMENT, str(e), "out_of_range")
                    return
                try:
                    registry.handle(conn, m, received)
                except Exception:  # a bug on one message must not take the stream down
                    log.exception("handling %s from %s failed", body, conn.peer)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the call ended under us (client gone): just stop reading
            log.debug("stream from %s ended: %r", conn.peer, e)
            conn.close()

    # ------------------------------------------------------------------ status

    async def _list_jobs(self, raw: bytes, context: grpc.aio.ServicerContext,
                         principal: Principal) -> bytes:
        await self._parse(pb.ListJobsRequest, raw, context)
        out = pb.ListJobsResponse()
        for job in self.registry.listing():  # live jobs and the history's
            if authorize(principal, job.namespace, job.job):
                out.jobs.append(self.registry.info(job, ranks=False))
        return out.SerializeToString()

    async def _get_job(self, raw: bytes, context: grpc.aio.ServicerContext,
                       principal: Principal) -> bytes:
        req = await self._parse(pb.GetJobRequest, raw, context)
        if principal.admin:
            job = self.registry.find_any(req.job, req.namespace)
        else:  # a scoped caller names its own namespace when it gives none
            namespace = req.namespace or principal.namespace or ""
            if not authorize(principal, namespace, req.job):
                await self.guard.deny(context, principal, namespace, req.job, "read")
                return b""
            key = (namespace, req.job)
            job = self.registry.jobs.get(key) or self.registry.history.past.get(key)
        if job is not None and not authorize(principal, job.namespace, job.job):
            await self.guard.deny(context, principal, job.namespace, job.job, "read")
            return b""
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {req.job!r} here (or the "
                                "name is in several namespaces): run `ftagent status` to list "
                                "jobs")
            return b""
        info = self.registry.info(job, ranks=True, timeline_limit=req.timeline_limit)
        return info.SerializeToString()

    async def _watch(self, raw: bytes, context: grpc.aio.ServicerContext,
                     principal: Principal) -> None:
        req = await self._parse(pb.WatchEventsRequest, raw, context)
        namespace = req.namespace
        if not principal.admin:
            namespace = namespace or principal.namespace or ""
            if req.job and not authorize(principal, namespace, req.job):
                await self.guard.deny(context, principal, namespace, req.job, "watch")
                return
        # Without a job a scoped caller watches everything it may see, and only that.
        w = self.timeline.watch(req.job, namespace)

        def shown(e: Entry) -> bool:
            return w.wants(e) and authorize(principal, e.namespace, e.job)

        try:
            if req.replay:
                for e in self.timeline.replay(req.job, namespace):  # one job's worth
                    if shown(e):
                        await context.write(convert.entry_to_proto(e).SerializeToString())
            while True:
                got = await w.queue.get()
                if got is None and w.ended:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, w.ended)
                    return
                if got is None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "this watcher "
                                        "fell too far behind: reconnect")
                    return
                if authorize(principal, got.namespace, got.job):
                    await context.write(convert.entry_to_proto(got).SerializeToString())
        finally:
            self.timeline.unwatch(w)

    async def _report_node(self, raw: bytes, context: grpc.aio.ServicerContext,
                           principal: Principal) -> bytes:
        req = await self._parse(pb.NodeReport, raw, context)
        try:
            check_node_report(req)
        except Refused as e:
            self.metrics.rejected.labels(reason=e.reason).inc()
            await context.abort(e.code, str(e))
            return b""
        if not authorize_node(principal, req.node):
            self.metrics.rejected.labels(reason="permission_denied").inc()
            log.info("denied %s (%s) to report for node %s", context.peer(), principal.name,
                     req.node)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"these credentials "
                                f"({principal.name}) speak for {principal.scope()}: they may "
                                f"not report for node {req.node!r}")
            return b""
        if req.faults and (principal.node is not None or principal.admin):
            ids = [m.id for m in req.faults]
            kinds = {pb.FaultKind.Name(m.kind).removeprefix("FAULT_KIND_").lower()
                     for m in req.faults if m.kind in pb.FaultKind.values()}
            for hook in self.on_node_report:
                try:
                    hook(req.node, ids, kinds)
                except Exception:  # a hook's bug must not lose the report
                    log.exception("node report hook %r failed", hook)
        if principal.node is not None and principal.node != ALL_NODES:
            for health in self.on_node_health:
                try:
                    health(req.node, req.healthy and not req.faults)
                except Exception:
                    log.exception("node health hook %r failed", health)
        return self.registry.node_report(req).SerializeToString()

    async def _parse(self, cls: Any, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return cls.FromString(raw)
        except DecodeError:
            self.metrics.rejected.labels(reason="invalid_argument").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"not an ftagent.v1.{cls.__name__}")


def _name(namespace: str, job: str) -> str:
    return f"{namespace}/{job}" if namespace else job


async def serve_until(server: ArbiterServer, stop: asyncio.Event) -> None:
    """Run ``server`` until ``stop`` is set, then stop it gracefully."""
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await server.stop()
