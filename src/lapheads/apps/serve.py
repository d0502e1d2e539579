"""A local web chat with a mid/SFT run (``lapheads serve RUN_DIR``), after nanochat's ``chat_web``, and OpenAI's
chat completions; OpenAI's legacy completions and vLLM's tokenizer routes for any run, base runs included
(lapheads.apps.completions). In rooms, as vLLM's protocol / serving / router: the typed request bodies in
``lapheads.apps.schema``, what each endpoint does in ``lapheads.apps.serving``, and here the guards and the routes.

Design choices:

* **FastAPI + uvicorn, one page**: ``GET /`` is a self-contained HTML page (no external scripts or fonts);
  ``POST /chat/completions`` takes the whole conversation (``{"messages": [...], "temperature", "top_k",
  "max_tokens"}``) and streams the reply as server-sent events (``data: {"token": "..."}`` then
  ``data: {"done": true}``); ``GET /health`` says which run is served.
* **Stateless, so conversations cannot mix**: the browser keeps its conversation and sends it each turn; every
  reply is its own row of the batch's KV cache, at its own positions (``lapheads.apps.batching``).
* **Replies decoded together**: chat replies and legacy completions that arrive together (every choice of ``n``
  and every prompt of a list too) are decoded as one batch by one worker, one forward per step for all of them,
  each with its own sampling and seed (the same text as alone); a chat reply sent while a batch runs joins it at
  the next step (continuous batching). An echoed prompt's own forward takes its turn between the batch's steps.
* **The model leaves the HTTP side a CPU** (:func:`model_threads`): with ``--threads auto`` the model runs on the
  CPUs less one, as vLLM's CPU backend reserves one for its API server (``VLLM_CPU_NUM_OF_RESERVED_CPU``); on two
  cores a second model thread made the server slower, batched or not (docs/benchmarks.md).
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
* **Prometheus metrics, as vLLM's** (``GET /metrics``, :mod:`lapheads.apps.metrics`): vLLM's request metrics
  under the prefix ``lapheads:`` (running and waiting requests, tokens, time to first token, inter-token latency,
  end-to-end and queue times, tokens per forward), and the worker's time per phase. Behind the API key when there
  is one (Prometheus sends it as ``authorization: {credentials: KEY}``); vLLM leaves it open.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request  # the optional extra 'serve'; lapheads imports this module only to serve
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from lapheads.apps.batching import Batcher
from lapheads.apps.chat import ChatEngine
from lapheads.apps.completions import CompletionEngine
from lapheads.apps.metrics import ServingMetrics
from lapheads.apps.serving import MAX_JSON_DEPTH, ChatServing, CompletionServing, Refusal, ServeLimits
from lapheads.io import json_depth

__all__ = ["create_app", "model_threads", "serve", "served"]


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")


def _hostname(value: str) -> str:
    """The host of a Host header or an Origin URL, without scheme and port, lower case."""
    value = value.split("://", 1)[-1].split("/", 1)[0].lower()
    if value.startswith("["):  # [::1]:8000
        return value.split("]", 1)[0] + "]"
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _refuse(status: int, message: str, param: str | None = None) -> JSONResponse:
    """This server's one-line error (the page's routes)."""
    return JSONResponse({"error": " ".join(message.split())}, status_code=status)


def _refuse_openai(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error object, as its clients read it: the refused field in ``param``."""
    kind = {401: "invalid_request_error", 404: "not_found_error", 500: "server_error"}.get(status)
    code = {401: "invalid_api_key", 404: "model_not_found", 413: "request_too_large"}.get(status)
    error = {"message": " ".join(message.split()), "type": kind or "invalid_request_error", "param": param,
             "code": code or ("invalid_value" if param else None)}  # fmt: skip
    return JSONResponse({"error": error}, status_code=status)


def _refusal(request: Request, refused: Refusal) -> JSONResponse:
    """A refusal in its endpoint's shape: OpenAI's error object under /v1, one line elsewhere."""
    openai = request.url.path.startswith("/v1/")
    return (_refuse_openai if openai else _refuse)(refused.status, str(refused), refused.param)


def _unknown_route(request: Request, err: StarletteHTTPException) -> JSONResponse:
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


def _key_refusal(request: Request, api_key: str | None) -> Refusal | None:
    """With an API key, a request without it (but to the page and /health) is a 401, before any work."""
    if api_key is None or request.url.path in ("/", "/health"):
        return None
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode()):
        return None
    return Refusal(401, "a missing or wrong API key; allowed: the header 'Authorization: Bearer KEY' with this "
                   "server's key")  # fmt: skip


