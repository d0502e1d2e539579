"""Laplacian attention: the fused op and the textbook reference, side by side (as nanoGPT keeps its two paths).

A Laplacian head replaces its softmax matrix P by the random-walk graph Laplacian I - P, so it outputs
V - P V instead of P V (Zhang & Papyan, arXiv 2602.09297). Design choices:

* **One fused SDPA call for all heads.** ``laplacian_attention`` computes y = SDPA(q, k, v) for every head with
  ``F.scaled_dot_product_attention`` and then, in one elementwise pass, turns the Laplacian heads' y into v - y.
  No T x T tensor exists on this path and there is no Python loop over heads (the autograd machinery:
  ``lapheads.core._autograd``; under torch.compile the combine is one expression Inductor fuses).
* **On the CPU, a compiled training node where built.** The training path's autograd node (SDPA's CPU flash kernel,
  its backward and the Laplacian fix-ups) also exists in C++ (``lapheads.core.native``, ``lapheads kernel build``):
  bit-identical, without the Python autograd.Function's per-call cost; the Python node is the fallback.
* **The identity uses the query's own position.** With a KV cache (T < S) the T queries are the last T positions
  of the S keys, so the identity term is v[..., S - T:, :]; a causal mask is aligned the same way (bottom right).
* **GQA/MQA.** v is broadcast from its Hkv heads to the H query heads inside the combine, never copied.
* **Dropout acts on P.** SDPA drops entries of P, so a Laplacian head computes (I - drop(P)) V.
* **Head kinds** (``lapheads.core.heads``): negated, local, untied, sum, centring, exclusive and mix heads are one
  SDPA call plus one elementwise expression of V, P V and the attended mean (exclusive heads: minus P V's component
  along the token's own value), differentiated by autograd.
* **A textbook reference path** (``laplacian_attention_reference``) materialises P and applies its operator
  explicitly. It serves attention maps (``return_attn=True``) and is the parity reference for the fused path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional  # TorchScript reads Optional in scripted_attention's signature

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend

from lapheads.core import native
from lapheads.core._autograd import (
    _combine_runs,
    _flash_mask,
    _head_runs,
    _head_runs_of,
    _identity_values,
    _laplacian_blocks,
    _LaplacianCombine,
    _LaplacianSDPA,
    _sdpa,
)
from lapheads.core.heads import (
    KIND_COEFFICIENTS,
    PROJECTING_KINDS,
    HeadSpec,
    _check_count,
    _check_mask_tensor,
    _is_kinds,
    _kind_tuple,
    is_plain_laplacian,
    laplacian_head_mask,
)
from lapheads.errors import InputError

__all__ = ["IDENTITIES", "laplacian_attention", "laplacian_attention_reference", "scripted_attention"]

#: Where the identity term reads each query's own value (``identity=``): "aligned", the queries are the last T of the
#: S keys; "filled", the same when T == S, else the last T of the keys any query may attend to (a static cache's
#: filled slots; with a dynamic cache or none it is "aligned" for every mask: causal, sliding, left or right padding,
#: prefix-LM, bidirectional). "last_allowed"
#: is the earlier name of "filled" (it read each query's last allowed key, which a prefix-LM mask moves off the query).
IDENTITIES = ("aligned", "filled", "last_allowed")

_FLASH = int(SDPBackend.FLASH_ATTENTION)


def _check_identity(identity: str, attn_mask: Tensor | None) -> None:
    if identity not in IDENTITIES or (identity == "last_allowed" and attn_mask is None):
        raise InputError(
            f"identity={identity!r} with attn_mask {'None' if attn_mask is None else 'given'}; allowed: "
            "'aligned', 'filled', or 'last_allowed' with an attn_mask"
        )


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


def _own_values(v: Tensor, attn_mask: Tensor | None, t: int, identity: str) -> Tensor:
    """v at each query's own position, (B, Hkv, T, D), as ``identity`` says."""
    if identity == "aligned" or attn_mask is None:
        return _identity_values(v, t)
    return v.index_select(2, _filled_index(attn_mask, t, v.shape[-2]))


def _runs_cpu_flash(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool, scale: float | None
) -> bool:
    """Whether F.scaled_dot_product_attention would run its CPU flash kernel here (its own dispatcher decides, so
    ``torch.nn.attention.sdpa_kernel`` is respected): the op then calls that kernel and its backward directly,
    without the re-entrant autograd call that is most of its fixed cost at small shapes. A bool mask is converted
    as SDPA converts it; a float mask must already be of q's dtype (SDPA's own rule)."""
    if q.device.type != "cpu" or (attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype)):
        return False
    gqa = q.shape[1] != k.shape[1]
    return torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa) == _FLASH


