"""Talking with a chat model: generation with a KV cache, streamed text, and the calculator tool (nanochat's Engine).

Design choices:

* **One decoder for one reply and for many**: a reply is a :class:`ChatTurn` (the prompt, a rendered conversation
  ending in ``<|assistant_start|>``, and what each new token does), decoded by :mod:`lapheads.apps.batching`: alone
  here (a batch of one), together with others under ``lapheads serve``. The prompt is prefilled once; each token is
  one cached step. Generation stops at ``<|assistant_end|>`` or BOS.
* **The calculator tool, as nanochat**: when the model closes a tool call (``<|python_start|> expr
  <|python_end|>``), the expression is evaluated and ``<|output_start|> result <|output_end|>`` is forced into the
  sequence before sampling resumes (one token per step, each reported with the model's log-probability there).
  Only arithmetic (digits, ``+ - * / ( ) .``) and ``'word'.count('x')`` are accepted, and they run in
  :mod:`lapheads.sandbox` (a separate, resource-limited process), never in ours.
* **Streamed text is decoded a few tokens at a time** (:class:`lapheads.apps.detokenize.IncrementalText`, as
  vLLM's): a token costs the same at the end of a long reply as at its start, characters spread over several byte
  tokens come out whole, and the pieces add up to the whole reply's text; tool calls are shown as
  ``[calc: expr = result]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lapheads.apps.batching import Generated, Generation, Stopping, decode_steps
from lapheads.apps.detokenize import IncrementalText
from lapheads.apps.penalties import Penalties
from lapheads.data.conversations import render_for_completion
from lapheads.data.tokenizers import Tokenizer
from lapheads.data.turns import Conversation
from lapheads.errors import InputError, LapheadsError
from lapheads.models.gpt import GPT

__all__ = ["ChatEngine", "ChatTurn", "chat_once", "chat_repl", "use_calculator"]

_ARITHMETIC = re.compile(r"[0-9+\-*/(). ]{1,100}")
_COUNT = re.compile(r"'[A-Za-z]{1,40}'\.count\('[A-Za-z]'\)")


def use_calculator(expression: str, timeout: float = 3.0) -> str | None:
    """The calculator's answer to ``expression`` as text, or None when it is not allowed or fails.

    Integral floats print as integers (48/2 -> "24"), as GSM8K writes them.
    """
    from lapheads.sandbox import run_program

    expression = expression.strip()
    if not (_ARITHMETIC.fullmatch(expression) and "**" not in expression) and not _COUNT.fullmatch(expression):
        return None
    program = f"value = {expression}\nprint(int(value) if isinstance(value, float) and value.is_integer() else value)\n"
    result = run_program(program, timeout=timeout, memory_mb=256)
    return result.output.strip() if result.passed else None


@dataclass
class ChatEngine:
    """Replies of a chat model.

    Args:
        model: a GPT trained with the chat tokens (SFT).
        tokenizer: its tokenizer.
        tools: run the calculator on tool calls (False: the model's own guess of the output is kept).
    """

    model: GPT
    tokenizer: Tokenizer
    tools: bool = True

    def __post_init__(self) -> None:
        t = self.tokenizer
        self.ids = {
            name: t.special_id(f"<|{name}|>")
            for name in ("assistant_end", "python_start", "python_end", "output_start", "output_end")
        }
        self._shown = {
            self.ids["python_start"]: "[calc: ",
            self.ids["python_end"]: "",
            self.ids["output_start"]: " = ",
            self.ids["output_end"]: "]",
        }

    def shown(self, token: int) -> str:
        """One token's text as :meth:`display` shows it (a tool marker as its bracket, not its special name)."""
        return self._shown.get(token, self.tokenizer.decode([token]))

    def shown_bytes(self, token: int) -> bytes:
        """The bytes one token stands for in what :meth:`display` shows (a byte of a split character: that byte)."""
        return self._shown[token].encode("utf-8") if token in self._shown else self.tokenizer.piece_bytes(token)

    def display(self, ids: list[int]) -> str:
        """The reply's text with tool calls written ``[calc: expr = result]``."""
        out, run = [], []
        for i in ids:
            if i in self._shown:
                out.append(self.tokenizer.decode(run))
                out.append(self._shown[i])
                run = []
            else:
                run.append(i)
        out.append(self.tokenizer.decode(run))
        return "".join(out)

    def turn(
        self,
        prompt_ids: list[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
        outcome: dict[str, Any] | None = None,
        top_p: float | None = None,
        logprobs: list[dict[str, Any]] | None = None,
        top_logprobs: int = 0,
        penalties: Penalties = Penalties(),
        stopping: Stopping = Stopping(),
        min_p: float | None = None,
    ) -> ChatTurn:
        """One reply to generate (:meth:`stream` decodes it alone; the server decodes many together): see
        :meth:`stream` for the arguments. The prompt is checked here, before any work."""
        limit = self.model.config.sequence_len
        if not prompt_ids:
            raise InputError("an empty prompt; allowed: a rendered conversation")
        if len(prompt_ids) >= limit:
            raise InputError(
                f"the conversation has {len(prompt_ids)} tokens; allowed: fewer than the model's sequence_len {limit}"
            )
        stops = frozenset({self.ids["assistant_end"], self.tokenizer.bos_id})
        generation = Generation(
            tuple(prompt_ids), max_tokens, temperature, top_k or None, top_p, seed, stops, penalties, stopping, min_p
        )
        return ChatTurn(self, generation, outcome, logprobs, top_logprobs)

    def stream(self, prompt_ids: list[int], *args: Any, **kwargs: Any) -> Iterator[str]:
        """Yield the reply's text piece by piece; ``prompt_ids`` end with ``<|assistant_start|>``.

        Args (after ``prompt_ids``): max_tokens, temperature, top_k, seed; ``outcome``, when given, holds
        ``completion_tokens`` (the model's and the tool's tokens so far, kept current before each piece, so a caller
        that stops reading at a stop string still counts what was generated) and, once the reply ends,
        ``finish_reason`` ("stop": the model ended its turn; "length": ``max_tokens`` or the context ran out);
        ``top_p``; ``logprobs``, when given, gains one entry per token of the reply before its text is yielded, the
        tool's forced tokens included (the content shows them): ``{"id", "logprob", "top": [(id, logprob), ...]}``,
        the model's log-softmax at that position (untempered, as OpenAI reports it), with its ``top_logprobs``
        likeliest tokens, and ``"text"``: the content it completes (the entries' texts join to the reply's; a
        character spread over byte tokens belongs to its last byte's entry); ``penalties``: logit biases and
        repetition, frequency and presence penalties (:class:`lapheads.apps.penalties.Penalties`); ``stopping``:
        the request's own stop tokens, ``ignore_eos`` and ``min_tokens`` (:class:`lapheads.apps.batching.Stopping`);
        ``min_p``: min-p sampling (``lapheads.models.gpt.sample_token``).
        """
        turn = self.turn(prompt_ids, *args, **kwargs)
        steps = decode_steps(self.model, [turn.generation], turn.on_token)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                turn.finish(done.value[0])
                break
            yield from turn.pieces()
        yield from turn.pieces()

    def reply(self, conversation: Conversation, **kwargs) -> str:
        """The assistant's whole next turn in ``conversation`` (a final assistant message is ignored)."""
        return "".join(self.stream(render_for_completion(self.tokenizer, conversation), **kwargs))


@dataclass
class ChatTurn:
    """One reply being generated: what to decode (``generation``), what each new token does (:meth:`on_token`: the
    calculator's output forced in after a closed tool call, log-probabilities, the token count) and the text shown
    so far (:meth:`pieces`)."""

    engine: ChatEngine
    generation: Generation
    outcome: dict[str, Any] | None = None
    logprobs: list[dict[str, Any]] | None = None
    top_logprobs: int = 0
    reply: list[int] = field(default_factory=list)
    call: list[int] | None = None  # the tokens of an open tool call

    def __post_init__(self) -> None:
        self.text = IncrementalText(self.engine.display)  # the reply's text, as its tokens arrive
        self.unread = ""  # the text of the tokens since the last piece

    def on_token(self, index: int, token: int, logits: torch.Tensor) -> list[int] | None:
        """The decoder's report of the reply's next token (sampled or forced): the tool's output to force in when
        the token closes a tool call, else None."""
        engine, ids = self.engine, self.engine.ids
        self.reply.append(token)
        piece = self.text.add(token)
        self.unread += piece
        if self.logprobs is not None:  # the entry's text: what it completes ("" for a split character's first bytes)
            self.logprobs.append({**_logprob_entry(logits, token, self.top_logprobs), "text": piece})
        if self.outcome is not None:
            self.outcome["completion_tokens"] = len(self.reply)
        if token == ids["python_start"]:
            self.call = []
        elif token == ids["python_end"] and self.call is not None:
            result = use_calculator(engine.tokenizer.decode(self.call)) if engine.tools else None
            self.call = None
            if result is not None:  # forced: the tool writes its output, the model reads it
                return [ids["output_start"], *engine.tokenizer.encode(result), ids["output_end"]]
        elif self.call is not None:
            self.call.append(token)
        return None

    def pieces(self) -> Iterator[str]:
        """The text added since the last piece (none while a character is still incomplete)."""
        if self.unread:
            yield self.unread
            self.unread = ""

    def finish(self, generated: Generated) -> None:
        """The reply ended: its held-back text (a character cut short) becomes the last piece; say why in
        ``outcome``."""
        rest = self.text.flush()
        self.unread += rest
        if self.logprobs and rest:
            self.logprobs[-1]["text"] += rest  # the last entry completes what was held back
        if self.outcome is not None:
            self.outcome.update(finish_reason=generated.finish_reason, completion_tokens=len(self.reply))


def _logprob_entry(logits: torch.Tensor, token: int, top: int) -> dict[str, Any]:
    """One sampled token's log-probability and the ``top`` likeliest tokens' (the model's log-softmax)."""
    logp = logits.float().log_softmax(-1)
    best = logp.topk(top) if top else None
    pairs = [] if best is None else [(int(i), float(v)) for v, i in zip(best.values, best.indices)]
    return {"id": token, "logprob": float(logp[token]), "top": pairs}


def _answer(engine: ChatEngine, messages: list[dict[str, str]], text: str, options: dict[str, Any], seed: int) -> None:
    """Add the user's ``text``, stream the reply to stdout and keep it in ``messages``."""
    messages.append({"role": "user", "content": text})
    prompt = render_for_completion(engine.tokenizer, {"messages": messages})
    pieces = []
    sampling = {key: options[key] for key in ("top_p", "min_p", "penalties") if key in options}
    for piece in engine.stream(
        prompt, options["max_tokens"], options["temperature"], options["top_k"], seed, **sampling
    ):
        pieces.append(piece)
        print(piece, end="", flush=True)
    print()
    messages.append({"role": "assistant", "content": "".join(pieces)})


def chat_once(engine: ChatEngine, prompt: str, *, system: str = "", seed: int = 0, **options: Any) -> None:
    """One question, answered once on stdout (``lapheads chat RUN_DIR --prompt ...``, for scripts)."""
    messages = [{"role": "system", "content": system}] if system else []
    _answer(engine, messages, prompt, options, seed)


def chat_repl(engine: ChatEngine, *, name: str, system: str = "", seed: int = 0, **options: Any) -> None:
    """The terminal chat: streamed replies; an empty line or Ctrl-D quits, 'clear' starts a new conversation, and a
    conversation grown past the context says so and keeps the session."""
    messages = [{"role": "system", "content": system}] if system else []
    print(f"lapheads chat with {name} (empty line or Ctrl-D: quit; 'clear': new conversation)")
    for turn in range(10**9):
        try:
            text = input("user> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not text:
            return
        if text == "clear":
            del messages[int(bool(system)) :]
            continue
        print("assistant> ", end="", flush=True)
        try:
            _answer(engine, messages, text, options, seed + turn)
        except LapheadsError as err:
            message = str(err).replace("\n", " ")
            print(f"\n(error: {message}; type 'clear' to start over)")
            del messages[-1:]
