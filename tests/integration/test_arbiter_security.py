"""Who may talk to the arbiter, and that nothing a client sends can take it down."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.wire.credentials import bearer
from tests.arbiter_helpers import ArbiterProcess, running_links, wait_until

TOKEN = "t0ken"
CONNECT = "/ftagent.v1.Arbiter/Connect"


@pytest.fixture(scope="module")
def arbiter() -> Iterator[ArbiterProcess]:
    with ArbiterProcess("--token", TOKEN, "--metrics-port", "0",
                        "--metrics-addr", "127.0.0.1") as a:
        yield a


def hello(job: str = "sec", rank: int = 0, world: int = 1) -> pb.AgentMessage:
    return pb.AgentMessage(hello=pb.Hello(job=job, rank=rank, world_size=world))


def stream_status(address: str, messages: list[bytes], token: str = TOKEN,
                  ) -> tuple[grpc.StatusCode, str]:
    """Open Connect with raw bytes, send ``messages``, read until the arbiter ends it.

    The synchronous client, because the asyncio one may report INTERNAL instead of the
    server's status when a write races the server ending the call (grpc/grpc#36066).
    """
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(CONNECT)(iter(messages), metadata=bearer(token), timeout=10)
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass
        return call.code(), call.details() or ""


async def serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "ftagent.v1.Arbiter"):
            r = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            if r.status != health_pb2.HealthCheckResponse.SERVING:
                return False
    return True


def test_health_is_serving_without_a_token(arbiter: ArbiterProcess) -> None:
    assert asyncio.run(serving(arbiter.address))


def test_missing_or_wrong_token_is_unauthenticated(arbiter: ArbiterProcess) -> None:
    async def body() -> None:
        async with grpc.aio.insecure_channel(arbiter.address) as ch:
            stub = pb_grpc.ArbiterStub(ch)
            for md in ((), bearer("wrong")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.ListJobs(pb.ListJobsRequest(), metadata=md, timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "--token" in (e.value.details() or "")
            await stub.ListJobs(pb.ListJobsRequest(), metadata=bearer(TOKEN), timeout=5)
        code, _ = stream_status(arbiter.address, [hello().SerializeToString()], "nope")
        assert code == grpc.StatusCode.UNAUTHENTICATED
    asyncio.run(body())


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
    port = next(line.rsplit(":", 1)[1].split("/")[0]
                for line in arbiter.log_text().splitlines() if line.startswith("metrics on"))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'ftagent_arbiter_rejected_requests_total{reason="unauthenticated"}' in text
    assert arbiter.proc is not None and arbiter.proc.poll() is None


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

    async def body(address: str) -> None:
        async with running_links(address, "tls", 1, tls_ca=str(d / "ca.pem"),
                                 tls_cert=str(d / "client.pem"),
                                 tls_key=str(d / "client.key")) as links:
            assert links[0].connected
        creds = grpc.ssl_channel_credentials(root_certificates=(d / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(address, creds) as ch:  # no client certificate
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.ArbiterStub(ch).ListJobs(pb.ListJobsRequest(), timeout=5)
        async with grpc.aio.insecure_channel(address) as ch:  # no TLS at all
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.ArbiterStub(ch).ListJobs(pb.ListJobsRequest(), timeout=5)

    with ArbiterProcess("--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"),
                        "--tls-client-ca", str(d / "ca.pem")) as a:
        asyncio.run(body(a.address))
        asyncio.run(wait_until(lambda: a.proc is not None and a.proc.poll() is None, 1))