def _causal_mask(t: int, s: int, device: torch.device) -> Tensor:
    """Bool (T, S) mask, True = attend; aligned bottom-right so query i sits at key position S - T + i."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)


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
    q: Tensor, k: Tensor, attn_mask: Tensor | None, dropout_p: float, blend: float | Tensor | None
) -> None:
    """The op's other arguments, checked before torch sees them: one-line errors naming the value and the shapes."""
    b, h, t, _ = q.shape
    s = k.shape[-2]
    if attn_mask is not None:
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
) -> Tensor:
    """Multi-head attention where the selected heads output (I - P) V instead of P V (or another head kind).

    Args:
        q: queries (B, H, T, D).
        k: keys (B, Hkv, S, D) with H % Hkv == 0 (GQA/MQA when Hkv < H).
        v: values (B, Hkv, S, D).
        laplacian_heads: int k (the trailing k heads are Laplacian), a bool mask of length H, or H head kinds
            (:data:`HEAD_KINDS`; a "local" head is ordinary here and an "untied" one negated: their module adds
            the untied local term).
        attn_mask: optional bool (True = attend) or additive float mask broadcastable to (B, H, T, S).
        is_causal: causal attention; when T < S the queries are the last T positions (KV cache).
        dropout_p: attention dropout on P, so Laplacian heads compute (I - drop(P)) V.
        scale: softmax scale; default 1 / sqrt(D).
        identity: where the identity term reads each query's own value (:data:`IDENTITIES`). "aligned": the
            queries are the last T of the S keys. "filled" (or its earlier name "last_allowed", which needs a
            mask): the last T of the keys any query may see (static caches; right for every mask shape).
        blend: lambda in [0, 1] for Laplacian heads, which then output lambda V + (1 - 2 lambda) P V: 0 is plain
            attention (a function-preserving start when converting a pretrained model), 1 (None) is V - P V. A
            0-dim tensor avoids recompiling as it changes.
        mix: (a, b), each of shape (H,): the coefficients of V and P V of the heads of kind "mix" (learnable;
            a = 0, b = 1 is an ordinary head, (1, -1) a Laplacian one); other heads ignore them.

    Returns:
        (B, H, T, D) head outputs.
    """
    h, hkv = _check_qkv(q, k, v)
    _check_options(q, k, attn_mask, dropout_p, blend)
    _check_identity(identity, attn_mask)
    if q.shape[-2] == k.shape[-2]:  # with T == S every rule reads each query's own key (_filled_index): "aligned",
        identity = "aligned"  # so a padded batch (transformers passes "filled") takes the one-node training path too
    if _is_kinds(laplacian_heads):
        kinds = _check_kinds(laplacian_heads, h, mix, blend)
        if not is_plain_laplacian(kinds):
            return _kinds_attention(q, k, v, kinds, mix, attn_mask, is_causal, dropout_p, scale, identity)
        laplacian_heads = [kind == "laplacian" for kind in kinds]
    compiling = torch.compiler.is_compiling()
    # torch.compile and torch.func (grad, vmap, jvp) both take the plain-autograd expression: an autograd.Function
    # without functorch rules cannot run under a transform, and Inductor fuses the expression anyway
    traced = compiling or torch._C._are_functorch_transforms_active()
    lap_mask, runs = _resolve_heads(laplacian_heads, h, q.device, inspect_mask=not compiling)
    t, s = q.shape[-2], k.shape[-2]
    if is_causal and t != s:
        if attn_mask is not None:
            raise InputError("attn_mask and is_causal=True cannot be combined; fold the causal mask into attn_mask")
        attn_mask, is_causal = (None, False) if t == 1 else (_causal_mask(t, s, q.device), False)
    g = h // hkv
    blocks = runs is not None and blend is None and all(start % g == 0 for start, _, _ in runs) and not traced
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if (
        blocks
        and len(runs) > 1  # every head Laplacian: v_self - y below is already the cheapest form
        and identity == "aligned"
        and needs_grad
        and not (attn_mask is not None and attn_mask.requires_grad)
    ):
        cpu_flash = _runs_cpu_flash(q, k, v, attn_mask, dropout_p, is_causal, scale)
        if cpu_flash and (node := native.module()) is not None:  # the same node compiled: no Python Function cost
            starts, stops = _laplacian_blocks(runs)
            return node.laplacian_sdpa(q, k, v, _flash_mask(attn_mask, q), dropout_p, is_causal, scale, starts, stops)
        sdpa = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        return _LaplacianSDPA.apply(q, k, v, sdpa, runs, cpu_flash)
    y = _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if runs is None and lap_mask is None:
        return y  # no Laplacian head: exactly plain SDPA, nothing extra
    v_self = _own_values(v, attn_mask, t, identity)
    if runs is not None and len(runs) == 1 and hkv == h and blend is None:
        return v_self - y  # every head Laplacian: one subtraction, autograd needs nothing special
    if blocks and not needs_grad:  # inference (decoding): no graph; SDPA's fresh output turned Laplacian in place
        return _combine_runs(y, v_self, runs, g, in_place=True)
    if lap_mask is None:  # an int spec: its mask is needed only from here on
        lap_mask = torch.arange(h, device=q.device) >= runs[-1][0]
    if blend is not None:
        runs = None  # a partial Laplacian: the general sign / lap combine
    b, d = q.shape[0], v.shape[-1]
    lap = lap_mask.to(y.dtype).view(hkv, g, 1, 1)
    if blend is not None:
        lap = lap * (blend.to(y.dtype) if isinstance(blend, Tensor) else blend)
    sign = 1 - 2 * lap
    y, v_self = y.view(b, hkv, g, t, d), v_self.unsqueeze(2)
    if traced:  # one expression Inductor fuses into its neighbours; no out= views, no graph break
        return (y * sign + v_self * lap).view(b, h, t, d)
    return _LaplacianCombine.apply(y, v_self, sign, lap, runs if g == 1 else None).view(b, h, t, d)


