"""Sweeps and training through a real SLURM (slurmctld + slurmd + slurmdbd on localhost, see conftest.py): the same
records as the local executor, pre-emption that requeues and resumes on the same trajectory, a 2-task gloo job
that matches one process, failures reported with SLURM's log and resubmitted alone, and SLURM's refusals in one line."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lapheads.cli import main
from lapheads.runs.records import read_record

pytestmark = pytest.mark.slow


def _weights(run_dir):
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


def _comparable(record):
    """What two executors must agree on: everything but when, how fast and where the run directory was."""
    data = dict(record.data)
    for key in ("written_at", "wall_seconds"):
        data.pop(key)
    data["metrics"] = [{k: v for k, v in row.items() if k != "images_per_s"} for row in data["metrics"]]
    data["analysis"] = {k: v for k, v in data["analysis"].items() if k != "run_dir"}  # each sweep's own folder
    return data


def _sweep(preset, out, records, *extra):
    args = ["sweep", str(preset), "--task", "classify", "--laplacian-heads", "0,1", "--seeds", "0"]
    return [*args, "--out", str(out), "--records", str(records), "--set", "amp=false", *extra]


def test_a_sweep_through_slurm_gives_the_local_executors_records(slurm_cluster, tiny_preset, tmp_path, capsys):
    slurm = ["--executor", "slurm", "--slurm-partition", slurm_cluster, "--slurm-time", "10", "--wait"]
    assert main(_sweep(tiny_preset, tmp_path / "s", tmp_path / "slurm-records", *slurm)) == 0
    said = capsys.readouterr().out
    assert said.count("submitted as SLURM job") == 2 and "cells done" in said
    ledger = json.loads((tmp_path / "s" / "sweep.json").read_text())["cells"]
    assert all(c["slurm_job"] and c["status"] == "done" for c in ledger.values())
    torch.set_num_threads(1)  # a job's threads: SLURM's CPUs per task (1)
    assert main(_sweep(tiny_preset, tmp_path / "l", tmp_path / "local-records")) == 0
    for name in ("L0-s0", "L1-s0"):
        slurm_record = read_record(tmp_path / "slurm-records" / f"{name}.json")
        local = read_record(tmp_path / "local-records" / f"{name}.json")
        assert _comparable(slurm_record) == _comparable(local), name
    # the same command again: every cell has its record; nothing is submitted
    assert main(_sweep(tiny_preset, tmp_path / "s", tmp_path / "slurm-records", *slurm)) == 0
    assert "submitted" not in capsys.readouterr().out


def _job_of(out, name):
    return json.loads((out / "sweep.json").read_text())["cells"][name]["slurm_job"]


def test_a_preempted_cell_requeues_and_finishes_on_the_uninterrupted_trajectory(
    slurm_cluster, tiny_config, tmp_path, capsys
):
    # long enough to be signalled mid-run on an idle machine too: 1,024 steps (~5 ms each there; 128 steps were over
    # before the signal came once, and submitit's own handler took it), a checkpoint every 64
    preset = tmp_path / "long.json"
    cfg = dataclasses.replace(tiny_config, epochs=64, eval_every_epochs=16, checkpoint_every=64, log_every=2)
    preset.write_text(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k != "laplacian_heads"}))
    out = tmp_path / "s"
    args = ["sweep", str(preset), "--task", "classify", "--laplacian-heads", "1", "--seeds", "0", "--out", str(out)]
    slurm = ["--executor", "slurm", "--slurm-partition", slurm_cluster]
    assert main([*args, *slurm]) == 0  # submitted; not waited for
    capsys.readouterr()
    job = _job_of(out, "L1-s0")
    metrics = out / "L1-s0" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    # what SLURM does at pre-emption with preempt_send_user_signal (and before the time limit): the user signal
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    _start_when_requeued(job)
    # the job is still ours (requeued or running): not resubmitted
    assert main([*args, *slurm, "--wait"]) == 0, _history(job)
    said = capsys.readouterr().out
    assert "not submitted again" in said and "submitted as SLURM job" not in said.replace("not submitted again", "")
    log = "".join(p.read_text() for p in (out / "slurm" / job).glob("*_log.*"))
    assert "Caught signal SIGUSR2" in log and "Requeued job" in log
    # the step in progress finished and was checkpointed; the requeued job continued from exactly that step
    stopped = re.search(r"interrupted \(SIGUSR2\) at step (\d+)", log)
    assert stopped and f"from step {stopped[1]} (step-{int(stopped[1]):08d};" in log, log[-3000:]
    torch.set_num_threads(1)
    from lapheads.train.classify import train_classify

    train_classify(dataclasses.replace(cfg, laplacian_heads="1", seed=0), tmp_path / "uninterrupted")
    a, b = _weights(out / "L1-s0"), _weights(tmp_path / "uninterrupted")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _history(job: str) -> str:
    """Every run of a job as the accounting database and the controller saw it (for a failure's message)."""
    runs = subprocess.run(["sacct", "-D", "-P", "-j", job, "-o", "JobID,State,ExitCode,Start,End"], capture_output=True)
    now = subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%i %T %r"], capture_output=True)
    return f"sacct -D: {runs.stdout.decode()!r}; squeue: {now.stdout.decode()!r}"


def _start_when_requeued(job: str) -> None:
    """SLURM holds a requeued batch job for 121 s before it may start again; the test lifts that hold once the
    job is back in the queue (what an operator's `scontrol update` does), so it does not wait two minutes.

    Not within the second of the requeue: slurmd revoked the job's credential then and refuses any credential
    created in the same second or before ("Killing non-startable batch job: Job credential revoked", whole-second
    times), which is what the 121 s hold guards against."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()
        if state == "PENDING":
            time.sleep(2.0)  # past the revocation's second, whatever fraction of it the requeue took
            subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job} was not requeued (squeue: {state!r})")


def test_a_two_task_gloo_job_matches_one_process_with_the_same_global_batch(slurm_cluster, text_root, tmp_path):
    from lapheads.train.lm import train_lm
    from tests.conftest import tiny_lm

    cfg = tiny_lm(text_root, num_iterations=4, eval_every=4, micro_batch=8, checkpoint_every=4)
    torch.set_num_threads(1)
    train_lm(cfg, tmp_path / "one")
    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps(dataclasses.asdict(cfg)))
    args = ["train", "lm", "--preset", str(preset), "--out", str(tmp_path / "two"), "--executor", "slurm"]
    args += ["--slurm-partition", slurm_cluster, "--slurm-tasks-per-node", "2", "--wait"]
    assert main(args) == 0
    record = json.loads((tmp_path / "two" / "config.json").read_text())
    assert record["world_size"] == 2
    loss = lambda d: [r["loss"] for r in map(json.loads, (d / "metrics.jsonl").open()) if "loss" in r]  # noqa: E731
    # the same tokens per step on 2 ranks x 1 accumulation as on 1 rank x 2: only summation order differs
    assert loss(tmp_path / "two") == pytest.approx(loss(tmp_path / "one"), rel=1e-4)


def test_a_failed_cell_is_reported_with_its_slurm_log_and_a_rerun_resubmits_only_it(
    slurm_cluster, tiny_preset, tmp_path, capsys
):
    out = tmp_path / "s"
    (out / "L1-s0").mkdir(parents=True)
    (out / "L1-s0" / "config.json").write_text("{broken")  # this cell's job cannot start its run
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0,1", "--seeds", "0"]
    args += ["--out", str(out), "--executor", "slurm", "--slurm-partition", slurm_cluster, "--wait"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "1 cell(s) failed: L1-s0 (job" in err and "config.json is corrupt" in err  # the job's own log line
    failed_job = _job_of(out, "L1-s0")
    (out / "L1-s0" / "config.json").unlink()
    assert main(args) == 0
    said = capsys.readouterr().out
    assert f"L1-s0's SLURM job {failed_job} ended FAILED" in said
    assert said.count("submitted as SLURM job") == 1 and "L0-s0 finished before, skipped" in said


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--slurm-partition", "no-such-partition"], "sbatch refused the job: invalid partition specified: no-such"),
        (["--slurm-option=account"], "--slurm-option 'account'; allowed: KEY=VALUE"),
        (["--slurm-time", "0"], "--slurm-time 0; allowed: an integer >= 1"),
    ],
)
def test_slurm_refusals_are_one_line_naming_what_was_refused(slurm_cluster, tiny_preset, tmp_path, capsys, extra, says):
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0", "--seeds", "0"]
    assert main([*args, "--out", str(tmp_path / "s"), "--executor", "slurm", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1  # SLURM's own words, or the option and what is allowed


def test_an_unreachable_slurmctld_is_one_line_with_slurms_words(
    slurm_cluster, tiny_preset, tmp_path, capsys, monkeypatch
):
    conf = Path("/etc/slurm/slurm.conf")
    if not conf.is_file():
        pytest.skip("the cluster's slurm.conf is not on this machine")
    wrong = tmp_path / "slurm.conf"  # the same cluster, its controller on a port nothing listens on
    wrong.write_text(conf.read_text() + "SlurmctldPort=1\n")
    monkeypatch.setenv("SLURM_CONF", str(wrong))
    args = ["sweep", str(tiny_preset), "--task", "classify", "--laplacian-heads", "0", "--seeds", "0"]
    assert main([*args, "--out", str(tmp_path / "s"), "--executor", "slurm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "sbatch refused the job: Batch job submission failed: Unable to contact slurm controller (connect failure)"
    )
    assert len(err.splitlines()) == 1 and not (tmp_path / "s" / "L0-s0").exists()  # nothing started
