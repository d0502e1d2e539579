"""Crash recovery as the README documents it, and the repairs a resume makes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lapheads import runs
from lapheads.errors import CheckpointError
from lapheads.runs import RunDir, checkpoints, latest_checkpoint
from lapheads.runs.checkpoints import NonFiniteLossError
from lapheads.train.classify import train_classify
from tests.conftest import torchrun

LAPHEADS = str(Path(sys.executable).with_name("lapheads"))


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(RunDir(run)) / "model.safetensors"))


@pytest.mark.slow
def test_the_readme_resume_line_after_kill_9_ends_bit_identical(tiny_config, tmp_path):
    cfg = dataclasses.replace(tiny_config, epochs=6.0, eval_every_epochs=6.0, checkpoint_every=4, laplacian_heads="0")
    preset = tmp_path / "tiny.json"
    preset.write_text(json.dumps(dataclasses.asdict(cfg)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = tmp_path / "straight"
    # The README's two lines, with a small preset: train with a head spec, then resume without repeating it.
    subprocess.run(
        [LAPHEADS, "train", "classify", "--preset", str(preset), "--laplacian-heads", "1", "--out", str(straight)],
        check=True,
        capture_output=True,
        env=env,
        timeout=600,
    )
    crashed = tmp_path / "crashed"
    proc = subprocess.Popen(
        [LAPHEADS, "train", "classify", "--preset", str(preset), "--laplacian-heads", "1", "--out", str(crashed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.time() + 300
    while not (crashed / "checkpoints" / "latest").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = latest_checkpoint(RunDir(crashed)).name
    total = json.loads((crashed / "config.json").read_text())["steps"]
    assert int(killed_at.split("-")[1]) < total, "the run finished before it could be killed"
    done = subprocess.run(
        [LAPHEADS, "train", "classify", "--preset", str(preset), "--out", str(crashed), "--resume"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    a, b = _final_weights(straight), _final_weights(crashed)
    assert latest_checkpoint(RunDir(crashed)).name == f"step-{total:08d}"
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_changed_option_and_accepts_a_repeated_one(tiny_config, tmp_path, capsys):
    from lapheads.cli import main

    preset = tmp_path / "tiny.json"
    preset.write_text(json.dumps(dataclasses.asdict(dataclasses.replace(tiny_config, checkpoint_every=1))))
    out = str(tmp_path / "run")
    assert (
        main(["train", "classify", "--preset", str(preset), "--laplacian-heads", "2", "--out", out, "--epochs", "0.25"])
        == 0
    )
    assert main(["train", "classify", "--out", out, "--resume", "--laplacian-heads", "1"]) == 2
    assert "--laplacian-heads '1' (run: '2')" in capsys.readouterr().err
    assert main(["train", "classify", "--out", out, "--resume", "--preset", "fmnist-cpu"]) == 2
    assert "differs from the run's" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "classify",
                "--out",
                out,
                "--resume",
                "--laplacian-heads",
                "2",
                "--epochs",
                "0.25",
                "--preset",
                str(preset),
            ]
        )
        == 0
    )
    capsys.readouterr()
    # how many processes load the batches changes nothing a step trains on (step_loader): a resume may change it
    assert main(["train", "classify", "--out", out, "--resume", "--num-workers", "2"]) == 0
    assert "differs" not in capsys.readouterr().err


def test_resume_repairs_a_torn_log_line_and_a_half_written_checkpoint(tiny_config, tmp_path, capsys):
    cfg = dataclasses.replace(tiny_config, checkpoint_every=2)
    train_classify(cfg, tmp_path / "full")
    run = tmp_path / "run"
    train_classify(cfg, run, stop_at_step=5)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 2.3')  # killed mid-write
    (run / "checkpoints" / ".tmp-step-00000006").mkdir()
    (run / "checkpoints" / ".tmp-step-00000006" / "model.safetensors").write_bytes(b"half")
    with pytest.raises(CheckpointError, match="line 1 is corrupt"):
        (run / "bad.jsonl").write_text('{"step": 1\n{"step": 2}\n')
        runs.read_jsonl(run / "bad.jsonl")
    train_classify(cfg, run, resume=True)
    err = capsys.readouterr().err
    assert "removed the half-written checkpoint" in err and "dropped a torn last line" in err
    assert not (run / "checkpoints" / ".tmp-step-00000006").exists()
    a, b = _final_weights(tmp_path / "full"), _final_weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in RunDir(run).read_metrics()] == [
        r["step"] for r in RunDir(tmp_path / "full").read_metrics()
    ]


def test_latest_never_points_outside_the_run(tiny_config, tmp_path):
    train_classify(dataclasses.replace(tiny_config, epochs=0.125), tmp_path / "run")
    (tmp_path / "x").mkdir()
    (tmp_path / "run" / "checkpoints" / "latest").write_text("../../x\n")
    with pytest.raises(CheckpointError, match="allowed: the name of a step-<N> folder"):
        latest_checkpoint(RunDir(tmp_path / "run"))


def test_nan_message_says_when_no_checkpoint_exists_and_hints_only_what_is_off(tiny_config, tmp_path, monkeypatch):
    from lapheads.train import classify

    real = classify._loss_fn

    def poisoned(cfg):
        loss = real(cfg)
        return lambda logits, labels: loss(logits, labels) * float("nan")

    monkeypatch.setattr(classify, "_loss_fn", poisoned)
    with pytest.raises(NonFiniteLossError) as info:
        train_classify(tiny_config, tmp_path / "run")
    assert "no checkpoint was written yet" in str(info.value) and "clip" not in str(info.value)
    with pytest.raises(NonFiniteLossError, match="set --clip-grad"):
        train_classify(dataclasses.replace(tiny_config, clip_grad=None), tmp_path / "run2")


def test_optimizer_overflow_stops_like_nan(text_root, tmp_path, monkeypatch):
    from lapheads.train.lm import train_lm
    from tests.conftest import tiny_lm

    # Weights that overflow without an error: never saved over the last good checkpoint.
    with pytest.raises(
        NonFiniteLossError,
        match=r"(weights are not finite after|non-finite loss nan at) step \d+.* is "
        "intact",
    ):
        train_lm(tiny_lm(text_root, matrix_lr=1e38, checkpoint_every=1), tmp_path / "run")
    kept = load_file(str(latest_checkpoint(RunDir(tmp_path / "run")) / "model.safetensors"))
    assert all(bool(w.isfinite().all()) for w in kept.values())

    # An optimizer that raises an overflow: one line naming the step.
    def overflow(self, *args, **kwargs):
        raise RuntimeError("value cannot be converted to type float without overflow")

    monkeypatch.setattr(torch.optim.Muon, "step", overflow)
    with pytest.raises(NonFiniteLossError, match="numeric overflow in the ShardedMuon step at step 1 .*no checkpoint"):
        train_lm(tiny_lm(text_root), tmp_path / "run2")


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(tiny_config, tmp_path, monkeypatch):
    cfg = dataclasses.replace(tiny_config, checkpoint_every=2)
    real = checkpoints.save_file
    calls = []

    def save_file(tensors, path):
        calls.append(path)
        if len(calls) > 8:  # the first checkpoints succeed, then the disk is full
            raise OSError(28, "No space left on device", path)
        return real(tensors, path)

    monkeypatch.setattr(checkpoints, "save_file", save_file)
    with pytest.raises(CheckpointError, match="No space left on device.*step-000000\\d\\d is intact"):
        train_classify(cfg, tmp_path / "run")
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def _torchrun(args: list[str], out: Path) -> subprocess.Popen:
    return torchrun(["-m", "lapheads", "train", "classify", *args, "--out", str(out)], wait=False)


def _rank_pid(parent: int, rank: int) -> int | None:
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(child)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds torchrun's workers through /proc")
def test_a_killed_rank_stops_the_job_in_one_line_and_resume_is_identical(tiny_config, tmp_path):
    cfg = dataclasses.replace(tiny_config, epochs=6.0, eval_every_epochs=6.0, checkpoint_every=4)
    preset = tmp_path / "tiny.json"
    preset.write_text(json.dumps(dataclasses.asdict(cfg)))
    straight = _torchrun(["--preset", str(preset)], tmp_path / "straight")
    assert straight.wait(timeout=600) == 0, straight.stderr.read()
    job = _torchrun(["--preset", str(preset)], tmp_path / "killed")
    deadline = time.time() + 300
    while not (tmp_path / "killed" / "checkpoints" / "latest").exists() and time.time() < deadline:
        time.sleep(0.01)
    victim = _rank_pid(job.pid, 1)
    assert victim is not None and job.poll() is None
    os.kill(victim, signal.SIGKILL)
    _, err = job.communicate(timeout=120)  # no hang: torchrun and the surviving rank stop
    assert job.returncode != 0
    # The survivor says why in one line when it notices first (a lost gloo peer, or torchrun's SIGTERM while it
    # runs Python); blocked inside a gloo wait it is ended by torchrun's SIGTERM, whose report names the dead rank.
    survivor = [line for line in err.splitlines() if line.startswith(("lapheads train: error:", "lapheads: error:"))]
    if survivor:
        assert ("stopped by signal SIGTERM" in survivor[0] or "lost contact" in survivor[0]) and "--resume" in survivor[
            0
        ]
    else:
        assert "Root Cause" in err and "exitcode  : -9" in err, err[-2000:]
    assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err
    killed_at = latest_checkpoint(RunDir(tmp_path / "killed")).name
    total = json.loads((tmp_path / "killed" / "config.json").read_text())["steps"]
    assert int(killed_at.split("-")[1]) < total
    resumed = _torchrun(["--resume"], tmp_path / "killed")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    a, b = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "killed")
    assert latest_checkpoint(RunDir(tmp_path / "killed")).name == f"step-{total:08d}"
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_keep_all_checkpoints_and_resume_a_run_written_before_a_field_existed(tiny_config, tmp_path):
    cfg = dataclasses.replace(tiny_config, checkpoint_every=2, keep_checkpoints=0)
    train_classify(cfg, tmp_path / "all", stop_at_step=7)
    assert len(list((tmp_path / "all" / "checkpoints").glob("step-*"))) == 3  # steps 2, 4, 6: none deleted
    train_classify(cfg, tmp_path / "all", resume=True)
    assert len(list((tmp_path / "all" / "checkpoints").glob("step-*"))) == 4
    old = dataclasses.replace(tiny_config, checkpoint_every=2)
    train_classify(old, tmp_path / "old", stop_at_step=3)
    record = json.loads((tmp_path / "old" / "config.json").read_text())
    del record["config"]["keep_checkpoints"]  # written by an older lapheads
    (tmp_path / "old" / "config.json").write_text(json.dumps(record))
    assert train_classify(old, tmp_path / "old", resume=True)["step"] == 8
    with pytest.raises(ValueError, match="differs .* in: keep_checkpoints"):
        train_classify(dataclasses.replace(old, keep_checkpoints=5), tmp_path / "old", resume=True)


def test_a_run_folder_has_one_writer_a_second_training_is_refused_naming_the_first(tiny_config, tmp_path, capsys):
    """While one process trains a folder (here a child holding it as a training call does), a second
    ``train --resume`` or a fresh ``train`` into it is one line naming the holder's pid, and changes nothing."""
    from lapheads.cli import main

    preset = tmp_path / "tiny.json"
    preset.write_text(json.dumps(dataclasses.asdict(tiny_config)))
    out = tmp_path / "run"
    args = ["train", "classify", "--preset", str(preset), "--out", str(out), "--epochs", "0.25"]
    assert main(args) == 0
    capsys.readouterr()
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from lapheads.runs.directory import RunDir, owning_runs\n"
         f"with owning_runs():\n    RunDir({str(out)!r}).claim(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        for extra in (["--resume"], []):
            assert main([*args, *extra]) == 2
            err = capsys.readouterr().err
            assert f"run folder {out} is in use by process {holder.pid}" in err and err.count("\n") == 1
        after = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and "lapheads-run" not in p.name}
        assert after == {name: t for name, t in before.items() if "lapheads-run" not in name}
    finally:
        holder.kill()
        holder.wait()
    assert main([*args, "--resume"]) == 0  # the holder gone, the folder is free again
