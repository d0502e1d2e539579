"""Laplacian heads: the op, the timm-compatible module, and the one head-spec parser.

A Laplacian head replaces its softmax matrix P by the random-walk graph Laplacian I - P, so it outputs
V - P V instead of P V (Zhang & Papyan, arXiv 2602.09297). Design choices:

* **One fused SDPA call for all heads.** ``laplacian_attention`` computes y = SDPA(q, k, v) for every head with
  ``F.scaled_dot_product_attention`` and then, in one elementwise pass, turns the Laplacian heads' y into v - y.
  No T x T tensor exists on this path and there is no Python loop over heads.
* **One autograd.Function around SDPA and the combine, in training.** ``_LaplacianSDPA`` runs SDPA on its own
  small graph and writes the output head block by head block (ordinary heads copied, Laplacian heads v - y). Its
  backward hands the incoming gradient to SDPA's backward *unchanged* and then fixes the Laplacian heads in place:
  SDPA's backward is linear in the output gradient, per head, so negating a Laplacian head's dq, dk and dv equals
  feeding it -g; dv then gains g at the query's own position. No sign-flipped copy of g, no (B, H, T, D) gradient
  of zeros for the ordinary heads' identity term, no extra accumulation pass (benchmarks/attention.py). Where that
  does not apply (a GQA group mixing the two kinds, a blend, the "last_allowed" identity, a mask that needs a
  gradient, inference) ``_LaplacianCombine`` multiplies by a per-head sign and adds the masked value; under
  torch.compile the combine is one expression Inductor fuses.
* **The identity uses the query's own position.** With a KV cache (T < S) the T queries are the last T positions
  of the S keys, so the identity term is v[..., S - T:, :]; a causal mask is aligned the same way (bottom right).
* **GQA/MQA.** v is broadcast from its Hkv heads to the H query heads inside the combine, never copied.
* **Dropout acts on P.** SDPA drops entries of P, so a Laplacian head computes (I - drop(P)) V.
* **A textbook reference path** (``laplacian_attention_reference``) materialises P and applies I - P explicitly.
  It serves attention maps (``return_attn=True``) and is the parity reference for the fused path.
* **Trailing heads.** An integer k makes the *last* k heads Laplacian, the paper's convention.
* **One parser.** ``parse_laplacian_heads`` turns every accepted spec (int, "0,2,2,0", per-layer ints, per-layer
  masks) into one bool mask per layer; every model and the CLI use it, so error messages are the same everywhere.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence
from typing import List, Optional, Tuple, Union  # TorchScript reads typing.Optional / Tuple in string annotations

import torch
import torch.nn.functional as F
from timm.layers import Attention
from torch import Tensor

from lapheads.errors import InputError, LapheadsError

__all__ = [
    "HeadSpec",
    "HEAD_KINDS",
    "HEAD_SPEC_PATTERN",
    "HeadSpecError",
    "LaplacianAttention",
    "LaplacianHeadsMixin",
    "laplacian_attention",
    "laplacian_attention_reference",
    "laplacian_head_mask",
    "parse_head_kinds",
    "parse_laplacian_heads",
]

#: What ``laplacian_heads`` accepts for one layer: k trailing heads, or a bool mask of length num_heads.
HeadSpec = Union[int, Sequence[bool], Tensor]


class HeadSpecError(LapheadsError, ValueError):
    """A Laplacian-head spec that cannot be applied; the message names the value and what is allowed."""


# ----------------------------------------------------------------------------------------------------------------
# Head specs


def _check_count(k: object, num_heads: int, where: str = "") -> int:
    """Validate one per-layer head count and return it as an int."""
    # bool is an int subclass; True would silently mean "1 head", which is never what the user meant.
    if isinstance(k, bool) or not isinstance(k, int):
        raise HeadSpecError(
            f"laplacian_heads{where}={k!r} is a {type(k).__name__}; allowed: an int from 0 to {num_heads}"
        )
    if not 0 <= k <= num_heads:
        raise HeadSpecError(f"laplacian_heads{where}={k} is out of range; allowed: 0 to {num_heads} (num_heads)")
    return k


def _check_mask_tensor(mask: Tensor, num_heads: int) -> None:
    if mask.dtype != torch.bool or mask.shape != (num_heads,):
        raise HeadSpecError(
            f"laplacian_heads mask has dtype {mask.dtype} and shape {tuple(mask.shape)}; "
            f"allowed: a bool tensor of shape ({num_heads},) or an int from 0 to {num_heads}"
        )


def laplacian_head_mask(laplacian_heads: HeadSpec, num_heads: int) -> Tensor:
    """Turn one layer's spec into a bool mask of shape (num_heads,), True for Laplacian heads.

    Args:
        laplacian_heads: an int k (the trailing k heads are Laplacian) or a bool tensor / sequence of length
            num_heads.
        num_heads: the layer's number of (query) heads.

    Returns:
        A bool CPU tensor of shape (num_heads,).
    """
    if isinstance(laplacian_heads, Tensor):
        _check_mask_tensor(laplacian_heads, num_heads)
        return laplacian_heads.detach().to("cpu").clone()
    if isinstance(laplacian_heads, Sequence) and not isinstance(laplacian_heads, str):
        if len(laplacian_heads) != num_heads or not all(isinstance(b, bool) for b in laplacian_heads):
            raise HeadSpecError(
                f"laplacian_heads mask {list(laplacian_heads)!r} is not {num_heads} bools; "
                f"allowed: a bool sequence of length {num_heads} or an int from 0 to {num_heads}"
            )
        return torch.tensor(list(laplacian_heads), dtype=torch.bool, device="cpu")
    k = _check_count(laplacian_heads, num_heads)
    # Explicitly on the CPU: under ``with torch.device("meta")`` a mask must still hold its values.
    mask = torch.zeros(num_heads, dtype=torch.bool, device="cpu")
    mask[num_heads - k :] = True
    return mask


_INT_RE = re.compile(r"^\s*\d+\s*$")


def parse_laplacian_heads(spec: object, num_heads: int, num_layers: int) -> list[Tensor]:
    """Parse any Laplacian-head spec into one bool mask per layer.

    Args:
        spec: one of
            * an int k: the trailing k heads of every layer are Laplacian ("kL" in the paper);
            * a string: ``"3"`` (same as 3) or a comma-separated per-layer list ``"0,2,2,0"``;
            * a sequence of ints, one per layer;
            * a sequence of per-layer masks (bool sequences or tensors of length num_heads), or a bool tensor of
              shape (num_layers, num_heads).
        num_heads: heads per layer.
        num_layers: number of attention layers.

    Returns:
        ``num_layers`` bool tensors of shape (num_heads,).

    Raises:
        HeadSpecError: naming the bad value and what is allowed.
    """
    if isinstance(spec, str) and re.search("[a-zA-Z]", spec):  # head kinds: their Laplacian heads
        layers = parse_head_kinds(spec, num_heads, num_layers)
        others = sorted({kind for kinds in layers for kind in kinds} - {"ordinary", "laplacian"})
        if others:  # never drop a kind silently where a model can only tell ordinary from Laplacian heads
            raise HeadSpecError(
                f"laplacian_heads={spec!r} names head kinds ({', '.join(others)}) this model cannot run; allowed "
                "here: ordinary and Laplacian heads (the other kinds: lapheads' timm ViTs, create_vit)"
            )
        return [torch.tensor([kind == "laplacian" for kind in kinds]) for kinds in layers]
    allowed = (
        f"allowed: an int 0..{num_heads}, a comma-separated list of {num_layers} such ints (e.g. "
        f"{','.join(['0'] * min(num_layers, 4))}{',...' if num_layers > 4 else ''}), or {num_layers} bool masks "
        f"of length {num_heads}"
    )
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise HeadSpecError(f"laplacian_heads is an empty string; {allowed}")
        parts = text.split(",")
        if not all(_INT_RE.match(p) for p in parts):
            raise HeadSpecError(f"laplacian_heads={spec!r} is not an int or a comma-separated int list; {allowed}")
        counts = [int(p) for p in parts]
        spec = counts[0] if len(counts) == 1 else counts
    spec = _per_layer(spec, num_heads, num_layers, allowed)
    if isinstance(spec, Sequence):
        masks = []
        for layer, item in enumerate(spec):
            if isinstance(item, (Tensor, Sequence)) and not isinstance(item, str):
                masks.append(laplacian_head_mask(item, num_heads))
            else:
                masks.append(laplacian_head_mask(_check_count(item, num_heads, f"[layer {layer}]"), num_heads))
        return masks
    if isinstance(spec, bool) or not isinstance(spec, int):
        raise HeadSpecError(f"laplacian_heads={spec!r} is a {type(spec).__name__}; {allowed}")
    mask = laplacian_head_mask(_check_count(spec, num_heads), num_heads)
    return [mask.clone() for _ in range(num_layers)]


def _per_layer(spec: object, num_heads: int, num_layers: int, allowed: str) -> object:
    """A (layers, heads) bool tensor as a list of rows; a sequence of the wrong length refused; else ``spec``."""
    if isinstance(spec, Tensor):
        if spec.dtype != torch.bool or spec.dim() != 2:
            raise HeadSpecError(
                f"laplacian_heads tensor has dtype {spec.dtype} and shape {tuple(spec.shape)}; "
                f"allowed: a bool tensor of shape ({num_layers}, {num_heads})"
            )
        spec = list(spec.unbind(0))
    if isinstance(spec, Sequence) and not isinstance(spec, str) and len(spec) != num_layers:
        raise HeadSpecError(
            f"laplacian_heads has {len(spec)} entries {_short(spec)} but the model has {num_layers} layers; {allowed}"
        )
    return spec


def _short(seq: Sequence) -> str:
    text = repr([x.tolist() if isinstance(x, Tensor) else x for x in seq])
    return text if len(text) <= 60 else text[:57] + "..."


def format_head_mask(mask: Tensor) -> str:
    """Human-readable head mask, e.g. ``'3/6 Laplacian: [3, 4, 5]'``."""
    idx = mask.nonzero().flatten().tolist()
    return f"{len(idx)}/{mask.numel()} Laplacian: {idx}"


# ----------------------------------------------------------------------------------------------------------------
# Head kinds: what in a Laplacian head does the work


#: Every kind a head can be. A Laplacian head is an ordinary head with its P V term negated plus a token-local
#: term V (W_V x through W_O), the two tied by sharing W_V and W_O; the other kinds take those parts apart.
HEAD_KINDS = ("ordinary", "laplacian", "negated", "local", "centring", "mix")
#: Per fixed kind, the coefficients of (the head's own value V, P V, the mean of the attended values): ordinary
#: P V; laplacian V - P V; negated -P V (the Laplacian head without its local term); local P V, plus an untied
#: token-local term its module adds; centring V - mean(V) over the attended positions (no attention at all).
#: mix (a V + b P V, learnable a, b; a = 0, b = 1 at init) takes its coefficients from the module.
KIND_COEFFICIENTS = {
    "ordinary": (0.0, 1.0, 0.0),
    "laplacian": (1.0, -1.0, 0.0),
    "negated": (0.0, -1.0, 0.0),
    "local": (0.0, 1.0, 0.0),
    "centring": (1.0, 0.0, -1.0),
    "mix": (0.0, 1.0, 0.0),
}
_KIND_ITEM = re.compile(r"^[a-z]+(:\d+)?(\+[a-z]+:\d+)*$")
_KIND_NAME = "(" + "|".join(HEAD_KINDS) + ")"
_SPEC_ITEM = rf"\s*(\d+|{_KIND_NAME}(:\d+)?(\+{_KIND_NAME}:\d+)*|{_KIND_NAME}(/{_KIND_NAME})+)\s*"
#: The written form of every head spec ``parse_head_kinds`` reads as text: items (a k, a kind, kind:k+kind:j or
#: kind/kind/...) separated by commas. Configs check it before a model exists; the counts are checked at build.
HEAD_SPEC_PATTERN = re.compile(rf"{_SPEC_ITEM}(,{_SPEC_ITEM})*")


def _layer_kinds(item: object, num_heads: int, where: str) -> tuple[str, ...]:
    """One layer's kinds from an int k, a kind name, "kind:k+kind:j" (the trailing heads, in that order; the rest
    ordinary), "a/b/c" (one per head), or a sequence of names / bools."""
    allowed = (
        f"allowed: an int 0..{num_heads}, a kind ({', '.join(HEAD_KINDS)}), kind:k[+kind:j] for the trailing "
        f"heads, or {num_heads} kinds joined by '/'"
    )
    if isinstance(item, (Tensor, Sequence)) and not isinstance(item, str):
        values = list(item.tolist() if isinstance(item, Tensor) else item)
        if values and all(isinstance(x, str) for x in values):
            item = "/".join(values)
        else:
            return tuple("laplacian" if m else "ordinary" for m in laplacian_head_mask(item, num_heads).tolist())
    if isinstance(item, int) and not isinstance(item, bool):
        k = _check_count(item, num_heads, where)
        return ("ordinary",) * (num_heads - k) + ("laplacian",) * k
    text = str(item).strip().lower() if isinstance(item, str) else None
    if text is None:
        raise HeadSpecError(f"laplacian_heads{where}={item!r} is a {type(item).__name__}; {allowed}")
    if _INT_RE.match(text):
        return _layer_kinds(int(text), num_heads, where)
    if "/" in text:
        kinds = tuple(part.strip() for part in text.split("/"))
        if len(kinds) != num_heads:
            raise HeadSpecError(f"laplacian_heads{where}={item!r} names {len(kinds)} heads; {allowed}")
    elif _KIND_ITEM.match(text):
        if ":" not in text:
            kinds = (text,) * num_heads
        else:
            trailing = []
            for part in text.split("+"):
                kind, count = part.split(":")
                trailing += [kind] * int(count)
            if len(trailing) > num_heads:
                raise HeadSpecError(
                    f"laplacian_heads{where}={item!r} asks for {len(trailing)} heads of {num_heads}; {allowed}"
                )
            kinds = ("ordinary",) * (num_heads - len(trailing)) + tuple(trailing)
    else:
        raise HeadSpecError(f"laplacian_heads{where}={item!r} is not a head spec; {allowed}")
    unknown = sorted({k for k in kinds if k not in HEAD_KINDS})
    if unknown:
        raise HeadSpecError(f"laplacian_heads{where}={item!r}: unknown kind {unknown[0]!r}; {allowed}")
    return kinds


def parse_head_kinds(spec: object, num_heads: int, num_layers: int) -> list[tuple[str, ...]]:
    """Parse any head spec into each layer's head kinds (the one parser: ``parse_laplacian_heads`` reads its
    Laplacian heads from this).

    Args:
        spec: everything ``parse_laplacian_heads`` accepts (an int k, "0,2,2,0", per-layer ints or masks), and kinds:
            * a kind name, every head of every layer: ``"mix"``, ``"negated"``;
            * ``"kind:k"`` or ``"kind:k+kind:j"``: the trailing heads of every layer, in that order, the rest
              ordinary (``"negated:3"``; ``"laplacian:1+local:1"``);
            * ``"a/b/c"``: one kind per head (``"ordinary/negated/laplacian"``);
            * a comma-separated list of such items, one per layer (``"0,0,0,negated:3,negated:3,negated:3"``), or a
              sequence of per-layer items (names, masks or kind lists).
        num_heads: heads per layer.
        num_layers: attention layers.

    Returns:
        ``num_layers`` tuples of ``num_heads`` kinds.

    Raises:
        HeadSpecError: naming the bad value and what is allowed.
    """
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise HeadSpecError("laplacian_heads is an empty string; allowed: an int, a kind or a per-layer list")
        items = [p.strip() for p in text.split(",")]
        if len(items) == 1:
            return [_layer_kinds(items[0], num_heads, "")] * num_layers
        if len(items) == num_layers:
            try:
                return [_layer_kinds(item, num_heads, f"[layer {i}]") for i, item in enumerate(items)]
            except HeadSpecError as err:  # name the whole spec the user wrote, then the bad item
                raise HeadSpecError(f"laplacian_heads={spec!r}: {err}") from None
        spec = items
    spec = _per_layer(spec, num_heads, num_layers, "allowed: one item per layer, or one item for all")
    if isinstance(spec, Sequence):
        return [_layer_kinds(item, num_heads, f"[layer {i}]") for i, item in enumerate(spec)]
    return [_layer_kinds(spec, num_heads, "")] * num_layers


def is_plain_laplacian(kinds: Sequence[str]) -> bool:
    """Whether a layer's kinds are only ordinary and Laplacian heads (the op's Laplacian fast paths apply)."""
    return all(kind in ("ordinary", "laplacian") for kind in kinds)


# ----------------------------------------------------------------------------------------------------------------
# The op


class _LaplacianCombine(torch.autograd.Function):
    """out = sign * y + lap * v per head: sign = -1, lap = 1 on Laplacian heads; sign = 1, lap = 0 on the others.

    y is viewed as (B, Hkv, G, T, D) and v as (B, Hkv, 1, T, D), so GQA broadcasts v without copying it. ``runs``
    lists maximal blocks of consecutive query heads of one kind when G == 1 (typically one or two blocks, e.g.
    "ordinary heads, then the trailing k Laplacian heads"); forward then reads y and the Laplacian v once and
    writes out once. Backward returns grad * sign and grad * lap: one pass each, no other allocation.
    """

    @staticmethod
    def forward(ctx, y: Tensor, v: Tensor, sign: Tensor, lap: Tensor, runs: tuple | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(sign, lap)
        if runs is None:
            return torch.mul(y, sign).addcmul_(v, lap)
        return _combine_runs(y.flatten(1, 2), v.squeeze(2), runs).view(y.shape)  # G == 1 here

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        sign, lap = ctx.saved_tensors
        grad_y = grad * sign if ctx.needs_input_grad[0] else None
        grad_v = None
        if ctx.needs_input_grad[1]:
            grad_v = grad * lap
            if grad_v.shape[2] > 1:  # GQA: sum over the G query heads that share each kv head
                grad_v = grad_v.sum(2, keepdim=True)
        return grad_y, grad_v, None, None, None


def _combine_runs(y: Tensor, v_self: Tensor, runs: tuple[tuple[int, int, bool], ...], group: int = 1) -> Tensor:
    """Ordinary heads' y copied, Laplacian heads' v_self - y, one block of consecutive heads at a time.

    y is (B, H, T, D) and v_self (B, Hkv, T, D) with H = Hkv * group; every run starts and ends on a group boundary
    (GQA: the query heads that share a kv head are of one kind), so v_self broadcasts over each group, uncopied.
    """
    b, h, t, d = y.shape
    # y's own layout: SDPA on a packed qkv projection returns (B, T, H, D) strides, so the caller's
    # transpose(1, 2).reshape(B, T, H * D) before the output projection stays a free view
    out = torch.empty_like(y)
    y_groups, out_groups = y.view(b, h // group, group, t, d), out.view(b, h // group, group, t, d)
    v_groups = v_self.unsqueeze(2)
    for start, stop, is_laplacian in runs:
        kv = slice(start // group, stop // group)
        if is_laplacian:
            torch.sub(v_groups[:, kv], y_groups[:, kv], out=out_groups[:, kv])
        else:
            out_groups[:, kv].copy_(y_groups[:, kv])
    return out


class _LaplacianSDPA(torch.autograd.Function):
    """SDPA and the combine as one autograd node, for heads known as blocks (``runs``) that do not split a kv group.

    Forward runs SDPA on detached inputs inside its own small graph (SDPA saves what it always saves) and writes
    the output block by block. Backward: dq, dk, dv = SDPA's backward of g itself; on each Laplacian block they
    are negated in place (the backward is linear in g, head by head; under GQA every query head of a kv group is
    Laplacian, so the kv head's summed gradient flips as a whole) and dv gains g (summed over the group) at each
    query's own position, the last T of the S keys. Gradients equal those of ``v_self - y`` through autograd.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sdpa: dict, runs: tuple) -> Tensor:  # type: ignore[override]
        group = q.shape[1] // k.shape[1]
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(x.requires_grad) for x in (q, k, v)]
            y = _sdpa(*leaves, **sdpa)
        # saved, not set on ctx: autograd frees saved tensors (and with y, SDPA's small graph) after a backward
        # without retain_graph, even while the caller still holds the output
        ctx.save_for_backward(y, *leaves)
        ctx.runs, ctx.group = runs, group
        return _combine_runs(y.detach(), _identity_values(v, q.shape[-2]), runs, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        y, *leaves = ctx.saved_tensors
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        # retain_graph: a caller's retain_graph=True runs this again; otherwise the small graph goes with ctx's tensors
        found = iter(torch.autograd.grad(y, wanted, grad, retain_graph=True, create_graph=torch.is_grad_enabled()))
        grads = [next(found) if leaf.requires_grad else None for leaf in leaves]
        t, s, group = grad.shape[-2], leaves[2].shape[-2], ctx.group
        dq, dk, dv = grads
        for start, stop, is_laplacian in ctx.runs:
            if not is_laplacian:
                continue
            kv = slice(start // group, stop // group)
            if dq is not None:
                dq[:, start:stop].neg_()
            if dk is not None:
                dk[:, kv].neg_()
            if dv is not None:
                g_block = grad[:, start:stop]
                if group > 1:  # the group's query heads all read their kv head's value
                    g_block = g_block.unflatten(1, (-1, group)).sum(2)
                if t == s:  # one pass: dv = g - dv
                    torch.sub(g_block, dv[:, kv], out=dv[:, kv])
                else:  # KV cache: only the last T key positions are the queries' own
                    dv[:, kv].neg_()[..., s - t :, :].add_(g_block)
        return dq, dk, dv, None, None


def _head_runs(mask: Tensor) -> tuple[tuple[int, int, bool], ...]:
    """Maximal blocks (start, stop, is_laplacian) of consecutive heads of one kind."""
    return _head_runs_of(mask.tolist())


def _head_runs_of(flags: list[bool]) -> tuple[tuple[int, int, bool], ...]:
    runs, start = [], 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            runs.append((start, i, flags[start]))
            start = i
    return tuple(runs)


def _identity_values(v: Tensor, num_queries: int) -> Tensor:
    """The value at each query's own position: the queries are the last T of the S key positions."""
    s = v.shape[-2]
    return v if num_queries == s else v[..., s - num_queries :, :]


IDENTITIES = ("aligned", "last_allowed")


def _last_allowed_index(attn_mask: Tensor, t: int) -> Tensor:
    """(B', H', T) index of the last key each query may attend to under ``attn_mask`` (bool, True = attend, or
    additive float); computed on the device, no host sync. Under causal, padding, sliding-window and static-cache
    masks that key is the query's own position."""
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min / 2
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    allowed = allowed.expand(*allowed.shape[:2], t, allowed.shape[-1])
    s = allowed.shape[-1]
    return (s - 1) - allowed.flip(-1).to(torch.uint8).argmax(-1)


def _last_allowed_values(v: Tensor, attn_mask: Tensor, num_heads: int) -> Tensor:
    """v at each query's last allowed key: (B, Hkv, T, D)."""
    b, hkv, _, d = v.shape
    index = _last_allowed_index(attn_mask, attn_mask.shape[-2])
    if index.shape[1] == num_heads and num_heads != hkv:  # per-query-head masks: one per kv group is enough
        index = index[:, :: num_heads // hkv]
    index = index.expand(b, hkv, index.shape[-1])
    return torch.gather(v, 2, index.unsqueeze(-1).expand(b, hkv, index.shape[-1], d))


def _causal_mask(t: int, s: int, device: torch.device) -> Tensor:
    """Bool (T, S) mask, True = attend; aligned bottom-right so query i sits at key position S - T + i."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int]:
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
            (:data:`HEAD_KINDS`: ordinary, laplacian, negated, local, centring, mix; a "local" head is ordinary
            here, its module adds the untied local term).
        attn_mask: optional bool (True = attend) or additive float mask broadcastable to (B, H, T, S).
        is_causal: causal attention; when T < S the queries are the last T positions (KV cache).
        dropout_p: attention dropout on P, so Laplacian heads compute (I - drop(P)) V.
        scale: softmax scale; default 1 / sqrt(D).
        identity: where the identity term reads each query's own value. "aligned": the queries are the last T of
            the S keys. "last_allowed": the last key ``attn_mask`` lets the query see (causal models with padding,
            sliding windows or a static cache, where the queries' positions are not the last T); needs a mask.
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
    if identity not in IDENTITIES or (identity == "last_allowed" and attn_mask is None):
        raise InputError(
            f"identity={identity!r} with attn_mask {'None' if attn_mask is None else 'given'}; allowed: "
            "'aligned', or 'last_allowed' with an attn_mask"
        )
    if _is_kinds(laplacian_heads):
        kinds = _check_kinds(laplacian_heads, h, mix, blend)
        if not is_plain_laplacian(kinds):
            return _kinds_attention(q, k, v, kinds, mix, attn_mask, is_causal, dropout_p, scale, identity)
        laplacian_heads = [kind == "laplacian" for kind in kinds]
    compiling = torch.compiler.is_compiling()
    lap_mask, runs = _resolve_heads(laplacian_heads, h, q.device, inspect_mask=not compiling)
    t, s = q.shape[-2], k.shape[-2]
    if is_causal and t != s:
        if attn_mask is not None:
            raise InputError("attn_mask and is_causal=True cannot be combined; fold the causal mask into attn_mask")
        attn_mask, is_causal = (None, False) if t == 1 else (_causal_mask(t, s, q.device), False)
    if (
        runs is not None
        and len(runs) > 1  # every head Laplacian: v_self - y below is already the cheapest form
        and all(start % (h // hkv) == 0 for start, _, _ in runs)  # GQA: no kv group mixes the two kinds
        and blend is None
        and identity == "aligned"
        and not compiling
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and not (attn_mask is not None and attn_mask.requires_grad)
    ):
        sdpa = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        return _LaplacianSDPA.apply(q, k, v, sdpa, runs)
    y = _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if lap_mask is None:
        return y  # no Laplacian head: exactly plain SDPA, nothing extra
    v_self = _identity_values(v, t) if identity == "aligned" else _last_allowed_values(v, attn_mask, h)
    if blend is not None:
        runs = None  # a partial Laplacian: the general sign / lap combine
    if runs is not None and len(runs) == 1 and hkv == h:
        return v_self - y  # every head Laplacian: one subtraction, autograd needs nothing special
    b, d, g = q.shape[0], v.shape[-1], h // hkv
    lap = lap_mask.to(y.dtype).view(hkv, g, 1, 1)
    if blend is not None:
        lap = lap * (blend.to(y.dtype) if isinstance(blend, Tensor) else blend)
    sign = 1 - 2 * lap
    y, v_self = y.view(b, hkv, g, t, d), v_self.unsqueeze(2)
    if compiling:  # one expression Inductor fuses into its neighbours; no out= views, no graph break
        return (y * sign + v_self * lap).view(b, h, t, d)
    return _LaplacianCombine.apply(y, v_self, sign, lap, runs if g == 1 else None).view(b, h, t, d)


def _is_kinds(spec: object) -> bool:
    return isinstance(spec, (tuple, list)) and len(spec) > 0 and isinstance(spec[0], str)


def _kind_tuple(kinds: Sequence[str], num_heads: int) -> tuple[str, ...]:
    """``kinds`` as a tuple, if it names ``num_heads`` known kinds."""
    kinds = tuple(kinds)
    if len(kinds) != num_heads or any(kind not in HEAD_KINDS for kind in kinds):
        raise HeadSpecError(f"head kinds {list(kinds)!r}; allowed: {num_heads} of {', '.join(HEAD_KINDS)}")
    return kinds


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
    v_self = _identity_values(v, t) if identity == "aligned" else _last_allowed_values(v, attn_mask, h)
    b, d, g = q.shape[0], v.shape[-1], h // hkv
    shape = (hkv, g, 1, 1)
    out = y.view(b, hkv, g, t, d) * beta.view(shape) + v_self.unsqueeze(2) * alpha.view(shape)
    if "centring" in kinds:
        mean = _attended_mean(v, q, attn_mask, is_causal, scale)
        mean = mean.view(b, hkv, g, t, d) if mean.shape[1] == h else mean.unsqueeze(2)
        out = out + mean * gamma.view(shape)
    return out.view(b, h, t, d)


def _sdpa(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool, scale: float | None
) -> Tensor:
    """``F.scaled_dot_product_attention`` for H query heads over Hkv key/value heads."""
    h, hkv = q.shape[1], k.shape[1]
    gqa = bool(h != hkv)  # a plain bool: SDPA refuses a symbolic one under dynamic shapes
    if gqa and attn_mask is not None and q.is_cuda:
        # CUDA SDPA with enable_gqa and a mask falls back to the math kernel; expanded k/v keep the fused kernels
        k, v, gqa = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )


def _resolve_heads(
    laplacian_heads: HeadSpec, num_heads: int, device: torch.device, inspect_mask: bool = True
) -> tuple[Tensor | None, tuple[tuple[int, int, bool], ...] | None]:
    """The op's view of a spec: (bool mask on ``device``, head runs), or (None, None) when no head is Laplacian.

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
        runs = ((0, split, False), (split, num_heads, True)) if split else ((0, num_heads, True),)
        return torch.arange(num_heads, device=device) >= split, runs
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
    if identity not in IDENTITIES or (identity == "last_allowed" and attn_mask is None):
        raise InputError(
            f"identity={identity!r} with attn_mask {'None' if attn_mask is None else 'given'}; allowed: "
            "'aligned', or 'last_allowed' with an attn_mask"
        )
    kinds = _check_kinds(laplacian_heads, h, mix, blend) if _is_kinds(laplacian_heads) else None
    if kinds is not None:
        laplacian_heads = [kind == "laplacian" for kind in kinds]
    mask = laplacian_head_mask(laplacian_heads, h).to(q.device)
    t, s = q.shape[-2], k.shape[-2]
    if identity == "last_allowed":  # before the causal mask below could be folded in
        index = _last_allowed_index(attn_mask, t)
        identity_matrix = F.one_hot(index, s).to(q.dtype)  # (B', H', T, S)
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
    eye = identity_matrix if identity == "last_allowed" else _shifted_eye(t, s, attn)
    if kinds is not None and not is_plain_laplacian(kinds):
        # alpha I + beta P - gamma U, with U uniform over the keys each query may attend to
        alpha, beta, gamma = (c.view(1, h, 1, 1) for c in _kind_coefficients(kinds, mix, attn.dtype, attn.device))
        allowed = torch.isfinite(logits).to(attn.dtype)
        uniform = allowed / allowed.sum(-1, keepdim=True).clamp_min(1)
        operator = alpha * eye + beta * dropped + gamma * uniform
    else:
        weight = 1.0 if blend is None else blend
        operator = torch.where(mask.view(1, h, 1, 1), weight * eye + (1 - 2 * weight) * dropped, dropped)
    out = operator @ v
    return (out, attn) if return_attn else out


def _shifted_eye(t: int, s: int, like: Tensor) -> Tensor:
    """(T, S) matrix with ones at (i, S - T + i): each query's own key position."""
    return torch.ones(t, s, dtype=like.dtype, device=like.device).tril(s - t).triu(s - t)


# ----------------------------------------------------------------------------------------------------------------
# The timm-compatible module


class LaplacianHeadsMixin:
    """Holds one attention layer's Laplacian head mask for an ``nn.Module``: host truth plus a device buffer.

    The mask's truth is a CPU tensor kept beside the module; ``laplacian_mask`` is a non-persistent buffer (state
    dicts stay those of the plain model) that is rewritten from it whenever the module's tensors are moved or
    re-allocated (``_apply``: ``to``, ``cuda``, ``to_empty``). So a model built on the meta device and then
    ``to_empty``-ed runs with the heads it was configured with, not with uninitialised memory.
    """

    # (no class-level annotation of the buffer: TorchScript would read it as an unresolvable string)
    __jit_unused_properties__ = ["laplacian_heads_for_op", "laplacian_head_list", "num_laplacian_heads", "head_kinds"]

    def _init_laplacian_heads(self, num_heads: int, laplacian_heads: HeadSpec, device=None) -> None:
        # on the factory device (timm's create_model(device="meta") puts every tensor there)
        self.register_buffer(
            "laplacian_mask", torch.zeros(num_heads, dtype=torch.bool, device=device), persistent=False
        )
        self.set_laplacian_heads(laplacian_heads)

    def set_laplacian_heads(self, laplacian_heads: HeadSpec | Sequence[str]) -> None:
        """Choose which heads are Laplacian (no parameters change), or give every head a kind
        (:data:`HEAD_KINDS`): "mix" heads gain their learnable (a, b) (``mix_a`` = 0, ``mix_b`` = 1: ordinary at
        the start), "local" heads the module's untied local term (:meth:`_make_local`)."""
        num_heads = len(self.laplacian_mask)
        kinds = None
        if _is_kinds(laplacian_heads):
            kinds = _kind_tuple(laplacian_heads, num_heads)
            laplacian_heads = [kind == "laplacian" for kind in kinds]
        self._kinds = None if kinds is None or is_plain_laplacian(kinds) else kinds
        device = self.laplacian_mask.device
        if self._kinds is not None and "mix" in self._kinds:
            self.mix_a = torch.nn.Parameter(torch.zeros(num_heads, device=device))  # 1-D: no weight decay in timm
            self.mix_b = torch.nn.Parameter(torch.ones(num_heads, device=device))
        else:
            self.mix_a = self.mix_b = None
        self._make_local(sum(kind == "local" for kind in (self._kinds or ())))
        mask = laplacian_head_mask(laplacian_heads, num_heads)
        if mask.device.type != "cpu":  # a spec given as a device tensor, or built under a device context
            mask = mask.to("cpu") if mask.device.type != "meta" else torch.zeros(len(mask), dtype=torch.bool)
        self._laplacian_host = mask
        self._sync_laplacian_mask()
        # What forward hands the op: an int k when the mask is "the trailing k heads" (no device work to build it),
        # else the on-device buffer; either way no host-device sync per step.
        k = int(mask.sum())
        self._op_heads: HeadSpec | None = k if bool(mask[len(mask) - k :].all()) else None

    def _sync_laplacian_mask(self) -> None:
        device = self.laplacian_mask.device
        # A new tensor, not an in-place copy: on the meta device there is nothing to copy into.
        self._buffers["laplacian_mask"] = (
            self._laplacian_host.to(device, copy=True) if device.type != "meta" else self.laplacian_mask
        )

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        module = super()._apply(fn, recurse)  # type: ignore[misc]
        self._sync_laplacian_mask()  # to_empty() leaves buffers uninitialised; the host copy is the truth
        return module

    def _make_local(self, num_local: int) -> None:
        """The untied token-local term of "local" heads; a module without one refuses such heads."""
        if num_local:
            raise HeadSpecError(f"{type(self).__name__} has no local term; allowed kinds here: all but 'local'")

    @property
    def head_kinds(self) -> tuple[str, ...]:
        """Every head's kind (ordinary / laplacian unless other kinds were given)."""
        if getattr(self, "_kinds", None) is not None:
            return self._kinds
        return tuple("laplacian" if m else "ordinary" for m in self._laplacian_host.tolist())

    @property
    def laplacian_heads_for_op(self) -> HeadSpec:
        """The spec to hand ``laplacian_attention``: an int k for trailing heads, else the device mask."""
        return self.laplacian_mask if self._op_heads is None else self._op_heads

    @property
    def laplacian_head_list(self) -> list[bool]:
        """The mask as Python bools (works on any device, meta included)."""
        return self._laplacian_host.tolist()

    @property
    def num_laplacian_heads(self) -> int:
        return int(self._laplacian_host.sum())


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
        self._init_laplacian_heads(num_heads, laplacian_heads, kwargs.get("device"))

    def _make_local(self, num_local: int) -> None:
        """ "local" heads: their own value (W_V', initialised as timm's ViT initialises a Linear) and output
        (W_O', zero, like the model's output projections at the start) weights, untied from W_V and W_O."""
        if not num_local:
            self.local_v = self.local_o = None
            return
        device = self.qkv.weight.device
        width = num_local * self.head_dim
        self.local_v = torch.nn.Linear(self.qkv.in_features, width, bias=self.qkv.bias is not None, device=device)
        self.local_o = torch.nn.Linear(width, self.proj.out_features, bias=False, device=device)
        if device.type != "meta":
            torch.nn.init.trunc_normal_(self.local_v.weight, std=0.02)
            if self.local_v.bias is not None:
                torch.nn.init.zeros_(self.local_v.bias)
            torch.nn.init.zeros_(self.local_o.weight)

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
        x = x.transpose(1, 2).reshape(b, n, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        out = self.proj(x)
        if self.local_v is not None:  # "local" heads: their untied token-local term, W_O' W_V' x
            out = out + self.local_o(self.local_v(tokens))
        return self.proj_drop(out), attn

    @torch.jit.ignore
    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor],
        is_causal: bool,
        return_attn: bool,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The op (fused, or the reference path when timm's ``fused_attn`` is off or P is wanted); left to Python by
        TorchScript, traced as one call by FX."""
        # not the property: under TorchScript ``self`` is the scripted module, which keeps attributes only
        trailing = -1 if self._op_heads is None else self._op_heads
        dropout_p = self.attn_drop.p if self.training else 0.0
        blend = getattr(self, "laplacian_blend", None)  # lambda of a blend conversion (lapheads.convert)
        kinds_of_heads = self._kinds  # attributes, not methods: under TorchScript self keeps attributes only
        kinds = None if kinds_of_heads is None else list(kinds_of_heads)
        mix = None if self.mix_a is None else (self.mix_a, self.mix_b)
        if self.fused_attn and not return_attn:
            out = _fused_leaf(
                q, k, v, self.laplacian_mask, trailing, attn_mask, is_causal, dropout_p, self.scale, blend, kinds, mix
            )
            return out, None
        out, attn = _reference_leaf(
            q, k, v, self.laplacian_mask, trailing, attn_mask, is_causal, dropout_p, self.scale, blend, kinds, mix
        )
        return out, attn

    def extra_repr(self) -> str:
        if getattr(self, "_kinds", None) is not None:
            return f"head_kinds={list(self._kinds)}"
        return f"laplacian_heads={format_head_mask(self._laplacian_host)}"


@torch.jit.ignore
def _fused_leaf(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    trailing: int,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    dropout_p: float,
    scale: float,
    blend: Optional[Tensor] = None,
    kinds: Optional[List[str]] = None,
    mix: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tensor:
    """``laplacian_attention`` with positional arguments (``kinds`` when given, else k trailing heads when
    ``trailing`` >= 0, else ``mask``): the one node FX records and the one call TorchScript leaves to Python."""
    heads: HeadSpec = kinds if kinds is not None else (trailing if trailing >= 0 else mask)
    return laplacian_attention(
        q,
        k,
        v,
        heads,
        attn_mask=attn_mask,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
        blend=blend,
        mix=mix,
    )


@torch.jit.ignore
def _reference_leaf(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    trailing: int,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    dropout_p: float,
    scale: float,
    blend: Optional[Tensor] = None,
    kinds: Optional[List[str]] = None,
    mix: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """``laplacian_attention_reference`` with P, as :func:`_fused_leaf`."""
    heads: HeadSpec = kinds if kinds is not None else (trailing if trailing >= 0 else mask)
    out, attn = laplacian_attention_reference(
        q,
        k,
        v,
        heads,
        attn_mask=attn_mask,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
        blend=blend,
        mix=mix,
        return_attn=True,
    )
    return out, attn


# TorchScript cannot resolve the string annotations of ``from __future__ import annotations`` on methods it leaves
# to Python: give them their evaluated types
for _fn in (
    *(getattr(LaplacianAttention, m) for m in ("forward", "forward_with_attn", "_forward", "_attend")),
    _fused_leaf,
    _reference_leaf,
):
    _fn.__annotations__ = typing.get_type_hints(_fn)

# FX (torch.fx and timm's feature extraction) calls the op as one node: its argument checks branch on shapes
torch.fx.wrap("_fused_leaf")
torch.fx.wrap("_reference_leaf")
_register_notrace = getattr(
    __import__("timm.layers", fromlist=["register_notrace_function"]), "register_notrace_function", None
)
if _register_notrace is not None:
    _register_notrace(_fused_leaf)
    _register_notrace(_reference_leaf)
