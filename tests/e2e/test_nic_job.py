"""A real link outage under a real two-rank gloo job, decided by a real arbiter.

Layout (two fresh network namespaces, removed whatever happens)::

     ns0 (rank 0, arbiter)                      ns1 (rank 1)
     data0 10.77.0.1/24  <---- veth ---->  data1 10.77.0.2/24   gloo + TCPStore
     ctl0  10.78.0.1/24  <---- veth ---->  ctl1  10.78.0.2/24   agents <-> arbiter
     arbiter listening on 10.78.0.1:PORT

The arbiter cannot sit on the root namespace's loopback (nothing in a namespace reaches
it), and it must not sit behind the link the test cuts either: rank 1 would lose its
arbiter for the whole outage, its NIC fault would arrive only after the job had already
restarted, and the test would not show the arbiter hearing both ranks while the link is
down. So it runs in rank 0's namespace on a second veth pair -- a control network, as a
cluster's management network is separate from the training fabric. The test itself talks
to it with ``ip netns exec ns0 ftagent status``.

The outage is ``ip -n ns1 link set data1 down``: rank 1's agent sees its link
administratively down, rank 0's sees carrier loss -- real kernel events through netlink.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.conftest import PY, ftagent_cmd, wait_for
from tests.e2e.jobs import TRAIN, Job, needs_torch
from tests.netns import ip, namespaces, require_netns, veth

pytestmark = needs_torch

JOB = "e2e-nic"
GRACE = 0.5  # --nic-grace
OUTAGE = 2.5  # seconds the link stays down: > grace, << the process-group timeout
STEPS = 60
DATA = ("10.77.0.1", "10.77.0.2")
CTL = ("10.78.0.1", "10.78.0.2")
MASTER_PORT = "29511"  # fresh namespaces: any port is free


def in_ns(ns: str, args: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *args]


def timeline(path: Path) -> list[dict[str, Any]]:
    """Entries ``ftagent status --follow --json`` streamed so far (whole lines only)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line still being written
            break
    return out


def nic_faults(entries: list[dict[str, Any]], severity: str) -> dict[int, dict[str, Any]]:
    """The first NIC fault of each rank with this severity ("error": down, "info": back)."""
    found: dict[int, dict[str, Any]] = {}
    for e in entries:
        if e["kind"] == "fault" and e["message"].startswith(f"nic ({severity}"):
            found.setdefault(int(e["rank"]), e)
    return found


def both_down(path: Path) -> dict[int, dict[str, Any]] | None:
    """Both ranks' link-down NIC faults, once the arbiter has received them."""
    found = nic_faults(timeline(path), "error")
    return found if len(found) == 2 else None


def decisions(entries: list[dict[str, Any]], action: str) -> list[dict[str, Any]]:
    return [e for e in entries if e["kind"] == "decision" and e["action"] == action]


def releases(entries: list[dict[str, Any]]) -> list[int]:
    return [int(e["generation"]) for e in entries if e["action"] == "release_barrier"]


