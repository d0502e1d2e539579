"""The markdown rows of a sweep report: each statistic with its interval, MDE, verdict and sign count."""

from __future__ import annotations

import math
from typing import Any, Callable

from lapheads.study.comparison import Comparison, PairedTest
from lapheads.study.report.statistics import AGAINST_BASELINE, FitRow, LateChange, settled_from
from lapheads.study.verdicts import RuleRecord


def _fmt(x: float, spec: str) -> str:
    """A number for a table cell; an undefined one (a statistic of fewer than 2 seeds) as a dash, not "nan"."""
    return "–" if math.isnan(x) else format(x, spec)


def _mean_std(row: Comparison, spec: str) -> str:
    return format(row.mean, spec) + ("" if math.isnan(row.std) else f" ± {row.std:.2g}")


#: an interval that holds 0 is not evidence of a plateau: "not detected", never "no"
_IMPROVING = {True: "yes", False: "not detected"}


def _with_interval(row: PairedTest) -> str:
    """A ``paired_test`` row as "+mean [low, high]" ("+mean" alone where there is no interval: one pair)."""
    interval = "" if math.isnan(row["ci_low"]) else f" [{row['ci_low']:+.3g}, {row['ci_high']:+.3g}]"
    return f"{row['mean_difference']:+.3g}{interval}"


def late_change_lines(label: str, changes: dict[str, LateChange]) -> list[str]:
    lines = [
        "",
        f"{label}, change over the last quarter of training (each seed's last evaluation minus its evaluation at "
        "the quarter's start; mean [95% CI] over seeds): a model still improving there is not converged; 'not "
        "detected' (the interval holds 0) does not say it is.",
        "",
        "| Laplacian heads | steps | change [95% CI] | seeds | still improving |",
        "|---|---|---|---|---|",
    ]
    for spec, row in changes.items():
        lines.append(
            f"| {spec} | {row['from_step']} -> {row['to_step']} | {_with_interval(row)} | "
            f"{row['n_pairs']} | {_IMPROVING.get(row['still_improving'], 'untested (1 seed)')} |"
        )
    return lines


