"""In the cluster a job's end is known even when the arbiter missed it (issue 36, item 6):
the pods' terminal status (the kubelet's phase and each container's ``state.terminated``)
says how the ranks ended whose agents could not. The real ``kubernetes`` client against
the fake API server (real HTTP, real watch streams), a real Registry.

On the old code the restarted arbiter's status read "gone: no agent for Ns (was
running)" and the live job's stayed "running" with no agent: the pods' status was read
only for faults (evicted, preempted, deleted).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from ftagent.arbiter.history import History
from ftagent.arbiter.history_file import FileHistory
from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.timeline import Timeline
from ftagent.kube.actuator import Actuator
from ftagent.kube.cluster import JOB_LABEL, Cluster, KubeSettings, start_watches, tick_forever
from ftagent.v1 import ftagent_pb2 as pb
from tests.arbiter_helpers import wait_until
from tests.kube_fake import FakeKube

NS = "train"
WORLD = 2


def registry(state_dir: Path) -> Registry:
    return Registry(PolicyConfig(max_restarts=5), Timeline(), None, "arb",
                    history=History(FileHistory(str(state_dir))))


def agents(reg: Registry) -> list[Connection]:
    conns = []
    for r in range(WORLD):
        c = Connection(f"peer-{r}")
        reg.hello(c, pb.Hello(job="llm", namespace=NS, rank=r, world_size=WORLD,
                              agent_instance=f"i{r}", pod=f"llm-{r}", node="node-0"))
        conns.append(c)
    for c in conns:
        reg.handle(c, pb.AgentMessage(arrival=pb.BarrierArrival(generation=0)), 0.0)
    return conns


def pods(fake: FakeKube) -> None:
    fake.add_node("node-0")
    for r in range(WORLD):  # an Indexed Job's: ranks from its labels (kube/identity.py)
        fake.add_pod(NS, f"llm-{r}", labels={
            JOB_LABEL: "llm", "batch.kubernetes.io/job-name": "llm",
            "batch.kubernetes.io/job-completion-index": str(r)}, node="node-0")


async def watched(fake: FakeKube, reg: Registry, body: object) -> None:
    api = fake.client()
    cl = Cluster(reg, api, KubeSettings(), actuator=Actuator(api, backoff=0.01,
                                                             max_backoff=0.05))
    stop = threading.Event()
    threads = start_watches(cl, api, asyncio.get_running_loop(), stop)
    ticker = asyncio.create_task(tick_forever(cl, 0.05))
    try:
        await wait_until(lambda: len(cl.pod_cache) == WORLD, 20, "the pod watch's list")
        assert callable(body)
        await body(cl)
    finally:
        ticker.cancel()
        stop.set()
        fake.drop_watches()
        cl.close()
        for t in threads:
            t.join(10)
        fake.stop()


def state(reg: Registry) -> str:
    job = reg.find_any("llm", NS)
    return reg.info(job, ranks=False).state if job is not None else "unknown"


def test_a_restarted_arbiter_reads_succeeded_from_the_pods_not_gone(tmp_path: Path) -> None:
    agents(registry(tmp_path))  # then SIGKILLed: only its history file is left
    fake = FakeKube()
    pods(fake)
    for r in range(WORLD):  # every rank exited 0 while no arbiter ran
        fake.terminate_pod(NS, f"llm-{r}", 0)
    reg = registry(tmp_path)
    assert state(reg).startswith("gone")

    async def body(cl: Cluster) -> None:
        await wait_until(lambda: state(reg) == "succeeded", 20,
                         f"succeeded from the pods' status (is {state(reg)!r})")

    asyncio.run(watched(fake, reg, body))
    texts = [e.message for e in reg.timeline.entries("llm", NS)]
    assert any("read from its pods' terminal status" in t for t in texts), texts


def test_a_live_job_whose_agents_vanished_reads_failed_from_the_pods(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    conns = agents(reg)
    fake = FakeKube()
    pods(fake)

    async def body(cl: Cluster) -> None:
        for c in conns:  # the agents' streams end without an exit (the arbiter was away)
            reg.disconnect(c)
        fake.terminate_pod(NS, "llm-0", 0)
        fake.terminate_pod(NS, "llm-1", 137, signal=9)
        want = "stopped: failed: rank 1 exited with code 137 while no arbiter heard it"
        await wait_until(lambda: state(reg) == want, 20, f"failed (is {state(reg)!r})")

    asyncio.run(watched(fake, reg, body))


def test_a_pod_s_exit_does_not_speak_for_a_connected_agent(tmp_path: Path) -> None:
    reg = registry(tmp_path)
    agents(reg)
    fake = FakeKube()
    pods(fake)

    async def body(cl: Cluster) -> None:
        for r in range(WORLD):
            fake.terminate_pod(NS, f"llm-{r}", 3)
        await wait_until(lambda: len(cl._exits.get((NS, "llm"), {})) == WORLD, 20,
                         "the terminal pods seen")
        for _ in range(5):
            cl.tick()
        assert state(reg) == "running"  # their agents are connected: they say it

    asyncio.run(watched(fake, reg, body))
