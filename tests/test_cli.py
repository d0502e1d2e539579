"""The ``lapheads`` command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import lapheads
from lapheads.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"lapheads {lapheads.__version__}"


def test_help_lists_the_demo(capsys):
    assert main([]) == 0
    assert "demo" in capsys.readouterr().out


@pytest.mark.slow
def test_console_script_and_module_entry_points():
    console_script = Path(sys.executable).with_name("lapheads")
    for cmd in ([str(console_script), "--help"], [sys.executable, "-m", "lapheads", "--version"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr


def test_unknown_subcommand_fails_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_help_and_version_answer_without_torch_or_a_busy_probe(argv):
    """`lapheads --help` is the parser alone: torch (seconds to import) and the busy-CPU probe never start."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lapheads", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "lapheads" in done.stdout, done.stderr[-500:]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")}
    assert "torch" not in imported and "lapheads.hardware" not in imported and "machine is busy" not in done.stderr


def _leaf_commands() -> list[list[str]]:
    """Every command the parser has, as argv (``["train", "lm"]``, ``["serve"]``)."""
    import argparse

    from lapheads.cli.parser import build_parser

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> list[list[str]]:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subparsers:
            return [prefix]
        return [argv for name, sub in subparsers[0].choices.items() for argv in walk(sub, [*prefix, name])]

    return walk(build_parser(), [])


def _modules_loaded_by_help(*commands: list[str]) -> set[str]:
    """The modules loaded by ``lapheads COMMAND --help`` for each command in turn, in one fresh interpreter, as the
    console script runs them."""
    import subprocess
    import sys

    code = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: print('LOADED', *sorted(sys.modules), file=sys.stderr))\n"
        f"for argv in {[list(c) for c in commands]!r}:\n"
        "    sys.argv = ['lapheads', *argv, '--help']\n"
        "    try:\n"
        "        runpy.run_module('lapheads', run_name='__main__')\n"
        "    except SystemExit as stop:\n"
        "        assert stop.code in (0, None), (argv, stop.code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-800:]
    return set(done.stderr.split("LOADED", 1)[1].split())


def test_no_commands_help_loads_timm_torchvision_transformers_or_a_trainer():
    """Issue 74: a help text should not cost seconds. `lapheads train lm --help` loaded timm (the GPT's package
    registered lapheads' timm models on import, and the GPT's mixin lived in timm's drop-in module); issue 76:
    `train classify --help` took 4-14 s. Every command's help, run one after another in one interpreter, loads none
    of them (so none does alone)."""
    commands = _leaf_commands()
    assert ["train", "lm"] in commands and ["serve"] in commands and len(commands) > 20
    imported = _modules_loaded_by_help(*commands)
    assert not {"timm", "torchvision", "transformers"} & imported
    trainers = {f"lapheads.train.{task}" for task in ("classify", "lm", "dino", "chat")}
    assert not (trainers | {"lapheads.apps.serve", "lapheads.study.report"}) & imported


@pytest.mark.parametrize("task", ["classify", "lm"])
def test_a_train_help_loads_only_its_own_tasks_presets(task):
    """`lapheads train TASK --help` imports its own task's presets and config, not every task's; the classify help
    (issue 76: under 2 s idle) imports no torch at all: its config, the image catalog, the head-spec grammar and the
    run layout are torch-free."""
    imported = _modules_loaded_by_help(["train", task])
    other = "lapheads.tasks.presets.lm" if task == "classify" else "lapheads.tasks.presets.classify"
    assert f"lapheads.tasks.presets.{task}" in imported and other not in imported
    if task == "classify":
        assert "torch" not in imported and "numpy" not in imported


def test_each_evaluation_is_a_sub_parser_with_only_its_own_options(capsys):
    """``lapheads eval NAME``: every evaluation of the task table has its own parser (issue 59: one flat parser
    with "lm:"/"dino:"-prefixed help took every option for every evaluation)."""
    from lapheads.cli import main
    from lapheads.cli.parser import EVALUATION_HELP, build_parser
    from lapheads.tasks import EVALUATIONS

    assert list(EVALUATION_HELP) == list(EVALUATIONS)
    args = build_parser().parse_args(["eval", "lm", "runs/x", "--benchmarks", "arc_easy", "--harness", "mmlu"])
    assert (args.task, args.run_dirs, args.benchmarks, args.harness) == ("lm", ["runs/x"], "arc_easy", "mmlu")
    for argv in (["eval", "classify", "runs/x", "--harness", "mmlu"], ["eval", "dino", "runs/x", "--ema"]):
        with pytest.raises(SystemExit) as stop:  # another evaluation's option
            main(argv)
        assert stop.value.code == 2 and argv[3] in capsys.readouterr().err


