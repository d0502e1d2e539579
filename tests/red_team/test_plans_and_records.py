"""Red team, turn 5 (issue 60): a pre-registered plan that cannot be bent and records that cannot lie. Each trial
here was a wrong result or a data loss on main before; each is now a one-line refusal, or the plan's own value used.
The records are the committed patch-4 study's (docs/reproduction/patch4/cells), copied and then tampered with."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest

from lapheads.errors import InputError, LapheadsError
from lapheads.runs.records import RecordError, load_records, read_record
from lapheads.study.records import load_plan
from lapheads.study.recordset import RecordSet

PATCH4 = Path(__file__).resolve().parents[2] / "docs" / "reproduction" / "patch4" / "cells"
DECOMPOSITION = PATCH4.parent.parent / "decomposition" / "cells"
PLAN = json.loads((PATCH4 / "plan.json").read_text())


def _plan(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**copy.deepcopy(PLAN), **changes}))
    return path


BAD_PLANS = {
    "a misspelt primary": ({"primary": "test top1 (%)"}, "primary 'test top1 (%)' is not a row of a classify report"),
    "a primary with a word dropped": (
        {"primary": "within-sequence fraction (after final norm)"},
        "is not a row of a classify report",
    ),
    "an unknown family label": ({"family": ["NC1 (after the final norm)"]}, "family 'NC1 (after the final norm)'"),
    "an unknown margin label": ({"margins": {"top-1": 0.5}}, "margins 'top-1'"),
    "opposite contrasts of one pair": (
        {
            "contrasts": [
                {"arm": "3", "baseline": "0", "direction": "paper"},
                {"arm": "0", "baseline": "3", "direction": "reverse"},
            ]
        },
        "are contrasted more than once",
    ),
    "an arm against itself": (
        {"contrasts": [{"arm": "3", "baseline": "3", "direction": "paper"}]},
        "a contrast of arm '3' with itself",
    ),
    "a repeated seed": ({"seeds": [0, 0, 1]}, "repeat a seed"),
    "a fractional seed": ({"seeds": [0, 1.5]}, "allowed: integers >= 0"),
    "a margin of -1": ({"margins": {"test top-1 (%)": -1}}, "margin -1"),
    "a margin of 0": ({"margins": {"test top-1 (%)": 0}}, "margin 0"),
    "a NaN margin": ({"margins": {"test top-1 (%)": math.nan}}, "margin nan"),
    "a repeated arm": ({"arms": ["0", "3", "3"]}, "distinct head specs"),
    "an alpha of 1": ({"alpha": 1.0}, "alpha 1.0"),
    "an unknown task": ({"task": "regression"}, "task 'regression'"),
    # issue 76 (red team, low): fields of the wrong type raised TypeErrors or were accepted
    "contrasts null": ({"contrasts": None}, "contrasts None; allowed: a list of objects"),
    "family null": ({"family": None}, "family None; allowed: a list of strings"),
    "notes a number": ({"notes": 5}, "notes 5; allowed: a string"),
    "study a list": ({"study": ["x"]}, "study ['x']; allowed: a string"),
    "stopping null": ({"stopping": None}, "stopping None; allowed: a string"),
    "alpha true": ({"alpha": True}, "alpha True; allowed: a number"),
    "a margin of 1e308": ({"margins": {"test top-1 (%)": 1e308}}, "margin 1e+308"),
    "a contrast of numbers": ({"contrasts": [{"arm": 3, "baseline": 0, "direction": "paper"}]}, "strings"),
}


@pytest.mark.parametrize("name", sorted(BAD_PLANS))
def test_a_bent_plan_is_refused_when_it_is_read(name, tmp_path):
    changes, words = BAD_PLANS[name]
    with pytest.raises(RecordError) as refused:
        load_plan(_plan(tmp_path, **changes))
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_every_committed_plan_is_well_formed():
    for path in sorted(PATCH4.parents[1].glob("**/plan.json")):
        load_plan(path)


def test_the_plans_alpha_is_the_alpha_every_row_faces():
    from lapheads.study.report import summarize
    from lapheads.study.verdicts import apply_rule

    def judged(alpha):
        gains = [0.3, 0.1, 0.5, 0.05, 0.4, 0.2]  # paired t p ~ 0.014
        rows = summarize(
            {"0": {s: 85.0 + 0.1 * s for s in range(6)}, "3": {s: 85.0 + 0.1 * s + g for s, g in enumerate(gains)}}
        )
        rule = apply_rule({"test top-1 (%)": rows}, {}, {"test top-1 (%)": +1}, alpha=alpha)
        return rule, rows["3"]

    rule, row = judged(0.05)
    assert 0.01 < row.paired["p"] < 0.05 and row.verdict == "held" and rule["alpha"] == 0.05
    rule, row = judged(0.01)  # the same data under a plan's stricter alpha: no longer held
    assert rule["alpha"] == 0.01 and row.judgement.alpha == 0.01 and row.verdict.startswith("not detected")


def _records(tmp_path: Path) -> Path:
    folder = tmp_path / "cells"
    shutil.copytree(PATCH4, folder, ignore=shutil.ignore_patterns("report"))
    return folder


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _as_seed(data: dict, seed, name: str | None = None) -> None:
    data["cell"]["seed"] = seed
    data["cell"]["name"] = name or f"L0-s{seed}"
    data["cell"]["config"]["seed"] = seed
    data["config"]["config"]["seed"] = seed


TAMPERED = {
    "a record's seed changed, not its config": (
        lambda folder: _edit(folder / "L0-s5.json", lambda d: d["cell"].update(seed=6, name="L0-s6")),
        "cell seed 6, trained with seed 5",
    ),
    "a k = 1 record relabelled k = 0": (
        lambda folder: _edit(folder / "L3-s5.json", lambda d: d["cell"].update(spec="0", name="L0-s5")),
        "cell arm '0', trained with laplacian_heads '3'",
    ),
    "a seed of 1.5": (
        lambda folder: _edit(folder / "L0-s1.json", lambda d: _as_seed(d, 1.5, "L0-s1.5")),
        "cell seed 1.5",
    ),
    "a record under another file name": (
        lambda folder: (folder / "L0-s5.json").rename(folder / "L0-s9.json"),
        "holds the record of cell L0-s5",
    ),
}


@pytest.mark.parametrize("name", sorted(TAMPERED))
def test_a_record_that_disagrees_with_the_config_that_trained_it_is_refused(name, tmp_path):
    tamper, words = TAMPERED[name]
    folder = _records(tmp_path)
    tamper(folder)
    with pytest.raises(RecordError) as refused:
        load_records(folder)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_records_copied_as_new_seeds_do_not_count_as_new_seeds(tmp_path):
    """The red team's trial: three copies moved a primary from p 0.044 to 0.008."""
    folder = _records(tmp_path)
    for arm in ("0", "3"):
        data = json.loads((folder / f"L{arm}-s0.json").read_text())
        _as_seed(data, 7, f"L{arm}-s7")  # a seed the plan has: only the copy's identical log gives it away
        (folder / f"L{arm}-s7.json").write_text(json.dumps(data))
    with pytest.raises(RecordError, match=r"holds the same training log as L0-s0.json \(cell L0-s7 vs L0-s0\)"):
        load_records(folder)


