"""Red team, turn 5 (issue 60), "the rest": options that were taken and then silently dropped, or applied where they
could not hold, are one-line refusals; an explicit --threads is what the run gets."""

from __future__ import annotations

import os

import pytest
import torch

from lapheads.cli import main
from lapheads.hardware import apply_thread_policy, available_cpus


def _refusal(argv, capsys) -> tuple[object, str]:
    """(exit code, the one line said) of a command that must refuse, whether it returns or argparse exits."""
    try:
        code = main(argv)
    except SystemExit as exited:
        code = exited.code
    if isinstance(code, str):  # a message passed to SystemExit
        return 1, code
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["train", "lm", "--preset", "shakespeare-cpu", "--threads", "100000"],
            "--threads '100000'; allowed: auto, or 1",
        ),
        (
            ["sweep", "shakespeare-cpu", "--laplacian-heads", "0", "--seeds", "0", "--threads", "100000", "--dry-run"],
            "argument --threads: '100000'; allowed: auto, or 1",
        ),  # fmt: skip
        (["train", "classify", "--preset", "fmnist-cpu", "--nodes", "4"], "--nodes without --executor slurm"),
        (
            ["train", "classify", "--preset", "fmnist-cpu", "--slurm-gpus-per-node", "8"],
            "--slurm-gpus-per-node without --executor slurm",
        ),  # fmt: skip
        (
            ["train", "classify", "--preset", "fmnist-cpu", "--executor", "slurm", "--slurm-option", "signal=KILL"],
            "--slurm-option 'signal=KILL' would replace a setting lapheads makes itself",
        ),  # fmt: skip
        (
            [
                "sweep",
                "fmnist-cpu",
                "--laplacian-heads",
                "0",
                "--seeds",
                "0",
                "--executor",
                "slurm",
                "--slurm-option",
                "requeue=no",
                "--dry-run",
            ],
            "--slurm-option 'requeue=no' would replace",
        ),  # fmt: skip
    ],
)
def test_an_option_that_cannot_hold_is_refused_in_one_line(argv, words, tmp_path, capsys):
    code, said = _refusal([*argv, "--out", str(tmp_path / "run")] if argv[0] == "train" else argv, capsys)
    assert code not in (0, None) and words in said, said
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(available_cpus() < 2, reason="needs 2 CPUs to ask for 2 threads")
def test_an_explicit_threads_is_not_capped_by_mkl_num_threads(monkeypatch):
    monkeypatch.setattr(os, "environ", {**os.environ, "MKL_NUM_THREADS": "1"})
    threads = torch.get_num_threads()
    try:
        apply_thread_policy("2", announce=False)
        assert os.environ["MKL_NUM_THREADS"] == "2" and os.environ["OMP_NUM_THREADS"] == "2"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_device_cuda_without_a_gpu_is_one_line_not_a_traceback(command, sft_run, capsys):
    argv = [command, str(sft_run), "--device", "cuda"]
    argv += ["--prompt", "hi"]
    code, said = _refusal(argv, capsys)
    assert code == 2 and "no CUDA device is available here; allowed here: cpu or auto" in said


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_device_no_reader_computes_on_is_one_line(command, sft_run, capsys):
    """Issue 76 (red team, low): `generate --device meta` raised a traceback."""
    code, said = _refusal([command, str(sft_run), "--device", "meta", "--prompt", "hi"], capsys)
    assert code == 2 and "--device 'meta'; allowed: auto, cpu, cuda, cuda:N" in said
