"""The layering of docs/design.md, checked on the source: every import between lapheads' folders goes down the table
of layers, never up, and nothing imports a moved module by its old name. Every import counts, also those inside
functions (they are still dependencies), and so do the task table's ``module:attribute`` strings (it imports them
on first use)."""

import ast
import re
from pathlib import Path

import lapheads
from lapheads._moved import MOVED

PACKAGE = Path(lapheads.__file__).parent

#: the folders from the bottom up (docs/design.md, "Layers"); a module imports from its own folder and lower
#: layers only. Folders of one layer (models, data, geometry) do not import each other.
LAYERS = (
    ("basics",),
    ("core",),
    ("models", "data", "geometry"),
    ("lapheads",),  # the package's front door: it re-exports core and models
    ("runs",),
    ("apps",),
    ("evals",),
    ("integrations",),
    ("train",),
    ("tasks",),
    ("study",),
    ("cli",),
)
LEVEL = {folder: level for level, folders in enumerate(LAYERS) for folder in folders}
#: the modules that live in the package's root: the basics, the front door, the entry point, the old-name table
ROOT_MODULES = {
    "__init__",
    "__main__",
    "_moved",
    "bench",
    "config",
    "distributed",
    "errors",
    "hardware",
    "io",
    "plots",
    "sandbox",
}
_REFERENCE = re.compile(r"^(lapheads(?:\.\w+)+):\w+$")  # "lapheads.train.lm:train_lm" in the task table


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports() -> dict[str, set[str]]:
    """module -> the lapheads modules it imports (anywhere in its body) or names as ``module:attribute``."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("lapheads")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lapheads"):
                # "from lapheads.train import chat" names a submodule; "from lapheads.core import x" a name
                named = {f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")}
                targets |= named or {node.module}
                if len(named) < len(node.names):
                    targets.add(node.module)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                match = _REFERENCE.match(node.value)
                if match:
                    targets.add(match.group(1))
        graph[_module_name(path)] = targets
    return graph


def _folder(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "lapheads"
    if parts[1] == "__main__":
        return "cli"
    return "basics" if parts[1] in ROOT_MODULES else parts[1]


def test_the_graph_sees_the_package():
    graph = _imports()
    assert {"lapheads.runs", "lapheads.train.classify", "lapheads.study.analyze", "lapheads.core.heads"} <= set(graph)
    assert "lapheads.runs" in graph["lapheads.train.runtime"]  # an import at module level
    assert "lapheads.tasks" in graph["lapheads.study.analyze"]  # an import inside a function counts too
    assert "lapheads.train.classify" in graph["lapheads.tasks"]  # and the task table's strings


def test_every_folder_has_a_layer_and_the_root_holds_only_the_basics():
    graph = _imports()
    assert {_folder(m) for m in graph} <= set(LEVEL), sorted({_folder(m) for m in graph} - set(LEVEL))
    stray = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ROOT_MODULES)
    assert not stray, f"modules in the package root outside the basics: {stray}; put them in their layer's folder"


def test_imports_only_go_down_the_layers():
    graph = _imports()
    arrows = sorted(
        f"{m} -> {t}  ({_folder(m)} may not import {_folder(t)})"
        for m, targets in graph.items()
        for t in targets
        if _folder(t) != _folder(m) and LEVEL[_folder(t)] >= LEVEL[_folder(m)]
    )
    assert not arrows, "\n".join(arrows)


def test_nothing_imports_a_moved_module_by_its_old_name():
    graph = _imports()
    arrows = sorted(f"{m} -> {t} (now {MOVED[t]})" for m, targets in graph.items() for t in targets if t in MOVED)
    assert not arrows, "\n".join(arrows)


def test_old_names_are_the_moved_modules_themselves():
    import importlib

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


#: the names of a run directory's files and folders (lapheads.runs.layout): only runs/ spells them
RUN_DIR_NAMES = ("config.json", "metrics.jsonl", "samples.jsonl", "state.json", "sweep.json", "model.safetensors")
RUN_DIR_WORDS = ("checkpoints", "latest", "report", "tokenizer")


def _literals(path: Path):
    """(line, text) of the string constants of a module that could be a path: no docstring, no dict key, no command
    name, and no message (a message has spaces; it may name a file to the user)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            skipped.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.Dict):
            skipped |= {id(key) for key in node.keys if key is not None}  # a record's field, not a file
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_parser" and node.args:
            skipped.add(id(node.args[0]))  # `lapheads report` is a command
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            if not any(c.isspace() for c in node.value):
                yield node.lineno, node.value


def test_only_runs_spells_the_run_directory():
    found = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        # data/ has its own on-disk formats (token shards: meta.json beside their tokenizer folder)
        if relative.parts[0] in ("runs", "data"):
            continue
        for line, text in _literals(path):
            if text in RUN_DIR_WORDS or any(name in text for name in RUN_DIR_NAMES) or "step-" in text:
                found.append(f"{relative}:{line}: {text[:60]!r}")
    assert not found, "use lapheads.runs.layout / RunDir:\n" + "\n".join(sorted(found))
