"""The layering of docs/design.md, checked on the source: every import between lapheads' folders goes down the table
of layers, never up, and nothing imports a moved module by its old name. Every import counts, also those inside
functions (they are still dependencies), and so do the task table's ``module:attribute`` strings (it imports them
on first use)."""

import ast
import re
from pathlib import Path

import lapheads

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
#: the modules that live in the package's root: the basics, the front door, the entry point, and public short names
#: of modules in a layer's folder (their layer: :data:`SHORT_NAMES`)
ROOT_MODULES = {
    "__init__",
    "__main__",
    "hf",
    "bench",
    "config",
    "distributed",
    "errors",
    "hardware",
    "io",
    "log",
    "plots",
    "sandbox",
    "submodules",
}
SHORT_NAMES = {"hf": "integrations"}  # lapheads.hf, the documented name of lapheads.integrations.hf
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
    if parts[1] in SHORT_NAMES:
        return SHORT_NAMES[parts[1]]
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


def test_no_private_name_is_imported_across_modules():
    """``from lapheads.x import _y`` means ``_y`` is not private: make it public, or move the code that needs it
    (ruff's PLC2701 covers other packages' private names)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lapheads"):
                found += [f"{_module_name(path)}: {node.module}.{a.name}" for a in node.names if _is_private(a.name)]
    assert not found, "\n".join(sorted(found))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_there_are_no_old_import_names():
    import importlib

    import pytest

    for old in ("lapheads.attention", "lapheads.sweep", "lapheads.report", "lapheads.presets", "lapheads.chat"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    import lapheads.hf
    import lapheads.integrations.hf

    assert lapheads.hf.enable is lapheads.integrations.hf.enable  # the short name is the integration's


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


def test_the_op_reads_on_a_screen_and_leaves_the_compiled_node_to_its_autograd_module():
    """core/attention.py plans and calls paths: no function over 60 lines, and the compiled node is chosen in one
    place (core/_autograd.py), never named by the op."""
    source = (PACKAGE / "core" / "attention.py").read_text()
    tree = ast.parse(source)
    long = [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []
    assert "lapheads.core.native" not in _imports()["lapheads.core.attention"]
    assert "native" not in {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names
    }


def test_only_the_task_table_asks_which_task_a_run_is():
    """Nothing outside tasks/ compares a task's name with a literal (``record["task"] == "lm"``, ``task in ("mid",
    "sft")``): what differs between tasks is a field of its ``Task``, or a fact the run records (its token shards,
    its conversations)."""
    from lapheads.tasks import TASKS

    found = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "tasks":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            names = {n.value for side in sides for n in ast.walk(side) if isinstance(n, ast.Constant)}
            asks_task = any(
                (isinstance(side, ast.Name) and side.id == "task")
                or (
                    isinstance(side, ast.Subscript)
                    and isinstance(side.slice, ast.Constant)
                    and side.slice.value == "task"
                )
                for side in sides
            )
            if asks_task and names & set(TASKS):
                found.append(f"{relative}:{node.lineno}")
    assert not found, "ask the task table (lapheads.tasks.get_task) instead:\n" + "\n".join(found)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (modules in order, the first repeated at the end), or [] when there is none."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every path from it is explored

    def visit(module: str, path: list[str]) -> list[str]:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if target == module or target not in graph:
                continue
            if state.get(target) == "open":
                return [*path[path.index(target) :], module, target] if target in path else [module, target]
            if target not in state:
                found = visit(target, [*path, module])
                if found:
                    return found
        state[module] = "done"
        return []

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [])
            if found:
                return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_imports_itself_through_others():
    """No import cycle, counting imports inside functions (issue 59: study.sweep and study.slurm imported each
    other; a cell's code now lives in study.cells, which both import)."""
    assert _cycle(_imports()) == []


def _design_table() -> list[tuple[list[str], list[str]]]:
    """(folders, file names) of each row of docs/design.md's layer table, brace lists expanded
    (``models/{vit,gpt}.py`` -> ``models/vit.py``, ``models/gpt.py``)."""
    text = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = line.split(" | ")
        if not re.match(r"^\| \d+ \|", line) or len(cells) < 4:
            continue
        folders = [f.rstrip("/") for f in re.findall(r"`([\w/.]+)`", cells[1])]
        names = []
        for token in re.findall(r"`([\w/{},.]+\.(?:py|cpp)|[\w/{},]+/)`", cells[2]):
            head, brace, rest = token.partition("{")
            if brace:
                choices, _, tail = rest.partition("}")
                names += [f"{head}{choice}{tail}" for choice in choices.split(",")]
            else:
                names.append(token)
        rows.append((folders, names))
    return rows


def test_the_design_layer_table_names_exactly_the_files_there_are():
    """docs/design.md's layer table is the map: every module of the package is named in its folder's row, and
    every file or folder the table names exists (issue 59: the map named a deleted module and missed two)."""
    named = set()
    for folders, names in _design_table():
        base = "" if folders in ([], ["lapheads/__init__.py"]) else folders[0]
        for name in names:
            inside = len(folders) > 1 or name.split("/")[0] in {f.split("/")[0] for f in folders}
            named.add(name.rstrip("/") if inside or not base else f"{base}/{name.rstrip('/')}")
    missing = sorted(n for n in named if not (PACKAGE / n).exists() and n != "lapheads/__init__.py")
    assert not missing, f"docs/design.md names files that do not exist: {missing}"
    modules = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" and not any(str(p.relative_to(PACKAGE)).startswith(n + "/") for n in named)
    }
    unnamed = sorted(modules - named)
    assert not unnamed, f"modules docs/design.md's layer table does not name: {unnamed}"


