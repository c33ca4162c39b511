"""The pod mutation: wrap the trainer in ``ftagent run`` and give the agent what it needs.

Pure: ``mutate(pod, namespace, settings)`` returns a :class:`Mutation` with a JSONPatch
(RFC 6902) against the pod as given, the admission warnings and, for a bad job name, a
denial. The webhook (``webhook.py``) only carries it over HTTPS.

What an injected pod gets:

* an init container ``ftagent-install`` (the ftagent image) that copies the
  self-contained agent into the ``emptyDir`` ``ftagent``, mounted read-only at
  ``/opt/ftagent`` in the trainer (annotation ``ftagent.io/agent: image``: the image has
  ftagent on its PATH; nothing is copied);
* the trainer container's ``command`` becomes ``/opt/ftagent/ftagent run -- <command>``
  (its ``args`` stay as they are). A container without ``command`` runs its image's
  ENTRYPOINT, which admission cannot see: it is left alone with a warning and the
  annotation ``ftagent.io/injected: "skipped: no command"``, unless the annotation
  ``ftagent.io/command`` (a JSON list) says what the image runs;
* env: ``POD_NAME``, ``POD_NAMESPACE``, ``NODE_NAME``, ``POD_IP`` (downward API),
  ``FTAGENT_JOB``/``_RANK``/``_WORLD_SIZE`` where the job's labels and env tell
  (``identity.py``), ``FTAGENT_ARBITER`` and the job's own token ``FTAGENT_TOKEN``
  (derived from the arbiter's secret; never the secret), ``FTAGENT_PROGRESS=none`` for
  roles without steps, ``FTAGENT_METRICS_PORT``. What the container already sets wins;
* the named port ``ftagent-metrics`` and ``prometheus.io/scrape|port|path`` annotations.
  In its own network namespace every pod uses the base port (9430, or the next one no
  container of the pod declares). **hostNetwork pods** share the node's ports: each gets
  ``base + (hash(namespace/job) + rank) mod span`` (span 100: 9430-9529) declared as a
  *host port*, so the scheduler never places two pods with the same port on one node
  (nothing fights over a port, and no agent is silently without metrics); ranks of a job
  get distinct ports up to ``span`` ranks, beyond that two ranks whose ports are equal
  just never share a node. Prometheus finds each agent by the port's name (PodMonitor)
  or the annotations;
* ``ftagent.io/fault-tolerance: "false"`` (pod label or annotation) makes it monitor and
  alert only: no arbiter, no restarts, ``--hang-action alert``.

The mutation is idempotent: a pod already injected gets an empty patch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ftagent.kube.identity import (
    Identity,
    annotations_of,
    check_job_name,
    identify,
    labels_of,
    literal_env,
    trainer_index,
)

INJECTED = "ftagent.io/injected"
JOB_LABEL = "ftagent.io/job"  # set on injected pods: the arbiter watches pods by it
VOLUME = "ftagent"
INIT_NAME = "ftagent-install"
PORT_NAME = "ftagent-metrics"
MAX_PORT_SPAN = 1000


@dataclass(frozen=True)
class Settings:
    """How the webhook injects (flags of ``ftagent webhook``)."""

    image: str = "ghcr.io/ftagent/ftagent:0.1.0"
    arbiter: str = ""  # HOST:PORT for FTAGENT_ARBITER ("" : agents decide locally)
    token_for: Callable[[str, str], str] | None = None  # (namespace, job) -> job token
    agent_dir: str = "/opt/ftagent"  # where the trainer finds the agent
    bundle_dir: str = "/opt/ftagent-bundle"  # where the image holds it
    metrics_port: int = 9430
    metrics_port_span: int = 100  # hostNetwork pods: ports base .. base+span-1
    pull_policy: str = "IfNotPresent"
    init_resources: Mapping[str, Any] = field(default_factory=lambda: {
        "requests": {"cpu": "50m", "memory": "32Mi"},
        "limits": {"cpu": "1", "memory": "128Mi"}})


@dataclass
class Mutation:
    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    denied: str = ""  # a denial message ("" : allowed)
    status: str = ""  # the value written to ftagent.io/injected (or why nothing was done)


def _false(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("false", "0", "no", "off")


def mutate(pod: Any, namespace: str, settings: Settings) -> Mutation:
    """The patch that injects ftagent into ``pod`` (the AdmissionReview's object)."""
    if not isinstance(pod, dict) or not isinstance(pod.get("spec"), dict):
        return Mutation(status="not a pod")
    labels = labels_of(pod)
    if _false(labels.get("ftagent.io/inject")):
        return Mutation(status="opted out (ftagent.io/inject=false)")
    new = _working_copy(pod)
    status, warnings = _inject(new, namespace or _str(pod, "metadata", "namespace"), settings)
    if status.startswith("denied: "):
        return Mutation(denied=status.removeprefix("denied: "), status="denied")
    meta = new.setdefault("metadata", {})
    if not isinstance(meta.get("annotations"), dict):
        meta["annotations"] = {}
    meta["annotations"][INJECTED] = status
    return Mutation(patch=diff(pod, new), warnings=warnings, status=status)


def _working_copy(pod: dict[str, Any]) -> dict[str, Any]:
    """A copy of what the mutation may change (the rest is shared with ``pod``, never
    written): metadata and spec shallow, the lists it appends to, the containers deep.
    A deep copy of the whole pod was the webhook's largest cost."""
    meta = pod.get("metadata")
    new = {**pod, "metadata": dict(meta) if isinstance(meta, dict) else {}}
    for key in ("annotations", "labels"):
        if isinstance(new["metadata"].get(key), dict):
            new["metadata"][key] = dict(new["metadata"][key])
    spec = new["spec"] = dict(pod["spec"])
    for key in ("initContainers", "volumes"):
        if isinstance(spec.get(key), list):
            spec[key] = list(spec[key])
    if isinstance(spec.get("containers"), list):
        spec["containers"] = [_json_copy(c) for c in spec["containers"]]
    return new


def _json_copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _json_copy(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_copy(x) for x in v]
    return v


def _str(obj: Any, *path: str) -> str:
    for p in path:
        obj = obj.get(p) if isinstance(obj, dict) else None
    return obj if isinstance(obj, str) else ""


def _inject(pod: dict[str, Any], namespace: str, s: Settings) -> tuple[str, list[str]]:
    """Mutate ``pod`` in place; (the ftagent.io/injected value or "denied: ...", warnings)."""
    spec = pod["spec"]
    notes, labels = annotations_of(pod), labels_of(pod)
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers or \
            not all(isinstance(c, dict) for c in containers):
        return "skipped: no containers", ["ftagent: the pod has no containers; not injected"]
    # identity needs the trainer's env, the trainer's choice needs the role: role first
    probe = identify(pod, {}, labels=labels, notes=notes)
    index, how = trainer_index(pod, probe.role if probe else "")
    if index is None:
        return f"skipped: {how}", [f"ftagent: not injected: {how}"]
    trainer = containers[index]
    env = literal_env(trainer)
    found = identify(pod, env, labels=labels, notes=notes)
    if found is None and labels.get("ftagent.io/inject", "").lower() != "true":
        return "skipped: no job (no known job kind, no ftagent.io/inject label)", []
    ident = found or Identity("pod", _str(pod, "metadata", "name")
                              or _str(pod, "metadata", "generateName").rstrip("-"))
    if ident.skip:
        return f"skipped: {ident.skip}", []
    name = env.get("FTAGENT_JOB") or ident.job
    namespace = env.get("FTAGENT_NAMESPACE") or namespace
    denial = check_job_name(name) if name else None
    if denial:
        return "denied: " + denial, []
    command = _command(trainer, notes)
    if command is None:
        what = "args but no command" if trainer.get("args") else "no command"
        return (f"skipped: {what}",
                [f"ftagent: container {trainer.get('name')!r} has {what} (image entrypoint "
                 "unknown): runs without ftagent; set command or ftagent.io/command"])
    from_image = notes.get("ftagent.io/agent", "").strip().lower() == "image"
    agent = "ftagent" if from_image else f"{s.agent_dir}/ftagent"
    if command[:2] != [agent, "run"]:
        trainer["command"] = [agent, "run", "--", *command]
    if not from_image:
        _add_bundle(spec, trainer, s)
    monitor_only = _false(labels.get("ftagent.io/fault-tolerance")) or \
        _false(notes.get("ftagent.io/fault-tolerance"))
    port = _metrics_port(pod, env, namespace, ident, s)
    _add_env(trainer, _env(ident, name, namespace, port, monitor_only, s))
    _add_port(trainer, port, bool(spec.get("hostNetwork")))
    meta = pod.setdefault("metadata", {})
    if not isinstance(meta.get("annotations"), dict):
        meta["annotations"] = {}
    annotations = meta["annotations"]
    for k, v in (("prometheus.io/scrape", "true"), ("prometheus.io/port", str(port)),
                 ("prometheus.io/path", "/metrics")):
        annotations.setdefault(k, v)
    if not isinstance(meta.get("labels"), dict):
        meta["labels"] = {}
    meta["labels"].setdefault(JOB_LABEL, name)  # the arbiter's pod watch selects on it
    mode = "monitor only" if monitor_only else ident.kind
    return f"true ({mode}, container {trainer.get('name')}, {how})", []


def _command(c: Mapping[str, Any], notes: Mapping[str, str]) -> list[str] | None:
    """What the container runs before ``args``, or None when admission cannot know it."""
    command = c.get("command")
    if isinstance(command, list) and command and all(isinstance(x, str) for x in command):
        return list(command)
    raw = notes.get("ftagent.io/command")
    if raw:
        try:
            given = json.loads(raw)
        except ValueError:
            return None
        if isinstance(given, list) and given and all(isinstance(x, str) for x in given):
            return given
    return None


def _add_bundle(spec: dict[str, Any], trainer: dict[str, Any], s: Settings) -> None:
    volumes = spec["volumes"] = list(spec.get("volumes") or [])
    if not any(isinstance(v, dict) and v.get("name") == VOLUME for v in volumes):
        volumes.append({"name": VOLUME, "emptyDir": {"sizeLimit": "512Mi"}})
    inits = spec["initContainers"] = list(spec.get("initContainers") or [])
    if not any(isinstance(c, dict) and c.get("name") == INIT_NAME for c in inits):
        inits.insert(0, {
            "name": INIT_NAME, "image": s.image, "imagePullPolicy": s.pull_policy,
            "command": ["cp", "-a", f"{s.bundle_dir}/.", s.agent_dir + "/"],
            "volumeMounts": [{"name": VOLUME, "mountPath": s.agent_dir}],
            "resources": _json_copy(dict(s.init_resources)),
            "securityContext": {"allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}},
        })
    mounts = trainer.setdefault("volumeMounts", [])
    if not any(isinstance(m, dict) and m.get("name") == VOLUME for m in mounts):
        mounts.append({"name": VOLUME, "mountPath": s.agent_dir, "readOnly": True})


def metrics_port_for(namespace: str, job: str, rank: int, s: Settings) -> int:
    """A hostNetwork pod's port: ranks of one job spread over the span, jobs offset by a
    hash so that two jobs' rank 0 do not start on the same port."""
    span = max(1, min(s.metrics_port_span, MAX_PORT_SPAN))
    offset = int.from_bytes(hashlib.sha256(f"{namespace}/{job}".encode()).digest()[:4], "big")
    return s.metrics_port + (offset + rank) % span


def _metrics_port(pod: Mapping[str, Any], env: Mapping[str, str], namespace: str,
                  ident: Identity, s: Settings) -> int:
    given = env.get("FTAGENT_METRICS_PORT", "")
    if given.isdigit() and 0 < int(given) < 65536:
        return int(given)
    spec = pod["spec"]
    used = {p.get("containerPort") for c in spec.get("containers", []) + spec.get(
        "initContainers", []) if isinstance(c, dict) for p in c.get("ports", []) or []
        if isinstance(p, dict) and p.get("name") != PORT_NAME}
    if spec.get("hostNetwork"):
        rank = ident.rank if ident.rank is not None else int.from_bytes(hashlib.sha256(
            _str(pod, "metadata", "name").encode()).digest()[:4], "big")
        port = metrics_port_for(namespace, ident.job, rank, s)
    else:
        port = s.metrics_port
    while port in used:
        port += 1
    return port


def _env(ident: Identity, job: str, namespace: str, port: int, monitor_only: bool,
         s: Settings) -> list[dict[str, Any]]:
    def field_ref(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", **field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", **field_ref("metadata.namespace")},
        {"name": "NODE_NAME", **field_ref("spec.nodeName")},
        {"name": "POD_IP", **field_ref("status.podIP")},
        {"name": "FTAGENT_JOB", "value": job},
        {"name": "FTAGENT_METRICS_PORT", "value": str(port)},
    ]
    if ident.rank is not None:
        env.append({"name": "FTAGENT_RANK", "value": str(ident.rank)})
    if ident.world_size is not None:
        env.append({"name": "FTAGENT_WORLD_SIZE", "value": str(ident.world_size)})
    if ident.crash_only:
        env.append({"name": "FTAGENT_PROGRESS", "value": "none"})
    if monitor_only:
        env += [{"name": "FTAGENT_HANG_ACTION", "value": "alert"},
                {"name": "FTAGENT_MAX_RESTARTS", "value": "0"}]
    elif ident.arbitrated and s.arbiter:
        env.append({"name": "FTAGENT_ARBITER", "value": s.arbiter})
        if s.token_for is not None:
            env.append({"name": "FTAGENT_TOKEN", "value": s.token_for(namespace, job)})
    return env


def _add_env(c: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    env = c.get("env")
    if not isinstance(env, list):
        env = c["env"] = []
    have = {e.get("name") for e in env if isinstance(e, dict)}
    env.extend(e for e in entries if e["name"] not in have)


def _add_port(c: dict[str, Any], port: int, host_network: bool) -> None:
    ports = c.get("ports")
    if not isinstance(ports, list):
        ports = c["ports"] = []
    if any(isinstance(p, dict) and p.get("name") == PORT_NAME for p in ports):
        return
    entry: dict[str, Any] = {"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}
    if host_network:
        entry["hostPort"] = port
    ports.append(entry)


# --------------------------------------------------------------------------- JSONPatch


def _pointer(*parts: str | int) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """A JSONPatch turning ``old`` into ``new`` for what the mutation touches: annotations
    per key, whole init containers / volumes lists, whole containers that changed."""
    ops: list[dict[str, Any]] = []
    old_meta, new_meta = old.get("metadata") or {}, new.get("metadata") or {}
    if "metadata" not in old:
        ops.append({"op": "add", "path": "/metadata", "value": {}})
    for part in ("annotations", "labels"):
        old_map = old_meta.get(part)
        new_map = new_meta.get(part) or {}
        if not isinstance(old_map, dict):
            if new_map:
                ops.append({"op": "add" if old_map is None else "replace",
                            "path": _pointer("metadata", part), "value": new_map})
        else:
            for k, v in new_map.items():
                if old_map.get(k) != v:
                    ops.append({"op": "add", "path": _pointer("metadata", part, k),
                                "value": v})
    old_spec, new_spec = old["spec"], new["spec"]
    for key in ("initContainers", "volumes"):
        if old_spec.get(key) != new_spec.get(key):
            ops.append({"op": "add" if key not in old_spec else "replace",
                        "path": _pointer("spec", key), "value": new_spec[key]})
    for i, (a, b) in enumerate(zip(old_spec["containers"], new_spec["containers"],
                                   strict=True)):
        if a != b:
            ops.append({"op": "replace", "path": _pointer("spec", "containers", i),
                        "value": b})
    return ops
