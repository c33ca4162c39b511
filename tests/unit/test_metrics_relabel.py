"""A warm spare takes a rank (issue 24): its series move to the rank it trains as, keeping
what they counted, and the node's collectors follow (``AgentMetrics.relabel``)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ftagent.metrics import AgentMetrics


def spare_metrics() -> tuple[AgentMetrics, CollectorRegistry, dict[str, str]]:
    labels = {"job_name": "j", "namespace": "ns", "pod": "j-spare-0", "node": "n2",
              "rank": "-1"}
    reg = CollectorRegistry()
    m = AgentMetrics(reg, labels)
    m.share_identity(labels)
    return m, reg, labels


def test_a_spare_that_takes_rank_1_exports_as_rank_1_with_its_counts() -> None:
    m, reg, labels = spare_metrics()
    m.spare.set(1)
    m.faults_by_kind("gpu").inc()
    m.progress.report(step=12)
    m.relabel(rank="1")
    m.spare.set(0)
    m.progress.report(step=13)
    text = generate_latest(reg).decode()
    assert 'rank="-1"' not in text, [ln for ln in text.splitlines() if 'rank="-1"' in ln]
    fault = [ln for ln in text.splitlines() if ln.startswith("ftagent_faults_total{")]
    assert fault and all('rank="1"' in ln for ln in fault) and fault[0].endswith(" 1.0"), fault
    step = [ln for ln in text.splitlines() if ln.startswith("ftagent_training_step{")]
    assert step == [ln for ln in step if 'rank="1"' in ln and ln.endswith(" 13.0")], step
    assert any(ln.startswith("ftagent_sdk_datagrams_received_total{") and 'rank="1"' in ln
               for ln in text.splitlines())
    # the node's GPU and NIC collectors read the shared view at scrape time
    assert labels["rank"] == "1" and m.identity["rank"] == "1"


def test_relabel_refuses_a_label_that_is_no_identity_label() -> None:
    m, _, _ = spare_metrics()
    with pytest.raises(ValueError, match="not identity labels"):
        m.relabel(gpu="0")
