"""What ``lapheads serve``'s routes do, apart from HTTP (vLLM's serving layer): a chat request checked, its replies
decoded together (the :class:`lapheads.apps.batching.Batcher`), completed or streamed with their log-probabilities
and usage (:class:`ChatServing`), and the legacy completions with vLLM's tokenizer routes (:class:`CompletionServing`).
Each is testable without the app; ``lapheads.apps.serve`` holds the guards (host, origin, size, key) and the routes.

Design choices:

* **Errors are values with a status**: a refusal is a :class:`Refusal` (HTTP status, one line, the OpenAI ``param``);
  the route turns it into the endpoint's error shape (OpenAI's object under ``/v1``, one line elsewhere).
* **Blocking work is named**: :meth:`ChatServing.start`, :meth:`ChatServing.completion`,
  :meth:`CompletionServing.start` and :meth:`CompletionServing.complete` wait on the model; the routes run them off
  the event loop (a stream's chunks wait in the response's own thread).
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lapheads.apps.batching import Batcher
from lapheads.apps.chat import ChatEngine
from lapheads.apps.completions import (
    CompletionEngine,
    CompletionJob,
    CompletionRequest,
    completion_request,
    tokenize,
)
from lapheads.apps.detokenize import first_stop
from lapheads.apps.schema import (
    PENALTY_FIELDS,
    STOPPING_FIELDS,
    ChatCompletionBody,
    PageChatBody,
    RequestError,
    requested_penalties,
    requested_stopping,
    validated,
)
from lapheads.data.conversations import render_for_completion
from lapheads.errors import LapheadsError

__all__ = ["ChatServing", "CompletionServing", "Completions", "Refusal", "ServeLimits", "until_stop"]


@dataclass
class ServeLimits:
    """What one request may ask for, and how many chat replies are decoded together at most (``max_num_seqs``, as
    vLLM's option of that name; 1: one reply after another)."""

    max_request_bytes: int = 64_000
    max_messages: int = 64
    max_message_chars: int = 8_000
    max_tokens: int = 512
    max_num_seqs: int = 16


#: the deepest JSON nesting a request may have (a chat request needs 3: object, messages list, message object)
MAX_JSON_DEPTH = 16


class Refusal(Exception):
    """A request refused: its HTTP status, one line, and (OpenAI) the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.status, self.param = status, param


def _failed(err: Exception) -> Refusal:
    """An error while generating, as the client's one line (the server keeps running)."""
    return Refusal(500, f"generation failed: {' '.join(str(err).split())[:200]}")


def _from_openai(body: Any) -> dict[str, Any]:
    """An OpenAI chat-completions request (:class:`lapheads.apps.schema.ChatCompletionBody`) as this server's own
    (the same checks follow); what it cannot do is refused by name, never silently ignored."""
    request = validated(ChatCompletionBody, body).checked()
    given = request.model_dump(exclude_none=True)
    out = {"messages": _openai_messages(body["messages"])}
    limit = given.get("max_completion_tokens", given.get("max_tokens"))
    if limit is not None:
        out["max_tokens"] = limit
    for name in ("temperature", "top_k", "seed", "top_p", "min_p", "n", "logprobs", "top_logprobs", *PENALTY_FIELDS,
                 *STOPPING_FIELDS, "include_stop_str_in_output", "continue_final_message"):  # fmt: skip
        if name in given:
            out[name] = given[name]
    stop = given.get("stop", [])
    out["stop"] = [stop] if isinstance(stop, str) else stop
    options = given.get("stream_options", {})
    return {**out, "stream": given.get("stream", False), "include_usage": bool(options.get("include_usage"))}


def _openai_messages(messages: Any) -> Any:
    """OpenAI's message forms as this server's: ``developer`` is the newer name of ``system``, and ``content`` may be
    a list of parts, whose text parts are joined (an image or audio part is refused by name)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return messages  # _check_request says what a message is
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise RequestError(
                        f"message {i} has a content part of type {kind!r}; allowed: text parts", param="messages"
                    )
                if not isinstance(part.get("text"), str):  # a number or a list in "text" was an HTTP 500
                    raise RequestError(
                        f"message {i} content part {j}: text {part.get('text')!r:.40}; allowed: a string",
                        param="messages",
                    )
            content = "".join(part["text"] for part in content)
        role = "system" if message.get("role") == "developer" else message.get("role")
        out.append({**message, "role": role, "content": content})
    return out


def until_stop(
    pieces: Iterator[str], stops: list[str], outcome: dict[str, Any], min_tokens: int = 0, include: bool = False
) -> Iterator[str]:
    """``pieces`` up to the first stop string (not shown unless ``include``, vLLM's ``include_stop_str_in_output``;
    ``outcome["finish_reason"]`` becomes "stop", ``outcome["stop_reason"]`` the stop string, as vLLM says it). A
    piece that may begin a stop string is held back until the text after it decides. With ``min_tokens``, a stop
    string that ends in the text of the first ``min_tokens`` tokens is passed over, as vLLM passes it over
    (``outcome["completion_tokens"]``, the reader's count at each piece, says where that text ends)."""
    if not stops:
        yield from pieces
        return
    held, shown, floor = "", 0, 0  # the text held back, the characters before it, where stop strings may end after
    for piece in pieces:
        held += piece
        if min_tokens and outcome.get("completion_tokens", 0) <= min_tokens:
            floor = shown + len(held)
        found = first_stop(held, stops, floor - shown)
        if found is not None:
            cut = found[1] if include else found[0]
            if held[:cut]:
                yield held[:cut]
            outcome["finish_reason"], outcome["stop_reason"] = "stop", held[found[0] : found[1]]
            return
        keep = max((k for stop in stops for k in range(1, len(stop)) if held.endswith(stop[:k])), default=0)
        if len(held) > keep:
            yield held[: len(held) - keep]
            shown += len(held) - keep
            held = held[len(held) - keep :]
    if held:
        yield held


def _check_request(body: dict[str, Any], limits: ServeLimits, temperature: float, top_k: int) -> dict[str, Any]:
    """A request the schema validated (each field's own bounds: :mod:`lapheads.apps.schema`), checked for what the
    server and the conversation set (message count and size, roles, max_tokens) and completed with the defaults;
    a LapheadsError naming what is wrong."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise LapheadsError("'messages' must be a non-empty list of {role, content}")
    if len(messages) > limits.max_messages:
        raise LapheadsError(f"{len(messages)} messages; allowed: at most {limits.max_messages}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise LapheadsError(f"message {i} needs role system, user or assistant")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            raise LapheadsError(f"message {i} has empty or non-text content; allowed: a non-empty string")
        if len(content) > limits.max_message_chars:
            raise LapheadsError(
                f"message {i} has {len(content)} characters; allowed: at most {limits.max_message_chars}"
            )
    continuing = bool(body.get("continue_final_message"))
    if messages[-1]["role"] != ("assistant" if continuing else "user"):
        raise LapheadsError(
            "with continue_final_message the last message must be the assistant's (the reply to continue)"
            if continuing
            else "the last message must be the user's (an assistant's to continue: continue_final_message true)"
        )
    options = {
        "temperature": body.get("temperature", temperature),
        "top_k": body.get("top_k", top_k),
        "max_tokens": body.get("max_tokens", limits.max_tokens),
        # no seed: a fresh one, so repeated requests sample afresh (as vLLM, llama.cpp and Ollama do)
        "seed": body["seed"] if body.get("seed") is not None else secrets.randbelow(2**63),
        "top_p": body.get("top_p", 1.0),
        "min_p": body.get("min_p"),
        "n": body.get("n", 1),
        "top_logprobs": body.get("top_logprobs", 0),
    }
    if not 1 <= options["max_tokens"] <= limits.max_tokens:  # the server's bound; the schema checked the rest
        raise RequestError(
            f"max_tokens {options['max_tokens']!r}; allowed: an integer in [1, {limits.max_tokens}]", "max_tokens"
        )
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool) or (options["top_logprobs"] and not logprobs):
        param = "logprobs" if not isinstance(logprobs, bool) else "top_logprobs"
        raise RequestError(f"logprobs {logprobs!r} with top_logprobs {options['top_logprobs']}; allowed: logprobs true "
                           "or false, top_logprobs only with logprobs true", param=param)  # fmt: skip
    options["logprobs"] = logprobs
    extra = {key: body.get(key) for key in ("stream", "include_usage")}
    extra["include_stop_str_in_output"] = bool(body.get("include_stop_str_in_output"))
    extra["continue_final_message"] = continuing
    stop = body.get("stop") or []
    return {"messages": messages, **options, "stop": [stop] if isinstance(stop, str) else stop, **extra}


@dataclass
class Reply:
    """One choice being generated: its text after the stop strings (``pieces``) and ``outcome`` (completion_tokens,
    finish_reason, logprobs)."""

    pieces: Iterator[str]
    outcome: dict[str, Any]


@dataclass
class ChatServing:
    """Chat replies: a request checked (:meth:`check`), its choices decoded together (:meth:`start`), then one
    chat.completion object (:meth:`completion`), OpenAI's chunks (:meth:`chunks`) or the page's events
    (:meth:`page_events`)."""

    engine: ChatEngine
    batcher: Batcher
    name: str
    limits: ServeLimits
    temperature: float = 0.6
    top_k: int = 50

    def check(self, body: Any, openai: bool) -> tuple[dict[str, Any], list[int]]:
        """(the checked request, its rendered prompt); a :class:`Refusal` naming what is wrong."""
        try:
            if openai:
                if isinstance(body, dict) and body.get("model") not in (None, self.name):
                    raise Refusal(404, f"model {body.get('model')!r}; allowed: {self.name!r} (GET /v1/models)")
                body = _from_openai(body)
            else:
                body = validated(PageChatBody, body).model_dump(exclude_none=True)
            request = _check_request(body, self.limits, self.temperature, self.top_k)
            request["penalties"] = requested_penalties(body, self.engine.tokenizer.vocab_size)
            request["stopping"] = requested_stopping(body, self.engine.tokenizer, request["max_tokens"])
            if not openai and request["n"] != 1:  # the page streams one reply: more would be decoded for no one
                raise RequestError(f"n {request['n']}; allowed: 1 here (n choices: POST /v1/chat/completions)", "n")
            prompt = render_for_completion(
                self.engine.tokenizer, {"messages": request["messages"]}, request["continue_final_message"]
            )
            limit = self.engine.model.config.sequence_len
            if len(prompt) >= limit:
                raise LapheadsError(
                    f"the conversation has {len(prompt)} tokens; allowed: fewer than {limit} (start a new chat)"
                )
        except RecursionError:
            raise Refusal(400, 'the request nests too deeply; allowed: {"messages": [{"role", "content"}]}') from None
        except RequestError as err:
            raise Refusal(400, str(err), err.param if openai else None) from None
        except (LapheadsError, ValueError) as err:
            raise Refusal(400, str(err)) from None
        return request, prompt

    def start(self, request: dict[str, Any], prompt: list[int]) -> list[Reply]:
        """Every choice submitted (decoded together; choice i samples with seed + i), then each one's first piece
        taken (blocking: an error before it is still a JSON error, before any byte)."""
        outcomes: list[dict[str, Any]] = [{} for _ in range(request["n"])]
        submitted = [self._submit(request, prompt, outcome, i) for i, outcome in enumerate(outcomes)]
        try:
            begun = [(pieces, next(pieces, None)) for pieces in submitted]
        except Exception as err:  # noqa: BLE001 - the client gets one line
            raise _failed(err) from None
        least, include = request["stopping"].min_tokens, request["include_stop_str_in_output"]
        return [
            Reply(until_stop(_rest(*one), request["stop"], outcome, least, include), outcome)
            for one, outcome in zip(begun, outcomes)
        ]

    def _submit(self, request: dict[str, Any], prompt: list[int], outcome: dict[str, Any], choice: int):
        tokens = outcome.setdefault("logprobs", []) if request.get("logprobs") else None
        turn = self.engine.turn(prompt, request["max_tokens"], request["temperature"], request["top_k"] or None,
                                seed=(request["seed"] + choice) % 2**63, top_p=request["top_p"],
                                min_p=request["min_p"], logprobs=tokens,
                                top_logprobs=request.get("top_logprobs", 0),
                                penalties=request["penalties"], stopping=request["stopping"])  # fmt: skip
        return self.batcher.submit(turn, outcome)

    def completion(self, prompt: list[int], replies: list[Reply]) -> dict[str, Any]:
        """OpenAI's chat.completion object, once every reply is whole (blocking)."""
        try:
            texts = ["".join(reply.pieces) for reply in replies]
        except Exception as err:  # noqa: BLE001
            raise _failed(err) from None
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": self.token_logprobs(reply.outcome, 0, len(text)),
                "finish_reason": reply.outcome.get("finish_reason", "stop"),
                "stop_reason": reply.outcome.get("stop_reason"),
            }
            for i, (text, reply) in enumerate(zip(texts, replies))
        ]
        return {**self._head(), "object": "chat.completion", "choices": choices, "usage": _usage(prompt, replies)}

    def chunks(self, request: dict[str, Any], prompt: list[int], replies: list[Reply]) -> Iterator[str]:
        """OpenAI's chat.completion.chunk events, choice after choice, then the usage chunk (when asked) and
        [DONE]; an error mid-stream ends it with OpenAI's error object."""
        head = self._head()

        def chunk(index: int, delta: dict[str, str], finish: str | None = None, logprobs=None, why=None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "stop_reason": why}
            return f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n"

        for index, reply in enumerate(replies):
            yield chunk(index, {"role": "assistant", "content": ""})
            try:
                shown, reported = 0, 0  # characters sent; tokens whose log-probabilities were sent
                for piece in reply.pieces:
                    shown += len(piece)
                    logprobs = self.token_logprobs(reply.outcome, reported, shown)
                    reported += len(logprobs["content"]) if logprobs else 0
                    yield chunk(index, {"content": piece}, logprobs=logprobs)
            except Exception as err:  # noqa: BLE001 - mid-stream: OpenAI's error object as the last event
                yield f"data: {json.dumps({'error': {'message': str(_failed(err)), 'type': 'server_error'}})}\n\n"
                return
            yield chunk(index, {}, reply.outcome.get("finish_reason", "stop"), why=reply.outcome.get("stop_reason"))
        if request["include_usage"]:  # OpenAI's usage chunk: no choices, after the last choice's
            last = {**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage(prompt, replies)}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"

    @staticmethod
    def page_events(reply: Reply) -> Iterator[str]:
        """The web page's server-sent events: {"token"} ... {"done": true}, or {"error"} mid-stream."""
        try:
            for piece in reply.pieces:
                yield f"data: {json.dumps({'token': piece})}\n\n"
        except Exception as err:  # noqa: BLE001 - mid-stream: end the stream with an error event
            yield f"data: {json.dumps({'error': str(_failed(err))})}\n\n"
            return
        yield f"data: {json.dumps({'done': True})}\n\n"

    def token_logprobs(self, outcome: dict[str, Any], start: int, chars: int) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` of the reply's tokens (sampled, and the calculator's forced ones the content shows)
        from the ``start``-th on whose text lies within the reply's first ``chars`` characters (a stop string's
        tokens are not reported); each token's text is the content it completes (the texts join to the content: a
        split character's first bytes have ""), its ``bytes`` the ones it stands for (OpenAI's field for joining
        such tokens); None without logprobs."""
        if "logprobs" not in outcome:
            return None

        def entry(token: int, logprob: float, text: str) -> dict[str, Any]:
            return {"token": text, "logprob": logprob, "bytes": list(self.engine.shown_bytes(token))}

        content, length = [], 0
        for index, item in enumerate(outcome["logprobs"]):
            length += len(item["text"])
            if length > chars:
                break
            if index >= start:  # a stream's earlier chunks carried the tokens before: counted, not built again
                top = [entry(token, logprob, self.engine.shown(token)) for token, logprob in item["top"]]
                content.append({**entry(item["id"], item["logprob"], item["text"]), "top_logprobs": top})
        return {"content": content}

    def _head(self) -> dict[str, Any]:
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.name}


def _rest(pieces: Iterator[str], first: str | None) -> Iterator[str]:
    """The first piece, then the ones the batcher decodes after it."""
    if first is not None:
        yield first
        yield from pieces


def _usage(prompt: list[int], replies: list[Reply]) -> dict[str, int]:
    done = sum(reply.outcome.get("completion_tokens", 0) for reply in replies)
    return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}


@dataclass
class Completions:
    """A /v1/completions request under way: the checked request, one job a choice (in OpenAI's order) and the
    readers of their text (:meth:`Batcher.submit`; nothing to read for an echo of ``max_tokens`` 0)."""

    request: CompletionRequest
    jobs: list[CompletionJob]
    readers: list[Iterator[str]]
    outcomes: list[dict[str, Any]]  # each reader's token count at each piece, and its finish_reason
    id: str
    created: int


@dataclass
class CompletionServing:
    """OpenAI's legacy completions (:mod:`lapheads.apps.completions`) and vLLM's tokenizer routes, for any run."""

    engine: CompletionEngine
    batcher: Batcher
    name: str
    limits: ServeLimits
    temperature: float = 0.6
    top_k: int = 50

    def start(self, body: Any) -> Completions:
        """The checked request's choices, every one submitted (decoded together, with the requests waiting beside
        them); a :class:`Refusal` naming what is wrong."""
        if isinstance(body, dict) and body.get("model") not in (None, self.name):
            raise Refusal(404, f"model {body.get('model')!r}; allowed: {self.name!r} (GET /v1/models)")
        try:
            checked = completion_request(body, self.engine.tokenizer, max_tokens=self.limits.max_tokens,
                                         temperature=self.temperature, top_k=self.top_k)  # fmt: skip
            self.engine.check_fits(checked)
        except RequestError as err:
            raise Refusal(400, str(err), err.param) from None
        try:
            with self.batcher.exclusive():  # an echoed prompt's forward between steps; choices in OpenAI's order
                jobs = [self.engine.job(prompt, checked, choice) for prompt in checked.prompts
                        for choice in range(checked.n)]  # fmt: skip
            outcomes: list[dict[str, Any]] = [{} for _ in jobs]
            readers = [self.batcher.submit(job, outcome) if job.generation.max_tokens > 0 else iter(())
                       for job, outcome in zip(jobs, outcomes)]  # fmt: skip
        except Exception as err:  # noqa: BLE001 - the client gets one line; the server keeps running
            raise _failed(err) from None
        return Completions(checked, jobs, readers, outcomes, f"cmpl-{uuid.uuid4().hex}", int(time.time()))

    def complete(self, started: Completions) -> dict[str, Any]:
        """OpenAI's text_completion object, once every choice is whole (blocking)."""
        try:
            for reader in started.readers:  # to its end: the jobs hold their tokens
                for _ in reader:
                    pass
            outs = [job.result() for job in started.jobs]
        except Exception as err:  # noqa: BLE001 - the client gets one line; the server keeps running
            raise _failed(err) from None
        for out in outs:
            del out["completion_tokens"]
        return {**self._head(started), "choices": [{"index": i, **out} for i, out in enumerate(outs)],
                "usage": self._usage(started)}  # fmt: skip

    def chunks(self, started: Completions) -> Iterator[str]:
        """OpenAI's text_completion chunks, choice after choice (the module docstring of
        :mod:`lapheads.apps.completions`), then the usage chunk (when asked) and [DONE]; an error mid-stream ends
        it with OpenAI's error object."""
        head, request = self._head(started), started.request

        def chunk(index: int, text: str, logprobs: dict | None, finish: str | None = None, why=None) -> str:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": why}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        wanted = request.logprobs is not None
        for index, (job, reader, outcome) in enumerate(zip(started.jobs, started.readers, started.outcomes)):
            sent, start, offset = 0, 0, 0  # characters sent; the next entry to send, where its text begins
            try:
                if request.echo:
                    sent = len(prompt_text := self.engine.tokenizer.decode(job.prompt))
                    logprobs, start, offset = job.logprobs(0, 0, sent, begun=False)
                    yield chunk(index, prompt_text, logprobs if wanted else None)
                stops = until_stop(reader, request.stop, outcome, request.stopping.min_tokens, request.include_stop)
                for piece in stops:
                    sent += len(piece)
                    logprobs, start, offset = job.logprobs(start, offset, sent, begun=False)
                    yield chunk(index, piece, logprobs if wanted else None)
            except Exception as err:  # noqa: BLE001 - mid-stream: OpenAI's error object as the last event
                yield f"data: {json.dumps({'error': {'message': str(_failed(err)), 'type': 'server_error'}})}\n\n"
                return
            stopped = outcome.get("finish_reason") == "stop"  # at a stop string: its tokens are not reported
            rest = job.logprobs(start, offset, sent if stopped else None, begun=True)[0]
            finish, why = outcome.get("finish_reason", job.finish_reason), outcome.get("stop_reason", job.stop_reason)
            yield chunk(index, "", rest if wanted else None, finish, why)
        if request.include_usage:  # OpenAI's usage chunk: no choices, after the last choice's
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': self._usage(started)})}\n\n"
        yield "data: [DONE]\n\n"

    def _head(self, started: Completions) -> dict[str, Any]:
        return {"id": started.id, "object": "text_completion", "created": started.created, "model": self.name}

    @staticmethod
    def _usage(started: Completions) -> dict[str, int]:
        done = sum(len(job.reply) for job in started.jobs)
        asked = sum(len(prompt) for prompt in started.request.prompts)  # once per prompt, whatever n (as OpenAI)
        return {"prompt_tokens": asked, "completion_tokens": done, "total_tokens": asked + done}

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's tokenizer description (lm-eval's remote tokenizer reads it): BOS ends documents, as EOS does."""
        bos = self.engine.tokenizer.bos
        return {"eos_token": bos, "bos_token": bos, "pad_token": None,
                "model_max_length": self.engine.model.config.sequence_len}  # fmt: skip

    def tokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's ``/tokenize``: {"prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"}."""
        special = body.get("add_special_tokens", True) if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str) or not isinstance(special, bool):
            raise Refusal(400, 'allowed: {"prompt": text, "add_special_tokens": true or false}', "prompt")
        tokens = tokenize(self.engine.tokenizer, body["prompt"], special)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.model.config.sequence_len}

    def detokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's ``/detokenize``: {"tokens"} -> {"prompt"}."""
        tokens = body.get("tokens") if isinstance(body, dict) else None
        size = self.engine.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < size for t in tokens):
            raise Refusal(400, f'allowed: {{"tokens": [ids in [0, {size - 1}]]}}', "tokens")
        return {"prompt": self.engine.tokenizer.decode(tokens)}
