"""deploy/prometheus/scrape-config.yaml keeps ftagent's pods and only those.

Debian's Prometheus is built without Kubernetes service discovery (promtool rejects
``kubernetes_sd_configs``), so the relabelling is applied here as Prometheus documents it:
``source_labels`` joined by ``separator`` (default ``;``), missing labels as "", the
``regex`` anchored at both ends, ``keep`` drops a target that does not match, ``replace``
writes the expanded ``replacement`` (default ``$1``) into ``target_label`` on a match.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.conftest import ROOT

CONFIG = ROOT / "deploy" / "prometheus" / "scrape-config.yaml"


def relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str] | None:
    out = dict(labels)
    for r in rules:
        value = r.get("separator", ";").join(out.get(s, "") for s in r["source_labels"])
        m = re.fullmatch(r.get("regex", "(.*)"), value)
        action = r.get("action", "replace")
        if action == "keep":
            if m is None:
                return None
        elif action == "replace":
            if m is not None:
                rep = re.sub(r"\$(\d+)", r"\\\1", r.get("replacement", "$1"))
                out[r["target_label"]] = m.expand(rep)
        else:  # pragma: no cover - the config uses keep and replace only
            raise AssertionError(f"action {action} not modelled")
    return out


def pod(labels: dict[str, str], annotations: dict[str, str]) -> dict[str, str]:
    """A pod target as Prometheus' role: pod discovery labels it (one per container port)."""
    meta = {"__address__": "10.0.0.7:8080"}
    for k, v in labels.items():
        name = re.sub(r"[^a-zA-Z0-9_]", "_", k)
        meta[f"__meta_kubernetes_pod_label_{name}"] = v
        meta[f"__meta_kubernetes_pod_labelpresent_{name}"] = "true"
    for k, v in annotations.items():
        meta[f"__meta_kubernetes_pod_annotation_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}"] = v
    return meta


SCRAPE = {"prometheus.io/scrape": "true", "prometheus.io/port": "9430"}


def test_scrape_config_keeps_only_ftagent_pods() -> None:
    cfg = yaml.safe_load(CONFIG.read_text())
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "ftagent" and "honor_labels" not in job
    rules = job["relabel_configs"]

    injected = relabel(rules, pod({"ftagent.io/job": "llama", "app": "x"}, SCRAPE))
    assert injected is not None and injected["__address__"] == "10.0.0.7:9430"
    for name, port in (("ftagent-arbiter", "9431"), ("ftagent-node", "9432"),
                       ("ftagent-webhook", "9433")):
        kept = relabel(rules, pod({"app.kubernetes.io/name": name},
                                  {**SCRAPE, "prometheus.io/port": port}))
        assert kept is not None and kept["__address__"] == f"10.0.0.7:{port}", name

    # any other annotated pod of the cluster is not ours to scrape
    assert relabel(rules, pod({"app": "redis"}, SCRAPE)) is None
    assert relabel(rules, pod({"app.kubernetes.io/name": "ftagent-arbiter-evil"},
                              SCRAPE)) is None
    assert relabel(rules, pod({"job-name": "sweep"}, SCRAPE)) is None
    # ours without the annotation (opted out of scraping) stay out too
    assert relabel(rules, pod({"ftagent.io/job": "llama"}, {})) is None
