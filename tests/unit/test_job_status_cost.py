"""A job's status is bounded (issue 33, item 2): on the code before GetJob built one row per
rank, 100,000 rows for a job of 100,000 ranks (17 ms of the event loop at 6,000). Now at
most 1,000 rows, the ranks worth a look first, and the count of the rest."""

from __future__ import annotations

from ftagent.arbiter.policy import PolicyConfig
from ftagent.arbiter.registry import Connection, Registry
from ftagent.arbiter.status_view import format_job
from ftagent.arbiter.timeline import Timeline
from ftagent.v1 import ftagent_pb2 as pb


def _job(n: int) -> tuple[Registry, list[Connection]]:
    reg = Registry(PolicyConfig(max_restarts=5), Timeline(), None, "a")
    conns = []
    for r in range(n):
        c = Connection(f"p{r}")
        reg.hello(c, pb.Hello(job="big", namespace="ns", rank=r, world_size=n,
                              agent_instance=f"i{r}", pod=f"pod-{r}", node="n",
                              state="running"))
        conns.append(c)
    return reg, conns


def test_a_big_jobs_status_shows_a_thousand_ranks_the_troubled_first() -> None:
    reg, conns = _job(3000)
    for r in (2999, 1500, 7):
        reg.disconnect(conns[r])
    info = reg.info(reg.jobs[("ns", "big")], ranks=True)
    ranks = [r.rank for r in info.ranks]
    assert len(ranks) == 1000 and info.ranks_omitted == 2000
    assert {2999, 1500, 7} <= set(ranks) and ranks == sorted(ranks)
    assert ranks[:5] == [0, 1, 2, 3, 4]  # then the lowest
    text = format_job(info)
    assert "... and 2000 more ranks" in text


def test_a_small_jobs_status_shows_every_rank() -> None:
    reg, _ = _job(20)
    info = reg.info(reg.jobs[("ns", "big")], ranks=True)
    assert [r.rank for r in info.ranks] == list(range(20)) and info.ranks_omitted == 0
    assert "more ranks" not in format_job(info)
