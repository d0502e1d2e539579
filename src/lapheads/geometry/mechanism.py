"""Does a head diffuse or sharpen? Its whole output-value circuit from the weights, and its effect on data.

A head writes to the residual stream x. An ordinary head's write is G W_O,h W_V,h P x̂ and a Laplacian head's is
G W_O,h W_V,h (x̂ - P x̂), with x̂ = diag(γ) norm(x) (γ: the gain of the norm before attention, 1 for the GPT's
parameter-free RMS norm) and G = diag(g) any per-channel gain between the head and the residual stream (timm's
LayerScale ``ls1.gamma``; 1 where there is none). The **whole circuit** of head h is

    M_h = diag(g) W_O,h W_V,h diag(γ)      (C x C, rank <= D, the head dimension)

Leaving G out is not harmless: LayerScale starts at 1e-6 and AdamW turns about half of its channels negative in the
first steps, which flips the sign of those rows of M and scrambles any comparison with the identity.

Which way a head moves the within-sequence variance depends on its kind *and* on P. A head of kind (α, β, γ)
(:data:`lapheads.core.kinds.KIND_COEFFICIENTS`; a mix head's (a, b)) writes M_h A x̂, where the token operator
A = α I + β P + γ U (U: the uniform mean over the attended tokens) mixes the sequence's tokens. With M_h ≈ c·Π (Π a
projection on the head's subspace) the write changes the within-sequence variance by about 2 c τ(A) times that of
Π x̂, where τ(A) = tr(C A C) / (T - 1) is A's mean gain on the within-sequence part (C: centring over the
sequence). For a row-stochastic P, τ(P) = (tr P - 1) / (T - 1) lies in [-1/(T-1), 1]: about 0 when P is uniform
(P x̂ adds one vector to every token), 1 when each token attends to itself (P x̂ copies it); τ(U) = 0 unmasked. So:

* a Laplacian head (τ = 1 - τ(P) >= 0) with c < 0 moves each token toward its attention-weighted neighbours, one
  explicit step of the heat equation on the attention graph: it **diffuses**, the more the flatter P is;
* an ordinary head (τ = τ(P) >= 0) with c < 0 also lowers the within-sequence variance, by shrinking the tokens it
  attends to; with c > 0 it copies them and raises it (a copying head and a uniform head's no-op have the same
  weights: only P tells them apart);
* a negated head has τ <= 0, sum τ >= 1, centring τ = 1; a mix head's τ = a + b τ(P) has one sign over all P only
  when a and a + b agree; exclusive heads (not linear in P V) and heads with a second, untied circuit (local,
  untied) have no sign one circuit can give.

Scores per head (:func:`circuit_scores`, weights only):

* ``alignment``: tr(M) / (‖M‖_F √D), normalised by what a rank-D circuit can attain (|tr M| <= Σ σ_i <= √D ‖M‖_F),
  so ±1 means exactly ±c·Π on its subspace and a random M scores about 0. (``alignment_full`` is the older cosine
  with the C x C identity, tr(M) / (‖M‖_F √C), whose best value for a head is √(D/C).)
* ``expected_sign``: the sign of τ(A) the head's kind implies for every P (:func:`expected_sign`): +1, -1, 0 (it
  depends on P) or None (one circuit cannot tell).
* ``diffusion`` = -alignment x expected_sign: positive means "lowers the within-sequence variance", whatever P is;
  None where the sign depends on P or one circuit cannot tell (then read ``p_diffusion`` and ``fraction_drop``).
* ``as_laplacian`` = -alignment: what the same circuit would score in a Laplacian head: the null reading.
* ``size`` = ‖M‖_F / √D, the circuit's gain per dimension of its subspace; ``kind``; for mix heads ``mix_angle``,
  the direction of (a, b) in degrees (ordinary 90, Laplacian -45, negated -90, identity 0).

And from data (:func:`head_effects`), with the model's own P:

* ``tau``: τ(A) measured, the mean over sequences (timm ViTs, whose attention returns P; None for the GPT and for
  kinds without one circuit);
* ``p_diffusion`` = -alignment x tau: the weight score with P's effect in it;
* ``fraction_drop``: the within-sequence fraction the claims use (``geometry.anova``: within / total over the whole
  set) of the residual stream entering the block, minus the same fraction after adding the head's own whole write
  (its op output through W_O, its untied local term, LayerScale): positive = the head lowers that fraction. Both
  fractions are ratios of sums over every sequence of the set, not means of per-batch ratios (a biased estimator).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lapheads.core.heads import LayerHeads
from lapheads.core.kinds import KIND_COEFFICIENTS, PROJECTING_KINDS, kind_coefficients
from lapheads.core.vocabulary import LOCAL_TERM_KINDS
from lapheads.errors import InputError
from lapheads.geometry.anova import AnovaAccumulator

__all__ = [
    "HeadCircuits",
    "HeadEffects",
    "circuit_scores",
    "expected_sign",
    "gated_heads",
    "head_circuits",
    "head_effects",
    "ov_circuits",
]


def expected_sign(kind: str, mix: tuple[float, float] | None = None) -> int | None:
    """The sign of τ(A) = α + β τ(P) that a head of ``kind`` (a mix head: its (a, b)) has for every P with τ(P) in
    [0, 1]: +1 or -1 where the ends α and α + β agree (one of them may be 0), 0 where the sign depends on P, None
    where one circuit cannot tell (exclusive heads are not linear in P V; local and untied heads add a second
    circuit). Unmasked, the attended mean's τ(U) is 0, so γ does not count."""
    if kind in PROJECTING_KINDS or kind in LOCAL_TERM_KINDS:
        return None
    alpha, beta, _ = (mix[0], mix[1], 0.0) if kind == "mix" and mix is not None else KIND_COEFFICIENTS[kind]
    low, high = sorted((alpha, alpha + beta))
    if low >= 0 and high > 0:
        return 1
    if high <= 0 and low < 0:
        return -1
    return 0


