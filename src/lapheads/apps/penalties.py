"""Sampling penalties and logit biases, as OpenAI and vLLM define them: what a request may add to the model's logits
before its next token is chosen.

Design choices:

* **vLLM's order and formulas** (its V1 sampler): the request's ``logit_bias`` is added first; then the repetition
  penalty (transformers' and vLLM's: a logit of a token seen in the prompt or the output is divided by it where
  positive, multiplied where not); then OpenAI's frequency and presence penalties, on the output's tokens only
  (``logit[j] -= frequency * count[j] + presence * (count[j] > 0)``); then temperature, min-p, top-k and top-p
  (``lapheads.models.gpt.sample_rows``). Greedy rows take the argmax of the adjusted logits, as vLLM's do.
* **Log-probabilities stay the model's own**: the adjusted logits only choose the token; what a request reports
  (``logprobs``) is the model's log-softmax (vLLM's default ``raw_logprobs``).
* **The output is every token after the prompt**, a chat's forced tool output included (it is in the sequence the
  model reads; vLLM has no forced tokens).
* **Only a row that asks pays**: rows with no penalty and no bias are passed through untouched, so a server whose
  requests ask for none runs what it ran before; a penalised row costs a count of its tokens (bincount) and a few
  elementwise passes over its vocabulary row a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lapheads.errors import InputError

__all__ = ["Penalties", "penalized"]


@dataclass(frozen=True)
class Penalties:
    """What one request adds to its logits before sampling (the defaults add nothing).

    Args:
        presence: OpenAI's ``presence_penalty``: subtracted once from the logit of every token the output holds.
        frequency: OpenAI's ``frequency_penalty``: subtracted from a token's logit once per time the output holds it.
        repetition: vLLM's and transformers' ``repetition_penalty`` (1: none): a token seen in the prompt or the
            output has its logit divided by it where positive, multiplied where not.
        logit_bias: OpenAI's ``logit_bias`` as (token id, bias) pairs, added to those tokens' logits.
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.repetition > 0:  # a logit divided by 0 (or flipped in sign) is no penalty
            raise InputError(f"repetition penalty {self.repetition!r}; allowed: a number > 0 (1: none)")

    def __bool__(self) -> bool:
        """Whether these change any logit."""
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)


def penalized(
    logits: torch.Tensor,
    penalties: Sequence[Penalties],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """``logits`` (B, V) with each row's :class:`Penalties` applied, given the row's prompt and output so far; the
    input itself where no row asks for any (else a copy: the caller's logits stay the model's).

    Args:
        logits: (B, V), one row a request.
        penalties, prompts, outputs: one a row: its penalties, its prompt's ids and the ids generated after it.
    """
    rows = [row for row, asked in enumerate(penalties) if asked]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.size(-1)
    for row in rows:
        asked, line = penalties[row], out[row]  # a view: the row is adjusted in place
        if asked.logit_bias:
            ids, biases = zip(*asked.logit_bias)
            line[list(ids)] += torch.tensor(biases, dtype=line.dtype, device=line.device)
        counts = torch.bincount(torch.tensor(list(outputs[row]), dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(line.device, line.dtype)
        if asked.repetition != 1.0:
            seen = counts > 0
            seen[torch.tensor(list(prompts[row]), dtype=torch.long, device=line.device)] = True
            scaled = torch.where(line > 0, line / asked.repetition, line * asked.repetition)
            line.copy_(torch.where(seen, scaled, line))
        if asked.frequency:
            line -= asked.frequency * counts
        if asked.presence:
            line -= asked.presence * (counts > 0).to(line.dtype)
    return out
