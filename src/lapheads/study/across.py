"""``lapheads across``: one arm against a baseline across recipes (learning rates, schedules), from reports.

A study that compares head kinds at one recipe invites the question "was the recipe tuned for the baseline?". The
answer is a second and third sweep at other recipes (the fair-tuning folders: lr 0.5x and 2x) and one reading
across them, from the reports' stats.json alone (they keep every cell's per-seed value), fixed in the plans before
the data:

* **means**: each of the two arms at each recipe, mean over the seeds *every* recipe has (a reference sweep with
  more seeds is read on the common ones, so the columns compare like with like);
* **handicap tests**: the arm at each other recipe against the baseline at the reference recipe, paired by seed,
  one-sided in the better direction at ``alpha`` (a paired t-test; a one-sided test at alpha is the upper half of a
  two-sided one at 2 alpha, so its MDE is :func:`lapheads.study.verdicts.mde` at 2 alpha);
* **the reading**: "handicapped" when any handicap test rejects, or when the arm's best recipe (by mean) is not
  the reference while the baseline's is; otherwise "not handicapped within the recipes tried" (which is no more
  than the recipes tried and the MDEs can say);
* **beside the reading, the arm x recipe interaction** at each other recipe: (arm - baseline at the recipe) minus
  (arm - baseline at the reference), paired by seed, two-sided at 2 alpha (the handicap tests' one-sided alpha on
  either side), with each arm's own change between the two recipes. The trigger above compares the arm at another
  recipe with the baseline at the reference, so it fires as well when the other recipe suits *both* arms better;
  only the interaction says whether the change is the arm's own, and the reading states it beside the trigger.

Bad input is refused in one line, never read as an answer: per-seed values that are not finite real numbers, seed
keys that are not plain integers ("0", not "00"), one report given under two labels (or through a link), and
differences with no spread (no t-test exists).

Each input's code revisions (as its records name them) are carried into the output: a reader must see which code
trained which column.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lapheads.errors import SweepError
from lapheads.io import atomic_write_text, json_loads, read_regular_text
from lapheads.study.cells import cell_name
from lapheads.study.comparison import per_seed_values
from lapheads.study.verdicts import MIN_ALPHA, mde

#: what ``lapheads across`` writes into an output folder (and the only files it will replace there)
OUTPUTS = ("across.md", "across.json")
WRITER = "lapheads across"


@dataclass(frozen=True)
class Recipe:
    """One report's per-seed values of one metric: ``values[arm][seed]``."""

    label: str
    source: str
    values: dict[str, dict[int, float]]
    code_revisions: dict[str, list[str]]


@dataclass(frozen=True)
class HandicapTest:
    """The arm at ``recipe`` minus the baseline at the reference recipe, paired by seed, one-sided."""

    recipe: str
    n_pairs: int
    mean_difference: float
    t: float
    df: int
    p_one_sided: float
    mde: float
    rejects: bool


@dataclass(frozen=True)
class PairedChange:
    """A paired mean difference over seeds with its two-sided interval, p and MDE at one level."""

    mean_difference: float
    ci_low: float
    ci_high: float
    p: float
    mde: float
    moved_up: int  # seeds whose difference is > 0
    n_pairs: int


@dataclass(frozen=True)
class Interaction:
    """At ``recipe``, against the reference: the arm x recipe interaction (the gap's change) and each arm's lift."""

    recipe: str
    gap: PairedChange  # arm - baseline at the recipe, paired by seed
    reference_gap: PairedChange  # arm - baseline at the reference, on the same seeds
    interaction: PairedChange  # gap - reference gap, paired by seed
    baseline_lift: PairedChange  # baseline at the recipe - baseline at the reference
    arm_lift: PairedChange  # arm at the recipe - arm at the reference
    detected: bool  # the interaction's two-sided p < 2 alpha


@dataclass(frozen=True)
class AcrossReading:
    """The reading of ``arm`` against ``baseline`` across recipes, with what it rests on (across.json)."""

    metric: str
    arm: str
    baseline: str
    reference: str
    alpha: float
    higher_is_better: bool
    seeds: list[int]
    means: dict[str, dict[str, float]]  # means[arm or baseline][recipe], over ``seeds``
    best: dict[str, str]  # the recipe with the best mean, for the arm and for the baseline
    tests: list[HandicapTest]
    handicapped: bool
    why: str
    interactions: list[Interaction]
    specific: str  # what the interaction says beside the reading, in words
    recipes: list[Recipe]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["recipes"] = [
            {**asdict(r), "values": {a: {str(s): v for s, v in by.items()} for a, by in r.values.items()}}
            for r in self.recipes
        ]
        return {"written_by": WRITER, **out}


