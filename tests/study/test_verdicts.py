"""The verdict rule (lapheads.study.verdicts): each number pinned against scipy, exact enumeration or by hand."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from lapheads.study.report import restate, summarize
from lapheads.study.verdicts import (
    DECLARED_GEOMETRY,
    apply_rule,
    contrast_direction,
    default_margin,
    holm_steps,
    laplacian_count,
    mde,
    sign_count,
    sign_flip_p,
    sign_flip_tost_p,
    tost_gain_p,
)


@pytest.mark.parametrize("df, alpha", [(4, 0.05), (4, 0.05 / 12), (2, 0.05), (9, 0.01), (30, 0.05)])
def test_the_mde_has_exactly_80_percent_power_at_its_alpha(df, alpha):
    se = 0.37
    effect = mde(se, df, alpha)
    critical = stats.t.ppf(1 - alpha / 2, df)
    nc = effect / se
    power = stats.nct.sf(critical, df, nc) + np.nan_to_num(stats.nct.cdf(-critical, df, nc))
    assert power == pytest.approx(0.80, abs=1e-8)


def test_the_mde_grows_as_holm_lowers_the_alpha_and_approaches_the_normal_formula():
    assert mde(1.0, 4, 0.05 / 19) > 1.7 * mde(1.0, 4, 0.05)  # the point: ~15 % power at the old MDE
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.80)
    assert mde(1.0, 10_000, 0.05) == pytest.approx(z, rel=1e-3)
    assert math.isnan(mde(0.0, 4)) and math.isnan(mde(1.0, 0))


@pytest.mark.parametrize("alpha", [1e-20, 1e-300])
def test_an_mde_at_an_alpha_below_float_resolution_is_nan_at_once_not_a_search_that_never_ends(alpha):
    assert math.isnan(mde(0.3, 4, alpha))


def test_at_holms_first_step_the_old_mde_is_detected_far_less_than_80_percent_of_the_time():
    se, df = 1.0, 4
    old = (stats.t.ppf(0.975, df) + stats.t.ppf(0.80, df)) * se  # the raw-test MDE reports used to state
    critical = stats.t.ppf(1 - 0.05 / 19 / 2, df)
    power = stats.nct.sf(critical, df, old / se)
    assert 0.10 < power < 0.20


def test_the_tost_p_is_the_one_sided_t_probability_of_the_gain_below_the_margin():
    # mean 0, se 1, 4 df, margin = the 97.5 % t quantile: p = 0.025 exactly
    margin = stats.t.ppf(0.975, 4)
    assert tost_gain_p(0.0, 1.0, 4, margin, +1) == pytest.approx(0.025)
    # for a metric that improves by falling, a gain is a negative difference
    assert tost_gain_p(0.0, 1.0, 4, margin, -1) == pytest.approx(0.025)
    assert tost_gain_p(margin, 1.0, 4, margin, +1) == pytest.approx(0.5)
    assert math.isnan(tost_gain_p(0.0, 1.0, 4, 0.0, +1))


def _enumerate(d):
    observed = abs(np.mean(d))
    hits = [
        abs(np.mean([x if keep else -x for x, keep in zip(d, signs)])) >= observed - 1e-12
        for signs in itertools.product([True, False], repeat=len(d))
    ]
    return sum(hits) / len(hits)


@pytest.mark.parametrize(
    "d, expected",
    [
        ([1.0, 2.0, 3.0], 0.25),  # every seed one way: only the observed and the mirrored pattern: 2/8
        ([0.5, 0.4, 0.3, 0.6, 0.2], 0.0625),  # 5/5: the floor with 5 pairs, 2/32
        ([1.0, -1.0], 1.0),
    ],
)
def test_the_sign_flip_p_is_exact(d, expected):
    assert sign_flip_p(d) == pytest.approx(expected) == pytest.approx(_enumerate(d))


def test_the_sign_flip_p_matches_brute_force_on_random_differences():
    rng = np.random.default_rng(0)
    for n in (3, 5, 7):
        d = list(rng.normal(0.3, 1.0, n))
        assert sign_flip_p(d) == pytest.approx(_enumerate(d))


def test_sign_counts_follow_the_papers_direction():
    assert sign_count([-0.1, -0.2, 0.1], -1) == "2/3" and sign_count([-0.1, -0.2, 0.1], +1) == "1/3"


def testholm_steps_state_the_alpha_each_row_faces():
    adjusted, faced = holm_steps({"a": 0.01, "b": 0.04, "c": 0.03, "d": math.nan})
    assert faced == pytest.approx({"a": 0.05 / 3, "c": 0.05 / 2, "b": 0.05, "d": math.nan}, nan_ok=True)
    assert adjusted["a"] == pytest.approx(0.03) and adjusted["c"] == pytest.approx(0.06)
    assert adjusted["b"] == pytest.approx(0.06)


def test_the_default_margin_is_the_papers_relative_error_reduction_on_this_baseline():
    # ImageNet 81.45 -> 82.32: 4.69 % of the error rate; FMNIST baseline 85.31: 0.689 points (issue 30)
    assert default_margin("test top-1 (%)", 85.31) == pytest.approx(14.69 * 0.87 / 18.55)
    assert default_margin("test top-1 (%)", 85.31) == pytest.approx(0.689, abs=1e-3)
    assert default_margin("validation bits per byte", 2.0) is None


def _family(effects: dict[str, float], noise=0.1, n=5, seed=0):
    rng = np.random.default_rng(seed)
    values = {"0": {s: 10.0 + rng.normal() for s in range(n)}}
    for spec, effect in effects.items():
        values[spec] = {s: values["0"][s] + effect + noise * rng.normal() for s in range(n)}
    return summarize(values)


def test_the_primary_is_holm_corrected_across_arms_and_the_declared_family_spans_every_arm():
    primary = {"test top-1 (%)": _family({"3": 0.2, "1": 0.0}, noise=0.1)}
    declared = {label: _family({"3": -0.05, "1": -0.05}, noise=0.02) for label in DECLARED_GEOMETRY[:4]}
    secondary = {"token cosine similarity (last block)": _family({"3": 0.1, "1": 0.1}, noise=0.02)}
    claims = {**dict.fromkeys(primary, +1), **dict.fromkeys(declared, -1), "token cosine similarity (last block)": None}
    rule = apply_rule(primary, {**declared, **secondary}, claims)
    top = primary["test top-1 (%)"]["3"]
    assert rule["primary_family_size"] == 2 and top.judgement.role == "primary" and top.verdict == "held"
    assert top.judgement.alpha == 0.025 and top.judgement.p_holm == pytest.approx(min(1.0, 2 * top.paired["p"]))
    assert rule["declared_family_size"] == 4 * 2  # claims x arms
    rows = [rows[s] for rows in declared.values() for s in ("1", "3")]
    assert all(row.judgement.alpha == pytest.approx(0.05 / 8) for row in rows)  # the design alpha: Bonferroni
    assert sorted(row.judgement.holm_alpha for row in rows) == pytest.approx(sorted(0.05 / (8 - i) for i in range(8)))
    first = next(iter(declared.values()))
    differences = [first["1"].values[s] - v for s, v in first["0"].values.items()]
    se = np.std(differences, ddof=1) / math.sqrt(5)
    assert first["1"].judgement.mde_at_alpha == pytest.approx(mde(se, 4, 0.05 / 8))
    assert all(row.verdict == "held" for row in rows)
    assert secondary["token cosine similarity (last block)"]["3"].judgement.role == "secondary"
    assert secondary["token cosine similarity (last block)"]["3"].verdict == "no claim"
    flat = primary["test top-1 (%)"]["1"]
    assert flat.verdict.startswith(("excluded", "not detected", "equivalent"))
    # stats.json's row: the same keys, in the order reports have always written them
    assert list(top.to_json()) == [
        *("n", "mean", "std", "values", "baseline", "paired", "welch", "baseline_mean", "test", "role", "alpha"),
        *("direction", "mde_at_alpha", "permutation_p", "signs", "contrast_claim", "p_holm", "holm_alpha"),
        *("margin", "tost_p", "tost_lower_p", "tost_sign_flip_p", "tost_lower_sign_flip_p", "verdict"),
    ]
    assert "holm_alpha" not in secondary["token cosine similarity (last block)"]["3"].to_json()


def test_the_design_mde_at_alpha_over_m_has_80_percent_power_under_holm_whatever_the_ordering():
    """Simulated: a family of 6 where every effect equals its alpha/m MDE; Holm then rejects each row at least as
    often as Bonferroni does, i.e. with >= 80 % power (the old per-step MDE gave ~40 %)."""
    rng = np.random.default_rng(0)
    n, m, se = 6, 6, 1.0 / math.sqrt(6)
    effect = mde(se, n - 1, 0.05 / m)
    hits = 0
    for _ in range(2000):
        d = effect + rng.normal(size=(m, n))
        p = [2 * stats.t.sf(abs(x.mean() / (x.std(ddof=1) / math.sqrt(n))), n - 1) for x in d]
        adjusted, _ = holm_steps(dict(enumerate(p)))
        hits += adjusted[0] < 0.05
    assert hits / 2000 >= 0.78


def test_directions_follow_the_contrast_not_the_baseline():
    assert contrast_direction("3", "0") == 1 and contrast_direction("0", "0,0,0,3,3,3") == -1
    assert contrast_direction("sum:3", "3") is None and contrast_direction("centring:1", "1") is None
    assert contrast_direction("3,3,3,0,0,0", "0,0,0,3,3,3") is None  # where, not how many
    assert laplacian_count("0,2,2,0") == 4 and laplacian_count("negated:3") is None
    # against a late-only baseline, k = 0's higher within-sequence fraction is the paper's direction, reversed
    rows = summarize(
        {"0,0,0,3,3,3": {s: 0.30 + 0.001 * s for s in range(5)}, "0": {s: 0.36 + 0.002 * s for s in range(5)}},
        "0,0,0,3,3,3",
    )
    apply_rule({"test top-1 (%)": {}}, {DECLARED_GEOMETRY[0]: rows}, {DECLARED_GEOMETRY[0]: -1}, "0,0,0,3,3,3")
    assert rows["0"].verdict == "held" and rows["0"].judgement.contrast_claim == "the paper's direction, reversed"
    # an ablation makes no claim: tested two-sided, read as "differs"
    rows = summarize(
        {"3": {s: 0.30 + 0.001 * s for s in range(5)}, "sum:3": {s: 0.36 + 0.002 * s for s in range(5)}}, "3"
    )
    apply_rule({"test top-1 (%)": {}}, {DECLARED_GEOMETRY[0]: rows}, {DECLARED_GEOMETRY[0]: -1}, "3")
    assert (
        rows["sum:3"].verdict == "differs (higher)" and rows["sum:3"].judgement.contrast_claim == "no claim: contrast"
    )


def test_both_tost_halves_by_t_and_by_exact_sign_flips():
    d = [0.1, -0.05, 0.02, 0.04, -0.03]
    p_upper, p_lower = sign_flip_tost_p(d, 1.0, +1)
    assert p_upper == p_lower == 1 / 32  # every shifted difference on one side: the floor 1 / 2^5
    brute = np.mean(
        [
            np.mean(np.array(signs) * (np.array(d) - 0.05)) <= np.mean(np.array(d) - 0.05) + 1e-12
            for signs in itertools.product((1, -1), repeat=5)
        ]
    )
    assert sign_flip_tost_p(d, 0.05, +1)[0] == pytest.approx(brute)
    tight = {"test top-1 (%)": _family({"3": 0.0}, noise=0.05)}
    apply_rule(tight, {}, {"test top-1 (%)": +1}, margin=0.5)
    row, base = tight["test top-1 (%)"]["3"], tight["test top-1 (%)"]["0"].values
    differences = [row.values[s] - v for s, v in base.items()]
    se, mean = np.std(differences, ddof=1) / math.sqrt(5), float(np.mean(differences))
    assert row.equivalence.tost_p == pytest.approx(stats.t.cdf((mean - 0.5) / se, 4))
    assert row.equivalence.tost_lower_p == pytest.approx(stats.t.cdf((-mean - 0.5) / se, 4))
    assert row.verdict.startswith("equivalent within +-0.5 (TOST p")
    few = {"test top-1 (%)": _family({"3": 0.0}, noise=0.05, n=4)}  # 4 pairs: the exact floor 1/16 > 0.05
    apply_rule(few, {}, {"test top-1 (%)": +1}, margin=0.5)
    assert "but sign-flip 0.062: a gain >= 0.5 not excluded" in few["test top-1 (%)"]["3"].verdict


def test_a_paper_sized_gain_ruled_out_reads_excluded_and_an_undecided_one_not_detected():
    tight = {"test top-1 (%)": _family({"3": 0.0}, noise=0.05)}
    apply_rule(tight, {}, {"test top-1 (%)": +1}, margin=0.5)
    assert tight["test top-1 (%)"]["3"].verdict.startswith("equivalent within +-0.5 (TOST p")  # both halves
    above = {"test top-1 (%)": _family({"3": -0.45}, noise=0.05)}  # a loss: only a gain is ruled out
    apply_rule(above, {}, {"test top-1 (%)": +1}, margin=0.5)
    assert above["test top-1 (%)"]["3"].verdict.startswith(("excluded: a gain >= 0.5 is ruled out", "opposite"))
    loose = {"test top-1 (%)": _family({"3": 0.0}, noise=2.0)}
    apply_rule(loose, {}, {"test top-1 (%)": +1}, margin=0.5)
    assert loose["test top-1 (%)"]["3"].verdict.startswith("not detected (MDE")


def test_a_declared_row_with_a_plans_margin_gets_both_tost_halves_and_one_without_none():
    label = DECLARED_GEOMETRY[0]
    declared = {label: _family({"3": 0.0}, noise=0.01), DECLARED_GEOMETRY[1]: _family({"3": 0.0}, noise=0.01)}
    rule = apply_rule({"test top-1 (%)": {}}, declared, dict.fromkeys(declared, -1), margins={label: 0.1})
    row = declared[label]["3"]
    differences = [row.values[s] - v for s, v in declared[label]["0"].values.items()]
    se, mean = np.std(differences, ddof=1) / math.sqrt(5), float(np.mean(differences))
    # the claim is a fall: a gain is a negative difference, so "a gain >= margin" is mean <= -margin
    assert row.equivalence.tost_p == pytest.approx(stats.t.cdf((-mean - 0.1) / se, 4))
    assert row.equivalence.tost_lower_p == pytest.approx(stats.t.cdf((mean - 0.1) / se, 4))
    assert row.judgement.role == "declared" and row.verdict.startswith("equivalent within +-0.1 (TOST p")
    assert rule["margin"][label] == 0.1
    assert declared[DECLARED_GEOMETRY[1]]["3"].equivalence is None  # no margin declared: no equivalence test


def test_restating_a_committed_report_prints_the_family_alphas_and_margin():
    text = restate("docs/reproduction/fmnist-10k-converged/stats.json")
    assert "the **declared** family" in text and "(12 tests)" in text and "test top-1 (%): 0.689" in text
    assert text.startswith("Family **declared after the data**") and "| withdrawn |" in text
    top = [line for line in text.splitlines() if line.startswith("| test top-1 (%) | primary | 3 |")][0]
    assert "+0.006 [-0.607, +0.619]" in top and "| 2/5 |" in top
    assert "equivalent within +-0.689 (TOST p 0.018, sign-flip 0.031)" in top  # both halves, both ways


def test_a_plans_secondary_headline_keeps_its_margins_equivalence_test():
    """A plan whose primary is geometry: test top-1 is secondary, yet a paper-sized gain can still be excluded by
    both TOST halves (the decomposition plan's "top-1 secondary, with the rule's default margin")."""
    fraction = {"within-sequence fraction (after the final norm)": _family({"3": -0.08}, noise=0.01)}
    values = {"0": {s: 85.0 + 0.1 * s for s in range(6)}}
    values["3"] = {s: v + (0.05 if s % 2 else -0.05) for s, v in values["0"].items()}
    top1 = {"test top-1 (%)": summarize(values)}
    claims = {"within-sequence fraction (after the final norm)": -1, "test top-1 (%)": +1}
    rule = apply_rule(fraction, top1, claims, family=[])
    row = top1["test top-1 (%)"]["3"]
    margin = default_margin("test top-1 (%)", float(np.mean(list(values["0"].values()))))
    assert row.judgement.role == "secondary" and row.equivalence.margin == pytest.approx(margin)
    assert rule["margin"]["test top-1 (%)"] == pytest.approx(margin)
    assert row.verdict.startswith("equivalent within") and row.verdict.endswith("(uncorrected)")


def test_a_margin_fixed_before_the_data_outranks_the_papers_default():
    """A plan's margins (the patch-4 plan fixed 0.676 from its pilot) are the ones tested, primary or secondary;
    the paper's default on the study's own baseline (0.698 there) would move the bar after the data."""
    values = {"0": {s: 85.0 + 0.1 * s for s in range(6)}}
    values["3"] = {s: v + (0.05 if s % 2 else -0.05) for s, v in values["0"].items()}
    label = "test top-1 (%)"
    for as_primary in (True, False):
        top1 = {label: summarize(values)}
        fraction = {"within-sequence fraction (after the final norm)": _family({"3": -0.08}, noise=0.01)}
        primary, others = (top1, fraction) if as_primary else (fraction, top1)
        claims = {label: +1, "within-sequence fraction (after the final norm)": -1}
        rule = apply_rule(primary, others, claims, family=[], margins={label: 0.45})
        assert top1[label]["3"].equivalence.margin == 0.45 and rule["margin"][label] == 0.45
        assert "+-0.45" in top1[label]["3"].verdict
    top1 = {label: summarize(values)}
    apply_rule(top1, {}, {label: +1}, margin=0.25, margins={label: 0.45})  # --margin, given, wins
    assert top1[label]["3"].equivalence.margin == 0.25
