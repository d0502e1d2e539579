"""``lapheads sweep`` and ``lapheads report``: cells, resume without redoing, statistics, bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from scipy import stats

from lapheads.cli import main
from lapheads.study import cells as cells_module
from lapheads.study.report import (
    diffusion_against_zero,
    fit_against_test,
    gap_over_training,
    holm,
    late_change,
    mechanism_verdict,
    paired_test,
    summarize,
    welch_t_test,
    write_report,
)
from lapheads.study.report.statistics import dose_response, settled_from
from lapheads.study.report.tables import late_change_lines, table_row
from lapheads.tasks.metrics import VAL_BPB, Metric


def test_sweep_runs_every_cell_and_resumes_without_redoing_finished_ones(tiny_preset, tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    args = [
        "sweep",
        str(tiny_preset),
        "--task",
        "classify",
        "--laplacian-heads",
        "0,1",
        "--seeds",
        "0,1",
        "--out",
        str(out),
        "--set",
        "lr=0.003",
        "--set",
        "fit_subset=64",
    ]
    real_train = cells_module._train("classify")
    calls = []

    def killed_after_two(cfg, run_dir, resume=False):
        calls.append((run_dir.name, resume))
        if len(calls) == 3:
            real_train(cfg, run_dir, resume=resume, stop_at_step=1)  # a checkpoint-less partial cell
            raise KeyboardInterrupt
        return real_train(cfg, run_dir, resume=resume)

    monkeypatch.setattr(cells_module, "_train", lambda task: killed_after_two)
    assert main(args) == 130  # Ctrl-C: one line, no traceback (issue 60), the cell in progress marked
    assert (
        "interrupted; L0-s1 stopped at its last checkpoint; rerun the same command to resume" in capsys.readouterr().err
    )
    record = json.loads((out / "sweep.json").read_text())
    assert [c["status"] for c in record["cells"].values()] == ["done", "done", "interrupted", "pending"]
    calls.clear()
    assert main(args) == 0
    assert calls == [("L0-s1", True), ("L1-s1", False)]  # finished cells skipped, the partial one resumed
    record = json.loads((out / "sweep.json").read_text())
    assert len(record["cells"]) == 4 and all(c["status"] == "done" for c in record["cells"].values())
    assert json.loads((out / "L1-s1" / "config.json").read_text())["config"]["seed"] == 1
    assert json.loads((out / "L1-s1" / "config.json").read_text())["config"]["lr"] == 0.003

    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| test top-1 (%) | primary | 1 | 2 |" in printed
    assert "within-sequence fraction (last block) | secondary | 1 | 2 |" in printed
    assert "within-sequence fraction (after the final norm) | declared | 1 | 2 |" in printed
    saved = json.loads((out / "report" / "stats.json").read_text())
    assert saved["metrics"]["test top-1 (%)"]["1"]["n"] == 2 and "paired" in saved["metrics"]["test top-1 (%)"]["1"]
    assert (out / "report" / "metric.png").stat().st_size > 5000 and (out / "report" / "geometry.png").exists()
    report = (out / "report" / "report.md").read_text()
    assert "test top-1 (%), paired gap over training" in report and (out / "report" / "gap.png").exists()
    assert saved["over_training"]["test top-1 (%)"]["1"][-1]["n_pairs"] == 2
    assert "test top-1 (%), change over the last quarter of training" in report
    assert saved["late_change"]["test top-1 (%)"]["0"]["n_pairs"] == 2
    assert "Fit: final top-1 on the first training images" in report and saved["fit"]["1"]["n_pairs"] == 2
    laplacian = saved["mechanism"]["diffusion score, Laplacian heads (mean over blocks)"]
    assert list(laplacian) == ["1"] and laplacian["1"]["n"] == 2  # k = 0 has no Laplacian head to score
    assert "| diffusion score, Laplacian heads (block 2) | 1 | 2 |" in report
    # when do the heads turn diffusive: every kept checkpoint of every cell, read from the weights
    emergence = saved["mechanism_over_training"]
    kept = sorted(int(p.name[5:]) for p in (out / "L1-s0" / "checkpoints").glob("step-*"))
    assert [row["step"] for row in emergence["diffusion score, Laplacian heads"]["1"]] == kept
    assert all(row["n_pairs"] == 2 for row in emergence["diffusion score, ordinary heads"]["0"])
    assert "diffusion score, Laplacian heads (mean over blocks) at every kept checkpoint" in report
    assert (out / "report" / "mechanism.png").stat().st_size > 5000


@pytest.mark.slow
def test_a_per_layer_schedule_sweep_reports_each_schedule_against_k_0(tiny_preset, tmp_path, capsys):
    """The depth study's shape (Laplacian heads only early, only late), extended by a seed afterwards."""
    out = tmp_path / "depth"
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0;2,0;0,2", "--out", str(out)]
    assert main([*args, "--seeds", "0"]) == 0 and main([*args, "--seeds", "0,1"]) == 0  # a second seed added
    assert sorted(p.name for p in out.glob("L*")) == ["L0-s0", "L0-s1", "L0_2-s0", "L0_2-s1", "L2_0-s0", "L2_0-s1"]
    assert main(["report", str(out)]) == 0
    saved = json.loads((out / "report" / "stats.json").read_text())
    assert {spec: row["n"] for spec, row in saved["metrics"]["test top-1 (%)"].items()} == {"0": 2, "2,0": 2, "0,2": 2}
    assert saved["mechanism"]["diffusion score, Laplacian heads (block 1)"].keys() == {"2,0"}  # early heads only
    assert saved["mechanism"]["diffusion score, Laplacian heads (block 2)"].keys() == {"0,2"}
    assert set(saved["mechanism_over_training"]["diffusion score, Laplacian heads"]) == {"2,0", "0,2"}
    report = (out / "report" / "report.md").read_text()
    assert "| test top-1 (%) | primary | 2,0 | 2 |" in report and "k = 0,2:" in report
    assert (out / "report" / "metric.png").exists() and (out / "report" / "mechanism.png").exists()
    # early-only against late-only, seed by seed, beside (not over) the k = 0 report
    assert main(["report", str(out), "--baseline", "0,2", "--no-geometry"]) == 0
    versus = json.loads((out / "report-vs-L0_2" / "stats.json").read_text())
    top1 = {spec: row["values"] for spec, row in versus["metrics"]["test top-1 (%)"].items()}
    early_minus_late = [top1["2,0"][seed] - top1["0,2"][seed] for seed in ("0", "1")]
    assert versus["baseline"] == "0,2" and "paired" not in versus["metrics"]["test top-1 (%)"]["0,2"]
    assert versus["metrics"]["test top-1 (%)"]["2,0"]["paired"]["mean_difference"] == pytest.approx(
        np.mean(early_minus_late)
    )
    assert "difference vs 0,2 [95% CI]" in (out / "report-vs-L0_2" / "report.md").read_text()
    assert json.loads((out / "report" / "stats.json").read_text()) == saved  # the k = 0 report is untouched
    assert main(["report", str(out), "--baseline", "3"]) == 2
    assert "--baseline '3' is not a spec of this sweep; choose one of 0, 2,0, 0,2" in capsys.readouterr().err
    # the mechanism alone: every changed head against its k = 0 twin, and no headline or geometry row
    assert main(["mechanism", str(out)]) == 0
    mechanism = (out / "report" / "mechanism.md").read_text()
    twins = "within-sequence fraction drop, Laplacian heads minus their k = 0 twins"
    assert f"| {twins} | 2,0 | 2 |" in mechanism and f"| {twins} | 0,2 | 2 |" in mechanism
    assert "P-aware diffusion, Laplacian heads minus their k = 0 twins" in mechanism
    assert "test top-1" not in mechanism and "within-sequence fraction (" not in mechanism
    saved_twins = json.loads((out / "report" / "mechanism.json").read_text())["mechanism"][twins]
    assert saved_twins["2,0"]["verdict"] == "not decided (2 seed pairs; a verdict needs 3)"
    assert json.loads((out / "report" / "stats.json").read_text()) == saved  # report.md's numbers untouched
    # a cell whose config.json was edited to another arm is not reported under its old one
    edited = json.loads((out / "L0-s1" / "config.json").read_text())
    edited["config"]["laplacian_heads"] = "2,0"
    (out / "L0-s1" / "config.json").write_text(json.dumps(edited))
    capsys.readouterr()
    assert main(["report", str(out)]) == 2 and main(["mechanism", str(out)]) == 2
    err = capsys.readouterr().err
    assert "L0-s1: cell arm '0', trained with laplacian_heads '2,0'; allowed: the same arm" in err


