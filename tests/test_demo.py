"""``lapheads demo`` end to end on generated Fashion-MNIST files, with a tiny model."""

from __future__ import annotations

import json

from lapheads.cli import main


def test_demo_trains_both_runs_and_writes_the_report(fmnist_root, tmp_path, capsys):
    tiny = json.dumps({"depth": 2, "embed_dim": 48, "num_heads": 3, "patch_size": 7})
    code = main(
        [
            "demo",
            "--out",
            str(tmp_path),
            "--data-root",
            str(fmnist_root),
            "--laplacian-heads",
            "2",
            "--epochs",
            "0.5",
            "--batch-size",
            "64",
            "--model-kwargs",
            tiny,
            "--amp",
            "false",
        ]
    )
    assert code == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| baseline (0 Laplacian heads) |" in report and "| 2 Laplacian heads |" in report
    assert (tmp_path / "report" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "report" / "accuracy.png").stat().st_size > 1000
    assert "![anova](anova.png)" in report and "![spectrum](spectrum.png)" in report
    assert (tmp_path / "report" / "anova.png").stat().st_size > 5000
    assert "| metric | k=0 | k=2 |" in (tmp_path / "report" / "summary.md").read_text()
    assert json.loads((tmp_path / "fmnist-cpu-L2" / "config.json").read_text())["config"]["laplacian_heads"] == "2"
    # one accuracy source: the runs' own final evaluations, quoted alike in report.md and summary.md
    final = [
        [r for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines()) if "eval_top1" in r][
            -1
        ]["eval_top1"]
        for run in ("fmnist-cpu-L0", "fmnist-cpu-L2")
    ]
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert f"| test top-1 (%), the run's final eval | {final[0]:.4g} | {final[1]:.4g} |" in summary
    assert f"| {final[0]:.2f} |" in report and f"| {final[1]:.2f} |" in report
    claims = [
        line
        for line in report.splitlines()
        if line.startswith("| ") and line.endswith(("| as claimed |", "| opposite |", "| no change |"))
    ]
    assert len(claims) == 4 and "One seed per arm is a direction, not a test" in report
    assert "wall time (s, machine-dependent)" in report
    assert f"report: {tmp_path / 'report' / 'report.md'}" in capsys.readouterr().out


def test_verdict_compares_directions_and_calls_small_changes_no_change():
    from lapheads.demo import verdict

    assert verdict(0.50, 0.40, -1) == "as claimed" and verdict(0.50, 0.60, -1) == "opposite"
    assert verdict(80.0, 80.5, +1) == "no change" and verdict(80.0, 81.0, +1) == "as claimed"
