"""lapheads' messages go through logging (issue 74): warnings for a library user, everything for the command,
routable to the application's own handlers, and never printed from library code."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import lapheads
from lapheads.log import ROOT

PACKAGE = Path(lapheads.__file__).parent


@pytest.fixture
def restored():
    root = logging.getLogger(ROOT)
    level, propagate, handlers = root.level, root.propagate, list(root.handlers)
    yield root
    root.setLevel(level)
    root.propagate = propagate
    root.handlers[:] = handlers


def test_a_library_user_sees_warnings_not_notices_until_asking(restored, capsys):
    log = logging.getLogger("lapheads.runs.directory")
    log.info("lapheads: a notice")
    log.warning("lapheads: a repair")
    assert capsys.readouterr().err == "lapheads: a repair\n"  # the bare message, on the stderr of the moment
    lapheads.set_verbosity("info")
    log.info("lapheads: a notice")
    assert capsys.readouterr().err == "lapheads: a notice\n" and lapheads.get_verbosity() == logging.INFO


def test_propagation_hands_messages_to_the_applications_handlers_once(restored, capsys):
    seen: list[str] = []
    application = logging.Handler()  # the application's own handler on the root logger
    application.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger().addHandler(application)
    try:
        lapheads.enable_propagation()
        logging.getLogger("lapheads.sandbox").warning("lapheads: no boundary")
        assert seen == ["lapheads: no boundary"] and capsys.readouterr().err == ""  # not shown twice
        lapheads.enable_propagation(False)
        logging.getLogger("lapheads.sandbox").warning("lapheads: again")
        assert seen == ["lapheads: no boundary"] and capsys.readouterr().err == "lapheads: again\n"
    finally:
        logging.getLogger().removeHandler(application)


@pytest.mark.parametrize("level", ["loud", -1, True])
def test_a_verbosity_that_is_no_level_is_refused_in_one_line(level):
    with pytest.raises(ValueError, match="allowed: debug, info, warning, error or a logging level number"):
        lapheads.set_verbosity(level)


def test_the_environment_chooses_the_library_level_and_a_bad_value_is_said():
    code = "import logging, lapheads; print(logging.getLevelName(lapheads.get_verbosity()))"
    run = lambda value: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={"LAPHEADS_VERBOSITY": value}
    )
    assert run("debug").stdout.strip() == "DEBUG"
    bad = run("loud")
    assert bad.stdout.strip() == "WARNING" and "LAPHEADS_VERBOSITY: verbosity 'loud'; allowed:" in bad.stderr


def test_the_command_shows_info_and_leaves_the_callers_verbosity_as_it_was(restored, capsys, monkeypatch):
    from lapheads.cli import commands, main

    def a_command(args) -> int:  # stands for any command: its library code logs a notice
        logging.getLogger("lapheads.runs.directory").info("lapheads: resuming")
        return 0

    monkeypatch.setattr(commands, "cmd_export_tb", a_command)
    monkeypatch.delenv("LAPHEADS_VERBOSITY", raising=False)
    lapheads.set_verbosity("warning")
    assert main(["export-tb", "any"]) == 0 and capsys.readouterr().err == "lapheads: resuming\n"
    assert lapheads.get_verbosity() == logging.WARNING  # the caller's level again
    monkeypatch.setenv("LAPHEADS_VERBOSITY", "error")  # the user's choice wins over the command's
    assert main(["export-tb", "any"]) == 0 and capsys.readouterr().err == ""


def test_library_code_prints_almost_nothing():
    """Only the CLI layer (cli/, apps/) prints; the one print left elsewhere is the torchrun SIGTERM handler's line
    (logging is not safe inside a signal handler)."""
    prints = sorted(
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        if path.parent.name not in ("cli", "apps")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
    )
    assert prints == ["distributed.py:120"]
