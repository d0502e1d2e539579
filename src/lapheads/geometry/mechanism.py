"""Does a head diffuse or sharpen? Its whole output-value circuit from the weights, and its effect on data.

A head writes to the residual stream x. An ordinary head's write is G W_O,h W_V,h P x̂ and a Laplacian head's is
G W_O,h W_V,h (x̂ - P x̂), with x̂ = diag(γ) norm(x) (γ: the gain of the norm before attention, 1 for the GPT's
parameter-free RMS norm) and G = diag(g) any per-channel gain between the head and the residual stream (timm's
LayerScale ``ls1.gamma``; 1 where there is none). The **whole circuit** of head h is

    M_h = diag(g) W_O,h W_V,h diag(γ)      (C x C, rank <= D, the head dimension)

Leaving G out is not harmless: LayerScale starts at 1e-6 and AdamW turns about half of its channels negative in the
first steps, which flips the sign of those rows of M and scrambles any comparison with the identity.

When M_h is close to c·P (P a projection on the head's D-dim subspace):

* a Laplacian head with c < 0 adds -|c| (x̂_i - Σ_j P_ij x̂_j): token i moves toward its attention-weighted
  neighbours, one explicit step of the heat equation on the attention graph: it **diffuses**; with c > 0 it
  sharpens;
* an ordinary head with c > 0 adds a share of the neighbours' average, which also pulls token i toward them.

Scores per head:

* ``alignment``: tr(M) / (‖M‖_F √D), normalised by what a rank-D circuit can attain (|tr M| <= Σ σ_i <= √D ‖M‖_F),
  so ±1 means exactly ±c·P on its subspace and a random M scores about 0. (``alignment_full`` is the older cosine
  with the C x C identity, tr(M) / (‖M‖_F √C), whose best value for a head is √(D/C).)
* ``diffusion``: the alignment signed by the head's kind (Laplacian: -alignment, ordinary: +alignment): positive
  always means "moves tokens toward their neighbours".
* ``as_laplacian`` = -alignment: what the same circuit would score in a Laplacian head. The ordinary heads' mean
  of it is the **null** for a Laplacian head (an ordinary-looking circuit in a Laplacian head already scores it).
* ``size`` = ‖M‖_F / √D, the circuit's gain per dimension of its subspace; ``kind``: the head's kind (only
  ``ordinary`` heads count as ordinary in the report and the null).

And from data (:func:`smoothing_indices`): how much a head's own write lowers the within-sequence variance of the
residual stream it writes to, (WSV(x) - WSV(x + o_h)) / WSV(x), positive = smoothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lapheads.errors import InputError

__all__ = ["HeadCircuits", "circuit_scores", "head_circuits", "ov_circuits", "smoothing_indices"]


def circuit_scores(circuit: torch.Tensor, laplacian: bool, rank: int | None = None) -> dict[str, Any]:
    """Alignment (normalised by the attainable), diffusion (signed by the head's kind), the null reading and size of
    one (C, C) circuit of rank at most ``rank`` (default C)."""
    c = circuit.shape[0]
    rank = rank or c
    norm = float(circuit.norm())
    trace = float(torch.trace(circuit))
    alignment = trace / (norm * math.sqrt(rank)) if norm > 0 else 0.0
    return {
        "alignment": alignment,
        "alignment_full": trace / (norm * math.sqrt(c)) if norm > 0 else 0.0,
        "diffusion": -alignment if laplacian else alignment,
        "as_laplacian": -alignment,
        "size": norm / math.sqrt(rank),
        "laplacian": laplacian,
    }


@dataclass
class HeadCircuits:
    """One block's attention, as the circuits need it."""

    w_v: torch.Tensor  # (H_kv, D, C)
    w_o: torch.Tensor  # (C, H * D)
    gamma: torch.Tensor | None  # the pre-attention norm's gain (C,)
    gain: torch.Tensor | None  # the per-channel gain of the head's write (LayerScale) (C,)
    laplacian: list[bool]
    kinds: list[str]  # every head's kind (lapheads.core.kinds.HEAD_KINDS)
    group: int  # query heads per key/value head
    block: torch.nn.Module
    proj: torch.nn.Module  # the output projection, whose input is the heads' outputs side by side


def _layer_scale(block: torch.nn.Module) -> torch.Tensor | None:
    scale = getattr(block, "ls1", None)
    return getattr(scale, "gamma", None) if scale is not None else None


def head_circuits(model: torch.nn.Module) -> list[HeadCircuits]:
    """Per block: the weights of its heads' whole circuits (timm ViTs and lapheads.GPT)."""
    out = []
    if hasattr(model, "transformer") and hasattr(model, "lm_head"):
        for block in model.blocks:
            attn = block.attn
            w_v = attn.c_v.weight.view(attn.n_kv_head, attn.head_dim, -1)
            group = attn.n_head // attn.n_kv_head
            out.append(
                HeadCircuits(
                    w_v,
                    attn.c_proj.weight,
                    None,
                    None,
                    attn.laplacian_head_list,
                    list(attn.head_kinds),
                    group,
                    block,
                    attn.c_proj,
                )
            )
        return out
    if hasattr(model, "blocks") and hasattr(model.blocks[0], "attn") and hasattr(model.blocks[0].attn, "qkv"):
        for block in model.blocks:
            attn = block.attn
            width = attn.qkv.weight.shape[0] // 3
            w_v = attn.qkv.weight[2 * width :].view(attn.num_heads, attn.head_dim, -1)
            flags = list(getattr(attn, "laplacian_head_list", [False] * attn.num_heads))
            gamma = getattr(block.norm1, "weight", None)
            kinds = list(getattr(attn, "head_kinds", ["laplacian" if f else "ordinary" for f in flags]))
            out.append(
                HeadCircuits(w_v, attn.proj.weight, gamma, _layer_scale(block), flags, kinds, 1, block, attn.proj)
            )
        return out
    raise InputError(f"{type(model).__name__}: allowed: a timm ViT or lapheads.GPT (OV circuits need W_V, W_O)")


@torch.no_grad()
def ov_circuits(model: torch.nn.Module) -> list[list[dict[str, Any]]]:
    """Per block, per head: ``circuit_scores`` of the whole circuit diag(g) W_O,h W_V,h diag(γ)."""
    out = []
    for layer in head_circuits(model):
        dim = layer.w_v.shape[1]
        heads = []
        for h, laplacian in enumerate(layer.laplacian):
            circuit = layer.w_o[:, h * dim : (h + 1) * dim].double() @ layer.w_v[h // layer.group].double()
            if layer.gamma is not None:
                circuit = circuit * layer.gamma.double()[None, :]
            if layer.gain is not None:
                circuit = layer.gain.double()[:, None] * circuit
            heads.append({**circuit_scores(circuit, laplacian, rank=dim), "kind": layer.kinds[h]})
        out.append(heads)
    return out


def _within_sequence_variance(x: torch.Tensor) -> torch.Tensor:
    """Sum over sequences of the within-sequence variance (summed over channels) of (B, T, C) tokens."""
    return (x - x.mean(1, keepdim=True)).square().sum((1, 2)).sum() / x.shape[1]


@torch.no_grad()
def smoothing_indices(model: torch.nn.Module, batches: Iterable[Any]) -> list[list[float]]:
    """Per block, per head: (WSV(x) - WSV(x + o_h)) / WSV(x) over ``batches`` (the model's inputs), where x is the
    residual stream entering the block and o_h the head's own write to it (through W_O,h and any LayerScale; the
    projection's bias is shared by the heads and left out). Positive: the head smooths the stream it writes to."""
    layers = head_circuits(model)
    inputs: dict[int, torch.Tensor] = {}
    heads_out: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.block.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0])))
        hooks.append(layer.proj.register_forward_pre_hook(lambda m, args, i=i: heads_out.__setitem__(i, args[0])))
    before = [0.0] * len(layers)
    after = [[0.0] * len(layer.laplacian) for layer in layers]
    try:
        for batch in batches:
            model(batch)
            for i, layer in enumerate(layers):
                x, z = inputs[i].double(), heads_out[i].double()
                dim = layer.w_v.shape[1]
                before[i] += float(_within_sequence_variance(x))
                for h in range(len(layer.laplacian)):
                    write = z[..., h * dim : (h + 1) * dim] @ layer.w_o[:, h * dim : (h + 1) * dim].double().T
                    if layer.gain is not None:
                        write = write * layer.gain.double()
                    after[i][h] += float(_within_sequence_variance(x + write))
    finally:
        for hook in hooks:
            hook.remove()
    return [[(before[i] - a) / before[i] if before[i] > 0 else 0.0 for a in after[i]] for i in range(len(layers))]
