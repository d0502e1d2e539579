"""The layering of docs/design.md, checked on the source: which modules may import training code, and no cycles
between packages. Every import counts, also those inside functions (they are still dependencies)."""

import ast
from collections import defaultdict
from pathlib import Path

import lapheads

PACKAGE = Path(lapheads.__file__).parent
#: the entry points: they start training runs, so they may import anything
TOP = {"lapheads.__main__", "lapheads.cli", "lapheads.presets", "lapheads.tasks", "lapheads.sweep", "lapheads.demo"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the lapheads modules it imports (anywhere in its body)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("lapheads")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lapheads"):
                targets.add(node.module)
                # "from lapheads import runs" / "from lapheads.train import chat" name submodules
                targets |= {
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                }
        graph[name] = targets
    return graph


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_graph_sees_the_package():
    graph = _imports()
    assert {"lapheads.runs", "lapheads.train.classify", "lapheads.analyze", "lapheads.geometry.anova"} <= set(graph)
    assert "lapheads.runs" in graph["lapheads.train.runtime"]  # an import at module level
    assert "lapheads.tasks" in graph["lapheads.analyze"]


def test_nothing_below_the_entry_points_imports_training_code():
    graph = _imports()
    arrows = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        for t in targets
        if t.startswith("lapheads.train") and not m.startswith("lapheads.train") and m not in TOP
    )
    assert not arrows, "readers of runs must go through lapheads.runs:\n" + "\n".join(arrows)


def test_only_entry_points_import_entry_points():
    graph = _imports()
    allowed = TOP - {"lapheads.tasks"}  # the task table is data every layer may read
    arrows = sorted(f"{m} -> {t}" for m, targets in graph.items() if m not in TOP for t in targets if t in allowed)
    assert not arrows, "\n".join(arrows)


def test_the_bottom_floor_imports_only_the_bottom_floor():
    graph = _imports()
    bottom = {
        "lapheads.errors",
        "lapheads.config",
        "lapheads.io",
        "lapheads.distributed",
        "lapheads.runs",
        "lapheads.lora",
    }
    bottom_packages = ("lapheads.core", "lapheads.models", "lapheads.data", "lapheads.geometry")

    def is_bottom(m: str) -> bool:
        return m in bottom or m == "lapheads" or m.startswith(bottom_packages)

    arrows = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if is_bottom(m) and m != "lapheads"
        for t in targets
        if not is_bottom(t)
    )
    assert not arrows, "\n".join(arrows)


def test_no_cycle_between_packages():
    graph = _imports()
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        for target in targets:
            a, b = _package(module), _package(target)
            if a != b and b != "lapheads":
                packages[a].add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in packages[start]:
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(f"{a} <-> {b}" for a in list(packages) for b in packages[a] if reaches(b, a, {b}))
    assert not cycles, "\n".join(cycles)
