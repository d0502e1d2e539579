"""Cell records and plans: a sweep continues from committed records on a fresh machine, and reports from them alone."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from lapheads.cli import main
from lapheads.runs.records import RECORD_FORMAT, RecordError, load_records, read_record, write_record
from lapheads.study import cells as cells_module
from lapheads.study.records import load_plan


def _plan(tmp_path, tiny_preset, **changes):
    plan = {
        "study": "tiny decomposition",
        "preset": str(tiny_preset),
        "task": "classify",
        "arms": ["0", "1", "sum:1"],
        "seeds": [0, 1, 2],
        "overrides": ["amp=false"],
        "primary": "within-sequence fraction (after the final norm)",
        "family": ["within-sequence fraction (after the final norm)"],
        "contrasts": [
            {"arm": "1", "baseline": "0", "direction": "paper"},
            {"arm": "sum:1", "baseline": "1", "direction": "no claim"},
        ],
        "margins": {},
        "alpha": 0.05,
        "stopping": "fixed n = 3 seeds",
        **changes,
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    return path


def _sweep_args(tiny_preset, out, records, plan=None, seeds="0,1,2"):
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0;1;sum:1", "--seeds", seeds]
    args += ["--out", str(out), "--records", str(records), "--set", "amp=false"]
    return args + (["--plan", str(plan)] if plan else [])


def test_a_sweep_continues_from_its_records_and_reports_from_them_alone(tiny_preset, tmp_path, monkeypatch, capsys):
    out, records = tmp_path / "sweep", tmp_path / "records"
    plan = _plan(tmp_path, tiny_preset)
    assert main(_sweep_args(tiny_preset, out, records, plan)) == 0
    names = sorted(p.name for p in records.glob("*.json"))
    assert names == sorted(["plan.json"] + [f"{a}-s{s}.json" for a in ("L0", "L1", "Lsum-1") for s in (0, 1, 2)])
    assert (records / "plan.json").read_bytes() == plan.read_bytes()  # copied unchanged: its hash is the file's
    record = read_record(records / "L1-s0.json")
    assert record.data["format"] == RECORD_FORMAT and record.data["plan_sha256"] == load_plan(plan).sha256
    assert record.data["cell"] == {**record.data["cell"], "name": "L1-s0", "spec": "1", "seed": 0}
    assert record.data["environment"]["threads"] >= 1 and "cpu_flags" in record.data["environment"]
    assert record.data["environment"]["precision"]["autocast_bf16"] is False  # pinned by the plan
    assert record.data["analysis"]["per_layer"]["norm"]["anova"]["within_seq_fraction"] > 0
    assert record.data["checkpoint_heads"] and (records / "L1-s0.json").stat().st_size < 500_000

    assert main(["report", str(out)]) == 0
    from_runs = json.loads((out / "report" / "stats.json").read_text())
    # a fresh machine: git holds the records and the plan, nothing else
    shutil.rmtree(out)
    assert main(["report", str(records)]) == 0
    report = (records / "report" / "report.md").read_text()
    assert json.loads((records / "report" / "stats.json").read_text()) == from_runs
    # the code that trained each cell, as the records say (never a plan's intention), in both reports alike
    (revision, names), *others = from_runs["code_revisions"].items()
    commit = revision.removesuffix("+uncommitted")  # a developer's checkout with changes says so; CI's is clean
    assert not others and len(commit) == 40 and f"{revision[:7]}: " in report and sorted(names)[0] == "L0-s0"
    assert "declared before the data" in report
    # the plan's primary and contrasts: the fraction, Holm over its two contrasts (one against another arm)
    assert from_runs["rule"]["primary"] == ["within-sequence fraction (after the final norm)"]
    assert from_runs["rule"]["primary_family_size"] == 2 and from_runs["rule"]["plan"]["study"] == "tiny decomposition"
    assert "| within-sequence fraction (after the final norm) | primary | sum:1 vs 1 | 3 |" in report
    assert "| test top-1 (%) | secondary | 1 | 3 |" in report
    ablation = from_runs["geometry"]["within-sequence fraction (after the final norm)"]["sum:1 vs 1"]
    assert ablation["contrast_claim"] == "no claim: contrast" and ablation["baseline"] == "1"

    # a seed whose arms ran on machines with other kernels pairs nothing: left out, and said so
    mixed = tmp_path / "mixed"
    shutil.copytree(records, mixed)
    moved = json.loads((mixed / "L1-s2.json").read_text())
    moved["environment"]["cpu_kernels"]["mkl"] = "SSE4_2"  # its BLAS ran other kernels
    (mixed / "L1-s2.json").write_text(json.dumps(moved))
    assert main(["report", str(mixed), "--no-geometry"]) == 2  # the plan's primary is a geometry row: never dropped
    assert main(["report", str(mixed)]) == 0  # from records, the geometry is read, not recomputed
    text = (mixed / "report" / "report.md").read_text()
    assert "Seed 2 left out: its arms ran in different environments" in text
    assert json.loads((mixed / "report" / "stats.json").read_text())["metrics"]["test top-1 (%)"]["1"]["n"] == 2

    # a plan's stop that reads its first seeds only (e.g. 6 of 8 pairs): the others are left out, and said so
    assert main(["report", str(records), "--seeds", "0,1"]) == 0
    stats = json.loads((records / "report" / "stats.json").read_text())
    assert stats["metrics"]["test top-1 (%)"]["1"]["n"] == 2 and stats["seeds_left_out"] == [2]
    assert "seeds 0, 1 (--seeds; left out: 2)" in (records / "report" / "report.md").read_text()
    assert main(["report", str(records), "--seeds", "0,7"]) == 2
    assert "--seeds 7: not a seed of" in capsys.readouterr().err

    trained = []
    monkeypatch.setattr(cells_module, "_train", lambda task: lambda *a, **k: trained.append(a))
    capsys.readouterr()
    assert main(_sweep_args(tiny_preset, out, records, plan)) == 0  # the same command again: nothing to train
    assert trained == [] and capsys.readouterr().out.count("has its record") == 9


def test_a_record_of_another_config_is_refused_and_never_overwritten(tiny_preset, tmp_path, capsys):
    out, records = tmp_path / "sweep", tmp_path / "records"
    assert main(_sweep_args(tiny_preset, out, records, seeds="0")) == 0
    before = (records / "L1-s0.json").read_bytes()
    args = _sweep_args(tiny_preset, tmp_path / "other", records, seeds="0") + ["--set", "lr=0.01"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "L0-s0.json records cell L0-s0 with another config (lr:" in err[0]
    assert (records / "L1-s0.json").read_bytes() == before
    with pytest.raises(RecordError, match="written once"):
        write_record(records, read_record(records / "L1-s0.json").data)


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"seeds": [0, 1]}, "declares seeds [0, 1]"),
        ({"overrides": []}, "declares overrides []"),
        ({"arms": ["0", "1"], "contrasts": []}, "declares arms ['0', '1']"),
        ({"contrasts": [{"arm": "1", "baseline": "2", "direction": "paper"}]}, "is not one of the arms"),
        ({"contrasts": [{"arm": "1", "baseline": "0", "direction": "up"}]}, "direction one of paper, reverse"),
        ({"alpha": 2}, "alpha 2"),
        ({"alpha": 1e-20}, "alpha 1e-20; allowed: a number in [1e-06, 1)"),  # once hung the report's MDE search
    ],
)
def test_a_sweep_must_be_its_plan(changes, says, tiny_preset, tmp_path, capsys):
    plan = _plan(tmp_path, tiny_preset, **changes)
    assert main(_sweep_args(tiny_preset, tmp_path / "sweep", tmp_path / "records", plan)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "records").exists()  # nothing written before the plan holds


@pytest.mark.parametrize("records", ["same", "inside", "around"])
def test_a_sweep_folder_and_its_records_folder_must_not_overlap(records, tiny_preset, tmp_path, capsys):
    """Issue 76: a sweep whose --out was its records folder put sweep.json among the records, and `lapheads report`
    then read the folder as a sweep, ignoring the records. Overlapping folders are refused before anything runs."""
    out = tmp_path / "cells"
    folder = {"same": out, "inside": out / "records", "around": tmp_path}[records]
    assert main(_sweep_args(tiny_preset, out, folder)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "overlap; allowed: two separate folders" in err[0], err
    assert not out.exists()


def test_a_records_folder_keeps_the_plan_it_started_with(tiny_preset, tmp_path, capsys):
    records = tmp_path / "records"
    records.mkdir()
    (records / "plan.json").write_text(json.dumps({"another": "plan"}))
    plan = _plan(tmp_path, tiny_preset)
    assert main(_sweep_args(tiny_preset, tmp_path / "sweep", records, plan, seeds="0,1,2")) == 2
    assert "holds another plan" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("sets", "says"),
    [(["seed=5"], "seed is an axis of the sweep"), (["laplacian_heads=2"], "laplacian_heads is an axis")],
)
def test_a_sweeps_own_axes_cannot_be_overridden(sets, says, tiny_preset, tmp_path, capsys):
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0,1", "--seeds", "0"]
    args += ["--out", str(tmp_path / "s"), *[x for s in sets for x in ("--set", s)]]
    assert main(args) == 2
    assert says in capsys.readouterr().err


def test_seeds_are_normalised_before_duplicates_are_checked(tiny_preset, tmp_path, capsys):
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0", "--seeds", "0,00"]
    assert main([*args, "--out", str(tmp_path / "s")]) == 2
    assert "repeats a seed" in capsys.readouterr().err


def test_a_copied_sweep_reports_its_own_cells_and_a_corrupt_one_is_one_line(tiny_preset, tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0,1", "--seeds", "0,1"]
    assert main([*args, "--out", str(out)]) == 0
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shutil.rmtree(out)  # the original is gone: the copy must not read it
    assert main(["report", str(copy), "--no-geometry"]) == 0
    (copy / "sweep.json").write_text("{not json")
    capsys.readouterr()
    assert main(["report", str(copy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "corrupt" in err[0]


def test_one_process_writes_a_sweep_folder_at_a_time(tiny_preset, tmp_path, capsys):
    from lapheads.io import sole_owner
    from lapheads.runs.layout import SWEEP_LOCK

    out = tmp_path / "sweep"
    out.mkdir()
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0", "--seeds", "0"]
    with sole_owner(out / SWEEP_LOCK, "a running sweep"):  # as a sweep that is still running holds it
        assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"sweep folder {out} is in use by process {os.getpid()}" in err[0]
    assert not (out / "L0-s0").exists()
    assert main([*args, "--out", str(out)]) == 0  # the lock ends with its holder


@pytest.mark.parametrize("margin", ["-5", "nan", "0", "inf"])
def test_a_margin_must_be_a_positive_number(margin, tmp_path, capsys):
    assert main(["report", str(tmp_path), "--margin", margin]) == 2
    assert f"--margin {float(margin)}; allowed: a positive number" in capsys.readouterr().err


def test_a_non_finite_metric_is_refused_by_name(tmp_path, capsys):
    from lapheads.runs.records import CellRecord
    from lapheads.study.recordset import RecordSet
    from lapheads.study.report import collect
    from lapheads.tasks.metrics import TEST_TOP1

    cells = tuple(
        CellRecord(
            {"cell": {"name": f"L0-s{seed}", "spec": "0", "seed": seed}, "metrics": [{"step": 1, "eval_top1": v}]}
        )
        for seed, v in ((0, 80.0), (1, float("nan")))
    )
    with pytest.raises(Exception, match="cell 0 seed 1: test top-1 \\(%\\) is nan; allowed: a finite number"):
        collect(RecordSet("p", "classify", (), ("0",), (0, 1), cells), TEST_TOP1)


def test_cells_pair_by_the_kernels_they_ran_not_the_cpu_they_ran_on():
    from lapheads.hardware import cpu_kernels
    from lapheads.runs.records import environment_key

    avx2_machine = {"torch_version": "2.14.1", "cpu_flags": ["avx", "avx2", "fma"], "torch_cpu_capability": "AVX2"}
    avx2_machine |= {"machine": "x86_64", "threads": 1, "precision": {"autocast_bf16": False}}
    flags = ["avx", "avx2", "avx512f", "fma"]
    pins = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"}
    pinned = {**avx2_machine, "cpu_flags": flags, "cpu_kernels": cpu_kernels(flags, "AVX2", pins)}
    native = {**avx2_machine, "cpu_flags": flags, "cpu_kernels": cpu_kernels(flags, "AVX512")}
    # a record older than cpu_kernels (its kernels derived from its flags) pairs with a pinned AVX-512 machine
    assert environment_key(avx2_machine) == environment_key(pinned)
    assert environment_key(native) != environment_key(avx2_machine)
    # ATen capped alone is not enough: MKL still runs AVX-512
    assert environment_key({**native, "cpu_kernels": cpu_kernels(flags, "AVX2")}) != environment_key(pinned)


def test_cells_on_a_gpu_pair_only_with_cells_on_the_same_gpu_and_fp32_precision():
    from lapheads.runs.records import accelerator, environment, environment_key

    cpu = {"torch_version": "2.11.0", "cpu_flags": ["avx", "avx2", "fma"], "torch_cpu_capability": "AVX2"}
    cpu |= {"machine": "x86_64", "threads": 1, "precision": {"autocast_bf16": False}}
    h200 = {"name": "NVIDIA H200", "capability": "9.0", "cuda": "13.0", "cudnn": 91000}
    ieee, tf32 = {"fp32_matmul": "ieee", "fp32_conv": "ieee"}, {"fp32_matmul": "none", "fp32_conv": "tf32"}
    on_gpu = {**cpu, "accelerator": {**h200, **ieee}}
    assert environment_key(on_gpu) == environment_key({**cpu, "accelerator": {**h200, **ieee, "cudnn": 90000}})
    assert environment_key(on_gpu) != environment_key({**cpu, "accelerator": {**h200, **tf32}})  # TF32 convolutions
    assert environment_key(on_gpu) != environment_key(cpu)
    # a CPU cell records no accelerator, and a record older than the field pairs with it
    assert accelerator(None) is None and accelerator(torch.device("cpu")) is None
    assert environment(1)["accelerator"] is None
    assert environment_key({**cpu, "accelerator": None}) == environment_key(cpu)


@pytest.mark.skipif("avx2" not in __import__("lapheads.hardware").hardware.cpu_flags(), reason="needs an AVX2 CPU")
def test_a_pinned_sweep_records_the_kernels_its_cells_ran(tiny_preset, tmp_path, capsys):
    out, records = tmp_path / "sweep", tmp_path / "records"
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "1", "--seeds", "0"]
    args += ["--out", str(out), "--records", str(records), "--set", "amp=false"]
    assert main([*args, "--cpu-kernels", "avx2", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 DNNL_MAX_CPU_ISA")
    assert main([*args, "--cpu-kernels", "avx2"]) == 0  # --jobs 1: the cell still trains in its own process
    environment = read_record(records / "L1-s0.json").data["environment"]
    assert environment["cpu_kernels"] == {"aten": "AVX2", "mkl": "AVX2", "onednn": "AVX2"}
    assert environment["cpu_kernel_pins"]["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    # the environment is the training process's own, written into its config.json
    config = json.loads((out / "L1-s0" / "config.json").read_text())
    assert config["environment"]["torch_cpu_capability"] == "AVX2" and "ATEN_CPU_CAPABILITY" not in os.environ


def test_parallel_cells_are_analysed_in_their_own_processes_for_their_records(tiny_preset, tmp_path, monkeypatch):
    # on a many-core GPU host the sweep's one process analysed 16 finished cells one after another (~1 min each):
    # each cell's analysis now runs in a process of its own, and the record is written from its cached result
    from lapheads.study import analyze as analyze_module

    real, reused = analyze_module.analyze_run, []

    def from_the_cache(run_dir, options=None, force=False):
        cached = os.path.join(run_dir, "report", "analysis.json")
        before = os.stat(cached).st_mtime_ns  # the cell's own process wrote it
        result = real(run_dir, options, force)
        reused.append(os.stat(cached).st_mtime_ns == before)  # read, not computed again
        return result

    monkeypatch.setattr(analyze_module, "analyze_run", from_the_cache)
    out, records = tmp_path / "sweep", tmp_path / "records"
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0,1", "--seeds", "0"]
    args += ["--out", str(out), "--records", str(records), "--jobs", "2", "--threads", "2", "--set", "amp=false"]
    assert main(args) == 0
    assert reused == [True, True]
    for name in ("L0-s0", "L1-s0"):
        cached = json.loads((out / name / "report" / "analysis.json").read_text())
        assert read_record(records / f"{name}.json").analysis == cached
    # cells trained by an earlier sweep (one stopped before its records, say) are analysed side by side too
    again, more = tmp_path / "again", tmp_path / "more"
    assert main([*args[:8], "--out", str(again), "--jobs", "2", "--threads", "2", "--set", "amp=false"]) == 0
    assert not (again / "L0-s0" / "report" / "analysis.json").exists()  # no records asked: no analysis
    reused.clear()
    assert main([*args[:8], "--out", str(again), "--records", str(more), *args[12:]]) == 0
    assert reused == [True, True] and read_record(more / "L1-s0.json").data["wall_seconds"] is None


def test_an_arm_can_be_a_training_setting_paired_by_seed_like_any_arm(tiny_preset, tmp_path, capsys):
    """Issue 57: k = 0 with and without the geometry penalty, two arms of one plan: named in the plan, the records
    and the report, the setting in each record's config, the penalty's arm contrasted with plain k = 0."""
    penalised = "0+within_seq_penalty=1.0"
    plan = _plan(
        tmp_path,
        tiny_preset,
        study="tiny intervention",
        arms=["0", penalised],
        primary="test top-1 (%)",
        family=["within-sequence fraction (after the final norm)"],
        contrasts=[{"arm": penalised, "baseline": "0", "direction": "paper"}],
    )
    out, records = tmp_path / "sweep", tmp_path / "records"
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", f"0;{penalised}", "--seeds", "0,1,2"]
    assert main([*args, "--out", str(out), "--records", str(records), "--set", "amp=false", "--plan", str(plan)]) == 0
    record = read_record(records / "L0+within_seq_penalty=1.0-s1.json")
    config = record.data["config"]["config"]
    assert record.spec == penalised and config["within_seq_penalty"] == 1.0 and config["laplacian_heads"] == "0"
    assert read_record(records / "L0-s1.json").data["config"]["config"]["within_seq_penalty"] == 0.0
    assert main(["report", str(records)]) == 0
    stats = json.loads((records / "report" / "stats.json").read_text())
    fraction = stats["geometry"]["within-sequence fraction (after the final norm)"][penalised]
    assert fraction["role"] == "declared" and fraction["paired"]["n_pairs"] == 3
    assert fraction["paired"]["mean_difference"] < 0  # the manipulation: the penalty lowers the fraction
    assert stats["metrics"]["test top-1 (%)"][penalised]["role"] == "primary"
    # a record relabelled to the other arm is refused: the setting in its config says which arm it is
    moved = json.loads((records / "L0+within_seq_penalty=1.0-s2.json").read_text())
    moved["cell"].update(spec="0", name="L0-s2")
    (records / "L0-s2.json").write_text(json.dumps(moved))
    with pytest.raises(RecordError, match=r"cell arm '0', trained with|same training log"):
        load_records(records)


def test_a_gated_arm_is_recorded_with_its_geometry_and_without_a_mechanism(tiny_preset, tmp_path, capsys):
    """Issue 73's pilot: a gated head has no fixed operator per head, so its cell's record holds the geometry and no
    per-head mechanism (the sweep stopped at the gated cell's analysis before); the report reads it beside k = 1."""
    out, records = tmp_path / "sweep", tmp_path / "records"
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "1;gated-laplacian:1", "--seeds"]
    assert main([*args, "0", "--out", str(out), "--records", str(records), "--set", "amp=false"]) == 0
    gated, plain = (
        read_record(records / f"{name}-s0.json").analysis["per_layer"] for name in ("Lgated-laplacian-1", "L1")
    )
    assert gated.keys() == plain.keys()
    for layer in gated:
        assert gated[layer].keys() == plain[layer].keys() - {"mechanism"}
    assert any("mechanism" in layer for layer in plain.values())
    assert main(["report", str(records)]) == 0
