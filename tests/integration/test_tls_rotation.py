"""Certificates rotate under running processes (issue 32.5): the arbiter read its TLS files
(or Secret) once, so with cert-manager agents were refused once the first certificate
expired. Real arbiter processes, real gRPC TLS connections before and after each rotation,
no restart of the process whose credentials rotate."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ftagent.arbiter.process import ArbiterProcess
from ftagent.kube import certs
from tests.arbiter_helpers import running_links, wait_until
from tests.conftest import wait_for
from tests.kube_fake import FakeKube


def write(d: Path, pems: certs.Pems) -> None:
    """Rotate as the kubelet does: each file replaced at once."""
    for name, data in (("tls.crt", pems.cert), ("tls.key", pems.key), ("ca.crt", pems.ca)):
        tmp = d / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, d / name)


def presented(port: int) -> bytes:
    """The certificate the server presents to a new connection (DER)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as s:
        der = s.getpeercert(binary_form=True)
    assert der
    return der


def der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode().split("-----END CERTIFICATE-----")[0]
                                    + "-----END CERTIFICATE-----\n")


def health(channel: grpc.Channel) -> int:
    return int(health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=5).status)


def tls_channel(port: int, ca: bytes) -> grpc.Channel:
    return grpc.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(ca))


def test_the_arbiter_serves_rotated_files_without_a_restart(tmp_path: Path) -> None:
    first, second = certs.self_signed(["localhost"]), certs.self_signed(["localhost"])
    write(tmp_path, first)
    with ArbiterProcess("--tls-cert", str(tmp_path / "tls.crt"),
                        "--tls-key", str(tmp_path / "tls.key")) as arb:
        pid = arb.proc.pid if arb.proc else 0
        assert presented(arb.port) == der(first.cert)
        before = tls_channel(arb.port, first.ca)
        assert health(before) == health_pb2.HealthCheckResponse.SERVING
        tmp = tmp_path / "tls.key.half"  # a half-written rotation is never served
        tmp.write_bytes(second.key[:40])
        os.replace(tmp, tmp_path / "tls.key")
        with tls_channel(arb.port, first.ca) as ch:
            assert health(ch) == health_pb2.HealthCheckResponse.SERVING
        write(tmp_path, second)
        wait_for(lambda: presented(arb.port) == der(second.cert), 20,
                 "the rotated certificate on a new connection")
        with tls_channel(arb.port, second.ca) as ch:  # verified with the new CA
            assert health(ch) == health_pb2.HealthCheckResponse.SERVING
        with tls_channel(arb.port, first.ca) as ch, pytest.raises(grpc.RpcError):
            health(ch)  # the old CA signed nothing the server presents now
        assert health(before) == health_pb2.HealthCheckResponse.SERVING  # kept its own
        before.close()
        assert arb.proc is not None and arb.proc.pid == pid and arb.proc.poll() is None


def test_an_agent_reads_the_rotated_ca_for_its_next_connection(tmp_path: Path) -> None:
    """The agent's CA file is rotated (the webhook's injected Secret, the node agent's
    mount) while it runs: its next connection verifies with the new CA."""
    server, agent = tmp_path / "server", tmp_path / "agent"
    server.mkdir()
    agent.mkdir()
    first, second = certs.self_signed(["localhost"]), certs.self_signed(["localhost"])
    write(server, first)
    write(agent, first)
    arb = ArbiterProcess("--tls-cert", str(server / "tls.crt"),
                         "--tls-key", str(server / "tls.key"))
    arb.start()

    async def run() -> None:
        async with running_links(f"localhost:{arb.port}", "rotate", 1,
                                 tls_ca=str(agent / "ca.crt")) as links:
            old = links[0].arbiter_id
            write(server, second)
            write(agent, second)
            arb.stop()  # the streams end: the agent connects again
            arb.start()
            await wait_until(lambda: links[0].connected and links[0].arbiter_id != old, 30,
                             "the agent connected to the new arbiter with the rotated CA")

    try:
        asyncio.run(run())
    finally:
        arb.stop()


def test_the_arbiter_follows_its_tls_secret(tmp_path: Path) -> None:
    """--tls-secret: cert-manager renews the Secret in place; the arbiter re-reads it."""
    first, second = certs.self_signed(["localhost"]), certs.self_signed(["localhost"])
    with FakeKube() as fake:
        fake.create("secrets", {"apiVersion": "v1", "kind": "Secret", "type":
                                "kubernetes.io/tls",
                                "metadata": {"name": "arb-tls", "namespace": "ftagent-system"},
                                "data": certs.secret_data(first)})
        with ArbiterProcess("--kube", "--kube-api", fake.url,
                            "--tls-secret", "arb-tls", "--tls-reload-interval", "0.5",
                            env={"POD_NAMESPACE": "ftagent-system"}) as arb:
            assert presented(arb.port) == der(first.cert)
            secret = fake.get("secrets", "arb-tls", "ftagent-system")
            assert secret is not None
            secret["data"] = certs.secret_data(second)
            fake.update("secrets", secret)
            wait_for(lambda: presented(arb.port) == der(second.cert), 20,
                     "the renewed Secret's certificate on a new connection")
            with tls_channel(arb.port, second.ca) as ch:
                assert health(ch) == health_pb2.HealthCheckResponse.SERVING
