"""Issue 24: the TrainJob writer's interval is a flag (``--trainjob-status-interval``,
``FTAGENT_TRAINJOB_STATUS_INTERVAL``; 0 writes nothing), wired into the --kube settings."""

from __future__ import annotations

import pytest

from ftagent.cmd import arbiter as arbiter_cli
from ftagent.config import ConfigError
from ftagent.kube.trainjob_status import TrainJobStatus


def writer(argv: list[str], env: dict[str, str] | None = None) -> TrainJobStatus:
    s = arbiter_cli.kube_settings(arbiter_cli.parse(argv, env or {}))
    return TrainJobStatus(None, s.trainjob_status_interval)


def test_the_trainjob_status_interval_comes_from_the_flag_or_its_variable() -> None:
    assert writer([]).interval == 30.0
    w = writer(["--trainjob-status-interval", "5"])
    assert w.interval == 5.0
    assert w.due("ns", "tj", 100.0) and not w.due("ns", "tj", 104.0) and w.due("ns", "tj", 105.0)
    assert writer([], {"FTAGENT_TRAINJOB_STATUS_INTERVAL": "12.5"}).interval == 12.5
    off = writer(["--trainjob-status-interval", "0"])
    assert not off.due("ns", "tj", 100.0) and not off.due("ns", "tj", 1e9)


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ConfigError, match="--trainjob-status-interval"):
        arbiter_cli.parse(["--trainjob-status-interval", "-1"], {})