def show_logs(tmp: Path) -> None:
    for name in ("arbiter.log", "rank0.out", "rank1.out", "follow.err", "timeline.jsonl"):
        p = tmp / name
        if p.exists():
            print(f"--- {name} (tail)\n{p.read_text(errors='replace')[-3000:]}")


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_link_down_longer_than_grace_waits_then_restarts_the_job_once_back(
        tmp_path: Path) -> None:
    require_netns()
    arbiter: subprocess.Popen[bytes] | None = None
    follow: subprocess.Popen[bytes] | None = None
    job = Job(tmp_path, 2)
    with namespaces(2, prefix="ftanic") as nss:
        veth(nss[0], "data0", nss[1], "data1")
        veth(nss[0], "ctl0", nss[1], "ctl1")
        for r, ns in enumerate(nss):
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{DATA[r]}/24", "dev", f"data{r}")
            ip("-n", ns, "addr", "add", f"{CTL[r]}/24", "dev", f"ctl{r}")
        try:
            arb_log = tmp_path / "arbiter.log"
            with arb_log.open("wb") as f:
                arbiter = subprocess.Popen(
                    in_ns(nss[0], [PY, "-m", "ftagent", "arbiter", "--listen", f"{CTL[0]}:0",
                                   "--metrics-port", "-1", "--insecure"]),
                    stdout=f, stderr=subprocess.STDOUT)
            line = wait_for(lambda: next((ln for ln in arb_log.read_text().splitlines()
                                          if ln.startswith("listening on ")), None)
                            or arbiter.poll() is not None, 30, "the arbiter to listen")
            assert isinstance(line, str), arb_log.read_text()
            address = line.split()[-1]

            follow_out = tmp_path / "timeline.jsonl"
            with follow_out.open("wb") as f, (tmp_path / "follow.err").open("wb") as err:
                follow = subprocess.Popen(
                    in_ns(nss[0], [PY, "-m", "ftagent", "status", "--arbiter", address, JOB,
                                   "--follow", "--json"]), stdout=f, stderr=err)

            for r, ns in enumerate(nss):
                env = {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": DATA[0],
                       "MASTER_PORT": MASTER_PORT, "GLOO_SOCKET_IFNAME": f"data{r}",
                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TRAIN_STEPS": str(STEPS),
                       "TRAIN_STEP_SLEEP": "0.05", "TRAIN_PG_TIMEOUT": "60"}
                cmd = ftagent_cmd("--events-file", str(tmp_path / f"rank{r}.jsonl"),
                                  "--rank", str(r), "--world-size", "2", "--arbiter", address,
                                  "--job", JOB, "--nic", f"data{r}", "--nic-grace", str(GRACE),
                                  cmd=[PY, TRAIN])
                with (tmp_path / f"rank{r}.out").open("wb") as out:  # ip netns exec keeps env
                    job.procs.append(subprocess.Popen(in_ns(ns, cmd), env={**os.environ, **env},
                                                      stdout=out, stderr=subprocess.STDOUT))

            # generation 0 trains across the veth; then the link goes down
            wait_for(lambda: "step=10/" in job.log(0) and "step=10/" in job.log(1), 60,
                     "generation 0 training on both ranks", interval=0.05)
            down_at, down_wall = time.monotonic(), time.time()
            ip("-n", nss[1], "link", "set", "data1", "down")
            # both agents' faults reach the arbiter while the link is still down ...
            down = wait_for(lambda: both_down(follow_out), 10,
                            "both ranks' NIC faults at the arbiter", interval=0.05)
            during = timeline(follow_out)
            # ... which waits for the link instead of restarting a job that cannot rendezvous
            assert {e["rank"] for e in decisions(during, "wait")} == {0, 1}, during
            assert not decisions(during, "restart"), during
            assert not nic_faults(during, "info")
            # the outage itself is timed: longer than the grace, well under the PG timeout
            time.sleep(max(0.0, OUTAGE - (time.monotonic() - down_at)))
            up_wall = time.time()
            ip("-n", nss[1], "link", "set", "data1", "up")
            up_at = time.monotonic()

            # the recovery reaches the arbiter, which restarts every rank at generation 1
            wait_for(lambda: decisions(timeline(follow_out), "restart"), 15,
                     "the arbiter's restart after the link came back", interval=0.05)
            codes = job.wait(60)
            assert codes == [0, 0], (job.log(0)[-2000:], job.log(1)[-2000:])
            wait_for(lambda: decisions(timeline(follow_out), "succeeded"), 10,
                     "the job's success in the timeline", interval=0.05)
            entries = timeline(follow_out)
        except BaseException:
            show_logs(tmp_path)  # captured by pytest, shown with the failure
            raise
        finally:
            job.stop()
            stop(follow)
            stop(arbiter)

    # --- the arbiter's story, in order
    back = nic_faults(entries, "info")
    assert back, entries
    (restart,) = decisions(entries, "restart")
    assert restart["generation"] == 1 and "link back after" in restart["message"], restart
    seq = {e["seq"]: i for i, e in enumerate(entries)}
    first_back = min(seq[e["seq"]] for e in back.values())
    assert max(seq[e["seq"]] for e in down.values()) < first_back <= seq[restart["seq"]]
    assert releases(entries) == [0, 1], entries  # the barrier of each generation, once
    assert seq[restart["seq"]] < [i for i, e in enumerate(entries)
                                  if e["action"] == "release_barrier"][-1]
    assert entries[-1]["action"] == "succeeded", entries[-1]
    # the arbiter's receipt times (wall clock, same machine): each link-down fault after
    # the grace and while the link was down; the recovery after the link came back
    for e in down.values():
        assert down_wall + GRACE <= e["ts"] < up_wall, (down_wall, up_wall, e)
    assert entries[first_back]["ts"] >= up_wall

    # --- each agent's own account: real kernel events, both generations, a full run
    reasons = {}
    for r in (0, 1):
        nic = job.faults(r, "nic")
        downs = [e for e in nic if not e.get("recovered")]
        assert len(downs) == 1 and downs[0]["grace_seconds"] == GRACE, nic
        assert downs[0]["detection_latency_seconds"] >= GRACE
        reasons[r] = downs[0]["reason"]
        ups = [e for e in nic if e.get("recovered")]
        assert len(ups) == 1 and ups[0]["outage_seconds"] >= OUTAGE - 0.2, nic
        ev = job.events(r)
        runs = [e["generation"] for e in ev if e["event"] == "state" and e["kind"] == "running"]
        assert runs == [0, 1], ev
        assert [e["generation"] for e in ev if e["kind"] == "released"] == [0, 1]
        assert f"step={STEPS}/{STEPS}" in job.log(r)
        assert "Timed out" not in job.log(r)  # the link came back long before the PG timeout
    assert reasons == {0: "carrier_lost", 1: "admin_down"}
    assert up_at - down_at < 10
