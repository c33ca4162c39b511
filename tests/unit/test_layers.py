"""The package's imports run one way: no cycles, no arrow against the layer table.

Reads every module of ``ftagent`` with ``ast`` (never imports it), collects the imports at
module level *and* inside functions (a function-level import is real at run time: it only
runs later) *and* under ``if TYPE_CHECKING:``. Those last never run, but the dependency
they draw is real to a reader and to the type checker: two modules that name each other's
types cannot be read, changed or tested apart (issue 36 found decider.py and worker.py
importing each other that way). So no cycle of any kind, and every arrow is checked
against the table.

The layer table is the one in docs/architecture.md ("Layers"); keep the two in step.
Arrows nobody could fix yet are listed in ``ALLOWED`` with the reason: the test fails on
any arrow that is not there, and on an ``ALLOWED`` entry that no longer exists (so the list
only shrinks).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ftagent"

# Groups of modules, by name: a module is in a group when its name equals one of the
# entries or starts with an entry followed by a dot. A module can be in several groups
# (agent/reporter.py is in the agent room and is a sink).
GROUPS: dict[str, tuple[str, ...]] = {
    "bottom": ("ftagent.model", "ftagent.config", "ftagent.wire", "ftagent.timegrid",
               "ftagent.waits", "ftagent.v1", "ftagent.xid"),
    "detect": ("ftagent.detect",),
    "sources": ("ftagent.sources",),
    "sinks": ("ftagent.metrics", "ftagent.agent.metrics_sink", "ftagent.agent.reporter",
              "ftagent.agent.events"),
    "agent": ("ftagent.agent",),
    "arbiter": ("ftagent.arbiter",),
    "kube": ("ftagent.kube",),
    "node": ("ftagent.node",),
    "watch": ("ftagent.watch",),
    "cmd": ("ftagent.cmd", "ftagent.cli", "ftagent.__main__"),
}

# The rules: (group, "only" or "never", target groups). "only": a module of the group
# imports nothing of ftagent outside the targets (and its own group). "never": it imports
# nothing in the targets. Mirrors the table in docs/architecture.md.
RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("bottom", "only", ()),
    ("detect", "only", ("bottom",)),
    ("sources", "never", ("sinks", "detect", "watch")),
    ("arbiter", "never", ("agent", "kube", "node")),
    ("kube", "never", ("agent", "node")),
    ("watch", "never", ("agent", "node", "kube", "arbiter")),
)
# And for every module: only cmd/ (with cli.py) imports cmd/.

# Arrows against the table that stay for now, each with its reason (issue 23 tracks them).
# Keys: (importer, imported). The test fails when one of these disappears: delete it then.
ALLOWED: dict[tuple[str, str], str] = {}

# Cycles that stay for now, as sorted tuples of the modules in one strongly connected
# component, with the reason (none today: keep it that way).
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    type_checking: bool
    function_level: bool


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom,
             modules: dict[str, Path]) -> list[str]:
    base = node.module or ""
    if node.level:
        parts = importer.split(".")
        if not is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    found = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.append(sub if sub in modules else base)
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    edges: list[Edge] = []

    def visit(node: ast.AST, type_checking: bool, in_function: bool) -> None:
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = _resolve(name, is_package, node, modules)
        for target in targets:
            if target.split(".")[0] == "ftagent" and target != name:
                # "import ftagent.a.b" names ftagent.a.b; keep the longest known module.
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                edges.append(Edge(name, target, getattr(node, "lineno", 0), type_checking,
                                  in_function))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True, in_function)
            for child in node.orelse:
                visit(child, type_checking, in_function)
            return
        function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking, in_function or function)

    visit(tree, False, False)
    return edges


def all_edges() -> list[Edge]:
    modules = all_modules()
    return [e for name, path in modules.items() for e in imports_of(name, path, modules)]


def groups_of(module: str) -> set[str]:
    return {group for group, names in GROUPS.items()
            if any(module == n or module.startswith(n + ".") for n in names)}


def violations(edges: list[Edge]) -> dict[tuple[str, str], str]:
    """Every (importer, imported) arrow against RULES, with the rule it breaks."""
    found: dict[tuple[str, str], str] = {}
    for edge in edges:
        mine, theirs = groups_of(edge.importer), groups_of(edge.imported)
        for group, kind, targets in RULES:
            if group not in mine:
                continue
            if kind == "only":
                allowed = set(targets) | {group}
                bad = not theirs or not theirs <= allowed
            else:
                bad = bool(theirs & set(targets))
            if bad:
                found.setdefault((edge.importer, edge.imported),
                                 f"{group} {kind} {targets or '(itself)'}")
        if "cmd" in theirs and "cmd" not in mine:
            found.setdefault((edge.importer, edge.imported), "only cmd imports cmd")
    return found


def runtime_cycles(edges: list[Edge], *, type_checking: bool = True) -> list[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan, iterative); with
    ``type_checking`` False, of the imports that run only."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if type_checking or not edge.type_checking:
            graph.setdefault(edge.importer, set()).add(edge.imported)
            graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[tuple[str, ...]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        result.append(tuple(sorted(component)))
    return sorted(result)


def _describe(edges: list[Edge], pairs: list[tuple[str, str]]) -> str:
    lines = []
    for importer, imported in pairs:
        where = [e for e in edges if (e.importer, e.imported) == (importer, imported)]
        kinds = ", ".join(sorted({
            f"line {e.line}" + (" TYPE_CHECKING" if e.type_checking else "")
            + (" in a function" if e.function_level else "") for e in where}))
        lines.append(f"  {importer} -> {imported} ({kinds})")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def package_edges() -> tuple[Edge, ...]:
    """The package's import arrows, parsed once for the three tests that judge them (each
    parsed every module of ftagent/ again: about 2 s a test). Frozen edges in a tuple:
    no test can change what the next one reads."""
    return tuple(all_edges())


def test_the_package_is_read(package_edges: tuple[Edge, ...]) -> None:
    edges = list(package_edges)
    assert edges, "no imports found: is PACKAGE right?"
    assert {"ftagent.model", "ftagent.config", "ftagent.cli"} <= set(all_modules())


def test_no_arrow_against_the_layer_table(package_edges: tuple[Edge, ...]) -> None:
    edges = list(package_edges)
    found = violations(edges)
    new = sorted(set(found) - set(ALLOWED))
    assert not new, ("imports against the layer table (docs/architecture.md, Layers):\n"
                     + _describe(edges, new) + "\nrules broken: "
                     + "; ".join(sorted({found[p] for p in new})))
    gone = sorted(set(ALLOWED) - set(found))
    assert not gone, f"fixed, delete from ALLOWED: {gone}"


def test_no_import_cycle_of_any_kind(package_edges: tuple[Edge, ...]) -> None:
    edges = list(package_edges)
    cycles = runtime_cycles(edges)
    new = [c for c in cycles if c not in ALLOWED_CYCLES]
    assert not new, "import cycles (function-level and TYPE_CHECKING imports count):\n" + \
        "\n".join(
        "  " + " <-> ".join(c) + "\n" + _describe(edges, sorted(
            (e.importer, e.imported) for e in {(x.importer, x.imported): x
                                               for x in edges}.values()
            if e.importer in c and e.imported in c))
        for c in new)
    gone = [c for c in ALLOWED_CYCLES if c not in cycles]
    assert not gone, f"fixed, delete from ALLOWED_CYCLES: {gone}"


# The checker itself must be able to fail: each case is a tiny package it has to judge.
@pytest.mark.parametrize(("importer", "imported", "bad"), [
    ("ftagent.model", "ftagent.metrics", True),
    ("ftagent.wire.limits", "ftagent.model", False),
    ("ftagent.detect.hang", "ftagent.sources.progress", True),
    ("ftagent.detect.hang", "ftagent.model", False),
    ("ftagent.sources.sdk_socket", "ftagent.metrics", True),
    ("ftagent.sources.gpu", "ftagent.detect.gpu", True),
    ("ftagent.sources.gpu_sim", "ftagent.detect.gpu", True),
    ("ftagent.sources.gpu_sim", "ftagent.xid", False),
    ("ftagent.xid", "ftagent.detect.gpu", True),
    ("ftagent.arbiter.cli", "ftagent.kube.client", True),
    ("ftagent.arbiter.server", "ftagent.agent.reporter", True),
    ("ftagent.kube.client", "ftagent.node.agent", True),
    ("ftagent.agent.worker", "ftagent.cmd.run", True),
    ("ftagent.watch.gpu", "ftagent.agent.supervisor", True),
    ("ftagent.watch.loop", "ftagent.node.agent", True),
    ("ftagent.watch.gpu", "ftagent.detect.gpu", False),
    ("ftagent.watch.nic", "ftagent.metrics", False),
    ("ftagent.node.agent", "ftagent.watch.loop", False),
    ("ftagent.sources.gpu", "ftagent.watch.loop", True),
    ("ftagent.cmd.arbiter", "ftagent.kube.client", False),
    ("ftagent.cli", "ftagent.cmd.run", False),
    ("ftagent.demo", "ftagent.cmd.arbiter", True),
])
def test_rules_judge_arrows(importer: str, imported: str, bad: bool) -> None:
    edge = Edge(importer, imported, 1, False, False)
    assert bool(violations([edge])) is bad


def test_cycle_finder_sees_function_level_and_type_checking() -> None:
    a_b = Edge("ftagent.a", "ftagent.b", 1, False, False)
    b_a_late = Edge("ftagent.b", "ftagent.a", 9, False, True)
    b_a_typing = Edge("ftagent.b", "ftagent.a", 3, True, False)
    assert runtime_cycles([a_b, b_a_late]) == [("ftagent.a", "ftagent.b")]
    assert runtime_cycles([a_b, b_a_typing]) == [("ftagent.a", "ftagent.b")]
    assert runtime_cycles([a_b, b_a_typing], type_checking=False) == []


def test_parser_finds_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import ftagent.model\n"
        "if TYPE_CHECKING:\n"
        "    from ftagent.agent import worker\n"
        "def late():\n"
        "    from ftagent import metrics\n",
        encoding="utf-8")
    modules = all_modules()
    edges = imports_of("ftagent.probe", source, modules)
    assert [(e.imported, e.type_checking, e.function_level) for e in edges] == [
        ("ftagent.model", False, False),
        ("ftagent.agent.worker", True, False),
        ("ftagent.metrics", False, True),
    ]
