"""``lapheads analyze`` on two small trained vision runs: numbers, plots, summary, cache and bad input."""

from __future__ import annotations

import json
import math

import pytest

from lapheads.cli import main
from lapheads.train.classify import train_classify


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, fmnist_root):
    from lapheads.train.configs.classify import ClassifyConfig
    from tests.conftest import TINY_VIT

    root = tmp_path_factory.mktemp("analyze")
    runs = []
    for heads in ("0", "2"):
        cfg = ClassifyConfig(
            model="vit_fmnist_patch4",
            model_kwargs=dict(TINY_VIT),
            laplacian_heads=heads,
            data_root=str(fmnist_root),
            batch_size=32,
            epochs=0.5,
            lr=3e-3,
            warmup_epochs=0.0,
            amp=False,
            augment=False,
            log_every=4,
            device="cpu",
        )
        train_classify(cfg, root / f"L{heads}")
        runs.append(root / f"L{heads}")
    return runs


def test_analyze_two_runs_writes_numbers_plots_and_summary(two_runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["analyze", *map(str, two_runs), "--out", str(out), "--max-tokens", "3400"]) == 0
    printed = capsys.readouterr().out
    assert "| metric | k=0 | k=2 |" in printed and f"summary: {out / 'summary.md'}" in printed
    for name in ("anova", "collapse", "spectrum", "similarity"):
        assert (out / f"{name}.png").stat().st_size > 5000
    analyses = json.loads((out / "analysis.json").read_text())
    assert [a["laplacian_heads"] for a in analyses] == ["0", "2"]
    for analysis in analyses:
        assert analysis["num_sequences"] == 200 and analysis["tokens_per_sequence"] == 17  # 3400 // 17
        assert analysis["layers"] == ["embed", "1", "2", "norm"]
        for layer in analysis["layers"]:
            metrics = analysis["per_layer"][layer]
            parts = metrics["anova"]
            assert parts["within_seq"] + parts["between_seq"] + parts["between_class"] == pytest.approx(parts["total"])
            assert metrics["collapse_seq"]["num_classes"] == 10 and 0 <= metrics["collapse_seq"]["nc4"] <= 1
            assert 1 <= metrics["spectrum"]["n_components"] <= 32 and -1 <= metrics["similarity"] <= 1
            assert all(math.isfinite(v) for v in metrics["collapse_tokens"].values())
        assert 0 <= analysis["head_input"]["nc3"] <= 2 and 0 < analysis["accuracy"] <= 1
        # the per-run cache sits in the run directory
        cached = json.loads((two_runs[analyses.index(analysis)] / "report" / "analysis.json").read_text())
        assert cached["per_layer"] == analysis["per_layer"]


def test_cached_analysis_is_reused_until_options_change(two_runs, monkeypatch):
    from lapheads.evals import geometry
    from lapheads.study import analyze as module

    options = module.AnalyzeOptions(layers="1,norm", max_tokens=1000)
    first = module.analyze_run(two_runs[0], options)
    calls = []
    monkeypatch.setattr(geometry, "analyze_classify", lambda *a: calls.append(a) or {})
    assert module.analyze_run(two_runs[0], options) == first and not calls
    module.analyze_run(two_runs[0], module.AnalyzeOptions(layers="1", max_tokens=1000))
    assert len(calls) == 1


