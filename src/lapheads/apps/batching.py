"""Decoding many requests together: one forward pass per step for every request of a batch, each with its own
sampling, seed, stop tokens and length (what the server runs for requests that arrive together).

Design choices:

* **Each request at its own positions** (vLLM's sequences, without pages): prompts are prefilled together
  right-padded (``GPT.prefill``: causal attention never looks ahead), and every row of the KV cache holds its own
  length; a step writes each row's token at its own position, with its own rotary angle, and each row attends to its
  own positions only (``KVCache.attended``, a documents pattern). So each request's logits are the ones it has
  alone, to float rounding, no request waits for another's length, and a step's keys are the longest row's, not a
  padded batch's. Where every row holds the same length (one request alone) it is plain causal attention.
* **Each request samples as it would alone**: its own ``torch.Generator`` seeded with its seed, drawing from its own
  row of logits with its own temperature, top-k and top-p (``sample_rows``: ``sample_token`` for every row at
  once): the same tokens for the same seed. A request's logit biases and penalties adjust its own row first
  (:mod:`lapheads.apps.penalties`, vLLM's order), from its own prompt and output, and its ``min_tokens`` masks the
  tokens that would end it too early (:class:`Stopping`).
* **Each request ends as vLLM's would**: at one of the model's stop tokens (not kept; not with ``ignore_eos``), at
  one of its own ``stop_token_ids`` (kept where it is text, not where it is a special token), at its length, or
  where the caller says (a stop string).
* **Finished requests leave the batch**: their rows are dropped from the KV cache (``KVCache.keep``), so the step
  costs what the live requests need.
* **Each request's context is its own**: a row ends at the model's ``sequence_len`` as it does alone, whatever
  the others hold, so any requests can be decoded together.
* **The caller decides what ends a request besides a stop token and its length, and what is forced into it**:
  ``on_token`` sees each token and the logits it came from (stop strings, log-probabilities, streaming) and may end
  the request there, or hand back tokens to feed next instead of sampling (a chat's tool output), one per step, each
  reported through ``on_token`` too; forced tokens are bounded by the context only, as a request alone takes them.
* **A batch one can join** (:class:`Decoding`): a step is ``sample`` (each live request's next token) then
  ``advance`` (the forward pass); between them requests join, prefilled together and their cache rows appended
  (``KVCache.join``), whatever their lengths and the batch's. :func:`decode_steps` yields after every step, so a
  caller can stream between steps (the chat engine of one request); :func:`generate_together` runs it to the end.
* **The server's batches** (:class:`Batcher`): one worker thread owns decoding; it takes every job waiting (after a
  short gathering wait, so requests sent together start together) and decodes them as one batch; a job that arrives
  while it runs joins it (continuous batching, as vLLM's scheduler), up to ``max_batch``, in arrival order: it is
  prefilled on a second thread while the batch goes on decoding, and attached at the first step after (a prefill
  of a long prompt would otherwise stall every reply in the batch). Each job gets its text through its own queue,
  with the token count at that piece, so a reader that stops at a stop string counts what it read, and its end as
  soon as it ends. A job whose reader stops reading (a stop string, a closed connection) is ended at its next
  token. What it did is counted as vLLM counts it (:class:`lapheads.apps.metrics.ServingMetrics`: queue time, time
  to first token, inter-token latency, tokens per forward), with the time of each phase (decode, sample, prefill,
  a joiner's prefill) beside it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lapheads.apps.penalties import Penalties, penalized
from lapheads.errors import InputError
from lapheads.models.gpt import GPT, KVCache, sample_rows

if TYPE_CHECKING:  # prometheus_client is the 'serve' extra's; lm-eval and generate use this module without it
    from lapheads.apps.metrics import RequestClock, ServingMetrics

__all__ = [
    "Batcher",
    "Decoding",
    "Generated",
    "Generation",
    "Job",
    "Stopping",
    "decode_steps",
    "generate_together",
    "prefilled",
]

#: ``on_token(index, token, logits)``: the request's index in the call, its new token (sampled, or forced) and the
#: logits at that position (V,); returning False ends the request there ("stop"), keeping the token; a non-empty
#: list of token ids is fed next, one per step, instead of sampling; anything else continues
OnToken = Callable[[int, int, torch.Tensor], object]


@dataclass(frozen=True)
class Stopping:
    """How a request may end besides its length, beyond its model's own stop tokens: vLLM's ``stop_token_ids``,
    ``ignore_eos`` and ``min_tokens`` (its defaults change nothing).

    Args:
        kept_ids: tokens that end the request when sampled and are kept as its last (vLLM's ``stop_token_ids`` that
            are ordinary tokens: their text ends the reply).
        unkept_ids: tokens that end it and are not kept (``stop_token_ids`` that are special tokens, whose text
            vLLM's reply skips, as the model's own end tokens).
        ignore_eos: the model's own stop tokens (``Generation.stop_ids``) do not end the request: it runs to its
            length (what a serving benchmark asks for, so every request generates as many tokens as it says).
        min_tokens: before the request holds this many tokens, no token that would end it can be sampled (their
            logits are -inf, vLLM's ``MinTokensLogitsProcessor``); stop strings before then are the caller's to
            pass over (vLLM looks for them only in the text of later tokens).
    """

    kept_ids: frozenset[int] = frozenset()
    unkept_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(frozen=True)
class Generation:
    """One request to continue.

    Args:
        prompt: the ids fed first (BOS included where the caller wants one).
        max_tokens: tokens to generate at most.
        temperature, top_k, top_p: sampling (``sample_token``; temperature 0: greedy).
        min_p: min-p sampling (``sample_token``, vLLM's: at the temperature, before top-k and top-p; None: none).
        seed: the request's own generator seed.
        stop_ids: tokens that end the request when sampled (not kept: an end-of-turn or BOS).
        penalties: what the request adds to its logits before sampling (:mod:`lapheads.apps.penalties`: logit
            biases, repetition, frequency and presence penalties; none by default).
        stopping: the request's own stop tokens, ``ignore_eos`` and ``min_tokens`` (:class:`Stopping`; none by
            default).
    """

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    penalties: Penalties = Penalties()
    stopping: Stopping = Stopping()
    min_p: float | None = None

    @cached_property  # read for every row at every step: built once a request
    def unkept_stop_ids(self) -> frozenset[int]:
        """The tokens that end the request unkept: the model's own (unless ``ignore_eos``) and the request's
        special stop tokens."""
        own = frozenset() if self.stopping.ignore_eos else self.stop_ids
        return own | self.stopping.unkept_ids

    def blocked_ids(self, generated: int) -> frozenset[int]:
        """The tokens that cannot be sampled after ``generated`` tokens: every token that would end the request,
        while fewer than ``min_tokens`` are generated (none after)."""
        if generated >= self.stopping.min_tokens:
            return frozenset()
        return self.unkept_stop_ids | self.stopping.kept_ids


@dataclass
class Generated:
    """What a request generated: its tokens, why it ended ("stop": a stop token or ``on_token``; "length": its
    ``max_tokens`` or the context) and, where one of its own ``stop_token_ids`` ended it, that token (vLLM's
    ``stop_reason``; None for the model's own stop tokens, the length and the caller)."""

    tokens: list[int]
    finish_reason: str
    stop_reason: int | None = None


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
    for i, request in enumerate(requests):
        _check_prompt(request, model.config.sequence_len, f"request {i}")
    results: list[Generated | None] = [None] * len(requests)
    decoding = Decoding(model, list(enumerate(requests)), on_token)
    while True:
        for index, generated in decoding.sample():
            results[index] = generated
        yield
        if not decoding.live:
            return results  # type: ignore[return-value]
        decoding.advance()


def _check_prompt(request: Generation, limit: int, name: str) -> None:
    """Refuse a prompt that leaves no room for one more token in the model's context, in one line."""
    if not request.prompt or len(request.prompt) >= limit:
        raise InputError(
            f"{name}: a prompt of {len(request.prompt)} tokens; allowed: 1 to {limit - 1} (the model's "
            f"sequence_len {limit}, with room for one more)"
        )


@dataclass
class _Row:
    """One request in a batch: the caller's index for it, its generator, the positions its cache holds (its prompt,
    then each token fed), what it generated and the tokens forced next."""

    index: int
    request: Generation
    generator: torch.Generator
    position: int
    out: Generated = field(default_factory=lambda: Generated([], "length"))
    forced: list[int] = field(default_factory=list)


class Decoding:
    """A batch in flight: one forward per step for every live request, and requests that join it between steps.

    The first requests are prefilled together (``GPT.prefill``), each row of the cache at its own length; each later
    one (:meth:`join`) is prefilled the same way and its cache rows appended to the batch's (``KVCache.join``): every
    request's logits are the ones it has alone. A step is :meth:`sample` (each live request's next token, reported
    through ``on_token``; returns the requests that ended) and then :meth:`advance` (the forward pass on the tokens
    fed). No autograd: a generator around it keeps the caller's grad mode between steps, so each forward says it.

    Args:
        model: the GPT.
        requests: (the caller's index, request) of the first requests, each prompt within the context
            (:func:`_check_prompt`).
        on_token: :data:`OnToken`, called with the caller's index.
    """

    def __init__(self, model: GPT, requests: Sequence[tuple[int, Generation]], on_token: OnToken | None = None) -> None:
        self.model, self.on_token = model, on_token
        self.device = model.lm_head.weight.device
        self.limit = model.config.sequence_len
        self.cache, self.logits = model.prefill([request.prompt for _, request in requests])
        self.rows = [self._row(index, request) for index, request in requests]  # the live requests, in cache order
        self.fed: list[int] = []  # the tokens sample() chose to feed, in cache order

    def _row(self, index: int, request: Generation) -> _Row:
        generator = torch.Generator(self.device).manual_seed(request.seed % 2**63)
        return _Row(index, request, generator, len(request.prompt))

    @property
    def live(self) -> list[int]:
        """The caller's indices of the requests still generating."""
        return [row.index for row in self.rows]

    def join(self, requests: Sequence[tuple[int, Generation]]) -> None:
        """Add ``requests`` (each prompt within the context) to the batch, between an :meth:`advance` and the next
        :meth:`sample`."""
        self.attach(requests, *prefilled(self.model, [request for _, request in requests]))

    def attach(self, requests: Sequence[tuple[int, Generation]], cache: KVCache, logits: torch.Tensor) -> None:
        """:meth:`join` with the requests' :func:`prefilled` cache and logits, computed elsewhere (the server
        prefills on its own thread while the batch decodes)."""
        self.cache.join(cache)
        self.logits = torch.cat([self.logits, logits])
        self.rows += [self._row(index, request) for index, request in requests]

    def sample(self) -> list[tuple[int, Generated]]:
        """Each live request's next token (forced, else sampled), reported through ``on_token``; returns (index,
        :class:`Generated`) of the requests that ended at this step; the others' tokens are fed by :meth:`advance`."""
        fed, kept, ended = [], [], []
        drawn = self._draw()
        for slot, row in enumerate(self.rows):
            request, tokens = row.request, row.out.tokens
            if row.position >= self.limit:
                ended.append(row)  # its context is full: "length" (forced tokens past the allowance end here)
                continue
            sampled = not row.forced
            if row.forced:
                token = row.forced.pop(0)
            else:
                if len(tokens) >= request.max_tokens:
                    ended.append(row)  # "length", after its forced tokens
                    continue
                token = drawn[slot]
                if token in request.unkept_stop_ids:
                    row.out.finish_reason = "stop"
                    row.out.stop_reason = token if token in request.stopping.unkept_ids else None
                    ended.append(row)
                    continue
            tokens.append(token)
            said = self.on_token(row.index, token, self.logits[slot]) if self.on_token is not None else None
            if said is False or (sampled and token in request.stopping.kept_ids):
                row.out.finish_reason = "stop"  # ended by the caller, or by a stop token kept as the last
                row.out.stop_reason = None if said is False else token
                ended.append(row)
                continue
            if isinstance(said, list) and said:
                row.forced += said
            if not row.forced and len(tokens) >= request.max_tokens:
                ended.append(row)  # "length": nothing more to compute for it
                continue
            fed.append(token)
            kept.append(slot)
        if len(kept) < len(self.rows):  # ended requests leave the batch (all of them: requests may still join it)
            rows = torch.tensor(kept, dtype=torch.long, device=self.device)
            self.cache.keep(rows)
            self.logits = self.logits[rows]
            self.rows = [self.rows[slot] for slot in kept]
        self.fed = fed
        return [(row.index, row.out) for row in ended]

    def _draw(self) -> dict[int, int]:
        """The sampled token of each row that samples at this step (not forced, not at its end), by its slot: one
        :func:`sample_rows` call for them all (each with its own settings and generator, as alone)."""
        slots = [
            slot
            for slot, row in enumerate(self.rows)
            if row.position < self.limit and not row.forced and len(row.out.tokens) < row.request.max_tokens
        ]
        if not slots:
            return {}
        rows = [self.rows[slot] for slot in slots]
        requests = [row.request for row in rows]
        logits = penalized(
            self.logits[slots],
            [request.penalties for request in requests],
            [request.prompt for request in requests],
            [row.out.tokens for row in rows],
        )
        for i, row in enumerate(rows):  # min_tokens: what would end a request too early cannot be drawn
            blocked = row.request.blocked_ids(len(row.out.tokens))
            if blocked:
                logits[i, sorted(blocked)] = float("-inf")
        tokens = sample_rows(
            logits,
            [request.temperature for request in requests],
            [request.top_k for request in requests],
            [request.top_p for request in requests],
            [row.generator for row in rows],
            [request.min_p for request in requests],
        )
        return dict(zip(slots, tokens))

    def advance(self) -> None:
        """The forward pass on the tokens :meth:`sample` fed: every live request's logits one step on."""
        for row in self.rows:
            row.position += 1
        step = torch.tensor(self.fed, device=self.device)[:, None]
        with torch.no_grad():
            self.logits = self.model(step, kv_cache=self.cache)[:, -1].float()


def prefilled(model: GPT, requests: Sequence[Generation]) -> tuple[KVCache, torch.Tensor]:
    """``requests`` prefilled together into a cache only as long as their prompts (its filled positions move when
    they join a batch: :meth:`Decoding.attach`), and their last logits."""
    prompts = [request.prompt for request in requests]
    return model.prefill(prompts, max(map(len, prompts)))


class Job(Protocol):
    """What the :class:`Batcher` decodes: a request (``generation``), what each new token does (``on_token``, as
    :data:`OnToken` for this one request), the text added since the last call (``pieces``, read once more after
    ``finish``) and the reply's end (``finish``); ``reply`` holds its tokens so far. The chat engine's
    :class:`lapheads.apps.chat.ChatTurn` is one."""

    generation: Generation
    reply: list[int]

    def on_token(self, index: int, token: int, logits: torch.Tensor) -> object: ...

    def pieces(self) -> Iterator[str]: ...

    def finish(self, generated: Generated) -> None: ...


@dataclass
class _Submitted:
    job: Job
    out: queue.SimpleQueue
    clock: RequestClock
    cancelled: bool = False


class Batcher:
    """Decodes the jobs submitted while it works, together (module docstring).

    Args:
        model: the GPT every job runs on.
        max_batch: jobs decoded together at most.
        gather_s: how long the worker waits, once a job arrived, for others sent with it.
        metrics: where it counts what it did (default: its own, labelled "lapheads").
    """

    def __init__(
        self, model: GPT, max_batch: int = 16, gather_s: float = 0.002, metrics: ServingMetrics | None = None
    ) -> None:
        from lapheads.apps.metrics import ServingMetrics  # the 'serve' extra (TYPE_CHECKING above)

        self.model, self.max_batch, self.gather_s = model, max_batch, gather_s
        self.metrics = metrics if metrics is not None else ServingMetrics("lapheads")
        self.step_lock = threading.Lock()  # held around each step
        self.prefill_lock = threading.Lock()  # held around each prefill on the prefill thread
        self.prefills = ThreadPoolExecutor(1, thread_name_prefix="lapheads-prefill")
        self.waiting: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, name="lapheads-batcher", daemon=True).start()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Neither a step nor a prefill runs while this is held: for a forward of the model outside the batch (an
        echoed prompt's log-probabilities), between steps."""
        with self.step_lock, self.prefill_lock:
            yield

    def _prefill(self, generations: list[Generation]) -> tuple[KVCache, torch.Tensor]:
        with self.prefill_lock, self._timed("prefill_joining"):  # on the prefill thread, beside the steps
            return prefilled(self.model, generations)

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Count the time of ``phase`` (:meth:`ServingMetrics.step`), on the worker or the prefill thread."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.metrics.step(phase, time.perf_counter() - start)

    def _started(self, jobs: list[_Submitted]) -> None:
        """``jobs``' prefill begins now: their queue times, their prompt tokens, the prefill's size."""
        prompts = [len(s.job.generation.prompt) for s in jobs]
        for submitted, tokens in zip(jobs, prompts):
            self.metrics.started(submitted.clock, tokens)
        self.metrics.iteration_tokens.observe(sum(prompts))

    def submit(self, job: Job, outcome: dict[str, Any] | None = None) -> Iterator[str]:
        """The job's text, piece by piece, as the worker decodes it (blocking); ``outcome`` gains
        ``completion_tokens`` as each piece is read and ``finish_reason`` and ``stop_reason`` at the end. Closing
        the iterator early ends the job at its next token. A prompt that leaves no room is refused here, in one
        line (not in the batch it would have joined)."""
        _check_prompt(job.generation, self.model.config.sequence_len, "the request")  # refused alone, not its batch
        from lapheads.apps.metrics import RequestClock

        submitted = _Submitted(job, queue.SimpleQueue(), RequestClock())
        self.waiting.put(submitted)
        self.metrics.waiting.set(self.waiting.qsize())
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
                    outcome["finish_reason"], outcome["stop_reason"] = value
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
        """Decode ``batch`` and every job that joins it while it runs, until none is left. A job that joins is
        prefilled on the prefill thread while the batch goes on decoding, and attached at the first step after its
        prefill is done (the batch waits for it only when nothing else is live)."""
        if not batch:
            return
        jobs: dict[int, _Submitted] = dict(enumerate(batch))  # the index of a request in the batch -> its job
        joined = len(batch)  # the next index to give a job that joins (never reused)
        pending: list[tuple[list[tuple[int, Generation]], Future]] = []  # prefills under way, in arrival order

        def on_token(index: int, token: int, logits: torch.Tensor) -> object:
            submitted = jobs[index]
            if submitted.cancelled:
                return False
            self.metrics.token(submitted.clock)
            return submitted.job.on_token(index, token, logits)

        try:
            self._started(batch)
            with self.step_lock, self.prefill_lock, self._timed("prefill"):  # no step or prefill beside it
                decoding = Decoding(self.model, [(n, s.job.generation) for n, s in jobs.items()], on_token)
            while True:
                self.metrics.running.set(len(jobs))
                self.metrics.waiting.set(self.waiting.qsize())
                with self._timed("sample"):  # the per-token Python side: sampling, text, the readers' queues
                    with self.step_lock:
                        ended = decoding.sample()
                    self._flush(jobs.values())
                    for index, generated in ended:
                        self._finish(jobs.pop(index), generated)
                if decoding.live:
                    with self.step_lock, self._timed("decode"):
                        self.metrics.iteration_tokens.observe(len(decoding.live))
                        decoding.advance()
                elif not pending:
                    return
                joining = self._joining(len(jobs))
                if joining:
                    start, joined = joined, joined + len(joining)
                    jobs.update({start + n: submitted for n, submitted in enumerate(joining)})
                    requests = [(start + n, s.job.generation) for n, s in enumerate(joining)]
                    self._started(joining)
                    pending.append((requests, self.prefills.submit(self._prefill, [r for _, r in requests])))
                while pending and (pending[0][1].done() or not decoding.live):  # in order; wait only when idle
                    requests, prefill = pending.pop(0)
                    with self.step_lock:
                        decoding.attach(requests, *prefill.result())
        except Exception as err:  # noqa: BLE001 - every reader of the batch gets the error, the worker keeps going
            for submitted in jobs.values():
                submitted.out.put(("error", err, 0))
        finally:
            self.metrics.running.set(0)

    def _joining(self, running: int) -> list[_Submitted]:
        """The waiting jobs that join the batch in flight now, in arrival order, up to ``max_batch`` running."""
        joining: list[_Submitted] = []
        while running + len(joining) < self.max_batch:
            try:
                submitted = self.waiting.get_nowait()
            except queue.Empty:
                break
            if not submitted.cancelled:
                joining.append(submitted)
        return joining

    def _finish(self, submitted: _Submitted, generated: Generated) -> None:
        submitted.job.finish(generated)
        self._flush([submitted])  # what the job held back until its end (a character cut short)
        self.metrics.finished(submitted.clock, "abort" if submitted.cancelled else generated.finish_reason)
        submitted.out.put(("done", (generated.finish_reason, generated.stop_reason), len(submitted.job.reply)))

    @staticmethod
    def _flush(batch: Iterable[_Submitted]) -> None:
        for submitted in batch:
            for piece in submitted.job.pieces():
                submitted.out.put(("piece", piece, len(submitted.job.reply)))
