"""Red team, turn 5 (issue 60): a 100,000-deep JSON text in any file lapheads reads (a plan, a record, sweep.json,
a run's config.json, a preset file, a tokenizer's meta, a report's stats.json) or in a JSON argument is refused in
one line, like any malformed JSON, instead of a RecursionError traceback (9 trials, one cause)."""

from __future__ import annotations

import json

import pytest

from lapheads.errors import LapheadsError
from lapheads.io import MAX_JSON_DEPTH, json_depth, json_loads

DEEP = "[" * 100_000 + "]" * 100_000


def _read_plan(path):
    from lapheads.study.records import load_plan

    return load_plan(path)


def _read_record(path):
    from lapheads.runs.records import read_record

    return read_record(path)


def _read_sweep(path):
    from lapheads.runs.sweep import load_sweep

    return load_sweep(path.parent)


def _read_config(path):
    from lapheads.runs import RunDir

    return RunDir(path.parent).read_config()


def _read_preset(path):
    from lapheads.config import load_preset_file

    return load_preset_file(path)


def _read_tokenizer(path):
    from lapheads.data.tokenizers import load_tokenizer

    return load_tokenizer(path.parent)


def _read_stats(path):
    from lapheads.study.report import restate

    return restate(path)


#: (the file's name, how lapheads reads it)
READERS = {
    "plan": ("plan.json", _read_plan),
    "record": ("L0-s0.json", _read_record),
    "sweep.json": ("sweep.json", _read_sweep),
    "config.json": ("config.json", _read_config),
    "preset file": ("preset.json", _read_preset),
    "tokenizer meta": ("lapheads_tokenizer_meta.json", _read_tokenizer),
    "stats.json": ("stats.json", _read_stats),
}


@pytest.mark.parametrize("what", sorted(READERS))
def test_a_100000_deep_file_is_one_line(what, tmp_path):
    name, read = READERS[what]
    if what == "tokenizer meta":
        from lapheads.data.tokenizers import META_FILE

        name = META_FILE
    path = tmp_path / name
    path.write_text(DEEP)
    with pytest.raises(LapheadsError) as refused:
        read(path)
    message = str(refused.value)
    assert "\n" not in message and (str(tmp_path) in message or name in message), message


def test_the_depth_is_counted_without_recursion_and_strings_do_not_count():
    assert json_depth(DEEP) == 100_000
    assert json_depth('{"a": ["[[[[", {"b": "}}\\"]]"}]}') == 3
    with pytest.raises(json.JSONDecodeError, match=f"nested 100000 levels deep; allowed: at most {MAX_JSON_DEPTH}"):
        json_loads(DEEP)
    nested = json.dumps({"a": [[[{"b": 1}]]]})
    assert json_loads(nested) == json.loads(nested)


def test_a_deep_json_argument_is_one_line(capsys, tmp_path):
    from lapheads.cli import main

    code = main(["train", "classify", "--preset", "fmnist-cpu", "--model-kwargs", DEEP, "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err[-1]) < 400 and "nested 100000 levels deep" in err[-1]
