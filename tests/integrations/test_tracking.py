"""Trackers mirror metrics.jsonl: TensorBoard during training (resume without duplicates), export-tb afterwards."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lapheads.cli import main
from lapheads.train.lm import train_lm
from tests.conftest import tiny_lm

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _jsonl(run, key) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in records if key in r]


def test_tensorboard_mirrors_metrics_and_a_resumed_run_has_no_duplicate_steps(text_root, tmp_path):
    cfg = tiny_lm(text_root, num_iterations=8, eval_every=4, checkpoint_every=2, log="tensorboard")
    run = tmp_path / "run"
    assert train_lm(cfg, run, stop_at_step=5)["stopped"]  # steps 1-5 logged, last checkpoint at 4
    with pytest.raises(Exception, match="differs"):  # a trajectory field still may not change on resume
        train_lm(dataclasses.replace(cfg, seed=3), run, resume=True)
    train_lm(cfg, run, resume=True)
    seen = _scalars(run / "tensorboard")
    for key in ("loss", "val_bpb"):
        got = seen[key]
        assert [s for s, _ in got] == [s for s, _ in _jsonl(run, key)]  # step 5 once, not twice
        assert [v for _, v in got] == pytest.approx([v for _, v in _jsonl(run, key)], rel=1e-6)


def test_export_tb_replays_a_run_and_a_sweep(text_root, tmp_path, capsys):
    run = tmp_path / "run"
    train_lm(tiny_lm(text_root, num_iterations=4, eval_every=4), run)
    assert main(["export-tb", str(run)]) == 0
    seen = _scalars(run / "tensorboard-export" / "run")
    assert [v for _, v in seen["loss"]] == pytest.approx([v for _, v in _jsonl(run, "loss")], rel=1e-6)
    assert main(["export-tb", str(run)]) == 0  # again: replaced, not doubled
    assert len(_scalars(run / "tensorboard-export" / "run")["loss"]) == len(_jsonl(run, "loss"))
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text(json.dumps({"cells": {"L0-s0": {"run_dir": str(run)}}}))
    assert main(["export-tb", str(tmp_path / "sweep"), "--out", str(tmp_path / "tb")]) == 0
    assert _scalars(tmp_path / "tb" / "L0-s0")["loss"]
    assert main(["export-tb", str(tmp_path)]) == 2
    assert "holds neither metrics.jsonl nor sweep.json" in capsys.readouterr().err


def test_a_missing_tracker_package_is_one_line_before_anything_is_written(text_root, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code = main(
        [
            "train",
            "lm",
            "--preset",
            "shakespeare-cpu",
            "--log",
            "wandb",
            "--out",
            str(tmp_path / "r"),
            "--data-root",
            str(text_root),
            "--num-iterations",
            "1",
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--log wandb needs the wandb package; allowed: pip install wandb" in err and "\n" not in err
    assert not (tmp_path / "r" / "config.json").exists()
    assert main(["train", "lm", "--preset", "shakespeare-cpu", "--log", "mlflow", "--out", str(tmp_path / "r")]) == 2
    assert "--log 'mlflow': allowed: a string, empty or a comma list of tensorboard, wandb" in capsys.readouterr().err


def test_trackers_can_be_added_when_resuming(text_root, tmp_path, capsys):
    run = tmp_path / "run"
    args = [
        "train",
        "lm",
        "--preset",
        "shakespeare-cpu",
        "--out",
        str(run),
        "--data-root",
        str(text_root),
        "--device",
        "cpu",
        "--depth",
        "2",
        "--sequence-len",
        "64",
        "--micro-batch",
        "16",
        "--total-batch-size",
        "1024",
        "--num-iterations",
        "4",
        "--checkpoint-every",
        "2",
        "--eval-every",
        "4",
        "--eval-tokens",
        "1024",
        "--sample-tokens",
        "4",
        "--log-every",
        "1",
    ]
    train_lm_stopped = __import__("lapheads.train.lm", fromlist=["train_lm"]).train_lm
    from lapheads.tasks.presets import resolve_config

    train_lm_stopped(resolve_config("lm", "shakespeare-cpu", None, args[6:]), run, stop_at_step=2)
    assert main(["train", "lm", "--out", str(run), "--resume", "--log", "tensorboard"]) == 0, capsys.readouterr().err
    assert [s for s, _ in _scalars(run / "tensorboard")["loss"]] == [3, 4]  # mirrored from the resume on
