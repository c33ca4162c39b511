"""The alert rules in deploy/ are valid and behave as their unit tests say (promtool)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import ROOT

RULES = ROOT / "deploy" / "prometheus"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool missing: `make deps` installs Debian's prometheus package")


@needs_promtool
def test_rules_are_valid() -> None:
    r = subprocess.run(["promtool", "check", "rules", str(RULES / "ftagent-rules.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_rules_unit_tests_pass() -> None:
    r = subprocess.run(["promtool", "test", "rules", "ftagent-rules.test.yaml"],
                       cwd=RULES, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
