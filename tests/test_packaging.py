"""The source package: the library and its docs, and no test suite it could not run (issue 61: it held 11 of 92
test files and no conftest.py)."""

import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_source_package_ships_the_library_and_no_tests(tmp_path):
    build = "from setuptools import build_meta; print(build_meta.build_sdist(__import__('sys').argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    with tarfile.open(tmp_path / done.stdout.strip().splitlines()[-1]) as sdist:
        names = [name.split("/", 1)[1] for name in sdist.getnames() if "/" in name]
    assert "src/lapheads/core/attention.py" in names and "README.md" in names
    assert "src/lapheads/core/csrc/laplacian_sdpa.cpp" in names  # the native node's source builds on the user's CPU
    assert not [name for name in names if name.startswith("tests/")]
