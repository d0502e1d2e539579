"""Red team, the web server (issue 28): every hostile request (oversized, malformed, nested, wrong types, bad
sampling values) is refused with its HTTP status and a one-line JSON error, before any work is done.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Request:
    name: str
    body: object  # bytes as sent, or a value sent as JSON
    status: int
    says: str
    headers: tuple[tuple[str, str], ...] = ()
    method: str = "POST"
    path: str = "/chat/completions"


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def _serve_cases() -> list[Request]:
    cases = [
        Request("a list", [], 400, "not a JSON object"),
        Request("a string", "hi", 400, "not a JSON object"),
        Request("a number", 1, 400, "not a JSON object"),
        Request("an empty body", b"", 400, "not a JSON object"),
        Request("JSON null", b"null", 400, "not a JSON object"),
        Request("torn JSON", b'{"messages": ', 400, "Expecting value"),
        Request("not UTF-8", b"\xff\xfe\x00", 400, ""),
        Request("deep nesting", b"[" * 1_500 + b"]" * 1_500, 400, "nests too deeply"),
        Request("deep nesting in an object", b'{"a":' * 1_500 + b"1" + b"}" * 1_500, 400, "nests too deeply"),
        Request("30k brackets", b"[" * 30_000 + b"]" * 30_000, 413, "allowed: at most"),
        Request("a big body", {"messages": [{"role": "user", "content": "x" * 30_000}]}, 413, "allowed: at most"),
        # the page's body is validated by its schema (lapheads.apps.schema.PageChatBody), as OpenAI's is
        Request("no messages", {}, 400, "messages None; allowed: a non-empty list"),
        Request("messages not a list", {"messages": "hi"}, 400, "messages 'hi'; allowed: a non-empty list"),
        Request("messages an object", {"messages": {"role": "user"}}, 400, "allowed: a non-empty list"),
        Request("empty messages", {"messages": []}, 400, "'messages' must be a non-empty list"),
        Request("a message not an object", {"messages": [1]}, 400, "message 0 needs role"),
        Request("no role", {"messages": [{"content": "x"}]}, 400, "message 0 needs role"),
        Request("an unknown role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "message 0 needs role"),
        Request("a role of another type", {"messages": [{"role": 1, "content": "x"}]}, 400, "message 0 needs role"),
        Request("no content", {"messages": [{"role": "user"}]}, 400, "message 0 has empty or non-text content"),
        Request("blank content", {"messages": [{"role": "user", "content": " \n"}]}, 400, "empty or non-text"),
        Request("numeric content", {"messages": [{"role": "user", "content": 5}]}, 400, "empty or non-text"),
        Request("list content", {"messages": [{"role": "user", "content": ["x"]}]}, 400, "empty or non-text"),
        Request(
            "a long message",
            {"messages": [{"role": "user", "content": "x" * 1_500}]},
            400,
            "1500 characters; allowed: at most 1000",
        ),
        Request("too many messages", {"messages": [{"role": "user", "content": "x"}] * 9}, 400, "9 messages"),
        Request(
            "the assistant's turn last",
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            400,
            "the last message must be the user's",
        ),
        Request(
            "a conversation past the context",
            {"messages": [{"role": "user", "content": "word " * 190}]},
            400,
            "start a new chat",
        ),
    ]
    bad_options = {  # null is no bad value: it asks for the default, as in OpenAI's API
        "temperature": [-1, 2.5, "0.5", True, [0.5], {"v": 1}, 1e308],
        "top_k": [2.5, -1, 201, "5", True, 1e9, [5]],
        "max_tokens": [0, -1, 25, 2.5, "10", True, 10**20],
    }
    for option, values in bad_options.items():
        for value in values:
            cases.append(Request(f"{option} {value!r}", _chat(**{option: value}), 400, f"{option} "))
    for literal in ("NaN", "Infinity", "-Infinity"):
        body = json.dumps(_chat()).replace('"messages"', f'"temperature": {literal}, "messages"').encode()
        cases.append(Request(f"temperature {literal}", body, 400, "temperature"))
    hello = json.dumps(_chat()).encode()
    cases += [
        Request("text/plain", hello, 415, "allowed: application/json", (("content-type", "text/plain"),)),
        Request(
            "a form", hello, 415, "allowed: application/json", (("content-type", "application/x-www-form-urlencoded"),)
        ),
        Request("multipart", hello, 415, "allowed: application/json", (("content-type", "multipart/form-data"),)),
        Request("no content type", hello, 415, "allowed: application/json", (("content-type", ""),)),
        Request("a foreign host", hello, 403, "Host 'evil.example'", (("host", "evil.example"),)),
        Request("a foreign host and port", hello, 403, "Host 'evil.example'", (("host", "evil.example:8000"),)),
        Request("a rebinding name", hello, 403, "Host '127.0.0.1.nip.io'", (("host", "127.0.0.1.nip.io:8000"),)),
        Request("a foreign origin", hello, 403, "Origin 'http://evil.example'", (("origin", "http://evil.example"),)),
        Request("a null origin", hello, 403, "Origin 'null'", (("origin", "null"),)),
        Request("a declared length over the limit", hello, 413, "allowed: at most", (("content-length", "10000000"),)),
        Request("GET on the chat", None, 405, "Method Not Allowed", method="GET"),
        Request("PUT on the chat", hello, 405, "Method Not Allowed", method="PUT"),
        Request("DELETE on the chat", None, 405, "Method Not Allowed", method="DELETE"),
        Request("an unknown path", hello, 404, "Not Found", path="/v1/admin"),
        Request("a path escaping", None, 404, "Not Found", method="GET", path="/../../etc/passwd"),
    ]
    return cases


SERVE = _serve_cases()


@pytest.fixture(scope="module")
def server(sft_run):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from lapheads.apps.chat import ChatEngine
    from lapheads.apps.serve import create_app
    from lapheads.apps.serving import ServeLimits
    from lapheads.runs import load_gpt_run

    _, model, tokenizer = load_gpt_run(sft_run, "cpu")
    engine = ChatEngine(model, tokenizer)
    limits = ServeLimits(max_request_bytes=20_000, max_messages=8, max_message_chars=1_000, max_tokens=24)
    return TestClient(
        create_app(engine, "tiny", limits), base_url="http://127.0.0.1:8000", raise_server_exceptions=True
    )


@pytest.mark.parametrize("case", SERVE, ids=[c.name for c in SERVE])
def test_serve(case, server):
    headers = {"content-type": "application/json", **dict(case.headers)}
    if case.body is None:
        content = None
    elif isinstance(case.body, bytes):
        content = case.body
    else:
        content = json.dumps(case.body).encode()
    response = server.request(case.method, case.path, content=content, headers=headers)
    assert response.status_code == case.status, (case.name, response.text[:300])
    payload = response.json()
    error = payload.get("error", payload.get("detail"))
    if case.path.startswith("/v1/"):  # OpenAI's error object, as its clients read it
        error = error["message"]
    assert isinstance(error, str) and case.says in error and "\n" not in error, (case.name, payload)


@pytest.mark.parametrize("limit", [1_000, 2_000, 100_000])
def test_serve_nesting_guard_ignores_the_recursion_limit(limit, server):
    """torch.compile raises the interpreter's recursion limit (1000 -> 2000): serve's guard must not depend on it."""
    import sys

    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        for body in (b"[" * 1_500 + b"]" * 1_500, b'{"a":' * 17 + b"1" + b"}" * 17):
            response = server.post("/chat/completions", content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400 and "nests too deeply" in response.json()["error"], response.text
        brackets_in_a_string = {"messages": [{"role": "user", "content": "[" * 5_000}]}
        response = server.post("/chat/completions", json=brackets_in_a_string)
        assert "nests too deeply" not in response.text
    finally:
        sys.setrecursionlimit(previous)