def test_an_arm_the_plan_does_not_have_is_not_taken_in(tmp_path):
    folder = _records(tmp_path)
    plan = json.loads((folder / "plan.json").read_text())
    plan["arms"] = ["0"]
    plan["contrasts"] = []
    (folder / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(RecordError, match=r"L3-s0 \(classify\), which the plan in .* does not have"):
        RecordSet.from_folder(folder)


def test_the_committed_records_pass_every_check():
    for folder in (PATCH4, DECOMPOSITION):
        assert RecordSet.from_folder(folder).cells and all(read_record(r.path) for r in load_records(folder))


def test_a_report_cannot_change_the_plans_primary(tmp_path):
    """`report --no-geometry` on a plan whose primary is a geometry row used to make test top-1 the primary."""
    from lapheads.study.report import write_report

    folder = tmp_path / "cells"
    shutil.copytree(DECOMPOSITION, folder, ignore=shutil.ignore_patterns("report"))
    with pytest.raises(LapheadsError, match="the plan names 'within-sequence fraction .after the final norm.'"):
        write_report(folder, geometry=False)
    assert not (folder / "report" / "stats.json").exists()


def test_a_non_finite_primary_is_refused_not_read_as_no_spread():
    from lapheads.study.records import Plan
    from lapheads.study.report import _judge, summarize

    label = "within-sequence fraction (after the final norm)"
    rows = {label: summarize({"0": {s: 0.8 for s in range(4)}, "3": {0: 0.7, 1: math.nan, 2: 0.7, 3: 0.7}})}
    plan = Plan(**{**PLAN, "primary": label, "margins": {}})
    with pytest.raises(LapheadsError, match=r"the primary 'within-sequence fraction .*' of arm 3 is not finite"):
        _judge(rows, "test top-1 (%)", "0", None, plan)


def _edited_copy(tmp_path, folder, name, edit):
    """A copy of a committed records folder with one record edited by hand (``edit(record_dict)``)."""
    copy = tmp_path / "cells"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("report"))
    record = json.loads((copy / f"{name}.json").read_text())
    edit(record)
    (copy / f"{name}.json").write_text(json.dumps(record))
    return copy


