"""Peak memory of the arbiter's informers in a cluster full of other tenants' pods.

    .venv/bin/python bench/kube_memory.py [--pods 100000] [--training 1000] [--pod-bytes 1000]

The fake API server (tests/kube_fake) runs in its own process with PODS pods: TRAINING
training pods of ftagent jobs (label ftagent.io/job, Kubeflow labels) in the opted-in
namespace ``ml`` (ftagent.io/inject=true), the rest spread over 99 namespaces that did not
opt in (a fifth of them training pods too: other tenants' jobs). Each pod is about
POD_BYTES of JSON (env, labels, annotations, conditions), as real pods are (their
managedFields make them larger still).

Each variant runs in a fresh process that starts the arbiter's informers as ``ftagent
arbiter --kube`` does -- the ftagent pods (label selector), the nodes, and the gauge of
training pods without the agent -- waits until every informer has synced, and prints its
peak RSS (``ru_maxrss``) and the RSS before the informers started:

* ``before``: the uninjected-pods informer of the code before: every pod of the cluster
  listed, each list held whole as Python objects, then projected;
* ``after``: what ships now: Running pods of opted-in namespaces only, one informer per
  namespace, each page projected as it arrives.

Both variants run against the same server in the same run; figures on a shared machine
are noisy, the ratio is what this prints for.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

KF = {"training.kubeflow.org/job-name": "llm", "training.kubeflow.org/replica-type": "worker"}


def _pod(ns: str, name: str, labels: dict[str, str], pad: int) -> dict[str, Any]:
    env = [{"name": f"VAR_{i}", "value": "x" * 20} for i in range(max(0, pad // 40))]
    return {"metadata": {"name": name, "namespace": ns, "labels": labels,
                         "annotations": {"example.com/owner": "team-a"}},
            "spec": {"nodeName": f"node-{hash(name) % 500}",
                     "containers": [{"name": "pytorch", "image": "trainer:1", "env": env}]},
            "status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}]}}


def serve(pods: int, training: int, pad: int) -> None:
    """The server process: populate, print the URL and the JSON size, wait for stdin EOF."""
    from tests.kube_fake import FakeKube

    fake = FakeKube(bookmark_interval=60.0)
    fake.create("namespaces", {"metadata": {"name": "ml",
                                            "labels": {"ftagent.io/inject": "true"}}})
    for n in range(99):
        fake.create("namespaces", {"metadata": {"name": f"tenant-{n:02d}"}})
    for n in range(500):
        fake.create("nodes", {"metadata": {"name": f"node-{n}"}, "spec": {}})
    size = 0
    for i in range(pods):
        if i < training:
            p = _pod("ml", f"llm-worker-{i}", {**KF, "ftagent.io/job": "llm"}, pad)
        else:
            labels = dict(KF) if i % 5 == 0 else {"app": "web"}
            p = _pod(f"tenant-{i % 99:02d}", f"pod-{i}", labels, pad)
        size += len(json.dumps(p))
        fake.create("pods", p)
    print(json.dumps({"url": fake.url, "json_bytes": size}), flush=True)
    sys.stdin.read()
    fake.stop()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure(variant: str, url: str) -> None:
    """A child process: the arbiter's informers against ``url``; prints its memory."""
    import asyncio

    from kubernetes import client

    from ftagent.kube.client import api_client
    from ftagent.kube.cluster import JOB_LABEL
    from ftagent.kube.informer import Informer, key_of, node_informer, pod_informer
    from ftagent.kube.uninjected import OPT_IN, view, watch_uninjected

    class Before(Informer[Any]):
        """The list of the code before: the whole list held as API objects, then projected."""

        def _list(self) -> None:
            fresh: dict[str, dict[str, Any]] = {}
            cont: str | None = None
            rv = ""
            while True:
                kw: dict[str, Any] = {"_request_timeout": self._request_timeout}
                if self._page_size:
                    kw["limit"] = self._page_size
                if cont:
                    kw["_continue"] = cont
                resp = self._call(**kw)
                try:
                    body = json.loads(resp.data)
                finally:
                    resp.release_conn()
                meta = body.get("metadata") or {}
                for item in body.get("items") or []:
                    fresh[key_of(item)] = item
                rv = str(meta.get("resourceVersion") or rv)
                cont = meta.get("continue") or None
                if not cont:
                    break
            self.stats.lists += 1
            self._replace({k: (str(o["metadata"].get("resourceVersion", "")),
                               self._project(o)) for k, o in fresh.items()}, rv)

    api = api_client(url)
    core = client.CoreV1Api(api)
    base = _rss_mb()
    start = time.monotonic()
    loop = asyncio.new_event_loop()
    informers: list[Any] = [pod_informer(api, label_selector=JOB_LABEL),
                            node_informer(api)]
    if variant == "before":
        informers += [Before(core.list_pod_for_all_namespaces, name="pods", project=view),
                      Informer(core.list_namespace, name="namespaces",
                               label_selector=f"{OPT_IN}=true",
                               project=lambda o: str(o["metadata"]["name"]))]
        for inf in informers:
            inf.start()
        waits = informers
    else:
        for inf in informers:
            inf.start()
        from prometheus_client import CollectorRegistry

        namespaces, opted = watch_uninjected(api, None, CollectorRegistry())
        informers += [namespaces, opted]
        waits = informers[:3]
    for inf in waits:
        assert inf.wait_synced(600), inf.name
    if variant == "after":
        deadline = time.monotonic() + 600
        while len(opted) < 1 and time.monotonic() < deadline:  # the per-namespace informer
            time.sleep(0.05)
        per_ns = list(opted._informers.values())
        for inf in per_ns:
            assert inf.wait_synced(600)
    held = sum(len(i) for i in informers if hasattr(i, "__len__"))
    print(json.dumps({"variant": variant, "peak_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, "base_mb": base, "rss_mb": _rss_mb(),
        "held": held, "seconds": time.monotonic() - start}), flush=True)
    for inf in informers:
        inf.stop(2.0)
    loop.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pods", type=int, default=100_000)
    ap.add_argument("--training", type=int, default=1_000)
    ap.add_argument("--pod-bytes", type=int, default=1000)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--measure", choices=("before", "after"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.pods, a.training, a.pod_bytes)
        return
    if a.measure:
        measure(a.measure, a.url)
        return
    me = os.path.abspath(__file__)
    t0 = time.monotonic()
    server = subprocess.Popen([sys.executable, me, "--serve", "--pods", str(a.pods),
                               "--training", str(a.training), "--pod-bytes",
                               str(a.pod_bytes)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdin is not None
    info = json.loads(server.stdout.readline())
    print(f"fake API server: {a.pods:,} pods ({a.training:,} training pods of ftagent jobs "
          f"in the opted-in namespace), {info['json_bytes'] / 1e6:.0f} MB of pod JSON; "
          f"populated in {time.monotonic() - t0:.0f}s")
    rows = []
    try:
        for variant in ("before", "after"):
            out = subprocess.run([sys.executable, me, "--measure", variant, "--url",
                                  info["url"]], capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                print(out.stderr[-2000:])
                raise SystemExit(f"the {variant} variant failed")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        server.stdin.close()
        server.wait(60)
    print(f"{'variant':8} {'peak RSS':>10} {'before start':>13} {'objects held':>13} "
          f"{'sync':>7}")
    for r in rows:
        print(f"{r['variant']:8} {r['peak_mb']:8.0f} MB {r['base_mb']:10.0f} MB "
              f"{r['held']:13,} {r['seconds']:6.1f}s")
    before, after = rows
    grown = (before["peak_mb"] - before["base_mb"], after["peak_mb"] - after["base_mb"])
    print(f"informers' peak growth: before {grown[0]:.0f} MB, after {grown[1]:.0f} MB "
          f"({grown[0] / max(grown[1], 1e-9):.1f}x less)")


if __name__ == "__main__":
    main()