def test_one_job_trains_in_this_process_with_the_threads_asked_for(tiny_preset, tmp_path, monkeypatch):
    import torch

    seen = []
    monkeypatch.setattr(
        cells_module, "_train", lambda task: lambda cfg, run_dir, resume: seen.append(torch.get_num_threads())
    )
    before = torch.get_num_threads()
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0", "--seeds", "0,1"]
    assert main([*args, "--out", str(tmp_path / "a"), "--threads", "1"]) == 0
    assert seen == [1, 1] and torch.get_num_threads() == before  # capped while the cells train, then restored


@pytest.mark.slow
def test_parallel_jobs_train_every_cell_in_its_own_process_and_record_failures(tiny_preset, tmp_path, capsys):
    out = tmp_path / "sweep"
    args = [
        "sweep",
        str(tiny_preset),
        "--task",
        "classify",
        "--laplacian-heads",
        "0,1",
        "--seeds",
        "0",
        "--out",
        str(out),
        "--jobs",
        "2",
        "--threads",
        "2",
    ]
    assert main(args) == 0
    record = json.loads((out / "sweep.json").read_text())
    assert [c["status"] for c in record["cells"].values()] == ["done", "done"]
    assert "1 thread;" in capsys.readouterr().out and (out / "logs" / "L1-s0.log").is_file()
    assert json.loads((out / "L1-s0" / "config.json").read_text())["config"]["laplacian_heads"] == "1"
    # a cell whose process fails is marked failed, the others finish, the command says which and exits 2
    other = tmp_path / "other"
    (other / "L0-s1").mkdir(parents=True)
    (other / "L0-s1" / "config.json").write_text("{broken")
    assert main([*args[:7], "0,1", "--out", str(other), *args[10:]]) == 2
    assert "1 cell(s) failed: L0-s1" in capsys.readouterr().err
    statuses = {name: c["status"] for name, c in json.loads((other / "sweep.json").read_text())["cells"].items()}
    assert statuses == {"L0-s0": "done", "L1-s0": "done", "L0-s1": "failed", "L1-s1": "done"}


