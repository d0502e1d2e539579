"""Peers' suites run to their end on a busy machine: no constant wall-clock limit, only a stall watchdog (issue 61)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.conftest import run_peer_suite


def test_a_slow_suite_that_keeps_printing_runs_to_its_end():
    code = "import time\nfor i in range(4):\n    print('.', end='', flush=True); time.sleep(1.5)\nprint(' 4 passed')"
    done = run_peer_suite([sys.executable, "-c", code], stall_seconds=3)
    assert done.returncode == 0 and done.stdout == ".... 4 passed\n"  # 6 s in all: twice the stall limit


def test_a_silent_suite_is_stopped_as_stalled_and_says_so():
    done = run_peer_suite(
        [sys.executable, "-c", "print('x', flush=True); import time; time.sleep(60)"], stall_seconds=3
    )
    assert done.returncode != 0 and done.stdout == "x\n" and "stalled: no output for 3 s" in done.stderr


def test_no_test_gives_a_peer_suite_a_wall_clock_timeout():
    """A subprocess call that runs pytest (a peer's suite, or ours under another install) takes no ``timeout=``:
    a loaded machine slows it without breaking it (tests/conftest.py: run_peer_suite)."""
    offenders = []
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            words = [c.value for c in ast.walk(node.args[0]) if isinstance(c, ast.Constant)]
            if "pytest" in words and any(k.arg == "timeout" for k in node.keywords):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders
