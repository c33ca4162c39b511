"""History kept per namespace (issue 33, "the rest"): on the code before, 500 past jobs
were kept cluster-wide, so one tenant's churn of 500 short jobs deleted every other
namespace's history, including the rank owners its records keep across a restart."""

from __future__ import annotations

from pathlib import Path

from ftagent.arbiter.history import History
from ftagent.arbiter.history_file import FileHistory
from ftagent.arbiter.state import JobState


def _past(history: History, ns: str, name: str, at: float) -> None:
    job = JobState(job=name, namespace=ns, world_size=2, max_restarts=3)
    job.last_seen = at
    job.owners[0] = ("pod-0", "uid-0")
    history.retire(job, None)


def test_one_namespaces_churn_keeps_anothers_history(tmp_path: Path) -> None:
    h = History(FileHistory(str(tmp_path)))
    _past(h, "victim", "llm", at=1.0)
    for i in range(2000):
        _past(h, "churn", f"j{i}", at=10.0 + i)
    assert ("victim", "llm") in h.past
    assert h.owners(("victim", "llm")) == {0: ("pod-0", "uid-0")}
    churn = [k for k in h.past if k[0] == "churn"]
    assert len(churn) == 500
    assert ("churn", "j1999") in h.past and ("churn", "j0") not in h.past
    h.close()
    # and after a restart, from the file
    again = History(FileHistory(str(tmp_path)))
    again.load()
    assert ("victim", "llm") in again.past
    again.close()


def test_past_the_total_the_biggest_namespace_pays() -> None:
    from ftagent.arbiter.history import evictions

    past = [(("a", f"j{i}"), float(i)) for i in range(5)] + [(("b", "x"), 0.0)]
    assert evictions(past, "b", per_namespace=10, total=4) == [("a", "j0"), ("a", "j1")]
    assert evictions(past, "a", per_namespace=3, total=100) == [("a", "j0"), ("a", "j1")]
