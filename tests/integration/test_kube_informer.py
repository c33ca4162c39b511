"""Informers over the real ``kubernetes`` client and real HTTP to the fake API server."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from ftagent.kube.client import KubeConfigError, api_client, retry_after  # noqa: E402
from ftagent.kube.informer import (  # noqa: E402
    Backoff,
    Change,
    Informer,
    node_informer,
    pod_informer,
)
from tests.conftest import wait_for  # noqa: E402
from tests.kube_fake import FakeKube  # noqa: E402

JOB = "training.kubeflow.org/job-name"


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(bookmark_interval=60.0) as f:
        yield f


class Seen:
    """What a handler received, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changes: list[Change[Any]] = []

    def __call__(self, c: Change[Any]) -> None:
        with self.lock:
            self.changes.append(c)

    def of(self, key: str) -> list[str]:
        with self.lock:
            return [c.type for c in self.changes if c.key == key]

    def types(self) -> list[tuple[str, str]]:
        with self.lock:
            return [(c.type, c.key) for c in self.changes]


def _fast(**kw: Any) -> dict[str, Any]:
    kw.setdefault("backoff", Backoff(base=0.01, cap=0.05, rng=random.Random(1)))
    return kw


@pytest.fixture
def informers() -> Iterator[list[Informer[Any]]]:
    made: list[Informer[Any]] = []
    yield made
    for inf in made:
        inf.stop()


def _pods(fake: FakeKube, made: list[Informer[Any]], seen: Seen, **kw: Any) -> Informer[Any]:
    inf = pod_informer(api_client(fake.url), label_selector=JOB, handler=seen, **_fast(**kw))
    made.append(inf)
    inf.start()
    assert inf.wait_synced(10), "informer never synced"
    fake.wait_for_watches(1, "pods")
    return inf


def test_list_then_watch_sees_adds_modifies_deletes(fake: FakeKube,
                                                    informers: list[Informer[Any]]) -> None:
    fake.add_pod("ns", "w0", {JOB: "j1"}, node="n1")
    fake.add_pod("ns", "other", {"app": "web"}, node="n1")  # not a training pod
    seen = Seen()
    inf = _pods(fake, informers, seen, project=lambda o: (o["spec"].get("nodeName"),
                                                          o["status"].get("phase")))
    assert seen.types() == [("ADDED", "ns/w0")] and inf.get("ns/w0") == ("n1", "Running")
    fake.add_pod("ns", "w1", {JOB: "j1"}, node="n2")
    fake.set_pod_phase("ns", "w0", "Failed")
    fake.delete("pods", "w1", "ns")
    wait_for(lambda: seen.of("ns/w1") == ["ADDED", "MODIFIED", "DELETED"], what="w1 changes")
    wait_for(lambda: inf.get("ns/w0") == ("n1", "Failed"), what="w0 failed")
    assert "ns/other" not in [k for _, k in seen.types()]
    assert inf.get("ns/w1") is None and len(inf) == 1
    assert (fake.count("list", "pods"), fake.count("watch", "pods")) == (1, 1)


def test_a_falsy_projection_is_still_known(fake: FakeKube,
                                           informers: list[Informer[Any]]) -> None:
    fake.add_pod("ns", "a", {JOB: "j"})
    seen = Seen()
    inf = _pods(fake, informers, seen, project=lambda o: o["metadata"].get("annotations"))
    assert inf.get("ns/a") is None and len(inf) == 1
    fake.patch("pods", "a", {"metadata": {"annotations": {"k": "v"}}}, "ns")
    fake.delete("pods", "a", "ns")
    wait_for(lambda: seen.of("ns/a") == ["ADDED", "MODIFIED", "DELETED"], what="a's changes")


