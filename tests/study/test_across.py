"""``lapheads across``: the fair-tuning plans' cross-recipe reading, pinned against scipy and by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from scipy import stats

from lapheads.cli import main
from lapheads.errors import SweepError
from lapheads.study.across import load_recipe, read_across, render, write_across

TOP1 = "test top-1 (%)"
DECOMPOSITION = "docs/reproduction/decomposition/cells/report/stats.json"


def _stats(tmp_path, name: str, values: dict[str, dict[int, float]], metric: str = TOP1) -> str:
    rows = {arm: {"n": len(v), "values": {str(s): x for s, x in v.items()}} for arm, v in values.items()}
    path = tmp_path / name / "stats.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"baseline": "0", "metrics": {metric: rows}}))
    return str(path)


def _reading(tmp_path, recipes: dict[str, dict[str, dict[int, float]]], reference="1x", alpha=0.025, higher=True):
    loaded = [load_recipe(label, _stats(tmp_path, label, v), TOP1) for label, v in recipes.items()]
    return read_across(loaded, reference, "3", "0", alpha, higher, TOP1)


BASE = {0: 85.0, 1: 84.6, 2: 85.1, 3: 84.9, 4: 84.9}


def test_means_use_only_the_seeds_every_recipe_has_and_the_one_sided_p_is_scipys(tmp_path):
    one_x = {"0": {**BASE, 5: 99.0}, "3": {0: 85.2, 1: 85.0, 2: 85.3, 3: 85.1, 4: 85.0, 5: 0.0}}  # seed 5: 1x only
    half = {"0": {s: v - 0.5 for s, v in BASE.items()}, "3": {0: 85.6, 1: 84.9, 2: 85.5, 3: 85.4, 4: 85.0}}
    r = _reading(tmp_path, {"1x": one_x, "0.5x": half})
    assert r.seeds == [0, 1, 2, 3, 4]
    assert r.means["0"]["1x"] == pytest.approx(sum(BASE.values()) / 5)
    assert r.means["3"]["0.5x"] == pytest.approx((85.6 + 84.9 + 85.5 + 85.4 + 85.0) / 5)
    (test,) = r.tests
    expected = stats.ttest_rel([half["3"][s] for s in range(5)], [BASE[s] for s in range(5)], alternative="greater")
    assert test.recipe == "0.5x" and test.n_pairs == 5 and test.df == 4
    assert test.t == pytest.approx(expected.statistic) and test.p_one_sided == pytest.approx(expected.pvalue)
    assert test.rejects == (expected.pvalue < 0.025)
    (i,) = r.interactions  # seed 5 (1x only) enters no interaction row either
    assert i.reference_gap.n_pairs == 5 and i.baseline_lift.n_pairs == 5
    assert i.reference_gap.mean_difference == pytest.approx((0.2 + 0.4 + 0.2 + 0.2 + 0.1) / 5)


def test_a_clear_gain_at_another_recipe_reads_handicapped(tmp_path):
    twice = {"0": BASE, "3": {s: v + 1.0 + 0.05 * s for s, v in BASE.items()}}
    r = _reading(tmp_path, {"1x": {"0": BASE, "3": BASE}, "2x": twice})
    assert r.tests[0].rejects and r.handicapped
    assert "3 at 2x beats 0 at 1x" in r.why
    assert "**Reading: handicapped**" in render(r)


def test_the_arms_best_recipe_moving_away_from_the_baselines_reads_handicapped_without_a_test(tmp_path):
    # k = 3 is best at 2x by a hair (no test rejects), k = 0 best at 1x: the plan's second clause
    one_x = {"0": BASE, "3": {s: v - 0.3 for s, v in BASE.items()}}
    twice = {"0": {s: v - 1 for s, v in BASE.items()}, "3": {0: 84.9, 1: 84.7, 2: 85.0, 3: 84.9, 4: 84.9}}
    r = _reading(tmp_path, {"1x": one_x, "2x": twice})
    assert not r.tests[0].rejects
    assert r.best == {"3": "2x", "0": "1x"} and r.handicapped
    assert "3's best recipe is 2x, 0's is 1x" in r.why


def test_no_gain_anywhere_reads_not_handicapped_and_says_so(tmp_path):
    worse = {"0": {s: v - 0.4 for s, v in BASE.items()}, "3": {s: v - 0.5 + 0.01 * s for s, v in BASE.items()}}
    r = _reading(tmp_path, {"0.5x": worse, "1x": {"0": BASE, "3": BASE}, "2x": worse})
    assert [t.recipe for t in r.tests] == ["0.5x", "2x"] and not r.handicapped
    assert all(t.p_one_sided > 0.5 for t in r.tests)  # the differences point the other way
    assert "not handicapped within the recipes tried" in render(r)


def test_lower_is_better_turns_the_test_around(tmp_path):
    loss = {"0": {s: 2.0 + 0.01 * s for s in range(5)}, "3": {s: 1.8 + 0.012 * s for s in range(5)}}
    r = _reading(tmp_path, {"1x": {"0": loss["0"], "3": loss["0"]}, "2x": loss}, higher=False)
    assert r.tests[0].mean_difference < 0 and r.tests[0].rejects and r.handicapped
    assert _reading(tmp_path / "up", {"1x": {"0": loss["0"], "3": loss["0"]}, "2x": loss}).tests[0].p_one_sided > 0.9


def test_revisions_come_from_the_records_beside_a_report_that_predates_them(tmp_path):
    recipe = load_recipe("1x", DECOMPOSITION, TOP1)
    assert {r[:7] for r in recipe.code_revisions} >= {"c6f3dcd", "7492f28"}  # seed 0's cells name c6f3dcd
    copy = tmp_path / "copy" / "stats.json"  # the same numbers in another file (one file twice is refused)
    copy.parent.mkdir()
    copy.write_bytes(Path(DECOMPOSITION).read_bytes())
    reading = read_across([recipe, load_recipe("again", copy, TOP1)], "1x", "3", "0", 0.025, True, TOP1)
    text = render(reading)
    assert "c6f3dcd: L0-s0, L3-s0" in text and "Lsum-3" not in text  # only the cells the tables read


@pytest.mark.parametrize(
    "change, message",
    [
        ({"reference": "3x"}, "--reference '3x'; allowed: one of the recipes"),
        ({"arm": "sum:3"}, "arm 'sum:3' not in"),
        ({"alpha": 0.7}, "--alpha 0.7; allowed"),
        ({"arm": "0"}, "--arm '0' is the baseline"),
    ],
)
def test_bad_requests_are_one_line_errors(tmp_path, change, message):
    recipes = [load_recipe(x, _stats(tmp_path, x, {"0": BASE, "3": BASE}), TOP1) for x in ("1x", "2x")]
    args = {"reference": "1x", "arm": "3", "baseline": "0", "alpha": 0.025, "higher_is_better": True, "metric": TOP1}
    with pytest.raises(SweepError, match=message.replace("(", r"\(")):
        read_across(recipes, **{**args, **change})
    with pytest.raises(SweepError, match="metric 'top-5' not in"):
        load_recipe("1x", recipes[0].source, "top-5")


def test_the_cli_writes_its_folder_and_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    one = _stats(tmp_path, "1x", {"0": BASE, "3": BASE})
    two = _stats(tmp_path, "2x", {"0": BASE, "3": {s: v + 0.1 + 0.01 * s for s, v in BASE.items()}})
    out = tmp_path / "across"
    argv = ["across", f"1x={one}", f"2x={two}", "--reference", "1x", "--arm", "3", "--alpha", "0.025"]
    assert main([*argv, "--out", str(out)]) == 0
    saved = json.loads((out / "across.json").read_text())
    assert saved["written_by"] == "lapheads across" and saved["tests"][0]["recipe"] == "2x"
    assert math.isclose(saved["means"]["3"]["2x"], sum(BASE.values()) / 5 + 0.12)
    assert saved["interactions"][0]["interaction"]["mean_difference"] == pytest.approx(0.12)
    assert main([*argv, "--out", str(out)]) == 0  # its own output: rewritten
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "across.json").write_text('{"mine": true}')
    assert main([*argv, "--out", str(foreign)]) == 2
    assert (foreign / "across.json").read_text() == '{"mine": true}'
    assert "was not written by lapheads across" in capsys.readouterr().err
    assert main(["across", f"1x{one}", f"2x={two}", "--reference", "1x", "--arm", "3"]) == 2
    assert "allowed: LABEL=STATS" in capsys.readouterr().err


def test_write_across_refuses_a_markdown_file_without_its_json(tmp_path):
    varied = {s: v + 0.1 * s for s, v in BASE.items()}
    recipes = [load_recipe(x, _stats(tmp_path, x, {"0": BASE, "3": varied}), TOP1) for x in ("1x", "2x")]
    reading = read_across(recipes, "1x", "3", "0", 0.05, True, TOP1)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "across.md").write_text("notes")
    with pytest.raises(SweepError, match="exists without its across.json"):
        write_across(reading, tmp_path / "out")
    assert (tmp_path / "out" / "across.md").read_text() == "notes"


def test_the_interaction_is_read_beside_the_trigger_and_matches_scipy(tmp_path):
    # both arms gain ~0.5 at 2x and k = 3 leads by ~0.4 at both lrs: the trigger fires, the interaction does not
    one_x = {"0": BASE, "3": {0: 85.5, 1: 84.9, 2: 85.6, 3: 85.2, 4: 85.3}}
    twice = {"0": {0: 85.4, 1: 85.2, 2: 85.5, 3: 85.5, 4: 85.3}, "3": {0: 85.9, 1: 85.5, 2: 86.0, 3: 85.9, 4: 85.8}}
    r = _reading(tmp_path, {"1x": one_x, "2x": twice})
    assert r.handicapped  # the plans' trigger: 3 at 2x beats 0 at 1x
    (i,) = r.interactions
    gap = [twice["3"][s] - twice["0"][s] for s in range(5)]
    reference_gap = [one_x["3"][s] - one_x["0"][s] for s in range(5)]
    expected = stats.ttest_rel(gap, reference_gap)
    assert i.interaction.p == pytest.approx(expected.pvalue) and not i.detected
    assert i.interaction.mean_difference == pytest.approx(sum(gap) / 5 - sum(reference_gap) / 5)
    interval = expected.confidence_interval(0.95)
    assert (i.interaction.ci_low, i.interaction.ci_high) == pytest.approx((interval.low, interval.high))
    assert i.baseline_lift.moved_up == 5 and i.baseline_lift.ci_low > 0  # the lr change lifts k = 0 too
    assert i.reference_gap.mean_difference == pytest.approx(sum(reference_gap) / 5) and i.reference_gap.n_pairs == 5
    text = render(r)
    assert "**Reading: handicapped**" in text and "interaction is not detected at any recipe" in text
    assert "suits both arms better" in text


def test_an_interaction_of_the_arms_own_is_detected(tmp_path):
    twice = {"0": BASE, "3": {s: v + 1.0 + 0.05 * s for s, v in BASE.items()}}
    one_x = {"0": BASE, "3": {s: v + 0.02 * s for s, v in BASE.items()}}
    r = _reading(tmp_path, {"1x": one_x, "2x": twice})
    assert r.interactions[0].detected and "interaction is detected at 2x" in r.specific


@pytest.mark.parametrize(
    "values, message",
    [
        ({"0": 85.0, "1": float("nan")}, "seed 1: value nan"),
        ({"0": 85.0, "1": float("inf")}, "seed 1: value inf"),
        ({"0": 85.0, "1": "85.1"}, "seed 1: value '85.1'"),
        ({"0": 85.0, "1": True}, "seed 1: value True"),
        ({"0": 85.0, "00": 85.1}, "seed key '00'"),
        ({"0": 85.0, "-1": 85.1}, "seed key '-1'"),
    ],
)
def test_a_value_that_is_no_measurement_is_refused_in_one_line(tmp_path, values, message):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"metrics": {TOP1: {"0": {"values": values}, "3": {"values": {"0": 1.0}}}}}))
    with pytest.raises(SweepError, match=message.replace("(", r"\(")):
        load_recipe("1x", path, TOP1)


def test_one_report_under_two_labels_or_through_a_link_is_refused(tmp_path):
    source = _stats(tmp_path, "1x", {"0": BASE, "3": {s: v + 0.1 * s for s, v in BASE.items()}})
    link = tmp_path / "link.json"
    link.symlink_to(source)
    for other in (source, link):
        recipes = [load_recipe("1x", source, TOP1), load_recipe("2x", other, TOP1)]
        with pytest.raises(SweepError, match="is the report 1x already names"):
            read_across(recipes, "1x", "3", "0", 0.025, True, TOP1)


def test_a_gain_with_no_spread_is_refused_not_read_as_an_answer(tmp_path):
    recipes = [
        load_recipe("1x", _stats(tmp_path, "1x", {"0": BASE, "3": BASE}), TOP1),
        load_recipe("2x", _stats(tmp_path, "2x", {"0": BASE, "3": {s: v + 0.3 for s, v in BASE.items()}}), TOP1),
    ]
    with pytest.raises(SweepError, match="have no spread; no t-test exists"):
        read_across(recipes, "1x", "3", "0", 0.025, True, TOP1)


@pytest.mark.parametrize("alpha", [1e-300, 1e-20, 0.0])
def test_an_alpha_below_the_floor_is_refused_at_once(tmp_path, alpha):
    recipes = [load_recipe(x, _stats(tmp_path, x, {"0": BASE, "3": BASE}), TOP1) for x in ("1x", "2x")]
    with pytest.raises(SweepError, match=f"--alpha {alpha}; allowed: a level in"):
        read_across(recipes, "1x", "3", "0", alpha, True, TOP1)
