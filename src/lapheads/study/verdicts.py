"""The verdict rule of ``lapheads report``: what a sweep may claim, and with how much sensitivity.

Design choices (each answers a reviewer's objection to a single Holm family over every row):

* **One primary test per paradigm, alone at alpha 0.05**: the task's first headline metric (vision: test top-1;
  LM: validation bits per byte). Its threshold does not depend on how many geometry rows share its table.
* **A declared geometry family**: one metric per claim of the paper, at one place (after the final norm), fixed
  before the data (:data:`DECLARED_GEOMETRY`). Holm runs across claims x arms of the sweep (every spec against the
  baseline), not per spec. Every other row is **secondary**: reported with its raw p, uncorrected, and labelled so.
* **Sensitivity at the alpha a row really faces**: the minimum detectable effect (80 % power) by the exact
  noncentral t at the row's own alpha: 0.05 for the primary and for secondary rows, alpha / (m - i) for the
  declared row at Holm step i (0-based, ordered by raw p) of a family of m.
* **An equivalence verdict**: with a margin m (default: the paper's relative error reduction transferred to the
  baseline's error rate, where the paper reports one for the metric; ``--margin`` overrides), a one-sided test of
  "the gain is at least m" (TOST's upper half). When it rejects, the row reads "excluded: a gain >= m is ruled
  out", and "not detected" is left for what is truly undecided.
* **At least 3 seed pairs** for any verdict: with 2, a paired t-test has one degree of freedom (its p can be tiny
  when two differences happen to agree) and the row reads "not decided".
* **Beside every t-test p**: the exact sign-flip permutation p (all 2^n sign patterns of the paired differences;
  its floor is 2 / 2^n, 0.0625 with 5 pairs, so no "held" can rest on it alone with so few seeds) and the number of
  seeds that moved in the paper's direction ("5/5").
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

__all__ = [
    "ALPHA",
    "DECLARED_GEOMETRY",
    "PAPER_RELATIVE_ERROR_REDUCTION",
    "POWER",
    "apply_rule",
    "default_margin",
    "holm_steps",
    "mde",
    "sign_count",
    "sign_flip_p",
    "tost_gain_p",
]

ALPHA, POWER = 0.05, 0.80

#: one metric per claim of the paper, at one place (after the final norm): the family Holm corrects
DECLARED_GEOMETRY = (
    "within-sequence fraction (after the final norm)",  # tokens of a sequence move closer together
    "between-class fraction (after the final norm)",  # classes move apart
    "NC1, sequence means (after the final norm)",  # neural collapse of the sequence representations
    "components for 99%, per sequence (after the final norm)",  # each sequence's spectrum decays faster
    "CDNV, next-token classes (after the final norm)",  # LM: linguistic collapse (Wu & Papyan's CDNV)
)

#: relative error reduction the paper reports for a headline metric, (baseline, Laplacian) in percent; its error
#: rate is 100 - value. ImageNet-1k top-1, DeiT-III ViT-B-12L: 81.45 -> 82.32 (paper.md, the results table).
PAPER_RELATIVE_ERROR_REDUCTION = {
    "test top-1 (%)": (81.45, 82.32),
}


def default_margin(label: str, baseline_mean: float) -> float | None:
    """The paper's relative error reduction for ``label`` applied to this baseline's error rate (None: the paper
    reports no such number for this metric, e.g. bits per byte)."""
    if label not in PAPER_RELATIVE_ERROR_REDUCTION or not math.isfinite(baseline_mean):
        return None
    before, after = PAPER_RELATIVE_ERROR_REDUCTION[label]
    return (100.0 - baseline_mean) * (after - before) / (100.0 - before)


def mde(se: float, df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference a two-sided one-sample t-test at ``alpha`` detects with ``power``, by the
    exact noncentral t distribution (standard error ``se`` of the mean difference, ``df`` = n - 1)."""
    from scipy import optimize, stats

    if not (se > 0 and df >= 1 and math.isfinite(se)):
        return math.nan
    critical = float(stats.t.ppf(1 - alpha / 2, df))

    def shortfall(nc: float) -> float:
        lower = float(stats.nct.cdf(-critical, df, nc))  # underflows to NaN far from 0, where it is ~0
        return float(stats.nct.sf(critical, df, nc)) + (lower if math.isfinite(lower) else 0.0) - power

    high = critical + 10.0
    while shortfall(high) < 0:
        high *= 2
    return float(optimize.brentq(shortfall, 0.0, high, xtol=1e-10)) * se


