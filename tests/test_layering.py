"""The import graph of epbench/ (every import, function-level ones included, read with ast): no
cycle, the lower layers of docs/layout.md never import the upper ones, and the package imports
nothing from tools/ or tests/ (they import it)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PKG = Path(__file__).resolve().parent.parent / "epbench"
TOOLS = PKG.parent / "tools"
TESTS = PKG.parent / "tests"

# Modules that only describe data and rules: none of them may import a backend, the driver, the
# launcher or a presentation module (the one-way flow of STYLE.md: scenario -> routing -> backend
# -> samples + verification -> metrics -> results -> table / plot).
LOWER = ("epbench.errors", "epbench.contract", "epbench.scenario", "epbench.routing", "epbench.inputs",
         "epbench.verify", "epbench.metrics", "epbench.layout", "epbench.mxfp8", "epbench.options",
         "epbench.backend_names")
UPPER = ("epbench.backends", "epbench.driver", "epbench.plan", "epbench.session", "epbench.launch",
         "epbench.launcher", "epbench.flavors", "epbench.rank", "epbench.cli",
         "epbench.report", "epbench.plot", "epbench.compare", "epbench.overlap", "epbench.llprobe",
         "epbench.ceiling")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> Set[str]:
    """epbench modules ``path`` imports anywhere in it (``from a import b``: a.b where that is a
    module of the package, else a)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("epbench"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("epbench"):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if (PKG.parent / Path(*full.split("."))).with_suffix(".py").exists()
                        or (PKG.parent / Path(*full.split(".")) / "__init__.py").exists() else base)
    out.discard(me)
    return out


def graph() -> Dict[str, Set[str]]:
    return {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def cycles(g: Dict[str, Set[str]]) -> List[List[str]]:
    found, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m):] + [m])
            elif m in g and m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)
    return found


def test_the_import_graph_has_no_cycle():
    assert cycles(graph()) == []


def test_lower_layers_never_import_upper_ones():
    bad = [(m, i) for m, imps in graph().items() if m in LOWER for i in imps
           if any(i == u or i.startswith(u + ".") for u in UPPER)]
    assert bad == []


def top_level_imports(path: Path) -> Set[str]:
    """The first name of every absolute import in ``path``."""
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_package_imports_no_tool_and_no_test_module():
    theirs = {p.stem for folder in (TOOLS, TESTS) for p in folder.glob("*.py")} | {"tools", "tests"}
    bad = [(module_name(p), n) for p in PKG.rglob("*.py") for n in top_level_imports(p) & theirs]
    assert bad == []


def test_the_registry_names_only_the_package_backends():
    from epbench.backend_names import REGISTRY

    for name, where in REGISTRY.items():
        module = where.split(":")[0]
        assert module.startswith("epbench.backends."), (name, where)
        assert (PKG.parent / Path(*module.split("."))).with_suffix(".py").is_file(), (name, where)


def test_the_checks_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert "epbench.backends.base" in imports_of(PKG / "driver.py")
    assert "nccl_prune" in top_level_imports(TOOLS / "baselines.py")
