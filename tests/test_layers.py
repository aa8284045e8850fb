"""Import layers of the sources (ARCHITECTURE.md "Layers"), checked statically with ``ast``.

recipes/ -> planner/ -> pipeline/ -> recpipe._C: imports point downward only, and
there is no import cycle among recpipe modules, not even through an import
inside a function (a lazy import hides a cycle from Python, not from this test).

The graph has one node per source module of pipeline/, planner/ and recipes/ and
an edge for every ``import`` / ``from ... import`` naming another recpipe module,
wherever it appears (module level, functions, ``if TYPE_CHECKING`` blocks). The
implicit import of a package's ``__init__`` when one of its submodules is imported
is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterable, List, Set

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("pipeline", "planner", "recipes")



def module_name(folder: str, path: Path) -> str:
    """``recpipe.<folder>.<dotted path>`` of a source file (a package for ``__init__.py``)."""
    rel = path.relative_to(REPO / folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["recpipe", folder, *parts])


def source_modules() -> Dict[str, Path]:
    """Every source module of pipeline/, planner/ and recipes/ by import name."""
    out: Dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            out[module_name(folder, path)] = path
    return out


def imported_names(module: str, source: str, is_package: bool) -> Set[str]:
    """Every dotted name ``source`` imports, anywhere in the file.

    ``from X import Y`` yields ``X`` and ``X.Y`` (Y may be a submodule);
    relative imports are resolved against ``module``.
    """
    names: Set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def import_graph(sources: Dict[str, str], packages: Iterable[str]) -> Dict[str, Set[str]]:
    """Module -> the recpipe modules (of ``sources``) it imports.

    Args:
        sources: module name -> source text.
        packages: the names in ``sources`` that are packages (``__init__.py``).
    """
    pkgs = set(packages)
    graph: Dict[str, Set[str]] = {}
    for module, text in sources.items():
        names = imported_names(module, text, module in pkgs)
        graph[module] = {n for n in names if n in sources}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[Set[str]]:
    """The strongly connected components with a cycle (Tarjan), each as a set of modules."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[Set[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth <= number of modules (~60)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: Set[str] = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _repo_graph() -> Dict[str, Set[str]]:
    mods = source_modules()
    sources = {m: p.read_text() for m, p in mods.items()}
    return import_graph(sources, [m for m, p in mods.items() if p.name == "__init__.py"])


def _all_imports() -> Dict[str, Set[str]]:
    mods = source_modules()
    return {m: imported_names(m, p.read_text(), p.name == "__init__.py") for m, p in mods.items()}


def _violations(prefix: str, forbidden: Iterable[str]) -> Dict[str, List[str]]:
    bad: Dict[str, List[str]] = {}
    for module, names in _all_imports().items():
        if not module.startswith(prefix):
            continue
        hits = sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))
        if hits:
            bad[module] = hits
    return bad


def test_sources_are_found() -> None:
    mods = source_modules()
    assert "recpipe.pipeline.placement" in mods and "recpipe.planner.types" in mods
    assert "recpipe.recipes.build" in mods and "recpipe.planner" in mods


def test_pipeline_imports_neither_planner_nor_recipes() -> None:
    assert _violations("recpipe.pipeline", ("recpipe.planner", "recpipe.recipes")) == {}


def test_planner_does_not_import_recipes() -> None:
    assert _violations("recpipe.planner", ("recpipe.recipes",)) == {}


def test_placement_contract_is_a_bottom_module() -> None:
    # it may use the routing module's constants, rows-per-rank rule and int argument check, and
    # nothing else of recpipe
    names = _all_imports()["recpipe.pipeline.placement"]
    assert {n for n in names if n.startswith("recpipe")} <= {
        "recpipe.pipeline.routing.ops", "recpipe.pipeline.routing.ops.DIST_TYPES", "recpipe.pipeline.routing.ops.local_rows",
        "recpipe.pipeline.routing.ops.check_int"}


def test_no_import_cycles_among_recpipe_modules() -> None:
    found = [sorted(c) for c in cycles(_repo_graph())]
    assert found == [], f"import cycles (imports inside functions included): {found}"


def test_checker_sees_cycles_through_function_imports_and_relative_imports() -> None:
    sources = {
        "recpipe.pipeline.a": "from recpipe.pipeline import b\n",
        "recpipe.pipeline.b": "def f():\n    from .c import g\n    return g\n",
        "recpipe.pipeline.c": "import torch\n\nclass K:\n    def m(self):\n        import recpipe.pipeline.a\n",
        "recpipe.pipeline.d": "from recpipe.pipeline.a import x\n",
        "recpipe.pipeline": "",
    }
    graph = import_graph(sources, ["recpipe.pipeline"])
    assert graph["recpipe.pipeline.b"] == {"recpipe.pipeline.c"}
    assert graph["recpipe.pipeline.d"] == {"recpipe.pipeline.a"}
    assert cycles(graph) == [{"recpipe.pipeline.a", "recpipe.pipeline.b", "recpipe.pipeline.c"}]
    assert cycles({"x": {"x"}}) == [{"x"}] and cycles({"x": {"y"}, "y": set()}) == []