@pytest.mark.slow
def test_a_dino_sweep_report_evaluates_every_cell_once(tiny_dino, tmp_path, monkeypatch, capsys):
    from lapheads.evals import dino as dino_evals

    preset = tmp_path / "dino.json"
    cfg = dataclasses.replace(tiny_dino, epochs=1)
    preset.write_text(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k != "laplacian_heads"}))
    out = tmp_path / "sweep"
    assert (
        main(["sweep", str(preset), "--task", "dino", "--laplacian-heads", "0,1", "--seeds", "0", "--out", str(out)])
        == 0
    )
    assert main(["report", str(out), "--no-geometry"]) == 0
    report = (out / "report" / "report.md").read_text()
    for label in (
        "k-NN top-1, k = 20 (%)",
        "k-NN top-1 at random init, k = 20 (%)",
        "linear probe top-1 (%)",
        "segmentation mIoU (%)",
        "PCA foreground IoU (%)",
    ):
        assert f"| {label} | primary | 1 | 1 |" in report or f"| {label} | secondary | 1 | 1 |" in report
    assert (out / "report" / "pca.png").stat().st_size > 5000 and "![pca](pca.png)" in report
    first = (out / "L1-s0" / "report" / "eval_dino.json").read_text()

    def not_again(*args, **kwargs):
        raise AssertionError("a cached cell was evaluated again")

    monkeypatch.setattr(dino_evals, "_probe_run", not_again)
    assert main(["report", str(out), "--no-geometry"]) == 0  # same checkpoints, same options: probes reused
    assert (out / "L1-s0" / "report" / "eval_dino.json").read_text() == first
    assert (out / "report" / "report.md").read_text() == report