def test_resume_after_a_dropped_watch_misses_and_repeats_nothing(
        fake: FakeKube, informers: list[Informer[Any]]) -> None:
    fake.add_pod("ns", "a", {JOB: "j"})
    seen = Seen()
    inf = _pods(fake, informers, seen)
    mark = fake.mark()
    with fake.atomically():  # the stream is cut before it can carry these
        fake.drop_watches()
        fake.add_pod("ns", "b", {JOB: "j"})
        fake.delete("pods", "a", "ns")
        rv = fake.resource_version
    wait_for(lambda: seen.of("ns/a") == ["ADDED", "DELETED"] and inf.get("ns/b") is not None,
             what="changes made while the watch was down")
    rewatch = fake.wait_for_request("watch", "pods", after=mark)
    assert int(rewatch.query["resourceVersion"]) < rv  # resumed, not relisted
    assert seen.of("ns/b") == ["ADDED", "MODIFIED"]  # create, then add_pod's phase: once each
    assert fake.count("list", "pods") == 1 and inf.stats.relists == 0


def test_gone_relists_and_reports_the_delete_made_in_the_gap(
        fake: FakeKube, informers: list[Informer[Any]]) -> None:
    for name in ("a", "b"):
        fake.add_pod("ns", name, {JOB: "j"})
    seen = Seen()
    inf = _pods(fake, informers, seen)
    with fake.atomically():
        fake.drop_watches()
        fake.delete("pods", "a", "ns")
        fake.set_pod_phase("ns", "b", "Failed")
        fake.add_pod("ns", "c", {JOB: "j"})
        fake.compact()  # the informer's version is now older than the history: 410
    wait_for(lambda: fake.count("list", "pods") == 2, what="a relist after 410")
    wait_for(lambda: ("DELETED", "ns/a") in seen.types(), what="the delete from the gap")
    wait_for(lambda: inf.get("ns/c") is not None, what="the pod added in the gap")
    relisted = {c.key: c.type for c in seen.changes if c.relist}
    assert relisted == {"ns/a": "DELETED", "ns/b": "MODIFIED", "ns/c": "ADDED"}
    assert inf.get("ns/b")["status"]["phase"] == "Failed"
    assert inf.stats.relists == 1


def test_bookmarks_move_the_resume_version(fake: FakeKube,
                                           informers: list[Informer[Any]]) -> None:
    fake.add_pod("ns", "a", {JOB: "j"})
    inf = _pods(fake, informers, Seen())
    for i in range(3):  # writes of another kind move the global version, not the pods'
        fake.create("configmaps", {"metadata": {"name": f"c{i}", "namespace": "ns"}})
    now = str(fake.resource_version)
    fake.send_bookmarks()
    wait_for(lambda: inf.resource_version == now, what="the bookmark's version")
    mark = fake.mark()
    fake.drop_watches()
    assert fake.wait_for_request("watch", "pods", after=mark).query["resourceVersion"] == now
    assert inf.stats.bookmarks >= 1


def test_watch_timeout_rewatches_without_listing(fake: FakeKube,
                                                 informers: list[Informer[Any]]) -> None:
    _pods(fake, informers, Seen(), watch_timeout=1)
    wait_for(lambda: fake.count("watch", "pods") >= 3, timeout=30, what="re-watches")
    assert fake.count("list", "pods") == 1


def test_server_errors_back_off_with_capped_jitter(fake: FakeKube,
                                                   informers: list[Informer[Any]]) -> None:
    fake.add_pod("ns", "a", {JOB: "j"})
    fake.fail("list", "pods", 500, times=3)
    inf = _pods(fake, informers, Seen())
    assert inf.stats.errors == {500: 3} and len(inf.stats.waits) == 3
    assert all(0 <= w <= 0.05 for w in inf.stats.waits)
    assert fake.count("list", "pods") == 4 and inf.get("ns/a") is not None


def test_too_many_requests_waits_what_retry_after_says(fake: FakeKube,
                                                       informers: list[Informer[Any]]) -> None:
    fake.fail("list", "pods", 429, retry_after=1, times=1)
    inf = _pods(fake, informers, Seen())
    lists = [r for r in fake.requests if r.verb == "list"]
    assert [r.code for r in lists] == [429, 200]
    assert lists[1].at - lists[0].at >= 1.0  # a lower bound: never earlier than asked
    assert inf.stats.waits == [1.0]


