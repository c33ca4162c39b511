"""The install watches itself, truthfully (issue 32.4): a real Prometheus (Debian's package)
scrapes a real arbiter, a real webhook and a real agent on loopback, as the shipped
PodMonitors say (one scrape job per PodMonitor, named ``<namespace>/<name>`` as the
Prometheus Operator names it, on the port the monitor names), and evaluates the shipped
rule file. Before, nothing scraped the webhook: ``FtagentWebhookDown`` fired on every
install and ``FtagentWebhookErrors`` could never fire.

The rules are a test copy of ``deploy/prometheus/ftagent-rules.yaml`` with shorter
durations, nothing else changed: every ``for:`` becomes 2 s and every range window
(``[5m]``, ``[1h]``...) 20 s (10 s in the two tests here whose counts fit in it with room),
so an alert fires and resolves within the test. Checked here:
the self-watching alerts stay quiet while everything is up; ``FtagentWebhookErrors`` fires
on a review that fails inside the webhook (a fault injected into the real webhook process
for one namespace) and resolves; ``FtagentWebhookDown`` and ``FtagentAgentNotScraped``
fire when the webhook stops and resolve when it is back; ``FtagentArbiterAbsent`` fires
when the arbiter is killed and resolves when it is back; ``FtagentArbiterNoLeader`` fires
while the only replica scraped stands by (the Lease held elsewhere, in the fake API server)
and resolves when it leads. The training alerts are driven by a real agent wrapping a
trainer the test steers through a file (steps, a NaN loss, a stall, crashes) with the
simulated GPU backend (a fatal Xid): ``FtagentGpuFatalXid``, ``FtagentLossNaN``,
``FtagentLossAnomaly``, ``FtagentTrainingHung``, ``FtagentNoProgress`` (its 1800 s
threshold at 4 s: THRESHOLDS) and ``FtagentRestartingOften`` each fire and resolve.
``tests/integration/test_alerts_live_more.py`` drives the NIC and the arbiter's job alerts,
``tests/integration/test_alerts_live_cordons.py`` the straggler and the cordon alerts.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftagent.arbiter.process import ArbiterProcess
from tests.conftest import PY, free_port, ftagent_cmd, popen, prom_query, wait_for

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="prometheus missing: `make deps` installs Debian's prometheus package")

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/ftagent-rules.yaml"
MONITORS = ROOT / "deploy/components/monitoring/podmonitor.yaml"
NS = "ftagent-system"
QUIET = ("FtagentWebhookDown", "FtagentWebhookErrors", "FtagentArbiterAbsent",
         "FtagentArbiterNoLeader", "FtagentAgentNotScraped")
# The webhook, with one fault injected: a pod in namespace "boom" makes the mutation raise
# (an internal error, as a bug would); every other review is the real code's.
WEBHOOK = textwrap.dedent("""
    import sys
    import ftagent.kube.webhook as w
    real = w.mutate
    def mutate(obj, namespace, settings):
        if namespace == "boom":
            raise RuntimeError("injected fault")
        return real(obj, namespace, settings)
    w.mutate = mutate
    from ftagent.cmd.webhook import main
    sys.exit(main(sys.argv[1:]))
