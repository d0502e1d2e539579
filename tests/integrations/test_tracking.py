"""Trackers mirror metrics.jsonl: TensorBoard during training (resume without duplicates), export-tb afterwards."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from lapheads.cli import main
from lapheads.train.lm import train_lm
from tests.conftest import tiny_lm

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator  # noqa: E402


def _events(folder) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})  # what the TensorBoard server reads
    events.Reload()
    return events


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series (float64 tensors) of an event folder, as written."""
    from tensorboard.util import tensor_util

    events = _events(folder)
    return {
        tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
        if events.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
    }


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
        assert [v for _, v in got] == [v for _, v in _jsonl(run, key)]  # float64: the JSONL's numbers exactly


def test_export_tb_replays_a_run_and_a_sweep(text_root, tmp_path, capsys):
    run = tmp_path / "run"
    train_lm(tiny_lm(text_root, num_iterations=4, eval_every=4), run)
    assert main(["export-tb", str(run)]) == 0
    seen = _scalars(run / "tensorboard-export" / "run")
    assert [v for _, v in seen["loss"]] == [v for _, v in _jsonl(run, "loss")]
    assert "samples/text_summary" in _events(run / "tensorboard-export" / "run").Tags()["tensors"]  # samples.jsonl
    assert main(["export-tb", str(run)]) == 0  # again: replaced, not doubled
    assert len(_scalars(run / "tensorboard-export" / "run")["loss"]) == len(_jsonl(run, "loss"))
    (tmp_path / "sweep").mkdir()
    cells = {"L0-s0": {"run_dir": str(run), "spec": "0", "seed": 0}}
    (tmp_path / "sweep" / "sweep.json").write_text(json.dumps({"cells": cells}))
    assert main(["export-tb", str(tmp_path / "sweep"), "--out", str(tmp_path / "tb")]) == 0
    assert _scalars(tmp_path / "tb" / "L0-s0")["loss"]
    plugins = _events(tmp_path / "tb" / "L0-s0").PluginTagToContent("hparams")  # one HParams row per cell
    assert "_hparams_/session_start_info" in plugins
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


def test_non_finite_values_are_exported_not_dropped(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": float("nan")}, {"step": 3, "loss": float("inf")}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["export-tb", str(run)]) == 0
    values = [v for _, v in _scalars(run / "tensorboard-export" / "run")["loss"]]
    assert values[0] == 2.5 and math.isnan(values[1]) and values[2] == math.inf