def test_forbidden_is_one_clear_log_line(fake: FakeKube, informers: list[Informer[Any]],
                                         caplog: pytest.LogCaptureFixture) -> None:
    fake.add_node("n1")
    fake.forbid("list", "nodes", times=None)
    caplog.set_level(logging.WARNING, "ftagent.kube.informer")
    inf = node_informer(api_client(fake.url), forbidden_retry=0.02)
    informers.append(inf)
    inf.start()
    wait_for(lambda: fake.count("list", "nodes") >= 4, what="slow retries")
    lines = [r.getMessage() for r in caplog.records if "forbidden" in r.getMessage()]
    assert len(lines) == 1
    assert ('cannot list resource "nodes" in API group "" at the cluster scope' in lines[0]
            and "system:serviceaccount:ftagent:arbiter" in lines[0])
    assert not inf.synced
    fake.clear_faults()
    assert inf.wait_synced(10) and inf.get("n1") is not None


def test_stop_returns_promptly_from_a_blocked_watch(fake: FakeKube) -> None:
    inf = pod_informer(api_client(fake.url), watch_timeout=600, request_timeout=600)
    inf.start()
    assert inf.wait_synced(10)
    fake.wait_for_watches(1, "pods")
    t0 = time.monotonic()
    inf.stop(timeout=30)
    took = time.monotonic() - t0
    assert inf._thread is not None and not inf._thread.is_alive()
    assert took < 10, f"stop took {took:.1f}s with a 600 s watch open"
    wait_for(lambda: fake.open_watches("pods") == 0, what="the server to see the watch end")


def test_events_reach_the_asyncio_loop_in_order(fake: FakeKube) -> None:
    fake.add_node("n1")

    async def main() -> list[tuple[str, str, bool]]:
        got: list[tuple[str, str, bool]] = []
        loop_thread = threading.get_ident()

        def handle(c: Change[Any]) -> None:
            got.append((c.type, c.key, threading.get_ident() == loop_thread))

        inf = node_informer(api_client(fake.url), loop=asyncio.get_running_loop(),
                            handler=handle, project=lambda o: o["metadata"]["name"])
        inf.start()
        try:
            await asyncio.wait_for(inf.until_synced(), 10)
            assert got == [("ADDED", "n1", True)]  # the list's events come before synced
            await asyncio.to_thread(fake.wait_for_watches, 1, "nodes")
            await asyncio.to_thread(fake.set_node_ready, "n1", False)
            deadline = time.monotonic() + 10
            while len(got) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            await asyncio.to_thread(inf.stop)
        return got

    assert asyncio.run(main()) == [("ADDED", "n1", True), ("MODIFIED", "n1", True)]


def test_backoff_is_full_jitter_under_a_cap() -> None:
    b = Backoff(base=0.5, cap=4.0, rng=random.Random(7))
    waits = [b.next() for _ in range(10)]
    ceilings = [min(4.0, 0.5 * 2 ** i) for i in range(10)]
    assert all(0 <= w <= c for w, c in zip(waits, ceilings, strict=True))
    assert max(waits) > 0.5  # it grows
    b.reset()
    assert b.next() <= 0.5


# ----------------------------------------------------------------- api_client


def test_api_client_over_tls_with_a_ca_file_and_a_rotating_token_file(tmp_path: Any) -> None:
    from kubernetes import client

    token = tmp_path / "token"
    token.write_text("first\n")
    with FakeKube(tls=True, token="first") as fake:
        fake.add_node("n1")
        assert fake.ca_file is not None
        api = api_client(fake.url, token_file=str(token), ca_file=fake.ca_file)
        core = client.CoreV1Api(api)
        assert [n.metadata.name for n in core.list_node().items] == ["n1"]
        fake.token = "second"  # the kubelet rotated the projected token
        token.write_text("second\n")
        os.utime(token, ns=(time.time_ns(), time.time_ns() + 1_000_000_000))
        assert [n.metadata.name for n in core.list_node().items] == ["n1"]
        assert fake.requests[-1].headers["authorization"] == "Bearer second"
        # the server's certificate is checked: without the CA the client refuses it
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
            client.CoreV1Api(api_client(fake.url, token="second",
                                        connect_retries=0)).list_node()


