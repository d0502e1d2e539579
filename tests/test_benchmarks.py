"""The prepared GPU benchmark runs end to end on tiny CPU shapes, so it cannot rot between lent GPUs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest


def _load(name: str):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_benchmark_smoke_writes_every_table(tmp_path):
    out = tmp_path / "benchmarks-gpu.md"
    text = _load("gpu").main(["--smoke", "--out", str(out)])  # as documented: no --device on a CPU-only machine
    assert out.read_text() == text
    op_rows = [line for line in text.splitlines() if line.startswith("| 32 |")]
    assert len(op_rows) == 8  # full/causal x MHA/GQA x eager/compiled
    assert "| d2 | 0/2 |" in text and "| d2 | 1/2 |" in text
    assert "| ViT-B/16 32 px | 0/4 |" in text and "| ViT-B/16 32 px | 4/4 |" in text
    assert "| 64 | 2 | window T/8 | fwd |" in text and "| 64 | 2 | 8 documents | fwd |" in text  # patterns


def test_the_gpu_benchmark_says_in_one_line_what_it_needs(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the full run is allowed here")
    with pytest.raises(SystemExit) as stopped:
        _load("gpu").main(["--out", "-"])
    assert stopped.value.code == 2 and "allowed here: --smoke" in capsys.readouterr().err


@pytest.mark.slow
def test_hf_benchmark_and_the_conversion_example_run_on_tiny_settings(tmp_path, capsys, monkeypatch, text_root):
    import json
    import subprocess
    import sys

    import pytest

    pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "argv", ["hf.py", "--layers", "1", "--repeats", "1", "--seq-len", "16", "--batch", "1"])
    _load("hf").main()
    table = capsys.readouterr().out
    assert "| sdpa |" in table and "| lapheads k=2 |" in table
    example = Path(__file__).resolve().parents[1] / "examples" / "hf_convert_finetune.py"
    done = subprocess.run(
        [
            sys.executable,
            str(example),
            "--pretrain-steps",
            "2",
            "--steps",
            "2",
            "--blend-steps",
            "1",
            "--data-root",
            str(text_root),
            "--out",
            str(tmp_path / "convert"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    curves = json.loads((tmp_path / "convert" / "curves.json").read_text())["curves"]
    assert set(curves) == {"pretrain", "control", "switch", "signflip", "blend"}
    # blend at lambda = 0 and the k = 0 control start from the pretrained function; switch does not
    assert curves["blend"]["val_loss_at_conversion"] == curves["control"]["val_loss_at_conversion"]
    assert curves["switch"]["val_loss_at_conversion"] != curves["control"]["val_loss_at_conversion"]


@pytest.mark.slow
def test_the_timm_conversion_example_runs_on_tiny_settings(tmp_path, fmnist_root):
    import json
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[1] / "examples" / "timm_convert_finetune.py"
    done = subprocess.run(
        [
            sys.executable,
            str(example),
            "--pretrain-steps",
            "2",
            "--steps",
            "2",
            "--blend-steps",
            "1",
            "--batch",
            "16",
            "--test-images",
            "64",
            "--data-root",
            str(fmnist_root),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "curves.json").read_text())["results"]
    assert set(results) == {"pretrain", "control", "switch", "signflip", "blend"}
    # blend at lambda = 0 is the pretrained model, as the k = 0 control is
    assert results["blend"]["test_accuracy_at_conversion"] == results["control"]["test_accuracy_at_conversion"]
    assert (tmp_path / "pretrained.safetensors").is_file() and (tmp_path / "curves.png").is_file()


def test_the_sharded_muon_benchmark_runs_and_halves_the_state():
    import os
    import re
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "benchmarks" / "muon.py"
    done = subprocess.run(
        [sys.executable, str(script), "--depth", "2", "--batch", "2", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {
        m.group(1): [int(x.replace(",", "")) for x in m.group(2).split(" / ")]
        for m in re.finditer(r"^\| (plain|sharded) \|.*\| ([\d, /]+) \|$", done.stdout, re.M)
    }
    assert sum(rows["sharded"]) == rows["plain"][0] == rows["plain"][1]  # each rank: its share of the state
    assert "sharded / plain" in done.stdout


@pytest.mark.slow
def test_cpu_attention_benchmark_writes_the_op_and_whole_step_tables():
    table = _load("attention").main(["--seq-lens", "16", "--repeats-scale", "0.01", "--kinds"])
    row = next(line for line in table.splitlines() if line.startswith("| 16 |"))
    ratios = [float(cell) for cell in row.split("|")[3:13]]  # sdpa, copy, lapheads, where, cat, naive, 4 kinds
    assert ratios[0] == 1.0 and all(r > 0 for r in ratios) and "| gated-laplacian ratio |" in table
    for name in ("vit 0/3 Laplacian", "vit 1/3 Laplacian", "vit 3/3 Laplacian", "gpt 2/4 Laplacian",
                 "vit gated-laplacian:3", "gpt gated-laplacian:4"):  # fmt: skip
        assert f"| {name} |" in table
    assert "| model | ms/step | ratio, median of rounds [95% CI] |" in table
    fixed = next(line for line in table.splitlines() if line.startswith("| 4 | 197 | 2 |"))  # ViT-S, B = 4
    assert re.search(r"\| \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \|", fixed), fixed


@pytest.mark.slow
def test_the_thread_benchmark_writes_its_table_into_a_markdown_file(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    text = _load("threads").main(["--rounds", "1", "--steps", "1", "--batch", "4", "--write", str(doc)])
    rows = [line for line in text.splitlines() if line.startswith("| lapheads auto |")]
    assert len(rows) == 1 and "| 1 thread | 1 / 1 |" in text
    written = doc.read_text()
    assert written.startswith("# Benchmarks\n\nkept\n") and text in written


def test_a_benchmark_section_is_replaced_not_appended(tmp_path):
    from lapheads.bench import replace_section

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- x: begin -->\nold\n<!-- x: end -->\n\nafter\n")
    replace_section(doc, "<!-- x: begin -->\nnew\n<!-- x: end -->")
    assert doc.read_text() == "# Benchmarks\n\n<!-- x: begin -->\nnew\n<!-- x: end -->\n\nafter\n"
    replace_section(doc, "<!-- y: begin -->\nmore\n<!-- y: end -->")
    assert doc.read_text().endswith("after\n\n<!-- y: begin -->\nmore\n<!-- y: end -->\n")


@pytest.mark.slow
def test_the_precision_benchmark_states_the_cpu_and_the_auto_choice(tmp_path):
    text = _load("precision").main(["--repeats", "1", "--vit-batch", "2", "--gpt-batch", "1"])
    assert "| ViT (fmnist-cpu) |" in text and "| GPT (shakespeare-cpu) |" in text
    assert "`amp auto` here: **" in text and "avx512_bf16" in text


def test_the_per_call_benchmark_alternates_trees_in_fresh_processes_and_refuses_a_folder_without_lapheads(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = [sys.executable, str(root / "benchmarks" / "per_call.py")]
    done = subprocess.run([*script, str(root / "src"), "--rounds", "1"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (row,) = [line for line in done.stdout.splitlines() if line.startswith(f"| {root / 'src'} |")]
    times = [float(cell.split()[0]) for cell in row.strip("|").split("|")[1:]]
    assert len(times) == 3 and all(0 < t < 100_000 for t in times)  # op k, op bools, module: us per call
    refused = subprocess.run([*script, str(tmp_path)], capture_output=True, text=True)
    assert refused.returncode != 0 and "holds no lapheads/__init__.py" in refused.stderr


def test_the_windows_benchmark_times_every_path_side_by_side(tmp_path):
    doc = tmp_path / "benchmarks.md"
    text = _load("windows").main(
        ["--seq-lens", "256", "--repeats", "1", "--heads", "2", "--head-dim", "16", "--write", str(doc)]
    )
    row = next(line for line in text.splitlines() if line.startswith("| 256 | 32 |"))
    assert len(row.split("|")) == 11 and doc.read_text().strip() == text.strip()


def test_the_serving_benchmark_times_requests_together_and_one_by_one(tmp_path):
    doc = tmp_path / "benchmarks.md"
    text = _load("serving").main(
        [
            "--clients",
            "1",
            "3",
            "--depth",
            "1",
            "--max-tokens",
            "3",
            "--repeats",
            "1",
            "--requests-per-client",
            "1",
            "--write",
            str(doc),
        ]  # fmt: skip
    )
    engine, server = text.split("| clients | tokens |")
    server, profile = server.split("Where the served rounds' time went")
    profile, latency = profile.split("What the clients waited for")
    rows = [line for line in engine.splitlines() if line.startswith(("| 1 | 3 |", "| 3 | 9 |"))]
    assert len(rows) == 2 and all(len(row.split("|")) == 7 for row in rows)  # every request ran to its 3 tokens
    served = [line for line in server.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(served) == 2 and all(float(row.split("|")[-2]) > 0 for row in served)  # batched / serial
    # the server's own /metrics: a serial step decodes one row; 3 replies of at most 3 tokens take 2 steps each
    spent = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
             for line in profile.splitlines() if line.startswith(("| 1 |", "| 3 |"))}  # fmt: skip
    assert sorted(spent) == [("1", "batched"), ("1", "serial"), ("3", "batched"), ("3", "serial")]
    assert spent["3", "serial"][1] == "1.0" and 1 <= int(spent["3", "serial"][0]) <= 6
    # vLLM's latencies, from the streamed replies: each of the 3 replies has a first token, and 3 tokens have gaps
    waited = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
              for line in latency.splitlines() if line.startswith(("| 1 |", "| 3 |"))}  # fmt: skip
    assert sorted(waited) == sorted(spent) and waited["3", "batched"][0] == "3"
    ttft, ttft_p99, tpot, tpot_p99, itl, itl_p99 = map(float, waited["3", "batched"][1:])
    assert 0 < ttft <= ttft_p99 and 0 < tpot <= tpot_p99 and 0 < itl <= itl_p99
    assert 1.0 <= float(spent["3", "batched"][1]) <= 3.0
    assert all(float(row[2]) > 0 and row[4].endswith("%") for row in spent.values())  # decode ms a step
    assert doc.read_text().strip() == text.strip()


def test_the_loading_benchmark_runs_on_tiny_sizes(tmp_path, capsys):
    out = tmp_path / "benchmarks.md"
    text = _load("loading").main(["--smoke", "--workers", "0,1", "--write", str(out)])
    assert out.read_text().strip() == text and "| 0 |" in text and "| 1 |" in text
    assert "round 1 workers 1 gpu step" in capsys.readouterr().out
