"""lapheads serve's /v1/completions on a base run: the official openai client gets the model's own greedy text and
log-probabilities, seeds reproduce, unsupported fields are refused by name, and lm-evaluation-harness's
``local-completions`` model (with the server's tokenizer routes) scores the served run as lapheads' own lm-eval
model scores the run on disk."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
from lapheads.apps.completions import CompletionEngine  # noqa: E402
from lapheads.apps.serve import create_app  # noqa: E402
from lapheads.apps.serving import ServeLimits  # noqa: E402
from lapheads.runs import load_gpt_run  # noqa: E402
from lapheads.train.lm import train_lm  # noqa: E402
from tests.conftest import served, tiny_lm  # noqa: E402


@pytest.fixture(scope="module")
def base_run(text_root, tmp_path_factory):
    run = tmp_path_factory.mktemp("completions") / "base"
    train_lm(tiny_lm(text_root, num_iterations=4, eval_every=4), run)  # sequence_len 64
    return run


@pytest.fixture(scope="module")
def engine(base_run):
    _, model, tokenizer = load_gpt_run(base_run, "cpu")
    return CompletionEngine(model.eval(), tokenizer)


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, "base", ServeLimits(max_tokens=32), temperature=0.0)
    with served(app) as url:
        yield url


def _direct_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | BOS, ids[:i]) for every i, from one plain forward pass."""
    whole = [engine.tokenizer.bos_id, *ids]
    with torch.no_grad():
        logp = engine.model(torch.tensor([whole[:-1]])).float().log_softmax(-1)[0]
    return logp[torch.arange(len(ids)), torch.tensor(ids)]


