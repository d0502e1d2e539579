"""The timm-compatible module: ``LaplacianAttention`` (a drop-in for ``timm.layers.Attention``) built on
``LaplacianHeadsMixin`` (``lapheads.core.mixin``, which keeps one layer's heads for any attention module), and
``convert_attention`` for the timm families without ``attn_layer``.

TorchScript scripts the module and FX traces it: the op is one leaf of both (the mixin's ``fused_leaf`` and
``reference_leaf``), registered below with timm's feature extraction.
"""

from __future__ import annotations

#: callables to run once this module has loaded: the front door (lapheads/__init__.py) registers lapheads' timm
#: names here where this module's import of timm is what loaded timm (registering needs this module whole)
WHEN_LOADED: list = []

# ruff: noqa: E402 - the list above must exist before the import of timm below
import typing
from collections.abc import Sequence
from typing import Optional, Tuple  # TorchScript reads typing.Optional / Tuple in string annotations

import torch
from timm.layers import Attention

from lapheads.core.heads import HeadSpec, HeadSpecError, LayerHeads
from lapheads.core.mixin import LaplacianHeadsMixin, fused_leaf, reference_leaf

__all__ = ["LaplacianAttention", "convert_attention"]


class LaplacianAttention(LaplacianHeadsMixin, Attention):
    """``timm.layers.Attention`` with Laplacian heads: same arguments, parameters and state dict, plus a head spec.

    A timm Attention state dict loads with ``strict=True`` (the head mask is a non-persistent buffer), and with
    ``laplacian_heads=0`` the output equals timm's for the same weights. timm's ``fused_attn`` flag picks the fused
    op (``laplacian_attention``) or the reference path (``laplacian_attention_reference``).

    Args:
        dim: input dimension of the tokens.
        num_heads: number of attention heads.
        *args, **kwargs: every other ``timm.layers.Attention`` argument (qkv_bias, qk_norm, attn_drop, ...).
        laplacian_heads: int k (trailing k heads) or a bool mask of length num_heads.
    """

    def __init__(self, dim: int, num_heads: int = 8, *args, laplacian_heads: HeadSpec = 0, **kwargs) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        if not hasattr(self, "gate"):  # timm before gated attention
            self.gate = None
        self.local_v = self.local_o = None
        self.untied_v = self.untied_v_bias = self.untied_o = None
        self._untied_heads: list[int] = []
        self._init_laplacian_heads(num_heads, laplacian_heads, kwargs.get("device"))

    def _make_local(self, num_local: int, untied_heads: list[int]) -> None:
        """ "local" heads: their own value (W_V', initialised as timm's ViT initialises a Linear) and output
        (W_O', zero, like the model's output projections at the start) weights, untied from W_V and W_O.
        "untied" heads: W_V', W_O' (and W_V's bias) that start as copies of their head's W_V and W_O, so the head
        starts as exactly the Laplacian head (-W_O P V + W_O W_V x) and training only releases the tie. They are
        plain Parameters filled by copying (no random draw), so a model with untied heads starts from the same
        weights as the Laplacian model of the same seed."""
        device, dtype = self.qkv.weight.device, self.qkv.weight.dtype
        if num_local:
            width = num_local * self.head_dim
            self.local_v = torch.nn.Linear(
                self.qkv.in_features, width, bias=self.qkv.bias is not None, device=device, dtype=dtype
            )
            self.local_o = torch.nn.Linear(width, self.proj.out_features, bias=False, device=device, dtype=dtype)
        else:
            self.local_v = self.local_o = None
        self._untied_heads = list(untied_heads)
        if untied_heads:
            if not isinstance(self.norm, torch.nn.Identity):  # proj(norm(heads)) is no sum over heads to copy
                raise HeadSpecError("'untied' heads need scale_norm=False (a norm before proj mixes the heads)")
            width = len(untied_heads) * self.head_dim
            empty = lambda *shape: torch.nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))  # noqa: E731
            self.untied_v = empty(width, self.qkv.in_features)
            self.untied_v_bias = empty(width) if self.qkv.bias is not None else None
            self.untied_o = empty(self.proj.out_features, width)
        else:
            self.untied_v = self.untied_v_bias = self.untied_o = None
        if (num_local or untied_heads) and device.type != "meta":
            self.init_weights()

    def _gate_input_features(self) -> int | None:
        return self.qkv.in_features

    def init_weights(self) -> None:
        """The head kinds' own parameters at their start: mix heads ordinary (a = 0, b = 1), local heads' W_V' as
        timm initialises a Linear and W_O' zero, untied heads' W_V', W_O' copies of their head's W_V, W_O, gates at
        zero (the scale 1/2). timm's
        ``init_weights`` calls this after its own pass over the module's Linears (so a model built on the meta
        device, ``to_empty``-ed and re-initialised starts right); qkv and proj are timm's business and untouched."""
        with torch.no_grad():
            if self.mix_a is not None:
                self.mix_a.zero_()
                self.mix_b.fill_(1.0)
            if self.head_gate is not None:
                self.head_gate.weight.zero_()
            if self.local_v is not None:
                torch.nn.init.trunc_normal_(self.local_v.weight, std=0.02)
                if self.local_v.bias is not None:
                    torch.nn.init.zeros_(self.local_v.bias)
                torch.nn.init.zeros_(self.local_o.weight)
            if self.untied_v is not None:
                hd, start = self.head_dim, 2 * self.attn_dim  # qkv's rows: (q, k, v) x heads x head_dim
                v_rows = [slice(start + h * hd, start + (h + 1) * hd) for h in self._untied_heads]
                self.untied_v.copy_(torch.cat([self.qkv.weight[rows] for rows in v_rows]))
                if self.untied_v_bias is not None:
                    self.untied_v_bias.copy_(torch.cat([self.qkv.bias[rows] for rows in v_rows]))
                columns = [self.proj.weight[:, h * hd : (h + 1) * hd] for h in self._untied_heads]
                self.untied_o.copy_(torch.cat(columns, dim=1))

    def forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> torch.Tensor:
        """Args:
            x: tokens (B, N, C).
            attn_mask: optional mask broadcastable to (B, H, N, N) (bool: True = attend).
            is_causal: causal attention.

        The same signature as timm's Attention, so TorchScript scripts it and FX traces it (the op is a leaf of
        both); :meth:`forward_with_attn` also returns P for attention maps.
        """
        return self._forward(x, attn_mask, is_causal, False)[0]

    @torch.jit.ignore
    def forward_with_attn(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``forward`` and P (B, H, N, N) from the reference path, for attention maps."""
        out, attn = self._forward(x, attn_mask, is_causal, True)
        return out, attn

    def _forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool, return_attn: bool
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        b, n, _ = x.shape
        tokens = x
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x, attn = self._attend(q, k, v, attn_mask, is_causal, return_attn)
        x = self._gate(x, tokens)  # gated heads: each head's output times sigmoid(tokens w_h)
        x = x.transpose(1, 2).reshape(b, n, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        out = self.proj(x)
        if self.local_v is not None:  # "local" heads: their untied token-local term, W_O' W_V' x
            out = out + self.local_o(self.local_v(tokens))
        if self.untied_o is not None:  # "untied" heads: W_O' W_V' x, started as the Laplacian head's W_O W_V x
            out = out + torch.nn.functional.linear(
                torch.nn.functional.linear(tokens, self.untied_v, self.untied_v_bias), self.untied_o
            )
        return self.proj_drop(out), attn

    def extra_repr(self) -> str:
        if not self._heads.plain:
            return f"head_kinds={list(self._heads.names)}"
        return f"laplacian_heads={self._heads}"


def convert_attention(
    modules: Sequence[torch.nn.Module], laplacian_class: type, heads_per_layer: Sequence[LayerHeads]
) -> None:
    """Turn timm attention modules of a family without ``attn_layer`` (EVA, Swin) into ``laplacian_class`` in
    place: the class gains only behaviour (the mixin's heads and the op), so parameters and state dict stay the
    family's own; each module then gets its layer's heads."""
    for module, heads in zip(modules, heads_per_layer):
        if not isinstance(module, laplacian_class):
            module.__class__ = laplacian_class
            device = next(module.parameters()).device
            module._init_laplacian_heads(module.num_heads, heads, device)
        else:
            module.set_laplacian_heads(heads)


# TorchScript cannot resolve the string annotations of ``from __future__ import annotations`` on methods it leaves
# to Python: give them their evaluated types (the mixin's are given in lapheads.core.mixin)
for _fn in (LaplacianAttention.forward, LaplacianAttention.forward_with_attn, LaplacianAttention._forward):
    _fn.__annotations__ = typing.get_type_hints(_fn)

# timm's feature extraction (its own FX tracer) calls the op as one node, as torch.fx does (lapheads.core.mixin)
_register_notrace = getattr(
    __import__("timm.layers", fromlist=["register_notrace_function"]), "register_notrace_function", None
)
if _register_notrace is not None:
    _register_notrace(fused_leaf)
    _register_notrace(reference_leaf)


for _then in WHEN_LOADED:  # what waited for this module to be whole (timm's names: see WHEN_LOADED)
    _then()
WHEN_LOADED.clear()
