"""The op's autograd machinery (private): SDPA plus the Laplacian combine as few passes as the kinds allow.

This module owns the autograd Functions, the direct calls of SDPA's CPU flash kernels and the choice of the compiled
node (``lapheads.core.native``); ``lapheads.core.attention`` plans which of them a call takes.

* ``training_node`` is the one entry of the training path: the compiled C++ node where SDPA runs its CPU flash
  kernel and ``lapheads kernel build`` built it, else ``LaplacianSDPA`` (the same node in Python).
* ``LaplacianSDPA`` runs SDPA (on the CPU, SDPA's own flash kernel called directly; elsewhere SDPA on its own
  small graph) and writes the output: one copy of y, then the Laplacian head blocks turned into v - y in place.
  Its backward hands the incoming gradient to SDPA's backward *unchanged* and
  then fixes the Laplacian heads in place: SDPA's backward is linear in the output gradient, per head, so negating
  a Laplacian head's dq, dk and dv equals feeding it -g; dv then gains g at the query's own position. No
  sign-flipped copy of g, no gradient of zeros for the ordinary heads' identity term, no extra accumulation pass.
  ``csrc/laplacian_sdpa.cpp`` is its CPU flash path in C++, step for step (``lapheads.core.native``); keep the two
  in step: tests/core/test_native.py compares them bit for bit.
* ``LaplacianCombine`` multiplies by a per-head sign and adds the masked value where that does not apply (a GQA
  group mixing the two kinds, a blend, an identity read from the mask, a mask that needs a gradient).
* GQA/MQA: v is viewed per kv group and broadcast to its query heads, never copied.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend

from lapheads.core import native

__all__ = [
    "LaplacianCombine",
    "LaplacianSDPA",
    "combine_runs",
    "flash_mask",
    "head_runs",
    "head_runs_of",
    "identity_values",
    "runs_cpu_flash",
    "sdpa",
    "training_node",
]

# the overloads themselves, looked up once: the op's per-call cost is what small shapes feel
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_FLASH = int(SDPBackend.FLASH_ATTENTION)


def training_node(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    runs: tuple[tuple[int, int, bool], ...],
) -> Tensor:
    """SDPA and the Laplacian blocks ``runs`` as one autograd node (the op's training path): the compiled node where
    SDPA would run its CPU flash kernel and the node is built (no Python Function cost), else ``LaplacianSDPA``,
    which calls that kernel directly where it applies. Both give SDPA's own outputs and gradients, bit for bit."""
    cpu_flash = runs_cpu_flash(q, k, v, attn_mask, dropout_p, is_causal, scale)
    if cpu_flash and (node := native.module()) is not None:
        starts, stops = laplacian_blocks(runs)
        return node.laplacian_sdpa(q, k, v, flash_mask(attn_mask, q), dropout_p, is_causal, scale, starts, stops)
    sdpa_options = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return LaplacianSDPA.apply(q, k, v, sdpa_options, runs, cpu_flash)


def runs_cpu_flash(
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


class LaplacianCombine(torch.autograd.Function):
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
        return combine_runs(y.flatten(1, 2), v.squeeze(2), runs).view(y.shape)  # G == 1 here

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


def combine_runs(
    y: Tensor, v_self: Tensor, runs: tuple[tuple[int, int, bool], ...], group: int = 1, in_place: bool = False
) -> Tensor:
    """Ordinary heads' y copied (or, ``in_place``, kept: a y nobody else holds), Laplacian heads' v_self - y, one
    block of consecutive heads at a time.

    y is (B, H, T, D) and v_self (B, Hkv, T, D) with H = Hkv * group; every run starts and ends on a group boundary
    (GQA: the query heads that share a kv head are of one kind), so v_self broadcasts over each group, uncopied.
    """
    # a clone keeps y's own layout: SDPA on a packed qkv projection returns (B, T, H, D) strides, so the caller's
    # transpose(1, 2).reshape(B, T, H * D) before the output projection stays a free view; one contiguous copy, then
    # the Laplacian blocks in place, is faster than copying the ordinary blocks one strided block at a time
    out = y if in_place else y.clone()
    for start, stop, is_laplacian in runs:  # narrow, not indexing: a view at a fraction of the Python cost
        if not is_laplacian:
            continue
        out_run = out.narrow(1, start, stop - start)
        if group == 1:
            torch.sub(v_self.narrow(1, start, stop - start), out_run, out=out_run)
        else:  # v_self broadcast over each group of query heads, uncopied
            kv = v_self.narrow(1, start // group, (stop - start) // group).unsqueeze(2)
            grouped = out_run.view(y.shape[0], -1, group, *y.shape[2:])
            torch.sub(kv, grouped, out=grouped)
    return out


class LaplacianSDPA(torch.autograd.Function):
    """SDPA and the combine as one autograd node, for heads known as blocks (``runs``) that do not split a kv group.

    Forward runs SDPA on detached inputs inside its own small graph (SDPA saves what it always saves) and writes
    the output block by block; where SDPA would run its CPU flash kernel (``cpu_flash``), that kernel and its
    backward are called directly instead, saving the re-entrant autograd call (most of the op's fixed cost at small
    shapes) with the very same kernels, so outputs and gradients stay bit-identical to SDPA's.

    Backward: dq, dk, dv = SDPA's backward of g itself; on each Laplacian block they are negated in place (the
    backward is linear in g, head by head; under GQA every query head of a kv group is Laplacian, so the kv head's
    summed gradient flips as a whole) and dv gains g (summed over the group) at each query's own position, the
    last T of the S keys. Gradients equal those of ``v_self - y`` through autograd.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, options: dict, runs: tuple, cpu_flash: bool) -> Tensor:  # type: ignore[override]
        group = q.shape[1] // k.shape[1]
        ctx.runs, ctx.group, ctx.options = runs, group, options
        if cpu_flash:  # the kernel F.scaled_dot_product_attention itself runs here, called without its autograd node
            mask = flash_mask(options["attn_mask"], q)
            y, logsumexp = _CPU_FLASH(
                q, k, v, options["dropout_p"], options["is_causal"], attn_mask=mask, scale=options["scale"]
            )
            ctx.save_for_backward(y, q, k, v, logsumexp, mask)
        else:
            with torch.enable_grad():
                leaves = [x.detach().requires_grad_(x.requires_grad) for x in (q, k, v)]
                y = sdpa(*leaves, **options)
            # saved, not set on ctx: autograd frees saved tensors (and with y, SDPA's small graph) after a backward
            # without retain_graph, even while the caller still holds the output
            ctx.save_for_backward(y, *leaves)
            y = y.detach()
        ctx.cpu_flash = cpu_flash
        return combine_runs(y, identity_values(v, q.shape[-2]), runs, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        y, *leaves = ctx.saved_tensors
        if ctx.cpu_flash:  # SDPA's own backward kernel, as its autograd node would call it: bit-identical gradients
            *leaves, logsumexp, mask = leaves
            options = ctx.options
            grads = _CPU_FLASH_BACKWARD(
                grad,
                *leaves,
                y,
                logsumexp,
                options["dropout_p"],
                options["is_causal"],
                attn_mask=mask,
                scale=options["scale"],
            )
            if not all(ctx.needs_input_grad[:3]):
                grads = [g if wanted else None for g, wanted in zip(grads, ctx.needs_input_grad)]
        else:
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            # retain_graph: a caller's retain_graph=True runs this again; else the small graph goes with ctx's tensors
            grad_enabled = torch.is_grad_enabled()
            found = iter(torch.autograd.grad(y, wanted, grad, retain_graph=True, create_graph=grad_enabled))
            grads = [next(found) if leaf.requires_grad else None for leaf in leaves]
        t, s, group = grad.shape[-2], leaves[2].shape[-2], ctx.group
        dq, dk, dv = grads
        for start, stop, is_laplacian in ctx.runs:  # narrow, not indexing: a view at a fraction of the Python cost
            if not is_laplacian:
                continue
            kv_start, kv_len = start // group, (stop - start) // group
            if dq is not None:
                dq.narrow(1, start, stop - start).neg_()
            if dk is not None:
                dk.narrow(1, kv_start, kv_len).neg_()
            if dv is not None:
                g_block, dv_block = grad.narrow(1, start, stop - start), dv.narrow(1, kv_start, kv_len)
                if group > 1:  # the group's query heads all read their kv head's value
                    g_block = g_block.unflatten(1, (-1, group)).sum(2)
                if t == s:  # one pass: dv = g - dv
                    torch.sub(g_block, dv_block, out=dv_block)
                else:  # KV cache: only the last T key positions are the queries' own
                    dv_block.neg_().narrow(2, s - t, t).add_(g_block)
        return dq, dk, dv, None, None, None


def flash_mask(mask: Tensor | None, q: Tensor) -> Tensor | None:
    """The mask as SDPA hands it to its CPU flash kernel: a bool mask (True = attend) as 0 / -inf of q's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))


@functools.cache  # a model has a handful of distinct runs; the op's per-call cost is what small shapes feel
def laplacian_blocks(runs: tuple[tuple[int, int, bool], ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(starts, stops) of the Laplacian runs: the compiled node's form of ``runs``."""
    blocks = [(start, stop) for start, stop, is_laplacian in runs if is_laplacian]
    return tuple(start for start, _ in blocks), tuple(stop for _, stop in blocks)


def head_runs(mask: Tensor) -> tuple[tuple[int, int, bool], ...]:
    """Maximal blocks (start, stop, is_laplacian) of consecutive heads of one kind."""
    return head_runs_of(mask.tolist())


def head_runs_of(flags: list[bool]) -> tuple[tuple[int, int, bool], ...]:
    runs, start = [], 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            runs.append((start, i, flags[start]))
            start = i
    return tuple(runs)


def identity_values(v: Tensor, num_queries: int) -> Tensor:
    """The value at each query's own position: the queries are the last T of the S key positions."""
    s = v.shape[-2]
    return v if num_queries == s else v[..., s - num_queries :, :]


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool, scale: float | None
) -> Tensor:
    """``F.scaled_dot_product_attention`` for H query heads over Hkv key/value heads; a mask that is an attention
    pattern or a FlexAttention block mask goes to the backend ``lapheads.core.masks`` picks for it."""
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        from lapheads.core.masks import attend

        return attend(q, k, v, attn_mask, scale)  # the op refused dropout and is_causal with a pattern
    h, hkv = q.shape[1], k.shape[1]
    gqa = bool(h != hkv)  # a plain bool: SDPA refuses a symbolic one under dynamic shapes
    if gqa and attn_mask is not None and q.is_cuda:
        # CUDA SDPA with enable_gqa and a mask falls back to the math kernel; expanded k/v keep the fused kernels
        k, v, gqa = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
