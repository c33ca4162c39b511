"""Who may talk to the arbiter, for which job, and that nothing a client sends can take
it down. A real arbiter on loopback, real gRPC; job tokens from ``ftagent token``'s
derivation (and once through the real command)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import socket
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ftagent.arbiter.auth import job_token, parse_expiring_token
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.wire.credentials import bearer
from tests.arbiter_helpers import ArbiterProcess, ftagent_cmd, running_links, wait_until

SECRET = "t0ken-secret-0123456789"
TOKEN = SECRET  # the admin credential
CONNECT = "/ftagent.v1.Arbiter/Connect"
Metadata = tuple[tuple[str, str], ...]


@pytest.fixture(scope="module")
def arbiter() -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--token", SECRET, "--metrics-port", "0",
                        "--metrics-addr", "127.0.0.1") as a:
        yield a


def hello(job: str = "sec", rank: int = 0, world: int = 1, namespace: str = "",
          **fields: object) -> pb.AgentMessage:
    return pb.AgentMessage(hello=pb.Hello(job=job, namespace=namespace, rank=rank,
                                          world_size=world, **fields))  # type: ignore[arg-type]


def crash(fault_id: str, exit_status: int = 87, generation: int = 0) -> pb.AgentMessage:
    return pb.AgentMessage(fault=pb.Fault(id=fault_id, kind=pb.FAULT_KIND_CRASH,
                                          severity=pb.SEVERITY_ERROR, message="exit",
                                          generation=generation, exit_status=exit_status))


def stream_status(address: str, messages: list[bytes], token: str = TOKEN,
                  metadata: Metadata | None = None, *, welcome_ends: bool = False,
                  ) -> tuple[grpc.StatusCode, str]:
    """Open Connect with raw bytes, send ``messages``, read until the arbiter ends it;
    with ``welcome_ends`` a Welcome ends it from our side and reads as OK (accepted).

    The synchronous client, because the asyncio one may report INTERNAL instead of the
    server's status when a write races the server ending the call (grpc/grpc#36066).
    """
    md = bearer(token) if metadata is None else metadata
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(CONNECT)(iter(messages), metadata=md, timeout=10)
        try:
            for raw in call:
                if welcome_ends and \
                        pb.ArbiterMessage.FromString(raw).WhichOneof("body") == "welcome":
                    call.cancel()
                    return grpc.StatusCode.OK, "welcome"
        except grpc.RpcError:
            pass
        return call.code(), call.details() or ""


@contextlib.asynccontextmanager
async def held_stream(address: str, message: pb.AgentMessage, token: str = TOKEN,
                      ) -> AsyncIterator[grpc.aio.StreamStreamCall]:
    """An agent's stream that said ``message`` (a Hello) and got its Welcome; kept open."""
    async with grpc.aio.insecure_channel(address) as ch:
        call = ch.stream_stream(CONNECT)(metadata=bearer(token))
        await call.write(message.SerializeToString())
        first = pb.ArbiterMessage.FromString(await asyncio.wait_for(call.read(), 10))
        assert first.WhichOneof("body") == "welcome"
        try:
            yield call
        finally:
            call.cancel()


async def read_command(call: grpc.aio.StreamStreamCall, timeout: float = 10) -> pb.Command:
    while True:
        m = pb.ArbiterMessage.FromString(await asyncio.wait_for(call.read(), timeout))
        if m.WhichOneof("body") == "command":
            return m.command


async def serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "ftagent.v1.Arbiter"):
            r = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            if r.status != health_pb2.HealthCheckResponse.SERVING:
                return False
    return True


async def list_jobs(address: str, token: str) -> list[tuple[str, str]]:
    async with grpc.aio.insecure_channel(address) as ch:
        got = await pb_grpc.ArbiterStub(ch).ListJobs(pb.ListJobsRequest(),
                                                     metadata=bearer(token), timeout=5)
    return [(j.namespace, j.job) for j in got.jobs]


async def get_job(address: str, job: str, token: str = TOKEN,
                  namespace: str = "") -> pb.JobInfo:
    async with grpc.aio.insecure_channel(address) as ch:
        return await pb_grpc.ArbiterStub(ch).GetJob(
            pb.GetJobRequest(job=job, namespace=namespace), metadata=bearer(token), timeout=5)


