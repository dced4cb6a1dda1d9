"""The code's sizes against the house limits: classes' methods, functions' lines, modules' lines,
modules per folder, constructors' parameters, import circles. Read from the source with ``ast``;
nothing is imported or run.

    python scripts/house.py            # the figures, the largest of each first
    python scripts/house.py --check    # exit 1 naming each thing past a limit (tests/test_house.py)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("recsys", "embeddings", "recovery", "data")
MAX_METHODS = 25
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 800
MAX_RECOVERY_LINES = 450  # recovery modules, as set before
MAX_FOLDER_MODULES = 15  # modules at one folder's top (its __init__ aside)
MAX_INIT_PARAMS = 8  # a constructor's parameters, self aside


def modules(root: Path = ROOT) -> list[Path]:
    found = [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))]
    return found + sorted((root / "scripts").glob("*.py"))


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    return len([n for n in names if n.arg not in ("self", "cls")])


def figures(root: Path = ROOT) -> dict[str, list[tuple]]:
    """-> {what: [(size, where), ...] largest first}"""
    methods, functions, lines, inits = [], [], [], []
    folders: dict[str, int] = {}
    for path in modules(root):
        rel = str(path.relative_to(root))
        text = path.read_text()
        tree = ast.parse(text, rel)
        lines.append((len(text.splitlines()), rel))
        if path.name != "__init__.py" and path.parent != root / "scripts":
            key = str(path.parent.relative_to(root))
            folders[key] = folders.get(key, 0) + 1
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                defs = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                methods.append((len(defs), f"{rel}:{node.name}"))
                for d in defs:
                    if d.name == "__init__":
                        inits.append((_params(d), f"{rel}:{node.name}.__init__"))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                end = node.end_lineno or node.lineno
                functions.append((end - node.lineno + 1, f"{rel}:{node.lineno}:{node.name}"))
    order = lambda xs: sorted(xs, key=lambda x: (-x[0], x[1]))  # noqa: E731
    return {
        "methods per class": order(methods),
        "lines per function": order(functions),
        "lines per module": order(lines),
        "modules per folder": order([(n, f) for f, n in folders.items()]),
        "constructor parameters": order(inits),
    }


def imports(root: Path = ROOT) -> dict[str, set[str]]:
    """-> {module: the project's modules it imports, anywhere in it (``TYPE_CHECKING`` blocks aside)}"""
    names = {module_name(p, root): p for p in modules(root) if p.parent != root / "scripts"}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        types_only = {
            id(n)
            for node in tree.body
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):  # imports inside functions too: a circle put off is still one
            if id(node) in types_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                while t and t not in names:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles between modules (a package's ``__init__`` re-exporting its own modules aside)."""

    def own(a: str, b: str) -> bool:  # a package and a module inside it
        return b.startswith(a + ".") or a.startswith(b + ".")

    found: list[list[str]] = []
    seen: set[frozenset] = set()
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if own(node, nxt):
                    continue
                if nxt == start and len(path) > 1:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        found.append(path)
                elif nxt not in path and nxt > start and len(path) < 6:
                    stack.append((nxt, [*path, nxt]))
    return found


def breaches(root: Path = ROOT) -> list[str]:
    f = figures(root)
    out = [f"{w}: {n} methods (limit {MAX_METHODS})" for n, w in f["methods per class"] if n > MAX_METHODS]
    out += [
        f"{w}: {n} lines (limit {MAX_FUNCTION_LINES})" for n, w in f["lines per function"] if n > MAX_FUNCTION_LINES
    ]
    for n, w in f["lines per module"]:
        limit = MAX_RECOVERY_LINES if w.startswith("recovery/") else MAX_MODULE_LINES
        if n > limit:
            out.append(f"{w}: {n} lines (limit {limit})")
    out += [
        f"{w}/: {n} modules (limit {MAX_FOLDER_MODULES})" for n, w in f["modules per folder"] if n > MAX_FOLDER_MODULES
    ]
    out += [
        f"{w}: {n} parameters (limit {MAX_INIT_PARAMS})" for n, w in f["constructor parameters"] if n > MAX_INIT_PARAMS
    ]
    out += ["import circle: " + " -> ".join([*c, c[0]]) for c in circles(imports(root))]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 naming each thing past a limit")
    ap.add_argument("--top", type=int, default=5, help="how many of each figure to show (default 5)")
    args = ap.parse_args(argv)
    if args.check:
        bad = breaches()
        for line in bad:
            print(line)
        return 1 if bad else 0
    for what, rows in figures().items():
        print(f"{what}:")
        for n, where in rows[: args.top]:
            print(f"  {n:5d}  {where}")
    found = circles(imports())
    print(f"import circles: {len(found)}")
    for c in found:
        print("  " + " -> ".join([*c, c[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
