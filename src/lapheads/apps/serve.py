"""A local web chat with a mid/SFT run (``lapheads serve RUN_DIR``), after nanochat's ``chat_web``, and OpenAI's
chat completions; OpenAI's legacy completions and vLLM's tokenizer routes for any run, base runs included
(lapheads.apps.completions).

Design choices:

* **FastAPI + uvicorn, one page**: ``GET /`` is a self-contained HTML page (no external scripts or fonts);
  ``POST /chat/completions`` takes the whole conversation (``{"messages": [...], "temperature", "top_k",
  "max_tokens"}``) and streams the reply as server-sent events (``data: {"token": "..."}`` then
  ``data: {"done": true}``); ``GET /health`` says which run is served.
* **Stateless, so conversations cannot mix**: the browser keeps its conversation and sends it each turn; every
  reply is its own row of the batch's KV cache, its padding kept apart (``lapheads.apps.batching``).
* **Replies decoded together**: chat replies that arrive together (every choice of ``n`` too) are decoded as one
  batch by one worker, one forward per step for all of them, each with its own sampling and seed (the same text as
  alone); a reply sent while a batch runs starts with the next batch. The legacy completions take turns with the
  batch's steps on one lock around the model.
* **Limits before any work**: loopback by default (a warning when bound beyond it), a request body of at most
  ``max_request_bytes`` counted as it streams in (chunked bodies too), JSON only (``Content-Type:
  application/json``, so a web page cannot POST a form or text/plain), a Host header naming this server (DNS
  rebinding), an Origin (when sent) of the same host, bounded nesting, at most ``max_messages`` messages of at most
  ``max_message_chars`` characters, integer ``max_tokens`` (capped) and ``top_k`` in [0, 200], temperature in
  [0, 2] (below 1e-5: greedy); anything else is a 400/403/413/415 with a one-line JSON error naming the value and
  what is allowed. An error before the first token is a JSON error; one during the stream ends it with a
  ``data: {"error": ...}`` event, never a traceback. The calculator runs in the sandbox, as in ``lapheads chat``.
* **An API key, as vLLM's** (``--api-key`` or ``LAPHEADS_API_KEY``): every route but the page and ``/health`` then
  wants ``Authorization: Bearer KEY`` (compared in constant time), else HTTP 401 in OpenAI's error object; the
  page asks for the key once and sends it. Without one, a server bound beyond loopback says it has no
  authentication.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request  # the optional extra 'serve'; lapheads imports this module only to serve
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from lapheads.apps.batching import Batcher
from lapheads.apps.chat import ChatEngine
from lapheads.apps.completions import CompletionEngine, completion_request, tokenize
from lapheads.apps.schema import MAX_CHOICES, MAX_TOP_LOGPROBS, ChatCompletionBody, RequestError, validated
from lapheads.errors import LapheadsError
from lapheads.io import json_depth

__all__ = ["ServeLimits", "create_app", "serve", "served"]


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


def _from_openai(body: Any) -> dict[str, Any]:
    """An OpenAI chat-completions request (:class:`lapheads.apps.schema.ChatCompletionBody`) as this server's own
    (the same checks follow); what it cannot do is refused by name, never silently ignored."""
    request = validated(ChatCompletionBody, body).checked()
    given = request.model_dump(exclude_none=True)
    out = {"messages": _openai_messages(body["messages"])}
    limit = given.get("max_completion_tokens", given.get("max_tokens"))
    if limit is not None:
        out["max_tokens"] = limit
    for field in ("temperature", "top_k", "seed", "top_p", "n", "logprobs", "top_logprobs"):
        if field in given:
            out[field] = given[field]
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


def until_stop(pieces: Iterator[str], stops: list[str], outcome: dict[str, Any]) -> Iterator[str]:
    """``pieces`` up to the first stop string (never shown; ``outcome["finish_reason"]`` becomes "stop"). A piece
    that may begin a stop string is held back until the text after it decides."""
    if not stops:
        yield from pieces
        return
    held = ""
    for piece in pieces:
        held += piece
        found = [held.index(stop) for stop in stops if stop in held]
        if found:
            if held[: min(found)]:
                yield held[: min(found)]
            outcome["finish_reason"] = "stop"
            return
        keep = max((k for stop in stops for k in range(1, len(stop)) if held.endswith(stop[:k])), default=0)
        if len(held) > keep:
            yield held[: len(held) - keep]
            held = held[len(held) - keep :]
    if held:
        yield held


def _check_request(body: Any, limits: ServeLimits, temperature: float, top_k: int) -> dict[str, Any]:
    """The validated request, or a LapheadsError naming what is wrong."""
    if not isinstance(body, dict):
        raise LapheadsError('the request is not a JSON object; allowed: {"messages": [...]}')
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
    if messages[-1]["role"] != "user":
        raise LapheadsError("the last message must be the user's")
    options = {
        "temperature": body.get("temperature", temperature),
        "top_k": body.get("top_k", top_k),
        "max_tokens": body.get("max_tokens", limits.max_tokens),
        # no seed: a fresh one, so repeated requests sample afresh (as vLLM, llama.cpp and Ollama do)
        "seed": body["seed"] if body.get("seed") is not None else secrets.randbelow(2**63),
        "top_p": body.get("top_p", 1.0),
        "n": body.get("n", 1),
        "top_logprobs": body.get("top_logprobs", 0),
    }
    bounds = {
        "temperature": (0.0, 2.0),
        "top_k": (0, 200),
        "max_tokens": (1, limits.max_tokens),
        "seed": (0, 2**63 - 1),
        "top_p": (0.0, 1.0),  # 0 itself excluded below: no token would be left
        "n": (1, MAX_CHOICES),
        "top_logprobs": (0, MAX_TOP_LOGPROBS),
    }
    for name, value in options.items():
        low, high = bounds[name]
        kind = (int, float) if name in ("temperature", "top_p") else int
        if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
            words = "an integer" if kind is int else "a number"
            span = "(0, 1]" if name == "top_p" else f"[{low}, {high}]"
            raise RequestError(f"{name} {value!r}; allowed: {words} in {span}", param=name)
    if options["top_p"] == 0:
        raise RequestError("top_p 0; allowed: a number in (0, 1]", param="top_p")
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool) or (options["top_logprobs"] and not logprobs):
        param = "logprobs" if not isinstance(logprobs, bool) else "top_logprobs"
        raise RequestError(f"logprobs {logprobs!r} with top_logprobs {options['top_logprobs']}; allowed: logprobs true "
                           "or false, top_logprobs only with logprobs true", param=param)  # fmt: skip
    options["logprobs"] = logprobs
    extra = {key: body.get(key) for key in ("stream", "include_usage")}
    return {"messages": messages, **options, "stop": body.get("stop") or [], **extra}


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")


def _hostname(value: str) -> str:
    """The host of a Host header or an Origin URL, without scheme and port, lower case."""
    value = value.split("://", 1)[-1].split("/", 1)[0].lower()
    if value.startswith("["):  # [::1]:8000
        return value.split("]", 1)[0] + "]"
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def create_app(
    engine: ChatEngine | CompletionEngine,
    name: str = "lapheads",
    limits: ServeLimits | None = None,
    temperature: float = 0.6,
    top_k: int = 50,
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_NAMES,
    api_key: str | None = None,
):
    """The FastAPI app serving ``engine``; ``temperature`` and ``top_k`` apply where a request leaves them out.

    Args:
        engine: a chat run's ChatEngine (every route), or a base run's CompletionEngine (``/v1/completions`` and
            the tokenizer routes; the chat routes refuse in one line).
        allowed_hosts: host names the Host header may carry (None: any, for a server bound to every address).
        api_key: the key every route but ``/`` and ``/health`` wants as ``Authorization: Bearer KEY`` (None: none).
    """
    from lapheads.data.conversations import render_for_completion

    limits = limits or ServeLimits()
    chat = engine if isinstance(engine, ChatEngine) else None
    completer = CompletionEngine(engine.model, engine.tokenizer)
    app = FastAPI(title=f"lapheads chat: {name}", docs_url=None, redoc_url=None)
    model_lock = threading.Lock()  # the batcher's steps and the legacy completions take turns on the model
    batcher = Batcher(engine.model, limits.max_num_seqs, model_lock=model_lock) if chat is not None else None

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        """With an API key, a request without it is a 401 (OpenAI's error object under /v1) before any work."""
        if api_key is None or request.url.path in ("/", "/health"):
            return await call_next(request)
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode()):
            return await call_next(request)
        message = "a missing or wrong API key; allowed: the header 'Authorization: Bearer KEY' with this server's key"
        if request.url.path.startswith("/v1/"):
            error = {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
            return JSONResponse({"error": error}, status_code=401)
        return JSONResponse({"error": message}, status_code=401)

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.replace("{{NAME}}", name.replace("<", "&lt;"))

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "run": name}

    def refuse(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    def refuse_openai(status: int, message: str, param: str | None = None) -> JSONResponse:
        """OpenAI's error object, as its clients read it: the refused field in ``param``."""
        kind = {404: "not_found_error", 413: "invalid_request_error", 500: "server_error"}.get(status)
        code = {404: "model_not_found", 413: "request_too_large"}.get(status) or ("invalid_value" if param else None)
        error = {"message": message, "type": kind or "invalid_request_error", "param": param, "code": code}
        return JSONResponse({"error": error}, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def unknown_route(request: Request, err: StarletteHTTPException) -> JSONResponse:
        """An unknown route or method: OpenAI's error object under /v1 (its clients read no other), one line
        elsewhere, as every other refusal of this server."""
        message = f"{request.method} {request.url.path}: {err.detail}"  # "Not Found", "Method Not Allowed"
        allow = {k.lower(): v for k, v in (err.headers or {}).items()}.get("allow")
        if allow:
            message += f"; allowed: {allow}"
        if request.url.path.startswith("/v1/"):
            code = {404: "unknown_url", 405: "method_not_allowed"}.get(err.status_code)
            kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
            body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
            return JSONResponse(body, status_code=err.status_code, headers=err.headers)
        return JSONResponse({"error": message}, status_code=err.status_code, headers=err.headers)

    async def read_json(request: Request, refuse):
        """The request's JSON body, or the refusal: Host, Origin, type, size, nesting, syntax."""
        host = _hostname(request.headers.get("host", ""))
        if allowed_hosts is not None and host not in allowed_hosts:
            return refuse(403, f"Host {host!r}; allowed: {', '.join(allowed_hosts)} (this server's own names)")
        origin = request.headers.get("origin")
        if origin is not None and _hostname(origin) != host:
            return refuse(403, f"Origin {origin!r}; allowed: pages served by this server ({host})")
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            return refuse(415, f"Content-Type {media or 'none'!r}; allowed: application/json")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
            return refuse(413, f"request of {declared} bytes; allowed: at most {limits.max_request_bytes}")
        raw = bytearray()
        async for chunk in request.stream():  # counted as it arrives: chunked bodies declare no length
            raw += chunk
            if len(raw) > limits.max_request_bytes:
                return refuse(413, f"request of over {limits.max_request_bytes} bytes; allowed: at most that")
        if json_depth(bytes(raw)) > MAX_JSON_DEPTH:
            return refuse(400, "the request nests too deeply; allowed: the endpoint's JSON object")
        try:
            return json.loads(bytes(raw) or b"null")
        except (RecursionError, ValueError) as err:
            return refuse(400, f"the request is not JSON: {' '.join(str(err).split())[:200]}")

    async def read_request(request: Request, refuse, openai: bool = False):
        """(the checked request, the rendered prompt) or the refusal: read_json's checks, then the chat schema."""
        if chat is None:
            return refuse(400, f"{name} was never trained on conversations; allowed: POST /v1/completions")
        body = await read_json(request, refuse)
        if isinstance(body, JSONResponse):
            return body
        try:
            if openai:
                if isinstance(body, dict) and body.get("model") not in (None, name):
                    return refuse(404, f"model {body.get('model')!r}; allowed: {name!r} (GET /v1/models)")
                body = _from_openai(body)
            body = _check_request(body, limits, temperature, top_k)
            prompt = render_for_completion(engine.tokenizer, {"messages": body["messages"]})
            if len(prompt) >= engine.model.config.sequence_len:
                raise LapheadsError(
                    f"the conversation has {len(prompt)} tokens; allowed: fewer than "
                    f"{engine.model.config.sequence_len} (start a new chat)"
                )
        except RecursionError:
            return refuse(400, 'the request nests too deeply; allowed: {"messages": [{"role", "content"}]}')
        except RequestError as err:
            words = " ".join(str(err).split())
            return refuse(400, words, err.param) if openai else refuse(400, words)
        except (LapheadsError, ValueError) as err:
            return refuse(400, " ".join(str(err).split()))
        return body, prompt

    def submit(body: dict[str, Any], prompt: list[int], outcome: dict[str, Any], choice: int = 0):
        """The reply's pieces, decoded with the requests waiting beside it (the batcher); choice i of ``n`` samples
        with seed + i; with logprobs, ``outcome["logprobs"]`` gains each token's. A prompt that does not fit is
        refused here, before any work."""
        tokens = outcome.setdefault("logprobs", []) if body.get("logprobs") else None
        turn = chat.turn(prompt, body["max_tokens"], body["temperature"], body["top_k"] or None,
                         seed=(body["seed"] + choice) % 2**63, top_p=body["top_p"], logprobs=tokens,
                         top_logprobs=body.get("top_logprobs", 0))  # fmt: skip
        return batcher.submit(turn, outcome)

    def started(pieces):
        """The pieces and the first of them (an error before it is still a JSON error, before any byte)."""
        return pieces, next(pieces, None)

    def rest(pieces, first):
        """The pieces after the first, as the batcher decodes them."""
        if first is not None:
            yield first
            yield from pieces

    @app.post("/chat/completions")
    async def complete(request: Request):
        """The web page's endpoint: server-sent events {"token"} ... {"done": true} (or {"error"})."""
        checked = await read_request(request, refuse)
        if isinstance(checked, JSONResponse):
            return checked
        try:
            pieces, first = await run_in_threadpool(lambda: started(submit(*checked, {})))
        except Exception as err:  # noqa: BLE001 - the client gets one line; the server keeps running
            return refuse(500, f"generation failed: {' '.join(str(err).split())[:200]}")

        def events():
            try:
                for piece in rest(pieces, first):
                    yield f"data: {json.dumps({'token': piece})}\n\n"
            except Exception as err:  # noqa: BLE001 - mid-stream: end the stream with an error event
                yield f"data: {json.dumps({'error': 'generation failed: ' + ' '.join(str(err).split())[:200]})}\n\n"
                return
            yield f"data: {json.dumps({'done': True})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def openai_completions(request: Request):
        """OpenAI's legacy completions (lapheads.apps.completions): any run, text or token prompts, echo and
        log-probabilities in the legacy shape; what lm-eval's ``local-completions`` model calls."""
        body = await read_json(request, refuse_openai)
        if isinstance(body, JSONResponse):
            return body
        if isinstance(body, dict) and body.get("model") not in (None, name):
            return refuse_openai(404, f"model {body.get('model')!r}; allowed: {name!r} (GET /v1/models)")
        try:
            checked = completion_request(
                body, engine.tokenizer, max_tokens=limits.max_tokens, temperature=temperature, top_k=top_k
            )
            completer.check_fits(checked)
            # off the event loop, one completion at a time on the model (other requests interleave between them)
            outs = await run_in_threadpool(complete_all, checked)
        except RequestError as err:
            return refuse_openai(400, " ".join(str(err).split()), err.param)
        except Exception as err:  # noqa: BLE001 - the client gets one line; the server keeps running
            return refuse_openai(500, f"generation failed: {' '.join(str(err).split())[:200]}")
        done = sum(out.pop("completion_tokens") for out in outs)
        asked = sum(len(prompt) for prompt in checked.prompts)  # once per prompt, whatever n (as OpenAI counts)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": [{"index": i, **out} for i, out in enumerate(outs)],
            "usage": {"prompt_tokens": asked, "completion_tokens": done, "total_tokens": asked + done},
        }

    def complete_all(checked) -> list[dict[str, Any]]:
        """Each prompt's ``n`` choices, prompt after prompt (OpenAI's order)."""
        outs = []
        for prompt in checked.prompts:
            for choice in range(checked.n):
                with model_lock:
                    outs.append(completer.complete(prompt, checked, choice))
        return outs

    @app.get("/tokenizer_info")
    def tokenizer_info() -> dict[str, Any]:
        """vLLM's tokenizer description (lm-eval's remote tokenizer reads it): BOS ends documents, as EOS does."""
        bos = engine.tokenizer.bos
        return {"eos_token": bos, "bos_token": bos, "pad_token": None,
                "model_max_length": engine.model.config.sequence_len}  # fmt: skip

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        """vLLM's ``/tokenize``: {"prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"}."""
        body = await read_json(request, refuse_openai)
        if isinstance(body, JSONResponse):
            return body
        special = body.get("add_special_tokens", True) if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str) or not isinstance(special, bool):
            return refuse_openai(400, 'allowed: {"prompt": text, "add_special_tokens": true or false}', "prompt")
        tokens = tokenize(engine.tokenizer, body["prompt"], special)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.model.config.sequence_len}

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        """vLLM's ``/detokenize``: {"tokens"} -> {"prompt"}."""
        body = await read_json(request, refuse_openai)
        if isinstance(body, JSONResponse):
            return body
        tokens = body.get("tokens") if isinstance(body, dict) else None
        size = engine.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < size for t in tokens):
            return refuse_openai(400, f'allowed: {{"tokens": [ids in [0, {size - 1}]]}}', "tokens")
        return {"prompt": engine.tokenizer.decode(tokens)}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "lapheads"}]}

    def token_logprobs(outcome: dict[str, Any], start: int, chars: int) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` of the reply's tokens (sampled, and the calculator's forced ones the content shows)
        from the ``start``-th on whose text lies within the reply's first ``chars`` characters (a stop string's
        tokens are not reported); each token's text is the one the content shows; None without logprobs."""
        if "logprobs" not in outcome:
            return None

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = engine.shown(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content, length = [], 0
        for index, item in enumerate(outcome["logprobs"]):
            length += len(engine.shown(item["id"]))
            if length > chars:
                break
            if index >= start:  # a stream's earlier chunks carried the tokens before: counted, not built again
                top = [entry(*t) for t in item["top"]]
                content.append({**entry(item["id"], item["logprob"]), "top_logprobs": top})
        return {"content": content}

    @app.post("/v1/chat/completions")
    async def openai_complete(request: Request):
        """OpenAI's chat completions (as vLLM, llama.cpp's server and Ollama offer): a chat.completion object, or
        with "stream": true chat.completion.chunk events ending in [DONE]."""
        checked = await read_request(request, refuse_openai, openai=True)
        if isinstance(checked, JSONResponse):
            return checked
        body, prompt = checked
        outcomes: list[dict[str, Any]] = [{} for _ in range(body["n"])]
        try:  # every choice submitted first (decoded together), then each one's first piece, off the event loop
            submitted = [submit(body, prompt, outcome, i) for i, outcome in enumerate(outcomes)]
            begun = await run_in_threadpool(lambda: [started(pieces) for pieces in submitted])
        except Exception as err:  # noqa: BLE001
            return refuse_openai(500, f"generation failed: {' '.join(str(err).split())[:200]}")
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
        texts = [until_stop(rest(*one), body["stop"], outcome) for one, outcome in zip(begun, outcomes)]

        def usage() -> dict[str, int]:
            done = sum(outcome.get("completion_tokens", 0) for outcome in outcomes)
            return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}

        if not body["stream"]:
            try:  # off the event loop (issue 76: one long non-streamed reply held /health for 8 s)
                replies = await run_in_threadpool(lambda: ["".join(text) for text in texts])
            except Exception as err:  # noqa: BLE001
                return refuse_openai(500, f"generation failed: {' '.join(str(err).split())[:200]}")
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": reply},
                    "logprobs": token_logprobs(outcome, 0, len(reply)),
                    "finish_reason": outcome.get("finish_reason", "stop"),
                }
                for i, (reply, outcome) in enumerate(zip(replies, outcomes))
            ]
            return {**head, "object": "chat.completion", "choices": choices, "usage": usage()}

        def chunk(index: int, delta: dict[str, str], finish: str | None = None, logprobs=None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n"

        def events():
            for index, (text, outcome) in enumerate(zip(texts, outcomes)):  # choice after choice, each by its index
                yield chunk(index, {"role": "assistant", "content": ""})
                try:
                    shown, reported = 0, 0  # characters sent; tokens whose log-probabilities were sent
                    for piece in text:
                        shown += len(piece)
                        logprobs = token_logprobs(outcome, reported, shown)
                        reported += len(logprobs["content"]) if logprobs else 0
                        yield chunk(index, {"content": piece}, logprobs=logprobs)
                except Exception as err:  # noqa: BLE001 - mid-stream: OpenAI's error object as the last event
                    message = "generation failed: " + " ".join(str(err).split())[:200]
                    yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
                    return
                yield chunk(index, {}, outcome.get("finish_reason", "stop"))
            if body["include_usage"]:  # OpenAI's usage chunk: no choices, after the last choice's
                last = {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage()}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def served(app) -> Iterator[str]:
    """``app`` on a free loopback port, in a thread (a notebook, a test, a benchmark); yields its base URL and stops
    it on exit."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(300):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def serve(
    run_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str = "auto",
    limits: ServeLimits | None = None,
    tools: bool = True,
    temperature: float = 0.6,
    top_k: int = 50,
    api_key: str | None = None,
) -> None:
    """Load ``run_dir`` and serve it until interrupted: a mid or sft run with every route, a base run with
    ``/v1/completions`` and the tokenizer routes; with ``api_key``, only for requests that carry it."""
    import uvicorn

    from lapheads.runs import load_gpt_run, trained_on_conversations

    record, model, tokenizer = load_gpt_run(run_dir, device)
    chat = trained_on_conversations(record)  # a base run: completions and the tokenizer routes only
    engine = ChatEngine(model, tokenizer, tools=tools) if chat else CompletionEngine(model, tokenizer)
    loopback = host in LOOPBACK_NAMES
    if not loopback and api_key is None:
        print(
            f"lapheads serve: warning: listening on {host}, beyond this machine; anyone who can reach it can use "
            "the model (there is no authentication)",
            file=sys.stderr,
            flush=True,
        )
    # Bound to one address: requests must name it (or loopback); bound to all: any name (DNS-rebinding checks off).
    allowed = LOOPBACK_NAMES if loopback else (None if host in ("0.0.0.0", "::") else (*LOOPBACK_NAMES, host.lower()))
    app = create_app(engine, Path(run_dir).name, limits, temperature, top_k, allowed, api_key)
    routes = "the web chat, /v1/chat/completions, /v1/completions" if chat else "/v1/completions (a base run)"
    print(f"lapheads serve: {run_dir} on http://{host}:{port}/: {routes} (Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>lapheads chat: {{NAME}}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font-family: system-ui, sans-serif; max-width: 46rem; margin: 0 auto; padding: 1rem; }
 #messages { display: flex; flex-direction: column; gap: .6rem; margin-bottom: 1rem; }
 .user, .assistant { white-space: pre-wrap; padding: .5rem .8rem; border-radius: .6rem; }
 .user { align-self: flex-end; background: #e3ecff; } .assistant { background: #f2f2f2; }
 .error { color: #b00020; } form { display: flex; gap: .5rem; } textarea { flex: 1; min-height: 3rem; }
</style></head>
<body>
<h1>lapheads chat: {{NAME}}</h1>
<div id="messages"></div>
<form id="form"><textarea id="prompt" placeholder="Ask something (Enter sends)"></textarea>
<button id="send" type="submit">Send</button><button id="clear" type="button">New chat</button></form>
<script>
const conversation = []; let key = "";
function ask() {
  const headers = {"Content-Type": "application/json"}; if (key) headers["Authorization"] = "Bearer " + key;
  return fetch("/chat/completions", {method: "POST", headers, body: JSON.stringify({messages: conversation})});
}
const box = document.getElementById("messages"), prompt = document.getElementById("prompt");
function add(role, text) {
  const div = document.createElement("div"); div.className = role; div.textContent = text;
  box.appendChild(div); return div;
}
async function send() {
  const text = prompt.value.trim(); if (!text) return;
  prompt.value = ""; add("user", text); conversation.push({role: "user", content: text});
  const out = add("assistant", ""); let reply = "";
  try {
    let response = await ask();
    if (response.status === 401) { key = window.prompt("This server's API key:") || ""; response = await ask(); }
    if (!response.ok) { const err = await response.json(); throw new Error(err.error); }
    const reader = response.body.getReader(), decoder = new TextDecoder(); let buffer = "";
    while (true) {
      const {value, done} = await reader.read(); if (done) break;
      buffer += decoder.decode(value, {stream: true});
      const events = buffer.split("\\n\\n"); buffer = events.pop();
      for (const event of events) {
        const data = JSON.parse(event.replace(/^data: /, ""));
        if (data.token !== undefined) { reply += data.token; out.textContent = reply; }
      }
    }
    conversation.push({role: "assistant", content: reply || " "});
  } catch (err) { out.className = "assistant error"; out.textContent = "error: " + err.message; conversation.pop(); }
  out.dataset.done = "true";
}
document.getElementById("form").addEventListener("submit", e => { e.preventDefault(); send(); });
prompt.addEventListener("keydown", e => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
document.getElementById("clear").addEventListener("click", () => { conversation.length = 0; box.innerHTML = ""; });
</script></body></html>
"""
