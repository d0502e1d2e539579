"""One arm's row of a report, typed: its values, its tests against the baseline arm and the verdict rule's reading.

``report.statistics.summarize`` builds a :class:`Comparison` per arm, :func:`lapheads.study.verdicts.apply_rule`
adds its :class:`Judgement` (and :class:`Equivalence` where a margin applies) and verdict, the mechanism section its
:class:`ZeroTest`; the tables render them; stats.json stores :meth:`Comparison.to_json`, whose keys and their order
are those the reports have always had (a restated or rebuilt report is byte-identical).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, TypedDict

__all__ = ["Comparison", "Equivalence", "Judgement", "PairedTest", "ZeroTest", "per_seed_values", "rows_json"]


class PairedTest(TypedDict):
    """A paired comparison of a[s] - b[s] over the seeds both have (``report.statistics.paired_test``), as
    stats.json stores it: NaN where fewer than two seeds pair up."""

    n_pairs: int
    mean_difference: float
    ci_low: float
    ci_high: float
    t: float
    df: float
    p: float
    mde: float


@dataclass
class Judgement:
    """The verdict rule's reading of a compared row (:func:`lapheads.study.verdicts.apply_rule`)."""

    role: str  # "primary", "declared" (a Holm family) or "secondary" (uncorrected)
    alpha: float  # the row's design alpha (alpha / m in a family)
    direction: int | None  # the contrast's claim on this metric: +1 rises, -1 falls, None no claim
    mde_at_alpha: float
    permutation_p: float  # exact sign flips of the paired differences
    signs: str  # "5/6": seeds in the claimed direction
    contrast_claim: str
    p_holm: float = math.nan  # NaN outside a family
    holm_alpha: float | None = None  # the alpha of the Holm step the row faced (family members only)


@dataclass
class ZeroTest:
    """A mechanism row's one-sample test against 0, Holm across a spec's rows."""

    p_holm: float
    alpha: float
    mde_at_alpha: float


@dataclass
class Equivalence:
    """Both halves of the TOST against a margin, by the t distribution and by exact sign flips."""

    margin: float | None
    tost_p: float = math.nan  # H0: gain >= margin
    tost_lower_p: float = math.nan  # H0: gain <= -margin
    tost_sign_flip_p: float = math.nan
    tost_lower_sign_flip_p: float = math.nan


@dataclass
class Comparison:
    """One arm's row of a metric: its per-seed values and, where the baseline arm is there, the tests against it;
    the verdict rule then adds its reading. stats.json stores :meth:`to_json` (these keys, in this order)."""

    n: int
    mean: float
    std: float
    values: dict[int, float]  # seed -> value
    baseline: str
    paired: PairedTest | None = None  # paired_test against the baseline (None: the baseline's own row)
    welch: dict[str, float] | None = None
    baseline_mean: float | None = None
    test: str | None = None  # the test the rule reads: "paired", or "welch" where fewer than two seeds pair up
    arm: str | None = None  # a plan's contrast against another baseline: the arm it compares
    judgement: Judgement | None = None
    zero_test: ZeroTest | None = None
    equivalence: Equivalence | None = None
    verdict: str | None = None

    @property
    def compared(self) -> bool:
        return self.test is not None

    def to_json(self) -> dict[str, Any]:
        """stats.json's row: the fields set, a reading's fields inline (a family's Holm step only where it had one)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (Judgement, ZeroTest, Equivalence)):
                out.update({k: v for k, v in asdict(value).items() if not (k == "holm_alpha" and v is None)})
            elif value is not None:
                out[f.name] = value
        return out


def rows_json(table: dict[str, dict[str, Comparison]]) -> dict[str, dict[str, dict[str, Any]]]:
    """label -> key -> row, as stats.json stores it."""
    return {label: {key: row.to_json() for key, row in rows.items()} for label, rows in table.items()}


def per_seed_values(values: dict[str, Any]) -> dict[int, float]:
    """A stored row's ``{seed: value}`` read back: seeds spelled as plain integers, values finite real numbers (a
    bool, a string, a NaN or an infinity is no measurement), else ValueError naming the entry."""
    out: dict[int, float] = {}
    for key, value in values.items():
        if not (isinstance(key, str) and key.isdigit() and key == str(int(key))):
            raise ValueError(f"seed key {key!r}; allowed: a plain integer such as '0'")
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ValueError(f"seed {key}: value {value!r}; allowed: a finite number")
        out[int(key)] = float(value)
    return out
