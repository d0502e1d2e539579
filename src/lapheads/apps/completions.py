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
* **Sampling as the chat endpoint**: temperature, top_k, top_p, min_p, seed (choice i of n with seed + i), stop strings
  (the text ends before the first; finish_reason "stop"), logit biases and penalties, and vLLM's stop_token_ids,
  ignore_eos and min_tokens; BOS from the model ends the document ("stop"; not with ignore_eos).
* **Streamed as vLLM streams it** (``stream``): text_completion chunks, choice after choice (every choice decodes
  together; the later ones' text waits in their queues), each with the text decoded since the last (a stop string
  and what may begin one held back) and, with ``logprobs``, the legacy entries of the tokens that text completes;
  an echoed prompt is a choice's first chunk; then each choice's finish_reason, the usage (``stream_options``) and
  ``[DONE]``. The chunks' texts and entries join to the object a request without ``stream`` gets.
* **Refused by name**: ``suffix`` and ``best_of`` > 1, and any field the schema does not name.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lapheads.apps.batching import Generated, Generation, Stopping
from lapheads.apps.detokenize import IncrementalText, completed_pieces, first_stop
from lapheads.apps.penalties import Penalties
from lapheads.apps.schema import (
    PENALTY_FIELDS,
    STOPPING_FIELDS,
    CompletionBody,
    RequestError,
    requested_penalties,
    requested_stopping,
    validated,
)
from lapheads.data.tokenizers import Tokenizer
from lapheads.errors import LapheadsError
from lapheads.models.gpt import GPT

__all__ = ["CompletionEngine", "CompletionJob", "CompletionRequest", "completion_request", "tokenize"]


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
    stream: bool = False
    include_usage: bool = False  # with stream: a last chunk with the usage
    penalties: Penalties = Penalties()  # logit biases and penalties (none by default)
    stopping: Stopping = Stopping()  # vLLM's stop_token_ids, ignore_eos and min_tokens (none by default)
    min_p: float | None = None  # min-p sampling (none by default)
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string that ended the text is shown


def _prompts(prompt: str | list, tokenizer: Tokenizer) -> list[list[int]]:
    """The prompt field (typed by :class:`lapheads.apps.schema.CompletionBody`) as token lists, each non-empty and of
    ids the model has."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):  # one text, or one list of ids
        prompt = [prompt]
    if not prompt:
        raise RequestError("prompt []; allowed: a string or token ids, or a non-empty list of them", "prompt")
    out = [tokenizer.encode(item) if isinstance(item, str) else item for item in prompt]
    for ids in out:
        if not ids:
            raise RequestError("an empty prompt; allowed: text or at least one token id", "prompt")
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise RequestError(
                f"prompt token {bad[0]}; allowed: token ids in [0, {tokenizer.vocab_size - 1}]", "prompt"
            )
    return out


def completion_request(
    body: Any, tokenizer: Tokenizer, *, max_tokens: int, temperature: float, top_k: int, max_prompts: int = 64
) -> CompletionRequest:
    """The checked request (:class:`lapheads.apps.schema.CompletionBody`, then the bounds this server sets), or a
    RequestError naming the field."""
    request = validated(CompletionBody, body).checked()
    prompts = _prompts(request.prompt, tokenizer)
    if len(prompts) > max_prompts:
        raise RequestError(f"{len(prompts)} prompts; allowed: at most {max_prompts}", "prompt")
    echo = bool(request.echo)
    limit = 16 if request.max_tokens is None else request.max_tokens
    if not (0 if echo else 1) <= limit <= max_tokens:
        raise RequestError(
            f"max_tokens {limit}; allowed: an integer in [{0 if echo else 1}, {max_tokens}]", "max_tokens"
        )
    stop = request.stop or []
    return CompletionRequest(
        prompts=prompts,
        max_tokens=limit,
        temperature=temperature if request.temperature is None else request.temperature,
        top_k=top_k if request.top_k is None else request.top_k,
        top_p=1.0 if request.top_p is None else request.top_p,
        n=request.n or 1,
        # no seed: a fresh one, so repeated requests sample afresh (as vLLM, llama.cpp and Ollama do)
        seed=secrets.randbelow(2**63) if request.seed is None else request.seed,
        stop=[stop] if isinstance(stop, str) else stop,
        echo=echo,
        logprobs=request.logprobs,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        penalties=requested_penalties(request.model_dump(include=set(PENALTY_FIELDS)), tokenizer.vocab_size),
        stopping=requested_stopping(request.model_dump(include=set(STOPPING_FIELDS)), tokenizer, limit),
        min_p=request.min_p,
        include_stop=bool(request.include_stop_str_in_output),
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
        top = {} if best is None else {self._alternative(int(i)): float(v) for v, i in zip(*best)}
        return float(logp[token]), top

    def _alternative(self, token: int) -> str:
        """An alternative's key in ``top_logprobs``: its text, or where it is not whole characters (a byte of a
        split character, which decodes to U+FFFD) OpenAI's ``bytes:\\xe2...`` form, so byte tokens stay apart."""
        text = self.tokenizer.decode([token])
        if "\ufffd" not in text:
            return text
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.tokenizer.piece_bytes(token))

    def check_fits(self, request: CompletionRequest) -> None:
        """Every prompt fits the model's context with room for one more token, checked before any is generated: one
        too-long prompt among 64 was refused only after the others' generation (6.8 s, issue 76)."""
        limit = self.model.config.sequence_len
        for i, prompt in enumerate(request.prompts):
            ids = len(prompt) + (prompt[0] != self.tokenizer.bos_id)  # BOS put in front where it is not
            if ids + (request.max_tokens > 0) > limit:
                raise RequestError(
                    f"prompt {i} has {ids} tokens with BOS; allowed: at most {limit - 1} with room for one more "
                    f"(the model's sequence_len {limit})",
                    "prompt",
                )

    def job(self, prompt: list[int], request: CompletionRequest, choice: int) -> CompletionJob:
        """One choice to decode (by the server's batcher, with the requests beside it; alone:
        ``generate_together(model, [job.generation], job.on_token)``); the prompt fits (:meth:`check_fits`). With
        ``echo``, the prompt's own log-probabilities come from one forward here."""
        tok = self.tokenizer
        ids = prompt if prompt[0] == tok.bos_id else [tok.bos_id, *prompt]
        generation = Generation(tuple(ids), request.max_tokens, request.temperature, request.top_k or None,
                                request.top_p, (request.seed + choice) % 2**63, frozenset({tok.bos_id}),
                                request.penalties, request.stopping, request.min_p)  # fmt: skip
        job = CompletionJob(self, generation, request, prompt)
        if request.echo:
            job.entries = self._prompt_entries(ids, len(ids) - len(prompt), request.logprobs or 0)
        return job

    @torch.no_grad()
    def _prompt_entries(self, ids: list[int], skipped: int, alternatives: int) -> list[tuple]:
        """(token, logprob, alternatives) of each prompt token the user sent (not the BOS lapheads put in front);
        the prompt's own BOS has nothing before it."""
        device = self.model.lm_head.weight.device
        logits = self.model(torch.tensor([ids], device=device))[0].float()
        entries: list[tuple] = []
        for position in range(skipped, len(ids)):
            if position == 0:
                entries.append((ids[0], None, {}))
                continue
            logp = logits[position - 1].log_softmax(-1)
            entries.append((ids[position], *self._entry(logp, ids[position], alternatives)))
        return entries


