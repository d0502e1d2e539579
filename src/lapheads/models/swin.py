"""Laplacian heads in timm's Swin Transformer: ``LaplacianWindowAttention``, window attention through the one op.

timm's ``SwinTransformer`` takes no ``attn_layer`` argument, so :func:`convert_swin` turns a built model's
``WindowAttention`` modules into ``LaplacianWindowAttention`` in place (behaviour only: parameters, state dict and
timm's weights are the plain model's). Each window is one sequence: a Laplacian head outputs V - P V within its
window, with P from the relative-position bias and the shifted-window mask as an additive mask (timm's fused path).
Stages have different head counts, so a spec is read per layer against that layer's heads
(``parse_heads``, each layer against its own head count): an int k makes the trailing k heads of every layer Laplacian.
"""

from __future__ import annotations

#: what waits for this module to be whole: the front door (lapheads/__init__.py) registers lapheads' other timm
#: names here where this module's import of timm is what loaded timm (vit imports this module: it must be whole)
WHEN_LOADED: list = []

# ruff: noqa: E402 - the list above must exist before the import of timm below
from typing import Optional

import torch
from timm.models import generate_default_cfgs, register_model
from timm.models.swin_transformer import SwinTransformer, WindowAttention

from lapheads.core.heads import parse_heads
from lapheads.core.mixin import LaplacianHeadsMixin
from lapheads.core.modules import convert_attention
from lapheads.models.registry import converted_entry, untrained_cfg

__all__ = ["LaplacianWindowAttention", "convert_swin"]


class LaplacianWindowAttention(LaplacianHeadsMixin, WindowAttention):
    """``timm.models.swin_transformer.WindowAttention`` whose heads go through ``lapheads.laplacian_attention`` (or
    the reference path when ``fused_attn`` is off). Built by :func:`convert_swin` from a plain module."""

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, n, _ = x.shape  # b = windows x batch
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attn_mask = self._get_rel_pos_bias()  # (1, H, N, N), additive
        if mask is not None:  # shifted windows: (windows, N, N) of 0 / -100, the same for every image
            windows = mask.shape[0]
            mask = mask.view(1, windows, 1, n, n).expand(b // windows, -1, self.num_heads, -1, -1)
            attn_mask = attn_mask + mask.reshape(-1, self.num_heads, n, n)
        x, _ = self._attend(q, k, v, attn_mask.to(q.dtype), False, False)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, -1)))


def convert_swin(model: SwinTransformer, laplacian_heads: object) -> SwinTransformer:
    """Give every window-attention layer of a timm ``SwinTransformer`` its heads (any spec the one parser reads,
    per layer against that layer's head count; "local" heads are refused in one line)."""
    layers = [m for m in model.modules() if isinstance(m, WindowAttention)]
    convert_attention(layers, LaplacianWindowAttention, parse_heads(laplacian_heads, [m.num_heads for m in layers]))
    return model


# timm names: Swin-T (3, 6, 12, 24 heads per stage) with the trailing k heads of every layer Laplacian, e.g.
# swin_tiny_1L_patch4_window7_224
_BASE, _MIN_HEADS = "swin_tiny_patch4_window7_224", 3
default_cfgs = generate_default_cfgs(
    {f"swin_tiny_{k}L_patch4_window7_224": untrained_cfg(_BASE) for k in range(_MIN_HEADS + 1)}
)
for _k in range(_MIN_HEADS + 1):
    register_model(converted_entry(f"swin_tiny_{_k}L_patch4_window7_224", _BASE, convert_swin, _k, __name__))

for _then in WHEN_LOADED:  # what waited for this module to be whole (timm's other names: see WHEN_LOADED)
    _then()
WHEN_LOADED.clear()
