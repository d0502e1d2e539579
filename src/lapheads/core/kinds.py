"""Head kinds: what in a Laplacian head does the work, taken apart into kinds a head can be.

A head of any kind outputs alpha V_self + beta P V + gamma mean(V) per head (mean: the values the query may attend
to, uniformly), and an exclusive head then removes its output's component along the token's own value. This module
owns that vocabulary and its arithmetic; ``lapheads.core.heads`` parses written specs into kinds, the op
(``lapheads.core.attention``) plans around them and calls :func:`kinds_output`, and the modules
(``lapheads.core.mixin``, ``lapheads.core.modules``) add the learnable parts (mix heads' (a, b), local heads' untied
term). Design choices:

* **Coefficients, not code, per kind.** A new kind is a row of :data:`KIND_COEFFICIENTS`; the op, the textbook
  reference and TorchScript's form all read that one table.
* **No T x T tensor.** The attended mean is the mean of all keys, a running mean under a causal mask, or SDPA with
  all-equal scores under any other mask.
* **A gate is not a kind but a switch on one** (``"gated-laplacian"``): the head's output times sigmoid(x w_h), one
  scalar per head and token from the layer's input x, as gated attention (arXiv 2505.06708, headwise; Qwen3-Next)
  and the modded-nanogpt speedrun's gated heads have it. w_h starts at zero, so a new gate is the fixed scale 1/2
  (the papers' zero init). The op never sees x: a module owns the gate's weights and calls :func:`gate_heads` on
  what the op returns, before the output projection.
* **Mix heads are pulled to named points** by an optional penalty (:func:`decisiveness_penalty`), so a learned
  (a, b) can be read as a kind (:func:`nearest_kind`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from lapheads.core._autograd import sdpa

__all__ = [
    "KIND_COEFFICIENTS",
    "NAMED_POINTS",
    "PROJECTING_KINDS",
    "attended_mean",
    "decisiveness_penalty",
    "exclude_own_value",
    "gate_heads",
    "is_kinds",
    "is_plain_laplacian",
    "kind_coefficients",
    "kinds_output",
    "nearest_kind",
]

#: Per kind, the coefficients of (the head's own value V, P V, the mean of the attended values): ordinary P V;
#: laplacian V - P V; negated -P V; local P V, plus an untied token-local term its module adds; untied -P V, plus
#: its module's local term (started as W_O W_V); sum V + P V; centring V - mean(V) over the attended positions;
#: exclusive P V, from which the op then removes the component along V (:data:`PROJECTING_KINDS`). mix (a V + b P V,
#: learnable a, b; a = 0, b = 1 at init) takes its coefficients from the module.
KIND_COEFFICIENTS = {
    "ordinary": (0.0, 1.0, 0.0),
    "laplacian": (1.0, -1.0, 0.0),
    "negated": (0.0, -1.0, 0.0),
    "local": (0.0, 1.0, 0.0),
    "untied": (0.0, -1.0, 0.0),
    "sum": (1.0, 1.0, 0.0),
    "centring": (1.0, 0.0, -1.0),
    "exclusive": (0.0, 1.0, 0.0),
    "mix": (0.0, 1.0, 0.0),
}
#: kinds whose output is not linear in (V, P V, mean): exclusive heads remove P V's component along the token's own
#: value, z = y - (y . v / |v|^2) v
PROJECTING_KINDS = frozenset({"exclusive"})


#: The named points of a mix head's (a, b) (a V + b P V): the kinds the paper and its ablations talk about.
NAMED_POINTS = {
    "ordinary": (0.0, 1.0),
    "laplacian": (1.0, -1.0),
    "negated": (0.0, -1.0),
    "identity": (1.0, 0.0),
    "off": (0.0, 0.0),
}


def nearest_kind(a: float, b: float) -> tuple[str, float, str]:
    """(nearest named point, its distance, nearest named direction) of one head's (a, b)."""
    name, distance = min(((n, math.dist((a, b), p)) for n, p in NAMED_POINTS.items()), key=lambda item: item[1])
    norm = math.hypot(a, b)
    if norm == 0:
        return name, distance, "off"
    direction = max(
        ((n, (a * p[0] + b * p[1]) / (norm * math.hypot(*p))) for n, p in NAMED_POINTS.items() if n != "off"),
        key=lambda item: item[1],
    )[0]
    return name, distance, direction


def is_plain_laplacian(kinds: Sequence[str]) -> bool:
    """Whether a layer's kinds are only ordinary and Laplacian heads (the op's Laplacian fast paths apply)."""
    return all(kind in ("ordinary", "laplacian") for kind in kinds)


def is_kinds(spec: object) -> bool:
    """Whether a layer's spec is given as head kinds (a non-empty sequence of names)."""
    return isinstance(spec, (tuple, list)) and len(spec) > 0 and isinstance(spec[0], str)


