"""Decoding many requests together: one forward pass per step for every request of a batch, each with its own
sampling, seed, stop tokens and length (what the server runs for requests that arrive together).

Design choices:

* **Left padding kept apart by document ids.** Prompts of different lengths are padded on the left; the padding is
  document 0 and each request's tokens document 1 (``GPT.forward(document_ids=...)``, an id for every key under the
  KV cache), so attention and the smear never cross; rotary positions are relative, so each request's logits are
  the ones it has alone, to float rounding. Where no prompt is padded (one request, equal lengths) there are no
  ids: plain causal attention. (A padded prefill longer than one chunk runs compiled FlexAttention on the CPU:
  compiled once for the first length, once more for dynamic lengths, per process.)
* **Each request samples as it would alone**: its own ``torch.Generator`` seeded with its seed, drawing from its own
  row of logits with its own temperature, top-k and top-p (``sample_token``): the same tokens for the same seed.
* **Finished requests leave the batch**: their rows are dropped from the KV cache (``KVCache.keep``), so the step
  costs what the live requests need.
* **The context is the model's**: a batch's padded length plus its longest allowance fits ``sequence_len``; a
  request that would not fit beside the others is decoded in the next group (its own limit is the one it has alone).
* **The caller decides what ends a request besides a stop token and its length, and what is forced into it**:
  ``on_token`` sees each token and the logits it came from (stop strings, log-probabilities, streaming) and may end
  the request there, or hand back tokens to feed next instead of sampling (a chat's tool output), one per step, each
  reported through ``on_token`` too; forced tokens are bounded by the context only, as a request alone takes them.
* **A generator underneath**: :func:`decode_steps` yields after every step, so a caller can stream between steps
  (the chat engine of one request, the server's batches); :func:`generate_together` runs it to the end.
* **The server's batches** (:class:`Batcher`): one worker thread owns decoding; it takes every job waiting (after a
  short gathering wait, so requests sent together start together), decodes them as one batch and hands each its
  text through its own queue, with the token count at that piece, so a reader that stops at a stop string counts
  what it read. A job whose reader stops reading (a stop string, a closed connection) is ended at its next token;
  requests that arrive while a batch runs start with the next one (no joining mid-batch).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lapheads.errors import InputError
from lapheads.models.gpt import GPT, sample_token

__all__ = ["Batcher", "Generated", "Generation", "Job", "decode_steps", "generate_together"]

#: ``on_token(index, token, logits)``: the request's index in the call, its new token (sampled, or forced) and the
#: logits at that position (V,); returning False ends the request there ("stop"), keeping the token; a non-empty
#: list of token ids is fed next, one per step, instead of sampling; anything else continues
OnToken = Callable[[int, int, torch.Tensor], object]


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
    steps = decode_steps(model, requests, on_token)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def decode_steps(
    model: GPT, requests: Sequence[Generation], on_token: OnToken | None = None
) -> Generator[None, None, list[Generated]]:
    """:func:`generate_together` one step at a time: yields after each step's tokens were reported through
    ``on_token``; returns each request's :class:`Generated`, in order."""
    limit = model.config.sequence_len
    for i, request in enumerate(requests):
        if not request.prompt or len(request.prompt) >= limit:
            raise InputError(
                f"request {i}: a prompt of {len(request.prompt)} tokens; allowed: 1 to {limit - 1} (the model's "
                f"sequence_len {limit}, with room for one more)"
            )
    results: list[Generated | None] = [None] * len(requests)
    for group in _groups(requests, limit):
        generated = yield from _decode(model, [requests[i] for i in group], group, on_token)
        for index, one in zip(group, generated):
            results[index] = one
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


def _decode(
    model: GPT, requests: list[Generation], indices: list[int], on_token: OnToken | None
) -> Generator[None, None, list[Generated]]:
    """One group: left-padded prefill, then one token per live request per step (no autograd: a generator keeps
    the caller's grad mode between steps, so each forward says it)."""
    device = model.lm_head.weight.device
    limit = model.config.sequence_len
    width = max(len(r.prompt) for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long, device=device)
    documents = torch.zeros(len(requests), width, dtype=torch.long, device=device)  # padding: document 0
    for row, request in enumerate(requests):
        ids[row, width - len(request.prompt) :] = torch.tensor(request.prompt, device=device)
        documents[row, width - len(request.prompt) :] = 1
    generators = [torch.Generator(device).manual_seed(r.seed % 2**63) for r in requests]
    if all(len(r.prompt) == width for r in requests):
        documents = None  # no padding to keep apart: plain causal attention (one request alone, equal prompts)
    cache = model.new_kv_cache(len(requests), limit)
    with torch.no_grad():
        logits = model(ids, kv_cache=cache, document_ids=documents)[:, -1].float()
    out = [Generated([], "length") for _ in requests]
    forced: list[list[int]] = [[] for _ in requests]  # tokens to feed instead of sampling (a tool's output)
    live = list(range(len(requests)))  # the rows of the original order still generating, in cache order
    while live:
        fed, kept = [], []
        for position, row in enumerate(live):
            request, tokens = requests[row], out[row].tokens
            if cache.pos >= limit:
                continue  # the context is full: "length" (forced tokens past the group's allowance end here)
            if forced[row]:
                token = forced[row].pop(0)
            else:
                if len(tokens) >= request.max_tokens:
                    continue  # "length", after its forced tokens
                token = int(sample_token(logits[position : position + 1], request.temperature, request.top_k or None,
                                         generators[row], request.top_p))  # fmt: skip
                if token in request.stop_ids:
                    out[row].finish_reason = "stop"
                    continue
            tokens.append(token)
            said = on_token(indices[row], token, logits[position]) if on_token is not None else None
            if said is False:
                out[row].finish_reason = "stop"
                continue
            if isinstance(said, list) and said:
                forced[row] += said
            if not forced[row] and len(tokens) >= request.max_tokens:
                continue  # "length": nothing more to compute for it
            fed.append(token)
            kept.append(position)
        yield
        if not fed:
            break
        if len(kept) < len(live):  # finished requests leave the batch
            rows = torch.tensor(kept, device=device)
            cache.keep(rows)
            documents = documents[rows] if documents is not None else None
            live = [live[p] for p in kept]
        if documents is not None:
            documents = torch.cat([documents, torch.ones(len(live), 1, dtype=torch.long, device=device)], dim=1)
        step = torch.tensor(fed, device=device)[:, None]
        with torch.no_grad():
            logits = model(step, kv_cache=cache, document_ids=documents)[:, -1].float()
    return out