def test_every_layer_folder_is_a_package():
    """Each layer's folder has its ``__init__.py`` (issue 59: train/ had none and imported as a namespace)."""
    folders = {p.parent for p in PACKAGE.rglob("*.py")} - {PACKAGE}
    assert sorted(str(f.relative_to(PACKAGE)) for f in folders if not (f / "__init__.py").exists()) == []


def _defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


#: the modules whose ``__all__`` is a front door re-exporting other modules' names (documented as such)
FRONT_DOORS = {"lapheads", "lapheads.hf", "lapheads.integrations.hf"}


def test_a_module_all_lists_only_what_it_defines():
    """``__all__`` says where a name lives: a module lists the names it defines, never ones it imports (a package's
    ``__init__`` and the documented front doors excepted)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if path.name == "__init__.py" or module in FRONT_DOORS:
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                found += [f"{module}: {name}" for name in ast.literal_eval(node.value) if name not in _defined(tree)]
    assert not found, "\n".join(sorted(found))


def test_no_section_header_stands_over_nothing():
    """A ``# ----`` section header is followed by code of its section before the next header or the file's end."""
    empty = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        headers = [i for i, line in enumerate(lines) if re.fullmatch(r"# -{20,}", line)]
        for i, start in enumerate(headers):
            end = headers[i + 1] if i + 1 < len(headers) else len(lines)
            body = [line for line in lines[start + 1 : end] if line.strip() and not line.startswith("#")]
            if not body:
                empty.append(f"{path.relative_to(PACKAGE)}:{start + 2}: {lines[start + 1] if start + 1 < end else ''}")
    assert not empty, "\n".join(empty)


def test_the_science_layer_keeps_its_bars():
    """Issue 59's bars: the report's statistics are pure functions of numbers (nothing from runs, models or
    geometry), a sweep is run from a definition and its options (<= 4 parameters), and no function of study/ is
    longer than a screen and a half (80 lines)."""
    graph = _imports()
    statistics = graph["lapheads.study.report.statistics"]
    assert not [t for t in statistics if _folder(t) in ("runs", "models", "geometry")], sorted(statistics)
    run_sweep = next(
        node
        for node in ast.walk(ast.parse((PACKAGE / "study" / "sweep.py").read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "run_sweep"
    )
    assert len(run_sweep.args.args) + len(run_sweep.args.kwonlyargs) <= 4
    long = [
        f"{path.relative_to(PACKAGE)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in (PACKAGE / "study").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, "\n".join(long)