""")


# Thresholds that are durations, shortened with the rest (the rule's text must be there: a
# change of the shipped rule fails here, not silently)
THRESHOLDS = {"ftagent_seconds_since_progress > 1800": "ftagent_seconds_since_progress > 4",
              "(increase(ftagent_job_seconds_lost_to_faults_total[1d])) > 3600":
              "(increase(ftagent_job_seconds_lost_to_faults_total[1d])) > 0"}


def short_rules(dst: Path, window: str = "20s") -> Path:
    """The shipped rules with every ``for:`` at 2 s, every range window and ``offset`` at
    ``window`` (20 s; 10 s where a test's counts fit in it with room) and the duration
    thresholds of THRESHOLDS shortened."""
    text = RULES.read_text()
    for shipped, short in THRESHOLDS.items():
        assert shipped in text, f"{shipped!r} is no longer in {RULES.name}"
        text = text.replace(shipped, short)
    text = re.sub(r"\bfor: \d+[smhd]\b", "for: 2s", text)
    text = re.sub(r"\[\d+[smhd]\]", f"[{window}]", text)
    text = re.sub(r"\boffset \d+[smhd]\b", f"offset {window}", text)  # the born-in-window test
    dst.write_text(text)
    return dst


def monitors() -> dict[str, dict[str, Any]]:
    """The shipped PodMonitors by name."""
    return {o["metadata"]["name"]: o for o in yaml.safe_load_all(MONITORS.read_text())
            if o and o["kind"] == "PodMonitor"}


class Webhook:
    def __init__(self, metrics: int) -> None:
        self.metrics = metrics
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [PY, "-c", WEBHOOK, "--self-signed", "--listen", "127.0.0.1:0",
             "--metrics-port", str(self.metrics), "--image", "ftagent:test"],
            stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        text = ""
        while "listening on " not in text:
            line = self.proc.stderr.readline()
            assert line, text
            text += line
        self.port = int(text.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def review(self, namespace: str) -> None:
        """One AdmissionReview of a training pod in ``namespace`` (TLS not verified: the
        answer is not what this test reads)."""
        import ssl

        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "p", "namespace": namespace,
                            "labels": {"training.kubeflow.org/job-name": "j"}},
               "spec": {"containers": [{"name": "pytorch", "image": "x",
                                        "command": ["python", "train.py"]}]}}
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {"uid": "u-1", "kind": {"group": "", "version": "v1",
                                                   "kind": "Pod"},
                            "operation": "CREATE", "namespace": namespace, "object": pod}}
        req = urllib.request.Request(f"https://127.0.0.1:{self.port}/mutate",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            assert r.status == 200


class Prometheus:
    def __init__(self, tmp: Path, targets: dict[str, tuple[str, int]], *,
                 netns: str = "", window: str = "20s") -> None:
        """``targets``: PodMonitor name -> (namespace of its pods, port). ``netns``: run it
        in that network namespace (its loopback), where the scraped processes run.
        ``window``: the rules' range windows and offsets (short_rules)."""
        self.netns = ["ip", "netns", "exec", netns] if netns else []
        self.port = free_port()
        jobs = []
        for name, mon in monitors().items():
            if name not in targets:
                continue
            ns, port = targets[name]
            jobs.append({"job_name": f"{ns}/{name}",  # the Operator's job name
                         "honor_labels": bool(mon["spec"]["podMetricsEndpoints"][0].get(
                             "honorLabels", False)),
                         "metrics_path": mon["spec"]["podMetricsEndpoints"][0]["path"],
                         "static_configs": [{"targets": [f"127.0.0.1:{port}"],
                                             "labels": {"namespace": ns}}]})
        cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                          "scrape_timeout": "1s"},
               "rule_files": [str(short_rules(tmp / "rules.yaml", window))],
               "scrape_configs": jobs}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.proc = subprocess.Popen(
            [*self.netns, "prometheus", f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.jobs = [j["job_name"] for j in jobs]

    def get(self, path: str) -> Any:
        if self.netns:  # this process is not in that namespace: curl is, for one request
            r = subprocess.run([*self.netns, "curl", "-sf", "--max-time", "5", "-g",
                                f"http://127.0.0.1:{self.port}{path}"],
                               capture_output=True, text=True, timeout=30)
            return json.loads(r.stdout)["data"] if r.returncode == 0 else None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                        timeout=5) as r:
                return json.load(r)["data"]
        except OSError:
            return None

    def alerts(self, state: str = "firing") -> set[str]:
        data = self.get("/api/v1/alerts") or {"alerts": []}
        return {a["labels"]["alertname"] for a in data["alerts"] if a["state"] == state}

    def active(self) -> set[str]:
        return self.alerts("firing") | self.alerts("pending")

    def evaluated_since(self, t: float) -> bool:
        """Every rule group was evaluated after wall time ``t``."""
        from datetime import datetime, timezone

        data = self.get("/api/v1/rules")
        groups = (data or {}).get("groups") or []

        def when(stamp: str) -> float:  # RFC 3339, UTC ("...T02:59:01.123456789Z")
            whole = stamp.rstrip("Z").split(".")[0]
            return datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(
                tzinfo=timezone.utc).timestamp()

        return bool(groups) and all(when(g["lastEvaluation"]) > t for g in groups)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    trainer = "import time\nwhile True:\n    print('step=1 loss=1.0', flush=True)\n" \
              "    time.sleep(0.2)\n"
    proc = popen(ftagent_cmd("--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
                             "--job", "alerts", "--rank", "0", "--world-size", "1",
                             cmd=[PY, "-c", trainer]),
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield port
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def test_every_component_with_an_alert_is_scraped_and_its_alerts_fire_and_resolve(
        tmp_path: Path, agent: int) -> None:
    arbiter_metrics, webhook_metrics = free_port(), free_port()
    arbiter = ArbiterProcess("--metrics-port", str(arbiter_metrics),
                             "--metrics-addr", "127.0.0.1")
    webhook = Webhook(webhook_metrics)
    # Prometheus first: its first scrape comes about 5 s after it starts (its target
    # discovery's update period), the arbiter and the webhook start meanwhile
    prom = Prometheus(tmp_path, {"ftagent-agents": ("default", agent),
                                 "ftagent-arbiter": (NS, arbiter_metrics),
                                 "ftagent-webhook": (NS, webhook_metrics)}, window="10s")
    try:
        arbiter.start()
        webhook.start()
        # every component that has an alert is scraped by a shipped monitor
        assert any(j.endswith("/ftagent-webhook") for j in prom.jobs), prom.jobs
        assert any(j.endswith("/ftagent-arbiter") for j in prom.jobs), prom.jobs
        wait_for(lambda: len([s for s in prom_query(prom.port, "up == 1", timeout=5)])
                 == len(prom.jobs), 60, "every target up")
        up_at = time.time()
        wait_for(lambda: prom.evaluated_since(up_at + 4), 30, "rules evaluated while up")
        assert not prom.active() & set(QUIET), prom.active()  # the install is quiet

        webhook.review("boom")  # an internal error in the webhook
        wait_for(lambda: "FtagentWebhookErrors" in prom.alerts(), 30,
                 "FtagentWebhookErrors to fire")
        webhook.review("default")  # a good review: the errors stop
        wait_for(lambda: "FtagentWebhookErrors" not in prom.active(), 60,
                 "FtagentWebhookErrors to resolve")

        webhook.stop()
        wait_for(lambda: {"FtagentWebhookDown", "FtagentAgentNotScraped"} <= prom.alerts(),
                 30, "FtagentWebhookDown and FtagentAgentNotScraped to fire")
        webhook.start()
        wait_for(lambda: not {"FtagentWebhookDown", "FtagentAgentNotScraped"}
                 & prom.active(), 30, "the webhook's alerts to resolve")

        arbiter.kill()
        wait_for(lambda: "FtagentArbiterAbsent" in prom.alerts(), 30,
                 "FtagentArbiterAbsent to fire")
        arbiter.start()
        wait_for(lambda: "FtagentArbiterAbsent" not in prom.active(), 30,
                 "FtagentArbiterAbsent to resolve")
    finally:
        prom.stop()
        webhook.stop()
        arbiter.stop()


def test_no_leader_fires_while_the_lease_is_held_elsewhere_and_resolves(
        tmp_path: Path) -> None:
    """FtagentArbiterNoLeader: a replica is scraped (by the shipped arbiter PodMonitor, so
    a standby is seen too) but none leads; it resolves once the replica takes the Lease."""
    from datetime import datetime, timezone

    from tests.kube_fake import FakeKube

    metrics = free_port()
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    with FakeKube() as fake:
        fake.create("leases.coordination.k8s.io", {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "ftagent-arbiter", "namespace": NS},
            "spec": {"holderIdentity": "a-replica-elsewhere", "leaseDurationSeconds": 3600,
                     "acquireTime": now, "renewTime": now, "leaseTransitions": 0}})
        arbiter = ArbiterProcess("--leader-elect", "--kube-api", fake.url,
                                 "--leader-elect-namespace", NS,
                                 "--leader-elect-retry-period", "0.5",
                                 "--leader-elect-renew-deadline", "2",
                                 "--leader-elect-lease-duration", "3",
                                 "--metrics-port", str(metrics), "--metrics-addr", "127.0.0.1")
        prom = Prometheus(tmp_path, {"ftagent-arbiter": (NS, metrics)})  # first: see above
        try:
            arbiter.start()
            wait_for(lambda: "FtagentArbiterNoLeader" in prom.alerts(), 60,
                     "FtagentArbiterNoLeader to fire (a standby only)")
            lease = fake.get("leases.coordination.k8s.io", "ftagent-arbiter", NS)
            assert lease is not None
            lease["spec"]["holderIdentity"] = ""  # the other one released it
            fake.update("leases.coordination.k8s.io", lease)
            wait_for(lambda: "FtagentArbiterNoLeader" not in prom.active(), 30,
                     "FtagentArbiterNoLeader to resolve (this replica leads)")
        finally:
            prom.stop()
            arbiter.stop()


def test_a_scrape_counts_every_workers_reviews() -> None:
    """``--workers 2``: the kernel hands each scrape to either worker; each answers with
    every worker's counts (shared memory), so the counter a scrape reads never goes back."""
    proc = subprocess.Popen(
        [PY, "-m", "ftagent", "webhook", "--self-signed", "--listen", "127.0.0.1:0",
         "--metrics-port", "0", "--workers", "2", "--image", "ftagent:test"],
        stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        text = ""
        while "listening on " not in text:
            line = proc.stderr.readline()
            assert line, text
            text += line
        https = int(text.rsplit(":", 1)[1])
        m = re.search(r"metrics on http://[^:]+:(\d+)/", text)
        assert m, text
        import ssl

        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        for _ in range(20):  # new connections: spread over both workers
            req = urllib.request.Request(f"https://127.0.0.1:{https}/mutate", data=b"junk",
                                         method="POST")
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(req, timeout=10, context=ctx)
        for _ in range(10):
            with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics",
                                        timeout=5) as r:
                body = r.read().decode()
            assert 'ftagent_webhook_reviews_total{result="malformed",reason=""} 20' in body, body
    finally:
        proc.terminate()
        proc.wait(10)


# A trainer steered by a file: "ok" (a step a fifth of a second, loss 1.0), "nan" (loss
# NaN), "stall" (alive, no output), "crash" (exits 1 at once, so the agent restarts it)
STEERED = textwrap.dedent("""
    import sys, time
    def mode():
        try:
            with open(sys.argv[1]) as f:
                return f.read().strip()
        except OSError:
            return "ok"
    step = 0
    while True:
        m = mode()
        if m == "crash":
            sys.exit(1)
        if m != "stall":
            step += 1
            print(f"step={step} loss={'nan' if m == 'nan' else 1.0}", flush=True)
        time.sleep(0.2)
""")
TRAINING = ("FtagentGpuFatalXid", "FtagentLossNaN", "FtagentLossAnomaly",
            "FtagentTrainingHung", "FtagentNoProgress", "FtagentRestartingOften")


def test_the_training_alerts_fire_and_resolve_on_a_real_agent(tmp_path: Path) -> None:
    ctl, gpus = tmp_path / "mode", tmp_path / "gpus.txt"
    ctl.write_text("ok")
    gpus.write_text("gpus 1\nt=1s gpu=0 xid=79\n")  # fallen off the bus, once
    port = free_port()
    agent = popen(ftagent_cmd(
        "--metrics-port", str(port), "--metrics-addr", "127.0.0.1", "--job", "alerts",
        "--rank", "0", "--world-size", "1", "--max-restarts", "100",
        "--restart-backoff", "0.1", "--restart-backoff-max", "0.2",
        # a declared hang raises the gauge only (no restart), within a second or two
        "--hang-action", "alert", "--hang-timeout-min", "1", "--hang-warmup-steps", "3",
        "--hang-verify-window", "0.5",
        # the Xid counted, no action taken: the trainer keeps running
        "--gpu-backend", f"simulated:{gpus}", "--gpu-xid-action", "79=ignore",
        "--gpu-poll-interval", "0.2", cmd=[PY, "-c", STEERED, str(ctl)]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # 10 s windows: the crash loop restarts 4 times in about 2 s (> 3 in the window)
    prom = Prometheus(tmp_path, {"ftagent-agents": ("default", port)}, window="10s")
    try:
        wait_for(lambda: prom_query(prom.port, "up == 1", timeout=5), 60, "the agent up")
        wait_for(lambda: "FtagentGpuFatalXid" in prom.alerts(), 30,
                 "FtagentGpuFatalXid to fire")
        up_at = time.time()
        wait_for(lambda: prom.evaluated_since(up_at + 3), 30, "rules evaluated while up")
        assert not prom.active() & (set(TRAINING) - {"FtagentGpuFatalXid"}), prom.active()

        ctl.write_text("nan")
        wait_for(lambda: {"FtagentLossNaN", "FtagentLossAnomaly"} <= prom.alerts(), 30,
                 "FtagentLossNaN and FtagentLossAnomaly to fire")
        ctl.write_text("ok")
        wait_for(lambda: "FtagentLossNaN" not in prom.active(), 30,
                 "FtagentLossNaN to resolve")

        ctl.write_text("stall")
        wait_for(lambda: {"FtagentTrainingHung", "FtagentNoProgress"} <= prom.alerts(), 60,
                 "FtagentTrainingHung and FtagentNoProgress to fire")
        ctl.write_text("ok")
        wait_for(lambda: not {"FtagentTrainingHung", "FtagentNoProgress"} & prom.active(),
                 30, "the stall's alerts to resolve")

        ctl.write_text("crash")
        wait_for(lambda: "FtagentRestartingOften" in prom.alerts(), 60,
                 "FtagentRestartingOften to fire")
        ctl.write_text("ok")
        # the counters' alerts resolve once their increases leave the (10 s) window
        wait_for(lambda: not prom.active() & set(TRAINING), 60,
                 "every training alert to resolve")
        assert agent.poll() is None, "the agent carried the trainer through all of it"
    finally:
        prom.stop()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