def load_recipe(label: str, stats_file: str | Path, metric: str) -> Recipe:
    """``metric``'s per-seed values from a report's stats.json (its metrics or geometry rows)."""
    try:
        saved = json_loads(read_regular_text(stats_file))
        rows = {**saved["metrics"], **saved.get("geometry", {})}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise SweepError(f"{stats_file} is not a lapheads report stats.json ({type(err).__name__}: {err})") from None
    if metric not in rows:
        raise SweepError(f"metric {metric!r} not in {stats_file}; allowed: {', '.join(sorted(rows))}")
    try:
        values = {str(arm): per_seed_values(row["values"]) for arm, row in rows[metric].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise SweepError(f"{stats_file}: {metric!r} holds no per-seed values ({type(err).__name__}: {err})") from None
    revisions = saved.get("code_revisions") or _revisions_of_records(Path(stats_file).parent.parent)
    return Recipe(label, str(stats_file), values, dict(revisions))


def _revisions_of_records(folder: Path) -> dict[str, list[str]]:
    """The revisions the records beside a report name (``RECORDS/report/stats.json``), for a stats.json written
    before reports kept them; {} where there are none."""
    from lapheads.runs.records import RecordError, load_records

    try:
        records = load_records(folder) if (folder / "plan.json").is_file() else []
    except RecordError:
        return {}
    by_revision: dict[str, list[str]] = {}
    for record in records:
        revision = (record.data.get("environment") or {}).get("git_revision")
        if revision:
            by_revision.setdefault(str(revision), []).append(record.name)
    return by_revision


def _one_sided(arm: dict[int, float], baseline: dict[int, float], sign: int, alpha: float, recipe: str) -> HandicapTest:
    """scipy's paired t-test of arm - baseline over their common seeds (>= 2, as read_across ensures), one-sided in
    the better direction, with the MDE of that test."""
    import numpy as np
    from scipy import stats

    seeds = sorted(set(arm) & set(baseline))
    a, b = np.array([arm[s] for s in seeds]), np.array([baseline[s] for s in seeds])
    n, diff = len(seeds), a - b
    se = float(diff.std(ddof=1)) / math.sqrt(n)
    if not se > 0:  # identical differences: no t-test exists, and no reading may rest on one
        raise SweepError(
            f"{recipe}: differences {diff.tolist()} have no spread; no t-test exists; allowed: values that vary"
        )
    test = stats.ttest_rel(a, b, alternative="greater" if sign > 0 else "less")
    p = float(test.pvalue)
    return HandicapTest(
        recipe, n, float(diff.mean()), float(test.statistic), n - 1, p, mde(se, n - 1, 2 * alpha), p < alpha
    )


def _paired_change(after: dict[int, float], before: dict[int, float], level: float) -> PairedChange:
    """after - before over their common seeds: mean, the (1 - level) interval, scipy's two-sided paired t-test and
    the MDE at ``level``; NaN for each where the differences have no spread (no t-test exists: "not tested")."""
    import numpy as np
    from scipy import stats

    seeds = sorted(set(after) & set(before))
    diff = np.array([after[s] - before[s] for s in seeds])
    n, mean = len(seeds), float(diff.mean())
    se = float(diff.std(ddof=1)) / math.sqrt(n)
    if not se > 0:
        return PairedChange(mean, math.nan, math.nan, math.nan, math.nan, int((diff > 0).sum()), n)
    half = float(stats.t.ppf(1 - level / 2, n - 1)) * se
    p = float(stats.ttest_rel([after[s] for s in seeds], [before[s] for s in seeds]).pvalue)
    return PairedChange(mean, mean - half, mean + half, p, mde(se, n - 1, level), int((diff > 0).sum()), n)


def _interaction(recipe: Recipe, reference: Recipe, arm: str, baseline: str, seeds: list[int], alpha: float):
    """The arm x recipe interaction at ``recipe`` (module docstring), two-sided at 2 alpha, on ``seeds`` alone."""
    here, there = ({a: {s: r.values[a][s] for s in seeds} for a in (arm, baseline)} for r in (recipe, reference))
    gap = {s: here[arm][s] - here[baseline][s] for s in seeds}
    reference_gap = {s: there[arm][s] - there[baseline][s] for s in seeds}
    interaction = _paired_change(gap, reference_gap, 2 * alpha)
    return Interaction(
        recipe.label,
        _paired_change(here[arm], here[baseline], 2 * alpha),
        _paired_change(there[arm], there[baseline], 2 * alpha),
        interaction,
        _paired_change(here[baseline], there[baseline], 2 * alpha),
        _paired_change(here[arm], there[arm], 2 * alpha),
        interaction.p < 2 * alpha,
    )


def read_across(
    recipes: list[Recipe], reference: str, arm: str, baseline: str, alpha: float, higher_is_better: bool, metric: str
) -> AcrossReading:
    """The pre-registered reading (module docstring) of ``arm`` against ``baseline`` across ``recipes``."""
    labels = [r.label for r in recipes]
    if len(set(labels)) != len(labels) or len(recipes) < 2:
        raise SweepError(f"recipes {labels}; allowed: two or more, each label once")
    files = [Path(r.source).resolve() for r in recipes]
    for i, file in enumerate(files):
        if file in files[:i]:
            raise SweepError(
                f"{recipes[i].label}={recipes[i].source} is the report {recipes[files.index(file)].label} already "
                "names; allowed: each report once"
            )
    if reference not in labels:
        raise SweepError(f"--reference {reference!r}; allowed: one of the recipes ({', '.join(labels)})")
    if arm == baseline:
        raise SweepError(f"--arm {arm!r} is the baseline; allowed: another arm of the reports")
    if not MIN_ALPHA <= alpha < 0.5:
        raise SweepError(f"--alpha {alpha}; allowed: a level in [{MIN_ALPHA:g}, 0.5) (one-sided)")
    for r in recipes:
        for name in (arm, baseline):
            if name not in r.values:
                raise SweepError(f"arm {name!r} not in {r.source}; allowed: {', '.join(sorted(r.values))}")
    by_label = {r.label: r for r in recipes}
    seeds = sorted(set.intersection(*(set(r.values[a]) for r in recipes for a in (arm, baseline))))
    if len(seeds) < 2:
        raise SweepError(f"seeds every recipe has for arms {arm} and {baseline}: {seeds}; allowed: two or more")
    sign = 1 if higher_is_better else -1
    means = {a: {r.label: sum(r.values[a][s] for s in seeds) / len(seeds) for r in recipes} for a in (arm, baseline)}
    best = {a: max(labels, key=lambda label, a=a: sign * means[a][label]) for a in (arm, baseline)}
    reference_baseline = {s: by_label[reference].values[baseline][s] for s in seeds}
    tests = [
        _one_sided({s: r.values[arm][s] for s in seeds}, reference_baseline, sign, alpha, r.label)
        for r in recipes
        if r.label != reference
    ]
    interactions = [
        _interaction(r, by_label[reference], arm, baseline, seeds, alpha) for r in recipes if r.label != reference
    ]
    beaten = [t.recipe for t in tests if t.rejects]
    moved = best[arm] != reference and best[baseline] == reference
    if beaten:
        why = f"{arm} at {', '.join(beaten)} beats {baseline} at {reference} (one-sided, alpha {alpha:g})"
    elif moved:
        why = f"{arm}'s best recipe is {best[arm]}, {baseline}'s is {reference}"
    else:
        why = (
            f"no recipe lets {arm} beat {baseline} at {reference} (one-sided, alpha {alpha:g}), and {arm}'s best "
            f"recipe is {best[arm]} with {baseline}'s {best[baseline]}"
        )
    return AcrossReading(
        metric,
        arm,
        baseline,
        reference,
        alpha,
        higher_is_better,
        seeds,
        means,
        best,
        tests,
        bool(beaten or moved),
        why,
        interactions,
        _interaction_words(interactions, arm, 2 * alpha),
        recipes,
    )


def _interaction_words(interactions: list[Interaction], arm: str, level: float) -> str:
    """What the interaction says beside the reading: where it is detected, not detected, or not tested."""
    found = [i.recipe for i in interactions if i.detected]
    untested = [i.recipe for i in interactions if math.isnan(i.interaction.p)]
    words = []
    if found:
        words.append(f"the arm x recipe interaction is detected at {', '.join(found)} (two-sided, alpha {level:g})")
    if untested:
        words.append(f"the arm x recipe interaction is not tested at {', '.join(untested)} (no spread)")
    if not found and len(untested) < len(interactions):
        where = "at any recipe" if not untested else "at the other recipes"
        words.append(
            f"the arm x recipe interaction is not detected {where} (two-sided, alpha {level:g}): what moves {arm} "
            f"is not shown to be {arm}'s own; the trigger fires as well for a recipe that suits both arms better"
        )
    return "; ".join(words)


def render(reading: AcrossReading) -> str:
    """across.md: the means table, the handicap tests, the reading, and which code trained each column."""
    r = reading
    labels = [x.label for x in r.recipes]
    lines = [
        f"# {r.arm} against {r.baseline} across recipes: {r.metric}",
        "",
        f"Seeds every recipe has: {', '.join(map(str, r.seeds))} (n = {len(r.seeds)}); reference recipe: "
        f"{r.reference}; {'higher' if r.higher_is_better else 'lower'} is better.",
        "",
        "| arm | " + " | ".join(labels) + " | best |",
        "|---|" + "---:|" * len(labels) + "---|",
    ]
    for a in (r.baseline, r.arm):
        lines.append(f"| {a} | " + " | ".join(f"{r.means[a][label]:.2f}" for label in labels) + f" | {r.best[a]} |")
    lines += [
        "",
        f"Handicap tests: {r.arm} at each recipe minus {r.baseline} at {r.reference}, paired by seed, one-sided "
        f"({'a gain' if r.higher_is_better else 'a fall'}) paired t-test at alpha {r.alpha:g}; MDE at 80 % power.",
        "",
        "| recipe | pairs | mean difference | t | p (one-sided) | MDE | rejects |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for t in r.tests:
        lines.append(
            f"| {t.recipe} | {t.n_pairs} | {t.mean_difference:+.2f} | {t.t:.2f} | {t.p_one_sided:.3g} | "
            f"{t.mde:.2f} | {'yes' if t.rejects else 'no'} |"
        )
    level = 2 * r.alpha
    lines += [
        "",
        f"Beside them, the {r.arm} x recipe interaction: ({r.arm} - {r.baseline} at the recipe) minus ({r.arm} - "
        f"{r.baseline} at {r.reference}), paired by seed, two-sided at alpha {level:g} with its {1 - level:.0%} "
        f"interval; and each arm's own change from {r.reference} to the recipe (seeds that rose).",
        "",
        f"| recipe | gap there | gap at {r.reference} | interaction | p | MDE | {r.baseline}'s change | "
        f"{r.arm}'s change |",
        "|---|---|---|---|---:|---:|---|---|",
    ]
    for i in r.interactions:
        lines.append(
            f"| {i.recipe} | {_interval(i.gap)} | {_interval(i.reference_gap)} | {_interval(i.interaction)} | "
            f"{i.interaction.p:.3g} | {i.interaction.mde:.2f} | {_interval(i.baseline_lift)} "
            f"({i.baseline_lift.moved_up}/{i.baseline_lift.n_pairs}) | {_interval(i.arm_lift)} "
            f"({i.arm_lift.moved_up}/{i.arm_lift.n_pairs}) |"
        )
    verdict = "handicapped" if r.handicapped else "not handicapped within the recipes tried"
    lines += ["", f"**Reading: {verdict}** ({r.why}); beside it, {r.specific}.", ""]
    lines += ["Inputs, and the code revisions their records name:", ""]
    compared = {cell_name(a, s) for a in (r.arm, r.baseline) for s in r.seeds}  # the cells these tables read
    for x in r.recipes:
        named = {rev: [c for c in cells if c in compared] for rev, cells in x.code_revisions.items()}
        revisions = "; ".join(f"{rev[:7]}: {', '.join(cells)}" for rev, cells in named.items() if cells)
        lines.append(f"- {x.label}: {x.source} ({revisions or 'no record names one'})")
    return "\n".join(lines) + "\n"


def _interval(change: PairedChange) -> str:
    return f"{change.mean_difference:+.2f} [{change.ci_low:+.2f}, {change.ci_high:+.2f}]"


def write_across(reading: AcrossReading, out: str | Path) -> Path:
    """across.md and across.json into ``out``; refuses to replace a file there that lapheads across did not write."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    md, js = (folder / name for name in OUTPUTS)
    if js.exists():
        try:
            ours = json_loads(js.read_text()).get("written_by") == WRITER
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            ours = False
        if not ours:
            raise SweepError(f"{js} exists and was not written by {WRITER}; allowed: a new folder or its own output")
    elif md.exists():
        raise SweepError(f"{md} exists without its across.json; allowed: a new folder or {WRITER}'s own output")
    atomic_write_text(js, json.dumps(reading.to_json(), indent=1) + "\n")
    atomic_write_text(md, render(reading))
    return md
