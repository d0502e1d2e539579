"""Laplacian attention: the fused op and, right below it, the textbook reference (as nanoGPT keeps its two paths).

A Laplacian head replaces its softmax matrix P by the random-walk graph Laplacian I - P, so it outputs
V - P V instead of P V (Zhang & Papyan, arXiv 2602.09297). ``laplacian_attention`` checks its arguments, plans
one path (``_plan``) and calls it. No path makes a T x T tensor or loops over heads in Python; every path gives
the reference's numbers up to rounding (tests/core/test_attention.py::test_fused_equals_reference_equals_dense and
test_each_call_takes_its_planned_path, which pins the plan below).

==============  =========================================================  ========================================
path            when                                                       what it runs, and why
==============  =========================================================  ========================================
sdpa            no head is Laplacian (k = 0, an all-False mask)            exactly F.scaled_dot_product_attention
kinds           head kinds beyond ordinary and Laplacian                   SDPA + one expression of V, P V and the
                                                                           attended mean (``lapheads.core.kinds``),
                                                                           differentiated by autograd
node            a gradient is wanted; the Laplacian heads are whole        one autograd node (``_autograd.
                blocks on kv-group boundaries, not all of them; no blend;  training_node``): SDPA's backward of g
                the identity aligned; not traced; the mask wants no grad   unchanged, then in-place fix-ups; on the
                                                                           CPU SDPA's flash kernels called directly,
                                                                           in C++ where built (``core.native``)
all_laplacian   every head Laplacian, H == Hkv, no blend                   ``v_self - y``: one subtraction
in_place        no gradient wanted (decoding), blocks as for ``node``      SDPA's fresh output made Laplacian in
                                                                           place: no copy, no graph
traced          under torch.compile or a torch.func transform              one expression: Inductor fuses it,
                                                                           functorch differentiates it
combine         the rest: a GQA group mixing kinds, a blend, an identity   ``LaplacianCombine``: a per-head sign and
                read from the mask, a mask that wants a gradient, a        the masked value, one pass each way
                device mask whose blocks are not read on the host
==============  =========================================================  ========================================

TorchScript compiles none of these: the modules call ``scripted_attention`` (bottom of this file) when scripted.

Semantics every path shares:

* **The identity uses the query's own position.** With a KV cache (T < S) the T queries are the last T positions
  of the S keys, so the identity term is v[..., S - T:, :]; a causal mask is aligned the same way (bottom right).
  ``identity="filled"`` reads it from the mask instead (a static cache's filled slots).
* **GQA/MQA.** v is broadcast from its Hkv heads to the H query heads inside the combine, never copied.
* **Dropout acts on P.** SDPA drops entries of P, so a Laplacian head computes (I - drop(P)) V.
* **A query with no key to attend to** has P = 0: its ordinary heads output 0, its Laplacian heads its own value.
* **An attention pattern or a FlexAttention block mask** (``lapheads.core.masks``) as ``attn_mask``: every path but
  ``node`` (which differentiates SDPA's own kernels) runs, its P V computed by the backend the pattern's module
  picks (FlexAttention, bands of T x W, or the dense mask); the reference uses the pattern's dense mask.
* **Learned sinks** (``sinks=``, GPT-OSS's) ride as a key of zeros in front of the keys with each head's sink as its
  mask entry, so every path runs them unchanged; the reference adds the sink column to its softmax by definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional  # TorchScript reads Optional in scripted_attention's signature

import torch
import torch.nn.functional as F
from torch import Tensor

from lapheads.core._autograd import (
    LaplacianCombine,
    combine_runs,
    head_runs,
    head_runs_of,
    identity_values,
    sdpa,
    training_node,
)
from lapheads.core.heads import HeadSpec, HeadSpecError, LayerHeads, check_count, check_mask_tensor
from lapheads.core.kinds import (
    PROJECTING_KINDS,
    exclude_own_value,
    is_kinds,
    is_plain_laplacian,
    kind_coefficients,
    kinds_output,
)
from lapheads.core.masks import attention_backend, check_pattern, is_pattern, tensor_mask
from lapheads.core.vocabulary import HEAD_KINDS
from lapheads.errors import InputError

__all__ = [
    "IDENTITIES",
    "AttentionPlan",
    "explain_attention",
    "laplacian_attention",
    "laplacian_attention_reference",
    "scripted_attention",
]

#: Where the identity term reads each query's own value (``identity=``): "aligned", the queries are the last T of the
#: S keys; "filled", the same when T == S, else the last T of the keys any query may attend to (a static cache's
#: filled slots; with a dynamic cache or none it is "aligned" for every mask: causal, sliding, left or right padding,
#: prefix-LM, bidirectional).
IDENTITIES = ("aligned", "filled")


def laplacian_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    laplacian_heads: HeadSpec,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    identity: str = "aligned",
    blend: float | Tensor | None = None,
    mix: tuple[Tensor, Tensor] | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Multi-head attention where the selected heads output (I - P) V instead of P V (or another head kind).

    Args:
        q: queries (B, H, T, D).
        k: keys (B, Hkv, S, D) with H % Hkv == 0 (GQA/MQA when Hkv < H).
        v: values (B, Hkv, S, D).
        laplacian_heads: int k (the trailing k heads are Laplacian), a bool mask of length H, H head kinds
            (:data:`lapheads.core.kinds.HEAD_KINDS`; a "local" head is ordinary here and an "untied" one negated:
            their module adds the untied local term), or a layer's ``LayerHeads`` (``lapheads.parse_heads``).
        attn_mask: optional bool (True = attend) or additive float mask broadcastable to (B, H, T, S); or an
            attention pattern (``lapheads.core.masks``: ``SlidingWindow``, ``Documents``, ``PrefixLM``, combined
            with ``&``) or a FlexAttention ``BlockMask``, run without a T x S mask (FlexAttention, or T x W bands
            for a window) by the backend ``lapheads.core.masks.attention_backend`` names.
        is_causal: causal attention; when T < S the queries are the last T positions (KV cache).
        dropout_p: attention dropout on P, so Laplacian heads compute (I - drop(P)) V.
        scale: softmax scale; default 1 / sqrt(D).
        identity: where the identity term reads each query's own value (:data:`IDENTITIES`). "aligned": the
            queries are the last T of the S keys. "filled": the last T of the keys any query may see (static
            caches; right for every mask shape).
        blend: lambda in [0, 1] for Laplacian heads, which then output lambda V + (1 - 2 lambda) P V: 0 is plain
            attention (a function-preserving start when converting a pretrained model), 1 (None) is V - P V. A
            0-dim tensor avoids recompiling as it changes.
        mix: (a, b), each of shape (H,): the coefficients of V and P V of the heads of kind "mix" (learnable;
            a = 0, b = 1 is an ordinary head, (1, -1) a Laplacian one); other heads ignore them.
        sinks: learned attention sinks (H,), as GPT-OSS defines them: one more logit per head in each query's
            softmax, whose value is zero, so P's rows sum to less than 1 (a Laplacian head keeps its identity term:
            V - P V). Run as a key of zeros in front of the keys with the sink as its additive mask entry: an
            explicit (B, H, T, S + 1) mask, differentiable in the sinks.

    Returns:
        (B, H, T, D) head outputs.
    """
    k, v, call = _prepare_with_sinks(q, k, v, laplacian_heads, attn_mask, is_causal, dropout_p, scale, identity,
                                     blend, mix, sinks)  # fmt: skip
    return _PATHS[_plan(q, k, v, call)](q, k, v, call)


