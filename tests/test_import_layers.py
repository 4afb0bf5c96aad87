"""Dependencies between turbollm's packages run one way (docs/ARCHITECTURE.md); checked from the source.

Every module under ``turbollm/`` is parsed with `ast`; nothing is imported. Each ``import`` and
``from ... import`` counts wherever it sits: a function-level import runs when the function does,
so it is a dependency all the same. Relative imports are resolved, and
``importlib.import_module("turbollm....")`` with a literal name counts too. Only imports under
``if TYPE_CHECKING:`` are left out (they never run). A *node* is a first-level subpackage of
``turbollm`` (``layers``, ``quantize``, ...) or a top-level module (``config``, ``errors``,
``__main__``, ...); imports inside one node are not edges.

- The offline tools (`OFFLINE`: quantizers, evaluation, benchmarks, the planner, the ablation, the CLI) are
  imported only by each other and by ``__main__``: nothing on the serving path reaches them, directly or
  through another package.
- The package graph has no cycle. None is allowed: the last ones were broken by moving the shared
  piece down (GGML block encoders and int bit packing to ``formats/``, ``copy_checked`` to
  ``quantization/qtensor.py``) or by handing the object in (the int8 method's equalization gets
  the decoder's branches from the model it is given, ``CausalLM.residual_branches``, instead of
  importing ``models``).
- The engine's folders along the process boundary import one way: ``engine/`` (the front door:
  LLMEngine, output processing, detokenizing), ``core/`` (the scheduler side: scheduler,
  sequences, block pool, KV manager, KV policies and eviction, KV sizing), ``handoff/`` (the
  contract both sides import: scheduler and runner outputs, KV specs and configs), ``executor/``
  and ``worker/`` (worker, model runner, fused step, pipeline stage, KV rings, sampler). The
  scheduler side never imports the worker side, the executors or the front door; the worker side
  and the executors never import the scheduler side or the front door; the contract imports none
  of them (the last edge against it, the draft runner sizing its K/V with the scheduler side's
  arithmetic, now gets the sized config handed in); ``kv_transfer/`` (the block store's files, which the
  two halves of a KV connector share) imports none of them either.
- No module cycle either (inside a package too; the last two were broken by moving the shared piece:
  the lookup groups into ``tensor_parallel``, the benchmarks' workload into ``cli/bench_workload.py``).
Failures name the import lines that make the violating edge.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "turbollm"
#: offline tools: never imported by the serving path
OFFLINE = frozenset({"quantize", "eval", "benchmarks", "cli", "planner", "ablation"})
#: launchers allowed to import the offline tools (``python -m turbollm`` runs the CLI)
ENTRY = frozenset({"__main__"})
#: named in the rule; checked to exist so that a rename cannot leave the test checking nothing
SERVING_PATH = ("layers", "quantization", "kernels", "models", "loader", "engine", "core", "handoff", "kv_transfer",
                "executor", "worker", "attention", "formats", "tokenizer", "server", "entrypoints")


#: the engine's folders, and (importer, imported) pairs that break the one-way rule between them
SIDES = ("engine", "core", "handoff", "kv_transfer", "executor", "worker")
FORBIDDEN_SIDE_EDGES = frozenset({("core", "worker"), ("core", "executor"), ("core", "engine"),
                                  ("worker", "core"), ("worker", "engine"), ("executor", "core"),
                                  ("executor", "engine"), ("handoff", "core"), ("handoff", "worker"),
                                  ("handoff", "executor"), ("handoff", "engine"),
                                  # the block store's files: what both halves of a KV connector read and write
                                  ("kv_transfer", "core"), ("kv_transfer", "worker"), ("kv_transfer", "executor"),
                                  ("kv_transfer", "engine")})


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module, dotted (a name imported from a module counts as the module)
    where: str  # "turbollm/layers/embedding.py:56"

    def __str__(self) -> str:
        return f"{self.where} imports {self.target}"


def _module_name(path: Path, pkg: Path) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str, pkg: Path) -> bool:
    p = pkg.parent.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, where: str, pkg: Path):
        self.module, self.is_package, self.where, self.pkg = module, is_package, where, pkg
        self.found: list[Import] = []

    def _add(self, target: str, node: ast.AST) -> None:
        if target == self.pkg.name or target.startswith(self.pkg.name + "."):
            self.found.append(Import(self.module, target, f"{self.where}:{node.lineno}"))

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        targets = []
        for alias in node.names:  # `from pkg import submodule` imports the submodule
            sub = f"{origin}.{alias.name}"
            target = sub if _is_module(sub, self.pkg) else origin
            if target not in targets:
                targets.append(target)
        for target in targets:
            self._add(target, node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(node.args[0].value, node)
        self.generic_visit(node)


def module_imports(pkg: Path) -> list[Import]:
    """Every import of a module of `pkg` (by name) in the source of `pkg`, in file order."""
    found: list[Import] = []
    for path in sorted(pkg.rglob("*.py")):
        visitor = _ImportVisitor(_module_name(path, pkg), path.name == "__init__.py",
                                 path.relative_to(pkg.parent).as_posix(), pkg)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        found += visitor.found
    return found


def node_of(module: str) -> str:
    """The graph node of a dotted module name: its first-level part under the package (the
    package's own ``__init__`` is the node named after the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(pkg: Path) -> tuple[set[str], dict[str, dict[str, list[Import]]]]:
    """(every node, source node → target node → the imports that make the edge)."""
    nodes = {node_of(_module_name(p, pkg)) for p in pkg.rglob("*.py")}
    edges: dict[str, dict[str, list[Import]]] = {}
    for imp in module_imports(pkg):
        a, b = node_of(imp.source), node_of(imp.target)
        if a != b:
            edges.setdefault(a, {}).setdefault(b, []).append(imp)
    return nodes, edges


def shortest_path(edges: dict[str, dict[str, list[Import]]], start: str, goals: set[str]) -> list[str] | None:
    """The shortest node path from `start` (excluded as a goal at length 0) to any of `goals`."""
    prev: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        a = queue.popleft()
        for b in sorted(edges.get(a, {})):
            if b in goals:
                path = [b, a]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return path[::-1]
            if b not in prev:
                prev[b] = a
                queue.append(b)
    return None


def strongly_connected(nodes: set[str], edges: dict[str, dict[str, list[Import]]]) -> list[set[str]]:
    """The strongly connected components of more than one node (each holds a cycle through all its nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(nodes | set(edges)):
        if v not in index:
            visit(v)
    return components


def find_cycles(nodes: set[str], edges: dict[str, dict[str, list[Import]]]) -> list[tuple[list[str], set[str]]]:
    """Per strongly connected component of more than one node: one shortest cycle through it
    (``[a, b, ..., a]``, from its first node by name) and the component."""
    found = []
    for comp in strongly_connected(nodes, edges):
        inside = {a: {b: e for b, e in edges.get(a, {}).items() if b in comp} for a in comp}
        start = min(comp)
        found.append((shortest_path(inside, start, {start}), comp))
    return found


def describe(path: list[str], edges: dict[str, dict[str, list[Import]]]) -> str:
    """`path` as ``a -> b -> c`` and, per edge, the import lines that make it."""
    lines = [" -> ".join(path)]
    for a, b in zip(path, path[1:]):
        imps = edges[a][b]
        more = f" (and {len(imps) - 3} more)" if len(imps) > 3 else ""
        lines.append(f"    {a} -> {b}: " + "; ".join(map(str, imps[:3])) + more)
    return "\n".join(lines)


@pytest.fixture(scope="module")
def graph():
    return package_graph(PACKAGE)


def test_the_serving_path_never_reaches_the_offline_tools(graph):
    nodes, edges = graph
    assert set(SERVING_PATH) <= nodes, f"packages named in the rule are gone: {sorted(set(SERVING_PATH) - nodes)}"
    assert OFFLINE <= nodes, f"offline packages named in the rule are gone: {sorted(OFFLINE - nodes)}"
    serving = nodes - OFFLINE - ENTRY
    # a path from the serving path into the tools enters them by an edge from a serving package
    bad = []
    for a in sorted(serving):
        for b in sorted(set(edges.get(a, {})) & (OFFLINE | ENTRY)):
            users = sorted(s for s in serving - {a} if shortest_path(edges, s, {a}) is not None)
            bad.append(describe([a, b], edges) + f"\n    (every package importing {a}, directly or not, loads {b} "
                       f"with it: {', '.join(users) or 'none'})")
    assert not bad, (f"the serving path imports offline tools ({', '.join(sorted(OFFLINE))}); move what it needs "
                     "down into a runtime package and let the tool import it from there:\n" + "\n".join(bad))


def test_no_import_cycle_between_packages(graph):
    nodes, edges = graph
    report = [describe(cycle, edges) + (f"\n    (one cycle of several among: {', '.join(sorted(comp))})"
                                        if len(comp) > len(cycle) - 1 else "")
              for cycle, comp in find_cycles(nodes, edges)]
    assert not report, ("import cycles between turbollm's packages (break each: move the shared piece into the "
                        "lower package, or hand the object in instead of importing its package):\n"
                        + "\n".join(report))


def test_the_scanner_sees_lazy_relative_and_dynamic_imports(tmp_path):
    pkg = tmp_path / "fakepkg"
    files = {
        "__init__.py": "",
        "a/__init__.py": "from fakepkg.b import helper\n",
        "a/x.py": "",
        "b/__init__.py": "",
        "b/helper.py": "def f():\n    from ..c import thing\n    return thing\n",
        "c.py": ("from typing import TYPE_CHECKING\nimport importlib\nif TYPE_CHECKING:\n    from fakepkg import d\n"
                 "thing = 1\n\ndef g():\n    return importlib.import_module('fakepkg.a.x')\n"),
        "d.py": "import fakepkg\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    nodes, edges = package_graph(pkg)
    assert nodes == {"fakepkg", "a", "b", "c", "d"}
    assert {a: sorted(bs) for a, bs in edges.items()} == {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["fakepkg"]}
    assert [str(i) for i in edges["b"]["c"]] == ["fakepkg/b/helper.py:2 imports fakepkg.c"]
    cycles = find_cycles(nodes, edges)
    assert cycles == [(["a", "b", "c", "a"], {"a", "b", "c"})]
    text = describe(cycles[0][0], edges)
    assert text.startswith("a -> b -> c -> a\n")
    assert "c -> a: fakepkg/c.py:8 imports fakepkg.a.x" in text
    assert shortest_path(edges, "d", {"c"}) is None and shortest_path(edges, "a", {"c"}) == ["a", "b", "c"]


def side_violations(imports: list[Import]) -> dict[tuple[str, str], list[Import]]:
    """(importing module, imported module) → the import lines, for every edge against FORBIDDEN_SIDE_EDGES."""
    out: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        if (node_of(imp.source), node_of(imp.target)) in FORBIDDEN_SIDE_EDGES:
            out.setdefault((imp.source, imp.target), []).append(imp)
    return out


def test_the_engine_sides_import_one_way():
    for side in SIDES:
        assert (PACKAGE / side / "__init__.py").is_file(), f"the {side}/ folder is gone"
    found = side_violations(module_imports(PACKAGE))
    bad = [f"{a} -> {b}: " + "; ".join(map(str, imps)) for (a, b), imps in sorted(found.items())]
    assert not bad, "imports against the one-way rule between the engine's folders:\n" + "\n".join(bad)


def test_no_module_cycle():
    imports = module_imports(PACKAGE)
    mods = {imp.source for imp in imports} | {imp.target for imp in imports}
    edges: dict[str, dict[str, list[Import]]] = {}
    for imp in imports:
        if imp.source != imp.target:
            edges.setdefault(imp.source, {}).setdefault(imp.target, []).append(imp)
    bad = [describe(cycle, edges) for cycle, _ in find_cycles(mods, edges)]
    assert not bad, "import cycles between modules (lazy imports included):\n" + "\n".join(bad)


def test_the_side_rule_can_fail(tmp_path):
    """A scheduler-side module importing the worker side lazily, and a contract module importing the scheduler
    side, are both caught, with their lines."""
    pkg = tmp_path / "turbollm"
    files = {"__init__.py": "", "core/__init__.py": "", "worker/__init__.py": "", "handoff/__init__.py": "",
             "core/sched.py": "def f():\n    from turbollm.worker.sampler import Sampler\n    return Sampler\n",
             "worker/sampler.py": "from turbollm.handoff import out\nSampler = 1\n",
             "handoff/out.py": "from turbollm.core import sched\n"}
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    found = side_violations(module_imports(pkg))
    assert {k: [str(i) for i in v] for k, v in found.items()} == {
        ("turbollm.core.sched", "turbollm.worker.sampler"): ["turbollm/core/sched.py:2 imports turbollm.worker.sampler"],
        ("turbollm.handoff.out", "turbollm.core.sched"): ["turbollm/handoff/out.py:1 imports turbollm.core.sched"]}