async def code_of(call: object) -> grpc.StatusCode:
    """The status an RPC ends with (OK when it answers)."""
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def first_watch_status(address: str, req: pb.WatchEventsRequest,
                             metadata: Metadata) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as ch:
        call = pb_grpc.ArbiterStub(ch).WatchEvents(req, metadata=metadata, timeout=5)
        try:
            await call.read()
        except grpc.aio.AioRpcError as e:
            return e.code()
        call.cancel()
        return grpc.StatusCode.OK


def tampered_tokens(token: str) -> list[str]:
    """One mac byte flipped; the job part changed (mac kept); the version changed;
    padding added; cut short."""
    version, ns, job, mac = token.split(".")
    raw = bytearray(base64.urlsafe_b64decode(mac + "=="))
    raw[5] ^= 0x01
    flipped = base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()
    other = base64.urlsafe_b64encode(b"victim").rstrip(b"=").decode()
    return [f"{version}.{ns}.{job}.{flipped}", f"{version}.{ns}.{other}.{mac}",
            f"ftj2.{ns}.{job}.{mac}", f"{version}.{ns}.{job}.{mac}=", token[:-3],
            job_token("another-secret-entirely", "", "tamper")]


# --------------------------------------------------------------------------- authentication


def test_health_is_serving_without_a_token(arbiter: ArbiterProcess) -> None:
    assert asyncio.run(serving(arbiter.address))


