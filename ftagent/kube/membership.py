"""Which job a pod belongs to: its controller chain, never a label its creator wrote. Pure.

Anyone who may create pods in a namespace can write ``ftagent.io/job=llm`` on a pod. What
they cannot write is an ownerReference to the PyTorchJob ``llm`` with its uid and
``controller: true``: the API server's garbage collector and the job's controller make
those, and the arbiter reads each owner by name and checks that its uid is the one the
reference names (``owners.py``). So:

* the pod's **root** is the top of its controller chain through job kinds (Pod -> batch Job
  -> JobSet -> TrainJob, or Pod -> PyTorchJob / MPIJob / TFJob / ... ), each link
  ``controller: true`` and matched by uid;
* the job named ``J`` in a namespace is **owned** by one root: of the roots of the pods
  labelled ``J``, the one named ``J`` (its label value) first, then one read and checked
  over one taken on its reference's word (RBAC refused the read), then the higher kind
  (TrainJob over JobSet over the Kubeflow kinds over a batch Job), then the first seen;
* a pod is a **member** of ``J`` when its root is that owner; a pod with no job controller
  (a bare pod, a Deployment's) is a member only of a job that no controller owns (a job of
  bare pods is only as strong as its labels: docs/security.md says so).

Labels still *name* things (the job's name, the pod's role and index); the world size comes
from the owner's spec where it has one (``world_from_spec``), and the ranks one pod may hold
from what it can run (``local_world``: its ``--nproc-per-node`` / ``PET_NPROC_PER_NODE``,
capped), never from dividing two numbers a Hello and a label chose.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ftagent.kube.identity import job_label_value, literal_env

MAX_LOCAL_WORLD = 64  # ranks one pod may run (8 GPUs a node today; 64 leaves room)
MAX_JOBS = 100_000
MAX_ROOTS_PER_JOB = 8
# Kinds that may be a job's root, and their rank when two roots claim one job name.
KIND_RANK = {("trainer.kubeflow.org", "TrainJob"): 4, ("jobset.x-k8s.io", "JobSet"): 3,
             ("batch.volcano.sh", "Job"): 2, ("batch", "Job"): 1}
KIND_RANK |= {("kubeflow.org", k): 2 for k in ("PyTorchJob", "TFJob", "MPIJob", "PaddleJob",
                                               "MXJob", "XGBoostJob", "JAXJob")}
# Owned kinds whose own controller is read to climb (Job <- JobSet <- TrainJob).
CLIMB = {("batch", "Job"), ("jobset.x-k8s.io", "JobSet")}


@dataclass(frozen=True)
class Ref:
    """An ownerReference with ``controller: true``."""

    group: str
    version: str
    kind: str
    name: str
    uid: str


@dataclass(frozen=True)
class Root:
    """The top of a pod's controller chain: the job object it belongs to."""

    group: str
    kind: str
    name: str
    uid: str
    world: int | None = None  # pods (nodes) the job runs, from its spec; None: unknown
    verified: bool = True  # read and its uid matched (False: RBAC refused the read)

    @property
    def rank(self) -> int:
        return KIND_RANK.get((self.group, self.kind), 0)


