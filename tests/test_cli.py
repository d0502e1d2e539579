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


@pytest.mark.parametrize("task", ["classify"])
def test_a_train_help_loads_neither_timm_nor_torchvision_nor_another_tasks_presets(task):
    """Issue 76: `lapheads train classify --help` took 4-14 s (torch, timm and torchvision imported for a help
    text, and every task's presets with the GPT). It imports its own task's presets and config, and torch. (The LM
    tasks' help still loads timm: their config imports the GPT, whose package registers lapheads' timm models.)"""
    import subprocess
    import sys

    code = (  # the command as its console script runs it, then the modules it loaded, printed at exit
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: print('LOADED', *sorted(sys.modules), file=sys.stderr))\n"
        f"sys.argv = ['lapheads', 'train', {task!r}, '--help']\n"
        "runpy.run_module('lapheads', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "presets:" in done.stdout, done.stderr[-500:]
    imported = set(done.stderr.split("LOADED", 1)[1].split())
    assert not {"timm", "torchvision", "transformers"} & imported
    other = "lapheads.tasks.presets.lm" if task == "classify" else "lapheads.tasks.presets.classify"
    assert f"lapheads.tasks.presets.{task}" in imported and other not in imported


def test_each_evaluation_is_a_sub_parser_with_only_its_own_options(capsys):
    """``lapheads eval NAME``: every evaluation of the task table has its own parser (issue 59: one flat parser
    with "lm:"/"dino:"-prefixed help took every option for every evaluation)."""
    from lapheads.cli import main
    from lapheads.cli.parser import EVALUATION_OPTIONS, build_parser
    from lapheads.tasks import EVALUATIONS

    assert list(EVALUATION_OPTIONS) == list(EVALUATIONS)
    args = build_parser().parse_args(["eval", "lm", "runs/x", "--benchmarks", "arc_easy", "--harness", "mmlu"])
    assert (args.task, args.run_dirs, args.benchmarks, args.harness) == ("lm", ["runs/x"], "arc_easy", "mmlu")
    for argv in (["eval", "classify", "runs/x", "--harness", "mmlu"], ["eval", "dino", "runs/x", "--ema"]):
        with pytest.raises(SystemExit) as stop:  # another evaluation's option
            main(argv)
        assert stop.value.code == 2 and argv[3] in capsys.readouterr().err


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
