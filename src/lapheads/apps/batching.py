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
* **A batch one can join** (:class:`Decoding`): a step is ``sample`` (each live request's next token) then
  ``advance`` (the forward pass); between them requests join, each prefilled so that its prompt ends where the batch
  is, after padding of document 0, and its cache rows appended (``KVCache.join``). A request joins only where it
  can generate all it would alone (its prompt no longer than the batch so far, its allowance within the context).
  :func:`decode_steps` yields after every step, so a caller can stream between steps (the chat engine of one
  request); :func:`generate_together` runs it to the end.
* **The server's batches** (:class:`Batcher`): one worker thread owns decoding; it takes every job waiting (after a
  short gathering wait, so requests sent together start together) and decodes them as one batch; a job that arrives
  while it runs joins at the next step (continuous batching, as vLLM's scheduler), up to ``max_batch``, in arrival
  order: the first that cannot join, and every job after it, start the next batch. Each job gets its text through
  its own queue, with the token count at that piece, so a reader that stops at a stop string counts what it read,
  and its end as soon as it ends. A job whose reader stops reading (a stop string, a closed connection) is ended at
  its next token.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lapheads.errors import InputError
from lapheads.models.gpt import GPT, sample_token

__all__ = ["Batcher", "Decoding", "Generated", "Generation", "Job", "decode_steps", "generate_together"]

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
        _check_prompt(request, limit, f"request {i}")
    results: list[Generated | None] = [None] * len(requests)
    for group in _groups(requests, limit):
        decoding = Decoding(model, [(i, requests[i]) for i in group], on_token)
        while True:
            for index, generated in decoding.sample():
                results[index] = generated
            yield
            if not decoding.live:
                break
            decoding.advance()
    return results  # type: ignore[return-value]


def _check_prompt(request: Generation, limit: int, name: str) -> None:
    """Refuse a prompt that leaves no room for one more token in the model's context, in one line."""
    if not request.prompt or len(request.prompt) >= limit:
        raise InputError(
            f"{name}: a prompt of {len(request.prompt)} tokens; allowed: 1 to {limit - 1} (the model's "
            f"sequence_len {limit}, with room for one more)"
        )


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


@dataclass
class _Row:
    """One request in a batch: the caller's index for it, what it generated, the tokens forced next, its generator."""

    index: int
    request: Generation
    generator: torch.Generator
    out: Generated = field(default_factory=lambda: Generated([], "length"))
    forced: list[int] = field(default_factory=list)


class Decoding:
    """A batch in flight: one forward per step for every live request, and requests that join it between steps.

    The first requests are prefilled together, left-padded; each later one (:meth:`join`) is prefilled where its
    prompt ends at the batch's current position, after padding of document 0, and its cache rows are appended to the
    batch's (``KVCache.join``): its logits are the ones it has alone, as a padded row's are. A step is
    :meth:`sample` (each live request's next token, reported through ``on_token``; returns the requests that ended)
    and then :meth:`advance` (the forward pass on the tokens fed). No autograd: a generator around it keeps the
    caller's grad mode between steps, so each forward says it.

    Args:
        model: the GPT.
        requests: (the caller's index, request) of the first requests; together they fit the context
            (:func:`_groups`).
        on_token: :data:`OnToken`, called with the caller's index.
    """

    def __init__(self, model: GPT, requests: Sequence[tuple[int, Generation]], on_token: OnToken | None = None) -> None:
        self.model, self.on_token = model, on_token
        self.device = model.lm_head.weight.device
        self.limit = model.config.sequence_len
        self.rows: list[_Row] = []  # the live requests, in cache order
        self.cache, self.documents, self.logits = self._prefill([request for _, request in requests], 0)
        self.rows = [self._row(index, request) for index, request in requests]
        self.fed: list[int] = []  # the tokens sample() chose to feed, in cache order

    def _row(self, index: int, request: Generation) -> _Row:
        return _Row(index, request, torch.Generator(self.device).manual_seed(request.seed % 2**63))

    def _prefill(self, requests: list[Generation], end: int):
        """(cache, document ids or None, last logits) of ``requests`` prefilled left-padded so that every prompt
        ends at position ``end`` (0: at the longest prompt's length)."""
        width = max(len(r.prompt) for r in requests)
        end = end or width
        ids = torch.zeros(len(requests), width, dtype=torch.long, device=self.device)
        documents = torch.zeros(len(requests), end, dtype=torch.long, device=self.device)  # padding: document 0
        for row, request in enumerate(requests):
            ids[row, width - len(request.prompt) :] = torch.tensor(request.prompt, device=self.device)
            documents[row, end - len(request.prompt) :] = 1
        if end == width and all(len(r.prompt) == width for r in requests):
            documents = None  # no padding to keep apart: plain causal attention (one request alone, equal prompts)
        cache = self.model.new_kv_cache(len(requests), self.limit)
        cache.pos = end - width  # the keys before stay zero, document 0: never attended
        with torch.no_grad():
            logits = self.model(ids, kv_cache=cache, document_ids=documents)[:, -1].float()
        return cache, documents, logits

    @property
    def live(self) -> list[int]:
        """The caller's indices of the requests still generating."""
        return [row.index for row in self.rows]

    def can_join(self, request: Generation) -> bool:
        """Whether ``request`` can join now and still generate all it would alone: its prompt fits before the
        batch's position, and its allowance after it."""
        position = self.cache.pos
        return len(request.prompt) <= position and position + _allowance(request, self.limit) <= self.limit

    def join(self, requests: Sequence[tuple[int, Generation]]) -> None:
        """Add ``requests`` (each :meth:`can_join`) to the batch, between an :meth:`advance` and the next
        :meth:`sample`."""
        position = self.cache.pos
        cache, documents, logits = self._prefill([request for _, request in requests], position)
        self.cache.join(cache)
        if documents is None:  # the newcomers' prompts fill the batch's whole length
            documents = torch.ones(len(requests), position, dtype=torch.long, device=self.device)
        if self.documents is None:  # the batch had no padding; it has now
            self.documents = torch.ones(len(self.rows), position, dtype=torch.long, device=self.device)
        self.documents = torch.cat([self.documents, documents])
        self.logits = torch.cat([self.logits, logits])
        self.rows += [self._row(index, request) for index, request in requests]

    def sample(self) -> list[tuple[int, Generated]]:
        """Each live request's next token (forced, else sampled), reported through ``on_token``; returns (index,
        :class:`Generated`) of the requests that ended at this step; the others' tokens are fed by :meth:`advance`."""
        fed, kept, ended = [], [], []
        for position, row in enumerate(self.rows):
            request, tokens = row.request, row.out.tokens
            if self.cache.pos >= self.limit:
                ended.append(row)  # the context is full: "length" (forced tokens past the allowance end here)
                continue
            if row.forced:
                token = row.forced.pop(0)
            else:
                if len(tokens) >= request.max_tokens:
                    ended.append(row)  # "length", after its forced tokens
                    continue
                logits = self.logits[position : position + 1]
                token = int(sample_token(logits, request.temperature, request.top_k or None, row.generator,
                                         request.top_p))  # fmt: skip
                if token in request.stop_ids:
                    row.out.finish_reason = "stop"
                    ended.append(row)
                    continue
            tokens.append(token)
            said = self.on_token(row.index, token, self.logits[position]) if self.on_token is not None else None
            if said is False:
                row.out.finish_reason = "stop"
                ended.append(row)
                continue
            if isinstance(said, list) and said:
                row.forced += said
            if not row.forced and len(tokens) >= request.max_tokens:
                ended.append(row)  # "length": nothing more to compute for it
                continue
            fed.append(token)
            kept.append(position)
        if not kept:  # every request ended: the batch is done (nothing to keep)
            self.rows = []
        elif len(kept) < len(self.rows):  # ended requests leave the batch
            rows = torch.tensor(kept, dtype=torch.long, device=self.device)
            self.cache.keep(rows)
            self.documents = self.documents[rows] if self.documents is not None else None
            self.rows = [self.rows[p] for p in kept]
        self.fed = fed
        return [(row.index, row.out) for row in ended]

    def advance(self) -> None:
        """The forward pass on the tokens :meth:`sample` fed: every live request's logits one step on."""
        if self.documents is not None:
            ones = torch.ones(len(self.rows), 1, dtype=torch.long, device=self.device)
            self.documents = torch.cat([self.documents, ones], dim=1)
        step = torch.tensor(self.fed, device=self.device)[:, None]
        with torch.no_grad():
            self.logits = self.model(step, kv_cache=self.cache, document_ids=self.documents)[:, -1].float()


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
        ends the job at its next token. A prompt that leaves no room is refused here, in one line (not in the
        batch it would have joined)."""
        _check_prompt(job.generation, self.model.config.sequence_len, "the request")  # refused alone, not its batch
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
        held: list[_Submitted] = []  # jobs that could not join the batch in flight: they start the next one
        while True:
            batch = held or [self.waiting.get()]
            deadline = time.monotonic() + self.gather_s
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.waiting.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            held = self._decode([s for s in batch if not s.cancelled])

    def _decode(self, batch: list[_Submitted]) -> list[_Submitted]:
        """Decode ``batch`` (those of it that fit the context together) and every job that can join it while it
        runs; returns the jobs left for the next batch."""
        if not batch:
            return []
        limit = self.model.config.sequence_len
        jobs: dict[int, _Submitted] = {}  # the index of a request in the batch -> its job (never reused)
        first, *rest = _groups([s.job.generation for s in batch], limit)
        held = [batch[i] for group in rest for i in group]

        def on_token(index: int, token: int, logits: torch.Tensor) -> object:
            submitted = jobs[index]
            if submitted.cancelled:
                return False
            return submitted.job.on_token(index, token, logits)

        try:
            jobs.update({n: batch[i] for n, i in enumerate(first)})
            joined = len(first)  # the next index to give a job that joins
            with self.model_lock:
                decoding = Decoding(self.model, [(n, batch[i].job.generation) for n, i in enumerate(first)], on_token)
            while True:
                with self.model_lock:
                    ended = decoding.sample()
                self._flush(jobs.values())
                for index, generated in ended:
                    self._finish(jobs.pop(index), generated)
                if not decoding.live:
                    return held
                with self.model_lock:
                    decoding.advance()
                joining = self._joining(decoding, len(jobs), held)
                if joining:
                    start, joined = joined, joined + len(joining)
                    jobs.update({start + n: submitted for n, submitted in enumerate(joining)})
                    with self.model_lock:
                        decoding.join([(start + n, s.job.generation) for n, s in enumerate(joining)])
        except Exception as err:  # noqa: BLE001 - every reader of the batch gets the error, the worker keeps going
            for submitted in jobs.values():
                submitted.out.put(("error", err, 0))
            return held

    def _joining(self, decoding: Decoding, running: int, held: list[_Submitted]) -> list[_Submitted]:
        """The waiting jobs that join the batch in flight now, in arrival order, up to ``max_batch`` running; the
        first that cannot join (its prompt longer than the batch's position, or its allowance past the context)
        and every job after it wait for the next batch (``held``), so none overtakes an earlier one."""
        joining: list[_Submitted] = []
        while not held and running + len(joining) < self.max_batch:
            try:
                submitted = self.waiting.get_nowait()
            except queue.Empty:
                break
            if submitted.cancelled:
                continue
            if decoding.can_join(submitted.job.generation):
                joining.append(submitted)
            else:
                held.append(submitted)
        return joining

    @staticmethod
    def _finish(submitted: _Submitted, generated: Generated) -> None:
        submitted.job.finish(generated)
        submitted.out.put(("done", generated.finish_reason, len(submitted.job.reply)))

    @staticmethod
    def _flush(batch: Iterable[_Submitted]) -> None:
        for submitted in batch:
            for piece in submitted.job.pieces():
                submitted.out.put(("piece", piece, len(submitted.job.reply)))