def test_an_evaluations_flags_are_its_options_fields_checked_by_their_domains(capsys):
    """Issue 74: evaluations declare their options as configs do; the flags are generated from the fields (every
    field a flag, but the RUN_DIR arguments), a value of the wrong type is argparse's one-line error, and a value
    outside the field's domain is refused in one line before any run is read."""
    import dataclasses

    from lapheads.cli import main
    from lapheads.cli.parser import build_parser
    from lapheads.evals.options import RUN_ARGUMENTS
    from lapheads.tasks import EVALUATIONS

    parser = build_parser()
    for name, evaluation in EVALUATIONS.items():
        args = parser.parse_args(["eval", name, "runs/x"])
        for cls in evaluation.option_classes():
            for field in dataclasses.fields(cls):
                if field.name not in RUN_ARGUMENTS:
                    assert getattr(args, field.name) == field.default, (name, field.name)
    assert parser.parse_args(["eval", "lm", "r", "--tasks", "mmlu"]).benchmarks == "mmlu"  # the 0.1 spelling
    with pytest.raises(SystemExit) as stop:
        main(["eval", "lm", "r", "--max-examples", "ten"])
    assert (
        stop.value.code == 2
        and "argument --max-examples: 'ten': allowed: an integer or none" in capsys.readouterr().err
    )
    assert main(["eval", "lm", "r", "--max-examples", "0"]) == 2
    assert "--max-examples 0: allowed: an integer, > 0 (or none)" in capsys.readouterr().err
    assert main(["eval", "dino", "a", "b", "--seg-epochs", "0"]) == 2
    assert "--seg-epochs 0: allowed: an integer, >= 1" in capsys.readouterr().err


def test_no_evaluation_entry_point_takes_more_than_six_parameters():
    """Issue 74's bar: an evaluation takes its options as one value (a scorer of one benchmark: at most 8)."""
    import inspect

    from lapheads.evals import chat, classify, dino, lm
    from lapheads.tasks import EVALUATIONS, _load

    entry_points = [_load(ref) for e in EVALUATIONS.values() for ref in (e.run, e.harness) if ref]
    entry_points += [chat.run_chat_evals, dino.eval_dino, lm.run_evals, classify.evaluate_run]
    wide = {f.__qualname__: n for f in entry_points if (n := len(inspect.signature(f).parameters)) > 6}
    assert not wide, wide
    scorers = [lm.score_humaneval, lm.score_completions, lm.score_multiple_choice, lm.score_gsm8k, lm.evaluate_bpb,
               chat.score_generative, chat.score_categorical]  # fmt: skip
    wide = {f.__qualname__: n for f in scorers if (n := len(inspect.signature(f).parameters)) > 8}
    assert not wide, wide


def test_the_parser_is_one_short_function_per_command():
    import ast
    import inspect

    from lapheads.cli import parser

    source = inspect.getsource(parser)
    functions = {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
    assert functions["build_parser"].end_lineno - functions["build_parser"].lineno < 40
    long = [name for name, n in functions.items() if name.endswith("_command") and n.end_lineno - n.lineno > 60]
    assert long == []


def test_ctrl_c_before_a_commands_own_handler_is_one_line_and_exit_130(monkeypatch, capsys):
    """Issue 76 (red team, low): Ctrl-C in the first seconds of report, mechanism, eval or analyze printed a
    KeyboardInterrupt traceback."""
    from lapheads.cli import commands, main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "cmd_report", interrupted)
    assert main(["report", "anything"]) == 130
    assert capsys.readouterr().err.strip() == "lapheads report: interrupted"


def test_sweep_nproc_per_node_below_one_is_refused_by_name(capsys):
    from lapheads.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["sweep", "fmnist-cpu", "--dry-run", "--nproc-per-node", "0"])
    assert stop.value.code == 2 and "--nproc-per-node: '0'; allowed: an integer >= 1" in capsys.readouterr().err
