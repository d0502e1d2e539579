"""The op's autograd machinery (private): SDPA plus the Laplacian combine as few passes as the kinds allow.

* ``_LaplacianSDPA`` runs SDPA on its own small graph and writes the output head block by head block (ordinary
  heads copied, Laplacian heads v - y). Its backward hands the incoming gradient to SDPA's backward *unchanged* and
  then fixes the Laplacian heads in place: SDPA's backward is linear in the output gradient, per head, so negating
  a Laplacian head's dq, dk and dv equals feeding it -g; dv then gains g at the query's own position. No
  sign-flipped copy of g, no gradient of zeros for the ordinary heads' identity term, no extra accumulation pass.
* ``_LaplacianCombine`` multiplies by a per-head sign and adds the masked value where that does not apply (a GQA
  group mixing the two kinds, a blend, an identity read from the mask, a mask that needs a gradient, inference).
* GQA/MQA: v is viewed per kv group and broadcast to its query heads, never copied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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
