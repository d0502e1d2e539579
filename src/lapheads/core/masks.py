"""Attention patterns without a T x S mask: sliding windows, packed documents and prefix-LM, as the op's ``attn_mask``.

A pattern says which keys each query may see, once, as a function of positions (``allows``); every backend is
derived from that one function, so they cannot disagree:

* **flex**: PyTorch's FlexAttention with a block mask (``mask_mod`` is ``allows``), compiled: cost grows with the
  keys a query sees, not with T x S. Forward only on the CPU (PyTorch has no FlexAttention backward there); forward
  and backward on a GPU.
* **banded**: for a pattern with a band (a query sees at most ``band`` keys before itself and none after: a sliding
  window, alone or with documents), the queries in chunks, each against only the keys its band reaches, through
  SDPA with the chunk's small mask: cost T x (chunk + band), differentiated by autograd. The CPU's training path,
  and decoding (a few queries, no compile per length).
* **dense**: SDPA with the (B, 1, T, S) bool mask the pattern gives: the fallback where neither applies (a CPU
  gradient through a pattern without a band), decoding through one without a band (at most one chunk of queries: a
  small mask, and no compile per key length; inductor's CPU FlexAttention also fails to compile a one-query
  block mask in torch 2.14), and the reference's mask.

Design choices:

* **One place picks the backend** (:func:`attention_backend`, read by :func:`attend`); the op hands it every SDPA
  call whose mask is a pattern or a FlexAttention ``BlockMask`` (``core._autograd.sdpa``), so every head kind's
  P V and the attended mean take the same path. A ``BlockMask`` built elsewhere (transformers' flex masks) runs
  through FlexAttention, or its dense form where FlexAttention cannot differentiate.
* **Queries are the last T of the S keys** (a KV cache), as everywhere in the op: query i sits at position
  S - T + i. The patterns are aligned bottom-right the same way.
* **Every pattern lets a query see itself**, so no query is left with nothing to attend to and a Laplacian head's
  identity term is always one of its keys.
* **Block masks are cached per pattern and shape**: a model that keeps its patterns (the GPT keeps one per window)
  builds each block mask once per sequence length; a pattern keeps its last dense mask, so the layers of one forward
  (which share its pattern) build it once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lapheads.errors import InputError

__all__ = [
    "BACKENDS",
    "AttentionPattern",
    "Causal",
    "Documents",
    "PrefixLM",
    "SlidingWindow",
    "attend",
    "attention_backend",
    "is_pattern",
]

#: the backends :func:`attend` chooses from (module docstring)
BACKENDS = ("flex", "banded", "dense")

#: queries per chunk of the banded backend, at least (a chunk is max(this, band) queries: a few SDPA calls per
#: sequence, each over chunk + band keys)
BANDED_CHUNK = 128


class AttentionPattern:
    """Which keys each query may see, as a function of positions; combine two with ``&`` (both must allow)."""

    #: how many keys before itself a query sees at most, and none after it; None where unbounded or not causal
    band: int | None = None

    def allows(self, batch: Tensor, query: Tensor, key: Tensor) -> Tensor:
        """Bool, broadcast over the three index tensors: may the query at position ``query`` see ``key``?"""
        raise NotImplementedError

    def check(self, batch: int, t: int, s: int) -> None:
        """Refuse, in one line, a call this pattern cannot describe (B queries rows, T queries, S keys)."""

    def batched(self) -> bool:
        """Whether the pattern differs between batch rows (its mask then has B rows, not one)."""
        return False

    def __and__(self, other: AttentionPattern) -> AttentionPattern:
        return Both(self, other)

    def dense(self, batch: int, t: int, s: int, device: torch.device | str) -> Tensor:
        """The pattern as a bool mask (B or 1, 1, T, S), True = attend, queries the last T of the S keys."""
        rows = batch if self.batched() else 1
        b = torch.arange(rows, device=device).view(-1, 1, 1, 1)
        query = torch.arange(s - t, s, device=device).view(1, 1, -1, 1)
        return self.allows(b, query, torch.arange(s, device=device).view(1, 1, 1, -1))

    def mask_mod(self, t: int, s: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
        """FlexAttention's ``mask_mod`` for T queries over S keys (its query index counts from 0)."""
        offset = torch.tensor(s - t)  # a tensor, not an int: the compiled kernel is not specialised on its value

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return self.allows(b, q_idx + offset, kv_idx)

        return mask_mod

    def block_mask(self, batch: int, t: int, s: int, device: torch.device | str):
        """FlexAttention's block mask of the pattern for this shape, built once per (B, T, S, device)."""
        from torch.nn.attention.flex_attention import create_block_mask

        cache = _block_masks(self)
        key = (batch if self.batched() else None, t, s, str(device))
        if key not in cache:
            cache[key] = create_block_mask(self.mask_mod(t, s), key[0], None, t, s, device=device)
        return cache[key]