def test_the_openai_client_gets_the_models_greedy_text_and_log_probabilities(server, engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    prompt = "ROMEO:\nWhat light"
    out = client.completions.create(model="base", prompt=prompt, max_tokens=8, echo=True, logprobs=2, temperature=0)
    (choice,) = out.choices
    assert choice.text.startswith(prompt) and out.usage.completion_tokens == 8
    ids = engine.tokenizer.encode(choice.text)
    assert len(choice.logprobs.token_logprobs) == len(ids)  # echo: every prompt token, then the completion's
    torch.testing.assert_close(
        torch.tensor(choice.logprobs.token_logprobs), _direct_logprobs(engine, ids), atol=1e-4, rtol=0
    )
    for logprob, top in zip(choice.logprobs.token_logprobs[len(prompt) :], choice.logprobs.top_logprobs[len(prompt) :]):
        assert len(top) <= 2 and logprob == pytest.approx(max(top.values()))  # greedy: the likeliest token
    assert choice.logprobs.text_offset[:3] == [0, 1, 2]


def test_seeds_reproduce_n_choices_differ_and_stop_strings_stop(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")

    def texts(**options):
        out = client.completions.create(model="base", prompt="KING:", max_tokens=16, temperature=1.0, **options)
        return [choice.text for choice in out.choices]

    assert texts(seed=5) == texts(seed=5)
    three = texts(seed=5, n=3)
    assert len(three) == 3 and len(set(three)) > 1 and three[0] == texts(seed=5)[0]
    (first,) = texts(seed=1)
    stop = first[4:6]
    (cut,) = texts(seed=1, stop=[stop])
    assert cut == first[: first.index(stop)]
    batch = client.completions.create(model="base", prompt=["A", "B"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]


def test_a_stream_is_the_completion_in_chunks(server):
    """stream true: text_completion chunks whose texts, legacy logprobs and finish reasons join, choice by choice,
    to what the same request (the same seed) gets without stream: two prompts, n 2, echo, a stop string, logprobs
    with alternatives; the usage chunk last (stream_options), then [DONE]. The openai client reads it."""
    import httpx

    openai = pytest.importorskip("openai")
    body = {"model": "base", "prompt": ["ROMEO:\nWhat", "JULIET:\nO"], "n": 2, "max_tokens": 24, "echo": True,
            "logprobs": 2, "stop": ["a "], "temperature": 1.0, "seed": 7}  # fmt: skip
    whole = httpx.post(f"{server}/v1/completions", json=body).json()
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert any(choice["finish_reason"] == "stop" for choice in whole["choices"])  # the stop string is exercised
    for expected in whole["choices"]:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == expected["index"]]
        assert "".join(choice["text"] for choice in mine) == expected["text"]
        assert mine[-1]["finish_reason"] == expected["finish_reason"] and not any(c["finish_reason"] for c in mine[:-1])
        joined = {key: [x for choice in mine for x in choice["logprobs"][key]] for key in expected["logprobs"]}
        assert joined["tokens"] == expected["logprobs"]["tokens"]
        assert joined["text_offset"] == expected["logprobs"]["text_offset"]
        # the same numbers to float rounding: the two requests' choices may share their batches differently (a
        # choice that arrives after the gathering wait joins the batch in flight), and a batch's shape moves the
        # last bits of its matmuls
        close = lambda a, b: a == pytest.approx(b, rel=1e-5, abs=1e-5)  # noqa: E731
        assert close(joined["token_logprobs"], expected["logprobs"]["token_logprobs"])
        for mine_top, their_top in zip(joined["top_logprobs"], expected["logprobs"]["top_logprobs"], strict=True):
            assert (mine_top is None) == (their_top is None)
            if their_top is not None:
                assert mine_top.keys() == their_top.keys() and close(
                    [mine_top[k] for k in their_top], [*their_top.values()]
                )
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    streamed = client.completions.create(model="base", prompt="ROMEO:", max_tokens=8, temperature=0, stream=True)
    alone = client.completions.create(model="base", prompt="ROMEO:", max_tokens=8, temperature=0)
    assert "".join(chunk.choices[0].text for chunk in streamed) == alone.choices[0].text


def test_penalties_and_biases_reach_the_completion(server, engine):
    """The openai client's logit_bias (and vLLM's repetition_penalty, an extra field) on /v1/completions: +100 on
    one token makes a greedy completion of it alone; a repetition penalty changes the greedy completion that repeats
    itself without one."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    (e,) = engine.tokenizer.encode("e")
    ask = dict(model="base", prompt="ROMEO:", max_tokens=12, temperature=0)
    biased = client.completions.create(**ask, logit_bias={str(e): 100})
    assert biased.choices[0].text == "e" * 12
    plain = client.completions.create(**ask).choices[0].text
    penalised = client.completions.create(**ask, extra_body={"repetition_penalty": 2.0}).choices[0].text
    assert penalised != plain


def test_vllms_stop_token_ids_ignore_eos_and_min_tokens_end_a_completion_where_vllms_would(server, engine):
    """vLLM's extensions as the openai client sends them (extra_body), greedy: BOS pushed to the top ends the
    completion at once; with ignore_eos it runs to max_tokens; min_tokens holds it off for that many tokens, which
    are the unbiased completion's (only the stop token was masked); an ordinary stop_token_id ends the text with
    itself, a special one without; a stop string in the first min_tokens tokens' text is passed over, streamed or
    not."""
    import httpx

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    tok = engine.tokenizer
    bos, (e,), user = tok.bos_id, tok.encode("e"), tok.special_id("<|user_start|>")
    ask = dict(model="base", prompt="ROMEO:", max_tokens=8, temperature=0, logprobs=0)

    def complete(**extra):
        choice = client.completions.create(**ask, **extra).choices[0]
        return choice.text, choice.finish_reason, choice.logprobs.tokens

    plain_text, _, plain_tokens = complete()
    to_bos = {"logit_bias": {str(bos): 100}}
    assert complete(**to_bos)[:2] == ("", "stop")
    assert complete(**to_bos, extra_body={"ignore_eos": True}) == (tok.decode([bos] * 8), "length", ["<|bos|>"] * 8)
    assert complete(**to_bos, extra_body={"min_tokens": 5}) == (plain_text[: len("".join(plain_tokens[:5]))], "stop",
                                                                 plain_tokens[:5])  # fmt: skip
    assert complete(logit_bias={str(e): 100}, extra_body={"stop_token_ids": [e]}) == ("e", "stop", ["e"])
    reason = lambda **extra: client.completions.create(**ask, **extra).choices[0].stop_reason  # noqa: E731 - vLLM's
    assert reason(logit_bias={str(e): 100}, extra_body={"stop_token_ids": [e]}) == e
    assert reason(**to_bos) is None and reason() is None  # the model's own end, the length
    assert complete(logit_bias={str(user): 100}, extra_body={"stop_token_ids": [user]})[:2] == ("", "stop")

    stop, least = plain_text[1:3], 4  # ends within the first 4 tokens' text: passed over with min_tokens 4
    floor = len("".join(plain_tokens[:least]))
    cut = plain_text.find(stop, floor - len(stop) + 1)
    expected = plain_text if cut < 0 else plain_text[:cut]
    assert complete(stop=[stop])[0] == plain_text[:1] != expected
    assert reason(stop=["zzz", stop]) == stop
    assert complete(stop=[stop], extra_body={"min_tokens": least})[0] == expected
    shown = complete(stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert shown[0] == plain_text[:3] and "".join(shown[2]) == plain_text[:3]  # its tokens' logprobs too
    for extra, text in (({"min_tokens": least}, expected), ({"include_stop_str_in_output": True}, plain_text[:3])):
        with httpx.stream(
            "POST", f"{server}/v1/completions", json={**ask, "stop": [stop], **extra, "stream": True}
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(event["choices"][0]["text"] for event in events) == text
        assert events[-1]["choices"][0]["stop_reason"] == (stop if text != plain_text else None)  # vLLM's


def test_min_p_reaches_the_completion(server):
    """min_p through the openai client (extra_body): 1 keeps only the likeliest token, so a sample at temperature 1
    is the greedy completion; a small one leaves sampling free (the seed's completion differs from greedy)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    ask = dict(model="base", prompt="ROMEO:", max_tokens=12, seed=3)
    greedy = client.completions.create(**ask, temperature=0).choices[0].text
    assert client.completions.create(**ask, temperature=1.0, extra_body={"min_p": 1.0}).choices[0].text == greedy
    assert client.completions.create(**ask, temperature=1.0, extra_body={"min_p": 0.01}).choices[0].text != greedy


@pytest.mark.parametrize(
    "options, param, says",
    [
        ({"stream_options": {"include_usage": True}}, "stream_options", "allowed: only with stream true"),
        ({"suffix": "x"}, "suffix", "suffix='x' is not supported"),
        ({"logprobs": 21}, "logprobs", "logprobs 21; allowed: an integer in [0, 20]"),
        ({"prompt": [10**9]}, "prompt", "prompt token 1000000000; allowed: token ids in"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens 0; allowed: an integer in [1, 32]"),
        ({"best_of": 3}, "best_of", "best_of=3 is not supported"),
        ({"frobnicate": 1}, "frobnicate", "unrecognized request argument 'frobnicate'"),
        ({"logit_bias": {"99999": 5}}, "logit_bias", "logit_bias token '99999'; allowed: token ids in [0, "),
        ({"presence_penalty": -3}, "presence_penalty", "presence_penalty -3; allowed: a number in [-2, 2]"),
        ({"stop_token_ids": [99999]}, "stop_token_ids", "stop_token_ids token 99999; allowed: token ids in [0, "),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids [-1]; allowed: a list of up to 64 token ids"),
        ({"min_tokens": 17}, "min_tokens", "min_tokens 17; allowed: an integer in [0, max_tokens 16]"),
        ({"ignore_eos": "yes"}, "ignore_eos", "ignore_eos 'yes'; allowed: true or false"),
        ({"min_p": 1.5}, "min_p", "min_p 1.5; allowed: a number in [0, 1]"),
    ],
)
def test_what_completions_cannot_honour_is_refused_by_name(server, options, param, says):
    import httpx

    body = {"model": "base", "prompt": "A", **options}
    response = httpx.post(f"{server}/v1/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and says in error["message"], error


def test_a_base_run_refuses_the_chat_routes_in_one_line(server):
    import httpx

    body = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(f"{server}/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert (
        "base was never trained on conversations; allowed: POST /v1/completions" in response.json()["error"]["message"]
    )


def test_the_tokenizer_routes_speak_vllms_protocol(server, engine):
    import httpx

    info = httpx.get(f"{server}/tokenizer_info").json()
    assert info["eos_token"] == engine.tokenizer.bos and info["model_max_length"] == 64
    ids = httpx.post(f"{server}/tokenize", json={"prompt": "to be", "add_special_tokens": False}).json()["tokens"]
    assert ids == engine.tokenizer.encode("to be")
    eos = httpx.post(f"{server}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [engine.tokenizer.bos_id]  # exactly one special token's string is that token
    assert httpx.post(f"{server}/detokenize", json={"tokens": ids}).json() == {"prompt": "to be"}


@pytest.mark.slow
def test_lm_evals_local_completions_scores_the_served_run_as_lapheads_lm_eval_model_does(server, base_run, tmp_path):
    """Issue 58's bar: lm-eval's API model (``local-completions``, tokenised by the server's own routes) and
    lapheads' lm-eval model give the same accuracy and, per item, log-likelihoods within 1e-4 (one sequence at a
    time through the KV cache vs padded batches) on the shipped ARC-Easy task."""
    pytest.importorskip("lm_eval")
    import json

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from lapheads.integrations.lm_eval import LapheadsLM, task_dir

    arc = [
        {
            "id": f"q{i}",
            "question": f"Which word is number {i}?",
            "choices": {"text": ["one", "two", "three"], "label": ["A", "B", "C"]},
            "answerKey": "ABC"[i % 3],
        }
        for i in range(6)
    ]
    (tmp_path / "arc_easy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arc))
    manager = TaskManager(include_path=[str(task_dir(tmp_path, tmp_path / "tasks"))])

    def evaluate(model, model_args=None):
        results = simple_evaluate(model=model, model_args=model_args, tasks=["lapheads_arc_easy"], task_manager=manager,
                                  log_samples=True, bootstrap_iters=0)  # fmt: skip
        samples = results["samples"]["lapheads_arc_easy"]
        scores = [[float(r[0]) for r in s["filtered_resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]
        return results["results"]["lapheads_arc_easy"], scores

    local, served_scores = evaluate(
        "local-completions",
        f"model=base,base_url={server}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,"
        "num_concurrent=1,max_retries=1,max_length=60",
    )
    own, own_scores = evaluate(LapheadsLM(str(base_run), device="cpu", batch_size=3))
    assert local["acc,none"] == own["acc,none"] and local["acc_norm,none"] == own["acc_norm,none"]
    torch.testing.assert_close(torch.tensor(served_scores), torch.tensor(own_scores), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "schema, header",
    [
        ("ChatCompletionBody", "| field | lapheads serve |"),
        ("CompletionBody", "| field | lapheads serve, `/v1/completions` |"),
    ],
)
def test_the_docs_field_tables_name_exactly_the_request_models_fields(schema, header):
    """docs/language-models.md's tables say what each field does; the typed request models are what is checked:
    a field added to one and not the other fails here."""
    import re
    from pathlib import Path

    from lapheads.apps import schema as schemas

    text = (Path(__file__).resolve().parents[2] / "docs" / "language-models.md").read_text()
    rows = text.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = [row for row in rows if not row.split("|")[1].strip().startswith("anything else")]  # refused examples
    named = {name.split(".")[0] for row in rows for name in re.findall(r"`([a-z_.]+)`", row.split("|")[1])}
    assert named == set(getattr(schemas, schema).model_fields)


def test_a_prompt_too_long_among_many_is_refused_before_any_is_generated(engine, monkeypatch):
    """Issue 76: one too-long prompt among 64 was refused only after 6.8 s of the others' generation. Every prompt
    is checked against the context first; the engine generates nothing."""
    from fastapi.testclient import TestClient

    from lapheads.apps.completions import CompletionEngine

    generated = []  # the server's own engine makes a job of each choice it decodes: none may be made
    monkeypatch.setattr(CompletionEngine, "job", lambda *args, **kwargs: generated.append(args))
    app = create_app(engine, "base", ServeLimits(max_tokens=32), temperature=0.0)
    too_long = [1] * engine.model.config.sequence_len
    body = {"model": "base", "prompt": [[1, 2, 3]] * 63 + [too_long], "max_tokens": 4}
    response = TestClient(app, base_url="http://127.0.0.1:8000").post("/v1/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt" and "prompt 63 has" in error["message"], error
    assert generated == []


def test_legacy_logprobs_cover_a_character_split_over_byte_tokens(engine, monkeypatch):
    """A completion 'ab€cd' ('€' three byte tokens of the character tokenizer), echoed after a prompt that holds
    one too: every token has an entry, the tokens' texts join to the text (a character's on its last byte, "" on
    its first) and each offset is the characters before it (each byte counted as a U+FFFD before)."""
    from fastapi.testclient import TestClient

    import lapheads.apps.batching as batching  # where a completion's tokens are sampled

    tok = engine.tokenizer
    script = tok.encode("ab€cd")
    assert len(script) == 7  # '€': three byte tokens
    calls = {"n": 0}

    def scripted(logits, *args, **kwargs):  # one choice: one row
        calls["n"] += 1
        return [script[(calls["n"] - 1) % len(script)]]

    monkeypatch.setattr(batching, "sample_rows", scripted)
    app = create_app(engine, "base", ServeLimits(max_tokens=32), temperature=0.0)
    body = {"model": "base", "prompt": "x€y", "max_tokens": 7, "echo": True, "logprobs": 1}
    (choice,) = TestClient(app, base_url="http://127.0.0.1:8000").post("/v1/completions", json=body).json()["choices"]
    logprobs = choice["logprobs"]
    assert choice["text"] == "x€yab€cd" and "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["tokens"] == ["x", "", "", "€", "y", "a", "b", "", "", "€", "c", "d"]
    assert logprobs["text_offset"] == [0, 1, 1, 1, 2, 3, 4, 5, 5, 5, 6, 7]


def test_an_error_mid_stream_ends_the_completion_stream_with_openais_error_object(engine, monkeypatch):
    from fastapi.testclient import TestClient

    from tests.apps.conftest import fail_at_the_second_draw

    fail_at_the_second_draw(monkeypatch, engine.tokenizer)
    app = create_app(engine, "base", ServeLimits(max_tokens=32), temperature=0.0)
    body = {"model": "base", "prompt": "A", "max_tokens": 8, "stream": True}
    with TestClient(app, base_url="http://127.0.0.1:8000").stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == "h"
    assert events[-1] == {"error": {"message": "generation failed: device lost second line", "type": "server_error"}}


def test_byte_token_alternatives_keep_apart_in_legacy_top_logprobs(engine):
    """Three byte tokens as the likeliest alternatives: each decodes alone to U+FFFD, so as {text: logprob} keys they
    collapsed into one; they are OpenAI's 'bytes:\\xNN' keys, one each."""
    euro = engine.tokenizer.encode("€")  # three byte tokens
    logp = torch.full((engine.tokenizer.vocab_size,), -20.0)
    logp[euro] = torch.tensor([-1.0, -2.0, -3.0])
    _, top = engine._entry(logp, euro[0], 3)
    assert top == {"bytes:\\xe2": -1.0, "bytes:\\x82": -2.0, "bytes:\\xac": -3.0}
