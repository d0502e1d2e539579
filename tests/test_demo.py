"""``lapheads demo`` end to end on generated Fashion-MNIST files, with a tiny model."""

from __future__ import annotations

import json

from lapheads.cli import main


def test_demo_trains_both_runs_and_writes_the_report(fmnist_root, tmp_path, capsys):
    tiny = json.dumps({"depth": 2, "embed_dim": 48, "num_heads": 3, "patch_size": 7})
    code = main(["demo", "--out", str(tmp_path), "--data-root", str(fmnist_root), "--laplacian-heads", "2",
                 "--epochs", "0.5", "--batch-size", "64", "--model-kwargs", tiny, "--amp", "false"])
    assert code == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| baseline (0 Laplacian heads) |" in report and "| 2 Laplacian heads |" in report
    assert (tmp_path / "report" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "report" / "accuracy.png").stat().st_size > 1000
    assert "![anova](anova.png)" in report and "![spectrum](spectrum.png)" in report
    assert (tmp_path / "report" / "anova.png").stat().st_size > 5000
    assert "| metric | k=0 | k=2 |" in (tmp_path / "report" / "summary.md").read_text()
    assert json.loads((tmp_path / "fmnist-cpu-L2" / "config.json").read_text())["config"]["laplacian_heads"] == "2"
    assert f"report: {tmp_path / 'report' / 'report.md'}" in capsys.readouterr().out