def tost_gain_p(mean_difference: float, se: float, df: int, margin: float, direction: int) -> float:
    """One-sided p of "the gain in the paper's ``direction`` is at least ``margin``" (H0) against "it is smaller":
    small p rules a gain of ``margin`` or more out (the upper half of a TOST)."""
    from scipy import stats

    if not (se > 0 and df >= 1 and margin > 0):
        return math.nan
    gain = mean_difference * direction
    return float(stats.t.cdf((gain - margin) / se, df))


def sign_flip_p(differences: list[float]) -> float:
    """Exact two-sided sign-flip permutation p of the mean paired difference: the share of the 2^n sign patterns
    whose |mean| is at least the observed one (the observed pattern included)."""
    d = np.asarray(differences, dtype=float)
    if len(d) < 1 or len(d) > 20:
        return math.nan
    observed = abs(d.mean())
    count = 0
    for signs in itertools.product((1.0, -1.0), repeat=len(d)):
        count += abs((d * signs).mean()) >= observed - 1e-12 * max(1.0, observed)
    return count / 2 ** len(d)


def sign_count(differences: list[float], direction: int | None) -> str:
    """How many seeds moved in the paper's direction (or up, for a metric without a claim): "4/5"."""
    d = np.asarray(differences, dtype=float)
    towards = int(np.sum(d * (direction or 1) > 0))
    return f"{towards}/{len(d)}"


def holm_steps(p_values: dict[Any, float]) -> tuple[dict[Any, float], dict[Any, float]]:
    """(Holm-adjusted p, the alpha each row faces at its step) of a family; NaN rows stay NaN."""
    finite = sorted((p, i, key) for i, (key, p) in enumerate(p_values.items()) if not math.isnan(p))
    adjusted = dict.fromkeys(p_values, math.nan)
    faced = dict.fromkeys(p_values, math.nan)
    running = 0.0
    for step, (p, _, key) in enumerate(finite):
        running = max(running, min(1.0, (len(finite) - step) * p))
        adjusted[key] = running
        faced[key] = ALPHA / (len(finite) - step)
    return adjusted, faced


def _differences(row: dict[str, Any], values: dict[int, float] | None) -> list[float]:
    if values is None:
        return []
    own = {int(s): float(v) for s, v in row["values"].items()}
    return [own[s] - values[s] for s in sorted(set(own) & set(values))]