def controller_ref(obj: Any) -> Ref | None:
    """The one ownerReference with ``controller: true`` (Kubernetes allows at most one),
    with a uid; None otherwise."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    refs = meta.get("ownerReferences") if isinstance(meta, Mapping) else None
    if not isinstance(refs, list):
        return None
    for r in refs[:32]:
        if not isinstance(r, Mapping) or r.get("controller") is not True:
            continue
        api, kind, name, uid = (r.get(k) for k in ("apiVersion", "kind", "name", "uid"))
        if not all(isinstance(v, str) and v and len(v) <= 253 for v in (api, kind, name, uid)):
            return None
        group, _, version = str(api).rpartition("/")
        return Ref(group, version, str(kind), str(name), str(uid))
    return None


def _int(v: Any, cap: int = 10**6) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= cap:
        return None
    return v


def world_from_spec(group: str, kind: str, obj: Any) -> int | None:
    """The pods (nodes) a job object says it runs, where its spec says so; None when it
    does not (or says something odd)."""
    spec = obj.get("spec") if isinstance(obj, Mapping) else None
    if not isinstance(spec, Mapping):
        return None
    if (group, kind) == ("trainer.kubeflow.org", "TrainJob"):
        trainer = spec.get("trainer")
        return _int(trainer.get("numNodes")) if isinstance(trainer, Mapping) else None
    if (group, kind) == ("jobset.x-k8s.io", "JobSet"):
        total = 0
        for rj in spec.get("replicatedJobs") or []:
            if not isinstance(rj, Mapping) or str(rj.get("name", "")).endswith("initializer"):
                continue
            tspec = rj.get("template", {}).get("spec") if isinstance(rj.get("template"),
                                                                      Mapping) else None
            par = tspec.get("parallelism", 1) if isinstance(tspec, Mapping) else 1
            reps, par = _int(rj.get("replicas", 1)), _int(par)
            if reps is None or par is None:
                return None
            total += reps * par
        return total or None
    if (group, kind) == ("batch", "Job"):
        return _int(spec.get("completions")) or _int(spec.get("parallelism"))
    if group == "kubeflow.org" and kind.endswith("Job"):
        specs = next((v for k, v in spec.items() if k.endswith("ReplicaSpecs")
                      and isinstance(v, Mapping)), None)
        if specs is None or kind == "MPIJob":  # MPI workers are no ranks (identity.py)
            return None
        total = 0
        for role, rs in specs.items():
            if str(role).lower() in ("ps", "evaluator"):
                continue
            n = _int(rs.get("replicas", 1)) if isinstance(rs, Mapping) else None
            if n is None:
                return None
            total += n
        return total or None
    return None


_NPROC_ARG = re.compile(r"--nproc[-_]per[-_]node(?:=|\s+)(\d{1,4})\b")


def local_world(pod: Mapping[str, Any], container: Mapping[str, Any] | None) -> int:
    """Ranks the pod's trainer container runs (torchrun's / ``ftagent run``'s
    ``--nproc-per-node``, ``PET_NPROC_PER_NODE`` or ``LOCAL_WORLD_SIZE`` as literals), 1
    when it says nothing, capped at MAX_LOCAL_WORLD."""
    if not isinstance(container, Mapping):
        return 1
    env = literal_env(container)
    for key in ("PET_NPROC_PER_NODE", "LOCAL_WORLD_SIZE", "FTAGENT_NPROC_PER_NODE"):
        v = env.get(key, "").strip()
        if v.isdigit() and len(v) <= 4 and int(v) > 0:
            return min(int(v), MAX_LOCAL_WORLD)
    words = [w for k in ("command", "args") for w in (container.get(k) or [])
             if isinstance(w, str)][:256]
    m = _NPROC_ARG.search(" ".join(w[:4096] for w in words))
    if m and int(m.group(1)) > 0:
        return min(int(m.group(1)), MAX_LOCAL_WORLD)
    return 1


class JobOwners:
    """Which root owns each (namespace, job name): the index ``member`` answers from."""

    def __init__(self) -> None:
        # (namespace, job) -> {root uid: (score, root)}
        self._roots: OrderedDict[tuple[str, str],
                                 dict[str, tuple[tuple[int, int, int, int], Root]]] = OrderedDict()
        self._seq = 0

    def see(self, namespace: str, job: str, root: Root) -> None:
        """A pod labelled ``job`` in ``namespace`` has ``root`` (from the pod watch)."""
        key = (namespace, job)
        roots = self._roots.setdefault(key, {})
        if root.uid not in roots:
            if len(roots) >= MAX_ROOTS_PER_JOB:
                return  # a flood of foreign roots: the first ones stand
            self._seq += 1
            named = int(job_label_value(root.name) == job or root.name == job)
            # a root read and checked outranks one taken on its reference's word
            roots[root.uid] = ((named, int(root.verified), root.rank, -self._seq), root)
        else:
            roots[root.uid] = (roots[root.uid][0], root)  # its world may be known now
        self._roots.move_to_end(key)
        while len(self._roots) > MAX_JOBS:
            self._roots.popitem(last=False)

    def owner(self, namespace: str, job: str) -> Root | None:
        roots = self._roots.get((namespace, job))
        if not roots:
            return None
        return max(roots.values(), key=lambda sr: sr[0])[1]

    def member(self, namespace: str, job: str, root: Root | None) -> tuple[bool, str]:
        """May a pod with ``root`` (None: no job controller) be a rank of ``job``?"""
        owner = self.owner(namespace, job)
        if owner is None:
            return True, ""
        if root is None:
            return False, (f"job {job!r} is owned by {owner.kind} {owner.name} (uid "
                           f"{owner.uid}); this pod has no job controller, so its "
                           "ftagent.io/job label alone does not make it a member")
        if root.uid != owner.uid:
            return False, (f"job {job!r} is owned by {owner.kind} {owner.name} (uid "
                           f"{owner.uid}); this pod's controller chain leads to "
                           f"{root.kind} {root.name} (uid {root.uid})")
        return True, ""
