"""Language-model training on the real Shakespeare corpus: learning, resume identity, NaN, bad input, evals."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch
from safetensors.torch import load_file

from lapheads.cli import main
from lapheads.runs.checkpoints import NonFiniteLossError
from lapheads.train import lm as lm_module
from lapheads.train import optimizers as optim
from lapheads.train.lm import train_lm
from tests.conftest import tiny_lm, torchrun


@pytest.fixture(scope="module")
def trained_run(text_root, tmp_path_factory):
    run = tmp_path_factory.mktemp("lm") / "run"
    # long enough for the multiple-choice prompts of the eval test
    result = train_lm(tiny_lm(text_root, num_iterations=30, eval_every=15, sequence_len=256, micro_batch=4), run)
    return run, result


def test_loss_drops_on_shakespeare_and_the_run_directory_is_complete(trained_run):
    run, result = trained_run
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    record = json.loads((run / "config.json").read_text())
    vocab = record["vocab_size"]
    assert losses[0] == pytest.approx(math.log(vocab), abs=0.05)  # zero-initialised head: uniform
    assert losses[-1] < losses[0] - 1.2
    assert result["val_bpb"] < math.log2(vocab) - 1.5
    assert record["laplacian_masks"] == [[False, False, True, True]] * 2 and record["config"]["seed"] == 0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [15, 30] and samples[-1]["text"].startswith("ROMEO:\n")
    assert (run / "tokenizer" / "lapheads_tokenizer.json").is_file()


def test_resume_continues_the_same_trajectory(text_root, tmp_path):
    cfg = tiny_lm(text_root, num_iterations=8, eval_every=4, checkpoint_every=2)
    _train_straight_and_resumed(cfg, tmp_path)

    def comparable(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]

    assert comparable(tmp_path / "straight" / "metrics.jsonl") == comparable(tmp_path / "resumed" / "metrics.jsonl")
    assert (tmp_path / "straight" / "samples.jsonl").read_text() == (tmp_path / "resumed" / "samples.jsonl").read_text()


def test_document_masking_trains_and_every_reload_keeps_each_document_to_itself(text_root, tmp_path):
    """Issue 75: `--document-masking true` packs documents without a T x T mask in the trainer (a document starts at
    each BOS); the model records its BOS, so a reloaded run (bpb, evaluations, serving) keeps it: a packed row's
    second document has the logits it has alone."""
    from lapheads.runs import load_gpt_run

    run = tmp_path / "run"
    cfg = dataclasses.replace(tiny_lm(text_root, num_iterations=3, eval_every=3), document_masking=True)
    result = train_lm(cfg, run)
    assert math.isfinite(result["val_bpb"])
    _, model, tokenizer = load_gpt_run(run, "cpu")
    bos = tokenizer.bos_id
    assert json.loads((run / "config.json").read_text())["model"]["kwargs"]["document_bos"] == bos
    first, second = tokenizer.encode("ROMEO: hi", bos=True), tokenizer.encode("JULIET: lo", bos=True)
    with torch.no_grad():
        packed = model(torch.tensor([first + second]))
        alone = model(torch.tensor([second]))
        torch.testing.assert_close(packed[:, len(first) :], alone, rtol=1e-4, atol=1e-4)
        model.config.document_bos = None  # the same weights without the rule: the documents mix
        assert (model(torch.tensor([first + second]))[:, len(first) :] - alone).abs().max() > 1e-3


def test_non_finite_loss_stops_with_the_step_and_keeps_the_last_checkpoint(text_root, tmp_path, monkeypatch):
    real_build = lm_module.build_gpt

    def poisoned(cfg, vocab_size, bos_id=None):
        model = real_build(cfg, vocab_size, bos_id)
        forward, calls = model.forward, []

        def forward_with_nan(idx, targets=None, **kwargs):
            out = forward(idx, targets, **kwargs)
            if targets is not None and kwargs.get("loss_reduction", "mean") == "mean":
                calls.append(1)
                if len(calls) > 3:  # the 4th training step
                    return out * float("nan")
            return out

        model.forward = forward_with_nan
        return model

    monkeypatch.setattr(lm_module, "build_gpt", poisoned)
    with pytest.raises(NonFiniteLossError, match="non-finite loss nan at step 4"):
        train_lm(tiny_lm(text_root, checkpoint_every=1), tmp_path / "run")
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-00000003"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--preset", "nope"],
            "unknown lm preset 'nope'; allowed: shakespeare-cpu, shakespeare-long-cpu, chat-cpu-base, nanochat-d20",
        ),
        (
            ["--preset", "shakespeare-cpu", "--dataset", "wiki"],
            "--dataset 'wiki': allowed: a string, one of shakespeare, fineweb-edu",
        ),
        (
            ["--preset", "shakespeare-cpu", "--tokenizer", "words"],
            "--tokenizer 'words': allowed: a string, one of char, bpe, gpt2",
        ),
        (
            ["--preset", "shakespeare-cpu", "--total-batch-size", "1000"],
            "--total-batch-size 1000 is not a multiple of micro_batch x sequence_len = 8192",
        ),
        (["--preset", "shakespeare-cpu", "--laplacian-heads", "9"], "laplacian_heads=9"),
    ],
)
def test_bad_training_input_is_a_one_line_error(args, message, tmp_path, capsys, text_root):
    code = main(["train", "lm", *args, "--out", str(tmp_path / "r"), "--data-root", str(text_root), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("lapheads train: error: ") and message in err and "\n" not in err


def test_eval_lm_scores_val_bpb_and_arc_from_local_files(trained_run, tmp_path, capsys):
    run, result = trained_run
    rows = [
        {
            "id": f"q{i}",
            "question": f"Which is {i}?",
            "choices": {"text": ["one", "two", "three"], "label": ["A", "B", "C"]},
            "answerKey": "ABC"[i % 3],
        }
        for i in range(6)
    ]
    rows.append({**rows[0], "answerKey": "D"})  # no such choice: left out and counted, not scored as wrong
    (tmp_path / "arc_easy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "lm", str(run), "--benchmarks", "val_bpb,arc_easy", "--data-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out.strip().splitlines()[-1])
    assert printed["arc_easy"]["unusable"] == 1 and "1 item(s) with unusable ground truth left out (rows 7)" in err
    assert printed["val_bpb"]["bpb"] == pytest.approx(result["val_bpb"], rel=1e-4)
    assert printed["arc_easy"]["n"] == 6 and printed["arc_easy"]["skipped_too_long"] == 0
    assert printed["arc_easy"]["chance"] == pytest.approx(1 / 3) and 0 <= printed["arc_easy"]["accuracy"] <= 1
    assert json.loads((run / "report" / "eval_lm.json").read_text())["tasks"]["arc_easy"]["n"] == 6


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--benchmarks", "squad"],
            "unknown benchmark(s) squad; allowed: val_bpb, arc_easy, arc_challenge, mmlu, gsm8k, humaneval",
        ),
        # --tasks: the 0.1 name of --benchmarks, an alias for this release
        (["--tasks", "mmlu", "--data-dir", "/nonexistent"], "task mmlu: no mmlu.jsonl / mmlu.parquet in /nonexistent"),
    ],
)
def test_bad_eval_input_is_a_one_line_error(trained_run, args, message, capsys, monkeypatch):
    import types

    def offline(*args, **kwargs):  # what the hub answers here, without the ~20 s of connection retries
        raise ConnectionError("offline")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    assert main(["eval", "lm", str(trained_run[0]), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_tokenizer_that_does_not_match_the_checkpoint_is_refused(trained_run, tmp_path, capsys):
    import shutil

    from lapheads.data.tokenizers import Tokenizer

    run = tmp_path / "copy"
    shutil.copytree(trained_run[0], run)
    shutil.rmtree(run / "tokenizer")
    Tokenizer.char("xyz").save(run / "tokenizer")
    assert main(["eval", "lm", str(run)]) == 2
    assert "tokenizer has 268 tokens but the model was trained with" in capsys.readouterr().err


def test_data_prepare_tokenises_the_corpus_once(text_root, capsys):
    assert main(["data", "prepare", "shakespeare", "--root", str(text_root), "--tokenizer", "char"]) == 0
    meta = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert meta["dataset"] == "shakespeare" and meta["train_tokens"] > 4_000_000 and meta["val_tokens"] > 300_000
    assert meta["train_documents"] + meta["val_documents"] == 38  # plays; every 10th is validation
    assert main(["data", "prepare", "cifar10", "--root", str(text_root)]) == 2
    assert "allowed: shakespeare, fineweb-edu" in capsys.readouterr().err


@pytest.mark.slow
def test_ddp_two_ranks_match_one_rank_and_resume_from_sharded_muon_state(text_root, tmp_path):
    import shutil

    # 1 rank: 2 accumulation steps; every checkpoint kept so the 2-rank run can be rewound
    cfg = tiny_lm(text_root, num_iterations=4, eval_every=4, micro_batch=8, checkpoint_every=2, keep_checkpoints=0)
    train_lm(cfg, tmp_path / "one")
    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps(dataclasses.asdict(cfg)))

    def two_processes(*extra):
        done = torchrun(
            ["-m", "lapheads", "train", "lm", "--preset", str(preset), "--out", str(tmp_path / "two"), *extra]
        )
        assert done.returncode == 0, done.stderr[-2000:]

    two_processes()
    final = tmp_path / "two" / "checkpoints" / "step-00000004"
    one = load_file(str(tmp_path / "one" / "checkpoints" / "step-00000004" / "model.safetensors"))
    two = load_file(str(final / "model.safetensors"))
    for key in one:
        # same tokens per step and init; only float summation order differs. Unaveraged gradients or other
        # windows would move weights by ~lr (0.02 for Muon) per step.
        torch.testing.assert_close(two[key], one[key], rtol=1e-3, atol=2e-4)
    record = json.loads((tmp_path / "two" / "config.json").read_text())
    assert record["world_size"] == 2
    # Muon's momentum is split across the ranks: two disjoint shards that together hold every block matrix
    shards = [load_file(str(final / f"optimizer-muon-rank{r}.safetensors")) for r in range(2)]
    assert not (final / "optimizer-muon.safetensors").exists()
    assert shards[0] and shards[1] and not set(shards[0]) & set(shards[1])
    with torch.device("meta"):
        blocks = sum(p.numel() for p in lm_module.build_gpt(cfg, record["vocab_size"]).blocks.parameters())
    assert sum(v.numel() for shard in shards for v in shard.values()) == blocks
    # rewind to step 2 and resume: the sharded state brings back the same step-4 weights, bit for bit
    shutil.rmtree(final)
    (tmp_path / "two" / "checkpoints" / "latest").write_text("step-00000002\n")
    two_processes("--resume")
    resumed = load_file(str(final / "model.safetensors"))
    for key in two:
        assert torch.equal(resumed[key], two[key]), key


def test_the_2026_family_trains_and_resumes_with_the_forks_optimizer_groups_and_schedules(text_root, tmp_path):
    cfg = tiny_lm(
        text_root,
        arch="nanochat-2026",
        short_window=8,
        laplacian_heads="0,2",
        num_iterations=8,
        eval_every=4,
        warmup_steps=2,
        warmdown_ratio=0.5,
        final_lr_frac=0.05,
        muon_momentum_warmup=2,
        muon_momentum_end=0.97,
        muon_momentum_final=0.90,
        muon_weight_decay=0.1,
        muon_weight_decay_schedule="cosine",
        grad_clip=0.0,
    )
    straight = train_lm(cfg, tmp_path / "straight")
    assert math.isfinite(straight["val_bpb"])
    record = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert record["config"]["arch"] == "nanochat-2026" and record["laplacian_masks"][1] == [False, False, True, True]
    train_lm(cfg, tmp_path / "resumed", stop_at_step=5)
    train_lm(cfg, tmp_path / "resumed", resume=True)
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000008" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoints" / "step-00000008" / "model.safetensors"))
    assert "value_embeds.1.weight" in a and "smear_lambda" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    # schedules: warm-up steps, momentum to 0.97 then to 0.90 over the warm-down, cosine weight decay
    assert optim.lr_multiplier(0, 8, 0.5, 2, 0.05) == 0.5 and optim.lr_multiplier(4, 8, 0.5, 2, 0.05) == 1.0
    assert optim.lr_multiplier(7, 8, 0.5, 2, 0.05) == pytest.approx(0.25 + 0.75 * 0.05)
    momentum = {s: optim.muon_momentum(s, 8, 0.85, 0.97, 2, 0.90, 0.5) for s in (0, 1, 2, 8)}
    assert momentum == pytest.approx({0: 0.85, 1: 0.91, 2: 0.97, 8: 0.90})
    assert optim.muon_weight_decay(0, 8, 0.1, "cosine") == pytest.approx(0.1)
    assert optim.muon_weight_decay(8, 8, 0.1, "cosine") == 0 and optim.muon_weight_decay(8, 8, 0.1, "constant") == 0.1
    # the chat stages' schedule: flat, then linear to 0 over the last warmdown_ratio
    assert [optim.lr_multiplier(s, 4, 0.5) for s in range(4)] == [1.0, 1.0, 1.0, 0.5]
    assert [optim.lr_multiplier(s, 4, 1.0) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]


def test_the_forks_optimizer_groups(text_root):
    from lapheads.models.gpt import GPT

    cfg = tiny_lm(text_root, arch="nanochat-2026", embedding_lr=0.3, scalar_lr=0.5)
    model = GPT(lm_module.gpt_config(cfg, 40))
    optimizers = optim.build_optimizers(model, cfg)
    groups = optimizers["adamw"].param_groups
    scale = (64 / 768) ** -0.5
    by_first = {id(g["params"][0]): g for g in groups}
    assert by_first[id(model.value_embeds["1"].weight)]["lr"] == pytest.approx(0.3 * scale * 0.5)
    assert by_first[id(model.resid_lambdas)]["lr"] == pytest.approx(0.005)
    assert by_first[id(model.x0_lambdas)]["betas"] == (0.96, 0.95)
    adam_params = {id(p) for g in groups for p in g["params"]}
    muon_params = {id(p) for g in optimizers["muon"].param_groups for p in g["params"]}
    assert adam_params.isdisjoint(muon_params) and len(adam_params | muon_params) == len(list(model.parameters()))
    assert id(model.blocks[1].attn.ve_gate.weight) in muon_params  # the fork's matrix group holds the gates


def test_the_forks_scaling_rules_give_its_batch_steps_and_decay():
    from lapheads.tasks.presets import LM_PRESETS, fork_scaling

    # d20 by hand: width 1280, blocks 20 x 12 x 1280^2 + 10 value-embedding gates of 12 x 10, head 32,768 x 1280
    scaling = 20 * 12 * 1280**2 + 10 * 120 + 32768 * 1280
    d12 = 12 * 12 * 768**2 + 6 * 72 + 32768 * 768
    batch = 2 ** round(math.log2(2**19 * (scaling / d12) ** 0.383))
    rule = fork_scaling(20)
    assert rule["total_batch_size"] == batch == 1_048_576 and rule["num_iterations"] == 12 * scaling // batch
    assert rule["muon_weight_decay"] == pytest.approx(0.28 * 2**0.5 * d12 / scaling)
    preset = LM_PRESETS["nanochat-2026-d20"]
    assert preset.matrix_lr == pytest.approx(0.02 * 2**0.5) and preset.arch == "nanochat-2026"
    assert preset.total_batch_size % (preset.micro_batch * preset.sequence_len) == 0


def test_the_authors_lm_sweep_as_one_dry_run_per_depth(capsys, tmp_path):
    for depth in (12, 16, 20):
        assert (
            main(
                [
                    "sweep",
                    f"nanochat-2026-d{depth}",
                    "--laplacian-heads",
                    "0,1,2,4",
                    "--seeds",
                    "1,2,3",
                    "--out",
                    str(tmp_path / f"d{depth}"),
                    "--dry-run",
                ]
            )
            == 0
        )
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("torchrun")]
    assert len(commands) == 36 and all("--preset nanochat-2026-d" in c for c in commands)


def test_generate_streams_a_continuation_of_a_run(trained_run, capsys):
    run, _ = trained_run
    assert main(["generate", str(run), "--prompt", "ROMEO:\n", "--max-tokens", "12", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    from lapheads.evals.lm import load_lm

    lm = load_lm(run)
    ids = torch.tensor([lm.tokenizer.encode("ROMEO:\n", bos=True)])
    expected = lm.tokenizer.decode(lm.model.generate(ids, 12, temperature=0)[0, 1:].tolist())
    assert out == expected + "\n"
    assert main(["generate", str(run), "--max-tokens", "-1"]) == 2
    capsys.readouterr()
    ask = ["generate", str(run), "--prompt", "ROMEO:\n", "--max-tokens", "12"]
    assert main([*ask, "--temperature", "1", "--top-k", "0", "--top-p", "1e-9"]) == 0  # the nucleus: one token
    assert capsys.readouterr().out == expected + "\n"
    assert main([*ask, "--temperature", "1", "--top-k", "0", "--min-p", "1"]) == 0  # min-p 1: the likeliest alone
    assert capsys.readouterr().out == expected + "\n"
    assert main([*ask, "--temperature", "0", "--repetition-penalty", "1.8"]) == 0
    assert capsys.readouterr().out != expected + "\n"  # the penalty reached the decoder
    assert main([*ask, "--top-p", "1.5"]) == 2
    assert "--top-p 1.5, --min-p 0.0, --repetition-penalty 1.0: allowed: --top-p in (0, 1]" in capsys.readouterr().err


def test_generate_streams_a_character_split_over_byte_tokens_whole(monkeypatch):
    """A continuation whose character is spelled in byte tokens ('€' outside the char tokenizer's corpus) streams
    the character once its last byte arrives, and the pieces join to the decoded continuation (the streamed text
    was U+FFFD and the character was lost)."""
    from types import SimpleNamespace

    import lapheads.apps.batching as batching
    from lapheads.data.tokenizers import Tokenizer
    from lapheads.evals.lm import stream_text

    tokenizer = Tokenizer.char("ROMEO:\nab")
    reply = tokenizer.encode("a€b€")  # the last '€' cut short after its first byte

    def decoded(model, requests, on_token):  # the decoder, reporting the reply's tokens one step each
        for token in reply[:-2]:
            on_token(0, token, None)
            yield
        return []

    monkeypatch.setattr(batching, "decode_steps", decoded)
    lm = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(sequence_len=32)), tokenizer=tokenizer)
    pieces = list(stream_text(lm, "ROMEO:\n", 16, 0.0, 0, 0))
    assert pieces[0] == "ROMEO:\n" and "".join(pieces[1:]) == tokenizer.decode(reply[:-2]) == "a€b\ufffd"
    assert pieces[1:] == ["a", "€", "b", "\ufffd"]  # the cut character shows as decoding the whole text shows it


def _nanochat_base(tmp_path):
    """nanochat's layout: <base>/tokenizer/tokenizer.pkl and <base>/base_checkpoints/d2/{model,meta}_<step>.pt."""
    import pickle

    from lapheads.models.gpt import GPT, GPTConfig
    from tests.data.test_tokenizers import _nanochat_encoding

    encoding = _nanochat_encoding()
    (tmp_path / "tokenizer").mkdir(parents=True)
    (tmp_path / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps(encoding))
    torch.manual_seed(0)
    config = GPTConfig(
        depth=2,
        vocab_size=encoding.n_vocab,
        sequence_len=128,
        aspect_ratio=32,
        head_dim=16,
        arch="nanochat-2026",
        laplacian_heads=[0, 2],
    )
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / "base_checkpoints" / "d2"
    folder.mkdir(parents=True)
    torch.save(model.state_dict(), folder / "model_000050.pt")
    model_config = {
        "sequence_len": 128,
        "vocab_size": encoding.n_vocab,
        "n_layer": 2,
        "n_head": 4,
        "n_kv_head": 4,
        "n_embd": 64,
        "window_pattern": "SSSL",
        "laplacian_heads": [0, 2],
    }
    (folder / "meta_000050.json").write_text(json.dumps({"step": 50, "model_config": model_config}))
    return folder, model.eval()


def test_eval_and_generate_take_a_nanochat_checkpoint(tmp_path, capsys, monkeypatch):
    folder, reference = _nanochat_base(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
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
    assert main(["eval", "lm", "--nanochat", str(folder), "--benchmarks", "arc_easy", "--data-dir", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["arc_easy"]["n"] == 4
    assert (tmp_path / "runs" / "nanochat-d2-step50" / "report" / "eval_lm.json").is_file()  # where analyze writes
    pytest.importorskip("lm_eval")
    harness = ["eval", "lm", "--nanochat", str(folder), "--harness", "lapheads_arc_easy", "--data-dir", str(tmp_path)]
    assert main([*harness, "--limit", "2", "--bootstrap-iters", "0"]) == 0
    assert (tmp_path / "runs" / "nanochat-d2-step50" / "report" / "eval_harness.json").is_file()  # the same folder
    capsys.readouterr()
    assert (
        main(["generate", "--nanochat", str(folder), "--prompt", "the", "--max-tokens", "5", "--temperature", "0"]) == 0
    )
    out = capsys.readouterr().out
    from lapheads.data.tokenizers import Tokenizer

    tokenizer = Tokenizer.nanochat(tmp_path / "base" / "tokenizer")
    ids = torch.tensor([tokenizer.encode("the", bos=True)])
    assert out == tokenizer.decode(reference.generate(ids, 5, temperature=0)[0, 1:].tolist()) + "\n"
    assert main(["eval", "lm", "--nanochat", str(folder), "--benchmarks", "val_bpb"]) == 2
    assert "val_bpb needs lapheads token shards" in capsys.readouterr().err
    assert main(["generate", "--nanochat", str(folder), "--nanochat-tokenizer", str(tmp_path)]) == 2
    assert "tokenizer.pkl does not exist" in capsys.readouterr().err


def test_analyze_takes_a_nanochat_checkpoint(tmp_path, capsys, monkeypatch, text_root):
    folder, _ = _nanochat_base(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "analyze",
                "--nanochat",
                str(folder),
                "--data-root",
                str(text_root),
                "--max-tokens",
                "4096",
                "--top-k",
                "10",
            ]
        )
        == 0
    )
    report = tmp_path / "runs" / "nanochat-d2-step50" / "report"
    analysis = json.loads((report / "analysis.json").read_text())[0]
    assert analysis["task"] == "lm" and analysis["num_sequences"] == 4096 // 128
    assert math.isfinite(analysis["next_token_loss"]) and "norm" in analysis["per_layer"]
    assert "| CDNV, top-K next tokens |" in (report / "summary.md").read_text()
    assert main(["analyze", "--nanochat", str(folder), str(tmp_path)]) == 2


def _prepare(root: str) -> int:
    from lapheads.train.configs.lm import text_source

    return len(text_source(tiny_lm(root)).prepare()[1].train)


def test_cells_started_together_prepare_the_tokens_once(tmp_path):
    import multiprocessing

    # two sweep cells on a fresh data root: without the lock one removed the other's half-written file
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        counts = pool.map(_prepare, [str(tmp_path)] * 2)
    assert counts[0] == counts[1] > 1_000_000


def test_an_lm_of_several_head_kinds_trains_resumes_identically_and_reloads(text_root, tmp_path):
    from lapheads.runs import load_model

    spec = "ordinary/negated/centring/mix,local:1+laplacian:1"  # 4 heads per layer, 2 layers: 5 kinds
    cfg = tiny_lm(text_root, laplacian_heads=spec, num_iterations=8, eval_every=4, checkpoint_every=2)
    _train_straight_and_resumed(cfg, tmp_path)
    weights = load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000008" / "model.safetensors"))
    assert "transformer.h.0.attn.mix_a" in weights and "transformer.h.1.attn.local_o.weight" in weights
    assert not torch.equal(weights["transformer.h.0.attn.mix_b"], torch.ones(4))  # the scalars trained (AdamW)
    record = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert record["head_kinds"] == [
        ["ordinary", "negated", "centring", "mix"],
        ["ordinary", "ordinary", "local", "laplacian"],
    ]
    model = load_model(tmp_path / "straight")
    assert model.head_kinds() == record["head_kinds"]
    assert torch.equal(model.blocks[0].attn.mix_a.detach(), weights["transformer.h.0.attn.mix_a"])


def test_a_gpt_of_head_kinds_decodes_with_its_cache_as_the_full_forward():
    from lapheads.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(
        depth=2,
        vocab_size=50,
        aspect_ratio=16,
        head_dim=8,
        sequence_len=32,
        n_kv_head=2,
        laplacian_heads="ordinary/negated/centring/mix,mix",
    )
    model = GPT(config).eval()
    with torch.no_grad():
        for block in model.blocks:  # move the mix heads off their ordinary start and open the output paths
            if block.attn.mix_a is not None:
                block.attn.mix_a.uniform_(-1, 1)
                block.attn.mix_b.uniform_(-1, 1)
            torch.nn.init.normal_(block.attn.c_proj.weight, std=0.1)
        torch.nn.init.normal_(model.lm_head.weight, std=0.1)
    prompt = torch.randint(0, 50, (1, 6))
    generated = model.generate(prompt, max_new_tokens=6, temperature=0.0)
    full = model(generated[:, :-1])
    assert torch.equal(
        full[:, 5:].argmax(-1), generated[:, 6:]
    )  # greedy: the cached steps chose what the full pass does


def test_a_gpt_of_mix_heads_at_init_has_the_ordinary_models_logits():
    from lapheads.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    plain = GPT(GPTConfig(depth=2, vocab_size=50, aspect_ratio=16, head_dim=8, laplacian_heads=0)).eval()
    torch.manual_seed(0)
    mixed = GPT(GPTConfig(depth=2, vocab_size=50, aspect_ratio=16, head_dim=8, laplacian_heads="mix")).eval()
    mixed.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        for model in (plain, mixed):
            for block in model.blocks:
                block.attn.c_proj.weight.copy_(torch.eye(32))
            model.lm_head.weight.normal_(generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 50, (2, 10))
    assert torch.equal(mixed(tokens), plain(tokens))


def _train_straight_and_resumed(cfg, tmp_path) -> None:
    """Train ``cfg`` straight through and, in another folder, stopped after step 5 and resumed: the final checkpoints
    (weights and both optimizers) must be bit-identical."""
    train_lm(cfg, tmp_path / "straight")
    assert train_lm(cfg, tmp_path / "resumed", stop_at_step=5)["stopped"]
    train_lm(cfg, tmp_path / "resumed", resume=True)
    for name in ("model", "optimizer-adamw", "optimizer-muon"):
        a = load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000008" / f"{name}.safetensors"))
        b = load_file(str(tmp_path / "resumed" / "checkpoints" / "step-00000008" / f"{name}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_eval_whole_split_scores_every_held_out_token_once_after_the_last_step(text_root, tmp_path):
    def final_rows(run, **changes):
        train_lm(tiny_lm(text_root, num_iterations=6, eval_every=6, eval_whole_split=True, **changes), run)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "val_bpb" in r][-1], [r for r in rows if "val_bpb_whole" in r]

    periodic, whole = final_rows(tmp_path / "short-eval")
    assert len(whole) == 1 and whole[0]["step"] == 6  # once, at the end
    assert whole[0]["val_tokens"] > 100 * 2048  # the held-out plays, not the first eval_tokens
    assert whole[0]["val_bpb_whole"] != pytest.approx(periodic["val_bpb"], rel=1e-6)
    # an evaluation that already reads the whole split gives the same number: the same windows, the same model
    periodic, whole = final_rows(tmp_path / "whole-eval", eval_tokens=10**9)
    assert whole[0]["val_bpb_whole"] == pytest.approx(periodic["val_bpb"], rel=1e-9)
