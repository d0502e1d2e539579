"""Red team, run folders (issue 28): a run directory whose config, checkpoints, weights or tokenizer were edited
or linked out of the run, and training into a folder lapheads did not write, are one-line lapheads errors; nothing
of the user's is changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _edit_config(change):
    def fault(run: Path, outside: Path) -> None:
        path = run / "config.json"
        record = json.loads(path.read_text())
        path.write_text(json.dumps(change(record)) if callable(change) else change)

    return fault


def _step(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def _link_latest_out(run: Path, outside: Path) -> None:
    (outside / "pointer").write_text(_step(run).name + "\n")
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").symlink_to(outside / "pointer")


def _link_step_out(run: Path, outside: Path) -> None:
    step = _step(run)
    step.rename(outside / step.name)
    step.symlink_to(outside / step.name)


def _link_checkpoints_out(run: Path, outside: Path) -> None:
    (run / "checkpoints").rename(outside / "checkpoints")
    (run / "checkpoints").symlink_to(outside / "checkpoints")


def _link_weights_out(run: Path, outside: Path) -> None:
    weights = _step(run) / "model.safetensors"
    weights.rename(outside / "model.safetensors")
    weights.symlink_to(outside / "model.safetensors")


def _link_tokenizer_out(run: Path, outside: Path) -> None:
    (run / "tokenizer").rename(outside / "tokenizer")
    (run / "tokenizer").symlink_to(outside / "tokenizer")


def _link_tokenizer_file_out(run: Path, outside: Path) -> None:
    for file in (run / "tokenizer").iterdir():
        file.rename(outside / file.name)
        file.symlink_to(outside / file.name)


def _rewrite_weights(change):
    def fault(run: Path, outside: Path) -> None:
        from safetensors.torch import load_file, save_file

        path = _step(run) / "model.safetensors"
        tensors = load_file(str(path))
        name = sorted(tensors)[0]
        tensors[name] = change(tensors[name])
        save_file(tensors, str(path))

    return fault


#: a trained run with one fault; loading it is a one-line lapheads error naming what is wrong
RUN_FAULTS = {
    "config.json a list": (_edit_config("[1, 2]"), "config.json"),
    "config.json null": (_edit_config("null"), "config.json"),
    "config.json torn": (_edit_config('{"task": "lm", "con'), "config.json"),
    "config.json not UTF-8": (lambda run, outside: (run / "config.json").write_bytes(b"\xff\xfe{"), "config.json"),
    "config.json missing": (lambda run, outside: (run / "config.json").unlink(), "config.json"),
    "an unknown task": (_edit_config(lambda r: {**r, "task": "mystery"}), "mystery"),
    "an unknown model factory": (_edit_config(lambda r: {**r, "model": {**r["model"], "factory": "nope"}}), "nope"),
    "an unknown model argument": (
        _edit_config(lambda r: {**r, "model": {**r["model"], "kwargs": {**r["model"]["kwargs"], "bogus": 1}}}),
        "bogus",
    ),
    "a model past this machine": (
        _edit_config(lambda r: {**r, "model": {**r["model"], "kwargs": {**r["model"]["kwargs"], "depth": 100_000}}}),
        "LAPHEADS_ALLOW_LARGE",
    ),
    "latest a symlink out": (_link_latest_out, "symlink or leads out"),
    "a step folder a symlink out": (_link_step_out, "symlink or leads out"),
    "checkpoints a symlink out": (_link_checkpoints_out, "symlink or leads out"),
    "the weights a symlink out": (_link_weights_out, "model.safetensors is a symlink"),
    "the tokenizer a symlink out": (_link_tokenizer_out, "tokenizer is a symlink"),
    "a tokenizer file a symlink out": (_link_tokenizer_file_out, "is a symlink"),
    "latest names a missing step": (
        lambda run, outside: (run / "checkpoints" / "latest").write_text("step-00009999\n"),
        "step-00009999",
    ),
    "latest names a path out": (
        lambda run, outside: (run / "checkpoints" / "latest").write_text("../../outside\n"),
        "latest",
    ),
    "weights truncated": (
        lambda run, outside: (_step(run) / "model.safetensors").write_bytes(
            (_step(run) / "model.safetensors").read_bytes()[:100]
        ),
        "not a valid safetensors file",
    ),
    "weights int8": (_rewrite_weights(lambda t: t.to(__import__("torch").int8)), "torch.int8"),
    "weights NaN": (_rewrite_weights(lambda t: t.clone().fill_(float("nan"))), "NaN or inf"),
    "weights of another shape": (_rewrite_weights(lambda t: t.flatten()[:3].clone()), "does not match the model"),
    "weights missing": (lambda run, outside: (_step(run) / "model.safetensors").unlink(), "model.safetensors"),
}


@pytest.mark.parametrize("name", sorted(RUN_FAULTS))
def test_run_faults(name, base_run, tmp_path):
    import shutil

    from lapheads.errors import LapheadsError
    from lapheads.runs import load_gpt_run

    fault, says = RUN_FAULTS[name]
    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(base_run, run, symlinks=True)
    outside.mkdir()
    fault(run, outside)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    with pytest.raises(LapheadsError) as info:
        load_gpt_run(run, "cpu")
    message = str(info.value)
    assert says in message and "\n" not in message, (name, message)
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


#: folders lapheads did not write (or wrote for another task): training there is refused and nothing changes
FOREIGN = {
    "an ordinary folder's config.json": {"config.json": '{"lr": 1}', "metrics.jsonl": '{"mine": 1}\n'},
    "a config.json that is a list": {"config.json": "[1, 2]", "metrics.jsonl": "x\n"},
    "a config.json that is null": {"config.json": "null"},
    "a torn config.json": {"config.json": '{"task": "lm"'},
    "another task's run": {"config.json": '{"task": "classify", "config": {}}', "metrics.jsonl": "{}\n"},
    "logs without a config.json": {"metrics.jsonl": '{"mine": 1}\n'},
    "a checkpoints folder without a config.json": {"checkpoints/notes.txt": "mine"},
    "samples without a config.json": {"samples.jsonl": '{"mine": 1}\n'},
}


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_training_into_a_foreign_folder(name, text_root, tmp_path):
    from lapheads.errors import LapheadsError
    from lapheads.train.lm import train_lm
    from tests.conftest import tiny_lm

    folder = tmp_path / "mine"
    for relative, text in FOREIGN[name].items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    with pytest.raises((LapheadsError, ValueError)) as info:
        train_lm(tiny_lm(text_root, num_iterations=2), folder)
    assert "nothing was changed" in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
