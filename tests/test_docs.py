"""Every `lapheads` command in README.md and docs/*.md is one lapheads accepts today: parsed by the real command
line, its sub-command's options known, a training command's config resolved from its preset and overrides (types
and ranges checked), a sweep's arms, seeds and preset valid, an evaluation known. Help and dry-run commands are run.
Commands that need a GPU or data this machine does not have are checked the same way: parsing needs neither."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import torch

from lapheads.cli import build_parser, main
from lapheads.cli.commands import _check_override_names

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _shell_blocks(text: str) -> list[str]:
    """The contents of the page's fenced blocks that are shell (bash, sh, console or unlabelled)."""
    blocks, current, language = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, language = [], line[3:].strip()
            else:
                if language in ("", "bash", "sh", "console"):
                    blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _commands(page: Path) -> list[tuple[str, list[str]]]:
    """(the line as written, its argv after `lapheads`) of every lapheads command in the page's code blocks."""
    found = []
    for block in _shell_blocks(page.read_text()):
        text = block.replace("\\\n", " ")  # continued lines
        for line in text.splitlines():
            for part in line.split("&&"):
                if not part.strip().startswith(("lapheads ", "torchrun ")):
                    continue  # prose, folder trees, other tools
                words = shlex.split(part, comments=True)
                if "-m" in words and "lapheads" in words[words.index("-m") + 1 : words.index("-m") + 2]:
                    words = words[words.index("-m") + 1 :]  # torchrun ... -m lapheads ...
                if words[:1] == ["lapheads"] and len(words) > 1:
                    found.append((part.strip(), words[1:]))
    return found


CASES = [(page.relative_to(ROOT).as_posix(), line, argv) for page in PAGES for line, argv in _commands(page)]


def test_the_pages_have_commands():
    pages = {page for page, _, _ in CASES}
    assert {"README.md", "docs/training.md", "docs/language-models.md", "docs/sweeps.md"} <= pages
    assert len(CASES) >= 40


@pytest.mark.parametrize("page, line, argv", CASES, ids=[f"{p}: {line[:70]}" for p, line, _ in CASES])
def test_a_documented_command_is_accepted(page, line, argv, capsys, tmp_path, monkeypatch):
    from lapheads.study.sweep import parse_seeds, parse_specs
    from lapheads.tasks import get_evaluation
    from lapheads.tasks.presets import PRESETS, resolve_config

    if {"-h", "--help"} & set(argv) or "--dry-run" in argv:
        monkeypatch.chdir(tmp_path)  # a dry run may write its sweep.json under runs/
        try:
            status = main(argv)
        except SystemExit as stop:  # argparse's --help
            status = stop.code
        assert status == 0, capsys.readouterr().err
        return
    for flag in ("--data-root", "--data-dir"):  # data this machine lacks: a GPU recipe must say what it needs
        if flag in argv and not Path(argv[argv.index(flag) + 1]).expanduser().exists():
            comment = line.split("#", 1)[1] if "#" in line else ""
            assert line.startswith("torchrun") or "GPU" in comment or "data" in comment, f"say what it needs: {line}"
            argv = [*argv]
            argv[argv.index(flag) + 1] = str(tmp_path)
    args, overrides = build_parser().parse_known_args(argv)
    assert not overrides or getattr(args, "takes_overrides", False), f"unknown options {overrides} in: {line}"
    if args.command == "train":
        _check_override_names(args.task, overrides)
        for option, field in (("base_from", "--base"), ("nanochat_from", "--nanochat")):  # as `train` does
            if getattr(args, option, None):
                overrides = [*overrides, field, getattr(args, option)]
        if not args.resume:
            resolve_config(args.task, args.preset, args.laplacian_heads, overrides)
    elif args.command == "sweep":
        if args.plan is not None and Path(args.plan).exists():  # a committed plan: it declares the arms and seeds
            from lapheads.study.records import load_plan

            plan = load_plan(args.plan)
            assert plan.preset == args.preset, line
        elif args.plan is None:
            parse_specs(args.laplacian_heads)
            parse_seeds(args.seeds)
        assert args.preset in {name for presets in PRESETS.values() for name in presets}, line
    elif args.command == "eval":
        get_evaluation(args.task)


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_leads_to_a_file(page):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert not missing, missing


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


