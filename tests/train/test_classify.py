"""Classification training: learning, resume identity, DDP equivalence, checkpoints, failures, the CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import Subset

import lapheads.train.classify as classify
from lapheads.cli import main
from lapheads.data.images import build_image_data
from lapheads.distributed import setup_distributed
from lapheads.errors import CheckpointError, InputError
from lapheads.evals.classify import evaluate_classifier, evaluate_run
from lapheads.io import load_safetensors
from lapheads.runs import RunDir, load_model
from lapheads.runs.checkpoints import NonFiniteLossError
from lapheads.train.classify import train_classify
from tests.conftest import torchrun


def test_tiny_vit_learns_and_evaluates(tiny_config, tmp_path):
    cfg = dataclasses.replace(tiny_config, epochs=2.0, eval_every_epochs=1.0)
    result = train_classify(cfg, tmp_path / "run")
    run = RunDir(tmp_path / "run")
    losses = [r["loss"] for r in run.read_metrics() if "loss" in r]
    assert len(losses) == result["step"] == 32
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4
    assert result["eval_top1"] > 30  # 10 classes: chance is 10%
    record = run.read_config()
    assert record["config"]["laplacian_heads"] == "1" and record["config"]["seed"] == 0
    assert record["laplacian_masks"] == [[False, True]] * 2 and record["torch_version"] == torch.__version__
    again = evaluate_run(tmp_path / "run")
    assert again["eval_top1"] == pytest.approx(result["eval_top1"])


def test_fit_subset_scores_the_training_images_without_augmentation(tiny_config, tmp_path):
    cfg = dataclasses.replace(
        tiny_config, augment=True, train_subset=96, fit_subset=1000, epochs=2.0, eval_every_epochs=1.0
    )
    result = train_classify(cfg, tmp_path / "run")
    run = RunDir(tmp_path / "run")
    assert [r["step"] for r in run.read_metrics() if "fit_top1" in r] == [3, 6]  # with every evaluation
    again = evaluate_run(tmp_path / "run", fit_subset=1000)  # capped at the 96 images the model trained on
    clean = build_image_data("fashion-mnist", cfg.data_root, 28, augment=False).train
    by_hand = evaluate_classifier(load_model(run), Subset(clean, range(96)), setup_distributed("cpu"), 64, amp=False)
    assert result["fit_top1"] == pytest.approx(again["fit_top1"]) == pytest.approx(by_hand["eval_top1"])
    assert result["fit_loss"] == pytest.approx(by_hand["eval_loss"]) and "fit_top5" not in result
    assert again["eval_top1"] == pytest.approx(result["eval_top1"])
    with pytest.raises(InputError, match="--fit-subset 0; allowed: a positive number"):
        evaluate_run(tmp_path / "run", fit_subset=0)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


def test_resume_continues_the_same_trajectory(tiny_config, tmp_path):
    cfg = dataclasses.replace(tiny_config, checkpoint_every=3, augment=True, drop_path=0.1, ema_decay=0.9)
    full = train_classify(cfg, tmp_path / "full")
    stopped = train_classify(cfg, tmp_path / "split", stop_at_step=7)  # killed after step 7; last checkpoint: 6
    assert stopped["stopped"] and (tmp_path / "split" / "checkpoints" / "step-00000006").is_dir()
    resumed = train_classify(cfg, tmp_path / "split", resume=True)
    assert resumed["step"] == full["step"] == 8
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a)
    metrics = lambda d: [r for r in RunDir(d).read_metrics()]  # noqa: E731
    assert metrics(tmp_path / "full") == [
        {**r, "images_per_s": m["images_per_s"]} if "images_per_s" in r else r
        for r, m in zip(metrics(tmp_path / "split"), metrics(tmp_path / "full"))
    ]


def test_a_checkpoint_at_start_keeps_the_weights_as_built_and_changes_no_step(tiny_config, tmp_path):
    """Issue 76: the demo's geometry over training had no point at step 0. --checkpoint-at-start keeps the weights
    as built as checkpoint step 0; the trajectory is the one without it, bit for bit."""
    from safetensors.torch import load_file

    cfg = dataclasses.replace(tiny_config, keep_checkpoints=0)
    train_classify(cfg, tmp_path / "plain")
    train_classify(dataclasses.replace(cfg, checkpoint_at_start=True), tmp_path / "start")
    a, b = final_weights(tmp_path / "plain"), final_weights(tmp_path / "start")
    assert all(torch.equal(a[k], b[k]) for k in a)
    first = load_file(tmp_path / "start" / "checkpoints" / "step-00000000" / "model.safetensors")
    assert any(not torch.equal(first[k], a[k]) for k in a)  # the weights before any step
    assert not (tmp_path / "plain" / "checkpoints" / "step-00000000").exists()


def test_resume_refuses_a_changed_config(tiny_config, tmp_path):
    tiny_config = dataclasses.replace(tiny_config, checkpoint_every=1)
    train_classify(tiny_config, tmp_path / "run", stop_at_step=1)
    with pytest.raises(ValueError, match="differs from .*config.json in: lr"):
        train_classify(dataclasses.replace(tiny_config, lr=1.0), tmp_path / "run", resume=True)
    with pytest.raises(ValueError, match="already holds a run; use --resume"):
        train_classify(tiny_config, tmp_path / "run")
    reworded = dataclasses.replace(tiny_config, description="a preset whose wording changed since the run began")
    assert train_classify(reworded, tmp_path / "run", resume=True)["step"] == 8  # wording is not the recipe


def test_a_run_resumed_where_other_kernels_run_says_so_once(tiny_config, tmp_path, capsys):
    cfg = dataclasses.replace(tiny_config, checkpoint_every=3)
    train_classify(cfg, tmp_path / "run", stop_at_step=4)
    stored = RunDir(tmp_path / "run").read_config()
    assert stored["environment"]["threads"] == torch.get_num_threads() and stored["environment"]["cpu_kernels"]
    capsys.readouterr()
    train_classify(cfg, tmp_path / "same", stop_at_step=4)
    train_classify(cfg, tmp_path / "same", resume=True)
    assert "bit for bit" not in capsys.readouterr().err  # the same machine: nothing to say
    stored["environment"]["cpu_kernels"] = {**stored["environment"]["cpu_kernels"], "mkl": "SSE4_2"}
    (tmp_path / "run" / "config.json").write_text(json.dumps(stored))
    assert train_classify(cfg, tmp_path / "run", resume=True)["step"] == 8  # it goes on
    assert capsys.readouterr().err.count("will not match a run trained in one place bit for bit") == 1


def test_resume_refuses_a_metrics_log_cut_short_and_says_what_it_found(tiny_config, tmp_path, capsys, verbose):
    cfg = dataclasses.replace(tiny_config, checkpoint_every=6, log_every=1)
    train_classify(cfg, tmp_path / "run", stop_at_step=7)  # checkpoint at step 6, records at steps 1..7
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line).get("step", 0) <= 3]
    metrics.write_text("".join(kept))  # a log cut short after step 3: steps 4-6 gone
    with pytest.raises(CheckpointError, match=r"ends at step 3 \(3 training records\) but the checkpoint is at step 6"):
        train_classify(cfg, tmp_path / "run", resume=True)
    assert metrics.read_text() == "".join(kept)  # nothing changed
    metrics.write_text("".join(lines))
    capsys.readouterr()
    assert train_classify(cfg, tmp_path / "run", resume=True)["step"] == 8
    assert "metrics.jsonl: 6 training records up to step 6" in capsys.readouterr().err


def test_a_run_killed_before_its_first_checkpoint_can_start_over_or_resume(tiny_config, tmp_path, capsys):
    train_classify(tiny_config, tmp_path / "run", stop_at_step=1)  # config.json written, no checkpoint yet
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()
    assert train_classify(tiny_config, tmp_path / "run", stop_at_step=1)["stopped"]
    assert "never wrote a checkpoint; starting it over" in capsys.readouterr().err
    full = train_classify(tiny_config, tmp_path / "run", resume=True)
    assert full["step"] == 8 and not full.get("stopped")


@pytest.mark.slow
def test_ddp_two_ranks_match_one_rank(tiny_config, tmp_path):
    # Parameters with zero true gradient would not compare: Adam turns the float noise in their gradients into
    # lr-sized steps. They are the key bias and the key-norm bias (softmax is shift-invariant) and the value bias of
    # Laplacian heads ((I - P) 1 b = 0), so the model has no qkv bias and k_norm.bias is skipped below.
    cfg = dataclasses.replace(tiny_config, epochs=0.25, model_kwargs={**tiny_config.model_kwargs, "qkv_bias": False})
    train_classify(cfg, tmp_path / "one")
    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items()}))
    done = torchrun(["-m", "lapheads", "train", "classify", "--preset", str(preset), "--out", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-2000:]
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    for key in (k for k in one if not k.endswith("k_norm.bias")):
        # Same batches and init; only the order of float sums differs. A wrong split (unaveraged gradients, other
        # samples) moves weights by ~lr = 3e-3 per step.
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=2e-5)
    assert RunDir(tmp_path / "two").read_config()["world_size"] == 2
    # each rank draws its own augmentations (timm's seed + rank): before that fix both ranks drew the same crops,
    # flips, drop-path masks and Mixup lambdas for their micro-batches
    folder = tmp_path / "two" / "checkpoints" / (tmp_path / "two" / "checkpoints" / "latest").read_text().strip()
    rank0, rank1 = (load_file(str(folder / f"rng-rank{r}.safetensors"))["torch_cpu"] for r in (0, 1))
    assert not torch.equal(rank0, rank1)


def test_checkpoint_with_code_payload_is_refused(tiny_config, tmp_path):
    tiny_config = dataclasses.replace(tiny_config, checkpoint_every=1)
    train_classify(tiny_config, tmp_path / "run", stop_at_step=1)
    folder = tmp_path / "run" / "checkpoints" / "step-00000001"
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / "model.safetensors").write_bytes(pickle.dumps({"weights": Payload()}))
    with pytest.raises(CheckpointError, match="is not a valid safetensors file .* refusing to load it"):
        load_safetensors(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        train_classify(tiny_config, tmp_path / "run", resume=True)
    assert not marker.exists()


def test_mismatched_checkpoint_is_one_line(tiny_config, tmp_path):
    train_classify(dataclasses.replace(tiny_config, checkpoint_every=1), tmp_path / "run", stop_at_step=1)
    config_file = tmp_path / "run" / "config.json"
    record = json.loads(config_file.read_text())
    record["model"]["kwargs"]["embed_dim"] = 64  # the recorded constructor arguments no longer fit the weights
    config_file.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="does not match the model .*different config"):
        evaluate_run(tmp_path / "run")


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tiny_config, tmp_path, monkeypatch):
    real = classify._loss_fn
    calls = {"n": 0}

    def poisoned(cfg):
        inner = real(cfg)

        def loss(logits, labels):
            calls["n"] += 1
            value = inner(logits, labels)
            return value * float("nan") if calls["n"] == 5 else value

        return loss

    monkeypatch.setattr(classify, "_loss_fn", poisoned)
    cfg = dataclasses.replace(tiny_config, checkpoint_every=2)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    with pytest.raises(NonFiniteLossError, match="non-finite loss nan at step 5; stopped before the optimizer step"):
        train_classify(cfg, tmp_path / "run")
    folder = tmp_path / "run" / "checkpoints" / "step-00000004"
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == folder.name
    before = digest(folder / "model.safetensors")
    weights = load_file(str(folder / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values()) and digest(folder / "model.safetensors") == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "nope"], "unknown classify preset 'nope'; allowed: fmnist-cpu"),
        (["--preset", "fmnist-cpu", "--model", "vit_nope"], "unknown model 'vit_nope'"),
        (["--preset", "fmnist-cpu", "--data-root", "/does/not/exist"], None),
        (["--preset", "fmnist-cpu", "--img-size", "30"], "img_size=30 is not a multiple of the patch size 7"),
        (["--preset", "fmnist-cpu", "--laplacian-heads", "4"], "laplacian_heads=4 is out of range; allowed: 0 to 3"),
        (["--preset", "fmnist-cpu", "--laplacian-heads", "1,1"], "has 2 entries .* but the model has 6 layers"),
        (["--preset", "fmnist-cpu", "--lr", "fast"], "--lr 'fast': allowed: a finite number"),
        (["--preset", "fmnist-cpu", "--learning-rate", "1"], "unknown option --learning-rate; allowed:"),
    ],
)
def test_cli_bad_input_is_one_line(argv, message, tmp_path, capsys, monkeypatch, fmnist_root):
    import lapheads.data.images as images

    monkeypatch.setattr(images, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian-copy")
    if "--data-root" not in argv:
        argv = [*argv, "--data-root", str(fmnist_root)]
    code = main(["train", "classify", *argv[:2], "--out", str(tmp_path / "run"), *argv[2:]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("lapheads train: error: ")
    if message:
        import re

        assert re.search(message, err), err
    else:
        assert "--data-root '/does/not/exist' does not exist; allowed: an existing directory" in err


def test_the_cosine_reaches_min_lr_at_the_last_step(tiny_config, tmp_path):
    cfg = dataclasses.replace(tiny_config, warmup_epochs=0.25, lr=3e-3, min_lr=1e-5)
    train_classify(cfg, tmp_path / "run")
    rates = [r["lr"] for r in RunDir(tmp_path / "run").read_metrics() if "lr" in r]
    assert max(rates) == pytest.approx(3e-3, rel=0.05)  # the peak right after warm-up
    assert rates[-1] == pytest.approx(1e-5)  # after the last step: the end of the cosine, not part-way down it


def test_the_precision_is_chosen_once_recorded_and_kept_on_resume(tiny_config, tmp_path, monkeypatch):
    from lapheads import hardware
    from lapheads.train import runtime

    cfg = dataclasses.replace(tiny_config, amp="auto", checkpoint_every=3)
    monkeypatch.setattr(runtime, "choose_precision", lambda amp, device: hardware.Precision(False, "fp32: test"))
    train_classify(cfg, tmp_path / "run", stop_at_step=4)
    assert RunDir(tmp_path / "run").read_config()["precision"] == {"autocast_bf16": False, "reason": "fp32: test"}
    # another machine would choose bf16; the resumed run keeps the recorded fp32
    monkeypatch.setattr(runtime, "choose_precision", lambda amp, device: hardware.Precision(True, "bf16: test"))
    used = []
    original = torch.autocast

    def spy(*args, **kwargs):
        used.append(kwargs.get("enabled"))
        return original(*args, **kwargs)

    monkeypatch.setattr(classify.torch, "autocast", spy)
    train_classify(cfg, tmp_path / "run", resume=True)
    assert used and not any(used)


@pytest.mark.parametrize(
    "files",
    [
        {"config.json": '{"lr": 1}', "metrics.jsonl": '{"mine": 1}\n'},  # an ordinary folder: no "task" key
        {"config.json": "[1, 2]", "metrics.jsonl": "x\n"},
        {"config.json": '{"task": "lm", "config": {}}', "metrics.jsonl": "{}\n"},  # another task's run
        {"metrics.jsonl": '{"mine": 1}\n'},  # logs without a config.json: not written by lapheads
    ],
    ids=["no task key", "a list", "another task", "no config.json"],
)
def test_train_never_deletes_or_overwrites_what_lapheads_did_not_write(tiny_config, tmp_path, files):
    folder = tmp_path / "mine"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    with pytest.raises(ValueError, match="nothing was changed"):
        train_classify(tiny_config, folder)
    assert {p.name: p.read_text() for p in folder.iterdir()} == files


@pytest.mark.parametrize("link", ["latest", "step"])
def test_symlinks_never_lead_out_of_a_run_directory(tiny_config, tmp_path, link):
    train_classify(dataclasses.replace(tiny_config, checkpoint_every=4), tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    name = (checkpoints / "latest").read_text().strip()
    outside = tmp_path / "outside"
    (checkpoints / name).rename(outside)
    if link == "step":
        (checkpoints / name).symlink_to(outside)
    else:
        (checkpoints / name).mkdir()
        (checkpoints / "latest").unlink()
        (tmp_path / "pointer").write_text(name + "\n")
        (checkpoints / "latest").symlink_to(tmp_path / "pointer")
    with pytest.raises(CheckpointError, match="symlink or leads out"):
        load_model(RunDir(tmp_path / "run"))


def test_a_model_of_several_head_kinds_trains_resumes_identically_and_reloads(tiny_config, tmp_path):
    # TINY_VIT: 2 layers of 2 heads; four kinds, a learned mix and a gated Laplacian head in one model
    spec = "negated/centring,mix/gated-laplacian"
    cfg = dataclasses.replace(tiny_config, laplacian_heads=spec, checkpoint_every=3)
    full = train_classify(cfg, tmp_path / "full")
    train_classify(cfg, tmp_path / "split", stop_at_step=5)
    resumed = train_classify(cfg, tmp_path / "split", resume=True)
    assert resumed["step"] == full["step"]
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a) and "blocks.1.attn.mix_a" in a
    assert a["blocks.1.attn.head_gate.weight"].abs().sum() > 0  # the gate trained away from its zero start
    record = RunDir(tmp_path / "full").read_config()
    assert record["head_kinds"] == [["negated", "centring"], ["mix", "gated-laplacian"]]
    assert record["laplacian_masks"] == [[False, False], [False, True]]
    model = load_model(RunDir(tmp_path / "full"))
    assert [list(block.attn.heads.names) for block in model.blocks] == record["head_kinds"]
    assert torch.equal(model.blocks[1].attn.mix_b.detach(), a["blocks.1.attn.mix_b"])
    assert torch.equal(model.blocks[1].attn.head_gate.weight.detach(), a["blocks.1.attn.head_gate.weight"])


def test_a_cpu_run_says_once_how_to_get_the_compiled_node_where_it_is_not_built(tiny_config, tmp_path, capsys):
    from lapheads.core import native

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAPHEADS_NATIVE_DIR", str(tmp_path / "no-native"))
        native._load.cache_clear()
        try:
            train_classify(tiny_config, tmp_path / "run", stop_at_step=1)
        finally:
            patch.undo()
            native._load.cache_clear()
    err = capsys.readouterr().err
    assert err.count("compiled CPU node is not built") == 1 and "lapheads kernel build" in err
    if native.module() is not None:  # where it is built, a run says nothing about it
        train_classify(tiny_config, tmp_path / "run2", stop_at_step=1)
        assert "compiled CPU node" not in capsys.readouterr().err


def test_ctrl_c_checkpoints_the_interrupted_step_says_so_in_one_line_and_resume_continues(
    tiny_config, tmp_path, monkeypatch, capsys
):
    import signal

    cfg = dataclasses.replace(tiny_config, augment=True, drop_path=0.1)  # random augmentation: the RNG state counts
    full = train_classify(cfg, tmp_path / "full")
    preset = tmp_path / "tiny.json"
    preset.write_text(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items()}))
    real_step = classify.optimizer_step

    def interrupted_at_step_5(optimizers, step, *args, **kwargs):
        real_step(optimizers, step, *args, **kwargs)
        if step == 4:  # 0-based: the fifth step; Ctrl-C arrives while it runs
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(classify, "optimizer_step", interrupted_at_step_5)
    argv = ["train", "classify", "--preset", str(preset), "--out", str(tmp_path / "split")]
    capsys.readouterr()
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a shell's background job
    assert main(argv) == 130
    said = [line for line in capsys.readouterr().err.splitlines() if "interrupted" in line]
    assert said == [
        f"lapheads train: interrupted (SIGINT) at step 5; saved a checkpoint of step 5 in {tmp_path / 'split'}; "
        "--resume continues from it"
    ]
    assert (tmp_path / "split" / "checkpoints" / "latest").read_text().strip() == "step-00000005"  # not an eval step
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back
    monkeypatch.setattr(classify, "optimizer_step", real_step)
    assert main([*argv, "--resume"]) == 0
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "split")
    assert full["step"] == 8 and all(torch.equal(a[k], b[k]) for k in a)


def test_progress_off_a_terminal_is_plain_lines_not_carriage_returns(tiny_config, tmp_path, capsys, verbose):
    from lapheads.train.runtime import _LineProgress

    train_classify(tiny_config, tmp_path / "run")
    err = capsys.readouterr().err
    assert "\r" not in err and "train: 8/8 steps (100%)" in err  # the closing line; a line every 30 s before it
    progress = _LineProgress(total=10, initial=2, desc="train", disable=False, interval=0.0)
    progress.set_postfix(loss=0.5)
    progress.update(3)
    progress.write("step 5: eval_top1 50.00")
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("train: 5/10 steps (50%), 0:00 elapsed, ~0:00 left, loss=0.5")
    assert lines[1:] == ["step 5: eval_top1 50.00"]  # closing after a line at the same step adds none


def test_the_within_seq_penalty_resumes_bit_identically_and_moves_the_fraction_its_way(tiny_config, tmp_path):
    """The intervention (issue 57): lambda > 0 lowers the within-sequence fraction after the final norm, lambda < 0
    raises it, a run stopped and resumed under it is the straight run, and lambda = 0 attaches nothing."""
    from lapheads.geometry import anova
    from lapheads.geometry.features import ResidualStream

    base = dataclasses.replace(tiny_config, laplacian_heads="0", epochs=1.0, eval_every_epochs=1.0, lr=3e-3)

    def fraction_after_training(penalty: float, out: Path) -> float:
        train_classify(dataclasses.replace(base, within_seq_penalty=penalty), out)
        model = load_model(RunDir(out)).eval()
        data = build_image_data("fashion-mnist", base.data_root, 28, augment=False).eval
        images = torch.stack([data[i][0] for i in range(64)])
        with ResidualStream(model, ["norm"]) as stream, torch.no_grad():
            model(images)
            return anova(stream.tokens["norm"])["within_seq_fraction"]

    plain, lowered, raised = (fraction_after_training(p, tmp_path / f"p{p}") for p in (0.0, 1.0, -1.0))
    assert lowered < plain - 0.02 and raised > plain + 0.02, (lowered, plain, raised)
    logged = [r["within_seq_fraction"] for r in RunDir(tmp_path / "p1.0").read_metrics() if "within_seq_fraction" in r]
    assert logged and all(0 < f < 1 for f in logged)  # the manipulation check, logged as it trains
    assert not any("within_seq_fraction" in r for r in RunDir(tmp_path / "p0.0").read_metrics())

    cfg = dataclasses.replace(base, within_seq_penalty=1.0, checkpoint_every=3)
    train_classify(cfg, tmp_path / "full")
    assert train_classify(cfg, tmp_path / "split", stop_at_step=7)["stopped"]
    train_classify(cfg, tmp_path / "split", resume=True)
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_zero_penalty_is_todays_run(tiny_config, tmp_path, monkeypatch):
    """lambda = 0 leaves the training step as it was: no hook, the same objective, the same weights bit for bit as a
    run whose config predates the option (its default)."""
    hooks = []
    monkeypatch.setattr(classify, "FinalNormTokens", lambda model: hooks.append(model))
    train_classify(dataclasses.replace(tiny_config, within_seq_penalty=0.0), tmp_path / "zero")
    train_classify(tiny_config, tmp_path / "default")
    assert not hooks
    a, b = final_weights(tmp_path / "zero"), final_weights(tmp_path / "default")
    assert all(torch.equal(a[k], b[k]) for k in a)