async def _read_json(request: Request, allowed_hosts: tuple[str, ...] | None, max_bytes: int) -> Any:
    """The request's JSON body, or a :class:`Refusal`: Host, Origin, type, size, nesting, syntax."""
    host = _hostname(request.headers.get("host", ""))
    if allowed_hosts is not None and host not in allowed_hosts:
        raise Refusal(403, f"Host {host!r}; allowed: {', '.join(allowed_hosts)} (this server's own names)")
    origin = request.headers.get("origin")
    if origin is not None and _hostname(origin) != host:
        raise Refusal(403, f"Origin {origin!r}; allowed: pages served by this server ({host})")
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise Refusal(415, f"Content-Type {media or 'none'!r}; allowed: application/json")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise Refusal(413, f"request of {declared} bytes; allowed: at most {max_bytes}")
    raw = bytearray()
    async for chunk in request.stream():  # counted as it arrives: chunked bodies declare no length
        raw += chunk
        if len(raw) > max_bytes:
            raise Refusal(413, f"request of over {max_bytes} bytes; allowed: at most that")
    if json_depth(bytes(raw)) > MAX_JSON_DEPTH:
        raise Refusal(400, "the request nests too deeply; allowed: the endpoint's JSON object")
    try:
        return json.loads(bytes(raw) or b"null")
    except (RecursionError, ValueError) as err:
        raise Refusal(400, f"the request is not JSON: {' '.join(str(err).split())[:200]}") from None


def create_app(
    engine: ChatEngine | CompletionEngine,
    name: str = "lapheads",
    limits: ServeLimits | None = None,
    temperature: float = 0.6,
    top_k: int = 50,
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_NAMES,
    api_key: str | None = None,
):
    """The FastAPI app serving ``engine``: the guards and one short route per endpoint, the work in
    :mod:`lapheads.apps.serving`; ``temperature`` and ``top_k`` apply where a request leaves them out.

    Args:
        engine: a chat run's ChatEngine (every route), or a base run's CompletionEngine (``/v1/completions`` and
            the tokenizer routes; the chat routes refuse in one line).
        allowed_hosts: host names the Host header may carry (None: any, for a server bound to every address).
        api_key: the key every route but ``/`` and ``/health`` wants as ``Authorization: Bearer KEY`` (None: none).
    """
    limits = limits or ServeLimits()
    metrics = ServingMetrics(name)
    batcher = Batcher(engine.model, limits.max_num_seqs, metrics=metrics)
    completions = CompletionServing(CompletionEngine(engine.model, engine.tokenizer), batcher, name, limits,
                                    temperature, top_k)  # fmt: skip
    chats = ChatServing(engine, batcher, name, limits, temperature, top_k) if isinstance(engine, ChatEngine) else None
    app = FastAPI(title=f"lapheads chat: {name}", docs_url=None, redoc_url=None)
    app.add_exception_handler(StarletteHTTPException, _unknown_route)
    app.add_exception_handler(Refusal, _refusal)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        refused = _key_refusal(request, api_key)
        return _refusal(request, refused) if refused is not None else await call_next(request)

    async def chat_request(request: Request, openai: bool) -> tuple[dict[str, Any], list[int], list]:
        if chats is None:
            raise Refusal(400, f"{name} was never trained on conversations; allowed: POST /v1/completions")
        body, prompt = chats.check(await _read_json(request, allowed_hosts, limits.max_request_bytes), openai)
        return body, prompt, await run_in_threadpool(chats.start, body, prompt)  # off the event loop

    @app.post("/chat/completions")
    async def page_chat(request: Request):
        """The web page's endpoint: server-sent events {"token"} ... {"done": true} (or {"error"})."""
        _, _, replies = await chat_request(request, openai=False)
        return StreamingResponse(chats.page_events(replies[0]), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def openai_chat(request: Request):
        """OpenAI's chat completions: a chat.completion object, or with "stream" chunks ending in [DONE]."""
        body, prompt, replies = await chat_request(request, openai=True)
        if body["stream"]:
            return StreamingResponse(chats.chunks(body, prompt, replies), media_type="text/event-stream")
        return await run_in_threadpool(chats.completion, prompt, replies)  # off the event loop (issue 76)

    @app.post("/v1/completions")
    async def openai_completions(request: Request):
        """OpenAI's legacy completions (what lm-eval's ``local-completions`` model calls): a text_completion object,
        or with "stream" chunks ending in [DONE]."""
        body = await _read_json(request, allowed_hosts, limits.max_request_bytes)
        started = await run_in_threadpool(completions.start, body)  # off the event loop
        if started.request.stream:
            return StreamingResponse(completions.chunks(started), media_type="text/event-stream")
        return await run_in_threadpool(completions.complete, started)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return completions.tokenize(await _read_json(request, allowed_hosts, limits.max_request_bytes))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return completions.detokenize(await _read_json(request, allowed_hosts, limits.max_request_bytes))

    app.get("/tokenizer_info")(completions.tokenizer_info)
    app.get("/", response_class=HTMLResponse)(lambda: PAGE.replace("{{NAME}}", name.replace("<", "&lt;")))
    app.get("/health")(lambda: {"status": "ok", "run": name})
    models = {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "lapheads"}]}
    app.get("/v1/models")(lambda: models)
    app.get("/metrics")(lambda: Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST))
    return app


def model_threads(cpus: int) -> int:
    """Torch's threads for the served model when the user did not choose (module docstring): ``cpus`` less the one
    the HTTP side keeps, at least one."""
    return max(1, cpus - 1)


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
    name: str | None = None,
) -> None:
    """Load ``run_dir`` and serve it until interrupted: a mid or sft run with every route, a base run with
    ``/v1/completions`` and the tokenizer routes; with ``api_key``, only for requests that carry it; ``name``: the
    model's name in the API (default: the run directory's)."""
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
    app = create_app(engine, name or Path(run_dir).name, limits, temperature, top_k, allowed, api_key)
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