def test_api_client_from_a_kubeconfig(fake: FakeKube, tmp_path: Any) -> None:
    from kubernetes import client

    fake.token = "kc-token"
    cfg = tmp_path / "config"
    cfg.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
        "users": [{"name": "arbiter", "user": {"token": "kc-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "arbiter"}}]}))
    fake.add_node("n1")
    api = api_client(kubeconfig=str(cfg), in_cluster=False)
    assert client.CoreV1Api(api).read_node("n1").metadata.name == "n1"


def test_api_client_without_any_config_says_what_to_give(tmp_path: Any) -> None:
    with pytest.raises(KubeConfigError, match="--kube-api URL"):
        api_client(kubeconfig=str(tmp_path / "missing"), in_cluster=False)
    with pytest.raises(KubeConfigError, match="does not exist"):
        api_client("https://10.0.0.1:6443", token_file=str(tmp_path / "none"))


def test_retry_after_reads_the_header_then_the_status() -> None:
    from kubernetes.client.rest import ApiException

    e = ApiException(status=429)
    e.headers = {"Retry-After": "3"}
    assert retry_after(e) == 3.0
    e = ApiException(status=429, body=json.dumps({"kind": "Status", "details": {
        "retryAfterSeconds": 9999}}))
    assert retry_after(e, cap=60) == 60.0
    e.headers = {"Retry-After": "nan"}
    assert retry_after(e) is None
    assert retry_after(ApiException(status=429)) is None


def test_retry_after_reads_an_http_date_too() -> None:
    """RFC 9110 allows an HTTP-date; the actuator's own parser (now gone) read seconds
    only and the informer's read no date: one parser for both, by the standard library."""
    import email.utils
    import time

    from kubernetes.client.rest import ApiException

    from ftagent.kube.actuator import _retry_after

    e = ApiException(status=429)
    e.headers = {"Retry-After": email.utils.formatdate(time.time() + 30, usegmt=True)}
    for got in (retry_after(e), _retry_after(e)):
        assert got is not None and 25 <= got <= 30, got
    e.headers = {"Retry-After": "120"}
    assert _retry_after(e) == 60.0 and retry_after(e) == 120.0
    e.headers = {"Retry-After": "not a date"}
    assert retry_after(e) is None and _retry_after(e) is None


def test_a_list_reaches_the_loop_in_batches_not_one_wakeup_per_object(
        fake: FakeKube) -> None:
    """Issue 33 (failover): a fresh arbiter lists 10,000 pods; each object handed over
    with its own call_soon_threadsafe was a write to the loop's self-pipe and a wake-up
    of the loop per pod, beside 10,000 agents reconnecting. A list's changes now come in
    batches of DELIVER_BATCH, still in order, before synced."""
    from ftagent.kube.informer import DELIVER_BATCH

    n = 2 * DELIVER_BATCH + 7
    for i in range(n):
        fake.add_node(f"n{i:04d}")

    async def main() -> tuple[list[str], int]:
        loop = asyncio.get_running_loop()
        got: list[str] = []
        calls = [0]
        real = loop.call_soon_threadsafe

        def counting(*args: Any, **kw: Any) -> Any:
            calls[0] += 1
            return real(*args, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
        inf = node_informer(api_client(fake.url), loop=loop, page_size=100,
                            handler=lambda c: got.append(c.key),
                            project=lambda o: o["metadata"]["name"])
        inf.start()
        try:
            await asyncio.wait_for(inf.until_synced(), 20)
            return list(got), calls[0]
        finally:
            await asyncio.to_thread(inf.stop)

    got, calls = asyncio.run(main())
    assert got == [f"n{i:04d}" for i in range(n)]  # every node, in the list's order
    assert calls <= 3 + 1, f"{calls} wake-ups of the loop for a list of {n}"  # + synced