def test_every_rpc_refuses_callers_without_a_valid_token(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        a = arbiter.address
        wrong: list[Metadata] = [(), bearer("wrong"), (("authorization", "Basic " + SECRET),),
                                 bearer(SECRET) + bearer(SECRET)]
        async with grpc.aio.insecure_channel(a) as ch:
            stub = pb_grpc.ArbiterStub(ch)
            for md in wrong:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.ListJobs(pb.ListJobsRequest(), metadata=md, timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
                assert "--token" in (e.value.details() or "")
                assert await code_of(stub.GetJob(pb.GetJobRequest(job="sec"), metadata=md,
                                                 timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
                assert await first_watch_status(a, pb.WatchEventsRequest(replay=True), md) \
                    == grpc.StatusCode.UNAUTHENTICATED
                code, _ = stream_status(a, [hello().SerializeToString()], metadata=md)
                assert code == grpc.StatusCode.UNAUTHENTICATED, md
            await stub.ListJobs(pb.ListJobsRequest(), metadata=bearer(SECRET), timeout=5)
    asyncio.run(body())


def test_anonymous_peer_cannot_stop_a_job(arbiter: ArbiterProcess) -> None:
    """The reported attack: Hello{victim, rank 1 of 2, max_restarts 0} plus a crash with
    exit 87, anonymously or with another job's token: refused, the victim runs on."""
    async def body() -> None:
        a = arbiter.address
        attack = [hello("victim", rank=1, world=2, max_restarts=0).SerializeToString(),
                  crash("attack-1").SerializeToString()]
        victim = job_token(SECRET, "", "victim")
        async with held_stream(a, hello("victim", rank=0, world=2), victim) as call:
            assert stream_status(a, attack, token="")[0] == grpc.StatusCode.UNAUTHENTICATED
            code, details = stream_status(a, attack, token=job_token(SECRET, "", "attacker"))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "victim" in details
            info = await get_job(a, "victim")
            assert (info.state, info.generation, info.connected) == ("starting", 0, 1)
            assert not info.ranks[0].last_fault and not call.done()
    asyncio.run(body())


def test_tampered_job_tokens_are_unauthenticated(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        a = arbiter.address
        good = job_token(SECRET, "", "tamper")
        assert stream_status(a, [hello("tamper").SerializeToString()], good,
                             welcome_ends=True)[0] == grpc.StatusCode.OK
        for bad in tampered_tokens(good):
            assert stream_status(a, [hello("tamper").SerializeToString()], bad)[0] == \
                grpc.StatusCode.UNAUTHENTICATED, bad
            assert stream_status(a, [hello("victim").SerializeToString()], bad)[0] == \
                grpc.StatusCode.UNAUTHENTICATED, bad
            async with grpc.aio.insecure_channel(a) as ch:
                assert await code_of(pb_grpc.ArbiterStub(ch).ListJobs(
                    pb.ListJobsRequest(), metadata=bearer(bad), timeout=5)) == \
                    grpc.StatusCode.UNAUTHENTICATED
    asyncio.run(body())


# --------------------------------------------------------------------------- authorization


def test_a_job_token_speaks_for_its_job_only(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        a = arbiter.address
        tok_a = job_token(SECRET, "", "scope-a")
        denied = grpc.StatusCode.PERMISSION_DENIED
        async with running_links(a, "scope-a", 1, token=tok_a) as links_a, \
                running_links(a, "scope-b", 1, token=job_token(SECRET, "", "scope-b")):
            assert links_a[0].connected
            # Connect: as B, in another namespace, or switching jobs mid-stream
            for m in (hello("scope-b"), hello("scope-a", namespace="prod")):
                code, details = stream_status(a, [m.SerializeToString()], tok_a)
                assert code == denied and "scope-a" in details, details
            code, _ = stream_status(a, [hello("scope-a", rank=1, world=2).SerializeToString(),
                                        hello("scope-b").SerializeToString()], tok_a)
            assert code == denied
            # ListJobs: only A; the admin sees both
            assert await list_jobs(a, tok_a) == [("", "scope-a")]
            assert {("", "scope-a"), ("", "scope-b")} <= set(await list_jobs(a, SECRET))
            # GetJob: A (with or without its namespace), not B, not A elsewhere
            assert (await get_job(a, "scope-a", tok_a)).connected == 1
            assert (await get_job(a, "scope-b", SECRET)).connected == 1
            for job, ns in (("scope-b", ""), ("scope-a", "prod"), ("", "")):
                async with grpc.aio.insecure_channel(a) as ch:
                    assert await code_of(pb_grpc.ArbiterStub(ch).GetJob(
                        pb.GetJobRequest(job=job, namespace=ns), metadata=bearer(tok_a),
                        timeout=5)) == denied, (job, ns)
            # WatchEvents: B refused; A allowed
            assert await first_watch_status(a, pb.WatchEventsRequest(job="scope-b"),
                                            bearer(tok_a)) == denied
            assert await first_watch_status(a, pb.WatchEventsRequest(
                job="scope-a", replay=True), bearer(tok_a)) == grpc.StatusCode.OK
    asyncio.run(body())


def test_a_job_token_watching_every_job_sees_its_own_only(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        a = arbiter.address
        tok_a = job_token(SECRET, "", "watch-a")
        async with grpc.aio.insecure_channel(a) as ch:
            stub = pb_grpc.ArbiterStub(ch)
            scoped = stub.WatchEvents(pb.WatchEventsRequest(replay=True),
                                      metadata=bearer(tok_a))
            admin = stub.WatchEvents(pb.WatchEventsRequest(replay=True),
                                     metadata=bearer(SECRET))
            async with running_links(a, "watch-b", 1, token=SECRET):
                while (await asyncio.wait_for(admin.read(), 10)).job != "watch-b":
                    pass  # the admin sees every job's entries; B's exist now
                async with running_links(a, "watch-a", 1, token=tok_a):
                    # B's entries came first; the scoped watch's first entry is A's
                    got = await asyncio.wait_for(scoped.read(), 10)
                    assert (got.namespace, got.job) == ("", "watch-a")
            scoped.cancel()
            admin.cancel()
    asyncio.run(body())


def test_namespaces_are_part_of_the_scope(arbiter: ArbiterProcess) -> None:
    """A token for job `twin` without a namespace does not reach `prod/twin`, not even
    where GetJob would find a name that is unique across namespaces."""
    async def body() -> None:
        a = arbiter.address
        prod = job_token(SECRET, "prod", "twin")
        bare = job_token(SECRET, "", "twin")
        assert prod != bare
        async with held_stream(a, hello("twin", namespace="prod"), prod):
            assert await list_jobs(a, prod) == [("prod", "twin")]
            assert await list_jobs(a, bare) == []
            assert (await get_job(a, "twin", prod)).namespace == "prod"  # its own namespace
            assert (await get_job(a, "twin", SECRET)).namespace == "prod"  # unique name
            async with grpc.aio.insecure_channel(a) as ch:
                stub = pb_grpc.ArbiterStub(ch)
                assert await code_of(stub.GetJob(pb.GetJobRequest(job="twin"),
                                                 metadata=bearer(bare), timeout=5)) == \
                    grpc.StatusCode.NOT_FOUND
                assert await code_of(stub.GetJob(pb.GetJobRequest(job="twin", namespace="prod"),
                                                 metadata=bearer(bare), timeout=5)) == \
                    grpc.StatusCode.PERMISSION_DENIED
            code, _ = stream_status(a, [hello("twin", namespace="prod").SerializeToString()],
                                    bare)
            assert code == grpc.StatusCode.PERMISSION_DENIED
    asyncio.run(body())


def test_ftagent_token_round_trip_through_the_cli(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        a = arbiter.address
        env = {k: v for k, v in os.environ.items()
               if k not in ("FTAGENT_JOB", "FTAGENT_NAMESPACE", "FTAGENT_TOKEN")}

        def ftagent(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(ftagent_cmd(*args), capture_output=True, text=True,
                                  timeout=30, env={**env, **extra})
        made = await asyncio.to_thread(ftagent, "token", "--job", "cli-job",
                                       FTAGENT_TOKEN=SECRET)
        assert made.returncode == 0 and made.stderr == "", made.stderr
        token = made.stdout.strip()
        # expiring by default (--ttl: 30 days), the expiry inside the MAC
        exp = (parse_expiring_token(token) or ("", "", 0, b""))[2]
        assert made.stdout == token + "\n" and token == job_token(SECRET, "", "cli-job", exp)
        flag = await asyncio.to_thread(ftagent, "token", "--job", "cli-job", "--namespace",
                                       "ml", "--token", SECRET, "--ttl", "0")
        assert flag.returncode == 0 and flag.stdout.strip() == job_token(SECRET, "ml",
                                                                         "cli-job")
        none = await asyncio.to_thread(ftagent, "token", "--job", "cli-job")
        assert none.returncode == 2 and "FTAGENT_TOKEN" in none.stderr and not none.stdout
        async with running_links(a, "cli-job", 1, token=token) as links, \
                running_links(a, "cli-other", 1, token=SECRET):
            assert links[0].connected
            listing = await asyncio.to_thread(ftagent, "status", FTAGENT_ARBITER=a,
                                              FTAGENT_TOKEN=token)
            assert listing.returncode == 0, listing.stderr
            assert "cli-job" in listing.stdout and "cli-other" not in listing.stdout
            other = await asyncio.to_thread(ftagent, "status", "cli-other", FTAGENT_ARBITER=a,
                                            FTAGENT_TOKEN=token)
            assert other.returncode == 1 and "PERMISSION_DENIED" in other.stderr
    asyncio.run(body())


# --------------------------------------------------------------------------- malformed input


def test_garbage_and_streams_without_hello_are_rejected(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        a = arbiter.address
        code, details = stream_status(a, [b"\xff\xfe garbage \x00\x01"])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "AgentMessage" in details
        progress = pb.AgentMessage(progress=pb.ProgressSummary(step=1)).SerializeToString()
        code, details = stream_status(a, [progress])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "start with Hello" in details
        code, _ = stream_status(a, [b""])  # an empty message has no body
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        code, details = stream_status(a, [hello(rank=5, world=2).SerializeToString()])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "--rank" in details
        # bytes that are not even HTTP/2, straight to the port
        host, _, port = a.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 8)
            s.settimeout(5)
            with contextlib.suppress(OSError):
                s.recv(1024)
        assert await serving(a)
        async with running_links(a, "after-garbage", 1, token=TOKEN) as links:
            assert links[0].connected
    asyncio.run(body())


def test_out_of_range_values_are_refused_at_the_edge(arbiter: ArbiterProcess) -> None:
    """A Hello at generation 2**63-1 plus a fault: INVALID_ARGUMENT, nothing of it becomes
    state, and the listing of every job still works."""
    async def body() -> None:
        a = arbiter.address
        edge = 2**63 - 1
        async with held_stream(a, hello("edge", rank=0, world=2)) as call:
            before = await list_jobs(a, SECRET)
            hostile = [
                [hello("edge", rank=1, world=2, generation=edge), crash("edge-1", 1, edge)],
                [hello("edge", rank=1, world=2, restart_count=-1)],
                [hello("edge", rank=1, world=2, max_restarts=-5)],
                [hello("edge", rank=1, world=2, released_generation=edge)],
                [hello("edge", rank=1, world=2, pod="x" * 1000)],
                [hello("edge\n", rank=1, world=2)],
                [hello("edge", rank=1, world=2), pb.AgentMessage(
                    arrival=pb.BarrierArrival(generation=edge))],
            ]
            for messages in hostile:
                code, details = stream_status(a, [m.SerializeToString() for m in messages])
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (messages, code, details)
            assert "generation" in stream_status(
                a, [hostile[0][0].SerializeToString()])[1]
            assert await list_jobs(a, SECRET) == before
            info = await get_job(a, "edge")
            assert (info.generation, info.restarts, info.state) == (0, 0, "starting")
            assert not any(r.last_fault for r in info.ranks)
            # a fault of generation 2**63-1 on an accepted stream: ignored, acknowledged as
            # final (so it is not re-sent), nothing decided
            await call.write(crash("edge-2", 1, edge).SerializeToString())
            while (m := pb.ArbiterMessage.FromString(
                    await asyncio.wait_for(call.read(), 10))).WhichOneof("body") != "fault_ack":
                pass
            assert m.fault_ack.fault_id == "edge-2" and m.fault_ack.final
            assert "ignored" in m.fault_ack.outcome
            info = await get_job(a, "edge")
            assert (info.generation, info.restarts, info.state) == (0, 0, "starting")
            assert await list_jobs(a, SECRET) == before
    asyncio.run(body())


def test_messages_for_another_job_are_permission_denied(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        a = arbiter.address
        other = pb.AgentMessage(job="someone-else", progress=pb.ProgressSummary(step=1))
        code, details = stream_status(a, [hello("mine").SerializeToString(),
                                          other.SerializeToString()])
        assert code == grpc.StatusCode.PERMISSION_DENIED and "someone-else" in details
        code, _ = stream_status(a, [hello("mine").SerializeToString(),
                                    hello("theirs").SerializeToString()])
        assert code == grpc.StatusCode.PERMISSION_DENIED
    asyncio.run(body())


def test_rejections_are_counted_in_metrics(arbiter: ArbiterProcess) -> None:
    stream_status(arbiter.address, [b"\x00garbage"], token="")
    stream_status(arbiter.address, [hello("other").SerializeToString()],
                  token=job_token(SECRET, "", "mine"))
    port = next(line.rsplit(":", 1)[1].split("/")[0]
                for line in arbiter.log_text().splitlines() if line.startswith("metrics on"))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'ftagent_arbiter_rejected_requests_total{reason="unauthenticated"}' in text
    assert 'ftagent_arbiter_rejected_requests_total{reason="permission_denied"}' in text
    assert arbiter.proc is not None and arbiter.proc.poll() is None


# --------------------------------------------------------------------------- ranks (registry)


def test_a_live_rank_cannot_be_taken_over_by_another_agent(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        a = arbiter.address
        mine = hello("takeover", rank=0, world=2, agent_instance="agent-one")
        async with held_stream(a, mine) as call:
            code, _ = stream_status(a, [hello("takeover", rank=0, world=2,
                                              agent_instance="agent-two").SerializeToString()],
                                    welcome_ends=True)
            assert code == grpc.StatusCode.ALREADY_EXISTS, code
            # the live stream is still the rank's: its progress arrives
            await call.write(pb.AgentMessage(progress=pb.ProgressSummary(
                step=42)).SerializeToString())

            async def stepped() -> bool:
                info = await get_job(a, "takeover")
                return info.ranks[0].connected and info.ranks[0].step == 42
            await wait_until(stepped, 10, "the live stream's progress")
            assert not call.done()
    asyncio.run(body())


def test_the_same_agent_reconnecting_replaces_its_stream(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        a = arbiter.address
        mine = hello("reconnect", rank=0, world=2, agent_instance="agent-one")
        async with held_stream(a, mine) as old, held_stream(a, mine) as new:
            with pytest.raises(grpc.aio.AioRpcError):  # the old stream is ended
                while True:
                    raw = await asyncio.wait_for(old.read(), 10)
                    if raw is grpc.aio.EOF:
                        break
            await new.write(pb.AgentMessage(progress=pb.ProgressSummary(
                step=7)).SerializeToString())

            async def stepped() -> bool:
                info = await get_job(a, "reconnect")
                return info.connected == 1 and info.ranks[0].step == 7
            await wait_until(stepped, 10, "the new stream's progress")
    asyncio.run(body())


def test_a_later_hello_cannot_lower_the_restart_budget(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        a = arbiter.address
        first = hello("budget", rank=0, world=2, max_restarts=5, agent_instance="agent-one")
        later = hello("budget", rank=1, world=2, max_restarts=0, agent_instance="agent-two")
        async with held_stream(a, first) as call0, held_stream(a, later) as call1:
            assert (await get_job(a, "budget")).max_restarts == 5
            await call1.write(crash("budget-1", 87).SerializeToString())
            cmd = await read_command(call0)
            assert cmd.kind == pb.COMMAND_KIND_RESTART and cmd.generation == 1, cmd
            assert (await get_job(a, "budget")).max_restarts == 5
    asyncio.run(body())


# --------------------------------------------------------------------------- TLS


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls(tmp_path: Path) -> None:
    d = tmp_path
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext",
                 "-out", f"{name}.pem", cwd=d)
    mtls = grpc.ssl_channel_credentials(
        root_certificates=(d / "ca.pem").read_bytes(),
        private_key=(d / "client.key").read_bytes(),
        certificate_chain=(d / "client.pem").read_bytes())

    async def listed(address: str, token: str) -> tuple[grpc.StatusCode, list[str]]:
        async with grpc.aio.secure_channel(address, mtls) as ch:
            try:
                got = await pb_grpc.ArbiterStub(ch).ListJobs(
                    pb.ListJobsRequest(), metadata=bearer(token), timeout=5)
            except grpc.aio.AioRpcError as e:
                return e.code(), []
            return grpc.StatusCode.OK, [j.job for j in got.jobs]

    async def without_secret(address: str) -> None:
        async with running_links(address, "tls", 1, tls_ca=str(d / "ca.pem"),
                                 tls_cert=str(d / "client.pem"),
                                 tls_key=str(d / "client.key")) as links:
            assert links[0].connected
            assert await listed(address, "") == (grpc.StatusCode.OK, ["tls"])  # admin
        creds = grpc.ssl_channel_credentials(root_certificates=(d / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(address, creds) as ch:  # no client certificate
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.ArbiterStub(ch).ListJobs(pb.ListJobsRequest(), timeout=5)
        async with grpc.aio.insecure_channel(address) as ch:  # no TLS at all
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.ArbiterStub(ch).ListJobs(pb.ListJobsRequest(), timeout=5)

    async def with_secret(address: str) -> None:
        tok = job_token(SECRET, "", "tls-a")
        tls: dict[str, Any] = {"tls_ca": str(d / "ca.pem"), "tls_cert": str(d / "client.pem"),
                               "tls_key": str(d / "client.key")}
        async with running_links(address, "tls-a", 1, token=tok, **tls), \
                running_links(address, "tls-b", 1, token=SECRET, **tls):
            # a certificate alone is not enough where the arbiter has a secret
            assert (await listed(address, ""))[0] == grpc.StatusCode.UNAUTHENTICATED
            assert await listed(address, tok) == (grpc.StatusCode.OK, ["tls-a"])
            assert await listed(address, SECRET) == (grpc.StatusCode.OK, ["tls-a", "tls-b"])

    tls_flags = ("--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"),
                 "--tls-client-ca", str(d / "ca.pem"))
    with ArbiterProcess(*tls_flags) as a:
        asyncio.run(without_secret(a.address))
        asyncio.run(wait_until(lambda: a.proc is not None and a.proc.poll() is None, 1))
    with ArbiterProcess(*tls_flags, "--token", SECRET) as a:
        asyncio.run(with_secret(a.address))