def test_a_percentage_outside_0_to_100_is_refused_not_read(tmp_path):
    """Issue 76 (red team, low): a record whose test top-1 read 150 % was summarised like any other."""
    from lapheads.study.report import write_report

    def to_150(record):
        for entry in record["metrics"]:
            if "eval_top1" in entry:
                entry["eval_top1"] = 150.0

    copy = _edited_copy(tmp_path, PATCH4, "L3-s2", to_150)
    with pytest.raises(LapheadsError, match=r"cell 3 seed 2: test top-1 \(%\) is 150.0; allowed: a percentage"):
        write_report(copy, seeds=[0, 1, 2, 3, 4, 5])


def test_a_record_missing_its_analysis_is_named_not_dropped_without_a_word(tmp_path):
    """Issue 76 (red team, low): a record without its analysis dropped that seed from every geometry row silently."""
    from lapheads.study.report import write_report

    copy = _edited_copy(tmp_path, PATCH4, "L0-s4", lambda record: record.update(analysis=None))
    with pytest.raises(LapheadsError, match=r"1 of 12 cells have no analysis \(L0-s4\)"):
        write_report(copy, seeds=[0, 1, 2, 3, 4, 5])


def test_no_report_writes_through_a_link_in_its_folder(tmp_path):
    from lapheads.study.report import write_report

    folder = _records(tmp_path)
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    (folder / "report").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(InputError, match="is a symbolic link; a report writes only into a folder of its own"):
        write_report(folder, geometry=False)
    (folder / "report").unlink()
    (folder / "report").mkdir()
    (folder / "report" / "stats.json").symlink_to(precious)
    with pytest.raises(InputError, match="stats.json is a symbolic link"):
        write_report(folder, geometry=False)
    assert precious.read_text() == "mine"


@pytest.mark.parametrize("linked", ["lock", "pid"])
def test_a_lock_file_linked_to_a_users_file_is_refused_not_overwritten(linked, tmp_path):
    from lapheads.io import sole_owner

    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    lock = tmp_path / "run" / ".lock"
    lock.parent.mkdir()
    (lock if linked == "lock" else lock.with_name(".lock.pid")).symlink_to(precious)
    with pytest.raises(InputError, match="is a symbolic link; lapheads keeps its lock files itself"):
        with sole_owner(lock, "run folder"):
            pass
    assert precious.read_text() == "mine"


def test_a_plan_with_a_key_given_twice_is_refused(tmp_path):
    """Issue 76: a repeated key was read as its last value, silently: a plan read two ways is no pre-registration."""
    path = _plan(tmp_path)
    text = path.read_text()
    path.write_text(text.replace('"alpha": 0.05', '"alpha": 0.05, "alpha": 0.5', 1))
    assert '"alpha": 0.5' in path.read_text()
    with pytest.raises(RecordError, match="key 'alpha' given more than once"):
        load_plan(path)
