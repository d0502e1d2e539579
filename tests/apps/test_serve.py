"""lapheads serve: streamed replies equal the engine's, limits are one-line errors, concurrent chats do not mix, and
the page works end to end in a real headless browser."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from lapheads.apps.chat import ChatEngine  # noqa: E402
from lapheads.apps.serve import create_app  # noqa: E402
from lapheads.apps.serving import ServeLimits  # noqa: E402
from lapheads.data.conversations import render_for_completion  # noqa: E402
from lapheads.runs import load_gpt_run  # noqa: E402
from tests.conftest import served  # noqa: E402

QUESTIONS = [
    "Ada has 23 coins and gets 45 more. How many coins does Ada have now?",
    "How many 'o' are there in 'zoo'?",
    "Eve had 50 pens and gave away 7. How many pens does Eve have left?",
]


@pytest.fixture(scope="module")
def engine(sft_run):
    _, model, tokenizer = load_gpt_run(sft_run, "cpu")
    return ChatEngine(model, tokenizer)


@pytest.fixture(scope="module")
def client(engine):
    app = create_app(engine, "tiny", ServeLimits(max_request_bytes=4000, max_tokens=24))
    return TestClient(app, base_url="http://127.0.0.1:8000")


def _expected(engine, messages, max_tokens=24):
    prompt = render_for_completion(engine.tokenizer, {"messages": messages})
    return "".join(engine.stream(prompt, max_tokens, 0.0, None))


def _reply(client, messages, **options):
    with client.stream("POST", "/chat/completions", json={"messages": messages, "temperature": 0, **options}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == {"done": True}
    return "".join(e["token"] for e in events[:-1]), len(events) - 1


def test_the_page_and_health_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and 'id="prompt"' in page.text and "lapheads chat: tiny" in page.text
    assert "<script src" not in page.text  # self-contained: nothing fetched from elsewhere
    assert client.get("/health").json() == {"status": "ok", "run": "tiny"}


def test_a_streamed_reply_equals_the_engines_greedy_reply(client, engine):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    text, pieces = _reply(client, messages)
    assert text == _expected(engine, messages) and pieces > 1


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"messages": []}, 400, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "  "}]}, 400, "message 0 has empty or non-text content"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "message 0 needs role system, user or assistant"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            400,
            "the last message must be the user's",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000},
            400,
            "max_tokens 10000; allowed: an integer in [1, 24]",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature -1"),
        ({"messages": [{"role": "user", "content": "x" * 3000}]}, 400, "the conversation has"),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "allowed: at most 4000"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n 2; allowed: 1 here"),
    ],
)
def test_bad_requests_are_one_line_errors(client, body, status, message):
    response = client.post("/chat/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error and "\n" not in error


def test_concurrent_chats_do_not_mix(client, engine):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS] * 2
    with ThreadPoolExecutor(len(conversations)) as pool:
        replies = list(pool.map(lambda m: _reply(client, m)[0], conversations))
    assert replies == [_expected(engine, m) for m in conversations]


def _browser():
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not (chrome and driver):
        pytest.skip(
            "no headless browser: install Debian's chromium and chromium-driver (apt-get install chromium "
            "chromium-driver; quickstart.sh does this when run as root)"
        )
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.mark.slow
def test_the_web_chat_works_in_a_real_browser(sft_run, engine, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lapheads",
            "serve",
            str(sft_run),
            "--port",
            str(port),
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--device",
            "cpu",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    browser = None
    try:
        for _ in range(300):  # wait for the server to listen
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert server.poll() is None, server.stdout.read().decode()[-2000:]
            time.sleep(0.1)
        browser = _browser()
        browser.get(f"http://127.0.0.1:{port}/")
        messages = []
        for turn, question in enumerate(QUESTIONS[:2]):  # two turns: the page sends the whole conversation
            box = browser.find_element(By.ID, "prompt")
            box.send_keys(question)
            browser.find_element(By.ID, "send").click()
            WebDriverWait(browser, 120).until(
                lambda b: len(b.find_elements(By.CSS_SELECTOR, ".assistant[data-done='true']")) == turn + 1
            )
            shown = browser.find_elements(By.CSS_SELECTOR, ".assistant")[turn].text
            messages.append({"role": "user", "content": question})
            expected = _expected(engine, messages)  # greedy, as the server was started
            assert "error" not in browser.find_elements(By.CSS_SELECTOR, ".assistant")[turn].get_attribute("class")
            assert shown == expected.strip() and shown  # the browser shows text without edge whitespace
            assert browser.find_elements(By.CSS_SELECTOR, ".user")[turn].text == question
            messages.append({"role": "assistant", "content": expected or " "})
    finally:
        if browser is not None:
            browser.quit()
        server.terminate()
        server.wait(10)


# ------------------------------------------------------------------------------------------------------------------
# The red-team cases of issue 28: every one a JSON error before any work, never a traceback


def _post(client, content: bytes, **headers):
    return client.post("/chat/completions", content=content, headers={"content-type": "application/json", **headers})


HELLO = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.mark.parametrize(
    "content, headers, status, message",
    [
        (b"[" * 30_000 + b"]" * 30_000, {}, 413, "allowed: at most"),  # too big before it is too deep
        (b"[" * 1_500 + b"]" * 1_500, {}, 400, "nests too deeply"),
        (HELLO, {"content-type": "text/plain"}, 415, "allowed: application/json"),
        (HELLO, {"content-type": "application/x-www-form-urlencoded"}, 415, "allowed: application/json"),
        (HELLO, {"host": "evil.example:8000"}, 403, "Host 'evil.example'"),
        (HELLO, {"origin": "http://evil.example"}, 403, "Origin 'http://evil.example'"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "top_k": 2.5}).encode(), {}, 400, "top_k 2.5"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3.0}).encode(),
            {},
            400,
            "max_tokens 3.0",
        ),
        (b'{"messages": ', {}, 400, "Expecting value"),
        (b"\xff\xfe", {}, 400, ""),
    ],
    ids=[
        "30k brackets",
        "deep nesting",
        "text/plain",
        "form",
        "foreign host",
        "foreign origin",
        "float top_k",
        "float max_tokens",
        "torn JSON",
        "not UTF-8",
    ],
)
def test_hostile_requests_are_refused_in_one_json_line(client, content, headers, status, message):
    response = _post(client, content, **headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error and "\n" not in error


def test_a_chunked_body_over_the_limit_is_refused_as_it_streams(client):
    def chunks():
        for _ in range(2_000):  # 2 MB, no Content-Length: the server must stop counting at 4,000 bytes
            yield b" " * 1_000

    response = _post(client, chunks())
    assert response.status_code == 413 and "allowed: at most" in response.json()["error"]


def test_the_same_origin_page_and_loopback_names_are_allowed(client, engine):
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        with client.stream(
            "POST",
            "/chat/completions",
            content=json.dumps({"messages": [{"role": "user", "content": QUESTIONS[1]}], "temperature": 0}),
            headers={"content-type": "application/json; charset=utf-8", "host": host, "origin": f"http://{host}"},
        ) as r:
            assert r.status_code == 200, host


@pytest.mark.parametrize("temperature", [1e-40, 1e-12, 0])
def test_a_tiny_temperature_is_greedy_not_a_broken_stream(client, engine, temperature):
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    text, _ = _reply(client, messages, temperature=temperature)
    assert text == _expected(engine, messages)


def test_an_error_during_generation_ends_the_stream_with_an_error_event(engine, monkeypatch):
    app = create_app(engine, "tiny", ServeLimits(max_tokens=24))
    client = TestClient(app, base_url="http://127.0.0.1")
    from tests.apps.conftest import fail_at_the_second_draw

    fail_at_the_second_draw(monkeypatch, engine.tokenizer)
    with client.stream("POST", "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
        events = [json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "token" in events[0] and events[-1] == {"error": "generation failed: device lost second line"}


@pytest.fixture(scope="module")
def openai_server(engine):
    """A real uvicorn server on a free loopback port, in a thread: what the openai client talks to."""
    app = create_app(engine, "tiny", ServeLimits(max_request_bytes=4000, max_tokens=24), temperature=0.0)
    with served(app) as url:
        yield f"{url}/v1"


def test_the_openai_client_streams_and_completes_a_reply_equal_to_the_engines(openai_server, engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    expected = _expected(engine, messages)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected and len(chunks) > 3
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0 and chunks[-1].usage.prompt_tokens > 0
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24)
    assert whole.object == "chat.completion" and whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.total_tokens > whole.usage.prompt_tokens
    short = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2


def test_a_logit_bias_writes_the_reply_and_the_logprobs_stay_the_models(openai_server, engine):
    """OpenAI's logit_bias through the openai client: +100 on one token makes a greedy reply of it alone, and the
    log-probabilities reported are the model's own (the first token's alternatives are the unbiased reply's)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    (e,) = engine.tokenizer.encode("e")
    ask = dict(model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=6, temperature=0,
               logprobs=True, top_logprobs=3)  # fmt: skip
    plain = client.chat.completions.create(**ask).choices[0]
    biased = client.chat.completions.create(**ask, logit_bias={str(e): 100}).choices[0]
    assert biased.message.content == "eeeeee" != plain.message.content and biased.finish_reason == "length"
    first = lambda choice: [(t.token, round(t.logprob, 5)) for t in choice.logprobs.content[0].top_logprobs]  # noqa: E731
    assert first(biased) == first(plain)


