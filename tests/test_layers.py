"""Import layers of the sources (docs/architecture.md "Layers"), checked statically with ``ast``.

recipes/ -> planner/ -> pipeline/ -> recpipe._C: imports point downward only. Inside
pipeline/, placement (the plan -> runtime contract) is the bottom and imports nothing of
recpipe; types (the extension points) sits on it; routing, tiered, checkpoint and train
import only the layers below them (PIPELINE_LAYERS). A private name (``_x``) is never
imported from another layer, and there is no import cycle among recpipe modules, not even
through an import inside a function (a lazy import hides a cycle from Python, not from
this test).

The graph has one node per source module of pipeline/, planner/ and recipes/ and
an edge for every ``import`` / ``from ... import`` naming another recpipe module,
wherever it appears (module level, functions, ``if TYPE_CHECKING`` blocks). The
implicit import of a package's ``__init__`` when one of its submodules is imported
is not an edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Set, Tuple

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
    """Modules under ``prefix`` importing a name under any of ``forbidden``."""
    bad: Dict[str, List[str]] = {}
    for module, names in _all_imports().items():
        if not (module == prefix or module.startswith(prefix + ".")):
            continue
        hits = sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))
        if hits:
            bad[module] = hits
    return bad


def _outside(prefix: str, allowed: Iterable[str]) -> Dict[str, List[str]]:
    """recpipe names imported by modules under ``prefix`` that lie outside ``allowed`` (and ``prefix``)."""
    allow = (prefix, *allowed)
    bad: Dict[str, List[str]] = {}
    for module, names in _all_imports().items():
        if not (module == prefix or module.startswith(prefix + ".")):
            continue
        hits = sorted(
            n
            for n in names
            if n.startswith("recpipe")
            and n not in ("recpipe", "recpipe.pipeline")
            and not any(n == a or n.startswith(a + ".") for a in allow)
        )
        if hits:
            bad[module] = hits
    return bad


#: Each part of ``recpipe.pipeline`` and what it may import besides itself (ARCHITECTURE.md, "Layers").
PIPELINE_LAYERS: Dict[str, Tuple[str, ...]] = {
    "recpipe.pipeline.placement": (),
    "recpipe.pipeline.interfaces": ("recpipe.pipeline.placement",),
    "recpipe.pipeline.routing": ("recpipe.pipeline.placement", "recpipe.pipeline.interfaces", "recpipe._C"),
    "recpipe.pipeline.tiered": (
        "recpipe.pipeline.placement",
        "recpipe.pipeline.interfaces",
        "recpipe.pipeline.routing",
        "recpipe._C",
    ),
    "recpipe.pipeline.checkpoint": (
        "recpipe.pipeline.placement",
        "recpipe.pipeline.interfaces",
        "recpipe.pipeline.routing",
        "recpipe.pipeline.tiered",
    ),
    "recpipe.pipeline.train_pipeline": (
        "recpipe.pipeline.placement",
        "recpipe.pipeline.interfaces",
        "recpipe.pipeline.routing",
        "recpipe.pipeline.tiered",
    ),
}


def _layer_of(module: str) -> str:
    """The layer a module belongs to: a ``recpipe.pipeline`` part, else its top-level package."""
    for layer in PIPELINE_LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    return (
        ".".join(module.split(".")[:3]) if module.startswith("recpipe.pipeline.") else ".".join(module.split(".")[:2])
    )


def _private_part(name: str) -> bool:
    """Whether a dotted name has a private part (``_x``; ``recpipe._C`` and dunders excepted)."""
    return any(p.startswith("_") and not p.startswith("__") and p != "_C" for p in name.split("."))


def test_sources_are_found() -> None:
    mods = source_modules()
    assert "recpipe.pipeline.placement" in mods and "recpipe.planner.types" in mods
    assert "recpipe.recipes.build" in mods and "recpipe.planner" in mods
    for layer in PIPELINE_LAYERS:
        if layer != "recpipe.pipeline.interfaces" or layer in mods:
            assert layer in mods, layer


def test_pipeline_imports_neither_planner_nor_recipes() -> None:
    assert _violations("recpipe.pipeline", ("recpipe.planner", "recpipe.recipes")) == {}


def test_planner_imports_only_the_placement_contract_of_the_runtime() -> None:
    """The planner reads the plan -> runtime contract, never the runtime's modules or recipes."""
    assert _outside("recpipe.planner", ("recpipe.pipeline.placement", "recpipe._C")) == {}


def test_each_pipeline_layer_imports_only_the_layers_below_it() -> None:
    bad = {layer: _outside(layer, allowed) for layer, allowed in PIPELINE_LAYERS.items()}
    assert {k: v for k, v in bad.items() if v} == {}


def test_placement_contract_loads_without_the_extension() -> None:
    """The planner reads the contract without loading the compiled kernels."""
    code = (
        "import sys, recpipe.pipeline.placement; "
        "assert 'recpipe._C' not in sys.modules, sorted(m for m in sys.modules if m.startswith('recpipe'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_private_name_is_imported_across_layers() -> None:
    bad: Dict[str, List[str]] = {}
    for module, names in _all_imports().items():
        hits = sorted(
            n for n in names if n.startswith("recpipe.") and _private_part(n) and _layer_of(n) != _layer_of(module)
        )
        if hits:
            bad[module] = hits
    assert bad == {}


def test_layer_checks_see_a_private_import_and_an_upward_import() -> None:
    assert _private_part("recpipe.pipeline.tiered.shard._helper")
    assert _private_part("recpipe.pipeline._old")
    assert not _private_part("recpipe._C") and not _private_part("recpipe.pipeline.__init__")
    assert _layer_of("recpipe.pipeline.routing.ops") == "recpipe.pipeline.routing"
    assert _layer_of("recpipe.planner.types") == "recpipe.planner"
    assert _layer_of("recpipe.recipes.data.base") == "recpipe.recipes"


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


#: The packages under tests/ that hold test files (tests/ is on sys.path).
TEST_PACKAGES = ("csrc", "pipeline", "planner", "recipes")


def _test_modules_imported(source: str) -> List[str]:
    """The ``test_*`` modules (tests/ is on sys.path; test folders are packages) that ``source``
    imports, absolutely or relatively, anywhere in the file."""
    found: List[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = f"{node.module}." if node.module else ""
            names = [prefix + alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0].startswith("test_") or (
                parts[0] in TEST_PACKAGES and any(p.startswith("test_") for p in parts)
            ):
                found.append(name)
    return found


def test_no_test_file_imports_another_test_file() -> None:
    """Pins that shared test helpers live in ``tests/harness/`` (pipelines.py,
    tiered_ebc_models.py, ...), never in a test file: no tests/**/test_*.py imports a
    ``test_*`` module, so each test file runs, moves or is renamed on its own."""
    files = sorted((REPO / "tests").rglob("test_*.py"))
    assert len(files) > 40
    bad = {p.name: hits for p in files if (hits := _test_modules_imported(p.read_text()))}
    assert bad == {}
    sample = (
        "import test_a as a\nfrom test_b import x\ndef f():\n    from . import test_c\n"
        "from torch.testing import y\nfrom torchrec.distributed.test_utils import test_model\n"
    )
    assert _test_modules_imported(sample) == ["test_a", "test_b.x", "test_c"]
    assert _test_modules_imported("from pipeline.tiered import test_x\n") == ["pipeline.tiered.test_x"]
