"""Print the shape of recpipe's Python source: module, class and function sizes.

The house rules (docs/architecture.md, "Shape") are: a module at most 700 lines, a
class at most 400 lines, a function at most 80 lines. This script counts them with
``ast`` (a definition's span is ``lineno .. end_lineno``, decorators included) and
prints one table per kind, largest first, plus the line totals per package.

Usage::

    python scripts/code_shape.py            # the table, exit 0
    python scripts/code_shape.py --check    # exit 1 when a rule is broken
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES: tuple[str, ...] = ("pipeline", "planner", "recipes")
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80


@dataclass(frozen=True)
class Span:
    """One module, class or function and its length in lines."""

    kind: str
    name: str
    lines: int


def _spans(path: Path) -> list[Span]:
    text = path.read_text()
    rel = path.relative_to(ROOT).as_posix()
    spans = [Span("module", rel, len(text.splitlines()))]
    tree = ast.parse(text, filename=rel)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                length = child.end_lineno - start + 1
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                name = f"{prefix}{child.name}"
                spans.append(Span(kind, f"{rel}:{name}", length))
                visit(child, f"{name}.")

    visit(tree, "")
    return spans


def collect(packages: tuple[str, ...] = PACKAGES) -> list[Span]:
    """Every span of every ``.py`` file under ``packages`` (folders below ROOT)."""
    spans: list[Span] = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            spans.extend(_spans(path))
    return spans


def main(argv: list[str] | None = None) -> int:
    """Print the tables; with ``--check`` return 1 when a limit is exceeded."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when a limit is exceeded")
    parser.add_argument("--top", type=int, default=5, help="rows per table (default 5)")
    args = parser.parse_args(argv)
    spans = collect()
    limits = {"module": MAX_MODULE_LINES, "class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}
    broken = 0
    for kind, limit in limits.items():
        rows = sorted((s for s in spans if s.kind == kind), key=lambda s: -s.lines)
        over = [s for s in rows if s.lines > limit]
        broken += len(over)
        print(f"| largest {kind}s (limit {limit} lines; {len(over)} over) | lines |")
        print("|---|---|")
        for span in rows[: max(args.top, len(over))]:
            print(f"| {span.name} | {span.lines} |")
        print()
    print("| package | Python lines |")
    print("|---|---|")
    total = 0
    for package in PACKAGES:
        n = sum(s.lines for s in spans if s.kind == "module" and s.name.startswith(f"{package}/"))
        total += n
        print(f"| {package}/ | {n} |")
    print(f"| total | {total} |")
    return 1 if args.check and broken else 0


if __name__ == "__main__":
    sys.exit(main())
