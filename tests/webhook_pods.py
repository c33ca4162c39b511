"""The pods each example in deploy/examples/ makes, as its controller would create them
(labels, and the env the controllers add), with the identity ftagent should find.

This stands in for the operators (no cluster here); the labels and variables are the
ones the projects document (FIELD-NOTES.md, "Kubernetes facts").
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import ROOT

EXAMPLES = ROOT / "deploy" / "examples"
KF = "training.kubeflow.org/"


@dataclass
class ExamplePod:
    example: str
    pod: dict[str, Any]
    container: str  # the trainer container
    job: str
    rank: int | None
    world_size: int | None
    crash_only: bool = False
    arbitrated: bool = True


def _pod(name: str, template: dict[str, Any], labels: dict[str, str],
         env: dict[str, str] | None = None, container: str | None = None,
         annotations: dict[str, str] | None = None) -> dict[str, Any]:
    t = copy.deepcopy(template)
    meta = t.get("metadata") or {}
    meta = {"name": name, "namespace": "ml", "labels": {**meta.get("labels", {}), **labels},
            **({"annotations": {**meta.get("annotations", {}), **(annotations or {})}}
               if meta.get("annotations") or annotations else {})}
    spec = t["spec"]
    spec.setdefault("restartPolicy", "Never")
    for c in spec["containers"]:
        if env and (container is None or c["name"] == container):
            c.setdefault("env", [])
            c["env"] += [{"name": k, "value": v} for k, v in env.items()]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _kubeflow(doc: dict[str, Any], example: str) -> list[ExamplePod]:
    kind, job = doc["kind"], doc["metadata"]["name"]
    specs_key = {"PyTorchJob": "pytorchReplicaSpecs", "TFJob": "tfReplicaSpecs",
                 "PaddleJob": "paddleReplicaSpecs", "MXJob": "mxReplicaSpecs"}[kind]
    specs = doc["spec"][specs_key]
    operator = kind.lower() + "-controller"
    order = {"PyTorchJob": ["Master", "Worker"], "TFJob": ["Chief", "Master", "Worker", "PS"],
             "MXJob": ["Scheduler", "Server", "Worker"], "PaddleJob": ["Master", "Worker"]}[kind]
    counts = {rt: specs[rt]["replicas"] for rt in order if rt in specs}
    total = sum(counts.values())
    out = []
    rank = 0
    for rt in order:
        if rt not in specs:
            continue
        for i in range(counts[rt]):
            labels = {KF + "job-name": job, KF + "replica-type": rt.lower(),
                      KF + "replica-index": str(i), KF + "operator-name": operator}
            env: dict[str, str] = {}
            container = {"PyTorchJob": "pytorch", "TFJob": "tensorflow", "PaddleJob": "paddle",
                         "MXJob": "mxnet"}[kind]
            if kind == "PyTorchJob":
                env = {"MASTER_ADDR": f"{job}-master-0", "MASTER_PORT": "23456",
                       "WORLD_SIZE": str(total), "RANK": str(rank),
                       "PET_NNODES": str(total), "PET_NODE_RANK": str(rank)}
            elif kind == "TFJob":
                cluster = {r.lower(): [f"{job}-{r.lower()}-{k}:2222" for k in range(n)]
                           for r, n in counts.items()}
                env = {"TF_CONFIG": json.dumps({"cluster": cluster,
                                                "task": {"type": rt.lower(), "index": i}})}
            elif kind == "MXJob":
                env = {"DMLC_ROLE": rt.lower(), "DMLC_NUM_SERVER": str(counts.get("Server", 0)),
                       "DMLC_NUM_WORKER": str(counts.get("Worker", 0)),
                       "DMLC_PS_ROOT_URI": f"{job}-scheduler-0"}
            pod = _pod(f"{job}-{rt.lower()}-{i}", specs[rt]["template"], labels, env)
            world: int | None = total
            r: int | None = rank
            if kind == "PaddleJob":  # no env of counts: the webhook knows the index only
                world = None
            if kind == "TFJob":  # TF_CONFIG order: chief, master, worker, ps
                tf = [t for t in ("Chief", "Master", "Worker", "PS") if t in counts]
                r = sum(counts[t] for t in tf[:tf.index(rt)]) + i
            out.append(ExamplePod(example, pod, container, job, r, world,
                                  crash_only=rt.lower() in ("ps", "scheduler", "server")))
            rank += 1
    return out


def _mpi(doc: dict[str, Any], example: str) -> list[ExamplePod]:
    job, specs = doc["metadata"]["name"], doc["spec"]["mpiReplicaSpecs"]
    out = []
    base = {KF + "job-name": job, KF + "operator-name": "mpi-operator"}
    out.append(ExamplePod(example, _pod(f"{job}-launcher-x1", specs["Launcher"]["template"], {
        **base, KF + "job-role": "launcher", KF + "replica-type": "launcher"}), "mpi", job,
        0, 1, crash_only=True))
    for i in range(specs["Worker"]["replicas"]):
        out.append(ExamplePod(example, _pod(f"{job}-worker-{i}", specs["Worker"]["template"], {
            **base, KF + "job-role": "worker", KF + "replica-type": "worker",
            KF + "replica-index": str(i)}), "mpi", job, None, None, crash_only=True,
            arbitrated=False))
    return out


def _jobset_pods(name: str, replicated: list[dict[str, Any]], example: str,
                 env: dict[str, str] | None = None, world: int | None = None,
                 parallelism: int | None = None) -> list[ExamplePod]:
    out = []
    global_index = 0
    for rj in replicated:
        jt = rj["template"]["spec"]
        n = parallelism or jt.get("parallelism", 1)
        for j in range(rj.get("replicas", 1)):
            for k in range(n):
                labels = {"jobset.sigs.k8s.io/jobset-name": name,
                          "jobset.sigs.k8s.io/replicatedjob-name": rj["name"],
                          "jobset.sigs.k8s.io/job-index": str(j),
                          "jobset.sigs.k8s.io/job-global-index": str(global_index),
                          "batch.kubernetes.io/job-name": f"{name}-{rj['name']}-{j}",
                          "batch.kubernetes.io/job-completion-index": str(k)}
                pod = _pod(f"{name}-{rj['name']}-{j}-{k}-x", jt["template"], labels, env)
                c = pod["spec"]["containers"][0]["name"]
                out.append(ExamplePod(example, pod, c, name, global_index * n + k,
                                      world if world is not None else _world(pod)))
            global_index += 1
    return out


def _world(pod: dict[str, Any]) -> int | None:
    raw = (pod["metadata"].get("annotations") or {}).get("ftagent.io/world-size")
    return int(raw) if raw else None


def _trainjob(docs: list[dict[str, Any]], example: str) -> list[ExamplePod]:
    runtime = next(d for d in docs if d["kind"] == "TrainingRuntime")
    tj = next(d for d in docs if d["kind"] == "TrainJob")
    nodes = tj["spec"]["trainer"]["numNodes"]
    replicated = copy.deepcopy(runtime["spec"]["template"]["spec"]["replicatedJobs"])
    for rj in replicated:
        if rj["name"] == "node":
            c = rj["template"]["spec"]["template"]["spec"]["containers"][0]
            c["command"] = tj["spec"]["trainer"]["command"]
            c["args"] = tj["spec"]["trainer"]["args"]
    pods = _jobset_pods(tj["metadata"]["name"], replicated, example,
                        env={"PET_NNODES": str(nodes), "PET_MASTER_PORT": "29400",
                             "PET_MASTER_ADDR": f"{tj['metadata']['name']}-node-0-0.x"},
                        world=nodes, parallelism=nodes)
    for p in pods:  # PET_NODE_RANK is a fieldRef on the completion index: not literal
        p.pod["spec"]["containers"][0]["env"].append({"name": "PET_NODE_RANK", "valueFrom": {
            "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/"
                         "job-completion-index']"}}})
    return pods


def _volcano(doc: dict[str, Any], example: str) -> list[ExamplePod]:
    job = doc["metadata"]["name"]
    tasks = doc["spec"]["tasks"]
    total = sum(t["replicas"] for t in tasks)
    counts = {f"VC_{t['name'].upper()}_NUM": str(t["replicas"]) for t in tasks}
    out, rank = [], 0
    for t in tasks:
        for i in range(t["replicas"]):
            env = {"MASTER_ADDR": f"{job}-master-0.{job}", "MASTER_PORT": "23456",
                   "WORLD_SIZE": str(total), "RANK": str(rank), **counts}
            pod = _pod(f"{job}-{t['name']}-{i}", t["template"], {
                "volcano.sh/job-name": job, "volcano.sh/task-spec": t["name"],
                "volcano.sh/task-index": str(i)}, env)
            out.append(ExamplePod(example, pod, t["template"]["spec"]["containers"][0]["name"],
                                  job, rank, total))
            rank += 1
    return out


def _indexed(doc: dict[str, Any], example: str) -> list[ExamplePod]:
    job = doc["metadata"]["name"]
    out = []
    for k in range(doc["spec"]["completions"]):
        labels = {"batch.kubernetes.io/job-name": job, "job-name": job,
                  "batch.kubernetes.io/controller-uid": "u", "controller-uid": "u",
                  "batch.kubernetes.io/job-completion-index": str(k)}
        pod = _pod(f"{job}-{k}-x", doc["spec"]["template"], labels,
                   annotations={"batch.kubernetes.io/job-completion-index": str(k)})
        out.append(ExamplePod(example, pod, "trainer", job, k, _world(pod)))
    return out


def example_pods() -> list[ExamplePod]:
    out: list[ExamplePod] = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        kinds = {d["kind"] for d in docs}
        if "TrainJob" in kinds:
            out += _trainjob(docs, path.name)
            continue
        for d in docs:
            if d["kind"] in ("PyTorchJob", "TFJob", "PaddleJob", "MXJob"):
                out += _kubeflow(d, path.name)
            elif d["kind"] == "MPIJob":
                out += _mpi(d, path.name)
            elif d["kind"] == "JobSet":
                out += _jobset_pods(d["metadata"]["name"], d["spec"]["replicatedJobs"],
                                    path.name)
            elif d["kind"] == "Job" and d["apiVersion"] == "batch.volcano.sh/v1alpha1":
                out += _volcano(d, path.name)
            elif d["kind"] == "Job":
                out += _indexed(d, path.name)
    return out


def admission_review(pod: dict[str, Any], namespace: str = "ml", kind: str = "Pod",
                     operation: str = "CREATE") -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": str(uuid.uuid4()),
                        "kind": {"group": "", "version": "v1", "kind": kind},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "requestKind": {"group": "", "version": "v1", "kind": kind},
                        "namespace": namespace, "operation": operation,
                        "userInfo": {"username": "system:serviceaccount:kube-system:job"},
                        "object": pod, "oldObject": None, "dryRun": False,
                        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pods_named(example: str, name: str) -> list[ExamplePod]:
    """The pods of ``deploy/examples/<example>`` with its job renamed to ``name`` (a
    55-character PyTorchJob, a Job called ``2024-sweep``), made as the controller would."""
    docs = load_all(EXAMPLES / example)
    job = next(d for d in docs if d["kind"] not in ("TrainingRuntime", "ConfigMap"))
    job["metadata"]["name"] = name
    builders = {"PyTorchJob": _kubeflow, "TFJob": _kubeflow, "PaddleJob": _kubeflow,
                "MXJob": _kubeflow, "MPIJob": _mpi}
    if job["kind"] in builders:
        return builders[job["kind"]](job, example)
    if job["kind"] == "JobSet":
        return _jobset_pods(name, job["spec"]["replicatedJobs"], example)
    if job["apiVersion"] == "batch.volcano.sh/v1alpha1":
        return _volcano(job, example)
    return _indexed(job, example)
