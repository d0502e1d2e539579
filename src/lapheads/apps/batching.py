"""Decoding many requests together: one forward pass per step for every request of a batch, each with its own
sampling, seed, stop tokens and length (what the server runs for requests that arrive together).

Design choices:

* **Left padding kept apart by document ids.** Prompts of different lengths are padded on the left; the padding is
  document 0 and each request's tokens document 1 (``GPT.forward(document_ids=...)``, an id for every key under the
  KV cache), so attention and the smear never cross; rotary positions are relative, so each request's logits are
  the ones it has alone, to float rounding.
* **Each request samples as it would alone**: its own ``torch.Generator`` seeded with its seed, drawing from its own
  row of logits with its own temperature, top-k and top-p (``sample_token``): the same tokens for the same seed.
* **Finished requests leave the batch**: their rows are dropped from the KV cache (``KVCache.keep``), so the step
  costs what the live requests need.
* **The context is the model's**: a batch's padded length plus its longest allowance fits ``sequence_len``; a
  request that would not fit beside the others is decoded in the next group (its own limit is the one it has alone).
* **The caller decides what ends a request besides a stop token and its length**: ``on_token`` sees each sampled
  token and its logits (stop strings, log-probabilities, streaming) and may end it there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lapheads.errors import InputError
from lapheads.models.gpt import GPT, sample_token

__all__ = ["Generated", "Generation", "generate_together"]

#: ``on_token(index, token, logits)``: the request's index in the call, the token sampled and the logits it was drawn
#: from (V,); returning False ends the request there ("stop"), keeping the token
OnToken = Callable[[int, int, torch.Tensor], bool]


@dataclass(frozen=True)
class Generation:
    """One request to continue.

    Args:
        prompt: the ids fed first (BOS included where the caller wants one).
        max_tokens: tokens to generate at most.
        temperature, top_k, top_p: sampling (``sample_token``; temperature 0: greedy).
        seed: the request's own generator seed.
        stop_ids: tokens that end the request when sampled (not kept: an end-of-turn or BOS).
    """

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_ids: frozenset[int] = field(default_factory=frozenset)


@dataclass
class Generated:
    """What a request generated: its tokens and why it ended ("stop": a stop token or ``on_token``; "length": its
    ``max_tokens`` or the context)."""

    tokens: list[int]
    finish_reason: str


def generate_together(model: GPT, requests: Sequence[Generation], on_token: OnToken | None = None) -> list[Generated]:
    """Decode ``requests`` together, one forward per step for all that are still generating; returns each one's
    :class:`Generated`, in order."""
    limit = model.config.sequence_len
    for i, request in enumerate(requests):
        if not request.prompt or len(request.prompt) >= limit:
            raise InputError(
                f"request {i}: a prompt of {len(request.prompt)} tokens; allowed: 1 to {limit - 1} (the model's "
                f"sequence_len {limit}, with room for one more)"
            )
    results: list[Generated | None] = [None] * len(requests)
    for group in _groups(requests, limit):
        for index, generated in zip(group, _decode(model, [requests[i] for i in group], group, on_token)):
            results[index] = generated
    return results  # type: ignore[return-value]


def _allowance(request: Generation, limit: int) -> int:
    """The tokens ``request`` may generate alone: its max_tokens, or what its context leaves."""
    return min(request.max_tokens, limit - len(request.prompt))


def _groups(requests: Sequence[Generation], limit: int) -> list[list[int]]:
    """Requests in groups whose padded prompt length plus longest allowance fits the context, in order."""
    groups: list[list[int]] = []
    for i, request in enumerate(requests):
        for group in groups:
            longest = max(len(request.prompt), *(len(requests[j].prompt) for j in group))
            allowance = max(_allowance(request, limit), *(_allowance(requests[j], limit) for j in group))
            if longest + allowance <= limit:
                group.append(i)
                break
        else:
            groups.append([i])
    return groups


@torch.no_grad()
def _decode(model: GPT, requests: list[Generation], indices: list[int], on_token: OnToken | None) -> list[Generated]:
    """One group: left-padded prefill, then one token per live request per step."""
    device = model.lm_head.weight.device
    limit = model.config.sequence_len
    width = max(len(r.prompt) for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long, device=device)
    documents = torch.zeros(len(requests), width, dtype=torch.long, device=device)  # padding: document 0
    for row, request in enumerate(requests):
        ids[row, width - len(request.prompt) :] = torch.tensor(request.prompt, device=device)
        documents[row, width - len(request.prompt) :] = 1
    generators = [torch.Generator(device).manual_seed(r.seed % 2**63) for r in requests]
    cache = model.new_kv_cache(len(requests), limit)
    logits = model(ids, kv_cache=cache, document_ids=documents)[:, -1].float()
    out = [Generated([], "length") for _ in requests]
    live = list(range(len(requests)))  # the rows of the original order still generating, in cache order
    while live:
        fed, kept = [], []
        for position, row in enumerate(live):
            request = requests[row]
            token = int(sample_token(logits[position : position + 1], request.temperature, request.top_k or None,
                                     generators[row], request.top_p))  # fmt: skip
            if token in request.stop_ids:
                out[row].finish_reason = "stop"
                continue
            out[row].tokens.append(token)
            if on_token is not None and on_token(indices[row], token, logits[position]) is False:
                out[row].finish_reason = "stop"
                continue
            if len(out[row].tokens) >= _allowance(request, limit):
                continue  # "length": nothing more to compute for it
            fed.append(token)
            kept.append(position)
        if not fed:
            break
        if len(kept) < len(live):  # finished requests leave the batch
            rows = torch.tensor(kept, device=device)
            cache.keep(rows)
            documents = documents[rows]
            live = [live[p] for p in kept]
        documents = torch.cat([documents, torch.ones(len(live), 1, dtype=torch.long, device=device)], dim=1)
        step = torch.tensor(fed, device=device)[:, None]
        logits = model(step, kv_cache=cache, document_ids=documents)[:, -1].float()
    return out
