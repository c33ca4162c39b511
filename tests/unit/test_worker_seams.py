"""A Worker is complete when built (issue 23): its parts come through its spec and its
constructor (agent/worker_parts.py), and nothing outside worker.py sets its attributes.

Two checks: one reads the source of every module that can hold a worker (the agent room and
the command-line wiring: the layer test keeps every other room from importing the agent)
with ``ast`` and fails on an assignment to a Worker attribute, a ``setattr`` of one, or a
part list mutated from outside; the other builds a worker the way ``ftagent run`` does, with
every part on (arbiter, warm standby, flight recorder, hang verifier, node sources) and
checks nothing of it changed between its constructor's return and the wiring's.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ftagent"
ROOMS = ("agent", "cmd")  # where a Worker can be reached (tests/unit/test_layers.py)
# what a Worker holds by the piece: mutating one from outside is patching the worker
PART_LISTS = {"sources", "detectors", "observers", "line_handlers", "fault_hooks",
              "on_close", "extra_env"}
MUTATORS = {"append", "extend", "insert", "update", "add", "setdefault", "clear", "pop",
            "remove", "discard", "put_nowait"}
# Known, named exceptions, each with its reason. Not a Worker's attribute: the link
# protocol's own restart count (the `onedecider` lane makes the lifecycle its one owner).
# The arbiter decider adds its link's observer to its worker as it is built (inside the
# worker's constructor: the decider's attachment is the `onedecider` lane's to reshape).
ALLOWED = {("agent/reporter.py", "self.proto.restarts")}


def worker_attributes(root: Path) -> set[str]:
    """Every name a Worker has: its methods and properties, and what its methods set on
    ``self``."""
    tree = ast.parse((root / "agent" / "worker.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Worker")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(cls):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and _is_self(t.value):
                names.add(t.attr)
    return names


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [e for t in node.targets for e in _flatten(t)]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _flatten(t: ast.expr) -> list[ast.expr]:
    """``a.x, b.y = ...`` assigns both."""
    if isinstance(t, (ast.Tuple, ast.List)):
        return [e for x in t.elts for e in _flatten(x)]
    return [t]


def _is_self(e: ast.expr) -> bool:
    return isinstance(e, ast.Name) and e.id == "self"


def patches(root: Path) -> list[str]:
    """Where a module other than worker.py sets, deletes or mutates a Worker attribute
    (``self.attr`` is the module's own object's, not a worker's)."""
    names = worker_attributes(root)
    found = []
    for room in ROOMS:
        for path in sorted((root / room).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == "agent/worker.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                hits = [t for t in _targets(node)
                        if isinstance(t, ast.Attribute) and t.attr in names
                        and not _is_self(t.value)]
                if isinstance(node, ast.Call):
                    f = node.func
                    if (isinstance(f, ast.Name) and f.id == "setattr" and len(node.args) > 1
                            and isinstance(node.args[1], ast.Constant)
                            and node.args[1].value in names):
                        hits.append(node)
                    if (isinstance(f, ast.Attribute) and f.attr in MUTATORS
                            and isinstance(f.value, ast.Attribute)
                            and f.value.attr in PART_LISTS and not _is_self(f.value.value)):
                        hits.append(f)
                for h in hits:
                    text = ast.unparse(h)
                    if (rel, text) not in ALLOWED:
                        found.append(f"{rel}:{h.lineno}: {text}")
    return found


def test_no_module_but_worker_py_sets_a_worker_attribute() -> None:
    assert patches(PACKAGE) == []


def test_the_scan_sees_a_patch(tmp_path: Path) -> None:
    """The check can fail: the shapes the old wiring used are all caught."""
    (tmp_path / "agent").mkdir()
    (tmp_path / "cmd").mkdir()
    (tmp_path / "agent" / "worker.py").write_text((PACKAGE / "agent" / "worker.py").read_text())
    (tmp_path / "cmd" / "run.py").write_text(
        "def wire(agent, w, x):\n"
        "    agent.spawn_trainer = x\n"
        "    agent.evidence, w.trainer = x, x\n"
        "    setattr(agent, 'extra_env', {})\n"
        "    agent.extra_env.update(x)\n"
        "    w.detectors.append(x)\n"
        "    self.agent.on_close.append(x)\n")
    assert [p.split(": ", 1)[1] for p in patches(tmp_path)] == [
        "agent.spawn_trainer", "agent.evidence", "w.trainer",
        "setattr(agent, 'extra_env', {})", "agent.extra_env.update", "w.detectors.append",
        "self.agent.on_close.append"]


def test_a_worker_built_by_ftagent_run_is_not_changed_after_its_constructor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every part on; what the constructor left is what the wiring returns (the same
    objects, the same parts in the same order)."""
    from ftagent.agent.pod import PodAgent
    from ftagent.agent.worker import Worker, WorkerSpec
    from ftagent.cmd.run import build_agent, parse, pod_decider

    built: list[tuple[Worker, dict[str, Any]]] = []
    init = Worker.__init__

    def snapshot(self: Worker, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append((self, {k: list(v) if isinstance(v, list) else v
                             for k, v in vars(self).items()}))

    monkeypatch.setattr(Worker, "__init__", snapshot)
    cfg = parse(["--arbiter", "127.0.0.1:9", "--metrics-port", "-1", "--warm-restart",
                 "--max-restarts", "1", "--fr-buffer-size", "1000",
                 "--hang-verify-window", "1", "--", "python3", "train.py"], {})
    worker = build_agent(PodAgent(pod_decider(cfg)), WorkerSpec(cfg, {"PATH": "/usr/bin:/bin"}),
                         str(tmp_path))
    ((w, at_init),) = built
    assert w is worker
    now = vars(worker)
    assert set(now) == set(at_init)
    changed = [k for k, v in now.items()
               if (list(v) != at_init[k] if isinstance(v, list) else v is not at_init[k])]
    assert changed == []
    # and the parts are there: the wiring went through the constructor, not around it
    assert worker.spawn_trainer is not None and worker.evidence is not None
    # before each start: the warm standby's wait for the rendezvous store (store_wait.py;
    # a Python command: one a standby can become), then the flight recorder's attempt
    # directory, the last step before the spawn
    assert [h.__name__ for h in worker.before_start] == ["store_first", "attempt_directory"]
    assert "FTAGENT_SDK_SOCKET" in worker.extra_env
    assert any(k.startswith("TORCH_FR") or k.startswith("TORCH_NCCL")
               for k in worker.extra_env), worker.extra_env
    (own,) = worker.watch.parts
    assert {type(s).__name__ for s in own.sources()} == {"SdkSocketSource", "WatchLoop"}
    assert [type(d).__name__ for d in own.detectors()] == ["HangWatch", "LossDetector"]
    # the rank's arbiter session is found while the parts are built: a phase the hang
    # verifier learns reaches the link (the ledger's other_phases), not only the events file
    says = worker.decider.session(worker).link.trainer_says  # type: ignore[attr-defined]
    own.detectors()[0].verifier.learned(4.0, "evaluate (train.py:88)")
    assert says.phase_seconds(0.0) == (0.0, 4.0)
    for s in own.sources():  # the SDK socket bound by the wiring
        close = getattr(s, "close", None)
        if close is not None:
            close()