def _prepare_with_sinks(q, k, v, laplacian_heads, attn_mask, is_causal, dropout_p, scale, identity, blend, mix, sinks):
    """(k, v, the checked call) as the paths read them; learned sinks checked as given, then run as a key in front
    (section "Sinks" below)."""
    if sinks is not None:
        _check_call(q, k, v, laplacian_heads, attn_mask, is_causal, dropout_p, identity, blend, sinks)
        k, v, attn_mask, is_causal, identity = _sink_key(q, k, v, attn_mask, is_causal, identity, sinks)
    return k, v, _prepare(q, k, v, laplacian_heads, attn_mask, is_causal, dropout_p, scale, identity, blend, mix)


#: what each path runs, in a sentence (the module docstring's table)
PATH_DESCRIPTIONS = {
    "sdpa": "plain F.scaled_dot_product_attention (no head is Laplacian)",
    "kinds": "SDPA and one expression of V, P V and the attended mean per head kind, differentiated by autograd",
    "node": "one autograd node: SDPA's backward unchanged, then in-place fix-ups of the Laplacian heads",
    "all_laplacian": "v - SDPA's output: one subtraction (every head Laplacian)",
    "in_place": "SDPA's output made Laplacian in place (no gradient wanted: no copy, no graph)",
    "traced": "one expression for torch.compile or a torch.func transform to fuse or differentiate",
    "combine": "SDPA, then a per-head sign and the masked value, one pass each way",
}
#: what each mask backend of ``lapheads.core.masks`` runs, in a sentence
MASK_DESCRIPTIONS = {
    "flex": "FlexAttention with a block mask (cost grows with the keys each query sees)",
    "banded": "queries in chunks, each against the keys its band reaches (T x W work, differentiable)",
    "dense": "SDPA with the pattern's (B, 1, T, S) bool mask",
}


