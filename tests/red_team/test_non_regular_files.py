"""Issue 76 (red team, medium): a FIFO or /dev/zero given as a plan, a record, a report's stats.json or a recipe
blocked forever or exhausted memory. Every place lapheads reads such a file refuses what is not a regular file
(also behind a link) and a file past its size bound, in one line; an alarm turns a regression into a failure,
not a hung suite."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from lapheads.cli import main
from lapheads.errors import LapheadsError
from lapheads.io import read_regular_bytes
from lapheads.runs.records import read_record
from lapheads.study.records import load_plan


def _fifo(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    os.mkfifo(path)
    return path


def _zero_link(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.symlink_to("/dev/zero")
    return path


def _folder(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


MAKERS = {"FIFO": _fifo, "link to /dev/zero": _zero_link, "folder": _folder}


@pytest.fixture(autouse=True)
def _alarm():
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a read blocked: the file was not refused"))
    signal.alarm(20)
    yield
    signal.alarm(0)


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_a_plan_or_record_that_is_not_a_regular_file_is_refused_in_one_line(kind, tmp_path):
    with pytest.raises(LapheadsError, match="not a regular file") as plan:
        load_plan(MAKERS[kind](tmp_path, "plan.json"))
    with pytest.raises(LapheadsError, match="not a regular file") as record:
        read_record(MAKERS[kind](tmp_path, "L0-s0.json"))
    assert "\n" not in str(plan.value) and "\n" not in str(record.value)


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_report_and_across_refuse_a_stats_json_that_is_not_a_regular_file(kind, tmp_path, capsys):
    stats = MAKERS[kind](tmp_path, "stats.json")
    assert main(["report", str(stats)]) == 2
    assert main(["across", f"1x={stats}", f"2x={stats}", "--reference", "1x", "--arm", "3"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 2 and all(line.startswith("lapheads ") for line in errors), errors  # one line each
    assert "not a regular file" in errors[1]


def test_a_file_past_the_bound_is_refused_after_reading_no_more_than_the_bound(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2048)
    with pytest.raises(OSError, match="holds more than 1,024 bytes"):
        read_regular_bytes(big, limit=1024)
    assert read_regular_bytes(big, limit=4096) == b" " * 2048
