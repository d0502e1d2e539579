"""Mid-training and SFT (full and LoRA) from an LM run: the run directory, resume, NaN stop, DDP, LoRA's bars,
chat evals and the chat command."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import lapheads.train.chat as chat_module
from lapheads.cli import main
from lapheads.models.lora import LoraAdapters, apply_lora
from lapheads.runs import load_gpt_run
from lapheads.runs.checkpoints import NonFiniteLossError
from lapheads.train.chat import train_mid, train_sft
from lapheads.train.configs.chat import MidConfig
from tests.conftest import tiny_sft, torchrun


def test_sft_lowers_the_masked_loss_and_records_its_base(base_run, tmp_path):
    result = train_sft(tiny_sft(base_run, num_iterations=8, eval_every=8), tmp_path / "sft")
    metrics = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    val = [m["val_loss"] for m in metrics if "val_loss" in m]
    assert len(val) == 2 and val[1] < val[0] - 0.5 and result["val_loss"] == val[1]
    record = json.loads((tmp_path / "sft" / "config.json").read_text())
    base_record = json.loads((base_run / "config.json").read_text())
    assert record["task"] == "sft" and record["base_run"] == str(base_run.resolve())
    assert record["laplacian_masks"] == base_record["laplacian_masks"]
    assert record["config"]["seed"] == 0 and record["trainable_params"] == record["num_params"]
    assert (tmp_path / "sft" / "tokenizer" / "lapheads_tokenizer.json").is_file()
    _, model, _ = load_gpt_run(tmp_path / "sft", "cpu")
    assert model.laplacian_masks() == base_record["laplacian_masks"]


def test_sft_trains_on_assistant_tokens_only(base_run):
    from lapheads.data.conversations import render_conversation
    from lapheads.data.synthetic import generated_conversations
    from lapheads.train.chat import sft_batch

    _, _, tokenizer = load_gpt_run(base_run, "cpu")
    rendered = [render_conversation(tokenizer, c) for c in generated_conversations("arith", "train")[:3]]
    x, y = sft_batch(rendered, tokenizer.special_id("<|assistant_end|>"), 256)
    for row, (ids, mask) in enumerate(rendered):
        n = len(ids) - 1
        assert x[row, :n].tolist() == ids[:-1]
        trained = [t for t, m in zip(ids[1:], mask[1:]) if m]
        assert y[row][y[row] >= 0].tolist() == trained and (y[row, n:] == -1).all()
        assert tokenizer.special_id("<|assistant_end|>") in trained  # it learns to stop


@pytest.mark.parametrize("task", ["sft", "mid"])
def test_resume_continues_the_same_trajectory(base_run, tmp_path, task):
    if task == "sft":
        cfg, train = tiny_sft(base_run, checkpoint_every=2), train_sft
    else:
        cfg, train = (
            MidConfig(
                base=str(base_run),
                data="arith",
                micro_batch=2,
                total_batch_size=1024,
                num_iterations=6,
                eval_every=3,
                checkpoint_every=2,
                device="cpu",
                amp=False,
            ),
            train_mid,
        )
    train(cfg, tmp_path / "straight")
    assert train(cfg, tmp_path / "killed", stop_at_step=4)["stopped"]
    train(cfg, tmp_path / "killed", resume=True)
    one = load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000006" / "model.safetensors"))
    two = load_file(str(tmp_path / "killed" / "checkpoints" / "step-00000006" / "model.safetensors"))
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_a_non_finite_sft_loss_stops_with_the_step(base_run, tmp_path, monkeypatch):
    real = chat_module._load_base

    def poisoned(cfg, device):
        model, tokenizer, source = real(cfg, device)
        forward, calls = model.forward, []

        def forward_with_nan(idx, targets=None, **kwargs):
            out = forward(idx, targets, **kwargs)
            if targets is not None and kwargs.get("loss_reduction", "mean") == "mean":
                calls.append(1)
                if len(calls) > 2 * 2:  # the 3rd step (2 micro-batches per step)
                    return out * float("nan")
            return out

        model.forward = forward_with_nan
        return model, tokenizer, source

    monkeypatch.setattr(chat_module, "_load_base", poisoned)
    with pytest.raises(NonFiniteLossError, match="non-finite loss nan at step 3"):
        train_sft(tiny_sft(base_run, checkpoint_every=1, val_data=""), tmp_path / "run")
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-00000002"


def test_lora_starts_at_the_base_keeps_only_adapters_and_merges_exactly(base_run, tmp_path):
    cfg = tiny_sft(base_run, lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_lr=1e-2, lora_merge=True)
    _, base, tokenizer = load_gpt_run(base_run, "cpu")
    x = torch.tensor([tokenizer.encode("ROMEO: what is 2 + 3?", bos=True)])
    adapted = apply_lora(
        load_gpt_run(base_run, "cpu")[1], cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets
    )
    torch.testing.assert_close(adapted(x), base(x), rtol=0, atol=0)  # B = 0 at initialisation

    train_sft(cfg, tmp_path / "lora")
    run = tmp_path / "lora"
    adapters = load_file(str(run / "checkpoints" / "step-00000006" / "model.safetensors"))
    assert adapters and all("lora_A" in k or "lora_B" in k for k in adapters)
    assert (
        sum(v.numel() for v in adapters.values()) == json.loads((run / "config.json").read_text())["trainable_params"]
    )
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert (run / "adapter" / "adapter_config.json").is_file()
    # the adapted model (base + trained adapters) against the merged run's plain checkpoint
    model = apply_lora(
        load_gpt_run(base_run, "cpu")[1], cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets
    )
    LoraAdapters(model).load_state_dict(adapters)
    model.eval()
    with torch.no_grad():
        expected = model(x)
        assert (expected - base(x)).abs().max() > 1e-3  # training moved it
        _, merged, _ = load_gpt_run(run / "merged", "cpu")
        torch.testing.assert_close(merged(x), expected, rtol=1e-5, atol=1e-5)
        _, adapted_run, _ = load_gpt_run(run, "cpu")
        torch.testing.assert_close(adapted_run(x), expected, rtol=1e-5, atol=1e-5)
    plain = load_file(str(run / "merged" / "checkpoints" / "step-00000006" / "model.safetensors"))
    assert not any("lora" in k for k in plain)


def test_mid_training_packs_conversations_and_trains_every_token(base_run, tmp_path):
    cfg = MidConfig(
        base=str(base_run),
        data="arith,letters",
        micro_batch=4,
        total_batch_size=2048,
        num_iterations=3,
        eval_every=3,
        log_every=1,
        device="cpu",
        amp=False,
    )
    train_mid(cfg, tmp_path / "mid")
    metrics = [json.loads(line) for line in (tmp_path / "mid" / "metrics.jsonl").read_text().splitlines()]
    assert [m["trained_tokens"] for m in metrics if "loss" in m] == [2048] * 3  # full windows, no mask
    # and an SFT can start from the mid run
    train_sft(tiny_sft(tmp_path / "mid", num_iterations=1, eval_every=1), tmp_path / "sft")
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["base_task"] == "mid"


@pytest.mark.slow
def test_ddp_two_ranks_match_one_rank(base_run, tmp_path):
    cfg = tiny_sft(base_run, num_iterations=2, eval_every=2, val_data="")  # 1 rank: 2 accumulation steps
    train_sft(cfg, tmp_path / "one")
    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps(dataclasses.asdict(cfg)))
    done = torchrun(["-m", "lapheads", "train", "sft", "--preset", str(preset), "--out", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-2000:]
    one = load_file(str(tmp_path / "one" / "checkpoints" / "step-00000002" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "checkpoints" / "step-00000002" / "model.safetensors"))
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-3, atol=2e-4)
    folder = tmp_path / "two" / "checkpoints" / "step-00000002"  # each rank its own dropout masks from here on
    assert not torch.equal(*(load_file(str(folder / f"rng-rank{r}.safetensors"))["torch_cpu"] for r in (0, 1)))


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "--base '' --nanochat '': allowed: exactly one of them"),
        (["--from", "{base}", "--laplacian-heads", "0"], "--laplacian-heads '0' differs from the base's heads"),
        (["--from", "{base}", "--data", "wiki"], "conversation source 'wiki'; allowed: NAME or NAME*EPOCHS"),
        (["--from", "{base}", "--lora-merge", "true"], "--lora-merge true needs --lora-rank > 0"),
        (["--from", "{base}", "--lora-targets", "wq"], "--lora-targets 'wq'; allowed: a comma list of c_q"),
        (["--from", "{base}", "--examples-per-step", "30"], "--examples-per-step 30 is not a multiple of micro_batch"),
        (["--from", "{base}", "--sequence-len", "4096"], "--sequence-len 4096; allowed: at most the base's 256"),
        # a window that cuts off every answer: a step would average a loss over no tokens ("non-finite loss")
        (
            ["--from", "{base}", "--sequence-len", "4"],
            "has an assistant token within the first 4 tokens (--sequence-len; the base's: 256); allowed: a base",
        ),
        (["--from", "{nowhere}"], "is not a run directory: no config.json"),
        (
            ["--preset", "nope", "--from", "{base}"],
            "unknown sft preset 'nope'; allowed: nanochat-sft, lora-sft, chat-cpu",
        ),
    ],
)
def test_bad_sft_input_is_a_one_line_error(base_run, tmp_path, capsys, args, message):
    args = [a.format(base=base_run, nowhere=tmp_path / "nowhere") for a in args]
    preset = [] if "--preset" in args else ["--preset", "chat-cpu"]
    code = main(["train", "sft", *preset, *args, "--out", str(tmp_path / "r"), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("lapheads train: error: ") and message in err and "\n" not in err
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_eval_chat_scores_generated_and_hub_tasks_into_the_run(sft_run, tmp_path, capsys):
    rows = [
        {
            "id": f"q{i}",
            "question": f"Which is {i}?",
            "choices": {"text": ["one", "two"], "label": ["A", "B"]},
            "answerKey": "AB"[i % 2],
        }
        for i in range(4)
    ]
    (tmp_path / "arc_easy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        main(
            [
                "eval",
                "chat",
                str(sft_run),
                "--benchmarks",
                "arith,arc_easy",
                "--data-dir",
                str(tmp_path),
                "--max-examples",
                "3",
            ]
        )
        == 0
    )
    said = capsys.readouterr()
    summary = json.loads(said.out)  # the command's answer: one JSON line on stdout
    assert summary["tasks"]["arith"]["n"] == 3 and summary["tasks"]["arc_easy"]["n"] == 3
    assert summary["tasks"]["arc_easy"]["chance"] == 0.5 and summary["run_dir"] == str(sft_run)
    assert "ChatCORE" in said.err and "arc_easy: accuracy" in said.err  # the human summary, logged
    saved = json.loads((sft_run / "report" / "eval_chat.json").read_text())
    assert saved["chatcore"] == summary["chatcore"]


def test_chat_answers_a_prompt_and_refuses_bad_input(sft_run, base_run, capsys):
    assert main(["chat", str(sft_run), "--prompt", "What is 2 + 3?", "--max-tokens", "8", "--temperature", "0"]) == 0
    first = capsys.readouterr().out
    assert main(["chat", str(sft_run), "--prompt", "What is 2 + 3?", "--max-tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == first and first.strip()  # greedy: the same reply
    ask = ["chat", str(sft_run), "--prompt", "What is 2 + 3?", "--max-tokens", "8"]
    assert main([*ask, "--temperature", "1", "--top-k", "0", "--top-p", "1e-9"]) == 0  # the nucleus: one token
    assert capsys.readouterr().out == first
    assert main([*ask, "--temperature", "1", "--top-k", "0", "--min-p", "1"]) == 0  # min-p 1: the likeliest alone
    assert capsys.readouterr().out == first
    assert main([*ask, "--temperature", "0", "--repetition-penalty", "1.8"]) == 0
    assert capsys.readouterr().out != first  # the penalty reached the decoder
    for args, message in (
        (["--prompt", " "], "--prompt is empty"),
        (["--prompt", "x" * 300], "the conversation has"),
        (["--top-k", "-1", "--prompt", "x"], "--top-k -1"),
        (
            ["--top-p", "0", "--prompt", "x"],
            "--top-p 0.0, --min-p 0.0, --repetition-penalty 1.0: allowed: --top-p in (0, 1]",
        ),
        (["--repetition-penalty", "0", "--prompt", "x"], "--repetition-penalty 0.0: allowed"),
        (["--min-p", "2", "--prompt", "x"], "--min-p 2.0, --repetition-penalty 1.0: allowed"),
    ):
        assert main(["chat", str(sft_run), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err
    assert main(["chat", str(base_run), "--prompt", "hi"]) == 2
    assert "never trained on conversations" in capsys.readouterr().err


def test_an_sft_sweep_fine_tunes_each_arms_own_base_and_reports_chat_accuracy(text_root, tmp_path, capsys):
    from lapheads.train.lm import train_lm
    from tests.conftest import tiny_lm

    bases = tmp_path / "bases"
    for spec in ("0", "2"):
        train_lm(
            tiny_lm(text_root, num_iterations=2, eval_every=2, sequence_len=256, micro_batch=4, laplacian_heads=spec),
            bases / f"L{spec}-s0",
        )
    preset = tmp_path / "sft.json"
    cfg = tiny_sft("", num_iterations=2, eval_every=2, eval_tasks="arith", eval_max_examples=2)
    preset.write_text(
        json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("laplacian_heads", "base")})
    )
    out = tmp_path / "sweep"
    assert (
        main(
            [
                "sweep",
                str(preset),
                "--task",
                "sft",
                "--laplacian-heads",
                "0,2",
                "--seeds",
                "0,1",
                "--out",
                str(out),
                "--set",
                f"base={bases}/L{{spec}}-s0",
            ]
        )
        == 0
    )
    for spec in ("0", "2"):
        record = json.loads((out / f"L{spec}-s1" / "config.json").read_text())
        assert record["base_run"] == str((bases / f"L{spec}-s0").resolve()) and record["config"]["seed"] == 1
        assert json.loads((out / f"L{spec}-s1" / "report" / "eval_chat.json").read_text())["tasks"]["arith"]["n"] == 2
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| held-out arith accuracy | secondary | 2 | 2 |" in printed
    assert "| ChatCORE | secondary | 2 | 2 |" in printed
    assert "| validation loss (nats) | primary | 2 | 2 |" in printed


def test_lora_sft_from_a_nanochat_checkpoint_keeps_its_heads_and_loads_back(tmp_path, capsys):
    from lapheads.data.tokenizers import Tokenizer
    from lapheads.models.nanochat import load_nanochat
    from tests.train.test_lm import _nanochat_base

    folder, reference = _nanochat_base(tmp_path / "base")
    cfg = tiny_sft(
        "",
        nanochat=str(folder),
        lora_rank=2,
        lora_alpha=4.0,
        lora_dropout=0.0,
        lora_lr=1e-2,
        sequence_len=128,
        val_data="",
    )
    train_sft(cfg, tmp_path / "lora")
    record = json.loads((tmp_path / "lora" / "config.json").read_text())
    assert record["nanochat"] == str(folder) and record["nanochat_step"] == 50
    assert record["laplacian_masks"] == reference.laplacian_masks()
    _, adapted, tokenizer = load_gpt_run(tmp_path / "lora", "cpu")
    x = torch.tensor([Tokenizer.nanochat(tmp_path / "base" / "tokenizer").encode("the theme", bos=True)])
    base = load_nanochat(folder)[0]
    with torch.no_grad():
        assert (adapted(x) - base(x)).abs().max() > 1e-4 and adapted.laplacian_masks() == base.laplacian_masks()
    assert (
        main(
            [
                "train",
                "sft",
                "--preset",
                "chat-cpu",
                "--nanochat",
                str(folder),
                "--laplacian-heads",
                "1",
                "--out",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )
    assert "--laplacian-heads '1' differs from the base's heads" in capsys.readouterr().err


def test_a_run_shorter_than_one_eval_period_evaluates_briefly_and_says_how_to_ask_for_more(base_run, tmp_path, capsys):
    """Issue 76 (first hour): `train sft --preset chat-cpu` with 40 steps trained 2 minutes, then ran 16 minutes of
    chat evals (300 + 168 items). A run shorter than --eval-every gets 20 items per task and the command for all."""
    from lapheads.train.chat import SHORT_RUN_EVAL_ITEMS, train_sft
    from tests.conftest import tiny_sft

    run = tmp_path / "short"
    train_sft(tiny_sft(base_run, num_iterations=2, eval_every=100, eval_tasks="arith", eval_max_examples=50), run)
    saved = json.loads((run / "report" / "eval_chat.json").read_text())
    assert saved["tasks"]["arith"]["n"] == SHORT_RUN_EVAL_ITEMS
    said = capsys.readouterr().err
    assert f"chat evals on the first {SHORT_RUN_EVAL_ITEMS} items per task" in said
    assert f"lapheads eval chat {run} --benchmarks arith --max-examples 50" in said