class AttentionPlan(NamedTuple):
    """What :func:`laplacian_attention` runs for one call, as :func:`explain_attention` answers it.

    Attributes:
        path: the op's path (``PATH_DESCRIPTIONS``: sdpa, kinds, node, all_laplacian, in_place, traced, combine).
        mask_backend: where ``attn_mask`` is a pattern or a FlexAttention block mask, the backend that runs it
            (flex, banded, dense: ``lapheads.core.masks``); None for a tensor mask or none.
        sinks: whether learned sinks ran as a key of zeros in front of the keys (an explicit mask then).
    """

    path: str
    mask_backend: str | None
    sinks: bool

    def __str__(self) -> str:
        text = f"path {self.path}: {PATH_DESCRIPTIONS[self.path]}"
        if self.mask_backend is not None:
            text += f"; mask {self.mask_backend}: {MASK_DESCRIPTIONS[self.mask_backend]}"
        return text + ("; learned sinks as a key of zeros in front" if self.sinks else "")


def explain_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    laplacian_heads: HeadSpec,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    identity: str = "aligned",
    blend: float | Tensor | None = None,
    mix: tuple[Tensor, Tensor] | None = None,
    sinks: Tensor | None = None,
) -> AttentionPlan:
    """The path :func:`laplacian_attention` takes for these arguments, and the backend of a pattern mask, without
    running it (the same checks, the same one-line errors). Grad mode and ``requires_grad`` decide as in the call:
    ask where the call will run (inside ``torch.no_grad()`` for decoding)."""
    k, v, call = _prepare_with_sinks(q, k, v, laplacian_heads, attn_mask, is_causal, dropout_p, scale, identity,
                                     blend, mix, sinks)  # fmt: skip
    backend = attention_backend(q, k, call.attn_mask) if is_pattern(call.attn_mask) else None
    return AttentionPlan(_plan(q, k, v, call), backend, sinks is not None)


def laplacian_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    laplacian_heads: HeadSpec,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    identity: str = "aligned",
    blend: float | Tensor | None = None,
    mix: tuple[Tensor, Tensor] | None = None,
    sinks: Tensor | None = None,
    return_attn: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Textbook Laplacian attention: materialise P, use I - P on Laplacian heads, multiply by V.

    Same arguments and semantics as ``laplacian_attention``, O(T * S) memory per head: the parity reference of every
    path of the op, and what serves attention maps.

    Args:
        return_attn: also return P (B, H, T, S), the softmax matrix before dropout, for attention maps.

    Every other argument is ``laplacian_attention``'s.

    Returns:
        (B, H, T, D) head outputs, or ``(outputs, P)`` when ``return_attn``.
    """
    h, hkv = _check_call(q, k, v, laplacian_heads, attn_mask, is_causal, dropout_p, identity, blend, sinks)
    if isinstance(laplacian_heads, LayerHeads):
        laplacian_heads = laplacian_heads.op_spec
    kinds = _check_kinds(laplacian_heads, h, mix, blend) if is_kinds(laplacian_heads) else None
    if kinds is not None:
        laplacian_heads = [kind == "laplacian" for kind in kinds]
    mask = _host_mask(laplacian_heads, h).to(q.device)
    t, s = q.shape[-2], k.shape[-2]
    attn_mask = tensor_mask(attn_mask, q.shape[0], t, s, q.device)  # a pattern's, from its definition
    identity_matrix = None  # before the causal mask below could be folded in
    if identity != "aligned" and attn_mask is not None:
        identity_matrix = F.one_hot(_filled_index(attn_mask, t, s), s).to(q.dtype)  # (T, S)
    if hkv != h:
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    logits, attn = _softmax_matrix(q, k, attn_mask, is_causal, scale, sinks)
    dropped = F.dropout(attn, p=dropout_p) if dropout_p > 0 else attn
    eye = identity_matrix if identity_matrix is not None else _shifted_eye(t, s, attn)
    if kinds is not None and not is_plain_laplacian(kinds):
        # alpha I + beta P - gamma U, with U uniform over the keys each query may attend to
        alpha, beta, gamma = (c.view(1, h, 1, 1) for c in kind_coefficients(kinds, mix, attn.dtype, attn.device))
        allowed = torch.isfinite(logits).to(attn.dtype)
        uniform = allowed / allowed.sum(-1, keepdim=True).clamp_min(1)
        operator = alpha * eye + beta * dropped + gamma * uniform
        out = operator @ v
        if PROJECTING_KINDS.intersection(kinds):
            out = exclude_own_value(out, eye @ v, kinds)
        return (out, attn) if return_attn else out
    weight = 1.0 if blend is None else blend
    operator = torch.where(mask.view(1, h, 1, 1), weight * eye + (1 - 2 * weight) * dropped, dropped)
    out = operator @ v
    return (out, attn) if return_attn else out


def _softmax_matrix(
    q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float | None, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The masked logits and P = softmax(q k^T * scale) from their definition, (B, H, T, S) each (k per query head);
    with sinks, the softmax over the S logits and the head's sink, whose column is then dropped (GPT-OSS's eager form).

    A query with no key to attend to has P = 0 (SDPA's fused kernels agree): its ordinary heads output 0, its
    Laplacian heads their own value."""
    logits = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        attn_mask = _causal_mask(q.shape[-2], k.shape[-2], q.device)
    if attn_mask is not None:
        logits = logits.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else logits + attn_mask
    if sinks is not None:
        column = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        return logits, torch.cat([logits, column], dim=-1).softmax(dim=-1)[..., :-1]
    attn = torch.where(torch.isneginf(logits).all(-1, keepdim=True), 0.0, logits.softmax(dim=-1))
    return logits, attn


