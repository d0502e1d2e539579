"""The thing a user imports: the head-spec parser, the head kinds, the op, the timm module and the conversion of
pretrained heads."""

#: callables to run once this package has loaded: the front door registers lapheads' timm names here where the
#: import of the timm drop-in below is what loaded timm (they need the whole of core)
WHEN_LOADED: list = []

# ruff: noqa: E402 - the list above must exist before the drop-in's import loads timm
from lapheads.core.attention import IDENTITIES, laplacian_attention, laplacian_attention_reference
from lapheads.core.heads import (
    HEAD_SPEC,
    HEAD_SPEC_PATTERN,
    HeadSpec,
    HeadSpecError,
    LayerHeads,
    parse_heads,
)
from lapheads.core.kinds import HEAD_KINDS, KIND_COEFFICIENTS, is_plain_laplacian
from lapheads.core.modules import LaplacianAttention, LaplacianHeadsMixin

for _then in WHEN_LOADED:  # what had to wait for the whole of core (lapheads/__init__.py: timm's names)
    _then()
WHEN_LOADED.clear()

__all__ = [
    "HEAD_KINDS",
    "HEAD_SPEC",
    "HEAD_SPEC_PATTERN",
    "IDENTITIES",
    "KIND_COEFFICIENTS",
    "HeadSpec",
    "HeadSpecError",
    "LaplacianAttention",
    "LaplacianHeadsMixin",
    "LayerHeads",
    "is_plain_laplacian",
    "laplacian_attention",
    "laplacian_attention_reference",
    "parse_heads",
]