def _check_kinds(
    kinds: Sequence[str], num_heads: int, mix: tuple[Tensor, Tensor] | None, blend: float | Tensor | None
) -> tuple[str, ...]:
    """The op's view of given kinds: known names, (a, b) for mix heads, no blend unless all are Laplacian/ordinary."""
    kinds = _kind_tuple(kinds, num_heads)
    if blend is not None and not is_plain_laplacian(kinds):
        raise InputError("blend applies to Laplacian heads only; allowed: blend=None with other head kinds")
    if "mix" in kinds:
        if mix is None or len(mix) != 2 or any(t.shape != (num_heads,) for t in mix):
            shapes = None if mix is None else [tuple(t.shape) for t in mix]
            raise InputError(f"mix heads need mix=(a, b) of shape ({num_heads},) each; got {shapes}")
    return kinds


def _kind_coefficients(
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


def _attended_mean(v: Tensor, q: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float | None) -> Tensor:
    """The mean of the values each query attends to (B, H or Hkv, T, D), without a T x T tensor: the mean of all
    keys; under a causal mask the running mean up to the query's own position; under any other mask uniform
    attention over the allowed keys (SDPA with all-equal scores)."""
    t, s = q.shape[-2], v.shape[-2]
    if attn_mask is None and not is_causal:
        return v.mean(-2, keepdim=True).expand(*v.shape[:-2], t, v.shape[-1])
    if attn_mask is None:  # causal, queries the last T of the S keys
        counts = torch.arange(s - t + 1, s + 1, device=v.device, dtype=v.dtype).unsqueeze(-1)
        return v.cumsum(-2)[..., s - t :, :] / counts
    return _sdpa(torch.zeros_like(q), v.new_zeros(v.shape[:-1] + (q.shape[-1],)), v, attn_mask, 0.0, False, scale)


def _kinds_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kinds: tuple[str, ...],
    mix: tuple[Tensor, Tensor] | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float | None,
    identity: str,
) -> Tensor:
    """out_h = alpha_h V_self + beta_h P V - gamma_h mean(V): one SDPA call (plus the attended mean when a head
    centres), one elementwise expression; autograd differentiates it, mix coefficients included."""
    h, hkv = q.shape[1], k.shape[1]
    t, s = q.shape[-2], k.shape[-2]
    if is_causal and t != s:
        attn_mask, is_causal = (None, False) if t == 1 else (_causal_mask(t, s, q.device), False)
    y = _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    alpha, beta, gamma = _kind_coefficients(kinds, mix, y.dtype, y.device)
    v_self = _own_values(v, attn_mask, t, identity)
    b, d, g = q.shape[0], v.shape[-1], h // hkv
    shape = (hkv, g, 1, 1)
    out = y.view(b, hkv, g, t, d) * beta.view(shape) + v_self.unsqueeze(2) * alpha.view(shape)
    if "centring" in kinds:
        mean = _attended_mean(v, q, attn_mask, is_causal, scale)
        mean = mean.view(b, hkv, g, t, d) if mean.shape[1] == h else mean.unsqueeze(2)
        out = out + mean * gamma.view(shape)
    out = out.view(b, h, t, d)
    if PROJECTING_KINDS.intersection(kinds):
        own = v_self.unsqueeze(2).expand(b, hkv, g, t, d).reshape(b, h, t, d)
        out = _exclude_own_value(out, own, kinds)
    return out


