"""`import lapheads` is light (issue 61): it loads neither timm nor torchvision until a model is asked for, and
lapheads' timm names still resolve in timm.create_model, whichever of the two is imported first."""

from __future__ import annotations

import subprocess
import sys

import pytest

ORDERS = {
    "lapheads, then timm": "import lapheads, timm",
    "timm, then lapheads": "import timm, lapheads",
    "the drop-in first": "from lapheads import LaplacianAttention; import timm",
    "a model module first": "import lapheads.models.vit, timm",
    # each module of lapheads.models that imports timm ends by importing vit, which registers every family
    "another model module first": "import lapheads.models.eva, timm",
    "the timm registry helper first": "import lapheads.models.registry, timm",
    "the GPT first (it loads no timm)": "import lapheads.models.gpt, timm",
    "the models package first": "import lapheads.models, timm",
    "the op first": "import lapheads.core.attention, timm",
    "the head-spec parser first": "import lapheads.core.heads, timm",
    "the drop-in's module first": "import lapheads.core.modules, timm",
    # transformers asks importlib.util.find_spec("timm") on import (is_timm_available) without importing it: the
    # README's second block did exactly this, and its names were then unknown to timm
    "lapheads, a probe for timm, then timm": "import importlib.util, lapheads\n"
    "importlib.util.find_spec('timm')\nimport timm",
    "lapheads, transformers, then timm": "import lapheads, transformers, timm",
}


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_import_lapheads_loads_neither_timm_nor_torchvision():
    assert _run("import sys, lapheads; print(sorted({'timm', 'torchvision'} & set(sys.modules)))") == "[]"


@pytest.mark.parametrize(
    "line",
    [
        "from lapheads import laplacian_attention",
        "from lapheads.core import parse_heads, LayerHeads",
        "from lapheads import GPT",  # issue 74: the GPT's mixin lived in timm's drop-in module
    ],
)
def test_the_op_and_the_parser_load_torch_but_neither_timm_nor_torchvision(line):
    """Issue 75: `from lapheads import laplacian_attention`, the one line a user needs for the op, took ~10 s and
    loaded timm and torchvision (lapheads.core imported the timm drop-in eagerly)."""
    code = f"import sys\n{line}\nprint(sorted({{'timm', 'torchvision', 'torch'}} & set(sys.modules)))"
    assert _run(code) == "['torch']"


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_lapheads_timm_names_resolve_whichever_is_imported_first(order):
    names = ["deit3_small_3L_patch16_224", "eva02_tiny_1L_patch14_224", "swin_tiny_1L_patch4_window7_224"]
    code = f"{ORDERS[order]}\nprint(all(timm.is_model(n) for n in {names!r}))"
    assert _run(code) == "True"


def test_the_public_names_are_there_when_used():
    code = (
        "import lapheads\n"
        "print(lapheads.GPT.__name__, lapheads.LaplacianAttention.__name__, callable(lapheads.laplacian_attention))"
    )
    assert _run(code) == "GPT LaplacianAttention True"
