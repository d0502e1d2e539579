"""Bad input, table-driven: every case ends in one line naming what is wrong, a non-zero exit, within 30 s, and
nothing written that would block the corrected command (issue 12's bar: >= 100 cases across the CLI, presets,
data and the Python API)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import time
import typing
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lapheads
from lapheads.cli import main
from lapheads.config import ConfigError, _options, validate_config
from lapheads.errors import LapheadsError
from lapheads.tasks.presets import CONFIG_TYPES, PRESETS

PRESET_OF = {
    "classify": "fmnist-cpu",
    "lm": "shakespeare-cpu",
    "dino": "dino-fmnist-cpu",
    "mid": "nanochat-mid",
    "sft": "chat-cpu",
}


def _run_cli(argv: list[str], capsys) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    return code, capsys.readouterr().err, time.perf_counter() - start


def _assert_one_line_failure(code: int, err: str, seconds: float, *, names: str | None = None) -> None:
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]
    assert code not in (0, None), err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("lapheads"), lines[0]
    assert seconds < 30
    if names is not None:
        assert names in lines[0], lines[0]


# ----------------------------------------------------------------------------------------------------------------
# Every config field of every task, with values outside its type or domain


def _bad_values(annotation: typing.Any, domain) -> list[str]:
    kinds = [t for t in _options(annotation) if t is not type(None)]
    base = typing.get_origin(kinds[0]) or kinds[0]
    if base is bool:
        return ["maybe"]
    if base in (int, float):
        values = ["abc"] + (["1.5"] if base is int else ["nan", "inf"])
        candidates = ["0", "-1", "-0.001", "1", "1.5"] if base is float else ["0", "-1", "-2"]
        rejected = [c for c in candidates if domain is not None and not domain.test(base(c))]
        return values + rejected[:2]
    if base is str and domain is not None:
        return ["bogus-value"]
    if base is dict:
        return ["[1, 2]", "{not json"]
    if base is list:
        return ["0.9,0.1"]  # a range whose low end is above its high end
    return []


def _field_cases() -> list[tuple[str, str, str]]:
    cases = []
    for task, cls in CONFIG_TYPES.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            for value in _bad_values(hints[field.name], field.metadata.get("domain")):
                cases.append((task, field.name, value))
    return cases


FIELD_CASES = _field_cases()


def test_the_table_is_large():
    assert len(FIELD_CASES) >= 100


@pytest.mark.parametrize("task,field,value", FIELD_CASES, ids=[f"{t}-{f}={v}" for t, f, v in FIELD_CASES])
def test_every_field_rejects_values_outside_its_domain(task, field, value, tmp_path, capsys):
    out = tmp_path / "run"
    flag = "--" + field.replace("_", "-")
    code, err, seconds = _run_cli(["train", task, "--preset", PRESET_OF[task], "--out", str(out), flag, value], capsys)
    _assert_one_line_failure(code, err, seconds, names=flag)
    assert not out.exists()  # validated before anything is written


# ----------------------------------------------------------------------------------------------------------------
# The CLI beyond single fields


@pytest.fixture
def tiny_preset(tiny_config, tmp_path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(dataclasses.asdict(tiny_config)))
    return path


def _cli_cases(tmp: Path, preset: Path) -> list[tuple[str, list[str], str | None]]:
    """(id, argv, a word the error line must contain). Files the cases need are written here."""
    a_file = tmp / "a_file"
    a_file.write_text("x")
    not_json = tmp / "broken.json"
    not_json.write_text("{lr: 1")
    a_list = tmp / "list.json"
    a_list.write_text("[1, 2]")
    unknown_key = tmp / "unknown.json"
    unknown_key.write_text('{"learning_rate": 0.1}')
    wrong_type = tmp / "wrong.json"
    wrong_type.write_text('{"lr": "abc"}')
    out = str(tmp / "out")
    train = ["train", "classify", "--preset", str(preset), "--out"]
    return [
        ("unknown-preset", ["train", "classify", "--preset", "nope", "--out", out], "nope"),
        ("lm-preset-for-classify", ["train", "classify", "--preset", "shakespeare-cpu", "--out", out], None),
        ("preset-not-json", ["train", "classify", "--preset", str(not_json), "--out", out], "broken.json"),
        ("preset-a-list", ["train", "classify", "--preset", str(a_list), "--out", out], "JSON object"),
        ("preset-unknown-key", ["train", "classify", "--preset", str(unknown_key), "--out", out], "learning_rate"),
        ("preset-wrong-type", ["train", "classify", "--preset", str(wrong_type), "--out", out], "--lr"),
        ("no-preset", ["train", "classify", "--out", out], "--preset"),
        ("no-task", ["train"], None),
        ("unknown-task", ["train", "segment", "--preset", "x"], "segment"),
        ("unknown-option", [*train, out, "--learning-rate", "1"], "--learning-rate"),
        ("option-without-value", [*train, out, "--lr"], "--lr"),
        ("stray-argument", [*train, out, "stray"], "stray"),
        ("head-spec-words", [*train, out, "--laplacian-heads", "two"], "two"),
        ("head-spec-negative", [*train, out, "--laplacian-heads", "-1"], "-1"),
        ("head-spec-too-many", [*train, out, "--laplacian-heads", "3"], "3"),
        ("head-spec-wrong-layers", [*train, out, "--laplacian-heads", "1,1,1"], "3 entries"),
        ("out-is-a-file", [*train, str(a_file)], "a_file"),
        ("data-root-is-a-file", [*train, out, "--data-root", str(a_file)], "a_file"),
        ("data-root-missing", [*train, out, "--data-root", str(tmp / "nowhere")], "nowhere"),
        ("micro-batch-not-dividing", [*train, out, "--micro-batch", "5"], "--micro-batch"),
        ("min-lr-above-lr", [*train, out, "--min-lr", "1"], "--min-lr"),
        ("unknown-optimizer", [*train, out, "--optimizer", "adamzz"], "adamzz"),
        ("unknown-model", [*train, out, "--model", "resnet_nope"], "resnet_nope"),
        ("image-size-not-patch-multiple", [*train, out, "--img-size", "30"], "img_size=30"),
        ("batch-larger-than-data", [*train, out, "--batch-size", "4096"], "4096"),
        ("resume-without-out", ["train", "classify", "--resume"], "--out"),
        ("resume-empty-dir", ["train", "classify", "--out", str(tmp), "--resume"], "no config.json"),
        (
            "lm-warmup-plus-warmdown",
            ["train", "lm", "--preset", "shakespeare-cpu", "--out", out, "--warmup-ratio", "0.9"],
            "--warmdown-ratio",
        ),
        (
            "lm-batch-not-multiple",
            ["train", "lm", "--preset", "shakespeare-cpu", "--out", out, "--total-batch-size", "1000"],
            "--total-batch-size",
        ),
        (
            "lm-data-root-file",
            ["train", "lm", "--preset", "shakespeare-cpu", "--out", out, "--data-root", str(a_file)],
            "a_file",
        ),
        (
            "dino-scale-range",
            ["train", "dino", "--preset", "dino-fmnist-cpu", "--out", out, "--global-scale", "0.5,2"],
            "--global-scale",
        ),
        ("eval-no-run", ["eval", "classify", str(tmp / "nowhere")], "nowhere"),
        ("eval-a-file", ["eval", "lm", str(a_file)], None),
        ("eval-two-runs", ["eval", "classify", out, out], "one RUN_DIR"),
        ("eval-dino-no-run", ["eval", "dino"], "needs a RUN_DIR"),
        ("eval-lm-no-run", ["eval", "lm"], "--nanochat"),
        ("generate-no-model", ["generate"], "RUN_DIR or --nanochat"),
        ("analyze-no-run-at-all", ["analyze"], "at least one RUN_DIR"),
        ("eval-unknown-lm-task", ["eval", "lm", str(tmp), "--benchmarks", "nope"], None),
        ("analyze-no-run", ["analyze", str(tmp / "nowhere")], "nowhere"),
        ("analyze-max-tokens", ["analyze", str(tmp), "--max-tokens", "1"], "--max-tokens"),
        ("sweep-bad-seeds", ["sweep", "fmnist-cpu", "--laplacian-heads", "0,1", "--seeds", "a,b"], None),
        ("sweep-unknown-preset", ["sweep", "nope", "--laplacian-heads", "0", "--seeds", "0"], "nope"),
        ("sweep-bad-spec", ["sweep", "fmnist-cpu", "--laplacian-heads", "0,9", "--seeds", "0", "--out", out], "9"),
        ("report-no-sweep", ["report", str(tmp / "nowhere")], "nowhere"),
        ("data-prepare-unknown", ["data", "prepare", "imagenet"], "imagenet"),
        ("data-fetch-unknown", ["data", "fetch", "cifar10"], "cifar10"),
        ("data-unknown-action", ["data", "destroy"], "destroy"),
        ("unknown-command", ["nope"], "nope"),
    ]


def test_cli_cases(tmp_path, tiny_preset, capsys):
    cases = _cli_cases(tmp_path, tiny_preset)
    for case_id, argv, word in cases:
        code, err, seconds = _run_cli(argv, capsys)
        try:
            _assert_one_line_failure(code, err, seconds, names=word)
        except AssertionError as failure:
            raise AssertionError(f"case {case_id}: {failure}") from None
        assert not (tmp_path / "out" / "config.json").exists(), case_id
    assert len(cases) >= 40


def test_a_corrected_rerun_after_bad_input_runs(tmp_path, tiny_preset, capsys):
    out = str(tmp_path / "run")
    for bad in (["--laplacian-heads", "1,1,1"], ["--batch-size", "-5"], ["--img-size", "30"]):
        code, err, seconds = _run_cli(["train", "classify", "--preset", str(tiny_preset), "--out", out, *bad], capsys)
        _assert_one_line_failure(code, err, seconds)
    code, _, _ = _run_cli(
        ["train", "classify", "--preset", str(tiny_preset), "--out", out, "--epochs", "0.125"], capsys
    )
    assert code == 0 and (tmp_path / "run" / "checkpoints" / "latest").is_file()


# ----------------------------------------------------------------------------------------------------------------
# Run directories that were damaged


def _finished_run(tiny_preset: Path, out: Path, capsys) -> None:
    code, err, _ = _run_cli(
        ["train", "classify", "--preset", str(tiny_preset), "--out", str(out), "--epochs", "0.125"], capsys
    )
    assert code == 0, err


def test_damaged_run_directories(tmp_path, tiny_preset, capsys):
    run = tmp_path / "run"
    _finished_run(tiny_preset, run, capsys)
    latest = run / "checkpoints" / "latest"
    good = latest.read_text()
    damages = {
        "latest-outside": lambda: latest.write_text("../../x\n"),
        "latest-missing-folder": lambda: latest.write_text("step-99999999\n"),
        "config-corrupt": lambda: (run / "config.json").write_text("{"),
        "config-a-list": lambda: (run / "config.json").write_text("[1, 2]"),
        "config-null": lambda: (run / "config.json").write_text("null"),
        "config-not-utf8": lambda: (run / "config.json").write_bytes(b'{"task": "\xff"}'),
        "config-unknown-model-kwarg": lambda: (run / "config.json").write_text(
            json.dumps(
                {
                    **json.loads(saved_config),
                    "model": {"factory": "vit", "kwargs": {"name": "vit_fmnist_patch4", "nope": 1}},
                }
            )
        ),
        "config-unknown-factory": lambda: (run / "config.json").write_text(
            json.dumps({**json.loads(saved_config), "model": {"factory": "rnn", "kwargs": {}}})
        ),
        "weights-not-safetensors": lambda: (run / "checkpoints" / good.strip() / "model.safetensors").write_bytes(
            pickle.dumps({"x": 1})
        ),
    }
    saved_config = (run / "config.json").read_text()

    def _with_model(factory: str, kwargs: dict) -> None:
        record = {**json.loads(saved_config), "model": {"factory": factory, "kwargs": kwargs}}
        (run / "config.json").write_text(json.dumps(record))

    saved_weights = (run / "checkpoints" / good.strip() / "model.safetensors").read_bytes()
    for name, damage in damages.items():
        damage()
        code, err, seconds = _run_cli(["eval", "classify", str(run)], capsys)
        try:
            _assert_one_line_failure(code, err, seconds)
        except AssertionError as failure:
            raise AssertionError(f"case {name}: {failure}") from None
        latest.write_text(good)
        (run / "config.json").write_text(saved_config)
        (run / "checkpoints" / good.strip() / "model.safetensors").write_bytes(saved_weights)
    code, _, _ = _run_cli(["eval", "classify", str(run)], capsys)
    assert code == 0


# ----------------------------------------------------------------------------------------------------------------
# The Python API


def _api_cases():
    """The package's constructors and parsers (the op's own table, on both its paths, is
    tests/red_team/test_op_api.py)."""
    return [
        ("spec-string", lambda: lapheads.parse_heads("a,b", [4, 4]), "a,b"),
        ("spec-layers", lambda: lapheads.parse_heads([1, 1, 1], [4, 4]), "3 entries"),
        ("spec-kind-unknown", lambda: lapheads.parse_heads("sharpen:1", [4, 4]), "sharpen"),
        ("spec-value", lambda: lapheads.LayerHeads(("laplacian", "sharpen")), "sharpen"),
        (
            "spec-kind-gpt",
            lambda: lapheads.GPT(lapheads.GPTConfig(depth=2, vocab_size=10, laplacian_heads="untied:1")),
            "untied",
        ),
        ("vit-unknown", lambda: lapheads.create_vit("vit_nope"), "vit_nope"),
        ("gpt-depth", lambda: lapheads.GPT(lapheads.GPTConfig(depth=0, vocab_size=10)), "depth"),
        (
            "gpt-kv-heads",
            lambda: lapheads.GPT(lapheads.GPTConfig(depth=2, vocab_size=10, aspect_ratio=64, head_dim=32, n_kv_head=3)),
            "n_kv_head",
        ),
        (
            "config-type",
            lambda: validate_config(dataclasses.replace(PRESETS["lm"]["shakespeare-cpu"], depth="4")),
            "--depth",
        ),
    ]


@pytest.mark.parametrize("case_id,call,word", _api_cases(), ids=[c[0] for c in _api_cases()])
def test_python_api_errors_are_lapheads_errors_naming_the_value(case_id, call, word):
    with pytest.raises(LapheadsError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and word in message, message


# ----------------------------------------------------------------------------------------------------------------
# Numeric fields under hypothesis: any value is either accepted or a ConfigError naming the field


NUMERIC = [
    (task, f.name)
    for task, cls in CONFIG_TYPES.items()
    for f in dataclasses.fields(cls)
    if typing.get_type_hints(cls)[f.name] in (int, float, int | None, float | None)
]
ODD_VALUES = st.one_of(
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 0.0, -0.0, 1e308, "3", None, True, [1]]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(NUMERIC), ODD_VALUES)
def test_numeric_fields_accept_or_name_the_field(field, value):
    task, name = field
    base = next(iter(PRESETS[task].values()))
    config = dataclasses.replace(base, **{name: value})
    try:
        validate_config(config)
    except ConfigError as err:
        assert "--" + name.replace("_", "-") in str(err) or "--" in str(err)
        assert "\n" not in str(err)
        return
    assert value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value))
