"""The report in a real browser: Debian's chromium, headless, opens the page written by
``ftagent report`` (a real subprocess, from a real arbiter's history after a crash and a
restart), renders it (the DOM after layout shows every picture with a size) and takes a
screenshot that is not blank."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ftagent.model import Fault, FaultKind, Progress
from tests.arbiter_helpers import ArbiterProcess, running_links

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium missing: `make deps` "
                                "installs Debian's chromium package")
SCREENSHOT_TO = os.environ.get("FTAGENT_REPORT_SCREENSHOT", "")  # keep a copy (docs/)

# Measures every picture after layout, puts the result in the title, which --dump-dom
# prints.
PROBE = """<script>window.addEventListener('load', () => {
  const figs = [...document.querySelectorAll('figure svg')].map(s => {
    const r = s.getBoundingClientRect(); return [s.closest('figure').id, r.width, r.height,
    s.querySelectorAll('path').length]; });
  document.body.setAttribute('data-probe', JSON.stringify(figs)); });</script>"""


def chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--disable-dev-shm-usage", f"--user-data-dir={cwd / 'profile'}",
                           "--virtual-time-budget=5000", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def png_size_and_colours(png: bytes) -> tuple[int, int, int]:
    """Width, height and an estimate of distinct byte values of the image data."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    data, i = b"", 8
    while i < len(png):
        n = int.from_bytes(png[i:i + 4], "big")
        if png[i + 4:i + 8] == b"IDAT":
            data += png[i + 8:i + 8 + n]
        i += 12 + n
    raw = zlib.decompress(data)
    return w, h, len(set(raw[::97]))


def make_history(address: str) -> None:
    async def body() -> None:
        async with running_links(address, "drill", 2, progress_interval=0.1) as links:
            for lk in links:
                lk.arrive(0)
            assert all(await asyncio.gather(*(lk.wait_released(0, 10) for lk in links)))
            for lk in links:
                lk.report_progress(Progress(10, ts=1.0), seconds_since_progress=0, hung=False)
            links[1].report_fault(Fault(FaultKind.CRASH, "segfault in the data loader"),
                                  exit_status=139)
            for lk in links:
                assert (await asyncio.wait_for(lk.commands.get(), 10)).generation == 1
            for lk in links:
                lk.arrive(1)
            assert all(await asyncio.gather(*(lk.wait_released(1, 10) for lk in links)))
            for lk in links:
                lk.report_progress(Progress(25, ts=2.0), seconds_since_progress=0, hung=False)
            await asyncio.sleep(0.5)  # noqa: ASYNC110 - let the last summary be sent
    asyncio.run(body())


def test_report_opens_in_headless_chromium_with_its_pictures(tmp_path: Path) -> None:
    with ArbiterProcess() as arbiter:
        make_history(arbiter.address)
        page = tmp_path / "report.html"
        r = subprocess.run([sys.executable, "-m", "ftagent", "report", "drill", "--arbiter",
                            arbiter.address, "-o", str(page)], capture_output=True, text=True,
                           timeout=120)
    assert r.returncode == 0, r.stderr
    html = page.read_text()
    assert "segfault in the data loader" in html
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", PROBE + "</body>"))
    dom = chromium("--dump-dom", probe.as_uri(), cwd=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    marker = 'data-probe="'
    assert marker in dom.stdout, dom.stdout[:2000]
    raw = dom.stdout.split(marker, 1)[1].split('"', 1)[0].replace("&quot;", '"')
    figs = {name: (w, h, paths) for name, w, h, paths in json.loads(raw)}
    assert set(figs) == {"steps", "downtime", "phases"}
    for name, (w, h, paths) in figs.items():
        assert w > 300 and h > 100 and paths > 5, (name, w, h, paths)

    shot = tmp_path / "screenshot.png"
    got = chromium(f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri(),
                   cwd=tmp_path)
    assert got.returncode == 0 and shot.exists(), got.stderr[-2000:]
    w, h, colours = png_size_and_colours(shot.read_bytes())
    assert (w, h) == (1200, 1400) and colours > 20  # drawn, not a blank page
    if SCREENSHOT_TO:
        shutil.copy(shot, SCREENSHOT_TO)
