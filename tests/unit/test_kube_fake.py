"""The fake API server answers the real ``kubernetes`` client as the real server would."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client, watch  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402

from tests.kube_fake import JSON_PATCH, MERGE, STRATEGIC, FakeKube  # noqa: E402
from tests.kube_fake.patch import merge_patch, strategic_merge_patch  # noqa: E402
from tests.kube_fake.resources import SelectorError, parse_label_selector  # noqa: E402


def _pod(name: str, labels: dict[str, str] | None = None, node: str | None = "n1") -> dict:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "i"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def _status(e: ApiException) -> dict:
    return json.loads(e.body)


@pytest.fixture
def fake_kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


@pytest.fixture
def core(fake_kube: FakeKube) -> client.CoreV1Api:
    return client.CoreV1Api(fake_kube.client())


def test_create_get_and_already_exists(core: client.CoreV1Api) -> None:
    p = core.create_namespaced_pod("ns", _pod("p"))
    assert p.metadata.uid and p.metadata.creation_timestamp and p.status.phase == "Pending"
    assert core.read_namespaced_pod("p", "ns").metadata.resource_version == \
        p.metadata.resource_version
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod("ns", _pod("p"))
    assert e.value.status == 409
    assert _status(e.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'pods "p" already exists', "reason": "AlreadyExists", "code": 409,
        "details": {"name": "p", "kind": "pods"}}


def test_not_found_is_a_status(core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod("nope", "ns")
    assert e.value.status == 404
    assert _status(e.value)["reason"] == "NotFound"
    assert _status(e.value)["message"] == 'pods "nope" not found'


def test_stale_update_conflicts(fake_kube: FakeKube) -> None:
    leases = client.CoordinationV1Api(fake_kube.client())
    lease = leases.create_namespaced_lease("ns", {"metadata": {"name": "l"},
                                                  "spec": {"holderIdentity": "a"}})
    lease.spec.holder_identity = "b"
    fresh = leases.replace_namespaced_lease("l", "ns", lease)
    assert int(fresh.metadata.resource_version) > int(lease.metadata.resource_version)
    lease.spec.holder_identity = "c"  # still carries the old resourceVersion
    with pytest.raises(ApiException) as e:
        leases.replace_namespaced_lease("l", "ns", lease)
    assert e.value.status == 409
    st = _status(e.value)
    assert st["reason"] == "Conflict"
    assert st["message"].startswith('Operation cannot be fulfilled on leases.coordination.k8s.io'
                                    ' "l": the object has been modified')
    assert fake_kube.get("leases.coordination.k8s.io", "l", "ns")["spec"]["holderIdentity"] == "b"


def test_noop_update_keeps_the_version(fake_kube: FakeKube) -> None:
    cm = fake_kube.create("configmaps", {"metadata": {"name": "c", "namespace": "ns"},
                                          "data": {"a": "1"}})
    again = fake_kube.patch("configmaps", "c", {"data": {"a": "1"}}, "ns")
    assert again["metadata"]["resourceVersion"] == cm["metadata"]["resourceVersion"]


def test_strategic_merge_conditions_by_type_taints_replace(core: client.CoreV1Api,
                                                           fake_kube: FakeKube) -> None:
    fake_kube.add_node("n1")
    core.patch_node("n1", {"spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]}})
    node = core.patch_node("n1", {"spec": {"taints": [{"key": "b", "effect": "NoSchedule"}]}})
    assert [t.key for t in node.spec.taints] == ["b"]  # listType=atomic, as on the real server
    node = core.patch_node_status("n1", {"status": {"conditions": [
        {"type": "FtagentGPUHealthy", "status": "False", "reason": "Xid79"}]}})
    assert {c.type: c.status for c in node.status.conditions} == {
        "Ready": "True", "FtagentGPUHealthy": "False"}
    # a main-resource patch cannot change status; a status patch cannot change spec
    node = core.patch_node("n1", {"status": {"conditions": []}, "spec": {"unschedulable": True}})
    assert len(node.status.conditions) == 2 and node.spec.unschedulable
    node = core.patch_node_status("n1", {"spec": {"unschedulable": False}})
    assert node.spec.unschedulable


def test_merge_and_json_patch(fake_kube: FakeKube) -> None:
    fake_kube.create("configmaps", {"metadata": {"name": "c", "namespace": "ns",
                                                 "annotations": {"x": "1", "y": "2"}}})
    out = fake_kube.patch("configmaps", "c", {"metadata": {"annotations": {"x": None}}}, "ns",
                          MERGE)
    assert out["metadata"]["annotations"] == {"y": "2"}
    out = fake_kube.patch("configmaps", "c", [{"op": "add", "path": "/data", "value": {"k": "v"}}],
                          "ns", JSON_PATCH)
    assert out["data"] == {"k": "v"}
    api = client.CoreV1Api(fake_kube.client())
    with pytest.raises(ApiException) as e:
        api.patch_namespaced_config_map("c", "ns", [{"op": "test", "path": "/data/k",
                                                     "value": "other"}])
    assert e.value.status == 422


def test_custom_objects_refuse_strategic_merge(fake_kube: FakeKube) -> None:
    co = client.CustomObjectsApi(fake_kube.client())
    fake_kube.create("pytorchjobs.kubeflow.org", {"metadata": {"name": "j", "namespace": "ns"},
                                                  "spec": {"pytorchReplicaSpecs": {}}})
    out = co.patch_namespaced_custom_object("kubeflow.org", "v1", "ns", "pytorchjobs", "j",
                                            {"metadata": {"annotations": {"a": "b"}}})
    assert out["metadata"]["annotations"] == {"a": "b"} and out["kind"] == "PyTorchJob"
    with pytest.raises(ApiException) as e:
        co.patch_namespaced_custom_object("kubeflow.org", "v1", "ns", "pytorchjobs", "j",
                                          {"metadata": {}}, _content_type=STRATEGIC)
    assert e.value.status == 415


def test_strategic_merge_directives() -> None:
    cur = {"status": {"conditions": [{"type": "A", "status": "True"},
                                     {"type": "B", "status": "True"}]},
           "metadata": {"finalizers": ["x"]}}
    out = strategic_merge_patch(cur, {"status": {"conditions": [
        {"type": "A", "$patch": "delete"}, {"type": "C", "status": "False"}]},
        "metadata": {"finalizers": ["y"], "$deleteFromPrimitiveList/finalizers": ["x"]}})
    assert [c["type"] for c in out["status"]["conditions"]] == ["B", "C"]
    # $deleteFromPrimitiveList runs on the merged list in this fake; either way x is gone
    assert "x" not in out["metadata"]["finalizers"]
    assert merge_patch({"a": [1, 2], "b": {"c": 1}}, {"a": [3], "b": {"c": None}}) == \
        {"a": [3], "b": {}}


def test_graceful_pod_deletion(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    core.create_namespaced_pod("ns", _pod("p"))
    gone_now = core.create_namespaced_pod("ns", _pod("unscheduled", node=None))
    assert gone_now
    core.delete_namespaced_pod("unscheduled", "ns", grace_period_seconds=30)
    assert fake_kube.get("pods", "unscheduled", "ns") is None  # never scheduled: no grace
    out = core.delete_namespaced_pod("p", "ns", grace_period_seconds=30)
    assert out.metadata.deletion_timestamp and out.metadata.deletion_grace_period_seconds == 30
    assert fake_kube.get("pods", "p", "ns") is not None  # Terminating
    fake_kube.finish_termination("ns", "p")
    assert fake_kube.get("pods", "p", "ns") is None
    core.create_namespaced_pod("ns", _pod("q"))
    core.delete_namespaced_pod("q", "ns", grace_period_seconds=30)
    core.delete_namespaced_pod("q", "ns", grace_period_seconds=0)  # force delete
    assert fake_kube.get("pods", "q", "ns") is None


def test_delete_preconditions(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    core.create_namespaced_pod("ns", _pod("p"))
    with pytest.raises(ApiException) as e:
        core.delete_namespaced_pod("p", "ns", body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid="other")))
    assert e.value.status == 409 and "Precondition failed: UID" in _status(e.value)["message"]


def test_label_and_field_selectors(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    fake_kube.add_pod("a", "p1", {"job": "j1", "role": "worker"}, node="n1")
    fake_kube.add_pod("a", "p2", {"job": "j2"}, node="n2")
    fake_kube.add_pod("b", "p3", {"job": "j3", "role": "master"}, node="n1")

    def names(**kw: Any) -> list[str]:
        return sorted(p.metadata.name for p in core.list_pod_for_all_namespaces(**kw).items)

    assert names(label_selector="job") == ["p1", "p2", "p3"]
    assert names(label_selector="!role") == ["p2"]
    assert names(label_selector="job=j1") == ["p1"]
    assert names(label_selector="job in (j1, j3),role") == ["p1", "p3"]
    assert names(label_selector="role notin (master)") == ["p1", "p2"]
    assert names(label_selector="role!=worker") == ["p2", "p3"]
    assert names(field_selector="spec.nodeName=n1") == ["p1", "p3"]
    assert names(field_selector="metadata.name=p2") == ["p2"]
    assert [p.metadata.name for p in core.list_namespaced_pod("b").items] == ["p3"]
    with pytest.raises(ApiException) as e:
        core.list_pod_for_all_namespaces(field_selector="spec.bogus=1")
    assert e.value.status == 400
    with pytest.raises(SelectorError):
        parse_label_selector("a in b")


def test_list_chunking(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    for i in range(5):
        fake_kube.add_pod("ns", f"p{i}")
    first = core.list_namespaced_pod("ns", limit=2)
    assert len(first.items) == 2 and first.metadata._continue
    seen = [p.metadata.name for p in first.items]
    tok = first.metadata._continue
    while tok:
        page = core.list_namespaced_pod("ns", limit=2, _continue=tok)
        seen += [p.metadata.name for p in page.items]
        assert page.metadata.resource_version == first.metadata.resource_version
        tok = page.metadata._continue
    assert seen == [f"p{i}" for i in range(5)]


def _collect(api_call: Any, *args: Any, **kw: Any) -> list[dict]:
    w = watch.Watch()
    return [{"type": e["type"], "rv": e["raw_object"]["metadata"]["resourceVersion"],
             "name": e["raw_object"]["metadata"].get("name"), "raw": e["raw_object"]}
            for e in w.stream(api_call, *args, **kw)]


def test_watch_resume_selectors_and_timeout(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    fake_kube.add_pod("ns", "keep", {"job": "j"})
    start = core.list_namespaced_pod("ns").metadata.resource_version
    fake_kube.add_pod("ns", "other", {"job": "x"})
    fake_kube.patch("pods", "keep", {"metadata": {"labels": {"job": "moved"}}}, "ns")
    fake_kube.delete("pods", "other", "ns")
    evs = _collect(core.list_namespaced_pod, "ns", resource_version=start, timeout_seconds=1)
    assert [(e["type"], e["name"]) for e in evs] == [
        ("ADDED", "other"), ("MODIFIED", "other"), ("MODIFIED", "keep"), ("DELETED", "other")]
    # leaving the selector is a DELETED for that watch, as the real watch cache sends
    evs = _collect(core.list_namespaced_pod, "ns", label_selector="job=j",
                   resource_version=start, timeout_seconds=1)
    assert [(e["type"], e["name"]) for e in evs] == [("DELETED", "keep")]


def test_watch_without_version_starts_with_the_current_state(core: client.CoreV1Api,
                                                            fake_kube: FakeKube) -> None:
    fake_kube.add_pod("ns", "a")
    evs = _collect(core.list_namespaced_pod, "ns", timeout_seconds=1)
    assert [(e["type"], e["name"]) for e in evs] == [("ADDED", "a")]


def test_watch_expired_is_an_error_event_in_the_stream(core: client.CoreV1Api,
                                                       fake_kube: FakeKube) -> None:
    fake_kube.add_pod("ns", "a")
    old = str(fake_kube.resource_version)
    fake_kube.add_pod("ns", "b")
    fake_kube.compact()
    resp = core.list_namespaced_pod("ns", watch=True, resource_version=old,
                                    _preload_content=False, timeout_seconds=5)
    assert resp.status == 200
    lines = [json.loads(x) for x in resp.read().decode().splitlines()]
    assert lines == [{"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f"too old resource version: {old} ({fake_kube.resource_version + 1})",
        "reason": "Expired", "code": 410}}]


def test_bookmarks(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    fake_kube.add_pod("ns", "a")
    rv = str(fake_kube.resource_version)
    fake_kube.create("configmaps", {"metadata": {"name": "c", "namespace": "ns"}})  # other kind
    resp = core.list_namespaced_pod("ns", watch=True, resource_version=rv,
                                    allow_watch_bookmarks=True, timeout_seconds=10,
                                    _preload_content=False)
    got: list[dict] = []

    def read() -> None:
        for line in watch.watch.iter_resp_lines(resp):
            got.append(json.loads(line))
            return

    t = threading.Thread(target=read)
    t.start()
    fake_kube.wait_for_watches(1, "pods")
    fake_kube.send_bookmarks()
    t.join(10)
    resp.close()
    assert got and got[0]["type"] == "BOOKMARK"
    assert got[0]["object"]["metadata"]["resourceVersion"] == str(fake_kube.resource_version)


def test_drop_watches_cuts_the_stream(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _collect(core.list_namespaced_pod, "ns", resource_version="1", timeout_seconds=30)
        except Exception as e:  # the broken chunked stream
            errors.append(e)

    t = threading.Thread(target=run)
    mark = fake_kube.mark()
    t.start()
    fake_kube.wait_for_request("watch", "pods", after=mark)
    fake_kube.wait_for_watches(1, "pods")
    fake_kube.drop_watches()
    t.join(10)
    assert not t.is_alive() and errors  # a cut, not a clean end of stream


def test_injected_faults(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    fake_kube.add_pod("ns", "p")
    fake_kube.forbid("delete", "pods")
    with pytest.raises(ApiException) as e:
        core.delete_namespaced_pod("p", "ns")
    assert e.value.status == 403 and _status(e.value)["message"] == (
        'pods "p" is forbidden: User "system:serviceaccount:ftagent:arbiter" cannot delete '
        'resource "pods" in API group "" in the namespace "ns"')
    fake_kube.forbid("list", "nodes")
    with pytest.raises(ApiException) as e:
        core.list_node()
    assert _status(e.value)["message"].endswith('cannot list resource "nodes" in API group "" '
                                                "at the cluster scope")
    fake_kube.fail("list", "pods", 429, retry_after=7)
    # urllib3 would sleep Retry-After and retry a GET by itself; retries=False shows the 429
    with pytest.raises(ApiException) as e:
        client.CoreV1Api(fake_kube.client(retries=False)).list_namespaced_pod("ns")
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "7"
    fake_kube.fail("get", "pods", 500, times=1)
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod("p", "ns")
    assert e.value.status == 500
    assert core.read_namespaced_pod("p", "ns").metadata.name == "p"  # times=1 spent
    assert fake_kube.count("get", "pods") == 2 and fake_kube.count("list", "pods") == 1


def test_events_two_views_of_one_storage(fake_kube: FakeKube) -> None:
    ev = client.EventsV1Api(fake_kube.client())
    ev.create_namespaced_event("ns", {
        "metadata": {"name": "e1"}, "note": "pod evicted", "reason": "Evicted",
        "regarding": {"kind": "Pod", "name": "p", "namespace": "ns"},
        "eventTime": "2026-01-01T00:00:00.000000Z", "action": "Replace",
        "reportingController": "ftagent.io/arbiter", "reportingInstance": "a-0",
        "type": "Warning"})
    [core_ev] = fake_kube.events("ns", involved="p")
    assert core_ev["message"] == "pod evicted" and core_ev["apiVersion"] == "v1"
    legacy = client.CoreV1Api(fake_kube.client()).list_namespaced_event("ns")
    assert legacy.items[0].reporting_component == "ftagent.io/arbiter"
    assert ev.read_namespaced_event("e1", "ns").note == "pod evicted"


def test_bearer_token() -> None:
    with FakeKube(token="s3cret") as fake:
        assert client.CoreV1Api(fake.client()).list_node().items == []
        with pytest.raises(ApiException) as e:
            client.CoreV1Api(fake.client(api_key={})).list_node()
        assert e.value.status == 401


def test_finalizers_hold_a_deleted_object(fake_kube: FakeKube) -> None:
    fake_kube.create("configmaps", {"metadata": {"name": "c", "namespace": "ns",
                                                 "finalizers": ["ftagent.io/history"]}})
    fake_kube.delete("configmaps", "c", "ns")
    held = fake_kube.get("configmaps", "c", "ns")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    fake_kube.patch("configmaps", "c", {"metadata": {"finalizers": None}}, "ns")
    assert fake_kube.get("configmaps", "c", "ns") is None


def test_main_resource_update_keeps_status(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    fake_kube.add_pod("ns", "p")
    pod = core.read_namespaced_pod("p", "ns")
    pod.status.phase = "Failed"
    pod.metadata.labels = {"x": "y"}
    out = core.replace_namespaced_pod("p", "ns", pod)
    assert out.status.phase == "Running" and out.metadata.labels == {"x": "y"}
    out = core.replace_namespaced_pod_status("p", "ns", out.to_dict() | {
        "status": {"phase": "Failed"}})
    assert out.status.phase == "Failed"


def test_list_versions_as_the_server_answers(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    for i in range(3):
        fake_kube.add_pod("ns", f"p{i}")
    page = core.list_namespaced_pod("ns", limit=1)
    fake_kube.add_pod("ns", "later")
    fake_kube.compact()  # the first page's version is now older than the oldest kept
    with pytest.raises(ApiException) as e:
        core.list_namespaced_pod("ns", limit=1, _continue=page.metadata._continue)
    assert e.value.status == 410 and _status(e.value)["reason"] == "Expired"
    with pytest.raises(ApiException) as e:
        core.list_namespaced_pod("ns", resource_version=str(fake_kube.resource_version + 50),
                                 _request_timeout=5)
    assert e.value.status == 504 and "Too large resource version" in _status(e.value)["message"]
    with pytest.raises(ApiException) as e:
        core.list_namespaced_pod("ns", resource_version="abc")
    assert e.value.status == 400


def test_not_served_paths_and_bad_bodies(fake_kube: FakeKube) -> None:
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{fake_kube.url}/api/v1/namespaces/ns/widgets", timeout=10)
    assert e.value.code == 404 and json.loads(e.value.read())["kind"] == "Status"
    req = urllib.request.Request(f"{fake_kube.url}/api/v1/namespaces/ns/pods", data=b"{not json",
                                 method="POST", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert fake_kube.list("pods") == []


def test_legacy_event_fields_and_selectors(core: client.CoreV1Api, fake_kube: FakeKube) -> None:
    core.create_namespaced_event("ns", {
        "metadata": {"name": "p.1"}, "involvedObject": {"kind": "Pod", "name": "p",
                                                         "namespace": "ns"},
        "reason": "FtagentRestart", "message": "rank 3 crashed", "type": "Warning",
        "count": 1, "source": {"component": "ftagent-arbiter"}})
    got = core.list_namespaced_event("ns", field_selector="involvedObject.name=p,"
                                                          "reason=FtagentRestart")
    assert [e.message for e in got.items] == ["rank 3 crashed"]
    assert core.list_namespaced_event("ns", field_selector="source=ftagent-arbiter").items
    # a core/v1 Event has no eventTime; events.k8s.io/v1 serves it as null, which the
    # Python client's model refuses (as with a real server): read such events raw
    resp = client.EventsV1Api(fake_kube.client()).read_namespaced_event(
        "p.1", "ns", _preload_content=False)
    ev = json.loads(resp.data)
    assert ev["regarding"]["name"] == "p" and ev["deprecatedCount"] == 1
    assert ev["eventTime"] is None and ev["note"] == "rank 3 crashed"