def kind_coefficients(
    kinds: tuple[str, ...], mix: tuple[Tensor, Tensor] | None, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """(alpha, beta, gamma) of shape (H,): the coefficients of V, P V and the attended mean per head."""
    table = torch.tensor([KIND_COEFFICIENTS[kind] for kind in kinds], dtype=dtype, device=device)
    alpha, beta, gamma = table.unbind(1)
    if mix is not None and "mix" in kinds:
        is_mix = torch.tensor([kind == "mix" for kind in kinds], device=device)
        alpha = torch.where(is_mix, mix[0].to(dtype), alpha)  # gradients reach a and b through these
        beta = torch.where(is_mix, mix[1].to(dtype), beta)
    return alpha, beta, gamma


def attended_mean(v: Tensor, q: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float | None) -> Tensor:
    """The mean of the values each query attends to (B, H or Hkv, T, D), without a T x T tensor: the mean of all
    keys; under a causal mask the running mean up to the query's own position; under any other mask uniform
    attention over the allowed keys (SDPA with all-equal scores)."""
    t, s = q.shape[-2], v.shape[-2]
    if attn_mask is None and not is_causal:
        return v.mean(-2, keepdim=True).expand(*v.shape[:-2], t, v.shape[-1])
    if attn_mask is None:  # causal, queries the last T of the S keys
        counts = torch.arange(s - t + 1, s + 1, device=v.device, dtype=v.dtype).unsqueeze(-1)
        return v.cumsum(-2)[..., s - t :, :] / counts
    return sdpa(torch.zeros_like(q), v.new_zeros(v.shape[:-1] + (q.shape[-1],)), v, attn_mask, 0.0, False, scale)


def kinds_output(
    y: Tensor,
    v_self: Tensor,
    v: Tensor,
    q: Tensor,
    kinds: tuple[str, ...],
    mix: tuple[Tensor, Tensor] | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> Tensor:
    """out_h = alpha_h V_self + beta_h P V + gamma_h mean(V), then the exclusive heads' projection: one elementwise
    expression of SDPA's y (B, H, T, D) and each query's own value v_self (B, Hkv, T, D); autograd differentiates
    it, mix coefficients included. v and q serve the attended mean only."""
    b, h, t, d = y.shape
    hkv = v_self.shape[1]
    alpha, beta, gamma = kind_coefficients(kinds, mix, y.dtype, y.device)
    shape = (hkv, h // hkv, 1, 1)
    out = y.view(b, hkv, h // hkv, t, d) * beta.view(shape) + v_self.unsqueeze(2) * alpha.view(shape)
    if "centring" in kinds:
        mean = attended_mean(v, q, attn_mask, is_causal, scale)
        mean = mean.view(b, hkv, h // hkv, t, d) if mean.shape[1] == h else mean.unsqueeze(2)
        out = out + mean * gamma.view(shape)
    out = out.view(b, h, t, d)
    if PROJECTING_KINDS.intersection(kinds):
        own = v_self.unsqueeze(2).expand(b, hkv, h // hkv, t, d).reshape(b, h, t, d)
        out = exclude_own_value(out, own, kinds)
    return out


def exclude_own_value(out: Tensor, own: Tensor, kinds: Sequence[str]) -> Tensor:
    """Exclusive heads' z = y - (y . n) n with n = v / |v| the token's own value direction (XSA, arXiv 2603.09078;
    ``F.normalize``'s eps keeps a zero value's z = y); other heads unchanged. out, own: (B, H, T, D)."""
    n = F.normalize(own, dim=-1)
    exclusive = torch.tensor([kind in PROJECTING_KINDS for kind in kinds], device=out.device).view(1, -1, 1, 1)
    return torch.where(exclusive, out - (out * n).sum(-1, keepdim=True) * n, out)


def gate_heads(out: Tensor, gate_logits: Tensor, gated_heads: Tensor) -> Tensor:
    """Scale each gated head's output by its sigmoid gate: out[:, h, t] * sigmoid(gate_logits[:, t, j]) for the
    j-th gated head h; the other heads unchanged (one elementwise pass over ``out``).

    Args:
        out: the heads' outputs (B, H, T, D), as the op returns them.
        gate_logits: (B, T, G), the layer's input through the module's gate (a Linear without bias, one output per
            gated head).
        gated_heads: (G,) int64, the gated heads' indices in order (a module's buffer, on out's device).
    """
    gates = torch.sigmoid(gate_logits).transpose(1, 2).unsqueeze(-1).to(out.dtype)  # (B, G, T, 1)
    if gates.shape[1] == out.shape[1]:  # every head gated
        return out * gates
    scale = torch.ones(out.shape[0], out.shape[1], out.shape[2], 1, dtype=out.dtype, device=out.device)
    return out * scale.index_copy(1, gated_heads, gates)


def decisiveness_penalty(model: torch.nn.Module) -> torch.Tensor:
    """Sum over mix heads of the squared distance of (a, b) to the nearest named point (0 without mix heads)."""
    points = None
    total = None
    for module in model.modules():
        a, b = getattr(module, "mix_a", None), getattr(module, "mix_b", None)
        if a is None or b is None:
            continue
        if points is None:
            points = torch.tensor(list(NAMED_POINTS.values()), dtype=a.dtype, device=a.device)  # (P, 2)
        ab = torch.stack([a, b], -1)  # (H, 2)
        distances = (ab[:, None, :] - points[None]).square().sum(-1)  # (H, P)
        term = distances.min(-1).values.sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return total
