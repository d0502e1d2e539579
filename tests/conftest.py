"""Shared fixtures: small datasets generated in the true on-disk formats."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import os
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest


def torchrun(args: list[str], processes: int = 2, timeout: float = 300, wait: bool = True):
    """``python -m torch.distributed.run --standalone --nproc_per_node N ARGS`` at one thread a process: the
    finished run (``subprocess.run``, output captured as text) or, with ``wait=False``, the running job (Popen)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


#: a peer's suite that prints nothing for this long has stalled (a hang), however busy the machine is: pytest -q
#: prints a character per test, and the slowest single peer test measured here takes ~3 min on a loaded 2-core CPU
PEER_SUITE_STALL_SECONDS = 1800


def run_peer_suite(
    command: list[str], *, stall_seconds: float = PEER_SUITE_STALL_SECONDS, **popen
) -> subprocess.CompletedProcess:
    """Run a peer's test suite to its end, however long a loaded machine makes it: no wall-clock limit, only a stall
    watchdog (no new output for ``stall_seconds``: killed, and the result says so in its stderr). Output is captured
    as text, as ``subprocess.run(capture_output=True, text=True)`` would."""
    import tempfile
    import time

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        job = subprocess.Popen(command, stdout=out, stderr=err, text=True, **popen)
        seen, last_change = -1, time.monotonic()
        while job.poll() is None:
            time.sleep(2)
            size = os.fstat(out.fileno()).st_size + os.fstat(err.fileno()).st_size
            if size != seen:
                seen, last_change = size, time.monotonic()
            elif time.monotonic() - last_change > stall_seconds:
                job.kill()
                job.wait()
                err.write(f"\n[stalled: no output for {stall_seconds:.0f} s; killed]\n")
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, job.returncode, out.read(), err.read())


def node_name(grad_fn) -> str:
    """An autograd node's name on every torch lapheads supports: torch 2.9 refuses ``.name()`` on a Python
    Function's node ("a legacy access pattern"), whose class name is the same string."""
    try:
        return grad_fn.name()
    except RuntimeError:
        return type(grad_fn).__name__


def processes_with(text: str) -> list[int]:
    """The pids whose command line contains ``text`` (a run's unique marker: what a sandbox must not leave behind)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if text.encode() in open(f"/proc/{entry.name}/cmdline", "rb").read():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.fixture
def verbose():
    """lapheads' info messages shown, as the command shows them (a library user sees warnings only: lapheads.log)."""
    import lapheads

    shown = lapheads.get_verbosity()
    lapheads.set_verbosity("info")
    yield
    lapheads.set_verbosity(shown)


@pytest.fixture(params=["boundary", "guard only"])
def layers(request, monkeypatch):
    """A sandbox case run with bubblewrap (where installed) and with the in-process guard alone."""
    from lapheads import sandbox

    if request.param == "boundary":
        if sandbox.boundary_tool() is None:
            pytest.skip("bubblewrap is not usable here (quickstart.sh test installs it where it can)")
    else:
        monkeypatch.setattr(sandbox, "boundary_tool", lambda: None)
    return request.param


def timm_and_lapheads(name: str, spec, **kwargs):
    """(timm's model, lapheads' model with heads ``spec``) of ``name``, in eval mode, sharing timm's own weights;
    asserts the state dicts differ only by the head kinds' own parameters."""
    import timm
    import torch

    import lapheads

    torch.manual_seed(0)
    plain = timm.create_model(name, **kwargs).eval()
    model = lapheads.create_vit(name, spec, **kwargs).eval()
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all(key.endswith(("mix_a", "mix_b")) for key in missing)  # only the kinds' own
    return plain, model