def _exclude_own_value(out: Tensor, own: Tensor, kinds: Sequence[str]) -> Tensor:
    """Exclusive heads' z = y - (y . n) n with n = v / |v| the token's own value direction (XSA, arXiv 2603.09078;
    ``F.normalize``'s eps keeps a zero value's z = y); other heads unchanged. out, own: (B, H, T, D)."""
    n = F.normalize(own, dim=-1)
    exclusive = torch.tensor([kind in PROJECTING_KINDS for kind in kinds], device=out.device).view(1, -1, 1, 1)
    return torch.where(exclusive, out - (out * n).sum(-1, keepdim=True) * n, out)


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
        k = _check_count(laplacian_heads, num_heads)
        if k == 0:
            return None, None
        split = num_heads - k
        # no mask yet: the block paths need only the runs (the caller builds it where a general combine needs it)
        return None, (((0, split, False), (split, num_heads, True)) if split else ((0, num_heads, True),))
    if isinstance(laplacian_heads, Tensor):
        _check_mask_tensor(laplacian_heads, num_heads)
        if laplacian_heads.device.type != "cpu" or not inspect_mask:
            return laplacian_heads.to(device), None
        mask = laplacian_heads
    else:  # a sequence of Python bools: decided on the host, compiled or not
        laplacian_head_mask(laplacian_heads, num_heads)  # validates the length and that each item is a bool
        flags = list(laplacian_heads)
        if not any(flags):
            return None, None
        return torch.tensor(flags, dtype=torch.bool, device=device), _head_runs_of(flags)
    if not mask.any():
        return None, None
    return mask.to(device), _head_runs(mask)


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
    return_attn: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Textbook Laplacian attention: materialise P, use I - P on Laplacian heads, multiply by V.

    Same arguments and semantics as ``laplacian_attention``; O(T * S) memory per head.

    Args:
        return_attn: also return P (B, H, T, S), the softmax matrix before dropout, for attention maps.

    Returns:
        (B, H, T, D) head outputs, or ``(outputs, P)`` when ``return_attn``.
    """
    h, hkv = _check_qkv(q, k, v)
    _check_options(q, k, attn_mask, dropout_p, blend)
    _check_identity(identity, attn_mask)
    kinds = _check_kinds(laplacian_heads, h, mix, blend) if _is_kinds(laplacian_heads) else None
    if kinds is not None:
        laplacian_heads = [kind == "laplacian" for kind in kinds]
    mask = laplacian_head_mask(laplacian_heads, h).to(q.device)
    t, s = q.shape[-2], k.shape[-2]
    identity_matrix = None  # before the causal mask below could be folded in
    if identity != "aligned" and attn_mask is not None:
        identity_matrix = F.one_hot(_filled_index(attn_mask, t, s), s).to(q.dtype)  # (T, S)
    if hkv != h:
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        if attn_mask is not None:
            raise InputError("attn_mask and is_causal=True cannot be combined; fold the causal mask into attn_mask")
        attn_mask = _causal_mask(t, s, q.device)
    if attn_mask is not None:
        logits = logits.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else logits + attn_mask
    attn = logits.softmax(dim=-1)
    # a query with no key to attend to has P = 0 (SDPA's fused kernels agree): its ordinary heads output 0, its
    # Laplacian heads their own value
    attn = torch.where(torch.isneginf(logits).all(-1, keepdim=True), 0.0, attn)
    dropped = F.dropout(attn, p=dropout_p) if dropout_p > 0 else attn
    eye = identity_matrix if identity_matrix is not None else _shifted_eye(t, s, attn)
    if kinds is not None and not is_plain_laplacian(kinds):
        # alpha I + beta P - gamma U, with U uniform over the keys each query may attend to
        alpha, beta, gamma = (c.view(1, h, 1, 1) for c in _kind_coefficients(kinds, mix, attn.dtype, attn.device))
        allowed = torch.isfinite(logits).to(attn.dtype)
        uniform = allowed / allowed.sum(-1, keepdim=True).clamp_min(1)
        operator = alpha * eye + beta * dropped + gamma * uniform
        out = operator @ v
        if PROJECTING_KINDS.intersection(kinds):
            out = _exclude_own_value(out, eye @ v, kinds)
        return (out, attn) if return_attn else out
    weight = 1.0 if blend is None else blend
    operator = torch.where(mask.view(1, h, 1, 1), weight * eye + (1 - 2 * weight) * dropped, dropped)
    out = operator @ v
    return (out, attn) if return_attn else out


def _shifted_eye(t: int, s: int, like: Tensor) -> Tensor:
    """(T, S) matrix with ones at (i, S - T + i): each query's own key position."""
    return torch.ones(t, s, dtype=like.dtype, device=like.device).tril(s - t).triu(s - t)


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
