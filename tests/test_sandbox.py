"""The HumanEval sandbox: passing, failing, endless and escaping programs."""

from __future__ import annotations

import uuid
from pathlib import Path

from lapheads.sandbox import run_program


def test_passing_and_failing_programs():
    assert run_program("def f(x):\n    return x * 2\nassert f(3) == 6\n").status == "passed"
    failed = run_program("assert 1 + 1 == 3, 'arithmetic'\n")
    assert failed.status == "failed" and "AssertionError: arithmetic" in failed.output


def test_an_endless_loop_is_killed_at_the_timeout():
    result = run_program("while True:\n    pass\n", timeout=1.5)
    assert result.status == "timeout"


def test_writes_and_deletions_outside_the_temporary_directory_are_refused(tmp_path):
    target = Path("/tmp") / f"lapheads-escape-{uuid.uuid4().hex}"
    for program in (
        f"open({str(target)!r}, 'w').write('x')\n",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')\n",
        f"import os\nos.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))\n",
        f"import shutil\nshutil.copy('/etc/hostname', {str(target)!r})\n",
        "import os\nos.system('true')\n",
        "import subprocess\nsubprocess.run(['true'])\n",
    ):
        result = run_program(program)
        assert result.status == "failed" and "PermissionError: sandbox" in result.output, program
        assert not target.exists()
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    assert run_program(f"import os\nos.remove({str(keep)!r})\n").status == "failed" and keep.exists()


def test_work_inside_the_temporary_directory_is_allowed_and_cleaned_up():
    program = (
        "import os\nos.mkdir('d')\nopen('d/x.txt', 'w').write('hi')\nassert open('d/x.txt').read() == 'hi'\n"
        "os.remove('d/x.txt')\nprint(os.getcwd())\n"
    )
    result = run_program(program)
    assert result.status == "passed"
    workdir = result.output.strip().splitlines()[-1]
    assert workdir.startswith("/") and not __import__("os").path.exists(workdir)  # the sandbox's folder is gone


def test_memory_is_limited():
    result = run_program("block = bytearray(3 * 1024**3)\n", memory_mb=512)
    assert result.status == "failed" and "MemoryError" in result.output
