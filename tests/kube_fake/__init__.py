"""A faithful fake Kubernetes API server for tests: real HTTP/1.1 + JSON on loopback.

Drive it with the REAL ``kubernetes`` client (or ``ftagent.kube.client.api_client(url=...)``);
it answers as the real server does: ``Status`` objects for every error (so the client raises
``ApiException`` with the right ``status`` and ``reason``), a global string
``resourceVersion``, 409 AlreadyExists / Conflict, 404 NotFound, strategic-merge /
JSON-merge / JSON-patch, graceful pod deletion, and chunked watch streams with resume,
bookmarks, ``timeoutSeconds`` and 410 Expired in-stream once a version left the history.

Use::

    from tests.kube_fake import FakeKube

    @pytest.fixture
    def fake_kube() -> Iterator[FakeKube]:
        with FakeKube() as fake:  # a fresh server per test, stopped after it
            yield fake

    def test_x(fake_kube: FakeKube) -> None:
        api = kubernetes.client.CoreV1Api(fake_kube.client())
        fake_kube.add_node("n1")
        fake_kube.add_pod("ns", "p0", labels={"app": "a"}, node="n1")
        ...

    with FakeKube(token="s3cret", history=100) as fake:   # or as a context manager
        fake.url                                          # "http://127.0.0.1:PORT"
    with FakeKube(tls=True) as fake:   # https://localhost:PORT, its CA in fake.ca_file
        ...

Resources served (RBAC names): pods, pods/status, nodes, nodes/status, events (core/v1 and
events.k8s.io/v1: one storage, two views, as on the real server), configmaps, secrets,
namespaces, services, deployments.apps, jobs.batch, leases.coordination.k8s.io,
mutatingwebhookconfigurations.admissionregistration.k8s.io, tokenreviews.authentication.k8s.io
(create only, never stored: projected ServiceAccount tokens from ``mint_token``/``token_file``
are reviewed as the real server reviews them, see tokens.py), the service-account issuer's
OIDC discovery (``/.well-known/openid-configuration``, ``/openid/v1/jwks``: logged and
fault-injectable as verb ``get`` on the path; the tokens are signed with a real RSA key),
and as custom resources (no strategic merge: 415, as for real CRDs)
pytorchjobs/tfjobs/mpijobs/paddlejobs/mxjobs/xgboostjobs.kubeflow.org (v1),
trainjobs.trainer.kubeflow.org (v1alpha1),
jobsets.jobset.x-k8s.io (v1alpha2), jobs.batch.volcano.sh (v1alpha1). Verbs: get, list (label
selectors ``k``, ``!k``, ``k=v``, ``k!=v``, ``k in (a,b)``, ``k notin (a)``; field selectors
on the kind's real fields, e.g. ``spec.nodeName``, ``metadata.name``, ``status.phase``;
``limit``/``continue``; ``resourceVersion`` with ``resourceVersionMatch``), watch, create,
update (PUT: stale ``metadata.resourceVersion`` → 409 Conflict), patch, delete
(``gracePeriodSeconds``, ``preconditions``). Writes to the main resource keep the old
``status`` for kinds with a /status subresource and vice versa; a no-op write keeps the
resourceVersion and sends no watch event. As on the real server, a core/v1 Event read through
events.k8s.io/v1 carries ``"eventTime": null``, which the Python client's ``EventsV1Event``
model refuses: write events.k8s.io Events with ``eventTime`` set. Not built (stubs):
deletecollection (405), server-side apply (415), namespace existence checks (any namespace
is accepted), field managers, admission.

Control API of :class:`FakeKube` (thread-safe; objects are plain dicts as on the wire):

* ``url``, ``ca_file`` (with ``tls=True``), ``token`` (settable: a rotation),
  ``client(**config) -> kubernetes.client.ApiClient``, ``stop()``.
* ``create(resource, obj, namespace=None)``, ``get(resource, name, namespace=None)`` (None if
  absent), ``list(resource, namespace=None, label_selector=None)``, ``update(resource, obj)``,
  ``patch(resource, name, body, namespace=None, content_type=MERGE)``,
  ``delete(resource, name, namespace=None, grace=0)``; ``resource`` as RBAC names it
  (``"pods"``, ``"leases.coordination.k8s.io"``, ``"pytorchjobs.kubeflow.org"``).
* ``add_pod(namespace, name, labels=None, node=None, phase="Running", owner=None, **spec)``,
  ``add_node(name, ready=True, labels=None)``,
  ``set_node_ready(name, status="False", reason="KubeletNotReady", message=...)``
  (status True/False/Unknown or a bool), ``set_node_condition(name, type, status, ...)``,
  ``set_pod_phase(namespace, name, phase, reason=None, message=None)``,
  ``set_pod_condition(namespace, name, type, status="True", reason=None, message=None)``
  (e.g. ``DisruptionTarget`` with reason ``PreemptionByScheduler``),
  ``terminate_pod(namespace, name, exit_code=0, container="trainer", signal=None)`` (the
  kubelet's terminal status: phase, ``state.terminated``),
  ``set_device_health(namespace, name, resource, device, health="Unhealthy",
  container="trainer", message=None)`` (the kubelet's ``allocatedResourcesStatus``, KEP-4680,
  validated as the real server does: 422 for a resource the container does not hold);
  ``set_node_features(name, kubelet_version=None, declared=None)`` (the kubelet's version
  and NodeDeclaredFeatures' ``status.declaredFeatures``), ``set_feature_gates(*gates)``
  (the API server's ContainerRestartRules / RestartAllContainersOnContainerExits: pod
  restart rules dropped or refused as the real server does, validate.py),
  node lifecycle conditions (KEP-5683) through ``set_node_condition`` (e.g.
  ``"DrainInProgress"``, ``"MaintenancePlanned"``),
  ``finish_termination(namespace, name)`` (the kubelet's final delete of a Terminating pod),
  ``events(namespace=None, involved=None) -> list`` (core/v1 shape).
* CRDs: ``remove_resource(resource)`` (not installed: 404 on every request for it),
  ``prune_status(resource, *fields)`` (a CRD schema without those status fields: they are
  dropped from writes, as the real server prunes unknown fields).
* Tokens: ``mint_token(namespace, service_account="default", pod=None, audiences=("ftagent",),
  expiration_seconds=3600) -> Minted``, ``user_token(username, groups=())`` (a person's OIDC
  id token), ``issuer.rotate_key(alg)`` / ``issuer.retire_key(kid)``,
  ``token_file(directory, namespace, pod, ...)`` (a projected-volume token file; call again
  to rotate), ``issuer.clock`` (settable: expiry).
* RBAC for SubjectAccessReview (``subjectaccessreviews.authorization.k8s.io``, create only,
  see access.py): ``allow(subject, verbs, resource="ftagentjobs", group="ftagent.io",
  namespace=None, names=())``.
* Faults: ``forbid(verb, resource, namespace=None, name=None, times=None)`` (403 with the real
  RBAC message for user ``system:serviceaccount:ftagent:arbiter``),
  ``fail(verb, resource, code=500, times=1, retry_after=None, message=None)`` (500, 503,
  429 with ``Retry-After`` and ``details.retryAfterSeconds``, any code),
  ``slow(verb, resource, seconds)`` (answered that late), ``clear_faults()``,
  ``drop_watches()`` (every open watch is cut mid-stream, no final chunk),
  ``compact()`` (forget the history: older versions get 410), ``send_bookmarks()``
  (a BOOKMARK now on every watch that allowed them; also every ``bookmark_interval`` s),
  ``atomically()`` (a context manager holding the store lock: several writes, a compaction
  and a drop that no watch sees in between).
* Request log: ``requests`` (list of :class:`Request`: verb, resource, namespace, name,
  query, headers, body, code), ``count(verb=None, resource=None)`` with verbs as RBAC names
  them (a watch is ``"watch"``, a list ``"list"``), ``wait_for_request(verb=None,
  resource=None, after=0, timeout=10.0) -> Request``, ``mark() -> int`` (an index to pass as
  ``after``), ``open_watches(resource=None) -> int`` and ``wait_for_watches(n=1,
  resource=None, timeout=10.0)`` (a watch counts once its stream is registered, so a
  ``drop_watches()`` after it surely cuts it).
"""

from __future__ import annotations

import builtins
import contextlib
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .access import Access
from .errors import ApiError, now_rfc3339
from .faults import Faults, Request
from .resources import Kind, kind_for, parse_label_selector
from .server import FakeHTTPServer
from .store import Store
from .tokens import Issuer, Minted, write_projected

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"

__all__ = ["FakeKube", "Request", "ApiError", "MERGE", "STRATEGIC", "JSON_PATCH", "Minted",
           "write_projected"]


class FakeKube:
    """The fake API server and its control API (see the module docstring)."""

    def __init__(self, token: str | None = None, history: int = 1000,
                 bookmark_interval: float = 1.0,
                 user: str = "system:serviceaccount:ftagent:arbiter",
                 tls: bool = False) -> None:
        self.store = Store(history=history)
        self.faults = Faults(user=user)
        self.ca_file: str | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        ctx = self._tls_context() if tls else None
        self._http = FakeHTTPServer(self.store, self.faults, token, bookmark_interval, ctx)
        self.issuer = Issuer(self.get)
        self._http.issuer = self.issuer
        self.access = Access()
        self._http.access = self.access
        port = self._http.server_address[1]
        self.url = f"https://localhost:{port}" if tls else f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self._http.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="fake-kube-api", daemon=True)
        self._thread.start()

    def _tls_context(self) -> ssl.SSLContext:
        from ftagent.kube.certs import self_signed

        pems = self_signed(["localhost"])
        self._tmp = tempfile.TemporaryDirectory(prefix="fake-kube-")
        d = Path(self._tmp.name)
        (d / "ca.crt").write_bytes(pems.ca)
        (d / "tls.crt").write_bytes(pems.cert)
        (d / "tls.key").write_bytes(pems.key)
        self.ca_file = str(d / "ca.crt")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(d / "tls.crt", d / "tls.key")
        return ctx

    @property
    def token(self) -> str | None:
        return self._http.token

    @token.setter
    def token(self, value: str | None) -> None:
        """Change the accepted bearer token at runtime (a rotation)."""
        self._http.token = value

    def __enter__(self) -> FakeKube:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._http.stopping.set()
        self.store.wake()
        self._http.shutdown()
        self._http.close_all()
        self._http.server_close()
        self._thread.join(timeout=5)
        if self._tmp is not None:
            self._tmp.cleanup()

    def client(self, **config: Any) -> Any:
        """A real ``kubernetes.client.ApiClient`` pointed at this server."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        cfg.ssl_ca_cert = self.ca_file
        if self.token:
            cfg.api_key = {"authorization": self.token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        for k, v in config.items():
            setattr(cfg, k, v)
        return client.ApiClient(cfg)

    # ------------------------------------------------------------------ objects
    def _kind(self, resource: str) -> Kind:
        return kind_for(resource)

    def create(self, resource: str, obj: dict[str, Any],
               namespace: str | None = None) -> dict[str, Any]:
        ns = namespace or (obj.get("metadata") or {}).get("namespace")
        return self.store.create(self._kind(resource), ns, obj)

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return self.store.get(self._kind(resource), namespace, name)
        except ApiError:
            return None

    def list(self, resource: str, namespace: str | None = None,
             label_selector: str | None = None) -> list[dict[str, Any]]:
        out = self.store.list_objects(self._kind(resource), namespace,
                              parse_label_selector(label_selector), [])
        return list(out["items"])

    def update(self, resource: str, obj: dict[str, Any], subresource: str | None = None
               ) -> dict[str, Any]:
        meta = obj["metadata"]
        return self.store.update(self._kind(resource), meta.get("namespace"), meta["name"], obj,
                                 subresource)

    def patch(self, resource: str, name: str, body: Any, namespace: str | None = None,
              content_type: str = MERGE, subresource: str | None = None) -> dict[str, Any]:
        return self.store.patch(self._kind(resource), namespace, name, content_type, body,
                                subresource)

    def delete(self, resource: str, name: str, namespace: str | None = None,
               grace: int | None = 0) -> dict[str, Any]:
        return self.store.delete(self._kind(resource), namespace, name, grace)

    def finish_termination(self, namespace: str, name: str) -> dict[str, Any]:
        return self.store.finish_termination(self._kind("pods"), namespace, name)

    def remove_resource(self, resource: str) -> None:
        """Serve ``resource`` (``"trainjobs.trainer.kubeflow.org"``) no more: its CRD is
        not installed; every request for it is 404 "the server could not find the
        requested resource", as the real server answers."""
        self._http.absent.add(self._kind(resource).qualified)

    def prune_status(self, resource: str, *fields: str) -> None:
        """The CRD of ``resource`` has no ``status.<field>`` in its schema: writes drop
        them, as the real server prunes unknown fields (an older Kubeflow Trainer's
        TrainJob without ``trainerStatus``)."""
        self._http.unknown_status.setdefault(self._kind(resource).qualified,
                                             set()).update(fields)

    def add_pod(self, namespace: str, name: str, labels: dict[str, str] | None = None,
                node: str | None = None, phase: str = "Running",
                owner: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels or {}}
        if owner:
            meta["ownerReferences"] = [owner]
        body: dict[str, Any] = {"metadata": meta, "spec": {
            "containers": [{"name": "trainer", "image": "trainer:latest"}], **spec}}
        if node:
            body["spec"]["nodeName"] = node
        self.create("pods", body)
        return self.set_pod_phase(namespace, name, phase)

    def add_node(self, name: str, ready: bool = True,
                 labels: dict[str, str] | None = None) -> dict[str, Any]:
        self.create("nodes", {"metadata": {"name": name, "labels": labels or {}}, "spec": {}})
        return self.set_node_ready(name, ready, reason="KubeletReady" if ready else
                                   "KubeletNotReady")

    def set_feature_gates(self, *gates: str) -> None:
        """The API server's gates of validate.GATES that are on (the rest off): pods
        created from now on lose a disabled gate's restart-rule fields or are refused."""
        self.store.gates = set(gates)

    def set_node_features(self, name: str, kubelet_version: str | None = None,
                          declared: list[str] | None = None) -> dict[str, Any]:
        """The kubelet's ``status.nodeInfo.kubeletVersion`` and its NodeDeclaredFeatures
        list ``status.declaredFeatures`` (sorted, as the kubelet writes it)."""
        status: dict[str, Any] = {}
        if kubelet_version is not None:
            status["nodeInfo"] = {"kubeletVersion": kubelet_version}
        if declared is not None:
            status["declaredFeatures"] = sorted(set(declared))
        return self.patch("nodes", name, {"status": status}, subresource="status")

    def set_node_condition(self, name: str, type_: str, status: str, reason: str = "",
                           message: str = "") -> dict[str, Any]:
        now = now_rfc3339()
        old = self.get("nodes", name) or {}
        prev = next((c for c in (old.get("status") or {}).get("conditions") or []
                     if c.get("type") == type_), None)
        since = now if prev is None or prev.get("status") != status else \
            prev.get("lastTransitionTime", now)
        cond = {"type": type_, "status": status, "reason": reason, "message": message,
                "lastHeartbeatTime": now, "lastTransitionTime": since}
        return self.patch("nodes", name, {"status": {"conditions": [cond]}},
                          content_type=STRATEGIC, subresource="status")

    def set_node_ready(self, name: str, status: bool | str = "False",
                       reason: str = "KubeletNotReady",
                       message: str = "") -> dict[str, Any]:
        s = ("True" if status else "False") if isinstance(status, bool) else status
        msg = message or ("kubelet is posting ready status" if s == "True" else
                          "Kubelet stopped posting node status." if s == "Unknown" else
                          "container runtime network not ready")
        if s == "Unknown" and reason == "KubeletNotReady":
            reason = "NodeStatusUnknown"
        return self.set_node_condition(name, "Ready", s, reason, msg)

    def set_pod_phase(self, namespace: str, name: str, phase: str, reason: str | None = None,
                      message: str | None = None) -> dict[str, Any]:
        status: dict[str, Any] = {"phase": phase, "reason": reason, "message": message}
        return self.patch("pods", name, {"status": status}, namespace, STRATEGIC, "status")

    def terminate_pod(self, namespace: str, name: str, exit_code: int = 0,
                      container: str = "trainer", signal: int | None = None
                      ) -> dict[str, Any]:
        """The kubelet's status for a pod whose only restart policy is Never and whose
        ``container`` ended: phase ``Succeeded`` (exit 0) or ``Failed``, the container's
        ``state.terminated`` (exitCode, reason Completed/Error, signal when killed by
        one, start and finish times, containerID), no longer ready or started."""
        pod = self.get("pods", name, namespace) or {}
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        st = next((c for c in statuses if c.get("name") == container), None) or {
            "name": container, "image": "trainer:latest", "imageID": "", "restartCount": 0}
        now = now_rfc3339()
        done: dict[str, Any] = {"exitCode": exit_code,
                                "reason": "Completed" if exit_code == 0 else "Error",
                                "startedAt": now, "finishedAt": now,
                                "containerID": f"containerd://{name}-{container}"}
        if signal is not None:
            done["signal"] = signal
        st = {**st, "ready": False, "started": False, "state": {"terminated": done}}
        return self.patch("pods", name, {"status": {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted",
                            "lastTransitionTime": now}],
            "containerStatuses": [st]}}, namespace, STRATEGIC, "status")

    def set_pod_condition(self, namespace: str, name: str, type_: str, status: str = "True",
                          reason: str | None = None, message: str | None = None
                          ) -> dict[str, Any]:
        cond = {"type": type_, "status": status, "reason": reason, "message": message,
                "lastTransitionTime": now_rfc3339()}
        return self.patch("pods", name, {"status": {"conditions": [cond]}}, namespace,
                          STRATEGIC, "status")

    def set_device_health(self, namespace: str, name: str, resource: str, device: str,
                          health: str = "Unhealthy", container: str = "trainer",
                          message: str | None = None) -> dict[str, Any]:
        """The kubelet's device health for one device of ``container`` (KEP-4680):
        ``status.containerStatuses[name=container].allocatedResourcesStatus[name=resource]
        .resources[resourceID=device].health`` set (the entry and the container's status
        added when absent), other devices and entries kept. Validated as the real server
        validates it (validate.py): a resource the container does not hold is 422."""
        pod = self.get("pods", name, namespace) or {}
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        st = next((c for c in statuses if c.get("name") == container), None) or {
            "name": container, "image": "trainer:latest", "imageID": "", "ready": True,
            "restartCount": 0, "started": True,
            "state": {"running": {"startedAt": now_rfc3339()}}}
        entries = [dict(e) for e in st.get("allocatedResourcesStatus") or []]
        entry = next((e for e in entries if e.get("name") == resource), None)
        if entry is None:
            entry = {"name": resource, "resources": []}
            entries.append(entry)
        dev: dict[str, Any] = {"resourceID": device, "health": health}
        if message is not None:
            dev["message"] = message
        entry["resources"] = [r for r in entry.get("resources") or []
                              if r.get("resourceID") != device] + [dev]
        st = {**st, "allocatedResourcesStatus": entries}
        return self.patch("pods", name, {"status": {"containerStatuses": [st]}}, namespace,
                          STRATEGIC, "status")

    def add_resource_slice(self, node: str, driver: str = "gpu.nvidia.com",
                           devices: tuple[str, ...] = ("gpu-0",),
                           pool: str | None = None) -> dict[str, Any]:
        """A DRA driver's ResourceSlice for ``node`` (resource.k8s.io/v1): pool ``pool``
        (default the node's name, as NVIDIA's driver names it), one generation, one slice."""
        pool = pool or node
        return self.create("resourceslices.resource.k8s.io", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}".replace("/", "-")},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": d} for d in devices]}})

    def taint_slice_device(self, node: str, device: str, key: str, value: str = "",
                           effect: str = "NoSchedule",
                           driver: str = "gpu.nvidia.com") -> dict[str, Any]:
        """The driver taints ``device`` in its slice (``spec.devices[].taints``, KEP-5055;
        effect None, NoSchedule or NoExecute, ``timeAdded`` set as the server sets it)."""
        name = f"{node}-{driver}".replace("/", "-")
        sl = self.get("resourceslices.resource.k8s.io", name) or {}
        taint = {"key": key, "effect": effect, "timeAdded": now_rfc3339()}
        if value:
            taint["value"] = value
        devs = [({**d, "taints": [*(d.get("taints") or []), taint]}
                 if d.get("name") == device else d) for d in sl["spec"]["devices"]]
        return self.patch("resourceslices.resource.k8s.io", name,
                          {"spec": {"devices": devs}})

    def allocate_claim(self, namespace: str, pod: str, devices: builtins.list[str],
                       node: str, driver: str = "gpu.nvidia.com", request: str = "gpu",
                       claim: str | None = None) -> dict[str, Any]:
        """A ResourceClaim for ``pod`` allocated ``devices`` of ``node``'s pool and
        reserved for the pod (its uid in ``status.reservedFor``), and the pod's
        ``status.resourceClaimStatuses`` naming it, as the scheduler and the
        ResourceClaim controller leave them for a claim made from a template."""
        p = self.get("pods", pod, namespace) or {}
        uid = (p.get("metadata") or {}).get("uid", "")
        name = claim or f"{pod}-gpu"
        self.create("resourceclaims.resource.k8s.io", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": request, "exactly": {
                "deviceClassName": driver}}]}}})
        status = {"allocation": {"devices": {"results": [
            {"request": request, "driver": driver, "pool": node, "device": d}
            for d in devices]}},
            "reservedFor": [{"resource": "pods", "name": pod, "uid": uid}]}
        got = self.patch("resourceclaims.resource.k8s.io", name, {"status": status},
                         namespace, subresource="status")
        self.patch("pods", pod, {"status": {"resourceClaimStatuses": [
            {"name": request, "resourceClaimName": name}]}}, namespace, STRATEGIC, "status")
        return got

    def events(self, namespace: str | None = None,
               involved: str | None = None) -> builtins.list[dict[str, Any]]:
        evs = self.list("events", namespace)
        return [e for e in evs if involved in (None, (e.get("involvedObject") or {}).get("name"))]

    # ------------------------------------------------------------------- tokens
    def mint_token(self, namespace: str, service_account: str = "default", *,
                   pod: str | None = None, audiences: tuple[str, ...] = ("ftagent",),
                   expiration_seconds: int = 3600) -> Minted:
        """A projected ServiceAccount token (bound to ``pod`` and its node when given) that
        this server's TokenReview recognises (see tokens.py)."""
        return self.issuer.mint(namespace, service_account, pod=pod, audiences=audiences,
                                expiration_seconds=expiration_seconds)

    def token_file(self, directory: str | Path, namespace: str, pod: str,
                   service_account: str = "default", audiences: tuple[str, ...] = ("ftagent",),
                   expiration_seconds: int = 3600) -> Path:
        """Mint a pod-bound token and write it as the kubelet does into ``directory`` (a
        projected volume: ``token`` through ``..data``); call again to rotate it."""
        minted = self.mint_token(namespace, service_account, pod=pod, audiences=audiences,
                                 expiration_seconds=expiration_seconds)
        return write_projected(directory, minted.token)

    def user_token(self, username: str, groups: tuple[str, ...] = ()) -> str:
        """A person's OIDC id token, as a kubeconfig holds it (TokenReview: the API
        server's audiences only)."""
        return self.issuer.user_token(username, groups)

    def allow(self, subject: str, verbs: tuple[str, ...] | str, resource: str = "ftagentjobs",
              group: str = "ftagent.io", namespace: str | None = None,
              names: tuple[str, ...] = ()) -> None:
        """RBAC for SubjectAccessReview (access.py): ``subject`` a user or ``group:NAME``;
        with ``namespace`` a RoleBinding there, else a ClusterRoleBinding; ``names`` its
        resourceNames."""
        self.access.allow(subject, verbs, resource, group, namespace, names)

    # ------------------------------------------------------------------- faults
    def forbid(self, verb: str, resource: str, namespace: str | None = None,
               name: str | None = None, times: int | None = None) -> None:
        self.faults.add(verb, resource, 403, namespace=namespace, name=name, times=times)

    def fail(self, verb: str, resource: str, code: int = 500, times: int | None = 1,
             retry_after: int | None = None, message: str | None = None,
             namespace: str | None = None, name: str | None = None) -> None:
        self.faults.add(verb, resource, code, namespace=namespace, name=name, times=times,
                        retry_after=retry_after, message=message)

    def slow(self, verb: str, resource: str, seconds: float) -> None:
        """Answer every ``verb`` on ``resource`` ``seconds`` late (a loaded API server, or
        the client-side rate limit a real one imposes); ``clear_faults`` ends it."""
        with self.faults.lock:
            self.faults.delays.append((verb, resource, seconds))

    def clear_faults(self) -> None:
        self.faults.clear()

    def drop_watches(self) -> None:
        self.store.drop_watches()

    def compact(self) -> None:
        self.store.compact()

    def send_bookmarks(self) -> None:
        self._http.bookmark_epoch += 1
        self.store.wake()

    @contextlib.contextmanager
    def atomically(self) -> Iterator[None]:
        with self.store.lock:
            yield

    @property
    def resource_version(self) -> int:
        return self.store.rv

    # -------------------------------------------------------------- request log
    @property
    def requests(self) -> builtins.list[Request]:
        with self.faults.lock:
            return list(self.faults.requests)

    def count(self, verb: str | None = None, resource: str | None = None) -> int:
        return self.faults.count(verb, resource)

    def open_watches(self, resource: str | None = None) -> int:
        """How many watches are open now (on ``resource`` if given)."""
        kind = self._kind(resource) if resource else None
        with self.store.lock:
            return sum(1 for w in self.store.watchers if kind in (None, w.kind))

    def wait_for_watches(self, n: int = 1, resource: str | None = None,
                         timeout: float = 10.0) -> None:
        """Until at least ``n`` watches are open (a drop before that would miss them)."""
        deadline = time.monotonic() + timeout
        with self.store.lock:
            while self.open_watches(resource) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{self.open_watches(resource)} watches open on "
                                         f"{resource or 'any resource'}, wanted {n}")
                self.store.changed.wait(left)

    def mark(self) -> int:
        with self.faults.lock:
            return len(self.faults.requests)

    def wait_for_request(self, verb: str | None = None, resource: str | None = None,
                         after: int = 0, timeout: float = 10.0) -> Request:
        return self.faults.wait_for(verb, resource, after, timeout)