# ----------------------------------------------------------------------------------------------------------------
# The plan: one call's arguments, checked, and the path they take


class _Call(NamedTuple):
    """One call as the paths read it: checked, a cached causal call's mask made explicit, the heads resolved."""

    attn_mask: Tensor | None
    is_causal: bool
    dropout_p: float
    scale: float | None
    identity: str
    #: (H,) bool on q's device; None when no head is Laplacian or an int spec's ``runs`` say it all
    lap_mask: Tensor | None
    #: maximal blocks (start, stop, is_laplacian) of heads of one kind; None when unknown (a device mask, compiling)
    runs: tuple[tuple[int, int, bool], ...] | None
    blend: float | Tensor | None
    #: head kinds beyond ordinary and Laplacian (the "kinds" path), else None
    kinds: tuple[str, ...] | None
    mix: tuple[Tensor, Tensor] | None
    #: under torch.compile or a torch.func transform: no autograd.Function, no host read of a mask
    traced: bool


def _prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    laplacian_heads: HeadSpec,
    attn_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float | None,
    identity: str,
    blend: float | Tensor | None,
    mix: tuple[Tensor, Tensor] | None,
) -> _Call:
    """Check every argument (one-line errors) and resolve the heads, so the paths need no checks of their own."""
    h, _ = _check_qkv(q, k, v)
    _check_options(q, k, attn_mask, is_causal, dropout_p, identity, blend)
    t, s = q.shape[-2], k.shape[-2]
    if t == s:  # every identity rule reads each query's own key here (_filled_index), so a padded batch
        identity = "aligned"  # (transformers passes "filled") takes the one-node training path too
    elif is_causal:  # a KV cache: the causal mask aligned bottom-right; one query sees every key
        attn_mask, is_causal = (None, False) if t == 1 else (_causal_mask(t, s, q.device), False)
    if isinstance(laplacian_heads, LayerHeads):  # a layer's parsed heads: k, or its kinds
        laplacian_heads = laplacian_heads.op_spec
    if is_kinds(laplacian_heads):
        kinds = _check_kinds(laplacian_heads, h, mix, blend)
        if not is_plain_laplacian(kinds):
            return _Call(attn_mask, is_causal, dropout_p, scale, identity, None, None, None, kinds, mix, False)
        laplacian_heads = [kind == "laplacian" for kind in kinds]
    compiling = torch.compiler.is_compiling()
    # torch.compile and torch.func (grad, vmap, jvp) both take the plain-autograd expression: an autograd.Function
    # without functorch rules cannot run under a transform, and Inductor fuses the expression anyway
    traced = compiling or torch._C._are_functorch_transforms_active()
    lap_mask, runs = _resolve_heads(laplacian_heads, h, q.device, inspect_mask=not compiling)
    return _Call(attn_mask, is_causal, dropout_p, scale, identity, lap_mask, runs, blend, None, None, traced)


