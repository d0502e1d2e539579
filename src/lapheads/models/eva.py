"""Laplacian heads in timm's EVA family (EVA-02, EVA, PE, ...): ``LaplacianEvaAttention``, the same module with the
one op in place of SDPA.

timm's ``Eva`` takes no ``attn_layer`` argument, so :func:`convert_eva` turns a built model's ``EvaAttention``
modules into ``LaplacianEvaAttention`` in place (the subclass adds behaviour only: parameters, state dict and
timm's pretrained weights stay those of the plain model). With 0 Laplacian heads the output is timm's exactly.
Rotary embeddings are applied to q and k before the op, as in EVA; the identity term is each token's own value.
"""

from __future__ import annotations

#: what waits for this module to be whole: the front door (lapheads/__init__.py) registers lapheads' other timm
#: names here where this module's import of timm is what loaded timm (vit imports this module: it must be whole)
WHEN_LOADED: list = []

# ruff: noqa: E402 - the list above must exist before the import of timm below
from typing import Optional

import torch
import torch.nn.functional as F
from timm.layers import apply_rot_embed_cat
from timm.models import generate_default_cfgs, register_model
from timm.models.eva import Eva, EvaAttention

from lapheads.core.heads import parse_heads
from lapheads.core.mixin import LaplacianHeadsMixin
from lapheads.core.modules import convert_attention
from lapheads.models.registry import converted_entry, untrained_cfg

__all__ = ["LaplacianEvaAttention", "convert_eva"]


class LaplacianEvaAttention(LaplacianHeadsMixin, EvaAttention):
    """``timm.models.eva.EvaAttention`` whose heads go through ``lapheads.laplacian_attention`` (or the reference
    path when ``fused_attn`` is off). Built by :func:`convert_eva` from a plain module."""

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        b, n, c = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self._qkv(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # EVA's rotary embedding on the patch tokens, prefix tokens left as they are
            npt = self.num_prefix_tokens
            half = getattr(self, "rotate_half", False)
            q = torch.cat([q[:, :, :npt], apply_rot_embed_cat(q[:, :, npt:], rope, half=half)], dim=2).type_as(v)
            k = torch.cat([k[:, :, :npt], apply_rot_embed_cat(k[:, :, npt:], rope, half=half)], dim=2).type_as(v)
        x, _ = self._attend(q, k, v, attn_mask, is_causal, False)
        x = self.norm(x.transpose(1, 2).reshape(b, n, c))
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, H, N, D) as EvaAttention builds them: one fused projection (with its split biases) or three;
        written as timm writes it, so TorchScript compiles it too."""
        b, n, _ = x.shape
        if self.qkv is not None:
            if self.q_bias is None:
                qkv = self.qkv(x)
            else:
                bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
                qkv = self.qkv(x) + bias if self.qkv_bias_separate else F.linear(x, self.qkv.weight, bias)
            qkv = qkv.reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
            return qkv[0], qkv[1], qkv[2]
        q = self.q_proj(x).reshape(b, n, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(x).reshape(b, n, self.num_heads, -1).transpose(1, 2)
        v = self.v_proj(x).reshape(b, n, self.num_heads, -1).transpose(1, 2)
        return q, k, v


def convert_eva(model: Eva, laplacian_heads: object) -> Eva:
    """Give every attention layer of a timm ``Eva`` model its heads (any spec the one parser reads, per layer too;
    "local" heads need an untied projection EVA does not have and are refused in one line)."""
    layers = [m for m in model.modules() if isinstance(m, EvaAttention)]
    convert_attention(layers, LaplacianEvaAttention, parse_heads(laplacian_heads, [m.num_heads for m in layers]))
    return model


# timm names: EVA-02 tiny (3 heads) with k Laplacian heads per layer, e.g. eva02_tiny_1L_patch14_224; registered from
# this module (timm's registry then files them under "eva", beside timm's own EVA names)
_BASE, _HEADS = "eva02_tiny_patch14_224", 3
default_cfgs = generate_default_cfgs({f"eva02_tiny_{k}L_patch14_224": untrained_cfg(_BASE) for k in range(_HEADS + 1)})
for _k in range(_HEADS + 1):
    register_model(converted_entry(f"eva02_tiny_{_k}L_patch14_224", _BASE, convert_eva, _k, __name__))

for _then in WHEN_LOADED:  # what waited for this module to be whole (timm's other names: see WHEN_LOADED)
    _then()
WHEN_LOADED.clear()
