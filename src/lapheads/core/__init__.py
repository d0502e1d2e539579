"""The thing a user imports: the head-spec parser, the head kinds, the op, the timm module and the conversion of
pretrained heads.

Each name is imported when first used (module ``__getattr__``), so ``from lapheads import laplacian_attention`` or
``from lapheads.core.heads import parse_heads`` loads torch and the op, not timm: only the timm drop-in
(:class:`LaplacianAttention`, ``lapheads.core.modules``) loads timm."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the public names, for readers and type checkers; at run time __getattr__ imports them on use
    from lapheads.core.attention import (
        IDENTITIES,
        AttentionPlan,
        explain_attention,
        laplacian_attention,
        laplacian_attention_reference,
    )
    from lapheads.core.heads import HeadSpec, HeadSpecError, LayerHeads, parse_heads
    from lapheads.core.kinds import KIND_COEFFICIENTS, is_plain_laplacian
    from lapheads.core.mixin import LaplacianHeadsMixin
    from lapheads.core.modules import LaplacianAttention
    from lapheads.core.vocabulary import HEAD_KINDS, HEAD_SPEC, HEAD_SPEC_PATTERN

#: each public name's module
_PUBLIC = {
    **dict.fromkeys(
        ("IDENTITIES", "AttentionPlan", "explain_attention", "laplacian_attention", "laplacian_attention_reference"),
        "attention",
    ),
    **dict.fromkeys(("HeadSpec", "HeadSpecError", "LayerHeads", "parse_heads"), "heads"),
    **dict.fromkeys(("KIND_COEFFICIENTS", "is_plain_laplacian"), "kinds"),
    **dict.fromkeys(("HEAD_KINDS", "HEAD_SPEC", "HEAD_SPEC_PATTERN"), "vocabulary"),
    "LaplacianHeadsMixin": "mixin",
    "LaplacianAttention": "modules",
}

__all__ = [
    "AttentionPlan",
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
    "explain_attention",
    "is_plain_laplacian",
    "laplacian_attention",
    "laplacian_attention_reference",
    "parse_heads",
]


def __getattr__(name: str):
    """A public name from its module, or one of core's modules by attribute (``lapheads.core.convert``)."""
    import importlib

    from lapheads.submodules import submodule_getattr

    if name in _PUBLIC:
        return getattr(importlib.import_module(f"lapheads.core.{_PUBLIC[name]}"), name)
    return submodule_getattr(__name__)(name)