def _block_masks(pattern: AttentionPattern) -> dict[tuple, Any]:
    """A pattern's cache of block masks (frozen dataclasses keep it outside their fields)."""
    cache = pattern.__dict__.get("_block_masks")
    if cache is None:
        cache = {}
        object.__setattr__(pattern, "_block_masks", cache)
    return cache


@dataclasses.dataclass(frozen=True, eq=False)
class Causal(AttentionPattern):
    """Each query sees itself and every key before it."""

    def allows(self, batch: Tensor, query: Tensor, key: Tensor) -> Tensor:
        return key <= query


@dataclasses.dataclass(frozen=True, eq=False)
class SlidingWindow(AttentionPattern):
    """Each query sees itself and the ``window`` keys before it (FlashAttention's ``window_size=(window, 0)``).

    Args:
        window: keys before a query that it sees, >= 0.
    """

    window: int

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise InputError(f"SlidingWindow(window={self.window!r}); allowed: an integer >= 0")

    @property
    def band(self) -> int:  # type: ignore[override]
        return self.window

    def allows(self, batch: Tensor, query: Tensor, key: Tensor) -> Tensor:
        return (key <= query) & (key >= query - self.window)


@dataclasses.dataclass(frozen=True, eq=False)
class Documents(AttentionPattern):
    """Packed sequences: each query sees the keys of its own document only, causally (or all of them).

    Args:
        document_ids: (B, S) integer document index of every key position (the queries are the last T).
        causal: also causal within a document (a language model's packed batch); False for an encoder.
    """

    document_ids: Tensor
    causal: bool = True

    def __post_init__(self) -> None:
        ids = self.document_ids
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
            raise InputError(f"Documents(document_ids of {shape}); allowed: an integer tensor (B, S)")

    def batched(self) -> bool:
        return True

    def check(self, batch: int, t: int, s: int) -> None:
        if tuple(self.document_ids.shape) != (batch, s):
            raise InputError(
                f"Documents: document_ids of shape {tuple(self.document_ids.shape)} for B = {batch} rows of S = {s} "
                f"keys; allowed: (B, S) = {(batch, s)}"
            )

    def allows(self, batch: Tensor, query: Tensor, key: Tensor) -> Tensor:
        ids = self.document_ids.to(query.device)
        same = ids[batch, query] == ids[batch, key]
        return same & (key <= query) if self.causal else same


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixLM(AttentionPattern):
    """A prefix seen in both directions, the rest causal: a query sees every key before it and the whole prefix.

    Args:
        prefix: how many leading positions are the prefix, >= 0 (0 is causal).
    """

    prefix: int

    def __post_init__(self) -> None:
        if isinstance(self.prefix, bool) or not isinstance(self.prefix, int) or self.prefix < 0:
            raise InputError(f"PrefixLM(prefix={self.prefix!r}); allowed: an integer >= 0")

    def allows(self, batch: Tensor, query: Tensor, key: Tensor) -> Tensor:
        return (key <= query) | (key < self.prefix)


@dataclasses.dataclass(frozen=True, eq=False)
class Both(AttentionPattern):
    """Two patterns at once: a key is seen where both allow it (``window & documents``)."""

    first: AttentionPattern
    second: AttentionPattern

    @property
    def band(self) -> int | None:  # type: ignore[override]
        bands = [p.band for p in (self.first, self.second) if p.band is not None]
        return min(bands) if bands else None  # a band bounds the intersection whatever the other allows

    def batched(self) -> bool:
        return self.first.batched() or self.second.batched()

    def check(self, batch: int, t: int, s: int) -> None:
        self.first.check(batch, t, s)
        self.second.check(batch, t, s)

    def allows(self, batch: Tensor, query: Tensor, key: Tensor) -> Tensor:
        return self.first.allows(batch, query, key) & self.second.allows(batch, query, key)


def is_pattern(attn_mask: object) -> bool:
    """Whether an ``attn_mask`` is a pattern or a FlexAttention block mask (this module's), not a tensor."""
    if isinstance(attn_mask, AttentionPattern):
        return True
    flex = _flex_module()
    return flex is not None and isinstance(attn_mask, flex.BlockMask)


def _flex_module():
    import sys

    return sys.modules.get("torch.nn.attention.flex_attention")  # a BlockMask exists only once this is imported


def check_pattern(attn_mask: Any, batch: int, t: int, s: int, dropout_p: float, identity: str) -> None:
    """The op's checks of a pattern or block mask: one-line errors naming what FlexAttention-style masks allow."""
    if dropout_p:
        raise InputError(f"dropout_p={dropout_p} with an attention pattern; allowed: 0 (FlexAttention has no dropout)")
    if identity != "aligned":
        raise InputError(f"identity={identity!r} with an attention pattern; allowed: 'aligned' (queries last)")
    if isinstance(attn_mask, AttentionPattern):
        attn_mask.check(batch, t, s)
        return
    shape = tuple(attn_mask.shape)
    if shape[-2:] != (t, s) or shape[0] not in (1, batch):
        raise InputError(
            f"block mask of shape {shape} for B = {batch}, T = {t}, S = {s}; allowed: (B or 1, H or 1, {t}, {s})"
        )