def _plan(q: Tensor, k: Tensor, v: Tensor, call: _Call) -> str:
    """The path of one call (the module docstring's table, in its order of precedence)."""
    if call.kinds is not None:
        return "kinds"
    if call.runs is None and call.lap_mask is None:
        return "sdpa"
    h, hkv = q.shape[1], k.shape[1]
    runs = call.runs
    # whole blocks that never split a GQA group: what the node and the in-place combine need
    blocks = runs is not None and call.blend is None and not call.traced
    if blocks and h != hkv:
        blocks = all(start % (h // hkv) == 0 for start, _, _ in runs)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # the node differentiates SDPA's own kernels: a tensor mask without a gradient only (a pattern has its backends)
    plain_mask = call.attn_mask is None or (isinstance(call.attn_mask, Tensor) and not call.attn_mask.requires_grad)
    if blocks and len(runs) > 1 and call.identity == "aligned" and needs_grad and plain_mask:
        return "node"
    if runs is not None and len(runs) == 1 and h == hkv and call.blend is None:
        return "all_laplacian"  # one run and some head Laplacian: every head is
    if blocks and not needs_grad:
        return "in_place"
    return "traced" if call.traced else "combine"


# ----------------------------------------------------------------------------------------------------------------
# The paths, one function each


def _sdpa_of(q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:
    return sdpa(q, k, v, call.attn_mask, call.dropout_p, call.is_causal, call.scale)


def _kinds_path(q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:
    v_self = _own_values(v, call.attn_mask, q.shape[-2], call.identity)
    y = _sdpa_of(q, k, v, call)
    return kinds_output(y, v_self, v, q, call.kinds, call.mix, call.attn_mask, call.is_causal, call.scale)


def _node_path(q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:
    return training_node(q, k, v, call.attn_mask, call.dropout_p, call.is_causal, call.scale, call.runs)


def _all_laplacian_path(q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:
    return _own_values(v, call.attn_mask, q.shape[-2], call.identity) - _sdpa_of(q, k, v, call)


def _in_place_path(q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:
    v_self = _own_values(v, call.attn_mask, q.shape[-2], call.identity)
    return combine_runs(_sdpa_of(q, k, v, call), v_self, call.runs, q.shape[1] // k.shape[1], in_place=True)


def _traced_path(q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:
    y, v_self, sign, lap = _signed_terms(q, k, v, call)
    return (y * sign + v_self * lap).view(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])  # no out=, no break


def _combine_path(q: Tensor, k: Tensor, v: Tensor, call: _Call) -> Tensor:
    y, v_self, sign, lap = _signed_terms(q, k, v, call)
    runs = call.runs if q.shape[1] == k.shape[1] and call.blend is None else None  # blocks only when G == 1
    return LaplacianCombine.apply(y, v_self, sign, lap, runs).view(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


def _signed_terms(q: Tensor, k: Tensor, v: Tensor, call: _Call) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """y viewed (B, Hkv, G, T, D), v_self (B, Hkv, 1, T, D), and per head sign = 1 - 2 lap, lap = the Laplacian
    weight (1, or the blend's lambda; 0 on ordinary heads), each (Hkv, G, 1, 1): out = y * sign + v_self * lap."""
    h, hkv, t = q.shape[1], k.shape[1], q.shape[-2]
    y = _sdpa_of(q, k, v, call)
    lap_mask = call.lap_mask
    if lap_mask is None:  # an int spec: the trailing run is Laplacian
        lap_mask = torch.arange(h, device=q.device) >= call.runs[-1][0]
    lap = lap_mask.to(y.dtype).view(hkv, h // hkv, 1, 1)
    if call.blend is not None:
        lap = lap * (call.blend.to(y.dtype) if isinstance(call.blend, Tensor) else call.blend)
    v_self = _own_values(v, call.attn_mask, t, call.identity).unsqueeze(2)
    return y.view(q.shape[0], hkv, h // hkv, t, v.shape[-1]), v_self, 1 - 2 * lap, lap


_PATHS = {
    "sdpa": _sdpa_of,
    "kinds": _kinds_path,
    "node": _node_path,
    "all_laplacian": _all_laplacian_path,
    "in_place": _in_place_path,
    "traced": _traced_path,
    "combine": _combine_path,
}


# ----------------------------------------------------------------------------------------------------------------
# Checks and the heads' resolution


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int]:
    qs, ks, vs = q.shape, k.shape, v.shape
    if (  # the common case in one expression (the op's per-call cost); any failure is explained below
        len(qs) == len(ks) == len(vs) == 4
        and qs[0] == ks[0] == vs[0]
        and ks[1] == vs[1] != 0
        and qs[1] % ks[1] == 0
        and ks[2] == vs[2] >= qs[2]
        and qs[3] == ks[3]
        and q.dtype == k.dtype == v.dtype
        and q.dtype.is_floating_point
        and q.device == k.device == v.device
    ):
        return qs[1], ks[1]
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise InputError(
            f"q, k, v must be 4-D (B, H, T, D); got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    h, hkv = q.shape[1], k.shape[1]
    if v.shape[1] != hkv or hkv == 0 or h % hkv:
        raise InputError(
            f"q has {h} heads and k, v have {k.shape[1]}, {v.shape[1]}; allowed: k and v with the same Hkv heads "
            f"and H % Hkv == 0"
        )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise InputError(f"batch sizes differ: {shapes}; allowed: the same B for q, k and v")
    if k.shape[-2] != v.shape[-2]:
        raise InputError(f"k has {k.shape[-2]} positions but v has {v.shape[-2]}: {shapes}; allowed: the same S")
    if q.shape[-1] != k.shape[-1]:
        raise InputError(f"q and k head dims differ: {shapes}; allowed: the same D for q and k")
    if q.shape[-2] > k.shape[-2]:
        raise InputError(
            f"q has {q.shape[-2]} positions but k has {k.shape[-2]}; allowed: T <= S (queries are the last T keys)"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise InputError(f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}; allowed: one floating dtype for all three")
    if not (q.device == k.device == v.device):
        raise InputError(f"devices q {q.device}, k {k.device}, v {v.device}; allowed: one device for all three")
    return h, hkv


def _check_options(
    q: Tensor,
    k: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    identity: str,
    blend: float | Tensor | None,
) -> None:
    """The op's other arguments, checked before torch sees them: one-line errors naming the value and the shapes."""
    b, h, t, _ = q.shape
    s = k.shape[-2]
    if identity not in IDENTITIES:
        raise InputError(f"identity={identity!r}; allowed: {', '.join(map(repr, IDENTITIES))}")
    if is_causal and attn_mask is not None:
        raise InputError("attn_mask and is_causal=True cannot be combined; fold the causal mask into attn_mask")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        if not is_pattern(attn_mask):
            raise InputError(
                f"attn_mask of type {type(attn_mask).__name__}; allowed: a bool or float tensor, an attention "
                "pattern (lapheads.core.masks) or a FlexAttention BlockMask"
            )
        check_pattern(attn_mask, b, t, s, dropout_p, identity)
    elif attn_mask is not None:
        if not (attn_mask.dtype == torch.bool or attn_mask.dtype.is_floating_point):
            raise InputError(
                f"attn_mask has dtype {attn_mask.dtype}; allowed: bool (True = attend) or an additive float"
            )
        try:
            shape = torch.broadcast_shapes(tuple(attn_mask.shape), (b, h, t, s))
        except RuntimeError:
            shape = None
        if shape != (b, h, t, s):
            raise InputError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, T, S) = {(b, h, t, s)} "
                f"for q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p <= 1:
        raise InputError(f"dropout_p={dropout_p!r}; allowed: a number in [0, 1]")
    if blend is not None:
        if isinstance(blend, Tensor):
            if blend.dim() != 0 or not blend.dtype.is_floating_point:
                raise InputError(
                    f"blend tensor of dtype {blend.dtype} and shape {tuple(blend.shape)}; allowed: a 0-dim float"
                )
            if blend.device.type == "cpu" and not torch.compiler.is_compiling() and not 0 <= float(blend) <= 1:
                raise InputError(f"blend={float(blend)}; allowed: a number in [0, 1]")
        elif isinstance(blend, bool) or not isinstance(blend, (int, float)) or not 0 <= blend <= 1:
            raise InputError(f"blend={blend!r}; allowed: a number in [0, 1] (0 = plain attention, 1 = V - PV)")


def _check_kinds(
    kinds: Sequence[str], num_heads: int, mix: tuple[Tensor, Tensor] | None, blend: float | Tensor | None
) -> tuple[str, ...]:
    """The op's view of given kinds: known names, (a, b) for mix heads, no blend unless all are Laplacian/ordinary."""
    kinds = tuple(kinds)
    if len(kinds) != num_heads or any(kind not in HEAD_KINDS for kind in kinds):
        raise HeadSpecError(f"head kinds {list(kinds)!r}; allowed: {num_heads} of {', '.join(HEAD_KINDS)}")
    if blend is not None and not is_plain_laplacian(kinds):
        raise InputError("blend applies to Laplacian heads only; allowed: blend=None with other head kinds")
    if "mix" in kinds:
        if mix is None or len(mix) != 2 or any(t.shape != (num_heads,) for t in mix):
            shapes = None if mix is None else [tuple(t.shape) for t in mix]
            raise InputError(f"mix heads need mix=(a, b) of shape ({num_heads},) each; got {shapes}")
    return kinds


def _check_flags(flags: Sequence[bool], num_heads: int) -> list[bool]:
    """One layer's Laplacian heads given to the op as Python bools: num_heads of them."""
    if not isinstance(flags, Sequence) or isinstance(flags, str):
        check_count(flags, num_heads)  # neither k, a mask nor bools (True, "3", 2.0): refused with what is allowed
    values = list(flags)
    if len(values) != num_heads or not all(isinstance(flag, bool) for flag in values):
        raise HeadSpecError(
            f"laplacian_heads mask {values!r} is not {num_heads} bools; "
            f"allowed: a bool sequence of length {num_heads} or an int from 0 to {num_heads}"
        )
    return values


def _host_mask(laplacian_heads: HeadSpec, num_heads: int) -> Tensor:
    """The op's spec for one layer (k, a bool tensor or bools) as a bool mask of shape (num_heads,)."""
    if isinstance(laplacian_heads, Tensor):
        check_mask_tensor(laplacian_heads, num_heads)
        return laplacian_heads
    if not isinstance(laplacian_heads, int) or isinstance(laplacian_heads, bool):
        return torch.tensor(_check_flags(laplacian_heads, num_heads), dtype=torch.bool)
    k = check_count(laplacian_heads, num_heads)
    return torch.arange(num_heads, device="cpu") >= num_heads - k


def _resolve_heads(
    laplacian_heads: HeadSpec, num_heads: int, device: torch.device, inspect_mask: bool = True
) -> tuple[Tensor | None, tuple[tuple[int, int, bool], ...] | None]:
    """The op's view of a spec: (bool mask on ``device``, head runs), or (None, None) when no head is Laplacian; an
    int spec gives (None, runs), its trailing run the Laplacian heads.

    No host-device copy or sync for an int spec, and none for a mask already on a CUDA device (its runs are then
    left unknown, None), so the op can sit inside a CUDA training step without stalling it. With
    ``inspect_mask=False`` (under torch.compile) a mask's values are never read on the host: no data-dependent
    branch, no graph break; an all-False mask then costs one fused elementwise pass.
    """
    if isinstance(laplacian_heads, int) and not isinstance(laplacian_heads, bool):
        k = check_count(laplacian_heads, num_heads)
        if k == 0:
            return None, None
        split = num_heads - k
        # no mask yet: the block paths need only the runs (the caller builds it where a general combine needs it)
        return None, (((0, split, False), (split, num_heads, True)) if split else ((0, num_heads, True),))
    if isinstance(laplacian_heads, Tensor):
        check_mask_tensor(laplacian_heads, num_heads)
        if laplacian_heads.device.type != "cpu" or not inspect_mask:
            return laplacian_heads.to(device), None
        mask = laplacian_heads
    else:  # a sequence of Python bools: decided on the host, compiled or not
        flags = _check_flags(laplacian_heads, num_heads)
        if not any(flags):
            return None, None
        return torch.tensor(flags, dtype=torch.bool, device=device), head_runs_of(flags)
    if not mask.any():
        return None, None
    return mask.to(device), head_runs(mask)


# ----------------------------------------------------------------------------------------------------------------
# Sinks: one more logit per head, as a key of zeros in front


def _check_call(q, k, v, laplacian_heads, attn_mask, is_causal, dropout_p, identity, blend, sinks) -> tuple[int, int]:
    """(H, Hkv) of a call as given, checked: q, k, v, the options and the sinks, (H,) floats with nothing a sink key
    in front would change the meaning of; each refused in one line."""
    h, hkv = _check_qkv(q, k, v)
    _check_options(q, k, attn_mask, is_causal, dropout_p, identity, blend)
    if sinks is None:
        return h, hkv
    if not isinstance(sinks, Tensor) or tuple(sinks.shape) != (h,) or not sinks.dtype.is_floating_point:
        shape = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise InputError(f"sinks of {shape}; allowed: a float tensor of shape ({h},), one logit per head")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise InputError("sinks with an attention pattern; allowed: sinks with a tensor mask, is_causal or no mask")
    if isinstance(laplacian_heads, LayerHeads):
        laplacian_heads = laplacian_heads.op_spec
    if is_kinds(laplacian_heads) and "centring" in laplacian_heads:  # its mean would count the sink key
        raise InputError("sinks with centring heads; allowed: sinks with every other head kind")
    return h, hkv


def _sink_key(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, identity: str, sinks: Tensor
) -> tuple[Tensor, Tensor, Tensor, bool, str]:
    """(k, v, mask, is_causal, identity) with a key and value of zeros in front of the S keys and an additive
    (B or 1, H, T, S + 1) mask whose first column is each head's sink: softmax over the keys and the sink, with the
    sink's value zero. The queries are still the last T keys; T == S stays "aligned" (each query its own key)."""
    identity = "aligned" if q.shape[-2] == k.shape[-2] else identity
    b, h, t, _ = q.shape
    s = k.shape[-2]
    if is_causal:
        attn_mask = _causal_mask(t, s, q.device)
    if attn_mask is None:
        keys = q.new_zeros(1, 1, t, s)
    elif attn_mask.dtype == torch.bool:
        keys = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    else:
        keys = attn_mask.to(q.dtype)
    keys = keys.expand(torch.broadcast_shapes(keys.shape, (1, h, t, s)))
    column = sinks.to(q.dtype).view(1, h, 1, 1).expand(keys.shape[0], h, t, 1)
    zero = k.new_zeros(b, k.shape[1], 1, k.shape[-1])
    return torch.cat([zero, k], dim=2), torch.cat([zero, v], dim=2), torch.cat([column, keys], dim=-1), False, identity


# ----------------------------------------------------------------------------------------------------------------
# Positions: each query's own key


def _own_values(v: Tensor, attn_mask: Tensor | None, t: int, identity: str) -> Tensor:
    """v at each query's own position, (B, Hkv, T, D), as ``identity`` says."""
    if identity == "aligned" or attn_mask is None:
        return identity_values(v, t)
    return v.index_select(2, _filled_index(attn_mask, t, v.shape[-2]))


def _filled_index(attn_mask: Tensor, t: int, s: int) -> Tensor:
    """(T,) key index of each query's own position: with T == S the queries are the keys themselves (whatever the
    mask: trailing padding hides keys from everyone, yet each query is still its own key); with T < S the last T of
    the keys that any query of any batch row may attend to (no key beyond them is visible to anyone: a static
    cache's empty slots). On the device, no host sync. Without such empty slots this is S - T + i."""
    if t == s:
        return torch.arange(t, device=attn_mask.device)
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min / 2
    seen = allowed.reshape(-1, allowed.shape[-1]).any(0)  # (S,): a key some query may see
    filled = s - seen.flip(0).to(torch.uint8).argmax()  # keys up to the last one seen (S when none is seen)
    return (torch.arange(t, device=attn_mask.device) + (filled - t)).clamp_min(0)


def _causal_mask(t: int, s: int, device: torch.device) -> Tensor:
    """Bool (T, S) mask, True = attend; aligned bottom-right so query i sits at key position S - T + i."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)


def _shifted_eye(t: int, s: int, like: Tensor) -> Tensor:
    """(T, S) matrix with ones at (i, S - T + i): each query's own key position."""
    return torch.ones(t, s, dtype=like.dtype, device=like.device).tril(s - t).triu(s - t)


# ----------------------------------------------------------------------------------------------------------------
# TorchScript's form


def scripted_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    coefficients: Tensor,
    exclusive: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    dropout_p: float,
    scale: float,
) -> Tensor:
    """The op in the form TorchScript compiles and saves (``torch.jit.save``): one SDPA call, then per head
    alpha V + beta P V + gamma mean(V) and the exclusive heads' projection, for self-attention (T == S, H == Hkv:
    the timm models' case). ``coefficients`` (3, H): each head's (alpha, beta, gamma) (:data:`KIND_COEFFICIENTS`,
    mix heads' learned (a, b)); ``exclusive`` (H,) bool. The same numbers as ``laplacian_attention`` up to
    rounding (a test pins it); eager code never takes this path."""
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
    alpha, beta, gamma = coefficients[0].view(1, -1, 1, 1), coefficients[1].view(1, -1, 1, 1), coefficients[2]
    out = y * beta + v * alpha
    if bool((gamma != 0).any()):  # centring heads: the mean of the keys each query may attend to
        if attn_mask is None and not is_causal:
            mean = v.mean(-2, keepdim=True)
        else:
            zeros = torch.zeros_like(q)
            mean = F.scaled_dot_product_attention(
                zeros, torch.zeros_like(k), v, attn_mask=attn_mask, is_causal=is_causal
            )
        out = out + mean * gamma.view(1, -1, 1, 1)
    if bool(exclusive.any()):
        n = F.normalize(v, dim=-1)
        out = torch.where(exclusive.view(1, -1, 1, 1), out - (out * n).sum(-1, keepdim=True) * n, out)
    return out
