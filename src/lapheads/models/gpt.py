"""A nanochat-style GPT with Laplacian heads.

Design choices (after Karpathy's nanochat ``gpt.py``; state-dict names are nanochat's, so its checkpoints load):

* **depth is the one dial.** Width = ``aspect_ratio`` (64) x depth, heads of ``head_dim`` (128), so
  ``GPTConfig(depth=20, vocab_size=65536)`` is the paper's 560,988,160-parameter nanochat d20.
* **Laplacian heads from the one op.** Attention calls ``lapheads.laplacian_attention`` with this layer's head mask
  (from the shared parser: k per layer, "0,2,2,0", or masks); a Laplacian head outputs v - PV. The causal mask is
  aligned bottom-right, so the same call serves training, prefill and KV-cache decoding.
* **Rotary embeddings** (base 10000) on queries and keys, no learned positions.
* **QK-norm**: parameter-free RMS norm of queries and keys after rotary, as nanochat.
* **relu^2 MLP** (4x), **no biases**, parameter-free RMS norms before attention, before the MLP, after the
  embedding and before the head.
* **Untied embeddings**: token embedding ``wte`` and output head ``lm_head`` are separate matrices.
* **Logit softcap** 15 * tanh(logits / 15), computed in float32.
* **GQA/MQA** through ``n_kv_head`` (SDPA broadcasts keys and values; Laplacian heads subtract their own value).
* **Initialisation in one place** (``init_weights``): Linear N(0, 1/sqrt(fan_in) * min(1, sqrt(fan_out/fan_in))),
  embedding N(0, 1), and zeros for ``lm_head`` and every output projection, so each block starts as the identity.
* **Generation** with a pre-allocated KV cache, temperature and top-k; cached logits equal full-forward logits.

The residual stream is exposed as ``blocks`` (the layers) and ``norm`` (the final norm) for
``lapheads.geometry.ResidualStream``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lapheads.attention import LaplacianHeadsMixin, laplacian_attention, parse_laplacian_heads
from lapheads.errors import InputError

__all__ = ["GPT", "GPTConfig", "KVCache"]


@dataclass
class GPTConfig:
    """Args:
        depth: number of blocks; also sets the width (``aspect_ratio`` x depth).
        vocab_size: tokenizer vocabulary (65,536 for nanochat's BPE).
        sequence_len: longest sequence the model takes (training and generation).
        aspect_ratio: width per layer of depth (nanochat: 64).
        head_dim: target head dimension (nanochat: 128); heads = ceil(width / head_dim).
        n_kv_head: key/value heads (GQA/MQA); default = the number of query heads.
        laplacian_heads: k trailing Laplacian heads per layer, "0,2,2,0" per layer, or masks.
        softcap: logit soft cap (0 disables it).
        rope_base: rotary base frequency.
    """

    depth: int = 20
    vocab_size: int = 65536
    sequence_len: int = 2048
    aspect_ratio: int = 64
    head_dim: int = 128
    n_kv_head: int | None = None
    laplacian_heads: Any = 0
    softcap: float = 15.0
    rope_base: float = 10000.0

    @property
    def n_embd(self) -> int:
        return self.depth * self.aspect_ratio

    @property
    def n_head(self) -> int:
        return max(1, math.ceil(self.n_embd / self.head_dim))

    def validate(self) -> None:
        if self.depth < 1 or self.vocab_size < 2 or self.sequence_len < 1:
            raise InputError(f"GPTConfig needs depth >= 1, vocab_size >= 2, sequence_len >= 1; got depth="
                             f"{self.depth}, vocab_size={self.vocab_size}, sequence_len={self.sequence_len}")
        if self.n_embd % self.n_head:
            raise InputError(f"width {self.n_embd} (= depth x aspect_ratio) is not divisible into {self.n_head} heads "
                             f"of about {self.head_dim}; allowed: a width that is a multiple of the head count")
        kv = self.n_kv_head or self.n_head
        if self.n_head % kv:
            raise InputError(f"n_kv_head={kv} must divide the {self.n_head} query heads")


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
    """Pre-allocated keys and values of every layer for incremental decoding.

    Args:
        batch_size, num_kv_heads, max_len, head_dim, num_layers: the cache's shape.
        device, dtype: where and in what precision keys and values are stored.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, num_layers: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        shape = (num_layers, 2, batch_size, num_kv_heads, max_len, head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.pos = 0  # tokens already stored (the next token's position)

    def insert(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, Hkv, T, D) for ``layer``; return all keys and values so far."""
        end = self.pos + k.shape[2]
        if end > self.max_len:
            raise InputError(f"KV cache full: {end} tokens > its max_len {self.max_len}")
        self.kv[layer, 0, :, :, self.pos:end] = k
        self.kv[layer, 1, :, :, self.pos:end] = v
        if layer == self.kv.shape[0] - 1:  # the last layer moves the cache forward
            self.pos = end
        return self.kv[layer, 0, :, :, :end], self.kv[layer, 1, :, :, :end]


class CausalSelfAttention(LaplacianHeadsMixin, nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int, laplacian_mask: torch.Tensor) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head or config.n_head
        self.head_dim = config.n_embd // self.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        # a non-persistent buffer (nanochat checkpoints load unchanged; the spec lives in the config) that
        # survives meta-device builds and to_empty (LaplacianHeadsMixin)
        self._init_laplacian_heads(self.n_head, laplacian_mask)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        q, k = rms_norm(q), rms_norm(k)  # QK-norm keeps attention logits bounded
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.insert(self.layer_idx, k, v)
        # T < S with a cache: the op aligns the causal mask bottom-right and uses the query's own value
        y = laplacian_attention(q, k, v, laplacian_heads=self.laplacian_heads_for_op, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int, laplacian_mask: torch.Tensor) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx, laplacian_mask)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(rms_norm(x), cos_sin, kv_cache)
        return x + self.mlp(rms_norm(x))


class GPT(nn.Module):
    """nanochat's GPT with Laplacian heads; ``forward(idx, targets)`` returns the loss, ``forward(idx)`` logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        masks = parse_laplacian_heads(config.laplacian_heads, num_heads=config.n_head, num_layers=config.depth)
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "h": nn.ModuleList([Block(config, i, masks[i]) for i in range(config.depth)]),
        })
        self.norm = RMSNorm()
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        cos, sin = self._rotary(config.sequence_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.init_weights()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer["h"]

    def laplacian_masks(self) -> list[list[bool]]:
        """Each layer's Laplacian head mask (from the config, so it works on the meta device too)."""
        with torch.device("cpu"):
            masks = parse_laplacian_heads(self.config.laplacian_heads, num_heads=self.config.n_head,
                                          num_layers=self.config.depth)
        return [mask.tolist() for mask in masks]

    def _rotary(self, seq_len: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = self.config.n_embd // self.config.n_head
        inv_freq = 1.0 / self.config.rope_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
        return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]

    @torch.no_grad()
    def init_weights(self) -> None:
        """All initialisation, in one place (see the module docstring)."""
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
        if self.cos.device.type != "meta":
            cos, sin = self._rotary(self.config.sequence_len, self.cos.device)
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        loss_reduction: str = "mean",
    ) -> torch.Tensor:
        """Args:
            idx: token ids (B, T).
            targets: next-token ids (B, T), -1 = ignored; when given, returns the cross-entropy loss.
            kv_cache: continue from the cache's position (generation); the new tokens are appended.
            loss_reduction: "mean", "sum" or "none" (per token, for bits-per-byte and scoring).
        """
        B, T = idx.shape
        start = kv_cache.pos if kv_cache is not None else 0
        if start + T > self.config.sequence_len:
            raise InputError(f"sequence of {start + T} tokens is longer than the model's sequence_len "
                             f"{self.config.sequence_len}; allowed: at most {self.config.sequence_len}")
        cos_sin = self.cos[:, start:start + T].to(idx.device), self.sin[:, start:start + T].to(idx.device)
        x = rms_norm(self.transformer["wte"](idx))
        for block in self.blocks:
            x = block(x, cos_sin, kv_cache)
        x = self.norm(x)
        logits = self.lm_head(x).float()
        if self.config.softcap:
            logits = self.config.softcap * torch.tanh(logits / self.config.softcap)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                               reduction=loss_reduction)

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        c = self.config
        return KVCache(batch_size, c.n_kv_head or c.n_head, max_len or c.sequence_len, c.n_embd // c.n_head, c.depth,
                       device=self.lm_head.weight.device, dtype=dtype or self.lm_head.weight.dtype)

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
        logits = self(idx, kv_cache=cache)[:, -1]
        out, done = [idx], torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for step in range(max_new_tokens):
            if temperature == 0:
                token = logits.argmax(-1, keepdim=True)
            else:
                scaled = logits / temperature
                if top_k is not None:
                    kth = scaled.topk(min(top_k, scaled.size(-1))).values[:, -1:]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                token = torch.multinomial(scaled.softmax(-1), 1, generator=generator)
            if stop_token is not None:
                token = torch.where(done[:, None], torch.full_like(token, stop_token), token)
                done |= token[:, 0] == stop_token
            out.append(token)
            if step + 1 == max_new_tokens or bool(done.all()):
                break
            logits = self(token, kv_cache=cache)[:, -1]
        generated = sum(t.shape[1] for t in out[1:])
        if generated < max_new_tokens:  # every row stopped early: pad with the stop token
            out.append(torch.full((idx.shape[0], max_new_tokens - generated), stop_token, dtype=idx.dtype,
                                  device=idx.device))
        return torch.cat(out, dim=1)