def apply_rule(
    primary: dict[str, dict[str, dict[str, Any]]],
    others: dict[str, dict[str, dict[str, Any]]],
    claims: dict[str, int | None],
    baseline: str = "0",
    margin: float | None = None,
) -> dict[str, Any]:
    """Give every compared row (label -> spec -> ``report.summarize`` row) its role, alpha, MDE at that alpha,
    permutation p, sign count, equivalence test and verdict, in place; returns the rule's record for stats.json.

    Args:
        primary: the primary metric's rows (one label).
        others: every other row: declared geometry (by label) and secondary rows.
        claims: the paper's direction per label (+1 rises, -1 falls, None no claim).
        baseline: the spec the others are compared with.
        margin: the equivalence margin of the primary metric (None: the paper's, where it has one).
    """

    def describe(label: str, spec: str, row: dict[str, Any], role: str, alpha: float) -> float:
        """Annotate ``row``; returns the standard error of its mean paired difference."""
        differences = _differences(row, _values(label, baseline))
        n = len(differences)
        se = float(np.std(differences, ddof=1)) / math.sqrt(n) if n >= 2 else math.nan
        row.update(
            role=role,
            alpha=alpha,
            mde_at_alpha=mde(se, n - 1, alpha) if n >= 2 else math.nan,
            permutation_p=sign_flip_p(differences) if differences else math.nan,
            signs=sign_count(differences, claims.get(label)) if differences else "",
        )
        return se

    tables = {**primary, **others}

    def _values(label: str, spec: str) -> dict[int, float] | None:
        row = tables[label].get(spec)
        return None if row is None else {int(s): float(v) for s, v in row["values"].items()}

    def compared(rows: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        return [(spec, row) for spec, row in rows.items() if spec != baseline and "test" in row]

    def test_of(row: dict[str, Any]) -> tuple[float, float]:
        """(difference, p) of the row's test: paired, or Welch's where fewer than two seeds pair up."""
        if row["test"] == "paired":
            return row["paired"]["mean_difference"], row["paired"]["p"]
        return row["mean"] - row.get("baseline_mean", math.nan), row["welch"]["p"]

    record: dict[str, Any] = {"alpha": ALPHA, "power": POWER, "primary": list(primary), "declared": [], "margin": {}}
    for label, rows in primary.items():
        direction = claims.get(label)
        base_mean = rows[baseline]["mean"] if baseline in rows else math.nan
        m = margin if margin is not None else default_margin(label, base_mean)
        record["margin"][label] = m
        for spec, row in compared(rows):
            se = describe(label, spec, row, "primary", ALPHA)
            n = row["paired"]["n_pairs"]
            difference, p = test_of(row)
            row["margin"] = m
            row["tost_p"] = tost_gain_p(difference, se, n - 1, m, direction or 1) if m and n >= 2 else math.nan
            row["verdict"] = _verdict(difference, p, row, direction, ALPHA)

    declared = {label: rows for label, rows in others.items() if label in DECLARED_GEOMETRY}
    record["declared"] = list(declared)
    family = {(label, spec): test_of(row)[1] for label, rows in declared.items() for spec, row in compared(rows)}
    adjusted, faced = holm_steps(family)
    for (label, spec), p_holm in adjusted.items():
        row = declared[label][spec]
        alpha = faced[(label, spec)] if not math.isnan(faced[(label, spec)]) else ALPHA / max(len(family), 1)
        describe(label, spec, row, "declared", alpha)
        row["p_holm"] = p_holm
        row["verdict"] = _verdict(test_of(row)[0], p_holm, row, claims.get(label), ALPHA)
    record["declared_family_size"] = len(family)

    for label, rows in others.items():
        if label in declared:
            continue
        for spec, row in compared(rows):
            describe(label, spec, row, "secondary", ALPHA)
            row["p_holm"] = math.nan
            words = _verdict(*test_of(row), row, claims.get(label), ALPHA)
            row["verdict"] = words if words.startswith(("not", "no claim")) else f"{words} (uncorrected)"
    return record


def _verdict(difference: float, p: float, row: dict[str, Any], direction: int | None, alpha: float) -> str:
    """held / opposite when the row's test rejects at ``alpha``; excluded when a paper-sized gain is ruled out;
    else not detected, with the MDE at the alpha the row faced."""
    if direction is None:
        return "no claim"
    pairs = row.get("paired", {}).get("n_pairs", 0)
    if 0 < pairs < 3 and not math.isnan(p):  # one degree of freedom: a t-test's p says too little to decide on
        return f"not decided ({pairs} seed pairs; a verdict needs 3)"
    if not math.isnan(p) and p < alpha:
        return "held" if difference * direction > 0 else "opposite"
    tost = row.get("tost_p", math.nan)
    if not math.isnan(tost) and tost < ALPHA:
        return f"excluded: a gain >= {row['margin']:.3g} is ruled out (TOST p {tost:.2g})"
    if not math.isnan(row.get("mde_at_alpha", math.nan)):
        return f"not detected (MDE {row['mde_at_alpha']:.3g} at alpha {row['alpha']:.2g})"
    if math.isnan(p) and row.get("paired", {}).get("n_pairs", 0) >= 2:
        return "not tested (the paired differences have no spread)"
    return "not detected" if not math.isnan(p) else "not tested (fewer than 2 seeds)"
