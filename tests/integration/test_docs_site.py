"""The documentation site: `mkdocs build --strict` passes (no page outside the nav, no
broken link or anchor), every alert's runbook anchor exists in the built page, and Debian's
chromium, headless, opens the home page and a reference page with their content laid out."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT

pytest.importorskip("mkdocs", reason="mkdocs missing: pip install -e '.[dev]'")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                        "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    yield out


def test_every_runbook_anchor_is_in_the_built_page(site: Path) -> None:
    page = (site / "runbooks" / "index.html").read_text()
    groups = yaml.safe_load((ROOT / "deploy" / "prometheus" / "ftagent-rules.yaml")
                            .read_text())["groups"]
    for rule in (r for g in groups for r in g["rules"] if "alert" in r):
        anchor = rule["annotations"]["runbook_url"].rsplit("#", 1)[1]
        assert f'id="{anchor}"' in page, anchor


# After layout: the page's title, its h1, the number of table rows drawn with a size, and
# the nav links, into an attribute that --dump-dom prints.
PROBE = """<script>window.addEventListener('load', () => {
  const rows = [...document.querySelectorAll('table tr')].filter(
      r => r.getBoundingClientRect().height > 0).length;
  const h1 = document.querySelector('h1');
  const nav = [...document.querySelectorAll('nav a, .navbar a')].map(a => a.textContent.trim());
  document.body.setAttribute('data-probe', JSON.stringify(
      {title: document.title, h1: h1 ? h1.textContent.trim() : '', rows, nav})); });</script>"""


def render(site: Path, page: str, tmp: Path) -> dict[str, Any]:
    """Open ``page`` of the built site in headless chromium; the probe's findings."""
    assert CHROMIUM is not None
    path = site / page
    path.write_text(path.read_text().replace("</body>", PROBE + "</body>"))
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                        "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}",
                        "--virtual-time-budget=5000", "--dump-dom", path.as_uri()],
                       capture_output=True, text=True, timeout=120, cwd=tmp)
    assert r.returncode == 0, r.stderr[-2000:]
    start = r.stdout.find("data-probe=")
    assert start >= 0, r.stdout[-2000:]
    quote = r.stdout[start + len("data-probe=")]
    raw = r.stdout[start + len("data-probe=") + 1:].split(quote, 1)[0]
    return dict(json.loads(raw.replace("&quot;", '"').replace("&amp;", "&")))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium missing: `make deps` installs "
                    "Debian's chromium package")
def test_home_and_reference_pages_open_in_headless_chromium(site: Path,
                                                           tmp_path: Path) -> None:
    home = render(site, "index.html", tmp_path)
    assert str(home["h1"]).rstrip("¶") == "ftagent" and "ftagent" in str(home["title"])
    assert int(str(home["rows"])) >= 6  # the "where to start" table, laid out
    assert "Quick start (ML engineer)" in str(home["nav"])
    flags = render(site, "reference/flags/index.html", tmp_path)
    assert str(flags["h1"]).startswith("Flags reference")
    assert int(str(flags["rows"])) > 100  # every flag of every command, one row each
