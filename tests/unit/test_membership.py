"""Job membership from the controller chain (kube/membership.py): pure."""

from __future__ import annotations

from ftagent.kube.membership import (
    MAX_LOCAL_WORLD,
    JobOwners,
    Root,
    controller_ref,
    local_world,
    world_from_spec,
)


def _pod(*refs: dict[str, object]) -> dict[str, object]:
    return {"metadata": {"ownerReferences": list(refs)}}


def test_only_a_controller_reference_with_a_uid_counts() -> None:
    ref = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llm", "uid": "u1"}
    assert controller_ref(_pod(ref)) is None  # not controller: true
    got = controller_ref(_pod({**ref, "controller": True}))
    assert got is not None and (got.group, got.version, got.kind, got.uid) == \
        ("kubeflow.org", "v1", "PyTorchJob", "u1")
    assert controller_ref(_pod({**ref, "controller": True, "uid": ""})) is None
    assert controller_ref({"metadata": None}) is None


def test_world_sizes_from_the_controllers_spec() -> None:
    ptj = {"spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1},
                                            "Worker": {"replicas": 7}}}}
    assert world_from_spec("kubeflow.org", "PyTorchJob", ptj) == 8
    js = {"spec": {"replicatedJobs": [
        {"name": "dataset-initializer", "replicas": 1},
        {"name": "node", "replicas": 2, "template": {"spec": {"parallelism": 4}}}]}}
    assert world_from_spec("jobset.x-k8s.io", "JobSet", js) == 8
    assert world_from_spec("trainer.kubeflow.org", "TrainJob",
                           {"spec": {"trainer": {"numNodes": 16}}}) == 16
    assert world_from_spec("batch", "Job", {"spec": {"completions": 3}}) == 3
    assert world_from_spec("kubeflow.org", "MPIJob", {"spec": {"mpiReplicaSpecs": {}}}) is None
    assert world_from_spec("batch", "Job", {"spec": {"completions": "many"}}) is None
    assert world_from_spec("batch", "Job", {"spec": {"completions": 10**9}}) is None


def test_ranks_per_pod_come_from_what_the_pod_runs_capped() -> None:
    assert local_world({}, None) == 1
    assert local_world({}, {"env": [{"name": "PET_NPROC_PER_NODE", "value": "8"}]}) == 8
    assert local_world({}, {"command": ["ftagent", "run", "--nproc-per-node", "4", "--",
                                        "python", "t.py"]}) == 4
    assert local_world({}, {"args": ["--nproc_per_node=9999"]}) == MAX_LOCAL_WORLD
    assert local_world({}, {"env": [{"name": "PET_NPROC_PER_NODE",
                                     "valueFrom": {"fieldRef": {}}}]}) == 1


def test_the_root_named_like_the_job_owns_it_whoever_came_first() -> None:
    owners = JobOwners()
    intruder = Root("batch", "Job", "not-llm", "bad")
    real = Root("kubeflow.org", "PyTorchJob", "llm", "good", world=8)
    owners.see("ns", "llm", intruder)  # seen first
    owners.see("ns", "llm", real)
    assert owners.owner("ns", "llm") == real
    assert owners.member("ns", "llm", real) == (True, "")
    ok, why = owners.member("ns", "llm", intruder)
    assert not ok and "PyTorchJob llm" in why
    assert not owners.member("ns", "llm", None)[0]  # a bare pod
    # a batch Job named like the job is outranked by the PyTorchJob of that name
    owners.see("ns", "llm", Root("batch", "Job", "llm", "batch-llm"))
    assert owners.owner("ns", "llm") == real
    # a job of bare pods only: as strong as its labels
    assert owners.member("ns", "bare", None) == (True, "")
    assert owners.owner("other", "llm") is None


def test_a_root_taken_on_its_references_word_never_outranks_a_checked_one() -> None:
    owners = JobOwners()
    forged = Root("kubeflow.org", "PyTorchJob", "llm", "made-up", verified=False)
    real = Root("kubeflow.org", "PyTorchJob", "llm", "real")
    owners.see("ns", "llm", forged)  # the forger's pod seen first, its read refused (403)
    owners.see("ns", "llm", real)
    assert owners.owner("ns", "llm") == real
    assert not owners.member("ns", "llm", forged)[0]

