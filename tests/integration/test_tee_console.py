"""``ftagent run --nproc-per-node 4 --tee 3``: four real workers share the console, each
writing every line in two halves with a pause between them (as ``print(..., end="")``
followed by the rest, or a progress bar, does). Every console line must be one worker's
whole line behind its own prefix. With the old pass-through (a partial line written as it
was read) 344, 365 and 347 of about 400 lines were spliced in three runs here; now none
is, in five."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap

from tests.conftest import ROOT, ftagent_cmd

WORKER = textwrap.dedent("""
    import os, sys, time
    r = os.environ["LOCAL_RANK"]
    for i in range(100):
        sys.stdout.write(r * 40)
        sys.stdout.flush()
        time.sleep(0.002)  # the workload: half a line stays alone in the pipe for a while
        sys.stdout.write(r * 40 + "\\n")
        sys.stdout.flush()
    sys.stdout.write("last line of " + r)  # no newline at exit: still printed, prefixed
""")


def test_tee_3_console_lines_of_four_workers_are_whole() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTAGENT_", "PET_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run(ftagent_cmd("--nproc-per-node", "4", "--tee", "3",
                                   "--output-interval", "0", "--no-python",
                                   cmd=["python3", "-c", WORKER]),
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    spliced = [ln for ln in lines if not re.fullmatch(r"\[default(\d)\]:(?:\1{80}|last line of \1)",
                                                       ln)]
    assert not spliced, f"{len(spliced)} of {len(lines)} lines spliced, e.g. {spliced[:3]}"
    assert len(lines) == 4 * 101
    assert {ln[:11] for ln in lines if "last line" in ln} == {f"[default{i}]:" for i in range(4)}