def circuit_scores(
    circuit: torch.Tensor, kind: str, rank: int | None = None, mix: tuple[float, float] | None = None
) -> dict[str, Any]:
    """Alignment (normalised by the attainable), the kind's expected sign, diffusion (signed by it; None where the
    kind's sign depends on P), the null reading and the size of one (C, C) circuit of rank at most ``rank``
    (default C), for a head of ``kind`` (a mix head: its (a, b) in ``mix``)."""
    c = circuit.shape[0]
    rank = rank or c
    norm = float(circuit.norm())
    trace = float(torch.trace(circuit))
    alignment = trace / (norm * math.sqrt(rank)) if norm > 0 else 0.0
    sign = expected_sign(kind, mix)
    scores = {
        "alignment": alignment,
        "alignment_full": trace / (norm * math.sqrt(c)) if norm > 0 else 0.0,
        "expected_sign": sign,
        "diffusion": -alignment * sign if sign else None,
        "as_laplacian": -alignment,
        "size": norm / math.sqrt(rank),
        "laplacian": kind == "laplacian",
        "kind": kind,
    }
    if kind == "mix" and mix is not None:
        scores["mix_angle"] = math.degrees(math.atan2(mix[1], mix[0]))
    return scores


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
    attn: torch.nn.Module  # the attention module (its input: the normed tokens; its mix and local parameters)
    proj: torch.nn.Module  # the output projection, whose input is the heads' outputs side by side

    def mix(self, h: int) -> tuple[float, float] | None:
        """Head h's learned (a, b), if it is a mix head."""
        a, b = getattr(self.attn, "mix_a", None), getattr(self.attn, "mix_b", None)
        return (float(a[h]), float(b[h])) if self.kinds[h] == "mix" and a is not None and b is not None else None


def _layer_scale(block: torch.nn.Module) -> torch.Tensor | None:
    scale = getattr(block, "ls1", None)
    return getattr(scale, "gamma", None) if scale is not None else None


def gated_heads(model: torch.nn.Module) -> LayerHeads | None:
    """The heads of the first attention module with gated heads, or None. A gate scales a head per token, so such a
    model has no fixed operator M_h A per head: :func:`head_circuits` refuses it, and an analysis leaves its
    mechanism out."""
    return next((m.heads for m in model.modules() if isinstance(getattr(m, "heads", None), LayerHeads)
                 and m.heads.gated_heads), None)  # fmt: skip