def test_dry_run_prints_one_torchrun_command_per_cell(capsys, tmp_path):
    assert (
        main(
            [
                "sweep",
                "shakespeare-cpu",
                "--laplacian-heads",
                "0;2,2,0,0",
                "--seeds",
                "3,4",
                "--dry-run",
                "--out",
                str(tmp_path / "s"),
                "--nproc-per-node",
                "2",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and not (tmp_path / "s").exists()
    assert lines[2] == (
        f"torchrun --nproc_per_node=2 -m lapheads train lm --preset shakespeare-cpu --laplacian-heads 0 "
        f"--seed 4 --out {tmp_path / 's' / 'L0-s4'}"
    )  # seed-major: both specs of seed 3 first
    assert "--laplacian-heads 2,2,0,0 --seed 3" in lines[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope", "--laplacian-heads", "0", "--seeds", "0"], "unknown preset 'nope'"),
        (["fmnist-cpu", "--laplacian-heads", "0,x", "--seeds", "0"], "malformed --laplacian-heads '0,x'"),
        (["fmnist-cpu", "--laplacian-heads", "0", "--seeds", ","], "--seeds ',': allowed: a non-empty comma list"),
        (["fmnist-cpu", "--laplacian-heads", "0,9", "--seeds", "0"], "laplacian_heads=9"),
        (["fmnist-cpu", "--laplacian-heads", "0", "--seeds", "0", "--set", "lr"], "--set 'lr': allowed: key=value"),
    ],
)
def test_bad_sweep_input_is_a_one_line_error(args, message, capsys, tmp_path):
    assert main(["sweep", *args, "--out", str(tmp_path / "s"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_sweep_extends_with_more_specs_or_seeds_and_refuses_another_experiment(tmp_path, capsys):
    out = tmp_path / "s"
    out.mkdir()
    recorded = {"preset": "fmnist-cpu", "task": "classify", "specs": ["0", "3"], "seeds": [0, 1], "overrides": []}
    (out / "sweep.json").write_text(json.dumps({**recorded, "cells": {}}))

    def sweep(specs: str, seeds: str, *extra: str) -> int:
        args = ["sweep", "fmnist-cpu", "--laplacian-heads", specs, "--seeds", seeds, "--out", str(out), "--dry-run"]
        return main([*args, *extra])

    assert sweep("0,3", "0,1") == 0 and "extending" not in capsys.readouterr().out  # the same sweep: resume
    assert sweep("0,3,1", "0,1,2") == 0  # a new arm and a third seed for every arm
    printed = capsys.readouterr().out
    assert "extending" in printed and "specs 1, seeds 2" in printed
    assert printed.count("python -m lapheads train") == 9 and "torchrun" not in printed  # a CPU preset: one process
    for refused in [("0", "0,1"), ("0,3", "0"), ("0,3", "0,1", "--set", "lr=0.003")]:
        assert sweep(*refused) == 2  # fewer arms, fewer seeds, another recipe
        err = capsys.readouterr().err
        assert "holds a different sweep" in err and "or more of them" in err and "\n" not in err.strip()
    assert main(["sweep", "fmnist-10k-cpu", "--laplacian-heads", "0,3", "--seeds", "0,1", "--out", str(out)]) == 2
    assert "holds a different sweep (fmnist-cpu" in capsys.readouterr().err
    assert json.loads((out / "sweep.json").read_text()) == {**recorded, "cells": {}}  # nothing rewritten
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no sweep (sweep.json missing)" in capsys.readouterr().err


def test_statistics_match_scipy_on_hand_made_results():
    a, b = [86.1, 85.2, 86.9, 85.5], [85.7, 84.9, 85.1]
    ours, theirs = welch_t_test(a, b), stats.ttest_ind(a, b, equal_var=False)
    assert ours["t"] == pytest.approx(theirs.statistic) and ours["p"] == pytest.approx(theirs.pvalue)
    assert ours["df"] == pytest.approx(theirs.df)
    summary = summarize({"0": dict(enumerate(b)), "3": dict(enumerate(a))})
    assert summary["3"].mean == pytest.approx(np.mean(a)) and summary["3"].std == pytest.approx(np.std(a, ddof=1))
    assert summary["3"].welch["p"] == pytest.approx(theirs.pvalue) and summary["0"].n == 3


def test_paired_statistics_match_scipy_on_fixed_numbers():
    a = {0: 86.1, 1: 85.2, 2: 86.9, 3: 85.5, 4: 86.0}
    b = {0: 85.7, 1: 84.9, 2: 85.1, 3: 85.6, 4: 85.2}
    ours, theirs = paired_test(a, b), stats.ttest_rel(list(a.values()), list(b.values()))
    assert ours["p"] == pytest.approx(theirs.pvalue) and ours["t"] == pytest.approx(theirs.statistic)
    diff = np.array(list(a.values())) - np.array(list(b.values()))
    low, high = stats.t.interval(0.95, 4, loc=diff.mean(), scale=stats.sem(diff))
    assert (ours["ci_low"], ours["ci_high"]) == (pytest.approx(low), pytest.approx(high))
    # MDE of a paired t-test at 80% power, alpha 0.05: (t_0.975 + t_0.80) x standard error of the mean difference
    assert ours["mde"] == pytest.approx((stats.t.ppf(0.975, 4) + stats.t.ppf(0.8, 4)) * stats.sem(diff))
    assert paired_test({0: 1.0}, {1: 1.0})["n_pairs"] == 0 and np.isnan(paired_test({0: 1.0}, {0: 2.0})["p"])


def test_holm_and_the_verdict_rule():
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": float("nan")})
    assert adjusted["a"] == pytest.approx(0.03) and adjusted["c"] == pytest.approx(0.06)
    assert adjusted["b"] == pytest.approx(0.06) and np.isnan(adjusted["d"])  # monotone: max with the step before
    assert mechanism_verdict(+1.2, 0.01, 0.5, +1) == "held" and mechanism_verdict(-1.2, 0.01, 0.5, +1) == "opposite"
    assert (
        mechanism_verdict(+0.3, 0.30, 1.57, +1) == "not detected (MDE 1.57)"
        and mechanism_verdict(1.0, 0.01, 0.5, None) == "no claim"
    )
    assert mechanism_verdict(+0.3, math.nan, math.nan, +1) == "not tested (fewer than 2 seeds)"
    assert mechanism_verdict(+0.3, math.nan, math.nan, +1, 8) == "not tested (the values have no spread)"  # 8 seeds


def test_a_sweep_with_one_pair_so_far_reports_it_untested_without_nan():
    from lapheads.study.verdicts import apply_rule

    def judged(values, others=None):
        family = {"test top-1 (%)": summarize(values)}
        apply_rule(family, others or {}, {"test top-1 (%)": +1, "token cosine similarity (last block)": None})
        return family["test top-1 (%)"]["3"]

    row = judged({"0": {0: 80.0, 1: 81.0}, "3": {0: 82.0}})
    text = table_row("test top-1 (%)", "3", row)
    assert "nan" not in text and "+2 (1 pair)" in text and "not tested" in text
    # arms on different seeds: Welch on the difference of the means
    assert "| +2.5 (Welch) |" in table_row(
        "test top-1 (%)", "3", judged({"0": {0: 80.0, 1: 81.0}, "3": {2: 82.0, 3: 84.0}})
    )
    no_baseline = judged({"0": {}, "3": {0: 82.0, 1: 84.0}})  # quietly: no mean of nothing
    assert "| – (k = 0 has no value) |" in table_row("test top-1 (%)", "3", no_baseline)
    cosine = {
        "token cosine similarity (last block)": summarize(
            {"0": {0: 0.5, 1: 0.4, 2: 0.45}, "3": {0: 0.3, 1: 0.2, 2: 0.26}}
        )
    }
    top1 = judged({"0": {0: 80.0, 1: 81.0, 2: 80.5}, "3": {0: 82.0, 1: 83.1, 2: 82.4}}, cosine)
    # the primary test stands alone: raw p at alpha 0.05, whatever else shares the table
    assert (
        top1.judgement.role == "primary" and top1.judgement.alpha == 0.05 and top1.paired["p"] < 0.05
    ) and top1.verdict == "held"
    assert cosine["token cosine similarity (last block)"]["3"].verdict == "no claim"


def test_report_restates_a_stats_json_with_todays_statistics(tmp_path, capsys):
    saved = {
        "baseline": "0",
        "metrics": {
            "test top-1 (%)": {
                "0": {"values": {"0": 80.0, "1": 81.0, "2": 80.5}},
                "3": {"values": {"0": 82.0, "1": 83.1, "2": 82.4}},
            }
        },
        "geometry": {
            "within-sequence fraction (last block)": {
                "0": {"values": {"0": 0.5, "1": 0.55, "2": 0.52}},
                "3": {"values": {"0": 0.6, "1": 0.7, "2": 0.61}},
            }
        },
    }
    saved["mechanism"] = {
        "diffusion score, Laplacian heads (mean over blocks)": {"3": {"values": {"0": 0.1, "1": 0.2}}}
    }
    (tmp_path / "stats.json").write_text(json.dumps(saved))
    assert main(["report", str(tmp_path / "stats.json")]) == 0
    out = capsys.readouterr().out
    assert "| diffusion score, Laplacian heads (mean over blocks) | 3 | 2 | +0.15 ± 0.071 |" in out
    diff = np.array([2.0, 2.1, 1.9])
    low, high = stats.t.interval(0.95, 2, loc=diff.mean(), scale=stats.sem(diff))
    assert f"| test top-1 (%) | primary | 3 | 3 | 82.5 ± 0.56 | +2 [{low:+.3g}, {high:+.3g}] |" in out
    assert "| within-sequence fraction (last block) | secondary | 3 |" in out
    (tmp_path / "bad.json").write_text("[]")
    assert main(["report", str(tmp_path / "bad.json")]) == 2


def _recorded_cell(spec: str, seed: int, metrics: list[dict]):
    """A finished cell as the report's statistics read it: its record (here only its name and metrics.jsonl)."""
    from lapheads.runs.records import CellRecord

    return CellRecord({"cell": {"name": f"L{spec}-s{seed}", "spec": spec, "seed": seed}, "metrics": metrics})


def _study(specs: list[str], cells: list):
    """The finished cells as a report reads them (lapheads.study.recordset.RecordSet)."""
    from lapheads.study.recordset import RecordSet

    seeds = tuple(sorted({cell.seed for cell in cells}))
    return RecordSet("p", "classify", (), tuple(specs), seeds, tuple(cells))


def test_the_gap_over_training_pairs_arms_seed_by_seed_at_every_evaluated_step():
    # val bpb at steps 100 and 200; seed 2 of spec 2 stopped before step 200 (a cell still running is not "done",
    # but a done cell may have skipped an evaluation); step 50 is logged by the baseline only
    values = {
        ("0", 0): {50: 3.0, 100: 2.50, 200: 2.20},
        ("0", 1): {100: 2.52, 200: 2.21},
        ("0", 2): {100: 2.47, 200: 2.19},
        ("2", 0): {100: 2.60, 200: 2.23},
        ("2", 1): {100: 2.58, 200: 2.22},
        ("2", 2): {100: 2.55},
    }
    cells = []
    for (spec, seed), by_step in values.items():
        lines = [{"step": step, "loss": 1.0} for step in by_step]  # training records are skipped
        lines += [{"step": step, "val_bpb": v} for step, v in by_step.items()]
        cells.append(_recorded_cell(spec, seed, lines))
    record = _study(["0", "2"], cells)
    gaps = gap_over_training(record, VAL_BPB)
    first, last = gaps["2"]
    assert [first["step"], last["step"]] == [100, 200] and [first["n_pairs"], last["n_pairs"]] == [3, 2]
    diff = np.array([0.10, 0.06, 0.08])
    low, high = stats.t.interval(0.95, 2, loc=diff.mean(), scale=stats.sem(diff))
    assert first["mean_difference"] == pytest.approx(0.08) and first["ci_low"] == pytest.approx(low)
    assert first["ci_high"] == pytest.approx(high) and last["mean_difference"] == pytest.approx(0.02)
    assert gap_over_training(record, Metric("k-NN", "eval_dino.json", ("knn", "20"))) == {}  # logged once, no series
    # still improving? the last quarter of 200 steps starts at step 150: no evaluation there but the last, so the
    # change is measured from the evaluation before it (step 100); bpb: lower is better
    changes = late_change(record, VAL_BPB)
    assert changes["0"]["from_step"] == 100 and changes["0"]["to_step"] == 200 and changes["0"]["n_pairs"] == 3
    assert changes["0"]["mean_difference"] == pytest.approx((-0.30 - 0.31 - 0.28) / 3)
    assert changes["2"]["n_pairs"] == 2 and changes["2"]["still_improving"] and changes["0"]["still_improving"]
    flat = _study(["0"], [c for c in cells if c.spec == "0"])
    flat_values = late_change(flat, Metric("top-1 (%)", "metrics", ("val_bpb",)))  # higher is better: falling is not
    assert flat_values["0"]["still_improving"] is False
    one_seed = _study(["0"], [c for c in cells if c.spec == "0" and c.seed == 0])
    assert late_change(one_seed, VAL_BPB)["0"]["still_improving"] is None
    # the table never reads an interval that holds 0 as a plateau
    table = "\n".join(late_change_lines("top-1 (%)", flat_values))
    assert table.rstrip().endswith("| not detected |") and "| no |" not in table


def test_fit_against_test_pairs_each_cells_training_and_test_top1_and_the_losses_with_the_baseline():
    # (fit top-1, test top-1, fit loss, test loss) at the last evaluation
    finals = {
        ("0", 0): (85.0, 83.0, 0.40, 0.50),
        ("0", 1): (86.0, 83.5, 0.38, 0.52),
        ("0", 2): (84.5, 83.2, 0.41, 0.49),
        ("3", 0): (99.0, 84.0, 0.05, 0.45),
        ("3", 1): (98.0, 84.5, 0.07, 0.43),
    }
    cells = []
    for (spec, seed), (fit, test, fit_loss, test_loss) in finals.items():
        lines = [
            {"step": 10, "eval_top1": 50.0, "fit_top1": 40.0, "fit_loss": 2.0, "eval_loss": 2.0},
            {"step": 20, "eval_top1": test, "fit_top1": fit, "fit_loss": fit_loss, "eval_loss": test_loss},
        ]
        cells.append(_recorded_cell(spec, seed, lines))
    record = _study(["0", "3"], cells)
    rows = fit_against_test(record)
    diff = np.array([2.0, 2.5, 1.3])  # the last evaluation of each cell
    low, high = stats.t.interval(0.95, 2, loc=diff.mean(), scale=stats.sem(diff))
    assert rows["0"]["fit_top1"] == pytest.approx(85.1667, abs=1e-4) and rows["0"]["n_pairs"] == 3
    assert rows["0"]["mean_difference"] == pytest.approx(diff.mean()) and rows["0"]["ci_low"] == pytest.approx(low)
    assert rows["0"]["ci_high"] == pytest.approx(high) and rows["0"]["against_baseline"] is None
    assert rows["3"]["mean_difference"] == pytest.approx(14.25) and rows["3"]["n_pairs"] == 2
    against = rows["3"]["against_baseline"]  # seeds 0 and 1 pair up
    assert against["fit top-1"]["mean_difference"] == pytest.approx(13.0) and against["fit top-1"]["n_pairs"] == 2
    assert against["fit loss"]["mean_difference"] == pytest.approx(-0.33)
    assert against["test loss"]["mean_difference"] == pytest.approx(-0.07)
    assert fit_against_test(record, baseline="3")["0"]["against_baseline"]["fit top-1"]["mean_difference"] == (
        pytest.approx(-13.0)
    )
    assert fit_against_test(_study(["0"], [])) == {}  # cells without --fit-subset: no section


def test_heads_settle_on_a_side_of_zero_from_the_first_step_after_which_every_interval_lies_there():
    def rows(lows, width=0.05):
        return [{"step": 100 * (i + 1), "ci_low": low, "ci_high": low + width} for i, low in enumerate(lows)]

    assert settled_from(rows([-0.1, 0.2, -0.01, 0.1, 0.3])) == (1, 400)  # the interval at step 300 holds 0
    assert settled_from(rows([0.1, 0.2])) == (1, 100) and settled_from(rows([0.1, -0.02])) is None
    assert settled_from(rows([0.1, -0.2, -0.3])) == (-1, 200)  # sharpening from step 200 on
    assert settled_from(rows([0.1, math.nan])) is None  # one seed at the end: no interval, nothing claimed


def test_diffusion_scores_are_tested_against_zero_with_holm_across_the_section():
    scores = {
        "diffusion score, ordinary heads (mean over blocks)": {"0": {0: -0.08, 1: -0.07, 2: -0.09}},
        "diffusion score, Laplacian heads (mean over blocks)": {"0": {}, "2": {0: 0.12, 1: 0.15, 2: 0.10}},
        "diffusion score, Laplacian heads (block 1)": {"0": {}, "2": {0: 0.01, 1: -0.02, 2: 0.02}},
    }
    family = diffusion_against_zero(scores)
    assert list(family)[-1].startswith("diffusion score, ordinary")  # Laplacian rows first
    mean = family["diffusion score, Laplacian heads (mean over blocks)"]["2"]
    expected = stats.ttest_1samp([0.12, 0.15, 0.10], 0.0)
    assert mean.paired["p"] == pytest.approx(expected.pvalue) and mean.mean == pytest.approx(0.37 / 3)
    raw = [expected.pvalue, stats.ttest_1samp([0.01, -0.02, 0.02], 0.0).pvalue]
    tested = mean.zero_test
    assert tested.p_holm == pytest.approx(holm({"a": raw[0], "b": raw[1]})["a"])
    assert mean.verdict == ("held" if tested.p_holm < 0.05 else f"not detected (MDE {tested.mde_at_alpha:.3g})")
    # the MDE is stated at the alpha of the row's Holm step (two rows: alpha / 2 for the smaller p)
    assert tested.alpha == pytest.approx(0.05 / 2 if raw[0] < raw[1] else 0.05)
    assert family["diffusion score, Laplacian heads (block 1)"]["2"].verdict.startswith("not detected")
    assert family["diffusion score, ordinary heads (mean over blocks)"]["0"].verdict == "no claim"
    assert list(mean.to_json())[-4:] == ["p_holm", "alpha", "mde_at_alpha", "verdict"]  # mechanism.json's row
    assert "0" not in family["diffusion score, Laplacian heads (mean over blocks)"]


FRACTION = "within-sequence fraction (after the final norm)"


def test_the_dose_is_each_seeds_least_squares_slope_against_k_tested_over_seeds():
    """k = 0..3 of 4 seeds: each seed's slope is scipy's linregress, the mean slope its one-sample t-test; a head kind
    is no dose; the headline's slope against the geometry is fitted seed by seed with the sign the paper predicts."""
    rng = np.random.default_rng(0)
    top1 = {str(k): {s: 80 + 0.5 * k + s + float(rng.normal(0, 0.2)) for s in range(4)} for k in range(4)}
    fraction = {str(k): {s: 0.3 - 0.02 * k + float(rng.normal(0, 0.005)) for s in range(4)} for k in range(4)}
    top1["sum:3"], fraction["sum:3"] = {s: 99.0 for s in range(4)}, {s: 0.0 for s in range(4)}
    del top1["2"][3]  # seed 3 lacks an arm: it has no top-1 slope
    table = {"test top-1 (%)": summarize(top1), FRACTION: summarize(fraction)}
    dose = dose_response(table, ["test top-1 (%)", FRACTION], "test top-1 (%)", [FRACTION])
    assert dose["levels"] == [0, 1, 2, 3]
    slopes = [stats.linregress(range(4), [top1[str(k)][s] for k in range(4)]).slope for s in range(3)]
    row = dose["slopes"]["test top-1 (%)"]
    assert list(row["values"]) == [0, 1, 2] and list(row["values"].values()) == pytest.approx(slopes)
    assert row["mean_difference"] == pytest.approx(np.mean(slopes)) and row["span"] == 3
    assert row["p"] == pytest.approx(stats.ttest_1samp(slopes, 0).pvalue) and row["signs"] == "3/3"
    assert dose["slopes"][FRACTION]["signs"] == "4/4" and dose["slopes"][FRACTION]["ci_high"] < 0  # falls: as claimed
    follows = dose["follows"][FRACTION]
    expected = [
        stats.linregress([fraction[str(k)][s] for k in range(4)], [top1[str(k)][s] for k in range(4)]).slope
        for s in range(3)
    ]
    assert list(follows["values"].values()) == pytest.approx(expected) and follows["direction"] == -1
    assert follows["signs"] == "3/3"  # top-1 rises as the fraction falls in every seed: what the paper's reading says
    assert (
        dose_response(
            {"test top-1 (%)": summarize({"0": top1["0"], "sum:3": top1["sum:3"]})},
            ["test top-1 (%)"],
            "test top-1 (%)",
            [],
        )
        == {}
    )  # one dose level: no dose section


def test_a_sweep_without_k_0_reports_its_arms_and_another_baseline_compares_them(tmp_path):
    """No k = 0 arm (say, k = 2 against k = 4): the default report lists both untested; --baseline 4 tests them."""
    cells = {}
    for spec, top1 in (("2", (84.0, 85.0)), ("4", (83.0, 84.5))):
        for seed, value in enumerate(top1):
            run_dir = tmp_path / f"L{spec}-s{seed}"
            run_dir.mkdir()
            (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 10, "eval_top1": value}) + "\n")
            config = {"task": "classify", "config": {"laplacian_heads": spec, "seed": seed}}
            (run_dir / "config.json").write_text(json.dumps(config))  # the arm a run trained, as every run says
            cells[run_dir.name] = {"spec": spec, "seed": seed, "run_dir": str(run_dir), "status": "done"}
    record = {"preset": "p", "task": "classify", "specs": ["2", "4"], "seeds": [0, 1], "overrides": [], "cells": cells}
    (tmp_path / "sweep.json").write_text(json.dumps(record))
    assert (
        "| test top-1 (%) |  | 2 | 2 | 84.5 ± 0.71 | – (no k = 0 arm) |"
        in write_report(tmp_path, geometry=False).read_text()
    )
    versus = write_report(tmp_path, geometry=False, baseline="4")
    assert versus == tmp_path / "report-vs-L4" / "report.md"
    assert "| test top-1 (%) | primary | 2 | 2 | 84.5 ± 0.71 | +0.75 [" in versus.read_text()
    # k = 2 and 4 are two dose levels: each seed's slope, (83 - 84) / 2 and (84.5 - 85) / 2
    assert "| test top-1 (%) | -0.375 [" in versus.read_text()
    dose = json.loads((tmp_path / "report-vs-L4" / "stats.json").read_text())["dose"]["slopes"]["test top-1 (%)"]
    assert dose["values"] == {"0": -0.5, "1": -0.25} and dose["signs"] == "0/2"


def test_head_kinds_are_arms_of_a_sweep_with_directory_safe_names():
    from lapheads.runs import SweepError, spec_dir_name
    from lapheads.study.sweep import parse_specs

    arms = parse_specs("0;3;negated:3;local:3;centring:3;mix;ordinary/negated/laplacian")
    assert arms == ["0", "3", "negated:3", "local:3", "centring:3", "mix", "ordinary/negated/laplacian"]
    assert parse_specs("0,1,3") == ["0", "1", "3"] and parse_specs("mix") == ["mix"]
    names = [spec_dir_name(a) for a in arms]
    assert "/" not in "".join(names) and len(set(names)) == len(names) and names[2] == "Lnegated-3"
    with pytest.raises(SweepError, match="malformed"):
        parse_specs("0;neg ated")


def test_an_arm_of_combined_kinds_keeps_its_plus_and_may_add_settings():
    """A spec's own "+" (laplacian:1+local:1) is not a setting: the settings start at the first KEY=VALUE."""
    from lapheads.runs import SweepError
    from lapheads.runs.sweep import arm_parts
    from lapheads.study.sweep import parse_specs

    assert parse_specs("0;laplacian:1+local:1") == ["0", "laplacian:1+local:1"]
    assert arm_parts("laplacian:1+local:1") == ("laplacian:1+local:1", {})
    arm = "laplacian:1+local:1+within_seq_penalty=0.5"
    assert parse_specs(f"0;{arm}") == ["0", arm]
    assert arm_parts(arm) == ("laplacian:1+local:1", {"within_seq_penalty": "0.5"})
    with pytest.raises(SweepError, match="setting 'local:1'"):  # after a setting, only settings
        arm_parts("0+within_seq_penalty=0.5+local:1")
    with pytest.raises(SweepError, match="malformed"):
        parse_specs("0;0+within_seq_penalty")


def test_a_dry_run_of_a_cpu_preset_prints_one_process_per_cell(capsys, tmp_path):
    args = ["sweep", "fmnist-cpu", "--laplacian-heads", "0,3", "--seeds", "0", "--dry-run", "--out", str(tmp_path)]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("python -m lapheads train classify --preset fmnist-cpu --laplacian-heads 0")
    assert not any("torchrun" in line for line in lines)


def test_changed_heads_are_compared_with_their_k0_twins_head_by_head_and_seed_by_seed():
    from lapheads.study.report.statistics import _against_twins

    def heads(kinds, drops):
        return {
            ("1", h): {"kind": k, "fraction_drop": d, "p_diffusion": None} for h, (k, d) in enumerate(zip(kinds, drops))
        }

    twins = {
        ("0", 0): heads(["ordinary"] * 3, [0.01, 0.02, 0.03]),
        ("0", 1): heads(["ordinary"] * 3, [0.00, 0.01, 0.02]),
        ("1", 0): heads(["ordinary", "ordinary", "laplacian"], [0.5, 0.5, 0.13]),
        ("1", 1): heads(["ordinary", "ordinary", "laplacian"], [0.5, 0.5, 0.07]),
        ("sum:3", 0): heads(["sum"] * 3, [0.11, 0.12, 0.13]),
        ("sum:3", 2): heads(["sum"] * 3, [0.2, 0.2, 0.2]),  # no k = 0 run of seed 2: no pair
    }
    mechanism: dict = {}
    _against_twins(mechanism, twins)
    laplacian = mechanism["within-sequence fraction drop, Laplacian heads minus their k = 0 twins"]
    assert laplacian == {"1": {0: pytest.approx(0.10), 1: pytest.approx(0.05)}}  # head 2 against head 2 only
    assert mechanism["within-sequence fraction drop, sum heads minus their k = 0 twins"] == {
        "sum:3": {0: pytest.approx(0.10)}
    }
    assert not any(label.startswith("P-aware") for label in mechanism)  # no tau measured: no row
    label = "within-sequence fraction drop, Laplacian heads minus their k = 0 twins"
    row = diffusion_against_zero({label: laplacian})[label]["1"]
    assert row.verdict == "not decided (2 seed pairs; a verdict needs 3)"


def test_an_arm_in_an_override_is_spelled_as_its_cell_folder():
    """``{arm}`` (and the older ``{spec}``) in ``--set`` is the arm as folders spell it (issue 59: "negated:3" gave
    ``Lnegated:3-s0`` while the folder is ``Lnegated-3-s0``)."""
    from lapheads.study.cells import SweepDefinition, cell_name

    definition = SweepDefinition("chat-cpu", "sft", ("negated:3", "0,2"), (0,), ("--base", "runs/L{arm}-s{seed}"))
    for arm in definition.arms:
        assert definition.cell_overrides(arm, 0)[1] == f"runs/{cell_name(arm, 0)}"
    spec_form = SweepDefinition("chat-cpu", "sft", ("negated:3",), (1,), ("--base", "runs/L{spec}-s{seed}"))
    assert spec_form.cell_overrides("negated:3", 1) == ["--base", "runs/Lnegated-3-s1"]
    assert SweepDefinition.from_json(definition.to_json()) == definition  # what sweep.json and a record keep
    assert definition.to_json()["specs"] == ["negated:3", "0,2"]  # the on-disk key committed records carry


@pytest.mark.slow
@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_ctrl_c_of_a_parallel_sweep_is_one_line_and_a_rerun_resumes_its_cells(tiny_preset, tmp_path, sigint):
    """Issue 60: Ctrl-C of ``sweep --jobs 2`` ended in a traceback with both cells left "running". The terminal's
    SIGINT reaches the whole process group: the cells checkpoint, the sweep marks them interrupted and says so."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "sweep"
    argv = [sys.executable, "-m", "lapheads", "sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads",
            "0,1", "--seeds", "0", "--jobs", "2", "--threads", "2", "--out", str(out), "--set", "epochs=4",
            "--set", "checkpoint_every=2"]  # fmt: skip
    handler = signal.SIG_DFL if sigint == "default" else signal.SIG_IGN  # ignored: a shell's background job (CI)
    sweep = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, handler),
    )
    logs = [out / "L0-s0" / "metrics.jsonl", out / "L1-s0" / "metrics.jsonl"]
    deadline = time.monotonic() + 300
    while not all(p.exists() and p.read_text().count("\n") >= 2 for p in logs) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(sweep.pid, signal.SIGINT)  # what Ctrl-C in its terminal does (this process may ignore SIGINT, as a
    # shell's background job does: then the cells' own exits say it)
    _, err = sweep.communicate(timeout=300)
    assert sweep.returncode == 130 and "Traceback" not in err, err
    assert "interrupted; L0-s0, L1-s0 stopped at its last checkpoint; rerun the same command to resume" in err
    record = json.loads((out / "sweep.json").read_text())
    assert {c["status"] for c in record["cells"].values()} == {"interrupted"}
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "L0-s0 resuming" in again.stdout and "L1-s0 resuming" in again.stdout
    record = json.loads((out / "sweep.json").read_text())
    assert {c["status"] for c in record["cells"].values()} == {"done"}
