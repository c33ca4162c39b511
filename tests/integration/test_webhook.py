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
from ftagent.kube import certs
from tests.conftest import wait_for
from tests.webhook_pods import ExamplePod, admission_review, example_pods

SECRET = "webhook-test-secret-0123456789"
K8S_VERSION = "1.32"
PODS = example_pods()


class Webhook:
    def __init__(self, tmp: Path, *extra: str, tls: tuple[str, ...] = ()) -> None:
        self.ca = tmp / "ca.pem"
        self.arbiter_ca = tmp / "arbiter-ca.crt"
        self.arbiter_ca.write_bytes(certs.self_signed(["ftagent-arbiter"]).ca)
        # an arbiter secret in the environment, as deployments had it: it must not be used
        env = {**os.environ, "FTAGENT_TOKEN": SECRET}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ftagent", "webhook",
             *(tls or ("--self-signed", "--ca-bundle-out", str(self.ca))),
             "--listen", "127.0.0.1:0", "--arbiter", "arbiter.ftagent:9400",
             "--arbiter-ca", str(self.arbiter_ca),
             "--image", "ftagent:test", "--handshake-timeout", "0.5", "--max-body", "65536",
             *extra],
            stderr=subprocess.PIPE, env=env, text=True)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()  # blocks until the server says where it listens
        assert line.startswith("listening on "), line
        self.port = int(line.rsplit(":", 1)[1])
        self.ctx = ssl.create_default_context(cafile=str(self.ca)) if not tls else \
            ssl.create_default_context()

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
    assert c["command"][:4] == ["/opt/ftagent/busybox", "sh", "/opt/ftagent/ftagent-entry", "--"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["FTAGENT_JOB"] == ex.job
    # the webhook mints nothing: no token, nothing derived from the secret it was given
    assert "FTAGENT_TOKEN" not in env
    assert SECRET not in json.dumps(pod) and job_token(SECRET, "ml", ex.job) not in \
        json.dumps(pod)
    if ex.arbitrated:
        assert env["FTAGENT_TOKEN_FILE"] == "/var/run/secrets/ftagent/token"
        assert env["FTAGENT_TLS_CA"] == "/opt/ftagent/ca.crt"
        init_env = {e["name"]: e["value"] for e in pod["spec"]["initContainers"][0]["env"]}
        assert init_env["FTAGENT_CA_PEM"] == webhook.arbiter_ca.read_text().strip()
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
    webhook.review(admission_review(PODS[0].pod))
    webhook.post(b"nope")
    c = webhook.connect()
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    assert 'ftagent_webhook_reviews_total{result="injected",reason=""}' in text
    assert 'ftagent_webhook_reviews_total{result="malformed",reason=""}' in text


def test_flags_are_checked() -> None:
    r = subprocess.run([sys.executable, "-m", "ftagent", "webhook"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--self-signed" in r.stderr
    r = subprocess.run([sys.executable, "-m", "ftagent", "webhook", "--tls-cert", "/nope",
                        "--tls-key", "/nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot load" in r.stderr and "Traceback" not in r.stderr
    # the webhook holds no secret to derive tokens from (issue 20)
    r = subprocess.run([sys.executable, "-m", "ftagent", "webhook", "--self-signed",
                        "--token", SECRET], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--token" in r.stderr


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


def test_attacker_namespace_pod_gets_no_token_over_https(webhook: Webhook) -> None:
    """Issue 20's attack, as it was done: a plain HTTPS POST with no client certificate,
    a pod in namespace ``attacker`` whose env names ``kube-system``/``victim``. The answer
    carries no credential at all (the old one held a valid kube-system/victim token)."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "evil", "labels": {"ftagent.io/inject": "true"}},
           "spec": {"containers": [{
               "name": "main", "image": "x", "command": ["sh"],
               "env": [{"name": "FTAGENT_NAMESPACE", "value": "kube-system"},
                       {"name": "FTAGENT_JOB", "value": "victim"}]}]}}
    resp = webhook.review(admission_review(pod, namespace="attacker"))
    new = patched(resp, pod)
    text = json.dumps(new)
    assert job_token(SECRET, "kube-system", "victim") not in text
    assert job_token(SECRET, "attacker", "victim") not in text
    env = {e["name"] for e in new["spec"]["containers"][0]["env"]}
    assert "FTAGENT_TOKEN" not in env and "FTAGENT_TOKEN_FILE" in env


def test_rotated_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    """cert-manager/the kubelet rewrite tls.crt/tls.key in place: the running webhook
    serves the new pair from the next handshake (it read the files once: after a
    rotation every handshake failed and injection stopped silently)."""
    names = ["localhost"]
    first, second = certs.self_signed(names), certs.self_signed(names)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"

    def install(p: certs.Pems) -> None:  # as the kubelet does: new files, renamed in
        for path, data in ((cert, p.cert), (key, p.key)):
            tmp = path.with_suffix(".new")
            tmp.write_bytes(data)
            os.replace(tmp, path)

    install(first)
    w = Webhook(tmp_path, "--tls-reload-interval", "0.05",
                tls=("--tls-cert", str(cert), "--tls-key", str(key)))
    try:
        def served_by(p: certs.Pems) -> bool:
            ctx = ssl.create_default_context(cadata=p.ca.decode())
            try:
                c = http.client.HTTPSConnection("localhost", w.port, context=ctx, timeout=5)
                c.request("GET", "/healthz")
                return c.getresponse().status == 200
            except ssl.SSLError:
                return False

        assert served_by(first) and not served_by(second)
        kept = http.client.HTTPSConnection(
            "localhost", w.port, timeout=5,
            context=ssl.create_default_context(cadata=first.ca.decode()))
        kept.request("GET", "/healthz")
        assert kept.getresponse().read()
        # a half-done rotation (new cert, old key) is not taken: the old pair stays
        cert.write_bytes(second.cert)
        assert served_by(first)
        install(second)
        wait_for(lambda: served_by(second), timeout=10, what="the rotated certificate")
        assert not served_by(first)
        kept.request("GET", "/healthz")  # an open connection keeps working
        assert kept.getresponse().status == 200
    finally:
        w.stop()
    assert w.proc.returncode == 0


def test_arbiter_ca_is_re_read_when_its_file_changes(tmp_path: Path) -> None:
    """The CA pods get follows --arbiter-ca's file (a mounted Secret the kubelet
    updates): a new CA reaches the next pod, a removed file means none, no restart."""
    w = Webhook(tmp_path)
    try:
        pod = next(p for p in PODS if p.arbitrated).pod

        def ca_of_next_pod() -> str | None:
            new = patched(w.review(admission_review(pod)), pod)
            init = new["spec"]["initContainers"][0]
            return next((e["value"] for e in init.get("env", [])
                         if e["name"] == "FTAGENT_CA_PEM"), None)

        assert ca_of_next_pod() == w.arbiter_ca.read_text().strip()
        rotated = certs.self_signed(["ftagent-arbiter"]).ca
        tmp = w.arbiter_ca.with_suffix(".new")
        tmp.write_bytes(rotated)
        os.replace(tmp, w.arbiter_ca)
        assert ca_of_next_pod() == rotated.decode().strip()
        w.arbiter_ca.write_text("not a certificate")  # refused: the last good one stays
        assert ca_of_next_pod() == rotated.decode().strip()
        w.arbiter_ca.unlink()
        assert ca_of_next_pod() is None
    finally:
        w.stop()
