"""The lower bounds pyproject states are versions lapheads works with: the Hugging Face extra's transformers floor,
installed from PyPI beside (not into) the environment, passes lapheads' own Hugging Face tests.

The floor is read from pyproject.toml, so a lowered bound is checked, not assumed. Its huggingface_hub, tokenizers
and kernels are the newest its own metadata allows (transformers checks or imports them on import). Measured 2026-12-03:
transformers 5.0.0-5.3.0 fail (5.0: GPT-2's attention maps never come back; a saved Laplacian model loads as plain
SDPA in a process that never imported lapheads), 5.4.0 and later pass. Slow: it downloads ~15 MB.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.conftest import run_peer_suite

ROOT = Path(__file__).resolve().parents[2]


def _floor(extra: str, package: str) -> str:
    """The ``>=`` bound of ``package`` in pyproject's ``extra``."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for requirement in extras[extra]:
        found = re.fullmatch(rf"{package}>=([\w.]+)", requirement.replace(" ", ""))
        if found:
            return found.group(1)
    raise AssertionError(f"pyproject's [{extra}] states no {package}>= bound")


def _requirement(metadata: str, package: str) -> str:
    found = re.search(rf"^Requires-Dist: {package}\s*([^;\n]*)(;.*)?$", metadata, flags=re.M | re.I)  # any extra's
    return f"{package}{found.group(1).replace(' ', '')}" if found else package


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *args], check=True, timeout=600)


@pytest.mark.slow
def test_the_stated_transformers_floor_passes_lapheads_hugging_face_tests(tmp_path):
    version = _floor("hf", "transformers")
    target = tmp_path / "floor"
    try:
        _pip("--target", str(target), f"transformers=={version}")
    except subprocess.CalledProcessError:
        pytest.skip("PyPI is not reachable here")
    (info,) = target.glob("transformers-*.dist-info")  # "5.4" installs as 5.4.0
    metadata = (info / "METADATA").read_text()
    # the floor's own hub, tokenizers and kernels ranges shadow the environment's newer ones (kernels 0.19, which
    # the current transformers requires, changed an API that 5.4 calls on import; 5.4 allows kernels <0.13)
    own = [_requirement(metadata, package) for package in ("huggingface-hub", "tokenizers", "kernels")]
    _pip("--target", str(target), *own, "typer-slim")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert probe.stdout.strip() == info.name.removeprefix("transformers-").removesuffix(".dist-info"), probe.stderr
    tests = run_peer_suite(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests/integrations/test_hf.py")],
        env=env, cwd=ROOT,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-3000:]
