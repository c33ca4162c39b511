"""``ftagent webhook`` as a real process over real HTTPS: every example's pods as real
AdmissionReview JSON, the patch applied with a real JSONPatch library and the result
validated against the Kubernetes schemas (offline); and every kind of bad input answered
cleanly while the server keeps serving."""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from ftagent.arbiter.auth import job_token
from tests.conftest import wait_for
from tests.webhook_pods import ExamplePod, admission_review, example_pods

SECRET = "webhook-test-secret-0123456789"
K8S_VERSION = "1.32"
PODS = example_pods()


class Webhook:
    def __init__(self, tmp: Path, *extra: str) -> None:
        self.ca = tmp / "ca.pem"
        env = {**os.environ, "FTAGENT_TOKEN": SECRET}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ftagent", "webhook", "--self-signed", "--ca-bundle-out",
             str(self.ca), "--listen", "127.0.0.1:0", "--arbiter", "arbiter.ftagent:9400",
             "--image", "ftagent:test", "--handshake-timeout", "0.5", "--max-body", "65536",
             *extra],
            stderr=subprocess.PIPE, env=env, text=True)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()  # blocks until the server says where it listens
        assert line.startswith("listening on "), line
        self.port = int(line.rsplit(":", 1)[1])
        self.ctx = ssl.create_default_context(cafile=str(self.ca))

    def connect(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("localhost", self.port, context=self.ctx, timeout=10)

    def post(self, body: bytes, conn: http.client.HTTPSConnection | None = None
             ) -> tuple[int, Any]:
        c = conn or self.connect()
        c.request("POST", "/mutate", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else None

    def review(self, doc: dict[str, Any]) -> dict[str, Any]:
        status, out = self.post(json.dumps(doc).encode())
        assert status == 200, out
        assert out["response"]["uid"] == doc["request"]["uid"]
        return dict(out["response"])

    def healthy(self) -> bool:
        c = self.connect()
        c.request("GET", "/healthz")
        return c.getresponse().status == 200 and self.proc.poll() is None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def webhook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webhook]:
    w = Webhook(tmp_path_factory.mktemp("webhook"))
    yield w
    w.stop()
    assert w.proc.returncode == 0


def patched(resp: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any]:
    assert resp["allowed"] is True and resp["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(resp["patch"]))
    return dict(jsonpatch.apply_patch(pod, patch))


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("ex", PODS, ids=[p.pod["metadata"]["name"] for p in PODS])
def test_example_pods_over_https(webhook: Webhook, ex: ExamplePod) -> None:
    validate(ex.pod)  # what the controller would create is a valid pod
    pod = patched(webhook.review(admission_review(ex.pod)), ex.pod)
    validate(pod)  # and so is what the API server stores after our patch
    c = next(x for x in pod["spec"]["containers"] if x["name"] == ex.container)
    assert c["command"][:3] == ["/opt/ftagent/ftagent", "run", "--"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["FTAGENT_JOB"] == ex.job
    if ex.arbitrated:
        assert env["FTAGENT_TOKEN"] == job_token(SECRET, "ml", ex.job)
    assert SECRET not in json.dumps(pod)
    assert pod["spec"]["initContainers"][0]["image"] == "ftagent:test"
    # reviewed again (reinvocation): nothing more to do
    again = webhook.review(admission_review(pod))
    assert again["allowed"] and "patch" not in again


def test_keep_alive_connection_serves_many(webhook: Webhook) -> None:
    conn = webhook.connect()
    for ex in PODS[:5]:
        status, out = webhook.post(json.dumps(admission_review(ex.pod)).encode(), conn)
        assert status == 200 and out["response"]["allowed"]


# ------------------------------------------------------------------ bad input


def test_malformed_json(webhook: Webhook) -> None:
    status, out = webhook.post(b'{"apiVersion": "admission.k8s.io/v1", "kind": ')
    assert status == 400 and "not JSON" in out["error"]
    assert webhook.healthy()


@pytest.mark.parametrize("body", [b"[]", b'"x"', b"{}", b'{"kind": "AdmissionReview"}',
                                  b'{"kind": "AdmissionReview", "request": {"object": {}}}',
                                  b"[" * 60_000])
def test_not_an_admission_review(webhook: Webhook, body: bytes) -> None:
    status, out = webhook.post(body)
    assert status == 400 and out["error"]
    assert webhook.healthy()


def test_oversized_body(webhook: Webhook) -> None:
    conn = webhook.connect()
    conn.putrequest("POST", "/mutate")
    conn.putheader("Content-Length", str(10 * 1024 * 1024))
    conn.endheaders()  # the body is never sent: the server answers from the headers
    r = conn.getresponse()
    assert r.status == 413 and b"over the limit" in r.read()
    assert webhook.healthy()


def test_pod_with_no_containers(webhook: Webhook) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "empty", "labels": {"ftagent.io/inject": "true"}},
           "spec": {"containers": []}}
    resp = webhook.review(admission_review(pod))
    assert resp["allowed"] and resp["warnings"]
    assert "no containers" in resp["auditAnnotations"]["injected"]


def test_unknown_kind_and_non_pod_object(webhook: Webhook) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}
    resp = webhook.review(admission_review(secret, kind="Secret"))
    assert resp["allowed"] and "patch" not in resp and "not a pod" in \
        resp["auditAnnotations"]["injected"]
    resp = webhook.review(admission_review([1, 2, 3]))  # type: ignore[arg-type]
    assert resp["allowed"] and "patch" not in resp and "not a pod" in \
        resp["auditAnnotations"]["injected"]
    resp = webhook.review(admission_review(PODS[0].pod, operation="UPDATE"))
    assert resp["allowed"] and "patch" not in resp


