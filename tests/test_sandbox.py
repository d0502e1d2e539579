"""The HumanEval sandbox: passing, failing, endless and escaping programs."""

from __future__ import annotations

import uuid
from pathlib import Path

from lapheads.sandbox import run_program
from tests.conftest import processes_with


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


# ------------------------------------------------------------------------------------------------------------------
# Truthful scoring: only a program whose last statement ran passes; every exit trick, escape and bomb of issue 28
# is a row of tests/red_team/

import os  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from lapheads import sandbox  # noqa: E402


def test_an_exit_after_a_failing_check_registered_in_atexit_fails(layers):
    program = "import atexit, os\natexit.register(lambda: os._exit(0))\nassert 1 + 1 == 3\n"
    assert run_program(program).status == "failed"


def test_a_correct_program_passes_and_prints(layers):
    result = run_program("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')\n")
    assert result.status == "passed" and result.output.strip() == "ok"


def test_humaneval_scores_a_right_answer_with_exit_zero_and_a_right_one_one():
    from lapheads.evals.lm import score_completions

    row = {
        "task_id": "t/0",
        "prompt": "def add(a, b):\n",
        "entry_point": "add",
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    }
    completions = [["    print(5)\n    return 0\nexit()\n", "    return a + b\n"]]
    out = score_completions([row], completions, ks=(1,), timeout=5, progress=False, unsafe_code_execution=True)
    assert out["samples"]["passed"] == 1 and out["samples"]["failed"] == 1
    assert out["sandbox"] == sandbox.containment()  # every result says what held the code
    assert sandbox.containment().startswith("bubblewrap" if sandbox.boundary_tool() else "guard only: not a boundary")


ESCAPED_CHILD = """
import sys, time
vars(sys)["meta_path"].pop(0)  # undo the guard's import block, as hostile code would
import ctypes
libc = ctypes.CDLL(None)
if libc.fork() == 0:
    libc.setsid()  # leaves the session the parent kills
    libc.execl(b"/bin/sleep", b"sleep", b"{seconds}", None)
time.sleep({parent})
"""


@pytest.mark.parametrize("parent_sleeps", [0, 60], ids=["parent exits", "parent times out"])
def test_a_setsid_child_is_killed_and_the_call_keeps_its_deadline(parent_sleeps, layers):
    seconds = f"75.{os.getpid()}{parent_sleeps}"  # a unique command line to look for afterwards
    start = time.monotonic()
    result = run_program(ESCAPED_CHILD.format(seconds=seconds, parent=parent_sleeps), timeout=3)
    assert time.monotonic() - start <= 3 + 2
    assert result.status == ("timeout" if parent_sleeps else "passed")
    time.sleep(0.2)
    assert processes_with(seconds) == []


def test_an_output_flood_is_drained_with_a_cap_and_a_deadline(layers):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    result = run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", timeout=2)
    assert result.status == "timeout" and time.monotonic() - start <= 2 + 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KB: far below the flood


def test_stdin_is_closed(layers):
    assert run_program("import sys\nassert sys.stdin.read() == ''\n").status == "passed"


SHARED_MEMORY_FILES = """
import os, sys
vars(sys)["meta_path"].pop(0)  # past the guard's import block, as hostile code would: the boundary must hold
import _posixshmem
for i in range(20):
    fd = _posixshmem.shm_open(f"/lapheads-{i}", os.O_CREAT | os.O_RDWR, 0o600)
    os.write(fd, b"x" * (8 << 20))
"""


@pytest.mark.parametrize(
    "program",
    ["for i in range(20):\n    open(f'f{i}', 'wb').write(b'x' * (8 << 20))\n", SHARED_MEMORY_FILES],
    ids=["work folder", "/dev/shm"],
)
def test_the_writable_space_has_a_disk_quota(program):
    """Every writable place inside the boundary is bounded; /dev/shm (a folder of bwrap's /dev tmpfs, which has no
    size) took 600 MB past a 64 MB quota (issue 60)."""
    if sandbox.boundary_tool() is None:
        pytest.skip("bubblewrap is not usable here")
    result = run_program(program, max_file_mb=16, max_disk_mb=32)
    assert result.status == "failed" and "No space left" in result.output, result


def test_an_interpreter_under_tmp_stays_visible_inside_the_boundary(monkeypatch):
    # a venv in a checkout under /tmp (CI's fresh clones): its bind must come after the tmpfs mounted on /tmp
    monkeypatch.setattr(sandbox, "_executable_dirs", lambda: ["/tmp/checkout/.venv"])
    args = sandbox._bwrap_args("/tmp/work")
    tmpfs = max(i for i, a in enumerate(args) if a == "--tmpfs" and args[i + 1] == "/tmp")
    bind = next(i for i, a in enumerate(args) if a == "--ro-bind" and args[i + 1] == "/tmp/checkout/.venv")
    assert bind > tmpfs


def test_without_a_boundary_code_evaluation_refuses_unless_the_user_opts_in_knowingly(monkeypatch, capsys, tmp_path):
    """Issue 60: the in-process guard is not a boundary, so it is never the only thing between a model's code and the
    user's files unless the user says so with a flag whose name says what it is; the result records which."""
    from lapheads.cli import main
    from lapheads.errors import InputError
    from lapheads.evals.lm import score_completions

    monkeypatch.setattr(sandbox, "boundary_tool", lambda: None)
    row = {"task_id": "t/0", "prompt": "def add(a, b):\n", "entry_point": "add",
           "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"}  # fmt: skip
    solved = [["    return a + b\n"]]
    with pytest.raises(InputError, match="install bubblewrap .* or pass --unsafe-code-execution"):
        score_completions([row], solved, progress=False)
    out = score_completions([row], solved, progress=False, unsafe_code_execution=True)
    assert out["pass@1"] == 1.0 and out["unsafe_code_execution"] is True and out["sandbox"].startswith("guard only")
    # the command refuses before it reads a model or data: one line, exit 2
    assert main(["eval", "lm", str(tmp_path / "no-run"), "--benchmarks", "humaneval"]) == 2
    assert "--unsafe-code-execution" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["eval", "chat", str(tmp_path / "no-run"), "--benchmarks", "humaneval"]) == 2
    assert "--unsafe-code-execution" in capsys.readouterr().err.strip().splitlines()[-1]
