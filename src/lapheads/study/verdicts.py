"""The verdict rule of ``lapheads report``: what a sweep may claim, and with how much sensitivity.

Design choices (each answers a reviewer's objection to a single Holm family over every row):

* **One primary test per paradigm**: the task's first headline metric (vision: test top-1; LM: validation bits per
  byte), or the plan's primary; Holm across the arms it compares (one test per arm), alone otherwise: its threshold
  does not depend on how many geometry rows share its table.
* **A declared geometry family**: one metric per claim of the paper, at one place (after the final norm), fixed
  before the data (:data:`DECLARED_GEOMETRY`). Holm runs across claims x arms of the sweep (every spec against the
  baseline), not per spec. Every other row is **secondary**: reported with its raw p, uncorrected, and labelled so.
* **Sensitivity the design guarantees**: the minimum detectable effect (80 % power, exact noncentral t) at alpha / m
  for a family of m (Bonferroni: Holm rejects at least what it rejects, whatever the ordering of the p-values), the
  realised Holm step's alpha beside it; 0.05 for secondary rows.
* **Directions per contrast**: a claim of the paper reads as stated when the arm is the more Laplacian one, reversed
  when the baseline is (a late-only schedule against k = 0), and not at all between arms that differ in head kind,
  not in count (ablations: sum, untied, exclusive, centring against a Laplacian arm), or as a plan declares. A
  contrast without a claim is tested two-sided and reads "differs (higher / lower)" or "not detected".
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
from typing import Any, TypedDict

import numpy as np

from lapheads.study.comparison import Comparison, Equivalence, Judgement

__all__ = [
    "mechanism_verdict",
    "ALPHA",
    "DECLARED_GEOMETRY",
    "Declaration",
    "PAPER_RELATIVE_ERROR_REDUCTION",
    "POWER",
    "RuleRecord",
    "apply_rule",
    "default_margin",
    "holm_steps",
    "mde",
    "contrast_direction",
    "laplacian_count",
    "sign_count",
    "sign_flip_p",
    "sign_flip_tost_p",
    "tost_gain_p",
]

ALPHA, POWER = 0.05, 0.80
#: the smallest significance level a plan or a reading may ask for: far below any design here (0.05 / 12), and far
#: enough above float resolution that every quantile, p and MDE stays finite
MIN_ALPHA = 1e-6
#: the MDE search doubles its bracket at most this often (a noncentral t of 10 * 2^60 is beyond any real design)
MDE_DOUBLINGS = 60

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
    if not math.isfinite(critical):  # alpha below float resolution: no finite test, so no finite MDE
        return math.nan

    def shortfall(nc: float) -> float:
        lower = float(stats.nct.cdf(-critical, df, nc))  # underflows to NaN far from 0, where it is ~0
        return float(stats.nct.sf(critical, df, nc)) + (lower if math.isfinite(lower) else 0.0) - power

    high = critical + 10.0
    for _ in range(MDE_DOUBLINGS):  # bounded: a search that cannot bracket the power says so instead of hanging
        if shortfall(high) >= 0:
            break
        high *= 2
    else:
        return math.nan
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


def holm_steps(p_values: dict[Any, float], alpha: float = ALPHA) -> tuple[dict[Any, float], dict[Any, float]]:
    """(Holm-adjusted p, the alpha each row faces at its step) of a family at familywise ``alpha``; NaN rows stay
    NaN."""
    finite = sorted((p, i, key) for i, (key, p) in enumerate(p_values.items()) if not math.isnan(p))
    adjusted = dict.fromkeys(p_values, math.nan)
    faced = dict.fromkeys(p_values, math.nan)
    running = 0.0
    for step, (p, _, key) in enumerate(finite):
        running = max(running, min(1.0, (len(finite) - step) * p))
        adjusted[key] = running
        faced[key] = alpha / (len(finite) - step)
    return adjusted, faced


def sign_flip_tost_p(differences: list[float], margin: float, direction: int) -> tuple[float, float]:
    """Exact sign-flip versions of the two TOST halves: (p of H0 "gain >= margin", p of H0 "gain <= -margin"), each
    the share of the 2^n sign patterns of the shifted gains whose mean is at least as far into the alternative as
    the observed one. Its floor is 1 / 2^n (0.03125 with 5 pairs)."""
    gains = np.asarray(differences, dtype=float) * direction
    if len(gains) < 1 or len(gains) > 20 or not margin > 0:
        return math.nan, math.nan
    patterns = np.array(list(itertools.product((1.0, -1.0), repeat=len(gains))))
    tolerance = 1e-12 * max(1.0, margin)
    upper = gains - margin  # under H0 (gain = margin) symmetric about 0; small means favour "gain < margin"
    lower = gains + margin
    p_upper = float(np.mean((patterns * upper).mean(1) <= upper.mean() + tolerance))
    p_lower = float(np.mean((patterns * lower).mean(1) >= lower.mean() - tolerance))
    return p_upper, p_lower


def laplacian_count(spec: str) -> int | None:
    """How many Laplacian heads a written spec has over the model ("3": 3 per layer, counted once; "0,2,2,0": 4),
    None for head kinds (an ablation is no dose of Laplacian heads)."""
    parts = [part.strip() for part in str(spec).split(",")]
    if not all(part.isdigit() for part in parts):
        return None
    counts = [int(part) for part in parts]
    return counts[0] if len(counts) == 1 else sum(counts)


def contrast_direction(arm: str, baseline: str) -> int | None:
    """+1: ``arm`` has more Laplacian heads than ``baseline`` (the paper's claims read as stated), -1: fewer (they
    read reversed), None: the two differ otherwise (head kinds, or the same count laid out differently)."""
    a, b = laplacian_count(arm), laplacian_count(baseline)
    if a is None or b is None or a == b:
        return None
    if 0 in (a, b) or "," not in f"{arm}{baseline}":
        return 1 if a > b else -1
    return None  # two per-layer schedules: where, not how many (a plan says what it claims)


def _differences(row: Comparison, values: dict[int, float] | None) -> list[float]:
    if values is None:
        return []
    own = {int(s): float(v) for s, v in row.values.items()}
    return [own[s] - values[s] for s in sorted(set(own) & set(values))]


def mechanism_verdict(
    difference: float, p_holm: float, mde_: float, direction: int | None, pairs: int | None = None
) -> str:
    """The mechanism section's words, beside :func:`apply_rule`'s (this module holds every verdict's words): held /
    opposite when significant after Holm, else not detected (with the MDE at the alpha of the row's Holm step);
    ``pairs`` below 3 decide nothing, as in the headline rule."""
    if direction is None:
        return "no claim"
    if pairs is not None and 0 < pairs < 3 and not math.isnan(p_holm):
        return f"not decided ({pairs} seed pairs; a verdict needs 3)"
    if not math.isnan(p_holm) and p_holm < ALPHA:
        return "held" if difference * direction > 0 else "opposite"
    if not math.isnan(mde_):
        return f"not detected (MDE {mde_:.3g})"
    return _untested_or_not_detected(p_holm, pairs or 0, "the values")


class Declaration(TypedDict):
    """Whether a report's family was declared before the data (``study.records.declaration``)."""

    before_data: bool
    plan_sha256: str | None
    why: str


class RuleRecord(TypedDict, total=False):
    """The verdict rule's record in stats.json: the alpha and power every row faced, the primary and declared
    families and their sizes, each margin, the plan, and the declaration (:func:`apply_rule` and the report fill
    it)."""

    alpha: float
    power: float
    primary: list[str]
    declared: list[str]
    margin: dict[str, float | None]
    primary_family_size: int
    declared_family_size: int
    plan: Any
    declaration: Declaration


def apply_rule(
    primary: dict[str, dict[str, Comparison]],
    others: dict[str, dict[str, Comparison]],
    claims: dict[str, int | None],
    baseline: str = "0",
    margin: float | None = None,
    directions: dict[str, int | None] | None = None,
    family: tuple[str, ...] | list[str] | None = None,
    planned: set[str] | None = None,
    margins: dict[str, float] | None = None,
    alpha: float = ALPHA,
) -> RuleRecord:
    """Give every compared row (label -> key -> ``report.summarize`` row, compared with its ``baseline``) its
    :class:`Judgement` (role, alpha, MDE at that alpha, permutation p, sign count), :class:`Equivalence` where a margin
    applies, and verdict, in place; returns the rule's record for stats.json.

    Args:
        primary: the primary metric's rows (one label).
        others: every other row: declared geometry (by label) and secondary rows.
        claims: the paper's direction per label (+1 rises, -1 falls, None no claim).
        baseline: the spec the others are compared with where a row does not name its own.
        margin: the equivalence margin of the primary metric (None: its entry in ``margins``, else the paper's where
            it has one).
        directions: per compared key, the contrast's claim (+1 as the paper, -1 reversed, None no claim); default
            :func:`contrast_direction` of the row's arm and baseline.
        family: the declared family's labels (default :data:`DECLARED_GEOMETRY`; a plan's ``family``).
        planned: the compared keys the plan declares (None: every compared key); others are secondary.
        margins: margins by label fixed before the data (a plan's ``margins``); they outrank the paper's default.
        alpha: every family's familywise alpha, and each secondary row's (a plan's ``alpha``; default 0.05).
    """
    rule = _Rule({**primary, **others}, claims, baseline, directions, planned, margins or {}, alpha)
    record: RuleRecord = {"alpha": alpha, "power": POWER, "primary": list(primary), "declared": [], "margin": {}}
    rule.primary_family(primary, margin, record)
    declared_labels = DECLARED_GEOMETRY if family is None else tuple(family)
    rule.declared_family({label: rows for label, rows in others.items() if label in declared_labels}, record)
    rule.secondary_rows(record)
    return record


class _Rule:
    """The verdict rule over one report's rows: each compared row's role, alpha, tests and verdict (apply_rule)."""

    def __init__(self, tables, claims, baseline, directions, planned, fixed, alpha) -> None:
        self.tables, self.claims, self.baseline, self.directions = tables, claims, baseline, directions
        self.planned, self.fixed, self.alpha = planned, fixed, alpha

    def margin_of(self, label: str, base_mean: float) -> float | None:
        """A margin fixed before the data wins; the paper's effect on this baseline is the default."""
        return self.fixed[label] if label in self.fixed else default_margin(label, base_mean)

    @staticmethod
    def arm_of(key: str, row: Comparison) -> str:
        return row.arm if row.arm is not None else key

    def values_of(self, label: str, spec: str) -> dict[int, float] | None:
        for key, row in self.tables[label].items():
            if self.arm_of(key, row) == spec:
                return {int(s): float(v) for s, v in row.values.items()}
        return None

    def differences(self, label: str, row: Comparison) -> list[float]:
        return _differences(row, self.values_of(label, row.baseline))

    def direction_of(self, label: str, key: str, row: Comparison) -> int | None:
        claim_ = self.claims.get(label)
        if claim_ is None:
            return None
        given = self.directions.get(key, _DEFAULT) if self.directions is not None else _DEFAULT
        d = contrast_direction(self.arm_of(key, row), row.baseline) if given is _DEFAULT else given
        return None if d is None else claim_ * d

    def compared(self, label: str) -> list[tuple[str, Comparison]]:
        return [
            (k, row) for k, row in self.tables[label].items() if row.compared and row.baseline != self.arm_of(k, row)
        ]

    def in_plan(self, key: str) -> bool:
        return self.planned is None or key in self.planned

    def describe(self, label: str, key: str, row: Comparison, role: str, alpha: float) -> list[float]:
        """Give ``row`` its judgement (p_holm NaN until a family sets it); returns its paired differences."""
        differences = self.differences(label, row)
        n = len(differences)
        se = float(np.std(differences, ddof=1)) / math.sqrt(n) if n >= 2 else math.nan
        direction = self.direction_of(label, key, row)
        claim_ = self.claims.get(label)
        row.judgement = Judgement(
            role=role,
            alpha=alpha,
            direction=direction,
            mde_at_alpha=mde(se, n - 1, alpha) if n >= 2 else math.nan,
            permutation_p=sign_flip_p(differences) if differences else math.nan,
            signs=sign_count(differences, direction if direction is not None else claim_) if n else "",
            # the contrast's own claim: the effective direction over the metric's (both +-1), or none
            contrast_claim="no claim"
            if claim_ is None
            else _CONTRAST_WORDS[None if direction is None else direction * claim_],
        )
        return differences

    @staticmethod
    def test_of(row: Comparison) -> tuple[float, float]:
        """(difference, p) of the row's test: paired, or Welch's where fewer than two seeds pair up."""
        if row.test == "paired":
            return row.paired["mean_difference"], row.paired["p"]
        return row.mean - row.baseline_mean, row.welch["p"]

    def holm_family(self, members: dict[Any, Comparison], role: str) -> int:
        """Holm over ``members`` ((label, key) -> row): design alpha / m, the realised step's alpha beside it."""
        adjusted, faced = holm_steps({member: self.test_of(row)[1] for member, row in members.items()}, self.alpha)
        m = max(len(members), 1)
        for (label, key), row in members.items():
            self.describe(label, key, row, role, self.alpha / m)
            row.judgement.p_holm = adjusted[(label, key)]
            row.judgement.holm_alpha = faced[(label, key)]
        return len(members)

    def primary_family(self, primary, margin: float | None, record: RuleRecord) -> None:
        """The primary metric's planned rows, Holm across them; its other rows secondary; its margin's TOST."""
        members = {(label, k): row for label in primary for k, row in self.compared(label) if self.in_plan(k)}
        record["primary_family_size"] = self.holm_family(members, "primary")
        for label, rows in primary.items():
            base = rows[self.baseline].mean if self.baseline in rows else math.nan
            m = margin if margin is not None else self.margin_of(label, base)
            record["margin"][label] = m
            for key, row in self.compared(label):
                if (label, key) not in members:
                    differences = self.describe(label, key, row, "secondary", self.alpha)
                else:
                    differences = self.differences(label, row)
                _equivalence(row, differences, m)
                p = row.judgement.p_holm if (label, key) in members else self.test_of(row)[1]
                row.verdict = _verdict(self.test_of(row)[0], p, row, self.claims.get(label), self.alpha)

    def declared_family(self, declared, record: RuleRecord) -> None:
        """The declared geometry rows, Holm across the family; a plan's margin gives a row its TOST."""
        record["declared"] = list(declared)
        members = {(label, k): row for label in declared for k, row in self.compared(label) if self.in_plan(k)}
        record["declared_family_size"] = self.holm_family(members, "declared")
        for (label, key), row in members.items():
            if label in self.fixed:  # a declared row with a plan's margin: both TOST halves, as the primary's
                record["margin"][label] = self.fixed[label]
                _equivalence(row, self.differences(label, row), self.fixed[label])
            row.verdict = _verdict(self.test_of(row)[0], row.judgement.p_holm, row, self.claims.get(label), self.alpha)

    def secondary_rows(self, record: RuleRecord) -> None:
        """Every row no family took: tested at alpha, uncorrected, and worded so."""
        for label in self.tables:
            for key, row in self.compared(label):
                if row.judgement is not None:
                    continue
                differences = self.describe(label, key, row, "secondary", self.alpha)
                if (
                    row.judgement.direction is not None
                ):  # a claimed secondary row (a plan's headline) keeps its margin's TOST
                    base = self.values_of(label, row.baseline) or {}
                    m = self.margin_of(label, float(np.mean(list(base.values()))) if base else math.nan)
                    if m is not None:
                        record["margin"].setdefault(label, m)
                        _equivalence(row, differences, m)
                words = _verdict(*self.test_of(row), row, self.claims.get(label), self.alpha)
                row.verdict = words if words.startswith(("not", "no claim")) else f"{words} (uncorrected)"


_DEFAULT = object()
#: what a contrast claims, by its effective direction on the metric (None: no claim for this contrast)
_CONTRAST_WORDS = {None: "no claim: contrast", 1: "the paper's direction", -1: "the paper's direction, reversed"}


def _equivalence(row: Comparison, differences: list[float], margin: float | None) -> None:
    """Both TOST halves for a row with a margin (the primary's, or a claimed secondary headline's): by the t
    distribution and by exact sign flips."""
    n = len(differences)
    se = float(np.std(differences, ddof=1)) / math.sqrt(n) if n >= 2 else math.nan
    row.equivalence = Equivalence(margin)
    gain_sign = (row.judgement.direction if row.judgement is not None else None) or 1
    if not (margin and n >= 2 and se > 0):
        return
    mean = float(np.mean(differences))
    upper_exact, lower_exact = sign_flip_tost_p(differences, margin, gain_sign)
    row.equivalence = Equivalence(
        margin,
        tost_p=tost_gain_p(mean, se, n - 1, margin, gain_sign),  # H0: gain >= margin
        tost_lower_p=tost_gain_p(-mean, se, n - 1, margin, gain_sign),  # H0: gain <= -margin
        tost_sign_flip_p=upper_exact,
        tost_lower_sign_flip_p=lower_exact,
    )


def _verdict(difference: float, p: float, row: Comparison, claim_: int | None, alpha: float = ALPHA) -> str:
    """held / opposite (a claimed contrast) or differs (higher / lower) (a contrast without a claim) when the row's
    test rejects at its alpha; excluded / equivalent when a TOST rejects by both of its tests; else not detected, with
    the design MDE."""
    if claim_ is None:
        return "no claim"
    judged = row.judgement
    direction = judged.direction if judged is not None else None
    pairs = row.paired["n_pairs"] if row.paired is not None else 0
    if 0 < pairs < 3 and not math.isnan(p):  # one degree of freedom: a t-test's p says too little to decide on
        return f"not decided ({pairs} seed pairs; a verdict needs 3)"
    if not math.isnan(p) and p < alpha:
        if direction is None:
            return f"differs ({'higher' if difference > 0 else 'lower'})"
        return "held" if difference * direction > 0 else "opposite"
    tost = row.equivalence or Equivalence(None)
    margin = tost.margin
    upper, upper_exact = tost.tost_p, tost.tost_sign_flip_p
    lower, lower_exact = tost.tost_lower_p, tost.tost_lower_sign_flip_p
    if upper < alpha and upper_exact < alpha:
        if lower < alpha and lower_exact < alpha:
            return (
                f"equivalent within +-{margin:.3g} (TOST p {max(upper, lower):.2g}, sign-flip "
                f"{max(upper_exact, lower_exact):.2g})"
            )
        return f"excluded: a gain >= {margin:.3g} is ruled out (TOST p {upper:.2g}, sign-flip {upper_exact:.2g})"
    tost_note = ""
    if upper < alpha:  # the t version alone: say so, with the exact one's p
        tost_note = f"; TOST p {upper:.2g} but sign-flip {upper_exact:.2g}: a gain >= {margin:.3g} not excluded"
    if judged is not None and not math.isnan(judged.mde_at_alpha):
        return f"not detected (MDE {judged.mde_at_alpha:.3g} at alpha {judged.alpha:.2g}{tost_note})"
    return _untested_or_not_detected(p, pairs, "the paired differences")


def _untested_or_not_detected(p: float, seeds: int, tested: str) -> str:
    """The last words of every verdict: an undefined p is "not tested", with why (no spread in ``tested`` over 2 or
    more seeds, or fewer than 2 seeds); a defined one that rejected nothing, "not detected"."""
    if not math.isnan(p):
        return "not detected"
    return f"not tested ({tested} have no spread)" if seeds >= 2 else "not tested (fewer than 2 seeds)"