def test_http_garbage_and_wrong_routes(webhook: Webhook) -> None:
    with socket.create_connection(("127.0.0.1", webhook.port)) as raw, \
            webhook.ctx.wrap_socket(raw, server_hostname="localhost") as s:
        s.sendall(b"GARBAGE\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 400")
    c = webhook.connect()
    c.request("GET", "/mutate")
    assert c.getresponse().status == 405
    c = webhook.connect()
    c.request("GET", "/nope")
    assert c.getresponse().status == 404
    c = webhook.connect()
    c.request("POST", "/mutate", body=iter([b"{}"]), encode_chunked=True,
              headers={"Transfer-Encoding": "chunked"})
    assert c.getresponse().status == 411
    assert webhook.healthy()


def test_tls_client_that_never_finishes_its_handshake(webhook: Webhook) -> None:
    """A client that connects and sends half a ClientHello is dropped after the handshake
    timeout; meanwhile and after, others are served."""
    silent = socket.create_connection(("127.0.0.1", webhook.port))
    half = socket.create_connection(("127.0.0.1", webhook.port))
    half.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
    try:
        assert webhook.healthy()  # served while both hang
        for s in (silent, half):
            s.settimeout(10)
            t0 = time.monotonic()
            try:
                data = s.recv(100)
            except ConnectionResetError:
                data = b""
            assert data == b"" or data[:1] == b"\x15"  # closed (or a TLS alert, then closed)
            assert time.monotonic() - t0 < 10
    finally:
        silent.close()
        half.close()
    assert webhook.healthy()


def test_metrics_count_outcomes(webhook: Webhook) -> None:
    c = webhook.connect()
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    assert 'ftagent_webhook_reviews_total{outcome="patched"}' in text
    assert 'ftagent_webhook_reviews_total{outcome="malformed"}' in text


def test_flags_are_checked() -> None:
    r = subprocess.run([sys.executable, "-m", "ftagent", "webhook"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--self-signed" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ftagent", "webhook", "--tls-cert", "/nope",
                        "--tls-key", "/nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot load" in r.stderr and "Traceback" not in r.stderr


def test_workers_share_the_port_and_a_dead_worker_is_replaced(tmp_path: Path) -> None:
    """``--workers 2``: two processes answer on one port (SO_REUSEPORT); a worker killed is
    started again and the port keeps answering; SIGTERM stops every worker, exit 0."""
    import psutil

    w = Webhook(tmp_path, "--workers", "2")
    try:
        parent = psutil.Process(w.proc.pid)
        workers = wait_for(lambda: len(parent.children()) == 2 and parent.children(),
                           what="two workers")
        doc = admission_review(PODS[0].pod)
        conns = [w.connect() for _ in range(20)]  # spread by the kernel over both workers
        for c in conns:
            assert w.post(json.dumps(doc).encode(), c)[0] == 200
        workers[0].kill()
        wait_for(lambda: len(parent.children()) == 2 and workers[0] not in parent.children(),
                 what="a new worker")
        for _ in range(20):
            assert w.post(json.dumps(doc).encode())[0] == 200
        assert w.healthy()
    finally:
        w.stop()
    assert w.proc.returncode == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers[1:])
