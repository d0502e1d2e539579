"""timm names for the attention families lapheads converts (EVA, Swin): ``<base>`` with k Laplacian heads per layer.

timm's ``Eva`` and ``SwinTransformer`` take no ``attn_layer``, so each name builds timm's own architecture through
timm's own entry point (features_only, pretrained_cfg and every timm argument behave as for the base name) and then
converts its attention modules in place with the family's ``convert_*``. The names have no published weights: a
Laplacian head changes what the pretrained function computes, so ``pretrained=True`` is refused with the way to
convert timm's weights instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lapheads.errors import InputError

__all__ = ["converted_entry", "untrained_cfg"]

#: pretrained-weight fields of a cfg: an untrained name has none (timm's tests then skip its weight loading)
_WEIGHT_FIELDS = ("url", "hf_hub_id", "hf_hub_filename", "file", "state_dict", "tag", "architecture", "license",
                  "paper_ids", "paper_name", "notes", "origin_url")  # fmt: skip


def untrained_cfg(base: str) -> dict[str, Any]:
    """timm's pretrained cfg of ``base`` (input size, normalisation, classifier, ...) without its weights."""
    # timm is imported where it is used: this helper module alone then never loads timm (models/__init__.py)
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(base).to_dict()
    return {key: value for key, value in cfg.items() if key not in _WEIGHT_FIELDS} | {"url": ""}


def converted_entry(
    name: str, base: str, convert: Callable[[torch.nn.Module, object], torch.nn.Module], k: int, module: str
) -> Callable[..., torch.nn.Module]:
    """A timm entry point ``name``: timm's ``base`` with its attention converted, k heads per layer Laplacian
    (``laplacian_heads=SPEC`` overrides it, any spec the one parser reads)."""

    def build(pretrained: bool = False, **kwargs: Any) -> torch.nn.Module:
        from timm.models import get_pretrained_cfg
        from timm.models._registry import model_entrypoint  # noqa: PLC2701 - timm has no public entry-point lookup

        if pretrained:
            raise InputError(
                f"pretrained=True: {name} has no published weights (Laplacian heads change the pretrained "
                f"function); allowed: timm.create_model({base!r}, pretrained=True), then "
                f"{module}.{convert.__name__}(model, {k})"
            )
        heads = kwargs.pop("laplacian_heads", k)
        if kwargs.get("pretrained_cfg") is None:  # else timm's builder would resolve the base name's (with weights)
            kwargs["pretrained_cfg"] = get_pretrained_cfg(name)
        return convert(model_entrypoint(base)(pretrained=False, **kwargs), heads)

    build.__name__, build.__module__ = name, module
    build.__doc__ = f"timm's {base} with {k} Laplacian heads in every attention layer (no published weights)."
    return build
