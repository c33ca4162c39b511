"""Watch load of the arbiter's informers: requests per kind, time to sync, cache memory.

    .venv/bin/python bench/kube_watch.py [--jobs 1000] [--pods-per-job 10] [--churn 1000]

The fake API server (tests/kube_fake) runs in its own process with JOBS x PODS_PER_JOB
training pods (Kubeflow's job-name label, 8 pods a node) and their nodes; this process
runs one pod informer (label selector on the job-name label, a small projection) and one
node informer, as the arbiter does. Printed, all from this one run:

* list and watch requests per kind at 10 jobs and at JOBS jobs (the same: one of each);
* time to sync against the kubernetes client's own typed list of the same pods (models);
* memory the synced caches hold (tracemalloc) with the projection vs raw API objects;
* after sync, CHURN pod status writes: latency from the server's write to the handler.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

JOB = "training.kubeflow.org/job-name"
SENT = "bench.ftagent.io/sent"


def serve(jobs: int, per_job: int) -> None:
    """The server process: populate, print the URL, then obey commands on stdin."""
    from tests.kube_fake import STRATEGIC, FakeKube

    fake = FakeKube(history=100_000, bookmark_interval=60.0)
    n_pods = jobs * per_job
    for n in range((n_pods + 7) // 8):
        fake.add_node(f"node-{n:05d}", labels={"nvidia.com/gpu.present": "true"})
    for j in range(jobs):
        for r in range(per_job):
            i = j * per_job + r
            fake.add_pod(f"team-{j % 20}", f"job-{j:04d}-worker-{r}",
                         {JOB: f"job-{j:04d}", "training.kubeflow.org/replica-index": str(r)},
                         node=f"node-{i // 8:05d}")
    for k in range(3):  # pods that are not training pods: the selector must skip them
        fake.add_pod("web", f"web-{k}", {"app": "web"}, node="node-00000")
    print(json.dumps({"url": fake.url}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "churn":
            for i in range(cmd["n"]):
                j, r = divmod(i % n_pods, per_job)
                fake.patch("pods", f"job-{j:04d}-worker-{r}", {"metadata": {"annotations": {
                    SENT: repr(time.monotonic())}}}, f"team-{j % 20}", STRATEGIC)
                time.sleep(cmd["gap"])  # paced load, so latency is not queueing behind it
            print(json.dumps({"done": True}), flush=True)
        elif cmd["op"] == "watching":
            fake.wait_for_watches(cmd["n"], timeout=60)
            print(json.dumps({"open": fake.open_watches()}), flush=True)
        elif cmd["op"] == "counts":
            out = {}
            for res in ("pods", "nodes"):
                reqs = [r for r in fake.requests if r.resource == res]
                out[res] = (f"{sum(r.verb == 'list' and not r.query.get('continue') for r in reqs)}"
                            f" list ({sum(r.verb == 'list' for r in reqs)} pages), "
                            f"{sum(r.verb == 'watch' for r in reqs)} watch")
            print(json.dumps(out), flush=True)
        elif cmd["op"] == "quit":
            break
    fake.stop()


@dataclass(frozen=True)
class PodView:
    """What the arbiter keeps of a pod: enough to map node faults and preemptions to jobs."""

    namespace: str
    name: str
    job: str
    node: str
    phase: str
    disrupted: bool
    terminating: bool
    sent: float | None  # bench only: the churn write's time, for write -> handler latency


def project_pod(o: dict[str, Any]) -> PodView:
    meta, spec, status = o["metadata"], o.get("spec") or {}, o.get("status") or {}
    return PodView(meta.get("namespace", ""), meta["name"], (meta.get("labels") or {}).get(JOB, ""),
                   spec.get("nodeName", ""), status.get("phase", ""),
                   any(c.get("type") == "DisruptionTarget" and c.get("status") == "True"
                       for c in status.get("conditions") or []),
                   bool(meta.get("deletionTimestamp")),
                   float(sent) if (sent := (meta.get("annotations") or {}).get(SENT)) else None)


def project_node(o: dict[str, Any]) -> tuple[str, str]:
    ready = next((c.get("status", "") for c in (o.get("status") or {}).get("conditions") or []
                  if c.get("type") == "Ready"), "")
    return o["metadata"]["name"], ready


class Server:
    def __init__(self, jobs: int, per_job: int) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(jobs),
                                      str(per_job)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.url = self.ask(None)["url"]

    def ask(self, cmd: dict[str, Any] | None) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        if cmd is not None:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fake API server process ended")
        return dict(json.loads(line))

    def close(self) -> None:
        self.ask_quit()
        self.proc.wait(30)

    def ask_quit(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()


def sync(url: str, project_pods: Any, project_nodes: Any,
         handler: Any = None) -> tuple[float, Any, Any]:
    from ftagent.kube.client import api_client
    from ftagent.kube.informer import node_informer, pod_informer

    api = api_client(url)
    t0 = time.perf_counter()
    pods = pod_informer(api, label_selector=JOB, project=project_pods, handler=handler)
    nodes = node_informer(api, project=project_nodes)
    pods.start()
    nodes.start()
    if not (pods.wait_synced(600) and nodes.wait_synced(600)):
        raise RuntimeError("informers did not sync")
    return time.perf_counter() - t0, pods, nodes


def cache_bytes(url: str, project_pods: Any, project_nodes: Any) -> tuple[int, int]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    _, pods, nodes = sync(url, project_pods, project_nodes)
    pods.stop()
    nodes.stop()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    n = len(pods)
    del pods, nodes
    return held, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--pods-per-job", type=int, default=10)
    ap.add_argument("--churn", type=int, default=1000)
    args = ap.parse_args()
    from kubernetes import client

    from ftagent.kube.client import api_client

    print(f"# bench/kube_watch.py --jobs {args.jobs} --pods-per-job {args.pods_per_job} "
          f"--churn {args.churn}")
    small = Server(10, args.pods_per_job)
    _, p, n = sync(small.url, project_pod, project_node)
    small.ask({"op": "watching", "n": 2})
    small_counts = small.ask({"op": "counts"})
    p.stop()
    n.stop()
    small.close()

    srv = Server(args.jobs, args.pods_per_job)
    n_pods = args.jobs * args.pods_per_job
    latencies: list[float] = []
    lock = threading.Lock()
    want = threading.Event()

    def on_change(c: Any) -> None:
        if c.type == "MODIFIED" and c.obj.sent is not None:
            with lock:
                latencies.append(time.monotonic() - c.obj.sent)
                if len(latencies) >= args.churn:
                    want.set()

    t_sync, pods, nodes = sync(srv.url, project_pod, project_node, on_change)
    assert len(pods) == n_pods, (len(pods), n_pods)
    srv.ask({"op": "watching", "n": 2})
    t_churn = time.perf_counter()
    srv.ask({"op": "churn", "n": args.churn, "gap": 0.002})
    if not want.wait(300):
        raise RuntimeError(f"only {len(latencies)} of {args.churn} churn events arrived")
    t_churn = time.perf_counter() - t_churn
    counts = srv.ask({"op": "counts"})
    pods.stop()
    nodes.stop()

    t0 = time.perf_counter()
    typed = client.CoreV1Api(api_client(srv.url)).list_pod_for_all_namespaces(
        label_selector=JOB)
    t_models = time.perf_counter() - t0
    assert len(typed.items) == n_pods
    del typed

    held_proj, _ = cache_bytes(srv.url, project_pod, project_node)
    held_raw, _ = cache_bytes(srv.url, None, None)
    srv.close()

    print("requests at 10 jobs:   " + "; ".join(f"{k}: {v}" for k, v in small_counts.items()))
    print(f"requests at {args.jobs} jobs: " + "; ".join(f"{k}: {v}" for k, v in counts.items()))
    print(f"sync {n_pods} pods + {(n_pods + 7) // 8} nodes: {t_sync:.2f} s "
          f"(the client's typed pod list alone: {t_models:.2f} s; ratio "
          f"{t_sync / t_models:.2f})")
    print(f"cache memory: projected {held_proj / 2**20:.1f} MiB vs raw objects "
          f"{held_raw / 2**20:.1f} MiB (ratio {held_proj / held_raw:.2f}; "
          f"{held_proj / n_pods:.0f} B a pod incl. nodes)")
    lat = sorted(latencies)
    print(f"churn {args.churn} pod writes (one each 2 ms) in {t_churn:.2f} s, no new list or "
          f"watch: write->handler p50 {statistics.median(lat) * 1e3:.1f} ms p99 "
          f"{lat[int(0.99 * (len(lat) - 1))] * 1e3:.1f} ms")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
