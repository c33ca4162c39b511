"""One owner per fact (issue 36): the worker's rank, generation, restart count and trainer
state live in its lifecycle (agent/lifecycle.py); every other part reads them there.

Two kinds of check: the package read with ``ast`` for an assignment to one of these facts
outside their owner (a copy that can go stale), and the cases that went stale before --
a warm spare that took over rank 3 judged the arbiter's "busy, not hung" verdict as rank
0 (cmd/run.py built its peer-wait check with the rank it was started with), the
metrics sink kept a shadow restart count of its own, and the link to the arbiter kept
its own ``trainer_running`` beside the lifecycle's trainer (its Hello reads it there:
test_link_running.py). A third reads the package for a push
of one of these facts into its Prometheus series (the sink set them from the trainer's
start and exit it was handed): they are read at scrape time.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from prometheus_client import CollectorRegistry

from ftagent.agent.lifecycle import Lifecycle
from ftagent.agent.metrics_sink import MetricsSink
from ftagent.agent.peer_wait import PeerWait
from ftagent.agent.pod import PodAgent
from ftagent.agent.worker import WorkerSpec, wait_at_barrier
from ftagent.cmd.run import build_agent, parse, pod_decider
from ftagent.metrics import AgentMetrics
from ftagent.model import Action, ActionKind, JobBusy, Origin
from ftagent.v1 import ftagent_pb2 as pb

PACKAGE = Path(__file__).resolve().parents[2] / "ftagent"
OWNER = "agent/lifecycle.py"
# the worker's facts, as attribute names (the link's Hello says them under these names)
FACTS = {"rank", "generation", "restarts", "restart_count", "trainer_state", "state",
         "spare", "stop_signal", "trainer_pid", "trainer_exit", "trainer_running",
         "trainer_ended"}
# where the agent keeps its facts: its modules and its composition root
SCOPE = ("agent/", "cmd/run.py")
# (file, attribute) assignments that stay, with the reason; the test fails when one goes
ALLOWED: dict[tuple[str, str], str] = {
}


def assignments(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of every assignment to ``x.<fact>`` (plain, augmented,
    annotated, or ``setattr(x, "<fact>", v)``) in ``path``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "setattr" and len(node.args) == 3 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in FACTS:
            found.append((node.lineno, str(node.args[1].value)))
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr in FACTS:
                    found.append((node.lineno, sub.attr))
    return found


def test_no_part_of_the_agent_assigns_a_fact_its_lifecycle_owns() -> None:
    outside: dict[tuple[str, str], list[int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == OWNER or not rel.startswith(SCOPE):
            continue
        for line, attr in assignments(path):
            outside.setdefault((rel, attr), []).append(line)
    new = {k: v for k, v in outside.items() if k not in ALLOWED}
    assert not new, ("assigned outside their owner (agent/lifecycle.py): read them there "
                     f"instead: {new}")
    gone = sorted(set(ALLOWED) - set(outside))
    assert not gone, f"fixed, delete from ALLOWED: {gone}"


# the agent's series of the lifecycle's facts (metrics.py), read there at scrape time
SCRAPED = {"trainer_running", "trainer_last_exit_code", "generation", "restarts", "spare"}
PUSHES = {"set", "inc", "dec", "set_to_current_time"}


def pushes(path: Path) -> list[tuple[int, str]]:
    """(line, series) of every ``x.<series>.<set|inc|dec>(...)`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in PUSHES and isinstance(node.func.value, ast.Attribute) and \
                node.func.value.attr in SCRAPED:
            found.append((node.lineno, node.func.value.attr))
    return found


def test_no_part_pushes_a_fact_the_lifecycle_owns_into_its_series(tmp_path: Path) -> None:
    found = {path.relative_to(PACKAGE).as_posix(): hits
             for path in sorted(PACKAGE.rglob("*.py")) if (hits := pushes(path))}
    assert not found, f"read these at scrape time from the lifecycle instead: {found}"
    probe = tmp_path / "probe.py"  # the checker finds what the old sink did
    probe.write_text("m.trainer_running.set(1)\nm.generation.set(g)\nm.restarts.inc()\n"
                     "m.spare.set_function(f)\nm.step.set(1)\n", encoding="utf-8")
    assert pushes(probe) == [(1, "trainer_running"), (2, "generation"), (3, "restarts")]


def test_the_checker_finds_each_kind_of_assignment(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("a.rank = 1\nb.restarts += 1\nc.state: int = 2\n"
                     "setattr(d, 'generation', 3)\nrank = 4\ne.other = 5\n", encoding="utf-8")
    assert assignments(probe) == [(1, "rank"), (2, "restarts"), (3, "state"),
                                  (4, "generation")]


def test_a_spare_that_took_over_rank_3_judges_busy_verdicts_as_rank_3(tmp_path: Path) -> None:
    """The peer-wait check of a warm spare assigned rank 3 (the arbiter's ASSIGN): the
    arbiter's BUSY names rank 3 waiting on rank 0, so this rank waits (no hang) -- on the
    old code the check still had the rank the spare was started with (0: the default) and
    found itself busy, not waiting, so a stall the arbiter called a wait stayed a hang."""
    cfg = parse(["--arbiter", "127.0.0.1:9", "--spare", "--world-size", "4",
                 "--arbiter-fail-open-after", "0", "--metrics-port", "-1",
                 "--hang-verify-window", "1", "--", "true"], {})
    assert cfg.identity.rank == 0 and cfg.identity.spare
    pod = PodAgent(pod_decider(cfg))
    worker = build_agent(pod, WorkerSpec(cfg, {"PATH": "/usr/bin:/bin"}), str(tmp_path))
    (waits,) = [o for o in worker.observers if isinstance(o, PeerWait)]
    decider = pod.decider
    link = decider.session(worker).link  # type: ignore[attr-defined]
    assign = pb.ArbiterMessage(command=pb.Command(
        id="a1", kind=pb.COMMAND_KIND_ASSIGN, target_rank=3, generation=1, restarts=1))

    async def go() -> None:
        waiting = asyncio.create_task(wait_at_barrier(decider, worker))
        await asyncio.sleep(0)  # one turn: the spare waits for its rank (no trainer)
        assert not waiting.done() and link.proto.hello().spare
        assert link.proto.on_message(assign).assigned
        # the spare's wait ends with the rank taken, then the barrier (failing open: alone)
        assert await asyncio.wait_for(waiting, 10) is None
        busy = Action(ActionKind.BUSY, "job busy, not hung", origin=Origin.ARBITER,
                      busy=JobBusy((0,), (3,), "save (serialization.py:966)", "alive"))
        await decider.on_minor_action(worker, busy)

    try:
        asyncio.run(go())
    finally:
        for s in worker.watch.parts[0].sources():
            close = getattr(s, "close", None)
            if close is not None:
                close()
    assert worker.ident.rank == 3 and link.proto.hello().rank == 3
    assert waits.rank == 3
    assert waits.waiting, "the spare judged a verdict about rank 3 as another rank"


def test_the_restart_count_is_read_at_scrape_time_from_the_lifecycle() -> None:
    """ftagent_restarts_total is the lifecycle's count when scraped: nothing counts it
    again (the old sink kept its own, moved by the steps it heard)."""
    life = Lifecycle()
    registry = CollectorRegistry()
    m = AgentMetrics(registry, {"job_name": "j", "namespace": "", "pod": "p", "node": "n",
                                "rank": "0"})
    MetricsSink(m, lifecycle=life)

    def scraped() -> float | None:
        return registry.get_sample_value("ftagent_restarts_total", dict(m.identity))

    assert scraped() == 0
    life.restart(Action(ActionKind.RESTART, "crash", origin=Origin.LOCAL))
    assert scraped() == 1
    life.reached(1, restarts=4)  # a rejoin adopts the job's count: read, never re-added
    assert scraped() == 4
