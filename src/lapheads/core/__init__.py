"""The thing a user imports: the head-spec parser, the op, the timm module and the conversion of pretrained heads."""

from lapheads.core.attention import IDENTITIES, laplacian_attention, laplacian_attention_reference
from lapheads.core.heads import (
    HEAD_KINDS,
    HEAD_SPEC,
    HEAD_SPEC_PATTERN,
    KIND_COEFFICIENTS,
    HeadSpec,
    HeadSpecError,
    format_head_mask,
    is_plain_laplacian,
    laplacian_head_mask,
    parse_head_kinds,
    parse_laplacian_heads,
    parse_spec_arms,
)
from lapheads.core.modules import LaplacianAttention, LaplacianHeadsMixin

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
    "format_head_mask",
    "is_plain_laplacian",
    "laplacian_attention",
    "laplacian_attention_reference",
    "laplacian_head_mask",
    "parse_head_kinds",
    "parse_laplacian_heads",
    "parse_spec_arms",
]
