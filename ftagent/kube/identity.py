"""Who a pod is: its job, role, rank and world size, read from its job's own labels and env.

Pure: a pod (the AdmissionReview's JSON object) in, an :class:`Identity` out. The sources,
first match wins:

=================  ==========================================  ===============================
job kind           job name, role                              rank / world size
=================  ==========================================  ===============================
pod label          ``ftagent.io/job``                          as the job kind below, else
                                                               ``ftagent.io/rank`` and
                                                               ``ftagent.io/world-size``
                                                               annotations
MPI Operator       ``training.kubeflow.org/job-name``, role     launcher: rank 0 of 1, crashes
                   ``launcher``/``worker`` (job-role or         only; workers run sshd for the
                   replica-type, operator ``mpi*``)             launcher: local, crashes only
Kubeflow v1        ``training.kubeflow.org/job-name``,          TFJob: ``TF_CONFIG`` (chief,
(PyTorch, TF,      ``replica-type``, ``replica-index``          master, worker, ps); MXJob:
Paddle, MX,                                                     ``DMLC_*``; else
XGBoost)                                                        ``PET_NODE_RANK``/``PET_NNODES``,
                                                                then the labels: the master is
                                                                rank 0, workers follow it
JobSet / Trainer   ``jobset.sigs.k8s.io/jobset-name``,          ``PET_NODE_RANK``/``PET_NNODES``
v2 TrainJob        ``replicatedjob-name``                       else job-global-index x
                                                                ``ftagent.io/pods-per-job``
                                                                (default 1) + completion index
Volcano            ``volcano.sh/job-name``, ``task-spec``      ``RANK``/``WORLD_SIZE`` (its
                                                                pytorch plugin), else
                                                                ``VC_<TASK>_NUM`` and the
                                                                task index (master first)
Indexed Job        ``batch.kubernetes.io/job-name``             completion index; world size
                                                                from the annotation
=================  ==========================================  ===============================

Only literal ``value`` env entries are read (a ``valueFrom`` is resolved by the kubelet,
too late for admission). What cannot be known here is left unset, and the agent falls back
to the variables the job sets at run time (``$RANK``, ``$WORLD_SIZE``, ``$PET_*``).
Roles without steps (parameter servers, launchers, MXNet schedulers and servers) are
supervised for crashes only (``--progress none``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KF = "training.kubeflow.org/"
JS = "jobset.sigs.k8s.io/"
VC = "volcano.sh/"
BATCH = "batch.kubernetes.io/"
COMPLETION_INDEX = BATCH + "job-completion-index"

# Container names that are the trainer by convention: Kubeflow's default container of
# each kind, and the Trainer v2 torch runtime's.
TRAINER_NAMES = ("pytorch", "tensorflow", "mpi", "paddle", "mxnet", "xgboost", "node",
                 "trainer")
CRASH_ONLY_ROLES = frozenset({"ps", "launcher", "scheduler", "server"})
# Trainer v2's initializer replicated jobs: no rank of the training job.
NOT_TRAINING_JOBS = frozenset({"dataset-initializer", "model-initializer", "initializer"})
TF_ORDER = ("chief", "master", "worker", "ps")
MX_ORDER = ("scheduler", "server", "worker")

# A label value (Kubernetes' validation.IsValidLabelValue): at most 63 characters, empty or
# alphanumerics with '-', '_', '.' inside.
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?\Z")
MAX_LABEL_VALUE = 63
HASH_CHARS = 10


@dataclass(frozen=True)
class Identity:
    """What the webhook tells the agent about its pod (None: not known at admission)."""

    kind: str  # "kubeflow", "mpi", "jobset", "trainjob", "volcano", "indexed-job", "label"
    job: str
    role: str = ""  # replica type, replicated job or task spec, lower case
    rank: int | None = None
    world_size: int | None = None
    crash_only: bool = False  # a role without steps: --progress none
    arbitrated: bool = True  # False: not a rank of the job (MPI workers): local policy only
    skip: str = ""  # why this pod is not injected at all ("" when it is)


def _meta(pod: Any) -> Mapping[str, Any]:
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    return meta if isinstance(meta, Mapping) else {}  # `metadata: null` is no metadata


def labels_of(pod: Mapping[str, Any]) -> dict[str, str]:
    return _str_map(_meta(pod).get("labels"))


def annotations_of(pod: Mapping[str, Any]) -> dict[str, str]:
    return _str_map(_meta(pod).get("annotations"))


def _str_map(v: Any) -> dict[str, str]:
    if not isinstance(v, dict):
        return {}
    return {str(k): str(x) for k, x in v.items() if isinstance(x, (str, int, float, bool))}


def literal_env(container: Mapping[str, Any]) -> dict[str, str]:
    """The container's env entries with a literal ``value`` (later entries win)."""
    out: dict[str, str] = {}
    env = container.get("env")
    for e in env if isinstance(env, list) else ():
        if isinstance(e, dict) and isinstance(e.get("name"), str) and "valueFrom" not in e:
            out[e["name"]] = str(e.get("value", ""))
    return out