@pytest.mark.parametrize(
    ("options", "status", "says"),
    [
        ({"model": "gpt-4o"}, 404, "model 'gpt-4o'; allowed: 'tiny'"),
        ({"n": 9}, 400, "n 9; allowed: an integer in [1, 8]"),
        ({"stop": [str(i) for i in range(17)]}, 400, "allowed: a string or a list of up to 16 non-empty strings"),
        ({"stop": "x" * 300}, 400, "non-empty strings of at most 200 characters"),  # once held the event loop
        ({"stream_options": {"include_usage": True}}, 400, "stream_options {'include_usage': True}; allowed: only"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            400,
            "message 0 content part 0: text 5; allowed: a string",  # was HTTP 500
        ),
        ({"service_tier": "gold"}, 400, "service_tier 'gold'; allowed: 'auto'"),
        ({"top_p": 0}, 400, "top_p 0; allowed: a number in (0, 1]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "content part of type 'image_url'; allowed: text parts",
        ),
        ({"max_tokens": 10_000}, 400, "max_tokens 10000; allowed"),
        ({"messages": []}, 400, "'messages' must be a non-empty list"),
        ({"top_logprobs": 3}, 400, "top_logprobs only with logprobs true"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs 21; allowed: an integer in [0, 20]"),
        ({"logit_bias": {"5": 101}}, 400, "logit_bias {'5': 101}; allowed: up to 1024 pairs of a token id"),
        ({"logit_bias": {"x": 1}}, 400, "logit_bias {'x': 1}; allowed: up to 1024 pairs of a token id"),
        ({"logit_bias": {"100000": 1}}, 400, "logit_bias token '100000'; allowed: token ids in [0, "),
        ({"frequency_penalty": 2.5}, 400, "frequency_penalty 2.5; allowed: a number in [-2, 2]"),
        ({"tool_choice": "auto"}, 400, "tool_choice='auto' is not supported"),
        ({"extra_body": {"typical_p": 0.1}}, 400, "unrecognized request argument 'typical_p'"),
        ({"extra_body": {"repetition_penalty": 0}}, 400, "repetition_penalty 0; allowed: a number in (0, 2]"),
        ({"extra_body": {"ignore_eos": 1}}, 400, "ignore_eos 1; allowed: true or false"),
        ({"extra_body": {"min_p": -0.1}}, 400, "min_p -0.1; allowed: a number in [0, 1]"),
        (
            {"max_tokens": 8, "extra_body": {"min_tokens": 9}},
            400,
            "min_tokens 9; allowed: an integer in [0, max_tokens 8]",
        ),
        ({"extra_body": {"stop_token_ids": [10**6]}}, 400, "stop_token_ids token 1000000; allowed: token ids in [0, "),
        ({"seed": -1}, 400, "seed -1; allowed: an integer"),
    ],
)
def test_the_openai_client_gets_openais_error_objects(openai_server, options, status, says):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **options}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**request)
    assert caught.value.status_code == status and says in caught.value.body["message"], caught.value.body


