"""lapheads: Laplacian heads for transformers (Zhang & Papyan, arXiv 2602.09297).

A Laplacian head outputs (I - P) V = V - P V instead of P V. This package provides the op
(:func:`laplacian_attention`), a drop-in for ``timm.layers.Attention`` (:class:`LaplacianAttention`) and the one
head-spec parser every model and the CLI share (:func:`parse_laplacian_heads`); models are timm ViTs
(:func:`create_vit`) and a nanochat-style GPT (:class:`GPT`).
"""

import os as _os
import sys as _sys
from importlib.metadata import PackageNotFoundError, version

_COMMAND = bool(_sys.argv) and _os.path.basename(_sys.argv[0]) in ("lapheads", "-m")
# `lapheads`, `lapheads --help` and `lapheads --version` answer from the parser alone: no torch, no busy probe
_ANSWERS_ALONE = _COMMAND and (_sys.argv[1:] in ([], ["-h"], ["--help"], ["--version"]))

# The lapheads command (not a library import) picks its threads and OpenMP wait policy from the free CPUs, which
# only takes effect before torch loads OpenMP: see lapheads.hardware.
if _COMMAND and not _ANSWERS_ALONE and "torch" not in _sys.modules:
    from lapheads.hardware import apply_cli_thread_policy

    apply_cli_thread_policy(_sys.argv[1:])

_PUBLIC = {
    "HeadSpec": "lapheads.core",
    "HeadSpecError": "lapheads.core",
    "LaplacianAttention": "lapheads.core",
    "laplacian_attention": "lapheads.core",
    "laplacian_attention_reference": "lapheads.core",
    "laplacian_head_mask": "lapheads.core",
    "parse_laplacian_heads": "lapheads.core",
    "GPT": "lapheads.models",
    "GPTConfig": "lapheads.models",
    "create_vit": "lapheads.models",
    "load_nanochat": "lapheads.models",
}

if not _ANSWERS_ALONE:
    from lapheads.core import (  # noqa: E402
        HeadSpec,
        HeadSpecError,
        LaplacianAttention,
        laplacian_attention,
        laplacian_attention_reference,
        laplacian_head_mask,
        parse_laplacian_heads,
    )
    from lapheads.models import GPT, GPTConfig, create_vit, load_nanochat  # noqa: E402 also registers timm names
else:

    def __getattr__(name: str):  # the command's quick answers import nothing; a later use still finds the name
        if name in _PUBLIC:
            import importlib

            return getattr(importlib.import_module(_PUBLIC[name]), name)
        raise AttributeError(f"module 'lapheads' has no attribute {name!r}")


try:
    __version__ = version("lapheads")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "GPT",
    "GPTConfig",
    "HeadSpec",
    "HeadSpecError",
    "LaplacianAttention",
    "__version__",
    "create_vit",
    "laplacian_attention",
    "laplacian_attention_reference",
    "laplacian_head_mask",
    "load_nanochat",
    "parse_laplacian_heads",
]