def _int(v: str | None) -> int | None:
    if v is None or not v.strip().isdigit() or len(v.strip()) > 9:
        return None
    return int(v.strip())


def job_label_value(job: str) -> str:
    """``job`` as a label value: itself when it is one, else a readable prefix and a hash
    (a valid job never gets denied for its name: a 55-character PyTorchJob, a Job named
    ``2024-sweep``, a 253-character ``FTAGENT_JOB``). The full name is kept in the pod's
    ``ftagent.io/job-name`` annotation and in ``FTAGENT_JOB``."""
    if LABEL_VALUE.match(job) and len(job) <= MAX_LABEL_VALUE:
        return job
    digest = hashlib.sha256(job.encode("utf-8", "replace")).hexdigest()[:HASH_CHARS]
    head = re.sub(r"[^-A-Za-z0-9_.]", "-", job[:MAX_LABEL_VALUE - HASH_CHARS - 1])
    head = head.strip("-_.")
    return f"{head}-{digest}" if head else digest


def identify(pod: Mapping[str, Any], env: Mapping[str, str], *,
             labels: Mapping[str, str] | None = None,
             notes: Mapping[str, str] | None = None) -> Identity | None:
    """The pod's identity from its labels and its trainer container's literal ``env``;
    None when the pod belongs to no job kind we know (and has no ``ftagent.io/job``).
    ``labels``/``notes``: the pod's, when the caller has them already (the webhook)."""
    labels = labels_of(pod) if labels is None else labels
    notes = annotations_of(pod) if notes is None else notes
    found = (_mpi(labels) or _kubeflow(labels, env) or _jobset(labels, notes, env)
             or _volcano(labels, env) or _indexed_job(labels))
    explicit = labels.get("ftagent.io/job")
    if explicit:
        found = Identity(kind="label", job=explicit) if found is None else \
            Identity(**{**found.__dict__, "job": explicit})
    if found is None:
        return None
    rank = found.rank if found.rank is not None else _int(notes.get("ftagent.io/rank"))
    world = _int(notes.get("ftagent.io/world-size")) or found.world_size
    if rank is not None and world is not None and rank >= world:
        world = None  # inconsistent sources: let the agent decide at run time
    return Identity(**{**found.__dict__, "rank": rank, "world_size": world})


def _mpi(labels: Mapping[str, str]) -> Identity | None:
    job = labels.get(KF + "job-name")
    role = (labels.get(KF + "job-role") or labels.get(KF + "replica-type") or "").lower()
    operator = labels.get(KF + "operator-name", "")
    if not job or not (operator.startswith("mpi") or role == "launcher"):
        return None
    if role == "launcher":
        return Identity("mpi", job, role, rank=0, world_size=1, crash_only=True)
    return Identity("mpi", job, role or "worker", crash_only=True, arbitrated=False)


def _kubeflow(labels: Mapping[str, str], env: Mapping[str, str]) -> Identity | None:
    job = labels.get(KF + "job-name")
    if not job:
        return None
    role = labels.get(KF + "replica-type", "").lower()
    index = _int(labels.get(KF + "replica-index"))
    if role == "evaluator":  # TF's evaluator is no member of the training cluster
        return Identity("kubeflow", job, role, crash_only=False, arbitrated=False)
    rank, world = _tf_config(env.get("TF_CONFIG", ""))
    if rank is None and "DMLC_ROLE" in env:
        rank, world = _mxnet(role, index, env)
    if rank is None:
        rank = _int(env.get("PET_NODE_RANK"))
        world = _int(env.get("PET_NNODES"))
    if rank is None and index is not None:
        if role in ("master", "chief"):
            rank = 0
        elif role == "worker":
            # workers follow a master (PyTorchJob points MASTER_ADDR at JOB-master-0)
            has_master = env.get("MASTER_ADDR", "").endswith("-master-0")
            rank = index + (1 if has_master else 0)
    if world is None:
        world = _world_from_env(env)
    return Identity("kubeflow", job, role, rank=rank, world_size=world,
                    crash_only=role in CRASH_ONLY_ROLES)


def _world_from_env(env: Mapping[str, str]) -> int | None:
    """Agents in the job from WORLD_SIZE, divided by the processes per node if given."""
    world = _int(env.get("WORLD_SIZE"))
    nproc = _int(env.get("PET_NPROC_PER_NODE"))
    if world and nproc and nproc > 1 and world % nproc == 0:
        return world // nproc
    return world or None