def pip_download(requirement: str, folder: Path, *, wheel: bool, timeout: int) -> subprocess.CompletedProcess:
    """``pip download`` of one distribution without its dependencies into ``folder``: its wheel, or its sdist."""
    folder.mkdir(parents=True, exist_ok=True)
    only = ["--only-binary", ":all:"] if wheel else ["--no-binary", ":all:"]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *only, "-q", "-d", str(folder), requirement]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def peer_tests(package: str, version: str, cache: Path) -> Path:
    """A peer's ``tests/`` folder from the sdist of ``package==version`` on PyPI (cached in ``cache``); skips the
    calling test, saying what pip said, where PyPI cannot be reached."""
    folder = cache / f"{package}-{version}" / "tests"
    if folder.is_dir():
        return folder
    fetched = pip_download(f"{package}=={version}", cache, wheel=False, timeout=600)
    sdist = cache / f"{package}-{version}.tar.gz"
    if fetched.returncode != 0 or not sdist.is_file():
        said = (fetched.stderr or fetched.stdout).strip().splitlines()[-1:]
        pytest.skip(f"{package}'s test suite needs its sdist from PyPI ({package}=={version}); pip said: {said}")
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(f"{package}-{version}/tests/")]
        archive.extractall(cache, members=members, filter="data")
    return folder


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write an MNIST-style idx file (gzip-compressed when the name ends in .gz)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def pattern_images(n: int, num_classes: int = 10, size: int = 28, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Learnable images: a fixed random template per class (the same in every split), plus noise."""
    templates = np.random.default_rng(1234).integers(0, 256, (num_classes, size, size))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, n)
    noise = rng.integers(0, 256, (n, size, size))
    images = (0.6 * templates[labels] + 0.4 * noise).astype(np.uint8)
    return images, labels.astype(np.uint8)


@pytest.fixture(scope="session")
def fmnist_root(tmp_path_factory) -> Path:
    """A Fashion-MNIST folder with the four idx.gz files: 512 training and 256 test images."""
    root = tmp_path_factory.mktemp("fmnist")
    for split, n, seed in (("train", 512, 0), ("t10k", 256, 1)):
        images, labels = pattern_images(n, seed=seed)
        write_idx(root / f"{split}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{split}-labels-idx1-ubyte.gz", labels)
    return root


TINY_VIT = {"depth": 2, "embed_dim": 32, "num_heads": 2, "patch_size": 7}


def tiny_classify(root, **changes):
    """A classification config that trains a 2-layer ViT on the generated data in seconds, deterministically."""
    from lapheads.train.configs.classify import ClassifyConfig

    base = ClassifyConfig(
        model="vit_fmnist_patch4",
        model_kwargs=dict(TINY_VIT),
        laplacian_heads="1",
        data_root=str(root),
        batch_size=32,
        epochs=0.5,
        lr=3e-3,
        warmup_epochs=0.0,
        amp=False,
        augment=False,
        eval_every_epochs=0.25,
        log_every=1,
        device="cpu",
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture
def tiny_config(fmnist_root):
    return tiny_classify(fmnist_root)


@pytest.fixture(scope="session")
def text_root(tmp_path_factory):
    """A data root where the Shakespeare corpus and its character tokens get prepared once per session."""
    return tmp_path_factory.mktemp("text-data")


def tiny_lm(root, **changes):
    """A 2-layer, 64-dim character GPT on the real Shakespeare corpus that trains in seconds."""
    from lapheads.train.configs.lm import LMConfig

    base = LMConfig(
        dataset="shakespeare",
        data_root=str(root),
        tokenizer="char",
        depth=2,
        aspect_ratio=32,
        head_dim=16,
        laplacian_heads="2",
        sequence_len=64,
        total_batch_size=1024,
        micro_batch=16,
        num_iterations=12,
        eval_every=6,
        eval_tokens=2048,
        sample_prompt="ROMEO:\n",
        sample_tokens=24,
        log_every=1,
        device="cpu",
        amp=False,
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture
def tiny_dino(fmnist_root):
    """A DINO config: 2-layer, 32-dim ViT, 2 local crops, 8 steps over 256 generated images, in seconds."""
    from lapheads.train.configs.dino import DINOConfig

    return DINOConfig(
        model="vit_fmnist_patch4",
        model_kwargs={"depth": 2, "embed_dim": 32, "num_heads": 2},
        laplacian_heads="1",
        dataset="fashion-mnist",
        data_root=str(fmnist_root),
        img_size=28,
        local_crop_size=12,
        local_crops=2,
        local_scale=[0.1, 0.4],
        out_dim=64,
        head_hidden_dim=32,
        head_bottleneck_dim=16,
        epochs=2,
        batch_size=64,
        train_subset=256,
        lr=0.002,
        warmup_epochs=0.5,
        momentum_teacher=0.9,
        freeze_last_layer=1,
        drop_path=0.1,
        amp=False,
        device="cpu",
        log_every=1,
        checkpoint_every_epochs=1.0,
    )


@pytest.fixture(scope="session")
def base_run(text_root, tmp_path_factory):
    """A tiny character GPT with 2 Laplacian heads per layer, trained for 6 steps: the base of chat tests."""
    from lapheads.train.lm import train_lm

    run = tmp_path_factory.mktemp("chat") / "base"
    train_lm(tiny_lm(text_root, num_iterations=6, eval_every=6, sequence_len=256, micro_batch=4), run)
    return run


def tiny_sft(base, **changes):
    """SFT of ``base`` on generated arith conversations, 6 steps of 8."""
    from lapheads.train.configs.chat import SFTConfig

    cfg = SFTConfig(
        base=str(base),
        data="arith",
        val_data="arith_test",
        micro_batch=4,
        examples_per_step=8,
        num_iterations=6,
        eval_every=3,
        eval_examples=8,
        init_lr_frac=0.5,
        log_every=1,
        device="cpu",
        amp=False,
    )
    return dataclasses.replace(cfg, **changes)


@pytest.fixture(scope="session")
def sft_run(base_run, tmp_path_factory):
    """``base_run`` after 4 SFT steps on arith and letters conversations."""
    from lapheads.train.chat import train_sft

    run = tmp_path_factory.mktemp("sft") / "run"
    train_sft(tiny_sft(base_run, data="arith,letters", num_iterations=4, eval_every=4), run)
    return run


@contextlib.contextmanager
def served(app):
    """A real uvicorn server of ``app`` on a free loopback port, in a thread; yields its base URL."""
    from lapheads.apps.serve import served as in_thread

    with in_thread(app) as url:
        yield url