def _openai_reply(client, seed=None, content=QUESTIONS[1]):
    options = {} if seed is None else {"seed": seed}
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], temperature=1.0, max_tokens=24, **options
    )
    return reply.choices[0].message.content


def test_a_requests_seed_reproduces_its_sample_and_no_seed_samples_afresh(openai_server):
    """Issue 58: every request used to sample with seed 0, so repeated sampling returned one answer."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    assert _openai_reply(client, 7) == _openai_reply(client, 7)  # a given seed reproduces
    seeded = {_openai_reply(client, seed) for seed in range(6)}
    unseeded = {_openai_reply(client) for _ in range(6)}
    assert len(seeded) > 1 and len(unseeded) > 1  # temperature 1 over 24 tokens: different seeds, different replies


def test_a_prefilled_reply_continues_the_assistants_started_message(openai_server, engine):
    """vLLM's continue_final_message: the model continues the last (assistant) message inside its turn, the reply
    holds the new text only, streamed or not, and the prompt counts the prefill; the combinations vLLM refuses, and
    a new turn the model would have to open itself, are refused by name."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    started = "The answer is"
    messages = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": started}]
    prompt = render_for_completion(engine.tokenizer, {"messages": messages[:1]}) + engine.tokenizer.encode(started)
    expected = "".join(engine.stream(prompt, 24, 0.0, None))
    prefill = {"continue_final_message": True, "add_generation_prompt": False}
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, extra_body=prefill)
    assert whole.choices[0].message.content == expected != _expected(engine, messages[:1])
    assert whole.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True, extra_body=prefill)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    refused = [
        ({"continue_final_message": True}, messages, "continue_final_message", "with add_generation_prompt true"),
        ({"add_generation_prompt": False}, messages[:1], "add_generation_prompt", "continue_final_message false with"),
        (prefill, messages[:1], None, "with continue_final_message the last message must be the assistant's"),
        ({}, messages, None, "the last message must be the user's (an assistant's to continue: continue_final_"),
    ]
    for extra, sent, param, says in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=sent, extra_body=extra)
        assert says in caught.value.body["message"] and caught.value.body.get("param") == param, caught.value.body


