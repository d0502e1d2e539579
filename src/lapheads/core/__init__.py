"""The thing a user imports: the head-spec parser, the head kinds, the op, the timm module and the conversion of
pretrained heads."""

from lapheads.core.attention import IDENTITIES, laplacian_attention, laplacian_attention_reference
from lapheads.core.heads import (
    HEAD_SPEC,
    HEAD_SPEC_PATTERN,
    HeadSpec,
    HeadSpecError,
    format_head_mask,
    laplacian_head_mask,
    parse_head_kinds,
    parse_laplacian_heads,
    parse_spec_arms,
)
from lapheads.core.kinds import HEAD_KINDS, KIND_COEFFICIENTS, is_plain_laplacian
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