@dataclass
class CompletionJob:
    """One completion choice being decoded: its tokens (``reply``), their log-probabilities, the text each token
    completes, and what ends it (BOS from the model, a stop string in the text, its length); :meth:`result` is the
    choice in OpenAI's shape, :meth:`pieces` its text as it is decoded (for a stream)."""

    engine: CompletionEngine
    generation: Generation
    request: CompletionRequest
    prompt: list[int]
    reply: list[int] = field(default_factory=list)
    entries: list[tuple] = field(default_factory=list)  # (token, logprob, alternatives), the echoed prompt's first
    finish_reason: str = "length"
    stop_reason: int | None = None  # vLLM's: the request's own stop token that ended it

    def __post_init__(self) -> None:
        decode = self.engine.tokenizer.decode
        self.text = IncrementalText(decode)  # the reply's text so far, for the stop strings and the stream
        self.unread = ""  # the text of the tokens since the last piece
        self.floor = 0  # the characters the first min_tokens tokens wrote: no stop string ends in them (vLLM)
        # the text each entry completes ("" for a split character's first bytes): they join to the choice's text
        self.texts: list[str] = completed_pieces(decode, self.prompt) if self.request.echo else []

    def on_token(self, index: int, token: int, logits: torch.Tensor) -> bool:
        """Record the token; False (end here) once the text holds a stop string (one that ends past the first
        ``min_tokens`` tokens' text)."""
        self.entries.append((token, *self.engine._entry(logits.log_softmax(-1), token, self.request.logprobs or 0)))
        self.reply.append(token)
        new = self.text.add(token)
        self.texts.append(new)
        self.unread += new
        if len(self.reply) <= self.generation.stopping.min_tokens:
            self.floor = len(self.text.text)
            return True
        return not self.text.completes_stop(new, self.request.stop)

    def pieces(self) -> Iterator[str]:
        """The text added since the last piece (none while a character is still incomplete)."""
        if self.unread:
            yield self.unread
            self.unread = ""

    def finish(self, generated: Generated) -> None:
        """The choice ended: its held-back text (a character cut short) becomes the last piece."""
        rest = self.text.flush()
        if rest:
            self.texts[-1] += rest
            self.unread += rest
        self.finish_reason, self.stop_reason = generated.finish_reason, generated.stop_reason

    def result(self) -> dict[str, Any]:
        tok, request = self.engine.tokenizer, self.request
        prompt_text = tok.decode(self.prompt) if request.echo else ""
        text = tok.decode(self.reply)
        found = first_stop(text, request.stop, self.floor)
        cut = len(text) if found is None else found[1] if request.include_stop else found[0]
        full = prompt_text + text[:cut]
        reported = len(full) if cut < len(text) else None  # a stop string's tokens are not reported
        return {
            "text": full,
            "logprobs": None if request.logprobs is None else self.logprobs(0, 0, reported, begun=True)[0],
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason if found is None else text[found[0] : found[1]],
            "completion_tokens": len(self.reply),
        }

    def logprobs(self, start: int, offset: int, chars: int | None, begun: bool) -> tuple[dict[str, list], int, int]:
        """OpenAI's legacy logprobs object for the entries from the ``start``-th (whose text begins at ``offset``
        characters into the choice's text) whose text ends (``begun``: begins) within the choice's first ``chars``
        characters (None: all); with the next entry's index and offset. A token's text is what it completes (the
        texts join to the choice's; the offsets count characters)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for (_, logprob, top), piece in zip(self.entries[start:], self.texts[start:]):
            if chars is not None and (offset >= chars if begun else offset + len(piece) > chars):
                break
            out["tokens"].append(piece)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top or None)
            out["text_offset"].append(offset)
            offset += len(piece)
            start += 1
        return out, start, offset