def test_a_refused_field_is_named_in_the_error_objects_param(openai_server):
    import urllib.error
    import urllib.request

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}
    request = urllib.request.Request(
        f"{openai_server}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(caught.value.read())["error"]
    assert caught.value.code == 400 and error["param"] == "tool_choice" and error["code"] == "invalid_value"
    assert error["type"] == "invalid_request_error" and "tool_choice='auto' is not supported" in error["message"]


def test_the_openai_client_gets_n_choices_stop_strings_top_p_text_parts_and_the_developer_role(openai_server, engine):
    """Issue 58: what client libraries send by default (content parts, the developer role) and what sampling needs
    (n, stop, top_p) are honoured as vLLM, llama.cpp's server and Ollama honour them."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    three = client.chat.completions.create(model="tiny", messages=messages, temperature=1.0, max_tokens=24, n=3, seed=5)
    assert [c.index for c in three.choices] == [0, 1, 2] and len({c.message.content for c in three.choices}) > 1
    assert three.choices[1].message.content == _openai_reply(client, 6)  # choice i samples with seed + i
    streamed = client.chat.completions.create(
        model="tiny", messages=messages, temperature=1.0, max_tokens=24, n=3, seed=5, stream=True
    )
    by_index = {}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
    assert [by_index[i] for i in range(3)] == [c.message.content for c in three.choices]
    # stop: the reply ends before the first stop string, which is not shown
    greedy = _expected(engine, messages)
    cut = greedy[3:5]
    stopped = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=24, stop=[cut])
    assert stopped.choices[0].message.content == greedy[: greedy.index(cut)]
    assert stopped.choices[0].finish_reason == "stop"
    pieces = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=24, stop=cut, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == greedy[: greedy.index(cut)]
    # top_p: a nucleus this small holds the likeliest token alone, so sampling at temperature 1 is greedy
    nucleus = client.chat.completions.create(
        model="tiny", messages=messages, temperature=1.0, top_p=1e-6, max_tokens=24, seed=3
    )
    assert nucleus.choices[0].message.content == greedy
    # min_p 1 (vLLM's extension) keeps only the likeliest token too
    least = client.chat.completions.create(
        model="tiny", messages=messages, temperature=1.0, max_tokens=24, seed=3, extra_body={"min_p": 1.0}
    )
    assert least.choices[0].message.content == greedy
    # text parts and the developer role read as a string and the system role
    parts = [{"type": "text", "text": QUESTIONS[1][:10]}, {"type": "text", "text": QUESTIONS[1][10:]}]
    as_parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], temperature=0, max_tokens=24
    )
    assert as_parts.choices[0].message.content == greedy
    system = [{"role": "system", "content": "Be brief."}, *messages]
    developer = [{"role": "developer", "content": "Be brief."}, *messages]
    replies = [
        client.chat.completions.create(model="tiny", messages=m, temperature=0, max_tokens=24).choices[0].message
        for m in (system, developer)
    ]
    assert replies[0].content == replies[1].content


def test_stop_strings_hold_back_only_what_may_begin_one():
    from lapheads.apps.serving import until_stop

    outcome = {}
    assert list(until_stop(iter(["ab", "c<", "|e", "nd|>x"]), ["<|end|>"], outcome)) == ["ab", "c"]  # "<|e" held
    assert outcome == {"finish_reason": "stop", "stop_reason": "<|end|>"}
    assert "".join(until_stop(iter(["a<", "b"]), ["<|"], {})) == "a<b"
    assert "".join(until_stop(iter(["x", "STOP", "y"]), ["ST"], {})) == "x"


def test_logprobs_are_the_models_log_softmax_at_the_sampled_tokens(openai_server, engine):
    """Issue 58: logprobs were accepted and dropped (HTTP 200, logprobs null). Each sampled token's log-probability
    is the model's log-softmax at its position, with the top_logprobs likeliest beside it, in OpenAI's shape."""
    import torch

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert "".join(t.token for t in content) == reply.choices[0].message.content and len(content) == 8
    ids = render_for_completion(engine.tokenizer, {"messages": messages})
    model = engine.model
    with torch.no_grad():
        for position, token in enumerate(content):
            logp = model(torch.tensor([ids]))[0, -1].float().log_softmax(-1)
            chosen = int(logp.argmax())  # greedy: the sampled token is the likeliest
            assert token.token == engine.tokenizer.decode([chosen]) and token.bytes == list(token.token.encode())
            assert token.logprob == pytest.approx(float(logp[chosen]), abs=1e-4)
            best = logp.topk(3)
            assert [t.logprob for t in token.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
            assert token.top_logprobs[0].token == token.token
            ids.append(chosen)
    streamed = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=8, logprobs=True, stream=True
    )
    tokens = [
        t
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert [t.logprob for t in tokens] == [t.logprob for t in content] and all(t.top_logprobs == [] for t in tokens)
    plain = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8)
    assert plain.choices[0].logprobs is None


def test_unknown_routes_and_methods_answer_openais_error_object(openai_server):
    """Issue 58: unknown routes answered FastAPI's {"detail": ...}, so client.models.retrieve(id) got a 404
    without OpenAI's shape."""
    import urllib.error
    import urllib.request

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("tiny")
    error = caught.value.body
    assert error["type"] == "not_found_error" and error["code"] == "unknown_url"
    assert error["message"] == "GET /v1/models/tiny: Not Found"
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{openai_server}/chat/completions", timeout=30)  # GET on a POST route
    assert caught.value.code == 405 and json.loads(caught.value.read())["error"]["code"] == "method_not_allowed"


def test_the_openai_client_counts_usage_of_a_reply_a_stop_string_ended(openai_server, engine):
    """Issue 72: usage.completion_tokens was 0 when a stop string ended a chat reply, streamed or not (the count was
    set only once the generation loop finished, and stop handling never let it finish)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    greedy = _expected(engine, messages)
    cut = greedy[6:8]
    shown = len(engine.tokenizer.encode(greedy[: greedy.index(cut)]))
    stopped = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=24, stop=cut)
    assert stopped.choices[0].finish_reason == "stop"
    assert shown <= stopped.usage.completion_tokens < 24  # what was generated, up to and holding the stop string
    streamed = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=24, stop=cut, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [chunk.usage for chunk in streamed if chunk.usage is not None]
    assert [u.completion_tokens for u in usage] == [stopped.usage.completion_tokens]


def test_vllms_ignore_eos_min_tokens_and_stop_token_ids_end_a_chat_reply_where_vllms_would(openai_server, engine):
    """The chat endpoint's vLLM extensions (extra_body), greedy, the end of turn pushed to the top: the reply ends
    at once; with ignore_eos it runs to max_tokens; with min_tokens it is the unbiased reply's first tokens, then
    ends; an ordinary stop_token_id ends the reply with itself, counted in the usage; a stop string in the first
    min_tokens tokens' text is passed over, streamed as whole."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    end, (e,) = engine.ids["assistant_end"], engine.tokenizer.encode("e")
    ask = dict(model="tiny", messages=[{"role": "user", "content": QUESTIONS[2]}], max_tokens=10, temperature=0,
               logprobs=True)  # fmt: skip

    reasons = []  # vLLM's stop_reason of each reply, streamed or not

    def reply(stream=False, **extra):
        if stream:
            chunks = list(client.chat.completions.create(**ask, **extra, stream=True))
            reasons.append(chunks[-1].choices[0].stop_reason)
            return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason, None
        out = client.chat.completions.create(**ask, **extra)
        reasons.append(out.choices[0].stop_reason)
        return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.completion_tokens

    plain, _, _ = reply()
    tokens = [t.token for t in client.chat.completions.create(**ask).choices[0].logprobs.content]
    to_end = {"logit_bias": {str(end): 100}}
    assert reply(**to_end) == ("", "stop", 0)
    assert reply(**to_end, extra_body={"ignore_eos": True})[1:] == ("length", 10)
    assert reply(**to_end, extra_body={"min_tokens": 4}) == ("".join(tokens[:4]), "stop", 4)
    assert reply(logit_bias={str(e): 100}, extra_body={"stop_token_ids": [e]}) == ("e", "stop", 1)
    assert reasons[1:] == [None, None, None, e]  # the end of turn, the length, min_tokens' end of turn, the stop id
    stop, least = plain[1:3], 4
    cut = plain.find(stop, len("".join(tokens[:least])) - len(stop) + 1)
    expected = plain if cut < 0 else plain[:cut]
    assert reply(stop=[stop])[0] == plain[:1] != expected
    for stream in (False, True):
        assert reply(stream, stop=[stop], extra_body={"min_tokens": least})[0] == expected
        assert reply(stream, stop=[stop], extra_body={"include_stop_str_in_output": True})[0] == plain[:3]
        assert reasons[-1] == stop


def test_fields_openai_accepts_are_accepted_and_change_nothing_and_many_stops_are_taken(openai_server):
    """Issue 72: store, metadata, parallel_tool_calls, service_tier and reasoning_effort were refused as
    unrecognized (OpenAI accepts them; vLLM accepts and ignores them), and lm-eval's 6 stop strings aborted a task."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=openai_server, api_key="unused", max_retries=0)
    request = {"model": "tiny", "messages": [{"role": "user", "content": QUESTIONS[1]}], "temperature": 0}
    plain = client.chat.completions.create(**request, max_tokens=12).choices[0].message.content
    ignored = client.chat.completions.create(
        **request, max_tokens=12, store=True, metadata={"run": "a"}, parallel_tool_calls=False,
        service_tier="auto", reasoning_effort="low",
    )  # fmt: skip
    assert ignored.choices[0].message.content == plain
    eight = client.chat.completions.create(**request, max_tokens=12, stop=[f"<stop{i}>" for i in range(8)])
    assert eight.choices[0].message.content == plain  # none of them appears
    tiny_nucleus = client.chat.completions.create(**request, max_tokens=12, top_p=1e-300)  # was HTTP 500
    assert tiny_nucleus.choices[0].message.content == plain
    twice = client.completions.create(model="tiny", prompt="To be", max_tokens=3, n=2, temperature=0)
    once = client.completions.create(model="tiny", prompt="To be", max_tokens=3, n=1, temperature=0)
    assert twice.usage.prompt_tokens == once.usage.prompt_tokens  # a prompt counts once, whatever n


def test_chat_logprobs_cover_exactly_the_content_when_the_calculator_writes_into_it(engine, monkeypatch):
    """Issue 72: with the calculator on (the default), the content showed the tool's inserted output while the
    logprobs listed only the sampled tokens (5 entries against 8 counted in usage). The model is steered into one
    calculator call; every token of the content, the tool's included, has an entry whose text is the content's."""
    import lapheads.apps.batching as chat_module  # where a reply's tokens are sampled

    ids, real = engine.ids, chat_module.sample_rows
    script = [ids["python_start"], *engine.tokenizer.encode("2+2"), ids["python_end"]]
    calls = {"n": 0}

    def calculator_first(logits, *args, **kwargs):  # one request: one row
        calls["n"] += 1
        return [script[calls["n"] - 1]] if calls["n"] <= len(script) else real(logits, *args, **kwargs)

    monkeypatch.setattr(chat_module, "sample_rows", calculator_first)
    app = create_app(engine, "tiny", ServeLimits(max_request_bytes=4000, max_tokens=24), temperature=0.0)
    body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 12, "logprobs": True}
    reply = TestClient(app, base_url="http://127.0.0.1:8000").post("/v1/chat/completions", json=body).json()
    assert "choices" in reply, reply
    choice = reply["choices"][0]
    content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    assert content.startswith("[calc: 2+2 = 4]")
    assert "".join(e["token"] for e in entries) == content
    assert len(entries) == reply["usage"]["completion_tokens"] or choice["finish_reason"] == "stop"
    assert all(math.isfinite(e["logprob"]) and e["logprob"] <= 0 for e in entries)


def test_a_long_non_streamed_reply_does_not_hold_the_event_loop(engine, monkeypatch):
    """Issue 76: a non-streamed chat request generated on the event loop, so /health answered only after it (8 s).
    With each token slowed to 0.1 s, /health answers while a 24-token reply is being generated."""
    import threading

    import httpx

    import lapheads.apps.batching as chat_module  # where a reply's tokens are sampled

    real = chat_module.sample_rows

    def slow(*args, **kwargs):
        time.sleep(0.1)
        return real(*args, **kwargs)

    monkeypatch.setattr(chat_module, "sample_rows", slow)
    app = create_app(engine, "tiny", ServeLimits(max_request_bytes=4000, max_tokens=24), temperature=0.0)
    with served(app) as url:
        body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 24}
        long = threading.Thread(target=lambda: httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60))
        long.start()
        time.sleep(0.5)  # the reply is being generated
        started = time.perf_counter()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        answered = time.perf_counter() - started
        still_generating = long.is_alive()
        long.join()
    assert still_generating, answered  # answered before the reply was done (before: only after it)


def test_an_api_key_guards_every_route_but_the_page_and_health(engine):
    """Issue 72: as vLLM's --api-key: without the key a 401 before any work (OpenAI's error object under /v1)."""
    app = create_app(engine, "tiny", ServeLimits(max_tokens=4), temperature=0.0, api_key="s3cret")
    client = TestClient(app, base_url="http://127.0.0.1:8000")
    assert client.get("/health").status_code == 200 and client.get("/").status_code == 200
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        refused = client.post("/v1/chat/completions", json=body, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers=headers).status_code == 401
        assert client.post("/chat/completions", json={"messages": body["messages"]}, headers=headers).status_code == 401
    assert "Authorization" in client.get("/").text  # the page sends the key it asks for
    good = {"Authorization": "Bearer s3cret"}
    assert client.get("/v1/models", headers=good).json()["data"][0]["id"] == "tiny"
    assert client.post("/v1/chat/completions", json=body, headers=good).status_code == 200


def test_replies_sent_together_are_decoded_together_and_each_reads_as_alone(engine, monkeypatch):
    """Issue 72: requests that arrive together are decoded as one batch (one forward per step), each with its own
    seed; each reply's text is the one it gets alone. The n = 4 choices of one request go in one batch of 4 (seed
    + i each) and equal four requests sent one by one with those seeds; four clients at once read the same."""
    import httpx

    import lapheads.apps.batching as batching

    sizes = []

    class Recorded(batching.Decoding):  # the size of each batch as it starts
        def __init__(self, model, requests, on_token=None):
            sizes.append(len(requests))
            super().__init__(model, requests, on_token)

    monkeypatch.setattr(batching, "Decoding", Recorded)
    app = create_app(engine, "tiny", ServeLimits(max_request_bytes=4000, max_tokens=16), temperature=1.0)
    ask = {"messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 16, "temperature": 1.0}
    with served(app) as url:

        def reply(body: dict) -> list[str]:
            out = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
            return [choice["message"]["content"] for choice in out["choices"]]

        alone = [reply({**ask, "seed": 7 + i})[0] for i in range(4)]
        assert sizes == [1, 1, 1, 1]
        assert reply({**ask, "seed": 7, "n": 4}) == alone and sizes[-1] == 4
        with ThreadPoolExecutor(4) as pool:
            at_once = list(pool.map(lambda i: reply({**ask, "seed": 7 + i})[0], range(4)))
    assert at_once == alone and len(set(alone)) > 1  # sampled: the seeds differ, so do the replies


def test_serve_runs_the_model_on_the_cpus_the_http_side_leaves(monkeypatch):
    """``lapheads serve --threads auto`` keeps one CPU for the HTTP side (as vLLM's reserved CPU); an explicit
    --threads, or OMP_NUM_THREADS, is taken as it is."""
    import torch

    from lapheads.apps import serve as serve_module
    from lapheads.apps.serve import model_threads
    from lapheads.cli import commands
    from lapheads.cli.parser import build_parser

    assert [model_threads(n) for n in (1, 2, 16)] == [1, 1, 15]
    seen: list[int] = []
    monkeypatch.setattr(serve_module, "serve", lambda *args, **kwargs: seen.append(torch.get_num_threads()))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        for argv, expected in ((["serve", "RUN"], 1), (["serve", "RUN", "--threads", "1"], 2)):
            torch.set_num_threads(2)  # what the command's thread policy chose before
            commands.cmd_serve(build_parser().parse_args(argv))
            assert seen[-1] == expected, argv
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        commands.cmd_serve(build_parser().parse_args(["serve", "RUN"]))
        assert seen[-1] == 2
    finally:
        torch.set_num_threads(before)


def _scrape(client, **headers) -> dict[tuple[str, tuple], float]:
    """``GET /metrics`` parsed by prometheus_client's own parser: (sample name, its labels but model_name) ->
    value."""
    from prometheus_client.parser import text_string_to_metric_families

    answer = client.get("/metrics", headers=headers)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == "tiny"
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_metrics_count_what_the_replies_say_under_vllms_names(engine):
    """``GET /metrics`` (Prometheus, vLLM's metric names under ``lapheads:``): after chat replies sent together and
    one by one, the token counters equal the replies' usage, every request has one time to first token, one
    end-to-end latency and one queue time, its other tokens one inter-token latency each, and every forward (a
    prefill, a step) its token count; the worker's phases are counted, and nothing is left running."""
    app = create_app(engine, "tiny", ServeLimits(max_tokens=12), temperature=1.0)
    client = TestClient(app, base_url="http://127.0.0.1:8000")
    ask = {"messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 12}
    usages = [client.post("/v1/chat/completions", json={**ask, "seed": seed}).json()["usage"] for seed in range(2)]
    with ThreadPoolExecutor(3) as pool:  # together: one batch, joiners prefilled beside it
        usages += pool.map(lambda s: client.post("/v1/chat/completions", json={**ask, "seed": s}).json()["usage"],
                           range(2, 5))  # fmt: skip
    m = _scrape(client)
    requests, generated = len(usages), sum(u["completion_tokens"] for u in usages)
    assert m["lapheads:generation_tokens_total", ()] == generated
    assert m["lapheads:prompt_tokens_total", ()] == sum(u["prompt_tokens"] for u in usages)
    ended = {k[1][0][1]: v for k, v in m.items() if k[0] == "lapheads:request_success_total"}
    assert sum(ended.values()) == requests and set(ended) <= {"stop", "length"}
    for latency in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert m[f"lapheads:{latency}_seconds_count", ()] == requests, latency
    assert m["lapheads:inter_token_latency_seconds_count", ()] == generated - requests
    phases = ("prefill", "prefill_joining", "decode", "sample")
    steps = {phase: m.get(("lapheads:step_seconds_count", (("phase", phase),)), 0) for phase in phases}
    forwards = m["lapheads:iteration_tokens_total_count", ()]
    assert forwards == steps["prefill"] + steps["prefill_joining"] + steps["decode"]
    assert steps["decode"] >= 12 - 1 and steps["sample"] >= steps["decode"]  # a reply of 12 tokens: 11 steps
    decoded_rows = m["lapheads:iteration_tokens_total_sum", ()] - m["lapheads:prompt_tokens_total", ()]
    assert generated - requests <= decoded_rows <= generated  # each token fed once, but a reply's last
    assert m["lapheads:num_requests_running", ()] == 0 and m["lapheads:num_requests_waiting", ()] == 0
    other = TestClient(create_app(engine, "tiny", ServeLimits(max_tokens=12)), base_url="http://127.0.0.1:8000")
    assert _scrape(other)["lapheads:generation_tokens_total", ()] == 0  # each server counts its own


def test_metrics_count_a_reader_that_left_as_aborted_and_want_the_api_key(engine):
    """A reply whose reader left (a closed stream) counts as finished_reason "abort", as vLLM's; with an API key
    ``/metrics`` wants it too (vLLM leaves it open; Prometheus sends it)."""
    app = create_app(engine, "tiny", ServeLimits(max_tokens=24), temperature=0.0, api_key="s3cret")
    client = TestClient(app, base_url="http://127.0.0.1:8000")
    key = {"Authorization": "Bearer s3cret"}
    assert client.get("/metrics").status_code == 401
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 24, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=key) as stream:
        next(stream.iter_lines())  # the first chunk, then the reader leaves
    for _ in range(200):  # the job ends at its next token
        m = _scrape(client, **key)
        if m.get(("lapheads:request_success_total", (("finished_reason", "abort"),))) == 1:
            break
        time.sleep(0.05)
    assert m["lapheads:request_success_total", (("finished_reason", "abort"),)] == 1
    assert m["lapheads:generation_tokens_total", ()] < 24


def test_serve_without_the_metrics_library_says_which_extra_to_install(monkeypatch, capsys):
    """`lapheads serve` where prometheus-client is missing (an install from before /metrics): one line naming the
    extra, exit 2, before any model loads."""
    from lapheads.cli import main

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import prometheus_client raises ImportError
    assert main(["serve", "no-such-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "prometheus-client" in err and "lapheads[serve]" in err


def test_served_model_name_names_the_model_in_the_api(sft_run, monkeypatch, capsys):
    """vLLM's --served-model-name: GET /v1/models lists it and requests name it (the run directory's name is then
    an unknown model); a name with a space is refused in one line before any model loads."""
    import torch
    import uvicorn

    from lapheads.cli import main

    apps, threads = [], torch.get_num_threads()
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))  # serve builds the app, then stops
    try:
        assert main(["serve", str(sft_run), "--served-model-name", "org/tiny-L1"]) == 0
    finally:
        torch.set_num_threads(threads)  # serve gives the model the CPUs the HTTP side leaves: not the suite's
    client = TestClient(apps[0], base_url="http://127.0.0.1:8000")
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["org/tiny-L1"]
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json={**ask, "model": "org/tiny-L1"}).status_code == 200
    assert client.post("/v1/chat/completions", json={**ask, "model": sft_run.name}).status_code == 404
    capsys.readouterr()
    assert main(["serve", str(sft_run), "--served-model-name", "my model"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--served-model-name 'my model': allowed:" in err


@pytest.fixture
def steered(engine, monkeypatch):
    """A client of a server whose model is steered into the reply 'ab€cd' and the end of its turn, one request at a
    time ('€' is three byte tokens in this tokenizer); every whole reply replays the script from its start."""
    import lapheads.apps.batching as batching  # where a reply's tokens are sampled

    script = [*engine.tokenizer.encode("ab€cd"), engine.ids["assistant_end"]]
    assert len(script) == len("ab€cd") + 3
    calls = {"n": 0}

    def scripted(logits, *args, **kwargs):  # one request: one row
        calls["n"] += 1
        return [script[(calls["n"] - 1) % len(script)]]

    monkeypatch.setattr(batching, "sample_rows", scripted)
    return TestClient(create_app(engine, "tiny", ServeLimits(max_tokens=24)), base_url="http://127.0.0.1:8000")


def test_a_character_split_over_byte_tokens_keeps_the_reply_after_it(steered):
    """A reply with a character the tokenizer spells in byte tokens: the server streamed U+FFFD for its first byte
    and then nothing more, and a non-streamed reply lost everything after it. Both forms give the whole text."""
    messages = [{"role": "user", "content": "hi"}]
    text, _ = _reply(steered, messages)
    assert text == "ab€cd"
    reply = steered.post("/v1/chat/completions", json={"messages": messages}).json()
    assert reply["choices"][0]["message"]["content"] == "ab€cd" and reply["choices"][0]["finish_reason"] == "stop"
    cut = steered.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}).json()  # the last
    assert cut["choices"][0]["message"]["content"] == "ab\ufffd"  # cut inside '€': shown as decoding shows it


def test_logprobs_cover_a_character_split_over_byte_tokens(steered):
    """The reply 'ab€cd' ('€' three byte tokens): its logprobs listed 5 of its 7 tokens (each byte counted as a
    U+FFFD character, so 'c' and 'd' fell past the content's length), with U+FFFD's bytes for each byte. Every token
    has an entry, the entries' texts join to the content (the character's text on its last byte), their bytes to
    the content's UTF-8, streamed or not."""
    client = steered
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    reply = client.post("/v1/chat/completions", json=body).json()
    entries = reply["choices"][0]["logprobs"]["content"]
    assert len(entries) == reply["usage"]["completion_tokens"] == 7
    assert [e["token"] for e in entries] == ["a", "b", "", "", "€", "c", "d"]
    assert bytes(b for e in entries for b in e["bytes"]) == "ab€cd".encode()
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [choice for c in chunks for choice in c["choices"]]
    streamed = [e for choice in choices if choice["logprobs"] for e in choice["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]
    assert "".join(choice["delta"].get("content", "") for choice in choices) == "ab€cd"
