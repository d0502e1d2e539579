"""DINO training end to end on generated Fashion-MNIST files: no teacher gradients, EMA, resume, evals, bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from lapheads.cli import main
from lapheads.data.multicrop import MultiCropAugmentation, collate_crops
from lapheads.train.dino import build_student_teacher, train_dino
from tests.conftest import torchrun


def test_multicrop_shapes_and_collation():
    augment = MultiCropAugmentation(28, 12, 3, (0.5,), (0.5,), local_scale=(0.1, 0.4))
    crops, labels = collate_crops([(augment(torch.rand(1, 28, 28)), i) for i in range(5)])
    assert [tuple(c.shape) for c in crops] == [(5, 1, 28, 28)] * 2 + [(5, 1, 12, 12)] * 3
    assert labels.tolist() == [0, 1, 2, 3, 4]


def test_teacher_gets_no_gradients_and_follows_the_student(tiny_dino):
    student, teacher = build_student_teacher(tiny_dino, in_chans=1)
    assert all(torch.equal(a, b) for a, b in zip(student.state_dict().values(), teacher.state_dict().values()))
    crops = [torch.randn(4, 1, 28, 28)] * 2 + [torch.randn(4, 1, 12, 12)] * 2
    (student(crops).sum() + teacher(crops[:2]).sum()).backward()
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert any(p.grad is not None for p in student.parameters())


def test_training_runs_and_resumes_on_the_same_trajectory(tiny_dino, tmp_path):
    result = train_dino(tiny_dino, tmp_path / "straight")
    assert result["step"] == 8 and result["loss"] > 0
    assert train_dino(tiny_dino, tmp_path / "resumed", stop_at_step=5)["stopped"]
    train_dino(tiny_dino, tmp_path / "resumed", resume=True)
    for name in ("model", "teacher", "dino_loss", "optimizer"):
        a = load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000008" / f"{name}.safetensors"))
        b = load_file(str(tmp_path / "resumed" / "checkpoints" / "step-00000008" / f"{name}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    student = load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000008" / "model.safetensors"))
    teacher = load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000008" / "teacher.safetensors"))
    assert not torch.equal(student["backbone.blocks.0.attn.qkv.weight"], teacher["backbone.blocks.0.attn.qkv.weight"])
    assert (
        load_file(str(tmp_path / "straight" / "checkpoints" / "step-00000008" / "dino_loss.safetensors"))["center"]
        .abs()
        .sum()
        > 0
    )
    metrics = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["teacher_momentum"] > metrics[0]["teacher_momentum"]  # cosine momentum towards 1
    record = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert record["task"] == "dino" and record["laplacian_masks"] == [[False, True]] * 2


@pytest.mark.slow
def test_eval_dino_prints_probes_and_writes_pictures(tiny_dino, tmp_path, capsys):
    train_dino(tiny_dino, tmp_path / "a")
    train_dino(dataclasses.replace(tiny_dino, laplacian_heads="0"), tmp_path / "b")
    code = main(["eval", "dino", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "pics")])
    assert code == 0
    said = capsys.readouterr()
    out = said.err  # the human summary, one line per run, logged; the answer is the JSON line on stdout
    assert "k-NN k=10" in out and "linear" in out and "segmentation mIoU" in out
    assert json.loads(said.out).keys() == {str(tmp_path / "a"), str(tmp_path / "b")}
    result = json.loads((tmp_path / "a" / "report" / "eval_dino.json").read_text())
    assert set(result["knn"]) == set(result["knn_random_init"]) == {"10", "20", "100", "200"}
    assert result["knn"]["10"] > 30  # chance: 10%
    assert "random init" in out
    assert 0 <= result["segmentation"]["miou"] <= 100 and len(result["segmentation"]["per_class"]) == 11
    assert 0 <= result["pca_foreground_iou"] <= 100
    assert (tmp_path / "a" / "report" / "attention.png").stat().st_size > 5000
    assert (tmp_path / "pics" / "pca.png").stat().st_size > 5000
    assert main(["analyze", str(tmp_path / "a"), "--max-tokens", "2000"]) == 0
    analysis = json.loads((tmp_path / "a" / "report" / "analysis.json").read_text())
    assert analysis["task"] == "dino" and "anova" in analysis["per_layer"]["2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "nope"], "unknown dino preset 'nope'; allowed: dino-vits16-imagenet, dino-fmnist-cpu"),
        (
            ["--preset", "dino-fmnist-cpu", "--dataset", "mnist"],
            "--dataset 'mnist': allowed: a string, one of fashion-mnist",
        ),
        (["--preset", "dino-fmnist-cpu", "--laplacian-heads", "7"], "laplacian_heads"),
    ],
)
def test_bad_input_is_a_one_line_error(args, message, tmp_path, capsys, fmnist_root):
    code = main(["train", "dino", *args, "--out", str(tmp_path / "r"), "--data-root", str(fmnist_root)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err


def test_eval_dino_refuses_other_runs(tmp_path, capsys, tiny_config):
    from lapheads.train.classify import train_classify

    train_classify(dataclasses.replace(tiny_config, epochs=0.1), tmp_path / "cls")
    assert main(["eval", "dino", str(tmp_path / "cls")]) == 2
    assert "holds a 'classify' run; allowed here: dino" in capsys.readouterr().err


@pytest.mark.slow
def test_ddp_two_ranks_train_split_the_batch_and_save_every_ranks_rng(tiny_dino, tmp_path):

    # Each rank draws its crops from its own RNG stream, so 2 ranks cannot reproduce 1 rank bit for bit (the
    # resume test holds exactness); this checks that torchrun training runs, splits the global batch and saves
    # every rank's RNG state.
    cfg = dataclasses.replace(tiny_dino, epochs=1, drop_path=0.0)
    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps(dataclasses.asdict(cfg)))
    done = torchrun(["-m", "lapheads", "train", "dino", "--preset", str(preset), "--out", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "two" / "config.json").read_text())
    assert record["world_size"] == 2 and record["steps"] == 4  # 256 images / global batch 64
    folder = tmp_path / "two" / "checkpoints" / "step-00000004"
    assert (folder / "rng-rank0.safetensors").exists() and (folder / "rng-rank1.safetensors").exists()
    student = load_file(str(folder / "model.safetensors"))
    teacher = load_file(str(folder / "teacher.safetensors"))
    assert all(torch.isfinite(v).all() for v in student.values())
    assert not torch.equal(student["backbone.blocks.0.attn.qkv.weight"], teacher["backbone.blocks.0.attn.qkv.weight"])
