"""A nanochat GPT with Laplacian heads, in both of nanochat's architecture families.

Design choices (after Karpathy's nanochat ``gpt.py`` and the authors' 2026 fork; state-dict names are nanochat's, so
its checkpoints load with ``strict=True``):

* **depth is the one dial.** Width = ``aspect_ratio`` (64) x depth, heads of ``head_dim`` (128), so
  ``GPTConfig(depth=20, vocab_size=65536)`` is the paper's 560,988,160-parameter nanochat d20.
* **One word picks the architecture family** (``arch``): ``"nanochat-2025"`` (October 2025, the default) or
  ``"nanochat-2026"`` (the fork the authors' LM sweep ran: value embeddings, residual and x0 lambdas, smear, backout,
  sliding windows "SSSL", q and k x 1.2, rotary base 100,000, vocabulary padded to a multiple of 64, its
  initialisation, and its width rule: width rounded up to a multiple of the head dim). Every feature is also its own
  option (the fork's names ``use_ve``, ``use_resid_lambdas``, ``use_x0``, ``use_smear``, ``use_backout``,
  ``window_pattern``, plus ``qk_scale``, ``rope_base``, ``pad_vocab_size_to``, ``init``); None means "the family's".
* **Laplacian heads from the one op.** Attention calls ``lapheads.laplacian_attention`` with this layer's heads (an
  int k for trailing specs); a Laplacian head outputs v - PV with v *after* the value-embedding mix, as the fork.
  The causal (or sliding-window) mask is aligned bottom-right, so one call serves training, prefill and decoding.
* **Sliding windows** ("S" layers, the last layer always "L"): a query sees itself and the ``short_window`` keys
  before it (FlashAttention's ``window_size=(w, 0)``), as a ``lapheads.core.masks.SlidingWindow`` pattern: no
  T x T mask; the op runs it as FlexAttention (evaluation, prefill), in bands of T x W work (decoding, and training
  on the CPU, where FlexAttention has no backward), or causal where the window reaches the first key.
* **Rotary embeddings** on queries and keys, no learned positions; **QK-norm** (parameter-free RMS norm) after them.
* **relu^2 MLP** (4x), **no biases**, parameter-free RMS norms before attention, before the MLP, after the
  embedding and before the head; **untied** ``wte`` / ``lm_head``; **logit softcap** 15 tanh(x / 15) in float32.
* **GQA/MQA** through ``n_kv_head`` (SDPA broadcasts keys and values; Laplacian heads subtract their own value).
* **Initialisation in one place** (``init_weights``), per family: 2025 = Linear N(0, 1/sqrt(fan_in) *
  min(1, sqrt(fan_out/fan_in))), embedding N(0, 1), zeros for ``lm_head`` and every output projection; 2026 = the
  fork's (embedding N(0, 0.8), head N(0, 0.001), q/k/v and value embeddings uniform with std 1/sqrt(width), c_fc at
  0.4 of that, zero output projections, scalars and gates as listed in ``_init_2026``). Either way every block starts
  as the identity, so Laplacian heads are a no-op at initialisation.
* **Built on the meta device** like nanochat (``with torch.device("meta")``, ``to_empty``, ``init_weights``): the
  head masks live beside the module and survive it (``LaplacianHeadsMixin``).
* **Generation** with a pre-allocated KV cache (which also carries the smear's previous embedding), temperature and
  top-k; cached logits equal full-forward logits with every option on. Requests decoded together (``prefill``) keep
  their own lengths in one cache: each row's step at its own position and rotary angle, attending to its own keys.

The residual stream is exposed as ``blocks`` (the layers) and ``norm`` (the final norm) for
``lapheads.geometry.ResidualStream``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lapheads.core.attention import laplacian_attention
from lapheads.core.heads import HeadSpecError, LayerHeads, parse_heads
from lapheads.core.masks import AttentionPattern, Documents, SlidingWindow
from lapheads.core.mixin import LaplacianHeadsMixin
from lapheads.errors import InputError
from lapheads.hardware import check_fits

__all__ = ["ARCHS", "GPT", "GPTConfig", "KVCache", "sample_rows", "sample_token"]

#: Architecture families: the value of every per-feature option that is left as None.
ARCHS: dict[str, dict[str, Any]] = {
    "nanochat-2025": dict(
        use_ve=False,
        use_resid_lambdas=False,
        use_x0=False,
        use_smear=False,
        use_backout=False,
        window_pattern="L",
        qk_scale=1.0,
        rope_base=10000.0,
        pad_vocab_size_to=1,
        init="nanochat-2025",
        round_width=False,
    ),
    "nanochat-2026": dict(
        use_ve=True,
        use_resid_lambdas=True,
        use_x0=True,
        use_smear=True,
        use_backout=True,
        window_pattern="SSSL",
        qk_scale=1.2,
        rope_base=100000.0,
        pad_vocab_size_to=64,
        init="nanochat-2026",
        round_width=True,
    ),
}
#: Feature widths of the fork's gates: the value-embedding gate and the smear gate read the first channels.
VE_GATE_CHANNELS, SMEAR_GATE_CHANNELS = 12, 24


@dataclass
class GPTConfig:
    """Args:
    depth: number of blocks; also sets the width (``aspect_ratio`` x depth).
    vocab_size: tokenizer vocabulary (65,536 for nanochat's BPE).
    sequence_len: longest sequence the model takes (training and generation).
    aspect_ratio: width per layer of depth (nanochat: 64).
    head_dim: target head dimension (nanochat: 128).
    n_kv_head: key/value heads (GQA/MQA); default = the number of query heads.
    laplacian_heads: k trailing Laplacian heads per layer, "0,2,2,0" per layer, or masks.
    softcap: logit soft cap (0 disables it).
    arch: the architecture family, ``"nanochat-2025"`` or ``"nanochat-2026"`` (see ``ARCHS``).
    use_ve: value embeddings mixed into v by a per-head gate in (0, 3), on alternating layers (last included).
    use_resid_lambdas: a learned scale of the residual stream before each block.
    use_x0: a learned share of the first (embedded) stream added back before each block.
    use_smear: the previous token's embedding mixed into each token's by a learned gate.
    use_backout: a learned share of the mid-depth stream subtracted before the final norm.
    window_pattern: "L" (full causal context) / "S" (sliding window) per layer, tiled; the last layer is "L".
    short_window: keys before a query that an "S" layer sees; None = the fork's rule, ceil(sequence_len / 4 to a
        multiple of 128).
    qk_scale: factor on queries and keys after the QK-norm (sharper attention).
    rope_base: rotary base frequency.
    pad_vocab_size_to: embedding and head rows rounded up to this multiple; logits are cropped to vocab_size.
    init: the initialisation, ``"nanochat-2025"`` or ``"nanochat-2026"``.
    width: the model width, overriding depth x aspect_ratio (e.g. a nanochat checkpoint's n_embd).
    num_heads: the number of query heads, overriding the width rule.
    document_bos: the token id that starts each document of a packed row (the tokenizer's BOS): the model then
        computes ``document_ids`` itself (``(idx == document_bos).cumsum(-1)``), so training, bits per byte and
        every evaluation keep attention and the smear within each document; not under a KV cache (generation
        continues one document). None: one causal sequence per row (nanochat's packing).
    """

    depth: int = 20
    vocab_size: int = 65536
    sequence_len: int = 2048
    aspect_ratio: int = 64
    head_dim: int = 128
    n_kv_head: int | None = None
    laplacian_heads: Any = 0
    softcap: float = 15.0
    arch: str = "nanochat-2025"
    use_ve: bool | None = None
    use_resid_lambdas: bool | None = None
    use_x0: bool | None = None
    use_smear: bool | None = None
    use_backout: bool | None = None
    window_pattern: str | None = None
    short_window: int | None = None
    qk_scale: float | None = None
    rope_base: float | None = None
    pad_vocab_size_to: int | None = None
    init: str | None = None
    width: int | None = None
    num_heads: int | None = None
    document_bos: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise InputError(f"arch={self.arch!r}; allowed: {', '.join(ARCHS)}")
        for name, value in ARCHS[self.arch].items():
            if name != "round_width" and getattr(self, name) is None:
                setattr(self, name, value)
        self.window_pattern = self.window_pattern.upper()

    @property
    def n_embd(self) -> int:
        if self.width is not None:
            return self.width
        base = self.depth * self.aspect_ratio
        if ARCHS[self.arch]["round_width"]:  # the fork: round up to whole heads of exactly head_dim
            return -(-base // self.head_dim) * self.head_dim
        return base

    def estimated_params(self) -> int:
        """The parameter count to within the small vectors, from the config alone (before anything is built): the
        block matrices (attention ~4 d^2, MLP 8 d^2), the embedding and head (untied) and, in the 2026 family, the
        value embeddings (a vocabulary x key/value width table on alternating layers)."""
        kv_width = (self.n_kv_head or self.n_head) * (self.n_embd // self.n_head)
        value_tables = sum(self.has_value_embedding(i) for i in range(self.depth)) if self.use_ve else 0
        embeddings = 2 * self.padded_vocab_size * self.n_embd + value_tables * self.padded_vocab_size * kv_width
        return self.depth * 12 * self.n_embd**2 + embeddings

    def estimated_bytes(self) -> int:
        """What building the model allocates: fp32 weights and the rotary tables (angles, cos and sin for every
        position up to ``sequence_len``)."""
        return 4 * self.estimated_params() + 4 * 3 * self.sequence_len * (self.n_embd // self.n_head // 2)

    @property
    def n_head(self) -> int:
        if self.num_heads is not None:
            return self.num_heads
        return max(1, math.ceil(self.n_embd / self.head_dim))

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.pad_vocab_size_to) * self.pad_vocab_size_to

    def window_sizes(self) -> list[int | None]:
        """Per layer: how many keys before a query an "S" layer sees, or None for full causal context ("L")."""
        short = self.short_window if self.short_window is not None else -(-self.sequence_len // 4 // 128) * 128
        sizes = [short if self.window_pattern[i % len(self.window_pattern)] == "S" else None for i in range(self.depth)]
        sizes[-1] = None  # the last layer always sees the whole context
        return [None if w is not None and w >= self.sequence_len - 1 else w for w in sizes]

    def has_value_embedding(self, layer: int) -> bool:
        """Alternating layers carry value embeddings, the last layer always (the fork's rule)."""
        return bool(self.use_ve) and layer % 2 == (self.depth - 1) % 2

    def validate(self) -> None:
        if self.depth < 1 or self.vocab_size < 2 or self.sequence_len < 1:
            raise InputError(
                f"GPTConfig needs depth >= 1, vocab_size >= 2, sequence_len >= 1; got depth="
                f"{self.depth}, vocab_size={self.vocab_size}, sequence_len={self.sequence_len}"
            )
        if self.n_embd % self.n_head:
            raise InputError(
                f"width {self.n_embd} (= depth x aspect_ratio) is not divisible into {self.n_head} heads "
                f"of about {self.head_dim}; allowed: a width that is a multiple of the head count"
            )
        kv = self.n_kv_head or self.n_head
        if self.n_head % kv:
            raise InputError(f"n_kv_head={kv} must divide the {self.n_head} query heads")
        if not self.window_pattern or set(self.window_pattern) - set("SL"):
            raise InputError(f"window_pattern={self.window_pattern!r}; allowed: a non-empty string of S and L")
        if self.short_window is not None and self.short_window < 1:
            raise InputError(f"short_window={self.short_window}; allowed: an integer >= 1")
        if self.init not in ("nanochat-2025", "nanochat-2026"):
            raise InputError(f"init={self.init!r}; allowed: nanochat-2025, nanochat-2026")
        if self.pad_vocab_size_to < 1 or self.qk_scale <= 0 or self.rope_base <= 1:
            raise InputError(
                f"pad_vocab_size_to={self.pad_vocab_size_to}, qk_scale={self.qk_scale}, rope_base="
                f"{self.rope_base}; allowed: >= 1, > 0 and > 1"
            )
        gates = [(self.use_ve, VE_GATE_CHANNELS, "use_ve"), (self.use_smear, SMEAR_GATE_CHANNELS, "use_smear")]
        for on, channels, name in gates:
            if on and self.n_embd < channels:
                raise InputError(
                    f"{name} needs a width >= {channels} (its gate reads {channels} channels); got {self.n_embd}"
                )

    def to_dict(self) -> dict[str, Any]:
        """Every field, resolved (JSON-ready): ``GPTConfig(**config.to_dict())`` rebuilds the same model."""
        return dataclasses.asdict(self)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMS norm over the last dimension."""
    return F.rms_norm(x, (x.size(-1),))


class RMSNorm(nn.Module):
    """Parameter-free RMS norm as a module, so hooks can see the final norm's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dimension of x (B, T, H, D) by the angles in cos/sin (1, T, 1, D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).to(x.dtype)


class KVCache:
    """Pre-allocated keys and values of every layer for incremental decoding, and the smear's previous embedding.

    ``kv`` holds the live batch rows: a view of the first rows of a storage with room for more, so sequences that
    leave (:meth:`keep`) or join (:meth:`join`) a batch being decoded move only their filled positions, never the
    whole pre-allocated length. Positions at and after a row's length are written before they are read.

    **Rows of their own lengths** (``lengths``; a batch of requests that started apart): each row holds its own
    first ``lengths[b]`` positions, and a step (one new token a row) writes each row's key and value at its own
    position and, as well, in the batch's last column (``pos``, the longest row's position): the op reads the query's
    own value there (queries are the last keys), and for a shorter row that column lies past its length, where
    nothing of it is kept. :meth:`attended` says which columns each row sees. Where every row holds the same
    number of positions, ``lengths`` is None and ``pos`` is that number.

    Args:
        batch_size, num_kv_heads, max_len, head_dim, num_layers: the cache's shape.
        device, dtype: where and in what precision keys and values are stored.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        num_layers: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (num_layers, 2, batch_size, num_kv_heads, max_len, head_dim)
        self._storage = torch.zeros(shape, device=device, dtype=dtype)
        self.kv = self._storage
        self.max_len = max_len
        self.pos = 0  # tokens already stored (the next token's position); with lengths: the longest row's
        self.lengths: torch.Tensor | None = None  # (B,) each row's own positions where rows differ
        self.prev_embedding: torch.Tensor | None = None  # the last token's embedding before the smear (B, 1, C)

    def row_lengths(self) -> torch.Tensor:
        """(B,) the positions each row holds."""
        if self.lengths is not None:
            return self.lengths
        return torch.full((self.kv.shape[2],), self.pos, dtype=torch.long, device=self.kv.device)

    def set_lengths(self, lengths: torch.Tensor) -> None:
        """Each row holds its first ``lengths[b]`` positions (the rest of its columns are not read): rows of
        their own lengths where they differ, else every row at that one position."""
        lengths = lengths.to(device=self.kv.device, dtype=torch.long)
        longest = int(lengths.max()) if len(lengths) else 0
        if longest > self.max_len:
            raise InputError(f"KV cache rows of up to {longest} positions > its max_len {self.max_len}")
        self.pos = longest
        self.lengths = None if not len(lengths) or bool((lengths == longest).all()) else lengths

    def attended(self, window: int | None = None) -> torch.Tensor:
        """(B, pos + 1) document ids for a step of rows of their own lengths (``lapheads.core.masks.Documents``):
        1 where a row's query (the last column) sees a key: its own positions (within ``window`` of its own
        position where given) and itself; 0 elsewhere."""
        lengths = self.row_lengths()[:, None]
        column = torch.arange(self.pos + 1, device=self.kv.device)[None]
        seen = column < lengths
        if window is not None:
            seen &= column >= lengths - window  # a query at position n sees n - window and after, as SlidingWindow
        return (seen | (column == self.pos)).long()

    def insert(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, Hkv, T, D) for ``layer``; return all keys and values so far."""
        end = self.pos + k.shape[2]
        if end > self.max_len:
            raise InputError(f"KV cache full: {end} tokens > its max_len {self.max_len}")
        if self.lengths is not None:  # one token a row, at its own position and in the query's column
            rows = torch.arange(k.shape[0], device=k.device)
            for i, new in ((0, k), (1, v)):
                self.kv[layer, i][rows, :, self.lengths] = new[:, :, 0]
        self.kv[layer, 0, :, :, self.pos : end] = k
        self.kv[layer, 1, :, :, self.pos : end] = v
        if layer == self.kv.shape[0] - 1:  # the last layer moves the cache forward
            self.pos = end
            if self.lengths is not None:
                self.set_lengths(self.lengths + k.shape[2])
        return self.kv[layer, 0, :, :, :end], self.kv[layer, 1, :, :, :end]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (indices), in that order: sequences that finished leave the batch (their
        filled positions move to the front rows; the storage stays)."""
        n, lengths = len(rows), self.row_lengths()[rows]
        self._storage[:, :, :n, :, : self.pos] = self.kv[:, :, rows, :, : self.pos]
        self.kv = self._storage[:, :, :n]
        self.set_lengths(lengths)  # the longest row may have left: the batch's last column moves back
        if self.prev_embedding is not None:
            self.prev_embedding = self.prev_embedding[rows]

    def join(self, other: KVCache) -> None:
        """Append ``other``'s batch rows after this cache's, each with its own length: sequences that join a batch
        being decoded, wherever they are (``other`` may be only as long as they are: its filled positions move)."""
        layout = lambda kv: (kv.shape[:2], kv.shape[3], kv.shape[5])  # noqa: E731 - layers, k/v, heads, head size
        if layout(other.kv) != layout(self.kv) or other.pos > self.max_len:
            raise InputError(
                f"a KV cache of shape {tuple(other.kv.shape)} at position {other.pos} cannot join one of shape "
                f"{tuple(self.kv.shape)}; allowed: the same layers, heads and head size, at most {self.max_len} "
                "positions"
            )
        if (self.prev_embedding is None) != (other.prev_embedding is None):
            raise InputError(
                "a KV cache with the smear's previous embedding cannot join one without it; allowed: caches of one "
                "model, both prefilled (the smear keeps each row's last embedding)"
            )
        n, m = self.kv.shape[2], other.kv.shape[2]
        lengths = torch.cat([self.row_lengths(), other.row_lengths()])
        if n + m > self._storage.shape[2]:  # room for the newcomers, and as many again
            shape = list(self._storage.shape)
            shape[2] = 2 * (n + m)
            storage = self._storage.new_zeros(shape)
            storage[:, :, :n, :, : self.pos] = self.kv[:, :, :, :, : self.pos]
            self._storage = storage
        self._storage[:, :, n : n + m, :, : other.pos] = other.kv[:, :, :, :, : other.pos]
        self.kv = self._storage[:, :, : n + m]
        self.set_lengths(lengths)
        if self.prev_embedding is not None:
            self.prev_embedding = torch.cat([self.prev_embedding, other.prev_embedding])


class CausalSelfAttention(LaplacianHeadsMixin, nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int, heads: LayerHeads) -> None:
        super().__init__()
        self.local_v = self.local_o = None
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head or config.n_head
        self.head_dim = config.n_embd // self.n_head
        self.qk_scale = config.qk_scale
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        # the value-embedding gate (2026): one gate per key/value head from the first channels of the input
        self.ve_gate = (
            nn.Linear(VE_GATE_CHANNELS, self.n_kv_head, bias=False) if config.has_value_embedding(layer_idx) else None
        )
        # a non-persistent buffer (nanochat checkpoints load unchanged; the spec lives in the config) that
        # survives meta-device builds and to_empty (LaplacianHeadsMixin)
        self._init_laplacian_heads(self.n_head, heads)

    def _make_local(self, num_local: int, untied_heads: list[int]) -> None:
        """ "local" heads: their own value and output weights (W_V', W_O'), untied from c_v and c_proj; init_weights
        starts W_O' at zero like every output projection. ("untied" heads: lapheads' timm ViTs.)"""
        if untied_heads:
            raise HeadSpecError("the GPT has no 'untied' heads; allowed here: every other kind (untied: the timm ViTs)")
        if not num_local:
            self.local_v = self.local_o = None
            return
        width = num_local * self.head_dim
        device, dtype = self.c_v.weight.device, self.c_v.weight.dtype
        self.local_v = nn.Linear(self.c_v.in_features, width, bias=False, device=device, dtype=dtype)
        self.local_o = nn.Linear(width, self.c_proj.out_features, bias=False, device=device, dtype=dtype)

    def _gate_input_features(self) -> int | None:
        return self.c_q.in_features

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache | None,
        value_embedding: torch.Tensor | None = None,
        pattern: AttentionPattern | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if value_embedding is not None:  # ResFormer value residual; Laplacian heads then use this mixed v
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))  # (B, T, Hkv), in (0, 3)
            v = v + gate.unsqueeze(-1) * value_embedding.view(B, T, self.n_kv_head, self.head_dim)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        q, k = rms_norm(q), rms_norm(k)  # QK-norm keeps attention logits bounded
        if self.qk_scale != 1.0:  # the 2026 family sharpens attention, split between q and k
            q, k = q * self.qk_scale, k * self.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.insert(self.layer_idx, k, v)
        # T < S with a cache: the op aligns the mask bottom-right and uses the query's own value
        y = laplacian_attention(
            q,
            k,
            v,
            laplacian_heads=self.laplacian_heads_for_op,
            attn_mask=pattern,
            is_causal=pattern is None,
            mix=None if self.mix_a is None else (self.mix_a, self.mix_b),
        )
        y = self._gate(y, x)  # gated heads: each head's output times sigmoid(x w_h)
        out = self.c_proj(y.transpose(1, 2).reshape(B, T, -1))
        if self.local_v is not None:  # "local" heads' untied token-local term
            out = out + self.local_o(self.local_v(x))
        return out


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int, heads: LayerHeads) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx, heads)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache | None = None,
        value_embedding: torch.Tensor | None = None,
        pattern: AttentionPattern | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(rms_norm(x), cos_sin, kv_cache, value_embedding, pattern)
        return x + self.mlp(rms_norm(x))


def _optional_parameter(enabled: bool, shape: tuple[int, ...]) -> nn.Parameter | None:
    """A disabled component registers as None: absent from parameters() and the state dict, as in the fork."""
    return nn.Parameter(torch.empty(shape)) if enabled else None


#: below this temperature sampling is greedy: the distribution already is one-hot, and logits / 1e-40 overflow to inf
GREEDY_BELOW = 1e-5


def sample_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """One next token (B, 1) from logits (B, V): greedy at temperature 0 (and below ``GREEDY_BELOW``), else
    sampled, at the temperature, from the tokens at least ``min_p`` times as likely as the likeliest (None or 0:
    all), then from the top-k (None/0: all), then from the smallest set of likeliest tokens whose probability
    reaches ``top_p`` (nucleus sampling; None or 1: all), in vLLM's order (transformers applies min_p last; the two
    differ only with min_p and top_p together). One setting and one generator for every row (:func:`sample_rows`
    gives each row its own)."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1, keepdim=True)
    return _draw(_filtered(logits, temperature, top_k, top_p, min_p).softmax(-1), generator)


def sample_rows(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ks: Sequence[int | None],
    top_ps: Sequence[float | None],
    generators: Sequence[torch.Generator | None],
    min_ps: Sequence[float | None] | None = None,
) -> list[int]:
    """:func:`sample_token` for each row of ``logits`` (B, V) with the row's own temperature, top-k, top-p and
    generator: the token each row samples alone, with the filtering done once for the rows that share a setting
    (a server's requests mostly do) and the draws raced in one division (:func:`_draw`), each row's noise from its
    own generator.

    Args:
        logits: (B, V), one row a request.
        temperatures, top_ks, top_ps, generators, min_ps: one a row, as :func:`sample_token` takes them (no min_ps:
            none for any row).
    """
    tokens = [0] * logits.size(0)
    greedy: list[int] = []
    sharing: dict[tuple[float, int | None, float | None, float | None], list[int]] = {}  # sampled rows by setting
    min_ps = [None] * logits.size(0) if min_ps is None else min_ps
    for row, setting in enumerate(zip(temperatures, top_ks, top_ps, min_ps)):
        if setting[0] >= GREEDY_BELOW:
            sharing.setdefault(setting, []).append(row)
        else:
            greedy.append(row)
    if greedy:  # one argmax for them (none in a server whose requests all sample)
        for row, token in zip(greedy, logits[greedy].argmax(-1).tolist()):
            tokens[row] = token
    for (temperature, top_k, top_p, min_p), rows in sharing.items():
        probs = _filtered(logits[rows], temperature, top_k, top_p, min_p).softmax(-1)
        noise = torch.empty_like(probs)
        for n, row in enumerate(rows):
            noise[n].exponential_(generator=generators[row])  # what _draw draws for this row alone
        for row, token in zip(rows, (probs / noise).argmax(-1).tolist()):
            tokens[row] = token
    return tokens


def _filtered(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, min_p: float | None = None
) -> torch.Tensor:
    """``logits`` / ``temperature``, the tokens below ``min_p`` times the likeliest's probability, then outside the
    top-k, then outside the nucleus at -inf (vLLM's order)."""
    scaled = logits / temperature
    if min_p:  # vLLM's and transformers' min-p: relative to the likeliest token, at the temperature
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if top_k:
        kth = scaled.topk(min(top_k, scaled.size(-1))).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = scaled.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        beyond = probs.cumsum(-1) - probs >= top_p  # the likelier tokens already hold top_p
        beyond[..., 0] = False  # never the likeliest: a top_p below float32's resolution (1e-300) compares as 0
        scaled = scaled.masked_fill(torch.zeros_like(beyond).scatter(-1, order, beyond), float("-inf"))
    return scaled


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token (B, 1) a row from ``probs`` (B, V): ``torch.multinomial(probs, 1, generator=generator)``'s own
    one-draw path written out (the exponential race: the argmax of p / E, E ~ Exp(1) from the generator; the same
    tokens: tests/models/test_gpt.py), so that :func:`sample_rows` can draw each row's noise from its own
    generator and race the rows together."""
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(-1, keepdim=True)


class GPT(nn.Module):
    """nanochat's GPT with Laplacian heads; ``forward(idx, targets)`` returns the loss, ``forward(idx)`` logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        if torch.empty(0).device.type != "meta":  # a meta-device build allocates nothing
            check_fits(
                f"GPT(depth={config.depth}, width={config.n_embd}, vocab={config.padded_vocab_size}, sequence_len="
                f"{config.sequence_len}): ~{config.estimated_params():,} parameters",
                config.estimated_bytes(),  # fp32 weights and rotary tables; training: lapheads.train.lm checks it
            )
        heads = parse_heads(config.laplacian_heads, [config.n_head] * config.depth)
        vocab, width = config.padded_vocab_size, config.n_embd
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, width),
                "h": nn.ModuleList([Block(config, i, heads[i]) for i in range(config.depth)]),
            }
        )
        self.norm = RMSNorm()
        self.lm_head = nn.Linear(width, vocab, bias=False)
        kv_width = (config.n_kv_head or config.n_head) * (width // config.n_head)
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(vocab, kv_width) for i in range(config.depth) if config.has_value_embedding(i)}
        )
        self.resid_lambdas = _optional_parameter(config.use_resid_lambdas, (config.depth,))
        self.x0_lambdas = _optional_parameter(config.use_x0, (config.depth,))
        self.smear_gate = nn.Linear(SMEAR_GATE_CHANNELS, 1, bias=False) if config.use_smear else None
        self.smear_lambda = _optional_parameter(config.use_smear, (1,))
        self.backout_lambda = _optional_parameter(config.use_backout, (1,))
        self.window_sizes = config.window_sizes()
        # one pattern per distinct window, kept: FlexAttention's block mask is then built once per length
        self.windows = {w: SlidingWindow(w) for w in set(self.window_sizes) if w is not None}
        cos, sin = self._rotary(config.sequence_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.init_weights()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer["h"]

    def head_kinds(self) -> list[list[str]]:
        """Each layer's head kinds, for records and config.json (host truth: works on the meta device too)."""
        return [list(block.attn.heads.names) for block in self.blocks]

    def laplacian_masks(self) -> list[list[bool]]:
        """Each layer's Laplacian head mask, for records and config.json."""
        return [list(block.attn.heads.flags) for block in self.blocks]

    def constructor_kwargs(self) -> dict[str, Any]:
        """``GPT(GPTConfig(**kwargs))`` rebuilds this model: every config field, the heads as explicit masks (or, with
        other head kinds, as each layer's kinds)."""
        plain = all(block.attn.heads.plain for block in self.blocks)
        heads = self.laplacian_masks() if plain else self.head_kinds()
        return dict(self.config.to_dict(), laplacian_heads=heads)

    def _rotary(self, seq_len: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = self.config.n_embd // self.config.n_head
        inv_freq = 1.0 / self.config.rope_base ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        )
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
        return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]

    @torch.no_grad()
    def init_weights(self) -> None:
        """All initialisation, in one place (see the module docstring)."""
        if self.config.init == "nanochat-2026":
            self._init_2026()
        else:
            self._init_2025()
        self._init_head_kinds()  # after the families' loops (2025's touches every Linear)
        if self.cos.device.type != "meta":
            cos, sin = self._rotary(self.config.sequence_len, self.cos.device)
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def _init_2025(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                fan_out, fan_in = module.weight.shape
                nn.init.normal_(module.weight, std=1.0 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in)))
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0)
        nn.init.zeros_(self.lm_head.weight)  # uniform predictions at step 0: loss = ln(vocab)
        for block in self.blocks:  # every block starts as the identity map
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
        self._init_scalars_and_gates()

    def _init_2026(self) -> None:
        nn.init.normal_(self.transformer["wte"].weight, std=0.8)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        bound = math.sqrt(3) / math.sqrt(self.config.n_embd)  # uniform with std 1/sqrt(width): no outliers
        for block in self.blocks:
            for linear in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                nn.init.uniform_(linear.weight, -bound, bound)
            nn.init.uniform_(block.mlp.c_fc.weight, -0.4 * bound, 0.4 * bound)
            nn.init.zeros_(block.attn.c_proj.weight)  # every block starts as the identity map
            nn.init.zeros_(block.mlp.c_proj.weight)
        for embedding in self.value_embeds.values():
            nn.init.uniform_(embedding.weight, -bound, bound)
        self._init_scalars_and_gates()

    def _init_head_kinds(self) -> None:
        """mix heads start ordinary (a = 0, b = 1); local heads' W_V' like c_v, W_O' at zero; gates at zero (the
        scale 1/2)."""
        for block in self.blocks:
            attn = block.attn
            if attn.mix_a is not None:
                nn.init.zeros_(attn.mix_a)
                nn.init.ones_(attn.mix_b)
            if attn.head_gate is not None:
                nn.init.zeros_(attn.head_gate.weight)
            if attn.local_v is not None:
                fan_in = attn.local_v.weight.shape[1]
                nn.init.normal_(attn.local_v.weight, std=1.0 / math.sqrt(fan_in))
                nn.init.zeros_(attn.local_o.weight)

    def _init_scalars_and_gates(self) -> None:
        """The fork's values, in either family when a feature is switched on."""
        depth = self.config.depth
        ramp = torch.arange(depth, dtype=torch.float32) / max(depth - 1, 1)
        if self.resid_lambdas is not None:  # a stronger residual early, weaker deep
            self.resid_lambdas.copy_(1.15 - 0.10 * ramp)
        if self.x0_lambdas is not None:  # more of the embedding re-injected early
            self.x0_lambdas.copy_(0.20 - 0.15 * ramp)
        if self.smear_lambda is not None:
            nn.init.zeros_(self.smear_lambda)  # the smear starts off
            nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)
        if self.backout_lambda is not None:
            nn.init.constant_(self.backout_lambda, 0.2)
        for block in self.blocks:  # gates start slightly above neutral
            if block.attn.ve_gate is not None:
                nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _attention_patterns(
        self, keys: int, kv_cache: KVCache | None, document_ids: torch.Tensor | None
    ) -> dict[int | None, AttentionPattern | None]:
        """Each layer's pattern by its window (None: an "L" layer) for a forward over ``keys`` keys: None (causal)
        where there are no documents and the window reaches the first key (SDPA's causal kernel and the training
        node); with documents, the documents (and the window) in every layer. Under a KV cache the ids name every
        key, the cached ones included (the new tokens are the last T)."""
        if document_ids is None:
            return {None: None, **{w: p if w < keys - 1 else None for w, p in self.windows.items()}}
        if kv_cache is not None and document_ids.shape[1] != keys:
            raise InputError(
                f"document_ids of {document_ids.shape[1]} tokens with a KV cache of {keys} keys; allowed: one id per "
                "key, the cached ones included (a batch decoded together: lapheads.apps.batching)"
            )
        documents = Documents(document_ids)
        return {None: documents, **{w: p & documents for w, p in self.windows.items()}}

    def _smear(self, x: torch.Tensor, kv_cache: KVCache | None, document_ids: torch.Tensor | None) -> torch.Tensor:
        """Mix each token's previous token's embedding into it, by a learned gate (cheap bigram information); not
        across a document boundary."""
        previous = kv_cache.prev_embedding if kv_cache is not None else None
        if kv_cache is not None:
            kv_cache.prev_embedding = x[:, -1:]
        shifted = x[:, :-1] if previous is None else torch.cat([previous.to(x.dtype), x[:, :-1]], dim=1)
        current = x[:, 1:] if previous is None else x
        if current.shape[1] == 0:  # one token and nothing before it
            return x
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(current[..., :SMEAR_GATE_CHANNELS]))
        if document_ids is not None:  # every key's id: the tokens mixed are the last T, their predecessors before them
            ids, t = document_ids, current.shape[1]
            gate = gate * (ids[:, -t:] == ids[:, -t - 1 : -1]).unsqueeze(-1).to(x.dtype)
        mixed = current + gate * shifted
        return mixed if previous is not None else torch.cat([x[:, :1], mixed], dim=1)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        loss_reduction: str = "mean",
        document_ids: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args:
        idx: token ids (B, T).
        targets: next-token ids (B, T), -1 = ignored; when given, returns the cross-entropy loss.
        kv_cache: continue from the cache's position (generation); the new tokens are appended.
        loss_reduction: "mean", "sum" or "none" (per token, for bits-per-byte and scoring).
        document_ids: (B, T) integer document of each token of a packed batch (e.g. ``(idx == bos).cumsum(-1)``):
            attention and the smear stay within each document, so with rotary positions each document's logits are
            those it has alone. Under a KV cache, (B, cached + T): an id for every key (a left-padded batch decoded
            together keeps its padding apart). None: one causal sequence per row (nanochat's packing).
        logits_at: (B,) the one position of each row whose logits are wanted (B, 1, V): a prefill's last tokens,
            without the (B, T, V) logits of every position (gigabytes at a 65,536-token vocabulary). No targets.
        """
        B, T = idx.shape
        if logits_at is not None and targets is not None:
            raise InputError("logits_at with targets; allowed: one of them (a loss needs every position's logits)")
        c = self.config
        if document_ids is None and c.document_bos is not None and kv_cache is None:  # the model's own packing rule
            document_ids = (idx == c.document_bos).cumsum(-1)
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > c.sequence_len:
            raise InputError(
                f"sequence of {start + T} tokens is longer than the model's sequence_len "
                f"{c.sequence_len}; allowed: at most {c.sequence_len}"
            )
        if kv_cache is not None and kv_cache.lengths is not None:  # rows of their own lengths: one step each
            if T != 1 or document_ids is not None:
                raise InputError(
                    f"{T} tokens a row{' with document_ids' if document_ids is not None else ''} into a KV cache whose "
                    "rows hold their own lengths; allowed: one token a row, no document_ids (a step of a batch "
                    "decoded together)"
                )
            at = kv_cache.lengths  # each row's own position: its rotary angle
            cos_sin = self.cos[0, at][:, None].to(idx.device), self.sin[0, at][:, None].to(idx.device)
            patterns = {w: Documents(kv_cache.attended(w)) for w in (None, *self.windows)}
        else:
            cos_sin = self.cos[:, start : start + T].to(idx.device), self.sin[:, start : start + T].to(idx.device)
            patterns = self._attention_patterns(start + T, kv_cache, document_ids)
        x = rms_norm(self.transformer["wte"](idx))
        if self.smear_gate is not None:
            x = self._smear(x, kv_cache, document_ids)
        x0, backout = x, None
        for i, block in enumerate(self.blocks):
            if self.resid_lambdas is not None:
                x = self.resid_lambdas[i].to(x.dtype) * x
            if self.x0_lambdas is not None:
                x = x + self.x0_lambdas[i].to(x.dtype) * x0
            ve = self.value_embeds[str(i)](idx).to(x.dtype) if str(i) in self.value_embeds else None
            x = block(x, cos_sin, kv_cache, ve, patterns[self.window_sizes[i]])
            if self.backout_lambda is not None and i == c.depth // 2:
                backout = x  # the mid-depth stream: low-level features to remove before the head
        if backout is not None:
            x = x - self.backout_lambda.to(x.dtype) * backout
        x = self.norm(x)
        if logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at.to(x.device)][:, None]
        logits = self.lm_head(x)[..., : c.vocab_size].float()  # padded rows are never predicted
        if c.softcap:
            logits = c.softcap * torch.tanh(logits / c.softcap)
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction=loss_reduction
        )

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        c = self.config
        return KVCache(
            batch_size,
            c.n_kv_head or c.n_head,
            max_len or c.sequence_len,
            c.n_embd // c.n_head,
            c.depth,
            device=self.lm_head.weight.device,
            dtype=dtype or self.lm_head.weight.dtype,
        )

    @torch.no_grad()
    def prefill(
        self, prompts: list[list[int]] | list[tuple[int, ...]], max_len: int | None = None
    ) -> tuple[KVCache, torch.Tensor]:
        """Prompts of any lengths in one forward: a KV cache (``max_len`` long, default ``sequence_len``) whose rows
        hold their own lengths, and each prompt's last logits (B, V) in float32, the ones it has alone.

        Each prompt is right-padded with its own last token: a causal query never sees what comes after it, the
        padded columns lie past the row's length (never attended, overwritten as it grows), and the smear's previous
        embedding, taken from the last column, is the row's own last token's.
        """
        lengths = [len(prompt) for prompt in prompts]
        if not lengths or min(lengths) == 0:
            raise InputError(f"prompts of lengths {lengths}; allowed: one or more prompts of at least one token")
        width, device = max(lengths), self.lm_head.weight.device
        ids = torch.tensor([[*prompt, *[prompt[-1]] * (width - len(prompt))] for prompt in prompts], device=device)
        cache = self.new_kv_cache(len(prompts), max_len)
        at = torch.tensor(lengths, device=device)
        logits = self(ids, kv_cache=cache, logits_at=at - 1)[:, 0]
        cache.set_lengths(at)
        return cache, logits

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        stop_token: int | None = None,
    ) -> torch.Tensor:
        """Continue prompts ``idx`` (B, T) by ``max_new_tokens`` tokens with a KV cache; returns (B, T + new).

        ``temperature`` 0 is greedy. Rows that produce ``stop_token`` keep emitting it (callers cut there).
        """
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0; got {max_new_tokens}")
        cache = self.new_kv_cache(idx.shape[0], idx.shape[1] + max_new_tokens)
        last = torch.full((idx.shape[0],), idx.shape[1] - 1, device=idx.device)
        logits = self(idx, kv_cache=cache, logits_at=last)[:, -1]  # the prompt's last position only
        out, done = [idx], torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for step in range(max_new_tokens):
            token = sample_token(logits, temperature, top_k, generator)
            if stop_token is not None:
                token = torch.where(done[:, None], torch.full_like(token, stop_token), token)
                done |= token[:, 0] == stop_token
            out.append(token)
            if step + 1 == max_new_tokens or bool(done.all()):
                break
            logits = self(token, kv_cache=cache)[:, -1]
        generated = sum(t.shape[1] for t in out[1:])
        if generated < max_new_tokens:  # every row stopped early: pad with the stop token
            out.append(
                torch.full((idx.shape[0], max_new_tokens - generated), stop_token, dtype=idx.dtype, device=idx.device)
            )
        return torch.cat(out, dim=1)