def attention_backend(q: Tensor, k: Tensor, attn_mask: Any) -> str:
    """The backend :func:`attend` runs for this call (:data:`BACKENDS`; the module docstring's rules)."""
    # FlexAttention has no backward on the CPU, compiled or not
    cpu_gradient = q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    band = attn_mask.band if isinstance(attn_mask, AttentionPattern) else None
    if band is not None and (cpu_gradient or q.shape[-2] <= max(BANDED_CHUNK, band)):
        return "banded"  # the CPU's differentiable path, or one chunk (decoding, a short prefill): no compile
    return "dense" if cpu_gradient or q.shape[-2] <= BANDED_CHUNK else "flex"  # one chunk: a small mask


def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: Any, scale: float | None) -> Tensor:
    """Softmax attention P V (B, H, T, D) under a pattern or a FlexAttention block mask, by the chosen backend."""
    backend = attention_backend(q, k, attn_mask)
    if backend == "banded":
        return _banded(q, k, v, attn_mask, scale)
    if backend == "dense":
        return _sdpa(q, k, v, tensor_mask(attn_mask, q.shape[0], q.shape[-2], k.shape[-2], q.device), scale)
    block_mask = attn_mask
    if isinstance(attn_mask, AttentionPattern):
        block_mask = attn_mask.block_mask(q.shape[0], q.shape[-2], k.shape[-2], q.device)
    return _flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def tensor_mask(attn_mask: Any, batch: int, t: int, s: int, device: torch.device | str) -> Tensor | None:
    """A pattern's or a block mask's bool mask (B or 1, H or 1, T, S): the reference's and the dense backend's; a
    tensor mask or None as it is."""
    if attn_mask is None or isinstance(attn_mask, Tensor):
        return attn_mask
    if isinstance(attn_mask, AttentionPattern):  # the last shape's mask kept: a model's layers share one pattern
        key = (batch, t, s, str(device))
        last = attn_mask.__dict__.get("_last_dense")
        if last is None or last[0] != key:
            last = (key, attn_mask.dense(batch, t, s, device))
            object.__setattr__(attn_mask, "_last_dense", last)  # frozen dataclasses keep it outside their fields
        return last[1]
    from torch.nn.attention.flex_attention import create_mask

    rows = attn_mask.shape[0]
    return create_mask(attn_mask.mask_mod, rows, attn_mask.shape[1], t, s, device=device)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _banded(q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern, scale: float | None) -> Tensor:
    """The queries in chunks, each over the keys its band reaches (module docstring): T x (chunk + band) work."""
    t, s, band = q.shape[-2], k.shape[-2], pattern.band
    chunk, offset = max(BANDED_CHUNK, band), s - t
    rows = q.shape[0] if pattern.batched() else 1
    b = torch.arange(rows, device=q.device).view(-1, 1, 1, 1)
    outputs = []
    for start in range(0, t, chunk):
        stop = min(start + chunk, t)
        first = max(0, offset + start - band)  # the earliest key the chunk's first query sees
        last = offset + stop  # past the chunk's last query: no key after a query is seen
        query = torch.arange(offset + start, offset + stop, device=q.device).view(1, 1, -1, 1)
        mask = pattern.allows(b, query, torch.arange(first, last, device=q.device).view(1, 1, 1, -1))
        outputs.append(_sdpa(q[..., start:stop, :], k[..., first:last, :], v[..., first:last, :], mask, scale))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)


#: compiled FlexAttention kernels one process may keep: one per pattern kind, dtype and shape class. Dynamo's own
#: default (8, for every function) is reached by a model with a few windows in two dtypes, after which FlexAttention
#: runs its uncompiled debugging path (the T x S scores) with a warning; the limit is raised for these calls only
FLEX_RECOMPILE_LIMIT = 64

_COMPILED_FLEX: list[Callable[..., Tensor]] = []


def _flex() -> Callable[..., Tensor]:
    """FlexAttention, compiled once per process (uncompiled it is a debugging path that makes the T x S scores);
    under torch.compile the uncompiled function, which Inductor compiles with the graph around it."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention
    if not _COMPILED_FLEX:
        compiled = torch.compile(flex_attention)  # automatic dynamic shapes: a second length is not a recompile

        def run(*args: Any, **kwargs: Any) -> Tensor:
            with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
                return compiled(*args, **kwargs)

        _COMPILED_FLEX.append(run)
    return _COMPILED_FLEX[0]
