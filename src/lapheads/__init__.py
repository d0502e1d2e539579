"""lapheads: Laplacian heads for transformers (Zhang & Papyan, arXiv 2602.09297).

A Laplacian head outputs (I - P) V = V - P V instead of P V. This package provides the op
(:func:`laplacian_attention`), a drop-in for ``timm.layers.Attention`` (:class:`LaplacianAttention`) and the one
head-spec parser every model and the CLI share (:func:`parse_laplacian_heads`); models are timm ViTs
(:func:`create_vit`) and a nanochat-style GPT (:class:`GPT`).
"""

import os as _os
import sys as _sys
from importlib.metadata import PackageNotFoundError, version

# The lapheads command (not a library import) picks its threads and OpenMP wait policy from the free CPUs, which
# only takes effect before torch loads OpenMP: see lapheads.hardware.
if _sys.argv and _os.path.basename(_sys.argv[0]) in ("lapheads", "-m") and "torch" not in _sys.modules:
    from lapheads.hardware import apply_cli_thread_policy

    apply_cli_thread_policy(_sys.argv[1:])

from lapheads import _moved

_moved.install()  # old import paths (lapheads.attention, lapheads.hf, ...) of modules that moved into folders

from lapheads.core import (  # noqa: E402
    HeadSpec,
    HeadSpecError,
    LaplacianAttention,
    laplacian_attention,
    laplacian_attention_reference,
    laplacian_head_mask,
    parse_laplacian_heads,
)
from lapheads.models import GPT, GPTConfig, create_vit, load_nanochat  # noqa: E402 also registers lapheads' timm model names

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
