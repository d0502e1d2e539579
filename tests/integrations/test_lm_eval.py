"""lm-evaluation-harness adapter: log-likelihoods equal a direct computation; the shipped YAMLs run offline."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from lapheads.cli import main  # noqa: E402
from lapheads.errors import InputError  # noqa: E402
from lapheads.integrations.lm_eval import LapheadsLM  # noqa: E402
from lapheads.train.lm import train_lm  # noqa: E402
from tests.conftest import tiny_lm  # noqa: E402


@pytest.fixture(scope="module")
def lm_run(text_root, tmp_path_factory):
    run = tmp_path_factory.mktemp("harness") / "run"
    train_lm(tiny_lm(text_root, num_iterations=4, eval_every=4), run)  # sequence_len 64
    return run


@pytest.fixture(scope="module")
def harness_lm(lm_run):
    return LapheadsLM(str(lm_run), device="cpu", batch_size=3)


def _write_arc(folder, n: int) -> None:
    """n ARC-Easy items in the hub's schema, as ``--data-dir`` reads them."""
    arc = [
        {
            "id": f"q{i}",
            "question": f"Which is {i}?",
            "choices": {"text": ["one", "two", "three"], "label": ["A", "B", "C"]},
            "answerKey": "ABC"[i % 3],
        }
        for i in range(n)
    ]
    (folder / "arc_easy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arc))


def _request(kind: str, args: tuple, i: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


def _direct(model, inputs: list[int], targets: list[int]) -> float:
    """Sum of log p(targets) where the model reads ``inputs`` and targets are the tokens after its last positions."""
    with torch.no_grad():
        logprobs = F.log_softmax(model(torch.tensor([inputs])).float(), -1)[0]
    n = len(targets)
    return float(sum(logprobs[len(inputs) - n + i, t] for i, t in enumerate(targets)))


def test_loglikelihood_equals_a_direct_computation(harness_lm):
    tok, bos = harness_lm.lapheads_tokenizer, harness_lm.eot_token_id
    pairs = [("ROMEO:", " What"), ("JULIET:\nO", " Romeo, Romeo"), ("A", "nd then"), ("x" * 80, " long")]
    got = harness_lm.loglikelihood([_request("loglikelihood", p, i) for i, p in enumerate(pairs)])
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        ids = tok.encode(context + continuation)
        ctx = tok.encode(context)
        cont = ids[len(ctx) :]
        whole = [bos, *ids][-65:]  # the longest context keeps its last tokens
        assert logprob == pytest.approx(_direct(harness_lm.model, whole[:-1], cont), abs=1e-4)
        with torch.no_grad():
            argmax = harness_lm.model(torch.tensor([whole[:-1]]))[0, -len(cont) :].argmax(-1).tolist()
        assert greedy == (argmax == cont)


def test_rolling_loglikelihood_is_the_sum_over_disjoint_windows(harness_lm):
    tok, bos = harness_lm.lapheads_tokenizer, harness_lm.eot_token_id
    short = "ROMEO:\nBut soft"
    got = harness_lm.loglikelihood_rolling([_request("loglikelihood_rolling", (short,))])[0]
    ids = tok.encode(short)
    assert got == pytest.approx(_direct(harness_lm.model, [bos, *ids[:-1]], ids), abs=1e-4)
    text = ("abcdefgh " * 20)[:128]  # exactly two windows of the model's 64 tokens
    seq = [bos, *tok.encode(text)]
    assert len(seq) == 129
    expected = sum(_direct(harness_lm.model, seq[64 * c : 64 * c + 64], seq[64 * c + 1 : 64 * c + 65]) for c in (0, 1))
    assert harness_lm.loglikelihood_rolling([_request("loglikelihood_rolling", (text,))])[0] == pytest.approx(
        expected, abs=1e-3
    )


def test_generate_until_is_greedy_and_stops_at_the_stop_strings(harness_lm):
    tok = harness_lm.lapheads_tokenizer
    prompt = "ROMEO:\n"
    ids = torch.tensor([tok.encode(prompt, bos=True)])
    full = tok.decode(harness_lm.model.generate(ids, 20, temperature=0)[0, ids.shape[1] :].tolist())
    got = harness_lm.generate_until([_request("generate_until", (prompt, {"until": [], "max_gen_toks": 20}))])[0]
    assert got == full
    stop = full[3:5]
    cut = harness_lm.generate_until([_request("generate_until", (prompt, {"until": [stop], "max_gen_toks": 20}))])[0]
    assert cut == full[: full.find(stop)]


def test_generate_until_decodes_a_batch_of_requests_as_each_alone(harness_lm, monkeypatch):
    """Requests are decoded batch_size at a time (lapheads.apps.batching): prompts of different lengths, stop
    strings, lengths and a sampled request give, in one call, what each gives alone; repeats of one sampled request
    differ (each its own seed) and a rerun repeats them."""
    requests = [
        ("ROMEO:\n", {"until": [], "max_gen_toks": 12}),
        ("JULIET:\nO Romeo, Romeo", {"until": ["\n"], "max_gen_toks": 20}),
        ("A", {"until": ["e", "o"], "max_gen_toks": 16}),
        ("KING:\n", {"until": [], "max_gen_toks": 5, "do_sample": True, "temperature": 1.0}),
        ("KING:\n", {"until": [], "max_gen_toks": 5, "do_sample": True, "temperature": 1.0}),
    ]
    monkeypatch.setattr(harness_lm, "batch_size", 3)  # two batches, the second of a greedy and sampled mix
    together = harness_lm.generate_until([_request("generate_until", r) for r in requests])
    alone = [harness_lm.generate_until([_request("generate_until", r)])[0] for r in requests[:3]]
    assert together[:3] == alone
    assert together[3] != together[4]  # lm-eval's repeats of a sampled request are different samples
    assert harness_lm.generate_until([_request("generate_until", r) for r in requests])[3:] == together[3:]


def _greedy_with_repetition_penalty(lm, prompt: str, steps: int, penalty: float) -> str:
    """The textbook loop: transformers' RepetitionPenaltyLogitsProcessor over everything the model has read (BOS,
    the context, the tokens so far), then the argmax, one full forward a token."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    ids = torch.tensor([lm.lapheads_tokenizer.encode(prompt, bos=True)])
    start = ids.shape[1]
    for _ in range(steps):
        with torch.no_grad():
            logits = lm.model(ids)[:, -1].float()
        token = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits).argmax(-1, keepdim=True)
        ids = torch.cat([ids, token], 1)
    return lm.lapheads_tokenizer.decode(ids[0, start:].tolist())


def test_generate_until_honours_the_generation_arguments_transformers_takes_and_refuses_the_rest(harness_lm):
    """A task's top_k / top_p narrow the sample (top_k 1 and a tiny top_p sample the greedy text), its
    repetition_penalty applies as transformers' generate applies it (greedy too), max_new_tokens sets the length,
    and an argument it would otherwise ignore is refused in one line."""
    run = lambda kwargs, prompt="ROMEO:\n": harness_lm.generate_until([_request("generate_until", (prompt, kwargs))])[0]  # noqa: E731
    greedy = run({"until": [], "max_gen_toks": 16})
    sampled = {"until": [], "max_gen_toks": 16, "do_sample": True, "temperature": 1.0}
    assert run(sampled) != greedy  # sampling alone moves off the greedy text here
    assert run({**sampled, "top_k": 1}) == greedy and run({**sampled, "top_p": 1e-9}) == greedy
    penalised = run({"until": [], "max_gen_toks": 16, "repetition_penalty": 1.8})
    assert penalised == _greedy_with_repetition_penalty(harness_lm, "ROMEO:\n", 16, 1.8) != greedy
    assert run({"until": [], "max_gen_toks": 16, "max_new_tokens": 4}) == greedy[: len(run({"max_gen_toks": 4}))]
    with pytest.raises(InputError, match="lm-eval generation argument 'min_length'; allowed: until, max_gen_toks"):
        run({"until": [], "min_length": 3})
    with pytest.raises(InputError, match="num_beams=4; allowed: 1"):
        run({"until": [], "num_beams": 4})
    with pytest.raises(InputError, match=r"repetition_penalty=0; allowed: a number > 0"):
        run({"until": [], "repetition_penalty": 0})
    with pytest.raises(InputError, match=r"top_p=1.5; allowed: a number in \(0, 1\]"):
        run({**sampled, "top_p": 1.5})


@pytest.mark.slow
def test_the_shipped_tasks_run_offline_through_the_cli(lm_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    arc = [
        {
            "id": f"q{i}",
            "question": f"Which is {i}?",
            "choices": {"text": ["one", "two", "three"], "label": ["A", "B", "C"]},
            "answerKey": "ABC"[i % 3],
        }
        for i in range(5)
    ]
    gsm = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(3)]
    (tmp_path / "arc_easy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arc))
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    code = main(
        [
            "eval",
            "lm",
            str(lm_run),
            "--harness",
            "lapheads_arc_easy,lapheads_gsm8k",
            "--data-dir",
            str(tmp_path),
            "--max-examples",
            "4",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    saved = json.loads((lm_run / "report" / "eval_harness.json").read_text())["results"]
    assert 0 <= saved["lapheads_arc_easy"]["acc,none"] <= 1 and "acc_norm,none" in saved["lapheads_arc_easy"]
    assert "exact_match,strict-match" in saved["lapheads_gsm8k"]
    assert main(["eval", "lm", str(lm_run), "--harness", "lapheads_hellaswag", "--data-dir", str(tmp_path)]) == 2
    assert (
        f"--data-dir {tmp_path} lacks hellaswag.jsonl (or .parquet) for lapheads_hellaswag" in capsys.readouterr().err
    )
    missing = tmp_path / "evals"  # the README's command on a machine without the folder: say that, not "unknown"
    assert main(["eval", "lm", str(lm_run), "--harness", "lapheads_arc_easy", "--data-dir", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--data-dir {missing} does not exist" in err and "unknown" not in err
    assert main(["eval", "lm", str(lm_run), "--harness", "no_such_task", "--data-dir", str(tmp_path)]) == 2
    assert "unknown harness task(s) no_such_task" in capsys.readouterr().err


def test_the_harness_options_pass_through_with_standard_errors_and_lm_evals_own_files(lm_run, tmp_path, capsys):
    _write_arc(tmp_path, 6)
    args = ["eval", "lm", str(lm_run), "--harness", "lapheads_arc_easy", "--data-dir", str(tmp_path), "--limit", "4"]
    args += ["--num-fewshot", "1", "--batch-size", "2", "--bootstrap-iters", "50", "--log-samples"]
    args += ["--output-path", str(tmp_path / "out"), "--device", "cpu"]
    assert main(args) == 0, capsys.readouterr().err
    saved = json.loads((lm_run / "report" / "eval_harness.json").read_text())
    stderr = saved["results"]["lapheads_arc_easy"]["acc_stderr,none"]
    assert isinstance(stderr, float) and stderr > 0  # bootstrap_iters=0 gave "N/A"
    assert saved["num_fewshot"] == 1
    (results,) = (tmp_path / "out").rglob("results_*.json")
    own = json.loads(results.read_text())
    assert own["n-shot"]["lapheads_arc_easy"] == 1 and own["config"]["limit"] == 4
    (samples,) = (tmp_path / "out").rglob("samples_lapheads_arc_easy_*.jsonl")
    assert len(samples.read_text().splitlines()) == 4


def test_without_a_device_the_model_goes_where_torch_can_run_it(lm_run):
    assert LapheadsLM(str(lm_run), device=None).device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_chat_template_prompts_an_sft_run_in_its_own_chat_turns(sft_run):
    from lapheads.data.conversations import render_for_completion

    lm = LapheadsLM(str(sft_run), device="cpu")
    tokenizer = lm.lapheads_tokenizer
    start = tokenizer.special_id("<|user_start|>")
    assert start not in lm.tok_encode("<|user_start|>hi")  # before chat templating: a task's text is text
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2? Ünïcode ok"}]
    prompt = lm.apply_chat_template(history)
    assert prompt.startswith("<|user_start|>Be brief.") and prompt.endswith("<|user_end|><|assistant_start|>")
    assert lm.tok_encode(prompt) == render_for_completion(tokenizer, {"messages": history})[1:]  # BOS: per request
    started = lm.apply_chat_template([*history, {"role": "assistant", "content": "The answer"}], False)
    assert started == prompt + "The answer"
    assert lm.tokenizer_name.startswith("lapheads-") and "<|assistant_start|>" in lm.chat_template(True)


def test_the_harness_applies_the_chat_template_with_fewshot_as_multiturn(sft_run, tmp_path, capsys):
    _write_arc(tmp_path, 4)
    args = ["eval", "lm", str(sft_run), "--harness", "lapheads_arc_easy", "--data-dir", str(tmp_path), "--limit", "2"]
    args += ["--num-fewshot", "1", "--apply-chat-template", "--fewshot-as-multiturn", "--log-samples"]
    args += ["--bootstrap-iters", "0", "--output-path", str(tmp_path / "out"), "--device", "cpu"]
    assert main(args) == 0, capsys.readouterr().err
    saved = json.loads((sft_run / "report" / "eval_harness.json").read_text())
    assert saved["apply_chat_template"] is True and saved["fewshot_as_multiturn"] is True
    (samples,) = (tmp_path / "out").rglob("samples_lapheads_arc_easy_*.jsonl")
    prompt = json.loads(samples.read_text().splitlines()[0])["arguments"]["gen_args_0"]["arg_0"]
    assert prompt.count("<|user_start|>") == 2 and prompt.endswith("<|assistant_start|>")  # 1 shot + the question


def test_in_process_generation_ends_at_the_assistant_turn_as_the_server_does(sft_run, monkeypatch):
    """Issue 72: with the chat template, LapheadsLM.generate_until ran past <|assistant_end|> (3 of 4 generations),
    while the server's chat engine stopped there. A 4-step SFT model rarely ends its turn by itself, so the sampler
    is wrapped to end it at the k-th token of each reply (the model's own greedy tokens before it): both paths give
    the same text, ended there."""
    import lapheads.apps.batching as batching  # where both paths sample a reply's tokens
    from lapheads.apps.chat import ChatEngine
    from lapheads.data.conversations import render_for_completion
    from lapheads.runs import load_gpt_run

    lm = LapheadsLM(str(sft_run), device="cpu")
    _, model, tokenizer = load_gpt_run(sft_run, "cpu")
    engine = ChatEngine(model, tokenizer, tools=False)
    end, greedy, calls = tokenizer.special_id("<|assistant_end|>"), batching.sample_rows, {"n": 0, "at": 0}

    def ends_at_k(logits, *args, **kwargs):  # one reply at a time: one row
        calls["n"] += 1
        return [end] if calls["n"] == calls["at"] else greedy(logits, *args, **kwargs)

    monkeypatch.setattr(batching, "sample_rows", ends_at_k)
    for at in (1, 3, 7, 12):
        history = [{"role": "user", "content": f"What is {at} + {at}?"}]
        calls.update(n=0, at=at)
        got = lm.generate_until(
            [_request("generate_until", (lm.apply_chat_template(history), {"until": [], "max_gen_toks": 48}))]
        )[0]
        outcome: dict = {}
        calls.update(n=0, at=at)
        prompt = render_for_completion(tokenizer, {"messages": history})
        served = "".join(engine.stream(prompt, 48, temperature=0, outcome=outcome))
        assert outcome["finish_reason"] == "stop" and got == served, (at, got, served)
        assert "<|assistant_end|>" not in got
