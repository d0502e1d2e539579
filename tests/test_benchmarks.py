"""The prepared GPU benchmark runs end to end on tiny CPU shapes, so it cannot rot between lent GPUs."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _load(name: str):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_benchmark_smoke_writes_every_table(tmp_path):
    out = tmp_path / "benchmarks-gpu.md"
    text = _load("gpu").main(["--smoke", "--device", "cpu", "--backend", "aot_eager", "--out", str(out)])
    assert out.read_text() == text
    op_rows = [line for line in text.splitlines() if line.startswith("| 32 |")]
    assert len(op_rows) == 8  # full/causal x MHA/GQA x eager/compiled
    assert "| d2 | 0/2 |" in text and "| d2 | 1/2 |" in text
    assert "| ViT-B/16 32 px | 0/4 |" in text and "| ViT-B/16 32 px | 4/4 |" in text
