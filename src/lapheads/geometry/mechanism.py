"""Does a head diffuse or sharpen? Its output-value circuit, read straight from the weights.

A head adds W_O (its output) to the residual stream x. An ordinary head's output is W_O W_V P x̂ (x̂ the normed
stream); a Laplacian head's is W_O W_V (x̂ - P x̂). Write M = W_O,h W_V,h diag(γ) for head h's output-value circuit
(γ: the gain of the norm before attention; 1 for the GPT's parameter-free RMS norm). When M is close to c·I:

* a Laplacian head with c < 0 adds -|c| (x̂_i - Σ_j P_ij x̂_j): token i moves toward its attention-weighted neighbours,
  one explicit step of the heat equation on the attention graph — it **diffuses**; with c > 0 it pushes token i
  away from them — it **sharpens**;
* an ordinary head with c > 0 adds a share of the neighbours' average, which also pulls token i toward them
  (diffusion); with c < 0 it pushes away.

The score per head is the cosine between M and the identity, ⟨M, I⟩ / (‖M‖ ‖I‖) = tr(M) / (‖M‖_F √C), in [-1, 1]
(-1 for M = -I, +1 for M = +I, about 0 for a random M), and ``diffusion`` is that score signed by the head's kind
(Laplacian heads: -score; ordinary heads: +score), so positive always means "moves tokens toward their neighbours".
``size`` = ‖M‖_F / √C is the circuit's gain per dimension.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lapheads.errors import InputError

__all__ = ["circuit_scores", "ov_circuits"]


def circuit_scores(circuit: torch.Tensor, laplacian: bool) -> dict[str, float]:
    """Alignment with the identity, diffusion (signed by the head's kind) and size of one (C, C) OV circuit."""
    c = circuit.shape[0]
    norm = float(circuit.norm())
    alignment = float(torch.trace(circuit)) / (norm * math.sqrt(c)) if norm > 0 else 0.0
    return {
        "alignment": alignment,
        "diffusion": -alignment if laplacian else alignment,
        "size": norm / math.sqrt(c),
        "laplacian": laplacian,
    }


def _vit_layers(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[bool], int]]:
    """(W_V per head stacked, W_O, gamma, Laplacian flags, kv group size) of each timm block with a
    LaplacianAttention."""
    layers = []
    for block in model.blocks:
        attn = block.attn
        heads, dim = attn.num_heads, attn.head_dim
        width = attn.qkv.weight.shape[0] // 3
        w_v = attn.qkv.weight[2 * width :].view(heads, dim, -1)  # (H, D, C)
        gamma = getattr(block.norm1, "weight", None)
        flags = attn.laplacian_head_list if hasattr(attn, "laplacian_head_list") else [False] * heads
        layers.append((w_v, attn.proj.weight, gamma, flags, 1))
    return layers


def _gpt_layers(
    model: torch.nn.Module,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[bool], int]]:
    layers = []
    for block in model.blocks:
        attn = block.attn
        w_v = attn.c_v.weight.view(attn.n_kv_head, attn.head_dim, -1)  # (Hkv, D, C)
        layers.append((w_v, attn.c_proj.weight, None, attn.laplacian_head_list, attn.n_head // attn.n_kv_head))
    return layers


@torch.no_grad()
def ov_circuits(model: torch.nn.Module) -> list[list[dict[str, Any]]]:
    """Per block, per head: ``circuit_scores`` of W_O,h W_V,h diag(γ) (timm ViTs and lapheads.GPT)."""
    if hasattr(model, "transformer") and hasattr(model, "lm_head"):
        layers = _gpt_layers(model)
    elif hasattr(model, "blocks") and hasattr(model.blocks[0], "attn") and hasattr(model.blocks[0].attn, "qkv"):
        layers = _vit_layers(model)
    else:
        raise InputError(f"{type(model).__name__}: allowed: a timm ViT or lapheads.GPT (OV circuits need W_V, W_O)")
    out = []
    for w_v, w_o, gamma, flags, group in layers:
        dim = w_v.shape[1]
        heads = []
        for h, laplacian in enumerate(flags):
            circuit = w_o[:, h * dim : (h + 1) * dim].double() @ w_v[h // group].double()
            if gamma is not None:
                circuit = circuit * gamma.double()[None, :]
            heads.append(circuit_scores(circuit, laplacian))
        out.append(heads)
    return out
