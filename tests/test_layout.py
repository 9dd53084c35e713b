"""The package's shape: no import cycle between pocketlab's modules, and the README's layout lists every module.

Imports are read from the source (ast), not by importing: a cycle hidden behind an import inside a function
counts too, since it ties the two modules together just the same."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pocketlab"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(importer: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in module `importer`."""
    if level == 0:
        return target or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """pocketlab modules that `name` imports, anywhere in its body (TYPE_CHECKING-only imports excluded:
    they never run)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, path.name == "__init__.py", node.level, node.module)
            # `from . import x` imports the submodule x when there is one, else a name from the package
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import pocketlab.a.b` names a module or its package
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], path[len(path) :] = 1, [node]
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    """The check above can fail: a hidden (function-level) import back is a cycle, a TYPE_CHECKING one is not."""
    pkg = tmp_path / "pocketlab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    known = {module_name(p, tmp_path): p for p in sorted(pkg.rglob("*.py"))}
    graph = {n: imports(n, p, known) for n, p in known.items()}
    assert graph["pocketlab.c"] == set()
    assert find_cycle(graph) == ["pocketlab.a", "pocketlab.b", "pocketlab.a"]


def test_readme_layout_lists_every_module():
    """The README's Layout block has one line per module (a package by its folder, its __init__ aside), no more."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Layout.*?```\n(.*?)```", text, re.S).group(1)
    listed = [line.split()[0] for line in block.splitlines() if line.strip()]
    files = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")}
    wanted = {f for f in files if not f.endswith("/__init__.py")} | {"pocketlab/__init__.py"}
    wanted |= {f.removesuffix("__init__.py") for f in files if f.endswith("/__init__.py") and f.count("/") > 1}
    assert sorted(listed) == sorted(wanted), (
        f"missing: {sorted(wanted - set(listed))}; not in the tree: {sorted(set(listed) - wanted)}; "
        f"twice: {sorted({e for e in listed if listed.count(e) > 1})}"
    )
