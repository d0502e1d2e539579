"""OpenAI's legacy completions for any lapheads GPT run (``POST /v1/completions`` of ``lapheads serve``), and the
tokenizer routes vLLM offers beside it, so lm-evaluation-harness's ``local-completions`` model can score a served
base run.

Design choices:

* **A prompt is a document**: training put BOS in front of every document, so BOS goes in front of every prompt
  (unless it starts with one), as ``lapheads eval lm`` and lapheads' lm-eval model do. ``echo`` returns the prompt
  as sent, without that BOS; the prompt's first token therefore has a log-probability (given BOS), where vLLM,
  which adds nothing, reports None.
* **Token prompts and text prompts**: ``prompt`` is a string, a list of strings, a list of token ids or a list of
  such lists (lm-eval sends token lists it tokenised with ``/tokenize``); choices come prompt by prompt, ``n`` each.
* **Log-probabilities are the model's own**: the untempered log-softmax of one forward pass over prompt and
  completion, in the legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs`` as {text: logprob},
  ``text_offset``); ``max_tokens`` 0 with ``echo`` scores the prompt alone.
* **Sampling as the chat endpoint**: temperature, top_k, top_p, seed (choice i of n with seed + i), stop strings
  (the text ends before the first; finish_reason "stop"); BOS from the model ends the document ("stop").
* **Refused by name**: ``stream``, ``suffix``, ``best_of`` > 1 and penalties / biases other than their defaults.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import torch

from lapheads.data.tokenizers import Tokenizer
from lapheads.errors import LapheadsError
from lapheads.models.gpt import GPT, sample_token

__all__ = ["COMPLETION_FIELDS", "CompletionEngine", "CompletionRequest", "completion_request", "tokenize"]

#: the most alternatives per token the legacy ``logprobs`` may ask for (vLLM's limit; OpenAI's own is 5)
MAX_LOGPROBS = 20

#: the request fields of OpenAI's completions this server takes, with what it does with each
COMPLETION_FIELDS = {
    "model": "this server's one model (GET /v1/models)",
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists; BOS is put in front",
    "max_tokens": "the completion's length limit (default 16; 0 with echo scores the prompt alone)",
    "temperature": "sampling temperature (0 = greedy)",
    "top_k": "top-k sampling (an extension vLLM and llama.cpp also take)",
    "top_p": "nucleus sampling, in (0, 1]",
    "n": "1 to 8 completions per prompt, completion i sampled with seed + i",
    "seed": "the sampler's seed: a given seed reproduces, none draws a fresh one",
    "stop": "up to 4 strings: the completion ends before the first that appears (finish_reason stop)",
    "echo": "the prompt's text (and its tokens' log-probabilities) in front of the completion",
    "logprobs": f"0 to {MAX_LOGPROBS}: each token's log-probability and that many likeliest alternatives",
    "user": "an end-user id: recorded nowhere, changes nothing",
    "stream": "false only",
    "suffix": "none only",
    "best_of": "1 only",
    "frequency_penalty": "0 only",
    "presence_penalty": "0 only",
    "logit_bias": "none only",
}
_ONLY = {
    "stream": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}


class CompletionError(LapheadsError):
    """A refused completions field: the message, and the field's name for OpenAI's error object (``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class CompletionRequest:
    """A checked ``/v1/completions`` request: token prompts (BOS not yet added) and how to continue them."""

    prompts: list[list[int]]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    n: int
    seed: int
    stop: list[str]
    echo: bool
    logprobs: int | None


def _number(body: dict, name: str, default, low, high, kind=int, open_low: bool = False):
    value = body.get(name)
    value = default if value is None else value
    inside = (low < value if open_low else low <= value) and value <= high
    if isinstance(value, bool) or not isinstance(value, kind) or not inside:
        words = "an integer" if kind is int else "a number"
        span = f"{'(' if open_low else '['}{low}, {high}]"
        raise CompletionError(f"{name} {value!r}; allowed: {words} in {span}", param=name)
    return value


def _prompts(prompt: Any, tokenizer: Tokenizer) -> list[list[int]]:
    """The prompt field as token lists, each non-empty and of valid ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise CompletionError(
            f"prompt {str(prompt)[:60]!r}; allowed: a string or token ids, or a list of them", "prompt"
        )
    out = []
    for item in prompt:
        ids = tokenizer.encode(item) if isinstance(item, str) else item
        if not isinstance(ids, list) or not ids:
            raise CompletionError("an empty prompt; allowed: text or at least one token id", "prompt")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise CompletionError(
                f"prompt token {bad[0]!r}; allowed: token ids in [0, {tokenizer.vocab_size - 1}]", "prompt"
            )
        out.append(ids)
    return out


def completion_request(
    body: Any, tokenizer: Tokenizer, *, max_tokens: int, temperature: float, top_k: int, max_prompts: int = 64
) -> CompletionRequest:
    """The checked request, or a CompletionError naming the field (unknown fields are refused, as OpenAI does)."""
    if not isinstance(body, dict):
        raise CompletionError('the request is not a JSON object; allowed: {"model", "prompt": ...}')
    unknown = sorted(set(body) - set(COMPLETION_FIELDS))
    if unknown:
        raise CompletionError(
            f"unrecognized request argument {unknown[0]!r}; allowed: {', '.join(COMPLETION_FIELDS)}", unknown[0]
        )
    for field, allowed in _ONLY.items():
        if body.get(field) not in allowed:
            raise CompletionError(f"{field}={body[field]!r} is not supported on /v1/completions; allowed: "
                                  f"{COMPLETION_FIELDS[field]}", field)  # fmt: skip
    prompts = _prompts(body.get("prompt"), tokenizer)
    if len(prompts) > max_prompts:
        raise CompletionError(f"{len(prompts)} prompts; allowed: at most {max_prompts}", "prompt")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise CompletionError(f"stop {stop!r}; allowed: a string or a list of up to 4 non-empty strings", "stop")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise CompletionError(f"echo {echo!r}; allowed: true or false", "echo")
    logprobs = None if body.get("logprobs") is None else _number(body, "logprobs", 0, 0, MAX_LOGPROBS)
    return CompletionRequest(
        prompts=prompts,
        max_tokens=_number(body, "max_tokens", 16, 0 if echo else 1, max_tokens),
        temperature=_number(body, "temperature", temperature, 0.0, 2.0, (int, float)),
        top_k=_number(body, "top_k", top_k, 0, 200),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, (int, float), open_low=True),
        n=_number(body, "n", 1, 1, 8),
        # no seed: a fresh one, so repeated requests sample afresh (as vLLM, llama.cpp and Ollama do)
        seed=_number(body, "seed", secrets.randbelow(2**63), 0, 2**63 - 1),
        stop=stops,
        echo=echo,
        logprobs=logprobs,
    )


def tokenize(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """vLLM's ``/tokenize``: the text's ids, BOS first when ``add_special_tokens``. A text that is exactly one
    special token's string is that token (how lm-eval's remote tokenizer learns the end-of-text id); inside longer
    text, special-token strings stay ordinary text, as everywhere in lapheads."""
    try:
        return [tokenizer.special_id(text)]
    except LapheadsError:
        return tokenizer.encode(text, bos=add_special_tokens)


@dataclass
class CompletionEngine:
    """Completions of any GPT run (a base run has no chat tokens; a chat run's are ordinary ids here)."""

    model: GPT
    tokenizer: Tokenizer

    def _entry(self, logp: torch.Tensor, token: int, alternatives: int) -> tuple[float, dict[str, float]]:
        best = logp.topk(alternatives) if alternatives else None
        top = {} if best is None else {self.tokenizer.decode([int(i)]): float(v) for v, i in zip(*best)}
        return float(logp[token]), top

    @torch.no_grad()
    def complete(self, prompt: list[int], request: CompletionRequest, choice: int) -> dict[str, Any]:
        """One choice: {"text", "logprobs" (legacy shape or None), "finish_reason", "completion_tokens"}."""
        model, tok, limit = self.model, self.tokenizer, self.model.config.sequence_len
        ids = prompt if prompt[0] == tok.bos_id else [tok.bos_id, *prompt]
        if len(ids) + (request.max_tokens > 0) > limit:
            raise CompletionError(
                f"the prompt has {len(ids)} tokens with BOS; allowed: at most {limit - 1} with room for one more "
                f"(the model's sequence_len {limit})",
                "prompt",
            )
        device = model.lm_head.weight.device
        generator = torch.Generator(device).manual_seed((request.seed + choice) % 2**63)
        cache = model.new_kv_cache(1, limit)
        logits = model(torch.tensor([ids], device=device), kv_cache=cache)[0].float()
        entries: list[tuple[int, float | None, dict[str, float]]] = []  # (token, logprob, alternatives)
        if request.echo:
            skipped = len(ids) - len(prompt)  # the BOS lapheads put in front: not the user's, not reported
            for position in range(skipped, len(ids)):
                if position == 0:  # the prompt's own BOS: nothing before it
                    entries.append((ids[0], None, {}))
                    continue
                logp = logits[position - 1].log_softmax(-1)
                entries.append((ids[position], *self._entry(logp, ids[position], request.logprobs or 0)))
        completion: list[int] = []
        finish, last = "length", logits[-1]
        while len(completion) < request.max_tokens and cache.pos < limit:
            token = int(sample_token(last[None], request.temperature, request.top_k or None, generator, request.top_p))
            if token == tok.bos_id:  # the model ended the document
                finish = "stop"
                break
            entries.append((token, *self._entry(last.log_softmax(-1), token, request.logprobs or 0)))
            completion.append(token)
            text = tok.decode(completion)
            if any(stop in text for stop in request.stop):
                finish = "stop"
                break
            if cache.pos >= limit:
                break
            last = model(torch.tensor([[token]], device=device), kv_cache=cache)[0, -1].float()
        prompt_text = tok.decode(prompt) if request.echo else ""
        text = tok.decode(completion)
        cut = min([text.index(s) for s in request.stop if s in text] or [len(text)])
        full = prompt_text + text[:cut]
        reported = len(full) if cut < len(text) else None  # a stop string's tokens are not reported
        return {
            "text": full,
            "logprobs": None if request.logprobs is None else _legacy_logprobs(tok, entries, reported),
            "finish_reason": finish,
            "completion_tokens": len(completion),
        }


def _legacy_logprobs(tok: Tokenizer, entries: list, chars: int | None) -> dict[str, list]:
    """OpenAI's legacy logprobs object for every token, or (``chars``: the text was cut at a stop string) for those
    whose text begins within its first ``chars`` characters."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, logprob, top in entries:
        if chars is not None and offset >= chars:
            break
        piece = tok.decode([token])
        out["tokens"].append(piece)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top or None)
        out["text_offset"].append(offset)
        offset += len(piece)
    return out