class Job(Protocol):
    """What the :class:`Batcher` decodes: a request (``generation``), what each new token does (``on_token``, as
    :data:`OnToken` for this one request), the text added since the last call (``pieces``) and the reply's end
    (``finish``); ``reply`` holds its tokens so far. The chat engine's :class:`lapheads.apps.chat.ChatTurn` is one."""

    generation: Generation
    reply: list[int]

    def on_token(self, index: int, token: int, logits: torch.Tensor) -> object: ...

    def pieces(self) -> Iterator[str]: ...

    def finish(self, generated: Generated) -> None: ...


@dataclass
class _Submitted:
    job: Job
    out: queue.SimpleQueue
    cancelled: bool = False


class Batcher:
    """Decodes the jobs submitted while it works, together (module docstring).

    Args:
        model: the GPT every job runs on.
        max_batch: jobs decoded together at most.
        gather_s: how long the worker waits, once a job arrived, for others sent with it.
        model_lock: held around each step (other users of the model interleave between steps).
    """

    def __init__(
        self,
        model: GPT,
        max_batch: int = 16,
        gather_s: float = 0.002,
        model_lock: AbstractContextManager | None = None,
    ) -> None:
        self.model, self.max_batch, self.gather_s = model, max_batch, gather_s
        self.model_lock = model_lock if model_lock is not None else nullcontext()
        self.waiting: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, name="lapheads-batcher", daemon=True).start()

    def submit(self, job: Job, outcome: dict[str, Any] | None = None) -> Iterator[str]:
        """The job's text, piece by piece, as the worker decodes it (blocking); ``outcome`` gains
        ``completion_tokens`` as each piece is read and ``finish_reason`` at the end. Closing the iterator early
        ends the job at its next token."""
        submitted = _Submitted(job, queue.SimpleQueue())
        self.waiting.put(submitted)
        return self._read(submitted, outcome if outcome is not None else {})

    @staticmethod
    def _read(submitted: _Submitted, outcome: dict[str, Any]) -> Iterator[str]:
        try:
            while True:
                kind, value, count = submitted.out.get()
                if kind == "error":
                    raise value
                outcome["completion_tokens"] = count
                if kind == "done":
                    outcome["finish_reason"] = value
                    return
                yield value
        finally:
            submitted.cancelled = True  # read to the end, or left early: either way nothing more is wanted

    def _work(self) -> None:
        while True:
            batch = [self.waiting.get()]
            deadline = time.monotonic() + self.gather_s
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.waiting.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            self._decode([s for s in batch if not s.cancelled])

    def _decode(self, batch: list[_Submitted]) -> None:
        if not batch:
            return

        def on_token(index: int, token: int, logits: torch.Tensor) -> object:
            submitted = batch[index]
            if submitted.cancelled:
                return False
            return submitted.job.on_token(index, token, logits)

        try:
            steps = decode_steps(self.model, [s.job.generation for s in batch], on_token)
            while True:
                try:
                    with self.model_lock:
                        next(steps)
                except StopIteration as done:
                    generated = done.value
                    break
                self._flush(batch)
            self._flush(batch)
            for submitted, one in zip(batch, generated):
                submitted.job.finish(one)
                submitted.out.put(("done", one.finish_reason, len(submitted.job.reply)))
        except Exception as err:  # noqa: BLE001 - every reader of the batch gets the error, the worker keeps going
            for submitted in batch:
                submitted.out.put(("error", err, 0))

    @staticmethod
    def _flush(batch: list[_Submitted]) -> None:
        for submitted in batch:
            for piece in submitted.job.pieces():
                submitted.out.put(("piece", piece, len(submitted.job.reply)))