def test_one_run_reports_into_its_own_folder(two_runs, capsys):
    assert main(["analyze", str(two_runs[1]), "--layers", "2", "--max-tokens", "1700"]) == 0
    assert (two_runs[1] / "report" / "summary.md").exists()
    assert json.loads((two_runs[1] / "report" / "analysis.json").read_text())["layers"] == ["2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layers", "9"], "unknown layers 9; allowed: all, or a comma list of embed, 1, 2, norm"),
        (["--max-tokens", "1"], "--max-tokens 1: allowed: an integer >= 2"),
        (["--fraction", "2"], "fraction must be in (0, 1]; got 2.0"),
    ],
)
def test_bad_options_are_one_line_errors(two_runs, args, message, capsys):
    assert main(["analyze", str(two_runs[0]), *args, "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lapheads analyze: error: {message}"


def test_a_folder_that_is_not_a_run_is_a_one_line_error(tmp_path, capsys):
    assert main(["analyze", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip() == f"lapheads analyze: error: {tmp_path} is not a run directory: no config.json"
    )


def test_analyze_language_model_runs(text_root, tmp_path, capsys):
    from lapheads.train.lm import train_lm
    from tests.conftest import tiny_lm

    runs = []
    for heads in ("0", "4"):
        train_lm(tiny_lm(text_root, laplacian_heads=heads, num_iterations=6, eval_every=6), tmp_path / f"lm{heads}")
        runs.append(str(tmp_path / f"lm{heads}"))
    out = tmp_path / "cmp"
    assert main(["analyze", *runs, "--out", str(out), "--max-tokens", "4096", "--top-k", "20"]) == 0
    printed = capsys.readouterr().out
    assert "| CDNV, top-K next tokens |" in printed and "| metric | k=0 | k=4 |" in printed
    # the withdrawn diffusion scores are not summarised (analysis.json keeps them), and no cell reads nan
    assert "diffusion score" not in printed and "| nan" not in printed.lower()
    assert all("mechanism" in a["per_layer"]["1"] for a in json.loads((out / "analysis.json").read_text()))
    for name in ("linguistic", "spectrum", "similarity"):
        assert (out / f"{name}.png").stat().st_size > 5000
    for analysis in json.loads((out / "analysis.json").read_text()):
        assert analysis["task"] == "lm" and analysis["num_sequences"] == 64 and analysis["tokens_per_sequence"] == 64
        assert 1.0 < analysis["next_token_loss"] < 5.0
        last = analysis["per_layer"]["2"]
        assert last["linguistic"]["num_classes"] == 20 and last["linguistic"]["cdnv"] > 0
        assert 1 <= last["spectrum"]["n_components"] <= 64
        for layer in analysis["layers"]:  # issue 71: the within-sequence fraction at every layer, windows as classes
            anova = analysis["per_layer"][layer]["anova"]
            assert 0 < anova["within_seq_fraction"] <= 1 and anova["between_class"] == 0
    assert "| within-sequence fraction |" in printed


def test_runs_of_different_tasks_are_not_compared(two_runs, text_root, tmp_path, capsys):
    from lapheads.train.lm import train_lm
    from tests.conftest import tiny_lm

    train_lm(tiny_lm(text_root, num_iterations=2, eval_every=2), tmp_path / "lm")
    assert (
        main(["analyze", str(two_runs[0]), str(tmp_path / "lm"), "--max-tokens", "1024", "--out", str(tmp_path / "x")])
        == 2
    )
    assert "analyze compares runs of one task; got classify, lm" in capsys.readouterr().err


def test_geometry_and_diffusion_over_training(tiny_config, tmp_path, capsys):
    import dataclasses

    from lapheads.train.classify import train_classify

    cfg = dataclasses.replace(tiny_config, checkpoint_every=2, keep_checkpoints=0)
    train_classify(cfg, tmp_path / "run")
    assert main(["analyze", str(tmp_path / "run"), "--over-training", "--max-tokens", "1700"]) == 0
    saved = json.loads((tmp_path / "run" / "report" / "over_training.json").read_text())
    assert saved["steps"] == [2, 4, 6, 8] and saved["layer"] == "2"
    assert len(saved["series"]["within-sequence fraction"]) == 4
    laplacian, ordinary = (saved["per_block"][f"diffusion score, {kind} heads"] for kind in ("Laplacian", "ordinary"))
    assert sorted(laplacian) == sorted(ordinary) == ["1", "2"]  # every block, not only the summary layer
    assert all(len(v) == 4 and all(-1 <= d <= 1 for d in v) for v in laplacian.values())
    assert laplacian["2"] != ordinary["2"]
    assert (tmp_path / "run" / "report" / "over_training.png").stat().st_size > 5000
    assert (tmp_path / "run" / "report" / "analysis-step-4.json").is_file()
    assert main(["analyze", str(tmp_path / "run"), str(tmp_path / "run"), "--over-training"]) == 2


def test_language_model_over_training_has_diffusion_scores_for_every_block(text_root, tmp_path):
    """An LM's summary layer is after the final norm, which has no heads: the diffusion scores are per block."""
    from lapheads.train.lm import train_lm
    from tests.conftest import tiny_lm

    cfg = tiny_lm(text_root, num_iterations=6, eval_every=6, checkpoint_every=3, keep_checkpoints=0)
    train_lm(cfg, tmp_path / "lm")
    assert main(["analyze", str(tmp_path / "lm"), "--over-training", "--max-tokens", "4096", "--top-k", "20"]) == 0
    saved = json.loads((tmp_path / "lm" / "report" / "over_training.json").read_text())
    assert saved["steps"] == [3, 6] and saved["layer"] == "norm"
    assert all(math.isfinite(v) for v in saved["series"]["CDNV, top-K next tokens"])
    for kind in ("Laplacian", "ordinary"):  # 2 of 4 heads Laplacian in both blocks
        blocks = saved["per_block"][f"diffusion score, {kind} heads"]
        assert sorted(blocks) == ["1", "2"] and all(math.isfinite(v) for vs in blocks.values() for v in vs)
