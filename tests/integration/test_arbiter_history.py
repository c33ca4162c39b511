"""Job history through a real arbiter with --state-dir: finished and stopped jobs stay in
`ftagent status` (the real CLI) after their agents left, and after a SIGKILL and restart
of the arbiter, also with a torn last line in the file."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from ftagent.arbiter.history_file import FILE
from ftagent.model import ActionKind, Fault, FaultKind, ProcessExit
from tests.arbiter_helpers import ArbiterProcess, ftagent_cmd, running_links, wait_until

TOKEN = "s3cret-history"


def status(address: str, *args: str) -> Any:
    p = subprocess.run(ftagent_cmd("status", "--json", *args), capture_output=True, text=True,
                       timeout=30, env={**os.environ, "FTAGENT_ARBITER": address,
                                        "FTAGENT_TOKEN": TOKEN})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def human(address: str, *args: str) -> str:
    p = subprocess.run(ftagent_cmd("status", *args), capture_output=True, text=True,
                       timeout=30, env={**os.environ, "FTAGENT_ARBITER": address,
                                        "FTAGENT_TOKEN": TOKEN})
    assert p.returncode == 0, p.stderr
    return p.stdout


def jobs(address: str) -> dict[str, dict[str, Any]]:
    return {j["job"]: j for j in status(address)["jobs"]}


async def run_two_jobs(address: str) -> None:
    async with running_links(address, "fine", 2, token=TOKEN) as links:
        for lk in links:
            lk.arrive(0)
        assert all(await asyncio.gather(*(lk.wait_released(0, 5) for lk in links)))
        links[1].report_fault(Fault(FaultKind.CRASH, "segfault"), exit_status=139)
        for lk in links:
            assert (await asyncio.wait_for(lk.commands.get(), 5)).generation == 1
            lk.arrive(1)
        assert all(await asyncio.gather(*(lk.wait_released(1, 5) for lk in links)))
        for lk in links:
            lk.report_exit(ProcessExit(pid=1, code=0), 1)
        await wait_until(lambda: jobs(address)["fine"]["state"] == "succeeded", 10,
                         "the job to succeed")
    async with running_links(address, "halted", 1, token=TOKEN, max_restarts=0) as links:
        links[0].report_fault(Fault(FaultKind.CRASH, "boom"), exit_status=2)
        assert (await asyncio.wait_for(links[0].commands.get(), 5)).kind is ActionKind.STOP


def check_shown(address: str) -> None:
    listed = jobs(address)
    assert listed["fine"]["state"] == "succeeded" and listed["fine"]["connected"] == 0
    assert listed["halted"]["state"].startswith("stopped: ")
    fine = status(address, "fine")
    messages = [e["message"] for e in fine["timeline"]]
    assert any("segfault" in m for m in messages)
    assert any("job succeeded" in m for m in messages)
    assert any(e["action"] == "restart" for e in fine["timeline"])
    halted = status(address, "halted")
    assert any(e["action"] == "stop" for e in halted["timeline"])


def test_finished_jobs_stay_in_status_after_their_agents_and_the_arbiter_died(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    with ArbiterProcess("--token", TOKEN, "--state-dir", str(state)) as arbiter:
        asyncio.run(run_two_jobs(arbiter.address))
        asyncio.run(wait_until(lambda: all(j["connected"] == 0 for j in
                                           jobs(arbiter.address).values()), 10,
                               "every agent to leave"))
        check_shown(arbiter.address)
        before = status(arbiter.address, "fine")["timeline"]

        arbiter.kill()
        arbiter.start()
        check_shown(arbiter.address)
        assert status(arbiter.address, "fine")["timeline"] == before
        shown = human(arbiter.address, "fine")
        assert shown.startswith("job fine: succeeded, generation 1, restarts 1/3")
        assert "every agent has left" in shown and "job succeeded" in shown
        assert "stopped: " in human(arbiter.address)

        arbiter.kill()
        with (state / FILE).open("ab") as f:
            f.write(b'{"t":"e","seq":123456,"job":"fine","mess')  # a torn last write
        arbiter.start()
        check_shown(arbiter.address)
        assert arbiter.log_text().count("unreadable line") == 1
        assert (state / FILE).read_bytes().endswith(b"\n")


def test_without_a_state_dir_history_outlives_the_job_but_not_the_arbiter() -> None:
    with ArbiterProcess("--token", TOKEN) as arbiter:
        asyncio.run(run_two_jobs(arbiter.address))
        asyncio.run(wait_until(lambda: all(j["connected"] == 0 for j in
                                           jobs(arbiter.address).values()), 10,
                               "every agent to leave"))
        check_shown(arbiter.address)
        arbiter.kill()
        arbiter.start()
        assert status(arbiter.address)["jobs"] == []


def test_an_unusable_state_dir_is_one_line_and_exit_1(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    p = subprocess.run(ftagent_cmd("arbiter", "--listen", "127.0.0.1:0", "--metrics-port",
                                   "-1", "--state-dir", str(blocker / "sub")),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert p.stderr.strip().count("\n") == 0 and "--state-dir" in p.stderr, p.stderr