def fit_lines(rows: dict[str, FitRow], baseline: str) -> list[str]:
    lines = [
        "",
        "Fit: final top-1 on the first training images without augmentation (`--fit-subset`) against the test "
        "top-1, paired within each cell, mean [95% CI] over seeds. A fit score near the test score means the model "
        "has not fitted its training data: underfit, where a regularising bias has little to act on. Against "
        f"k = {baseline}, paired by seed: a regularising bias lowers the fit top-1, raises the fit loss and lowers the "
        "test loss.",
        "",
        "| Laplacian heads | fit top-1 (%) | fit - test [95% CI] | "
        + " | ".join(f"{name} - at k = {baseline}" for name in AGAINST_BASELINE)
        + " | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec, row in rows.items():
        against = row["against_baseline"] or {}
        columns = [_with_interval(against[name]) if name in against else "–" for name in AGAINST_BASELINE]
        lines.append(
            f"| {spec} | {row['fit_top1']:.2f} | {_with_interval(row)} | {' | '.join(columns)} | {row['n_pairs']} |"
        )
    return lines


def step_lines(intro: str, rows_by_spec: dict[str, list[dict]], column: Callable[[str], str]) -> list[str]:
    """Markdown: one row per step, one column per spec: mean [95% CI] (pairs) of ``paired_test`` rows."""
    specs = list(rows_by_spec)
    steps = sorted({row["step"] for rows in rows_by_spec.values() for row in rows})
    at = {(spec, row["step"]): row for spec, rows in rows_by_spec.items() for row in rows}
    lines = ["", intro, "", "| step | " + " | ".join(map(column, specs)) + " |", "|---|" + "---|" * len(specs)]
    for step in steps:
        cells = []
        for spec in specs:
            row = at.get((spec, step))
            cells.append("" if row is None else f"{_with_interval(row)} ({row['n_pairs']})")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def gap_lines(label: str, gaps: dict[str, list[dict]], baseline: str) -> list[str]:
    intro = f"{label}, paired gap over training (spec - {baseline} at each evaluation; mean [95% CI] (pairs)):"
    return step_lines(intro, gaps, lambda spec: f"{spec} - {baseline}")


def settled_text(rows: list[dict]) -> str:
    settled = settled_from(rows)
    if settled is None:
        return "one seed so far, untested" if rows[-1]["n_pairs"] < 2 else "its interval includes 0 at the last step"
    sign, step = settled
    return f"{'diffusive (above 0)' if sign > 0 else 'sharpening (below 0)'} from step {step} on"


def table_row(label: str, spec: str, row: Comparison) -> str:
    judged = row.judgement
    cells = [label, judged.role if judged else "", spec, str(row.n), _mean_std(row, ".4g")]
    if row.compared:
        pair = row.paired
        test = pair if row.test == "paired" else row.welch
        if row.test == "paired":
            difference = f"{pair['mean_difference']:+.4g} [{pair['ci_low']:+.3g}, {pair['ci_high']:+.3g}]"
        elif not math.isnan(test["p"]):  # arms on different seeds: the difference of their means
            difference = f"{row.mean - row.baseline_mean:+.4g} (Welch)"
        elif pair["n_pairs"]:  # one pair so far: its difference, untested
            difference = f"{pair['mean_difference']:+.4g} (1 pair)"
        elif math.isnan(row.baseline_mean):
            difference = f"– (k = {row.baseline} has no value)"
        else:
            difference = f"{row.mean - row.baseline_mean:+.4g} (unpaired)"
        corrected = judged is not None and judged.role in ("primary", "declared")
        cells += [
            difference,
            f"{_fmt(test['p'], '.3g')} / {_fmt(judged.p_holm, '.3g') if corrected else '–'} / "
            f"{_fmt(judged.permutation_p if judged else math.nan, '.3g')}",
            judged.signs if judged else "",
            f"{_fmt(judged.alpha if judged else math.nan, '.2g')}: "
            f"{_fmt(judged.mde_at_alpha if judged else math.nan, '.3g')}",
            row.verdict or "",
        ]
    else:
        no_arm = "(baseline)" if spec == row.baseline else f"– (no k = {row.baseline} arm)"
        cells += [no_arm, "", "", "", ""]
    return "| " + " | ".join(cells) + " |"


def mechanism_row(label: str, spec: str, row: Comparison) -> str:
    pair, tested = row.paired, row.zero_test
    interval = "" if math.isnan(pair["ci_low"]) else f"[{pair['ci_low']:+.3g}, {pair['ci_high']:+.3g}]"
    cells = [
        label,
        spec,
        str(row.n),
        _mean_std(row, "+.3g"),
        interval,
        f"{_fmt(pair['p'], '.3g')} / {_fmt(tested.p_holm, '.3g')}",
        f"{_fmt(tested.alpha, '.2g')}: {_fmt(tested.mde_at_alpha, '.3g')}",
        row.verdict,
    ]
    return "| " + " | ".join(cells) + " |"


MECHANISM_HEADER = [
    "| quantity | Laplacian heads | n | mean ± std | 95% CI | p raw / Holm | alpha: MDE | verdict |",
    "|---|---|---|---|---|---|---|---|",
]


def table_header(baseline: str) -> list[str]:
    return [
        f"| metric | role | Laplacian heads | n | mean ± std | difference vs {baseline} [95% CI] | p: t-test / Holm / "
        "sign-flip | seeds in the paper's direction | alpha: MDE | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]


def rule_lines(rule: RuleRecord) -> list[str]:
    """The verdict rule in words, with this report's family and margins (lapheads.study.verdicts)."""
    margins = "; ".join(
        f"{label}: {'none (the paper reports no such effect)' if m is None else f'{m:.3g}'}"
        for label, m in rule["margin"].items()
    )
    declared = ", ".join(rule["declared"]) or "none of its rows in this sweep"
    when = rule.get("declaration")
    stamp = []
    if when is not None:
        stamp = [
            f"Family **declared before the data** (plan sha256 {when['plan_sha256'][:12]}: {when['why']})."
            if when["before_data"]
            else f"Family **declared after the data** ({when['why']}): read its corrections as exploratory.",
            "",
        ]
    sizes = f"{rule.get('primary_family_size', 1)} test(s)"
    return [
        *stamp,
        f"Verdict rule (`lapheads.study.verdicts`): the **primary** test ({', '.join(rule['primary'])}) Holm-corrected "
        f"across its arms ({sizes}); the **declared** family ({declared}), Holm-corrected across claims x arms "
        f"({rule['declared_family_size']} tests); every other row **secondary**, raw p, uncorrected. Directions per "
        "contrast: a claim reads as stated where the arm has more Laplacian heads, reversed where it has fewer, and "
        "not at all between head kinds (tested two-sided: 'differs' or 'not detected'). MDE: the difference detected "
        f"with {rule['power']:.0%} power at the design alpha (alpha / m of the row's family: what Holm always meets), "
        "exact noncentral t. Equivalence margin (both TOST halves, each by t and by exact sign flips; the upper half "
        f"alone reads 'excluded', both 'equivalent'): {margins}. Beside each t-test p: Holm's p and the exact "
        "sign-flip permutation p (floor 2/2^n: 0.0625 with 5 pairs), and the seeds that moved the claimed way.",
        "",
    ]


def dose_lines(dose: dict[str, Any]) -> list[str]:
    """The dose section: each metric's slope against k over the dose arms, and the headline against the geometry."""
    if not dose:
        return []
    levels = ", ".join(map(str, dose["levels"]))
    lines = [
        "",
        f"Dose (secondary: raw p, uncorrected): each seed's least-squares slope against k, the Laplacian heads per "
        f"block, over the arms k = {levels}; mean [95% CI] over seeds, one-sample t-test against 0; 'fitted' is the "
        "slope times the span of k.",
        "",
        "| metric | slope per Laplacian head [95% CI] | fitted over the span | p | seeds in the paper's direction |",
        "|---|---|---|---|---|",
    ]
    for label, row in dose["slopes"].items():
        fitted = row["mean_difference"] * row["span"]
        signs = row["signs"] if row["direction"] is not None else f"{row['signs']} (no claim: up)"
        lines.append(f"| {label} | {_with_interval(row)} | {fitted:+.3g} | {_fmt(row['p'], '.3g')} | {signs} |")
    if dose["follows"]:
        lines += [
            "",
            "Does the headline follow the geometry? Each seed's least-squares slope of the headline against a "
            "geometry row across the same arms, mean [95% CI] over seeds; the sign the paper's reading predicts "
            "(accuracy improves as the geometry moves its way) beside it, and the seeds with that sign.",
            "",
            "| headline | against | slope [95% CI] | p | predicted sign | seeds with it |",
            "|---|---|---|---|---|---|",
        ]
        for label, row in dose["follows"].items():
            predicted = {1: "+", -1: "-", None: "none"}[row["direction"]]
            lines.append(
                f"| {row['headline']} | {label} | {_with_interval(row)} | {_fmt(row['p'], '.3g')} | {predicted} | "
                f"{row['signs'] if row['direction'] is not None else '–'} |"
            )
    return lines


def revisions_line(revisions: dict[str, list[str]]) -> str:
    """Which code trained the cells, as the records say (lapheads.study.report.statistics.code_revisions)."""
    named = "; ".join(
        f"{revision[:7]}: {', '.join(names) if len(names) <= 8 else f'{len(names)} cells'}"
        for revision, names in sorted(revisions.items(), key=lambda item: -len(item[1]))
    )
    several = " (several: what changed between them is for the study's account to state)" if len(revisions) > 1 else ""
    return f"Code revisions the records name (each record's environment.git_revision){several}: {named}."
