"""The docs follow the code: the generated reference pages are current, every alert has a
runbook section its runbook_url points at, and the README stays a front page."""

from __future__ import annotations

import re
import subprocess
import sys

import yaml

from tests.conftest import ROOT

RULES = ROOT / "deploy" / "prometheus" / "ftagent-rules.yaml"


def test_generated_reference_pages_match_the_code() -> None:
    """docs/gen.py --check regenerates the flags page (from every parser) and the metrics
    page (from the registry) and compares: a flag or series added, renamed or re-documented
    without `python docs/gen.py` fails here."""
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "gen.py"), "--check"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_reference_pages_name_what_the_code_has() -> None:
    flags = (ROOT / "docs" / "reference" / "flags.md").read_text()
    metrics = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    for flag in ("`--max-restarts N`", "`--nproc-per-node", "`--no-python`",
                 "`FTAGENT_ARBITER`", "## `ftagent webhook`", "## `ftagent node`"):
        assert flag in flags, flag
    assert "--no-no-" not in flags
    for series in ("`ftagent_training_step`", "`ftagent_faults_total`",
                   "`ftagent_job_state`", "`ftagent_gpu_xid_errors_total`",
                   "`ftagent_nic_up`", "`ftagent_arbiter_cordons_total`"):
        assert series in metrics, series
    assert "`job_name`" in metrics


def alerts() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_every_alert_has_a_runbook_section() -> None:
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["site_url"].rstrip("/")
    runbooks = (ROOT / "docs" / "runbooks.md").read_text()
    headings = set(re.findall(r"^### (\w+)$", runbooks, re.M))
    names = [str(a["alert"]) for a in alerts()]
    assert names and len(names) == len(set(names))
    for a in alerts():
        name = str(a["alert"])
        url = a["annotations"]["runbook_url"]  # type: ignore[index]
        assert url == f"{site}/runbooks/#{name.lower()}", (name, url)
        assert name in headings, f"docs/runbooks.md has no '### {name}' section"
    assert headings <= set(names), f"runbooks for alerts that do not exist: {headings - set(names)}"


def test_readme_is_a_front_page_that_links_into_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024
    assert "make demo" in readme and "make test" in readme
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert len(links) >= 10
    for link in links:
        assert (ROOT / link).is_file(), link
