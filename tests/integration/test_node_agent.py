"""A real `ftagent node` process -> a real arbiter on loopback -> every rank of the job on it.

The GPU source runs the simulated NVML backend (a scripted fatal Xid), the NIC source
real netlink in a network namespace (``--nic-netns``), the conditions go to the fake API
server through the real ``kubernetes`` client; the ranks are real ArbiterLinks whose
Hello says which node they run on.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from ftagent.agent.reporter import ArbiterLink
from ftagent.arbiter.auth import node_token
from ftagent.model import Action, ActionKind
from ftagent.v1 import ftagent_pb2 as pb
from ftagent.v1 import ftagent_pb2_grpc as pb_grpc
from ftagent.wire import limits
from tests.arbiter_helpers import ArbiterProcess, running_links, wait_until
from tests.conftest import PY, Collector, wait_for
from tests.kube_fake import FakeKube
from tests.netns import ip, link_up, namespaces, require_netns, veth

SECRET = "node-agent-test-secret-0123456789"


@contextmanager
def node_agent(*flags: str, env: dict[str, str] | None = None
               ) -> Iterator[tuple[subprocess.Popen[bytes], Collector]]:
    """`ftagent node FLAGS` with its stderr collected; SIGTERM at the end (exit 0)."""
    import os

    proc = subprocess.Popen([PY, "-m", "ftagent", "node", "--metrics-port", "-1", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})
    assert proc.stderr is not None
    err = Collector(proc.stderr)
    try:
        yield proc, err
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=30) == 0, bytes(err.data).decode(errors='replace')
        finally:
            if proc.poll() is None:
                proc.kill()


async def next_action(link: ArbiterLink, timeout: float = 30.0) -> Action:
    return await asyncio.wait_for(link.commands.get(), timeout)


def test_fatal_xid_on_a_node_replaces_its_rank_and_restarts_the_others(tmp_path: Path) -> None:
    script = tmp_path / "gpu.txt"
    script.write_text("gpus 2\nt=1s gpu=1 xid=79\n")
    with ArbiterProcess() as arb:
        async def body() -> None:
            async with running_links(arb.address, "llama", 2) as links:  # node-0, node-1
                with node_agent("--node", "node-1", "--arbiter", arb.address,
                                "--gpu-backend", f"simulated:{script}", "--nic", "none",
                                "--report-interval", "0.5") as (_, err):
                    replaced = await next_action(links[1])
                    restarted = await next_action(links[0])
                    assert replaced.kind is ActionKind.REPLACE, replaced
                    assert restarted.kind is ActionKind.RESTART, restarted
                    assert "node node-1" in replaced.reason and "Xid 79" in replaced.reason
                    await wait_until(lambda: b"llama rank 1: replace" in err, 20,
                                     "the node agent logging the arbiter's outcome")
        asyncio.run(body())


def test_a_fatal_xid_replaces_only_the_pod_on_that_gpu(tmp_path: Path) -> None:
    """Two one-GPU pods of two jobs on one node, each naming its GPU in its Hello (as
    $NVIDIA_VISIBLE_DEVICES gives it): an Xid 79 on GPU 1 replaces the pod on GPU 1; the
    job on GPU 0 is not told anything."""
    script = tmp_path / "gpu.txt"
    script.write_text("gpus 2\nt=1s gpu=1 xid=79\n")
    uuid = "GPU-00000000-0000-4000-8000-{:012x}".format  # the simulated backend's UUIDs
    with ArbiterProcess() as arb:
        async def body() -> None:
            async with running_links(arb.address, "on-gpu0", 1, node="node-1",
                                     gpus=[uuid(0)]) as spared, \
                    running_links(arb.address, "on-gpu1", 1, node="node-1",
                                  gpus=[uuid(1)]) as hit:
                with node_agent("--node", "node-1", "--arbiter", arb.address,
                                "--gpu-backend", f"simulated:{script}", "--nic", "none",
                                "--report-interval", "0.5") as (_, err):
                    replaced = await next_action(hit[0])
                    assert replaced.kind is ActionKind.REPLACE, replaced
                    assert "Xid 79" in replaced.reason, replaced
                    await wait_until(lambda: b"on-gpu1 rank 0: replace; on-gpu0: not on that "
                                     b"GPU" in err, 20, "the node agent logging the outcome")
                    assert spared[0].commands.empty(), spared[0].commands.get_nowait()
        asyncio.run(body())


def test_node_fault_with_no_job_on_the_node_is_recorded(tmp_path: Path) -> None:
    script = tmp_path / "gpu.txt"
    script.write_text("gpus 1\nt=0.5s gpu=0 xid=95\n")
    with ArbiterProcess() as arb, node_agent(
            "--node", "idle-node", "--arbiter", arb.address, "--gpu-backend",
            f"simulated:{script}", "--nic", "none") as (proc, err):
        async def wait() -> None:
            await wait_until(lambda: b"no job has ranks on node idle-node: recorded" in err,
                             30, "the arbiter acknowledging a node fault with no job")
        asyncio.run(wait())
        assert proc.poll() is None
        assert "no job has ranks on it: recorded" in arb.log_text()


def test_a_gpu_fault_that_still_holds_reaches_a_pod_that_comes_later(tmp_path: Path) -> None:
    """The Xid comes while no job runs on the node (recorded); then a job's pod lands
    there: the node agent's heartbeat sees the arbiter know more ranks on the node and
    sends the fault again, so the new pod is moved off the broken GPU."""
    script = tmp_path / "gpu.txt"
    script.write_text("gpus 1\nt=0.2s gpu=0 xid=79\n")
    with ArbiterProcess() as arb, node_agent(
            "--node", "node-7", "--arbiter", arb.address, "--gpu-backend",
            f"simulated:{script}", "--nic", "none", "--report-interval", "0.3") as (_, err):
        async def body() -> None:
            await wait_until(lambda: b"no job has ranks on node node-7: recorded" in err, 30,
                             "the fault recorded with no job on the node")
            async with running_links(arb.address, "late", 1, node="node-7") as links:
                replaced = await next_action(links[0])
                assert replaced.kind is ActionKind.REPLACE, replaced
                assert "node node-7" in replaced.reason and "Xid 79" in replaced.reason
                await wait_until(lambda: b"sending again the 1 node fault(s) that still hold"
                                 in err and b"late rank 0: replace" in err, 20,
                                 "the node agent logging the re-sent fault's outcome")
        asyncio.run(body())


def test_carrier_loss_in_a_netns_is_a_node_fault_and_sets_the_condition() -> None:
    require_netns()
    # --nic-resume-timeout 0: these agents never step, so the arbiter restarts the job as
    # soon as the link is back instead of waiting for steps (tests/unit/test_policy.py)
    with namespaces(2) as (ns_a, ns_b), FakeKube() as kube, \
            ArbiterProcess("--nic-resume-timeout", "0") as arb:
        veth(ns_a, "ftn0", ns_b, "ftn1")
        kube.add_node("node-0")
        # The link settled (carrier up) before the agent's first dump: events racing a
        # pyroute2 dump in another namespace could leave the dump unanswered.
        wait_for(lambda: link_up(ns_a, "ftn0"), 10, "ftn0 up with carrier")

        def condition(node: dict[str, Any] | None) -> dict[str, Any] | None:
            conds = ((node or {}).get("status") or {}).get("conditions") or []
            return next((c for c in conds if c["type"] == "FtagentNICHealthy"), None)

        async def body() -> None:
            async with running_links(arb.address, "gpt", 2) as links:
                with node_agent("--node", "node-0", "--arbiter", arb.address,
                                "--gpu-backend", "none", "--nic-netns", ns_a, "--nic", "ftn0",
                                "--nic-grace", "0.3", "--kube-api", kube.url) as (_, err):
                    await wait_until(lambda: (c := condition(kube.get("nodes", "node-0")))
                                     is not None and c["status"] == "True", 30,
                                     "FtagentNICHealthy=True on the Node")
                    ready = condition(kube.get("nodes", "node-0"))
                    assert ready is not None and ready["reason"] == "LinksUp"
                    ip("-n", ns_b, "link", "set", "ftn1", "down")  # carrier loss on ftn0
                    await wait_until(lambda: (c := condition(kube.get("nodes", "node-0")))
                                     is not None and c["status"] == "False", 30,
                                     "FtagentNICHealthy=False")
                    down = condition(kube.get("nodes", "node-0"))
                    assert down is not None and down["reason"] == "CarrierLost"
                    assert "ftn0" in down["message"]
                    # the kubelet's own conditions are left alone (strategic merge by type)
                    node = kube.get("nodes", "node-0") or {}
                    ready_cond = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
                    assert ready_cond and ready_cond[0]["status"] == "True"
                    await wait_until(lambda: b"gpt rank 0: wait" in err, 30,
                                     "the arbiter waiting for the node's link")
                    assert links[0].commands.empty() and links[1].commands.empty()
                    ip("-n", ns_b, "link", "set", "ftn1", "up")
                    got = [await next_action(link) for link in links]
                    assert [a.kind for a in got] == [ActionKind.RESTART] * 2, got
                    assert "link back" in got[0].reason
                    await wait_until(lambda: (c := condition(kube.get("nodes", "node-0")))
                                     is not None and c["status"] == "True", 30,
                                     "FtagentNICHealthy=True again")
                    back = condition(kube.get("nodes", "node-0"))
                    assert back is not None and back["lastTransitionTime"] >= \
                        down["lastTransitionTime"]
                    patches = kube.count("patch", "nodes/status")
                    assert patches <= 6, f"{patches} patches: only transitions + heartbeats"
        asyncio.run(body())


def test_node_agent_keeps_running_when_the_condition_write_is_forbidden() -> None:
    with FakeKube() as kube:
        kube.add_node("node-9")
        kube.forbid("patch", "nodes/status")
        with node_agent("--node", "node-9", "--gpu-backend", "none",
                        "--nic", "lo", "--kube-api", kube.url) as (proc, err):
            async def wait() -> None:
                await wait_until(lambda: b"may not patch nodes/status" in err, 30,
                                 "one line naming the missing permission")
            asyncio.run(wait())
            assert proc.poll() is None
            kube.clear_faults()

            async def written() -> None:
                await wait_until(lambda: any(
                    c["type"] == "FtagentNICHealthy" for c in
                    (kube.get("nodes", "node-9") or {}).get("status", {}).get("conditions", [])),
                    60, "the condition written once allowed")
            asyncio.run(written())
            assert bytes(err.data).decode(errors='replace').count("may not patch nodes/status") == 1


# --------------------------------------------------------------------------- the RPC itself


def _fault(i: int = 0, **kw: Any) -> pb.Fault:
    base = dict(id=f"f{i}", kind=pb.FAULT_KIND_GPU, severity=pb.SEVERITY_FATAL,
                scope=pb.SCOPE_NODE, message="Xid 79", detected_at=1.0)
    return pb.Fault(**{**base, **kw})


def test_report_for_a_node_the_token_does_not_cover_is_refused() -> None:
    with ArbiterProcess("--token", SECRET) as arb:
        async def body() -> None:
            async with grpc.aio.insecure_channel(arb.address) as ch:
                stub = pb_grpc.ArbiterStub(ch)

                async def report(token: str, node: str) -> Any:
                    return await stub.ReportNode(
                        pb.NodeReport(node=node, faults=[_fault()]), timeout=10,
                        metadata=(("authorization", f"Bearer {token}"),))

                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await report(node_token(SECRET, "node-2"), "node-1")
                assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED
                assert "node 'node-1'" in (e.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as e:  # a job token: never
                    from ftagent.arbiter.auth import job_token
                    await report(job_token(SECRET, "", "llama"), "node-1")
                assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await report(node_token("another-secret-0123456789", "node-1"), "node-1")
                assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
                ack = await report(node_token(SECRET, "node-1"), "node-1")
                assert [a.fault_id for a in ack.acks] == ["f0"] and ack.acks[0].final
                ack = await report(node_token(SECRET, "*"), "node-7")
                assert ack.arbiter_id
        asyncio.run(body())


def test_bad_and_oversized_reports_get_a_clear_error_and_the_arbiter_keeps_serving() -> None:
    with ArbiterProcess() as arb:
        async def body() -> None:
            async with running_links(arb.address, "bert", 1, ranks=[0]) as links, \
                    grpc.aio.insecure_channel(arb.address) as ch:
                stub = pb_grpc.ArbiterStub(ch)
                raw = ch.unary_unary("/ftagent.v1.Arbiter/ReportNode")
                cases: list[tuple[Any, str]] = [
                    (pb.NodeReport(node=""), "NodeReport.node is empty"),
                    (pb.NodeReport(node="a\nb"), "control characters"),
                    (pb.NodeReport(node="n" * 300), "at most 253"),
                    (pb.NodeReport(node="node-0", faults=[
                        _fault(i) for i in range(limits.MAX_NODE_FAULTS + 1)]), "at most 64"),
                    (pb.NodeReport(node="node-0", faults=[_fault(message="x" * 5000)]),
                     "fault message is 5000 characters"),
                    (pb.NodeReport(node="node-0", faults=[_fault(id="")]), "fault id is empty"),
                    (pb.NodeReport(node="node-0", faults=[_fault(
                        kind=pb.FAULT_KIND_UNSPECIFIED)]), "has no kind"),
                ]
                for req, words in cases:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.ReportNode(req, timeout=10)
                    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, req
                    assert words in (e.value.details() or ""), (words, e.value.details())
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await raw(b"\xff\xff garbage", timeout=10)
                assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert links[0].commands.empty(), "a refused report decides nothing"
                ack = await stub.ReportNode(pb.NodeReport(node="node-0", faults=[_fault()]),
                                            timeout=10)
                assert ack.ranks == 1 and "bert rank 0: replace" in ack.acks[0].outcome
                assert (await next_action(links[0])).kind is ActionKind.REPLACE
                again = await stub.ReportNode(pb.NodeReport(node="node-0", faults=[_fault()]),
                                              timeout=10)
                assert "already received" in again.acks[0].outcome  # idempotent
        asyncio.run(body())


def test_every_shard_gets_the_report_and_the_gpu_condition_and_metrics_say_it(
        tmp_path: Path) -> None:
    """Jobs are sharded over arbiters: the node agent reports to each; its /metrics has the
    GPU series with the node label; FtagentGPUHealthy goes False on the fatal Xid."""
    import re
    import urllib.request

    script = tmp_path / "gpu.txt"
    script.write_text("gpus 2\nt=1.5s gpu=0 xid=48\n")
    with ArbiterProcess() as one, ArbiterProcess() as two, FakeKube() as kube:
        kube.add_node("node-0")

        async def body() -> None:
            async with running_links(one.address, "j1", 1, ranks=[0]) as a, \
                    running_links(two.address, "j2", 1, ranks=[0]) as b:
                with node_agent("--node", "node-0", "--arbiter", f"{one.address},{two.address}",
                                "--gpu-backend", f"simulated:{script}", "--nic", "none",
                                "--kube-api", kube.url, "--metrics-port", "0") as (_, err):
                    assert (await next_action(a[0])).kind is ActionKind.REPLACE
                    assert (await next_action(b[0])).kind is ActionKind.REPLACE
                    await wait_until(lambda: b"metrics on http" in err, 20, "metrics port")
                    m = re.search(rb"metrics on http://[^:]+:(\d+)/metrics", bytes(err.data))
                    assert m is not None
                    text = urllib.request.urlopen(
                        f"http://127.0.0.1:{int(m.group(1))}/metrics", timeout=10).read().decode()
                    xids = [ln for ln in text.splitlines()
                            if ln.startswith("ftagent_gpu_xid_errors_total{")]
                    assert any('node="node-0"' in ln and 'gpu="0"' in ln and 'xid="48"' in ln
                               and ln.endswith(" 1.0") for ln in xids), xids

                    def gpu_cond() -> dict[str, Any] | None:
                        conds = (kube.get("nodes", "node-0") or {}).get("status", {}).get(
                            "conditions", [])
                        return next((c for c in conds if c["type"] == "FtagentGPUHealthy"),
                                    None)

                    await wait_until(lambda: (c := gpu_cond()) is not None and
                                     c["status"] == "False", 30, "FtagentGPUHealthy=False")
                    cond = gpu_cond()
                    assert cond is not None and cond["reason"] == "Xid48"
                    assert "GPU 0" in cond["message"]
        asyncio.run(body())


@pytest.mark.parametrize(("accelerator", "event", "words"), [
    ("ascend", "fault=80CB8002 health=Critical", "code:80CB8002"),
    ("kunlunxin", "lost", "kunlunxin device is lost"),
])
def test_a_fatal_npu_or_xpu_error_on_a_node_replaces_its_rank(
        tmp_path: Path, accelerator: str, event: str, words: str) -> None:
    """`ftagent node --accelerator ascend|kunlunxin` runs the simulated npu-smi / xpu-smi
    (every device the tool shows: the node agent has no visible-devices variable)."""
    script = tmp_path / "devices.txt"
    script.write_text(f"devices 2\nt=0.5s dev=1 {event}\n")
    with ArbiterProcess() as arb:
        async def body() -> None:
            async with running_links(arb.address, "llama", 2) as links:  # node-0, node-1
                with node_agent("--node", "node-1", "--arbiter", arb.address,
                                "--accelerator", accelerator, "--gpu-backend",
                                f"simulated:{script}", "--gpu-poll-interval", "0.2",
                                "--nic", "none", "--report-interval", "0.5") as (_, err):
                    replaced = await next_action(links[1])
                    restarted = await next_action(links[0])
                    assert replaced.kind is ActionKind.REPLACE, replaced
                    assert restarted.kind is ActionKind.RESTART, restarted
                    assert "node node-1" in replaced.reason and words in replaced.reason
                    await wait_until(lambda: b"llama rank 1: replace" in err, 20,
                                     "the node agent logging the arbiter's outcome")
        asyncio.run(body())