def _tf_config(raw: str) -> tuple[int | None, int | None]:
    if not raw:
        return None, None
    try:
        cfg = json.loads(raw)
        cluster, task = cfg["cluster"], cfg["task"]
        sizes = {t: len(cluster[t]) for t in TF_ORDER if isinstance(cluster.get(t), list)}
        kind, index = str(task["type"]).lower(), int(task["index"])
    except (ValueError, KeyError, TypeError):
        return None, None
    if kind not in sizes or not 0 <= index < sizes[kind]:
        return None, None
    offset = sum(sizes[t] for t in TF_ORDER[:TF_ORDER.index(kind)] if t in sizes)
    return offset + index, sum(sizes.values())


def _mxnet(role: str, index: int | None, env: Mapping[str, str]) -> tuple[int | None, int | None]:
    servers, workers = _int(env.get("DMLC_NUM_SERVER")), _int(env.get("DMLC_NUM_WORKER"))
    kind = env.get("DMLC_ROLE", role).lower()
    if servers is None or workers is None or kind not in MX_ORDER:
        return None, None
    if kind == "scheduler":
        return 0, 1 + servers + workers
    if index is None:
        return None, 1 + servers + workers
    return (1 + index if kind == "server" else 1 + servers + index), 1 + servers + workers


def _jobset(labels: Mapping[str, str], notes: Mapping[str, str],
            env: Mapping[str, str]) -> Identity | None:
    job = labels.get(JS + "jobset-name")
    if not job:
        return None
    role = labels.get(JS + "replicatedjob-name", "").lower()
    kind = "trainjob" if role == "node" or "PET_NNODES" in env else "jobset"
    if role in NOT_TRAINING_JOBS:
        return Identity(kind, job, role, skip=f"replicated job {role!r} is no training rank")
    rank, world = _int(env.get("PET_NODE_RANK")), _int(env.get("PET_NNODES"))
    if rank is None:
        ci = _int(labels.get(COMPLETION_INDEX) or notes.get(COMPLETION_INDEX))
        gi = _int(labels.get(JS + "job-global-index") or labels.get(JS + "job-index"))
        per_job = _int(notes.get("ftagent.io/pods-per-job")) or 1
        if ci is not None or gi is not None:
            rank = (gi or 0) * per_job + (ci or 0)
    return Identity(kind, job, role, rank=rank, world_size=world or _world_from_env(env))


def _volcano(labels: Mapping[str, str], env: Mapping[str, str]) -> Identity | None:
    job = labels.get(VC + "job-name")
    if not job:
        return None
    role = labels.get(VC + "task-spec", "").lower()
    rank, world = _int(env.get("RANK")), _world_from_env(env)
    index = _int(labels.get(VC + "task-index") or env.get("VC_TASK_INDEX"))
    counts = {k[3:-4].lower(): _int(v) for k, v in env.items()
              if k.startswith("VC_") and k.endswith("_NUM")}
    if rank is None and index is not None:
        # the master task first, then the others in name order (the svc plugin's counts)
        order = sorted(counts, key=lambda t: (t != "master", t))
        if role in order and all(counts[t] is not None for t in order):
            rank = sum(counts[t] or 0 for t in order[:order.index(role)]) + index
            world = world or sum(counts[t] or 0 for t in order)
        elif not counts:
            rank = index
    return Identity("volcano", job, role, rank=rank, world_size=world,
                    crash_only=role in CRASH_ONLY_ROLES)


def _indexed_job(labels: Mapping[str, str]) -> Identity | None:
    job = labels.get(BATCH + "job-name") or labels.get("job-name")
    if not job:
        return None
    index = _int(labels.get(COMPLETION_INDEX))
    # a Job that is not Indexed has no ranks: its pods would collide at the arbiter
    return Identity("indexed-job" if index is not None else "job", job, "", rank=index,
                    arbitrated=index is not None)


def trainer_index(pod: Mapping[str, Any], role: str) -> tuple[int | None, str]:
    """(index of the trainer container, how it was chosen) or (None, why not).

    The annotation ``ftagent.io/container``; else the container named like the role
    (replica type, replicated job, task spec); else one named by convention
    (``TRAINER_NAMES``); else the only container.
    """
    spec = pod.get("spec")
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list) or not containers:
        return None, "the pod has no containers"
    names = [c.get("name") if isinstance(c, dict) else None for c in containers]
    wanted = annotations_of(pod).get("ftagent.io/container")
    if wanted:
        if wanted in names:
            return names.index(wanted), f"annotation ftagent.io/container={wanted}"
        return None, f"annotation ftagent.io/container names {wanted!r}, which is no container"
    if role and role in names:
        return names.index(role), f"named like the role {role!r}"
    for n in TRAINER_NAMES:
        if n in names:
            return names.index(n), f"named {n!r}"
    if len(containers) == 1:
        return 0, "the only container"
    return None, ("several containers and none is the trainer by name: set the annotation "
                  "ftagent.io/container")
