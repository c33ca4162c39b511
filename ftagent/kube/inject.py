"""The pod mutation: wrap the trainer in ``ftagent run`` and give the agent what it needs.

Pure: ``mutate(pod, namespace, settings)`` returns a :class:`Mutation` with a JSONPatch
(RFC 6902) against the pod as given, the admission warnings and, for a bad job name, a
denial. The webhook (``webhook.py``) only carries it over HTTPS.

What an injected pod gets:

* an init container ``ftagent-install`` (the ftagent image) that copies the agent (the
  self-contained bundle, and in ``py/`` the wheels the training image's own Python runs
  it from) and its entry shim (``packaging/ftagent-entry.sh``) into the ``emptyDir``
  ``ftagent``, mounted read-only at ``/opt/ftagent`` in the trainer, and
  writes the arbiter's CA there (``ca.crt``) when the webhook has one (``--arbiter-ca``,
  re-read when the file changes). It meets Pod Security "restricted" on its own: no
  privilege escalation, every capability dropped, non-root, seccomp ``RuntimeDefault``,
  read-only root, and it runs under any securityContext the pod sets (a pod-level
  ``runAsUser: 0`` gets the image's UID on it: :func:`init_security_context`). Windows
  pods are left alone. (Annotation ``ftagent.io/agent: image``: the image has ftagent on its
  PATH; nothing is copied);
* the trainer container's ``command`` becomes ``/opt/ftagent/busybox sh
  /opt/ftagent/ftagent-entry -- <command>`` (its ``args`` stay as they are; a static
  busybox: images without ``/bin/sh`` start it too): the shim runs ``ftagent run -- <command>``
  on the image's Python (3.10+) or as the bundle, or, when neither can start in this
  image (docs/compatibility.md: an old Python and glibc, musl, noexec mount, another
  architecture, a malformed ``FTAGENT_*`` value), the command itself, saying why on
  stderr: the trainer always starts.
  A container without ``command`` runs its image's ENTRYPOINT, which admission cannot see:
  it is left alone with a warning and the annotation ``ftagent.io/injected: "skipped: no
  command"``, unless the annotation ``ftagent.io/command`` (a JSON list) says what the
  image runs;
* credentials: none written. An arbitrated pod gets the projected ServiceAccount token
  volume ``ftagent-token`` (audience ``ftagent``, one hour, rotated by the kubelet)
  read-only at ``/var/run/secrets/ftagent`` and ``FTAGENT_TOKEN_FILE`` naming it; the
  arbiter checks it with a TokenReview, so a pod can only ever speak as itself;
* env: ``POD_NAME``, ``POD_NAMESPACE``, ``NODE_NAME``, ``POD_IP`` (downward API),
  ``FTAGENT_JOB``/``_RANK``/``_WORLD_SIZE`` where the job's labels and env tell
  (``identity.py``), ``FTAGENT_ARBITER``, ``FTAGENT_TLS_CA``, ``FTAGENT_PROGRESS=none``
  for roles without steps, ``FTAGENT_METRICS_PORT``. What the container already sets wins;
* ``FTAGENT_STOP_TIMEOUT``: the pod's ``terminationGracePeriodSeconds`` less
  ``grace.STOP_MARGIN`` (5 s), so that the agent records the trainer's exit and closes
  before the kubelet's SIGKILL; a value the container sets itself is kept, with a warning
  when it is not below the grace, and the annotation ``ftagent.io/stop-timeout`` says what
  the agent got and why (``grace.py``);
* the named port ``ftagent-metrics`` and ``prometheus.io/scrape|port|path`` annotations.
  In its own network namespace every pod uses the base port (9440, or the next one no
  container of the pod declares). **hostNetwork pods** share the node's ports: each gets
  ``base + (hash(namespace/job) + rank) mod span`` (span 100: 9440-9539) declared as a
  *host port*, so the scheduler never places two pods with the same port on one node
  (nothing fights over a port, and no agent is silently without metrics); ranks of a job
  get distinct ports up to ``span`` ranks, beyond that two ranks whose ports are equal
  just never share a node. The range stays clear of 9400-9439, ftagent's own ports (the
  arbiter's 9400 and 9431, the node agent's host port 9432): a rank given the node
  agent's port could be scheduled on no node that runs it. Prometheus finds each agent by
  the port's name (PodMonitor) or the annotations;
* the label ``ftagent.io/job`` (the job's name, or a prefix and a hash when the name is no
  label value: a valid job is never denied) and the annotation ``ftagent.io/job-name``;
* ``ftagent.io/fault-tolerance: "false"`` (pod label or annotation) makes it monitor and
  alert only: no arbiter, no restarts, ``--hang-action alert``.

Which pods: those of a job kind ``identity.py`` knows and those labelled
``ftagent.io/inject: "true"`` (or ``ftagent.io/job``); a plain (non-indexed) batch Job in
an opted-in namespace is left alone. Nothing in this module denies a pod: every outcome
is "injected" or "skipped" with a reason from :data:`SKIP_REASONS` (a bounded set, the
``reason`` label of the webhook's metrics).

The namespace of anything derived (the hostNetwork port's hash) is the AdmissionReview's
``request.namespace`` only, never a value from the pod.

The mutation is idempotent: a pod already injected gets an empty patch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ftagent import __version__
from ftagent.kube import grace
from ftagent.kube.identity import (
    Identity,
    annotations_of,
    identify,
    job_label_value,
    labels_of,
    literal_env,
    trainer_index,
)
from ftagent.kube.pod_tiers import add_rules

INJECTED = "ftagent.io/injected"
JOB_LABEL = "ftagent.io/job"  # set on injected pods: the arbiter watches pods by it
RESTART_IN_PLACE = "ftagent.io/restart-in-place"  # the pod's own say on restart rules
JOB_NAME_NOTE = "ftagent.io/job-name"  # the job's full name when the label had to hash it
VOLUME = "ftagent"
TOKEN_VOLUME = "ftagent-token"  # contract C2
TOKEN_DIR = "/var/run/secrets/ftagent"
TOKEN_AUDIENCE = "ftagent"
TOKEN_SECONDS = 3600
INIT_NAME = "ftagent-install"
ENTRY = "ftagent-entry"  # the shim beside the agent in the bundle
SHELL = "busybox"  # a static busybox beside it: its sh runs the shim (images without one)
CA_FILE = "ca.crt"
PORT_NAME = "ftagent-metrics"
MAX_PORT_SPAN = 1000
MAX_COMMAND_NOTE = 16 * 1024  # ftagent.io/command: longer is not parsed (nor deep JSON)

# Why a pod was not injected: the bounded set of the webhook metrics' ``reason`` label.
SKIP_REASONS = ("not a pod", "opted out", "no containers", "no trainer container",
                "not a training pod", "plain job", "not a training rank", "no command",
                "already injected", "unreadable pod", "not linux")


@dataclass(frozen=True)
class Settings:
    """How the webhook injects (flags of ``ftagent webhook``)."""

    image: str = f"ghcr.io/ftagent/ftagent:{__version__}"
    arbiter: str = ""  # HOST:PORT for FTAGENT_ARBITER ("" : agents decide locally)
    # the arbiter's CA (PEM) as of now, "" for none: the webhook re-reads its file
    arbiter_ca: Callable[[], str] | None = None
    token_audience: str = TOKEN_AUDIENCE
    token_seconds: int = TOKEN_SECONDS
    image_pull_secrets: tuple[str, ...] = ()  # for the init container's image
    agent_dir: str = "/opt/ftagent"  # where the trainer finds the agent
    bundle_dir: str = "/opt/ftagent-bundle"  # where the image holds it
    metrics_port: int = 9440  # 9400-9439: ftagent's own (docs/deploy.md, "Ports")
    metrics_port_span: int = 100  # hostNetwork pods: ports base .. base+span-1
    pull_policy: str = "IfNotPresent"
    init_resources: Mapping[str, Any] = field(default_factory=lambda: {
        "requests": {"cpu": "50m", "memory": "32Mi"},
        "limits": {"cpu": "1", "memory": "128Mi"}})
    # container restart rules for the ladder's pod-level tiers (kube/pod_tiers.py) on every
    # arbitrated pod: "" none, "container" (KEP-5307 Restart only: 1.35), "pod" (and
    # KEP-5532 RestartAllContainers: 1.36+); a pod says its own with
    # ftagent.io/restart-in-place (the same values, "true" for "pod", "false" for none)
    restart_rules: str = ""


@dataclass
class Mutation:
    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    status: str = ""  # the value written to ftagent.io/injected (or why nothing was done)
    reason: str = ""  # one of SKIP_REASONS when skipped, "" when injected

    @property
    def injected(self) -> bool:
        return not self.reason


def _false(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("false", "0", "no", "off")


def mutate(pod: Any, namespace: str, settings: Settings) -> Mutation:
    """The patch that injects ftagent into ``pod`` (the AdmissionReview's object).
    ``namespace``: the review's ``request.namespace``, the only namespace trusted."""
    if not isinstance(pod, dict) or not isinstance(pod.get("spec"), dict):
        return Mutation(status="skipped: not a pod", reason="not a pod")
    labels = labels_of(pod)
    if _false(labels.get("ftagent.io/inject")):
        return Mutation(status="skipped: opted out (ftagent.io/inject=false)",
                        reason="opted out")
    try:
        new = _working_copy(pod)
        status, reason, warnings = _inject(new, namespace, settings)
    except RecursionError:  # JSON nested deeper than any pod: nothing to inject into
        return Mutation(status="skipped: unreadable pod (nested too deep)",
                        reason="unreadable pod")
    if reason == "already injected":  # a reinvocation: nothing more to do
        return Mutation(warnings=warnings, status=status, reason=reason)
    meta = new["metadata"]
    if not isinstance(meta.get("annotations"), dict):
        meta["annotations"] = {}
    meta["annotations"][INJECTED] = status
    return Mutation(patch=diff(pod, new), warnings=warnings, status=status, reason=reason)


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


def _inject(pod: dict[str, Any], namespace: str, s: Settings
            ) -> tuple[str, str, list[str]]:
    """Mutate ``pod`` in place; (the ftagent.io/injected value, the skip reason or "",
    warnings)."""
    spec = pod["spec"]
    notes, labels = annotations_of(pod), labels_of(pod)
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers or \
            not all(isinstance(c, dict) for c in containers):
        return ("skipped: no containers", "no containers",
                ["ftagent: the pod has no containers; not injected"])
    if _windows(spec):  # no /bin/sh, and the API refuses a Linux securityContext there
        return ("skipped: not linux (a Windows pod)", "not linux",
                ["ftagent: a Windows pod: not injected"])
    # identity needs the trainer's env, the trainer's choice needs the role: role first
    probe = identify(pod, {}, labels=labels, notes=notes)
    index, how = trainer_index(pod, probe.role if probe else "")
    if index is None:
        return f"skipped: {how}", "no trainer container", [f"ftagent: not injected: {how}"]
    trainer = containers[index]
    env = literal_env(trainer)
    found = identify(pod, env, labels=labels, notes=notes)
    asked = labels.get("ftagent.io/inject", "").strip().lower() == "true" or \
        bool(labels.get(JOB_LABEL))
    if found is None and not asked:
        return ("skipped: not a training pod (no known job kind, no ftagent.io/inject "
                "label)", "not a training pod", [])
    if found is not None and found.kind == "job" and not asked:
        return ("skipped: plain Job (not indexed, no training job kind): label its pods "
                "ftagent.io/inject=true to inject", "plain job", [])
    ident = found or Identity("pod", _str(pod, "metadata", "name")
                              or _str(pod, "metadata", "generateName").rstrip("-")
                              or "pod")
    if ident.skip:
        return f"skipped: {ident.skip}", "not a training rank", []
    name = env.get("FTAGENT_JOB") or ident.job
    command = _command(trainer, notes)
    if command is None:
        what = "args but no command" if trainer.get("args") else "no command"
        return (f"skipped: {what}", "no command",
                [f"ftagent: container {str(trainer.get('name'))[:63]!r} has {what} (image "
                 "entrypoint unknown): runs without ftagent; set command or "
                 "ftagent.io/command"])
    from_image = notes.get("ftagent.io/agent", "").strip().lower() == "image"
    if _wrapped(_argv(command, trainer), s):
        return "skipped: already injected", "already injected", \
            ([] if INJECTED in notes else list(_own_agent_stop(spec, trainer, command, s)))
    if from_image:
        trainer["command"] = ["ftagent", "run", "--", *command]
    else:
        trainer["command"] = [f"{s.agent_dir}/{SHELL}", "sh", f"{s.agent_dir}/{ENTRY}", "--",
                              *command]
    monitor_only = _false(labels.get("ftagent.io/fault-tolerance")) or \
        _false(notes.get("ftagent.io/fault-tolerance"))
    arbitrated = ident.arbitrated and bool(s.arbiter) and not monitor_only
    ca = (s.arbiter_ca() if s.arbiter_ca is not None else "") if arbitrated else ""
    if not from_image or ca:
        _add_bundle(spec, trainer, s, ca, copy_agent=not from_image)
    if arbitrated:
        _add_token(spec, trainer, s)
    port = _metrics_port(pod, env, namespace, ident, s)
    stop = grace.stop_timeout(spec, trainer)  # before the env gets ours
    _add_env(trainer, _env(ident, name, port, monitor_only, arbitrated, bool(ca), s))
    if stop.value is not None:
        _add_env(trainer, [{"name": grace.ENV, "value": stop.value}])
    _add_port(trainer, port, bool(spec.get("hostNetwork")))
    warnings = [*stop.warnings,
                *(_restart_rules(spec, trainer, labels, notes, s) if arbitrated else [])]
    meta = pod["metadata"]
    if not isinstance(meta.get("annotations"), dict):
        meta["annotations"] = {}
    annotations = meta["annotations"]
    annotations[grace.NOTE] = stop.note
    for k, v in (("prometheus.io/scrape", "true"), ("prometheus.io/port", str(port)),
                 ("prometheus.io/path", "/metrics"), (JOB_NAME_NOTE, name)):
        annotations.setdefault(k, v)
    if not isinstance(meta.get("labels"), dict):
        meta["labels"] = {}
    meta["labels"].setdefault(JOB_LABEL, job_label_value(name))  # the arbiter's pod watch
    mode = "monitor only" if monitor_only else ident.kind
    return f"true ({mode}, container {str(trainer.get('name'))[:63]}, {how})", "", warnings


def _restart_rules(spec: dict[str, Any], trainer: dict[str, Any], labels: Mapping[str, str],
                   notes: Mapping[str, str], s: Settings) -> list[str]:
    """The trainer container's restart rules for the in-place tiers (pod_tiers.add_rules),
    where the webhook adds them (Settings.restart_rules) or the pod asks
    (``ftagent.io/restart-in-place``, label or annotation: "pod" or "true" both rules,
    "container" the KEP-5307 one only, "false" none)."""
    asked = (notes.get(RESTART_IN_PLACE) or labels.get(RESTART_IN_PLACE) or "").strip().lower()
    if _false(asked):
        return []
    which = {"true": "pod", "pod": "pod", "container": "container"}.get(asked, s.restart_rules)
    if which not in ("pod", "container"):
        return []
    why = add_rules(trainer, spec.get("restartPolicy"), reset_pod=which == "pod")
    return [f"ftagent: no in-place restart rules: {why}"] if why else []


def _windows(spec: Mapping[str, Any]) -> bool:
    """A pod for Windows nodes (``spec.os.name``, or the well-known node label it selects):
    the init container's shell is not there, and for ``os.name: windows`` the API refuses
    the pod outright with seccomp, capabilities or runAsUser set on any container."""
    selector = spec.get("nodeSelector")
    return _str(spec, "os", "name") == "windows" or (
        isinstance(selector, dict) and selector.get("kubernetes.io/os") == "windows")


def _own_agent_stop(spec: Mapping[str, Any], trainer: Mapping[str, Any],
                    command: list[str], s: Settings) -> tuple[str, ...]:
    """Warnings about the stop timeout of a container whose command already is the agent
    (the image's own ``ftagent run``, or a pod copied from an injected one without its
    annotation): its ``--stop-timeout`` or ``FTAGENT_STOP_TIMEOUT`` is kept, and checked
    against the pod's grace."""
    argv = _argv(command, trainer)
    return grace.stop_timeout(spec, trainer, argv[2:] if _runs_agent(argv) else []).warnings


def _argv(command: list[str], c: Mapping[str, Any]) -> list[str]:
    """The container's whole command line: ``command``, then ``args`` when they are a list
    of strings (the runtime appends them; an image may split ``ftagent`` and ``run ...``)."""
    args = c.get("args")
    return [*command, *(args if isinstance(args, list) and
                        all(isinstance(a, str) for a in args) else ())]


def _runs_agent(argv: list[str]) -> bool:
    """``ftagent run ...``: the agent by name (on PATH, or at any path: the image's own
    ``/usr/local/bin/ftagent``, the bundle's copy)."""
    return len(argv) >= 2 and argv[0].rsplit("/", 1)[-1] == "ftagent" and argv[1] == "run"


def _wrapped(argv: list[str], s: Settings) -> bool:
    """Already injected (a reinvocation, or a pod made from an injected one), or the
    container runs the agent itself: ``argv`` is its command and args together, so
    ``command: [ftagent], args: [run, --, ...]`` is not wrapped a second time."""
    return argv[:3] == [f"{s.agent_dir}/{SHELL}", "sh", f"{s.agent_dir}/{ENTRY}"] or \
        argv[:2] == ["/bin/sh", f"{s.agent_dir}/{ENTRY}"] or \
        _runs_agent(argv)  # the middle one: injected before the static shell


def _command(c: Mapping[str, Any], notes: Mapping[str, str]) -> list[str] | None:
    """What the container runs before ``args``, or None when admission cannot know it."""
    command = c.get("command")
    if isinstance(command, list) and command and all(isinstance(x, str) for x in command):
        return list(command)
    raw = notes.get("ftagent.io/command")
    if raw and len(raw) <= MAX_COMMAND_NOTE:
        try:
            given = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than a command
            return None
        if isinstance(given, list) and given and all(isinstance(x, str) for x in given):
            return given
    return None


RESTRICTED_CONTEXT: Mapping[str, Any] = {
    # Pod Security "restricted", container level, whatever the pod sets
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    # the image's numeric USER (65532) runs it; no runAsUser here, which OpenShift's
    # restricted SCC (a UID range per namespace) would refuse
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
    "readOnlyRootFilesystem": True,
}
IMAGE_UID = 65532  # the ftagent image's numeric USER (deploy/Dockerfile, build_image.py)


def init_security_context(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The init container's securityContext: restricted, and runnable under whatever the
    pod sets. The init container inherits the pod-level ``runAsUser``; the kubelet refuses
    ``runAsNonRoot`` under an effective UID 0 (CreateContainerConfigError: the pod never
    starts), which a root training image's usual ``runAsUser: 0`` would be. So where the
    pod's UID is not a known non-root one, the init container names the image's own UID;
    elsewhere it names none (OpenShift's restricted SCC assigns one from the namespace's
    range and refuses any other). Container-level settings of the pod's own containers
    never reach an init container; ``runAsGroup`` is never checked by the kubelet."""
    ctx: dict[str, Any] = _json_copy(dict(RESTRICTED_CONTEXT))
    psc = spec.get("securityContext")
    if isinstance(psc, dict) and "runAsUser" in psc:
        uid = psc["runAsUser"]
        if isinstance(uid, bool) or not isinstance(uid, int) or uid <= 0:
            ctx["runAsUser"] = IMAGE_UID
    return ctx


def _install_script(s: Settings, ca: str, copy_agent: bool) -> str:
    """The init container's ``sh -c`` script: copy the bundle, write the CA (from its env,
    never from a file of the pod)."""
    steps = []
    if copy_agent:
        steps.append(f'cp -R "{s.bundle_dir}/." "{s.agent_dir}/"')
    if ca:
        steps.append(f'printf "%s\\n" "$FTAGENT_CA_PEM" > "{s.agent_dir}/{CA_FILE}"')
    return " && ".join(steps)


def _add_bundle(spec: dict[str, Any], trainer: dict[str, Any], s: Settings, ca: str, *,
                copy_agent: bool) -> None:
    volumes = spec["volumes"] = list(spec.get("volumes") or [])
    if not any(isinstance(v, dict) and v.get("name") == VOLUME for v in volumes):
        volumes.append({"name": VOLUME, "emptyDir": {"sizeLimit": "512Mi"}})
    inits = spec["initContainers"] = list(spec.get("initContainers") or [])
    if not any(isinstance(c, dict) and c.get("name") == INIT_NAME for c in inits):
        init: dict[str, Any] = {
            "name": INIT_NAME, "image": s.image, "imagePullPolicy": s.pull_policy,
            "command": ["/bin/sh", "-c", _install_script(s, ca, copy_agent)],
            "volumeMounts": [{"name": VOLUME, "mountPath": s.agent_dir}],
            "resources": _json_copy(dict(s.init_resources)),
            "securityContext": init_security_context(spec),
        }
        if ca:
            init["env"] = [{"name": "FTAGENT_CA_PEM", "value": ca.strip()}]
        inits.insert(0, init)
    if s.image_pull_secrets:
        pulls = spec["imagePullSecrets"] = list(spec.get("imagePullSecrets") or [])
        have = {p.get("name") for p in pulls if isinstance(p, dict)}
        pulls.extend({"name": n} for n in s.image_pull_secrets if n not in have)
    _mount(trainer, {"name": VOLUME, "mountPath": s.agent_dir, "readOnly": True})


def _add_token(spec: dict[str, Any], trainer: dict[str, Any], s: Settings) -> None:
    """Contract C2: the pod's own ServiceAccount token for the arbiter, projected by the
    kubelet (audience-bound, short-lived, rotated); the webhook never sees a credential."""
    volumes = spec["volumes"] = list(spec.get("volumes") or [])
    if not any(isinstance(v, dict) and v.get("name") == TOKEN_VOLUME for v in volumes):
        volumes.append({"name": TOKEN_VOLUME, "projected": {"sources": [
            {"serviceAccountToken": {"audience": s.token_audience,
                                     "expirationSeconds": s.token_seconds,
                                     "path": "token"}}]}})
    _mount(trainer, {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True})


def _mount(c: dict[str, Any], mount: dict[str, Any]) -> None:
    mounts = c.get("volumeMounts")
    if not isinstance(mounts, list):
        mounts = c["volumeMounts"] = []
    if not any(isinstance(m, dict) and m.get("name") == mount["name"] for m in mounts):
        mounts.append(mount)


OWN_PORTS = range(9400, 9440)  # ftagent's own components (docs/deploy.md, "Ports")


def clashing_ports(s: Settings) -> list[int]:
    """The ports of the agents' range that ftagent's own components hold (the node agent's
    host port among them): a hostNetwork rank given one fits on no node running it."""
    span = max(1, min(s.metrics_port_span, MAX_PORT_SPAN))
    return sorted(set(range(s.metrics_port, s.metrics_port + span)) & set(OWN_PORTS))


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
    every = [*_list(spec.get("containers")), *_list(spec.get("initContainers"))]
    used = {p.get("containerPort") for c in every if isinstance(c, dict)
            for p in _list(c.get("ports")) if isinstance(p, dict) and p.get("name") != PORT_NAME}
    if spec.get("hostNetwork"):
        rank = ident.rank if ident.rank is not None else int.from_bytes(hashlib.sha256(
            _str(pod, "metadata", "name").encode()).digest()[:4], "big")
        port = metrics_port_for(namespace, ident.job, rank, s)
    else:
        port = s.metrics_port
    while port in used:
        port += 1
    return port


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _env(ident: Identity, job: str, port: int, monitor_only: bool, arbitrated: bool,
         ca: bool, s: Settings) -> list[dict[str, Any]]:
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
    elif arbitrated:
        env += [{"name": "FTAGENT_ARBITER", "value": s.arbiter},
                {"name": "FTAGENT_TOKEN_FILE", "value": f"{TOKEN_DIR}/token"}]
        if ca:
            env.append({"name": "FTAGENT_TLS_CA", "value": f"{s.agent_dir}/{CA_FILE}"})
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
    if not isinstance(old.get("metadata"), dict):  # absent or null: "add" sets it
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
    for key in ("initContainers", "volumes", "imagePullSecrets"):
        if old_spec.get(key) != new_spec.get(key):
            ops.append({"op": "add" if key not in old_spec else "replace",
                        "path": _pointer("spec", key), "value": new_spec[key]})
    for i, (a, b) in enumerate(zip(_list(old_spec.get("containers")),
                                   _list(new_spec.get("containers")), strict=True)):
        if a != b:
            ops.append({"op": "replace", "path": _pointer("spec", "containers", i),
                        "value": b})
    return ops