def head_circuits(model: torch.nn.Module) -> list[HeadCircuits]:
    """Per block: the weights of its heads' whole circuits (timm ViTs and lapheads.GPT)."""
    gated = gated_heads(model)
    if gated is not None:  # a gate scales a head per token: no fixed operator M_h A per head to take apart
        raise InputError(
            f"{type(model).__name__} has gated heads ({gated}); allowed: models without gates (a gated head's "
            "operator changes with every token)"
        )
    out = []
    if hasattr(model, "transformer") and hasattr(model, "lm_head"):
        for block in model.blocks:
            attn = block.attn
            w_v = attn.c_v.weight.view(attn.n_kv_head, attn.head_dim, -1)
            group = attn.n_head // attn.n_kv_head
            flags = list(attn.heads.flags)
            out.append(
                HeadCircuits(
                    w_v, attn.c_proj.weight, None, None, flags, list(attn.heads.kinds), group, block, attn, attn.c_proj
                )
            )
        return out
    if hasattr(model, "blocks") and hasattr(model.blocks[0], "attn") and hasattr(model.blocks[0].attn, "qkv"):
        for block in model.blocks:
            attn = block.attn
            width = attn.qkv.weight.shape[0] // 3
            w_v = attn.qkv.weight[2 * width :].view(attn.num_heads, attn.head_dim, -1)
            heads = getattr(attn, "heads", LayerHeads(("ordinary",) * attn.num_heads))  # timm's own: ordinary
            flags, kinds = list(heads.flags), list(heads.kinds)
            gamma = getattr(block.norm1, "weight", None)
            out.append(
                HeadCircuits(w_v, attn.proj.weight, gamma, _layer_scale(block), flags, kinds, 1, block, attn, attn.proj)
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
        for h in range(len(layer.kinds)):
            circuit = layer.w_o[:, h * dim : (h + 1) * dim].double() @ layer.w_v[h // layer.group].double()
            if layer.gamma is not None:
                circuit = circuit * layer.gamma.double()[None, :]
            if layer.gain is not None:
                circuit = layer.gain.double()[:, None] * circuit
            heads.append(circuit_scores(circuit, layer.kinds[h], rank=dim, mix=layer.mix(h)))
        out.append(heads)
    return out


def _head_writes(layer: HeadCircuits, tokens: torch.Tensor, heads_out: torch.Tensor) -> list[torch.Tensor]:
    """Each head's own whole write to the residual stream (B, T, C), in float64: its output through its columns of
    W_O, plus its untied local term (local, untied heads), through LayerScale. The projection's bias is shared by
    the heads and adds one vector to every token, which neither part of the fraction sees: left out. A module's
    local term is one sum over slices of W_V', W_O' of one head's width; the j-th slice is read as the j-th local
    (untied) head's, as each was sized and started for it."""
    attn, dim = layer.attn, layer.w_v.shape[1]
    w_o = layer.w_o.double()
    local = attn.local_v(tokens).double() if getattr(attn, "local_v", None) is not None else None
    untied = None
    if getattr(attn, "untied_v", None) is not None:
        untied = torch.nn.functional.linear(tokens, attn.untied_v, attn.untied_v_bias).double()
    untied_heads = list(getattr(attn, "_untied_heads", []))
    local_heads = [h for h, kind in enumerate(layer.kinds) if kind == "local"]
    writes = []
    for h in range(len(layer.kinds)):
        columns = slice(h * dim, (h + 1) * dim)
        write = heads_out[..., columns].double() @ w_o[:, columns].T
        if local is not None and h in local_heads:
            j = slice(local_heads.index(h) * dim, (local_heads.index(h) + 1) * dim)
            write = write + local[..., j] @ attn.local_o.weight[:, j].double().T
        if untied is not None and h in untied_heads:
            j = slice(untied_heads.index(h) * dim, (untied_heads.index(h) + 1) * dim)
            write = write + untied[..., j] @ attn.untied_o[:, j].double().T
        if layer.gain is not None:
            write = write * layer.gain.double()
        writes.append(write)
    return writes


def _token_gains(attn: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor | None:
    """Σ over the batch's sequences of τ(P) = (tr P - 1) / (T - 1) per head (H,), from the attention's own P
    (timm ViTs: ``forward_with_attn``; None where the module returns no P)."""
    if not hasattr(attn, "forward_with_attn"):
        return None
    _, p = attn.forward_with_attn(tokens)  # (B, H, T, T), unmasked
    t = p.shape[-1]
    return ((p.double().diagonal(dim1=-2, dim2=-1).sum(-1) - 1.0) / max(t - 1, 1)).sum(0)


class HeadEffects:
    """Streaming :func:`head_effects`: hooks on every block while the context is open; call :meth:`update` after
    each forward pass of the model and :meth:`compute` at the end. Memory O(blocks x heads x C^2)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers = head_circuits(model)
        self.captured: dict[tuple[str, int], torch.Tensor] = {}
        self.hooks: list[Any] = []
        self.before = [AnovaAccumulator() for _ in self.layers]
        self.after = [[AnovaAccumulator() for _ in layer.kinds] for layer in self.layers]
        self.gains: list[torch.Tensor | None] = [None] * len(self.layers)
        self.sequences = 0

    def __enter__(self) -> HeadEffects:
        for i, layer in enumerate(self.layers):
            for name, module in (("x", layer.block), ("tokens", layer.attn), ("heads", layer.proj)):
                hook = lambda m, args, key=(name, i): self.captured.__setitem__(key, args[0])  # noqa: E731
                self.hooks.append(module.register_forward_pre_hook(hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

    @torch.no_grad()
    def update(self) -> None:
        """Fold in the forward pass just made."""
        for i, layer in enumerate(self.layers):
            x, tokens = self.captured[("x", i)].double(), self.captured[("tokens", i)]
            self.before[i].update(x)
            for h, write in enumerate(_head_writes(layer, tokens, self.captured[("heads", i)])):
                self.after[i][h].update(x + write)
            gain = _token_gains(layer.attn, tokens)
            previous = self.gains[i]
            self.gains[i] = None if gain is None else gain if previous is None else previous + gain
        self.sequences += len(self.captured[("x", 0)])

    def compute(self, circuits: list[list[dict[str, Any]]] | None = None) -> list[list[dict[str, Any]]]:
        """The scores per block and head; ``circuits``: the model's ``ov_circuits`` where the caller has them."""
        out = []
        for i, (layer, block_circuits) in enumerate(zip(self.layers, circuits or ov_circuits(self.model))):
            fraction = self.before[i].compute()["within_seq_fraction"]
            alpha, beta, _ = kind_coefficients(tuple(layer.kinds), _mix_tensors(layer.attn), torch.float64, "cpu")
            gains = self.gains[i]
            heads = []
            for h, kind in enumerate(layer.kinds):
                tau = None
                if gains is not None and kind not in PROJECTING_KINDS and kind not in LOCAL_TERM_KINDS:
                    tau = float(alpha[h] + beta[h] * gains[h] / self.sequences)
                heads.append(
                    {
                        "tau": tau,
                        "p_diffusion": None if tau is None else -block_circuits[h]["alignment"] * tau,
                        "fraction_drop": fraction - self.after[i][h].compute()["within_seq_fraction"],
                    }
                )
            out.append(heads)
        return out


@torch.no_grad()
def head_effects(model: torch.nn.Module, batches: Iterable[Any]) -> list[list[dict[str, Any]]]:
    """Per block, per head over ``batches`` (the model's inputs): ``tau`` (τ(A) with the model's own P: the mean
    over sequences of α + β τ(P); None where the module returns no P or the kind has no one circuit),
    ``p_diffusion`` (-alignment x tau) and ``fraction_drop`` (the within-sequence fraction of the stream entering
    the block minus that after adding the head's own whole write; positive: the head lowers it)."""
    with HeadEffects(model) as effects:
        for batch in batches:
            model(batch)
            effects.update()
    return effects.compute()


def _mix_tensors(attn: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    a, b = getattr(attn, "mix_a", None), getattr(attn, "mix_b", None)
    return None if a is None or b is None else (a.detach().cpu(), b.detach().cpu())