#: every Python block of the README and docs/, by (page, index)
PYTHON_BLOCKS = [
    (page, index)
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for index in range(len(_python_blocks(page)))
]
#: a block (or one line of it) that cannot run here says so in a comment starting "needs:" (a checkpoint on disk, a
#: torchrun launch); it is left out, and only it
NEEDS = re.compile(r"#\s*needs:")


@pytest.mark.parametrize(("page", "index"), PYTHON_BLOCKS, ids=[f"{p.name}-{i}" for p, i in PYTHON_BLOCKS])
def test_the_docs_python_runs_as_written(page, index, monkeypatch, tmp_path):
    """Each Python block of the README and docs/, executed as it stands in a scratch folder; a download from the
    Hub is given a tiny local Llama instead (this machine, like CI, has no network for weights), and a block or line
    marked "needs:" is left out with its reason."""
    transformers = pytest.importorskip("transformers")
    block = _python_blocks(page)[index]
    if NEEDS.match(block.lstrip()):
        pytest.skip(block.splitlines()[0].lstrip("# "))
    code = "\n".join(line for line in block.splitlines() if not NEEDS.search(line))

    def tiny_llama(name, **kwargs):
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    real_from_pretrained = transformers.AutoModelForCausalLM.from_pretrained

    def hub_or_local(name, **kwargs):  # a Hub name: the tiny model; a folder the block saved: the real loader
        return real_from_pretrained(name, **kwargs) if os.path.isdir(name) else tiny_llama(name)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", hub_or_local)
    monkeypatch.setattr(os, "environ", os.environ.copy())  # the block's thread policy writes here, not for good
    monkeypatch.chdir(tmp_path)  # what a block saves ("out/") goes here
    threads = torch.get_num_threads()
    try:
        exec(compile(code, f"{page.name} python block {index}", "exec"), {})
    finally:
        torch.set_num_threads(threads)


def _inline_commands(page: Path) -> list[str]:
    """The `lapheads ...` commands a page names in inline code (outside its fenced blocks)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S).replace("\n", " ")
    return re.findall(r"`(lapheads [^`]+)`", text)


INLINE = [(page.relative_to(ROOT).as_posix(), span) for page in PAGES for span in _inline_commands(page)]


def _placeholder(word: str) -> bool:
    """A word that stands for a value the reader supplies: NAME, RUN_DIR, <task>."""
    return bool(re.fullmatch(r"[A-Z][A-Z0-9_=.]*|<[^>]+>", word))


@pytest.mark.parametrize("page, span", INLINE, ids=[f"{p}: {s[:60]}" for p, s in INLINE])
def test_a_command_named_in_inline_code_exists(page, span, capsys):
    """Issue 76: docs/language-models.md named `lapheads data fineweb-edu --shards N`, which is not a command (it is
    `lapheads data fetch fineweb-edu`). Inline code that names a command may leave out its arguments, or stand
    them in as placeholders; every command, subcommand and choice it spells must be one the parser has."""
    words = shlex.split(span)
    with pytest.raises(SystemExit) if {"-h", "--help"} & set(words) else _nothing():
        try:
            build_parser().parse_known_args(words[1:])
        except SystemExit as stop:
            err = capsys.readouterr().err
            wrong = re.search(r"invalid choice: '([^']*)'", err)
            assert not (wrong and not _placeholder(wrong.group(1))), f"{page}: `{span}`: {err.strip()[-200:]}"
            if stop.code == 0:
                raise


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_every_lapheads_name_in_the_docs_resolves_after_import_lapheads():
    """Issue 76: docs named `lapheads.convert.BlendSchedule` (it is lapheads.core.convert) and
    `lapheads.runs.load_model(...)` raised AttributeError after `import lapheads` alone. Each dotted name a page
    shows in code formatting resolves, attribute by attribute, from a fresh `import lapheads`."""
    import subprocess
    import sys

    names = sorted(
        {name for page in PAGES for name in re.findall(r"`(lapheads(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", page.read_text())}
    )
    assert len(names) >= 20
    code = (
        "import functools, sys, lapheads\n"
        "missing = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        functools.reduce(getattr, name.split('.')[1:], lapheads)\n"
        "    except AttributeError as err:\n"
        "        missing.append(f'{name}: {err}')\n"
        "print(missing)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-1000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
