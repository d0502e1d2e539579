"""The statistics of a sweep report: paired tests against the baseline arm, Holm, the change over the last
quarter, the gap over training, geometry and diffusion scores read from every cell's cached analysis."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lapheads.errors import SweepError
from lapheads.study.comparison import Comparison, PairedTest, ZeroTest
from lapheads.study.recordset import RecordSet
from lapheads.study.verdicts import ALPHA, POWER, holm_steps, mde, mechanism_verdict
from lapheads.tasks import get_task
from lapheads.tasks.metrics import Metric, claim, logged

# the headline metrics, geometry rows and geometry layers of each task are in lapheads.tasks (Task.headline, ...)


def welch_t_test(a: list[float], b: list[float]) -> dict[str, float]:
    """Two-sided Welch t-test of mean(a) - mean(b): t, degrees of freedom, p."""
    from scipy.special import stdtr

    a_, b_ = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a_) < 2 or len(b_) < 2:
        return {"t": math.nan, "df": math.nan, "p": math.nan}
    va, vb = a_.var(ddof=1) / len(a_), b_.var(ddof=1) / len(b_)
    if va + vb == 0:
        return {"t": math.nan, "df": math.nan, "p": math.nan}
    t = (a_.mean() - b_.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a_) - 1) + vb**2 / (len(b_) - 1))
    return {"t": float(t), "df": float(df), "p": float(2 * stdtr(df, -abs(t)))}


class LateChange(PairedTest):
    """One arm's change over the last part of training (:func:`late_change`): each seed's last evaluation minus its
    first at or after the window's start, tested against 0."""

    from_step: int
    to_step: int
    still_improving: bool | None  # the interval excludes 0 in the better direction; None: one seed


class FitRow(PairedTest):
    """One arm's fit against test (:func:`fit_against_test`): fit top-1 minus test top-1, tested over seeds."""

    fit_top1: float
    against_baseline: dict[str, PairedTest] | None  # fit top-1, fit loss, test loss minus the baseline's


def paired_test(a: dict[int, float], b: dict[int, float]) -> PairedTest:
    """Paired comparison of a[s] - b[s] over the seeds s both have: mean difference, its t-based 95% interval, the
    two-sided paired t-test, and the minimum detectable effect (80% power, alpha 0.05) at the observed spread."""
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    diff = np.array([a[s] - b[s] for s in seeds], dtype=float)
    out: PairedTest = {
        "n_pairs": len(seeds),
        "mean_difference": float(diff.mean()) if len(diff) else math.nan,
        "ci_low": math.nan,
        "ci_high": math.nan,
        "t": math.nan,
        "df": math.nan,
        "p": math.nan,
        "mde": math.nan,
    }
    if len(diff) < 2:
        return out
    df = len(diff) - 1
    se = float(diff.std(ddof=1)) / math.sqrt(len(diff))
    critical = float(stats.t.ppf(1 - ALPHA / 2, df))
    out.update(
        df=float(df),
        ci_low=out["mean_difference"] - critical * se,
        ci_high=out["mean_difference"] + critical * se,
        mde=(critical + float(stats.t.ppf(POWER, df))) * se,
    )
    if se > 0:
        t = out["mean_difference"] / se
        out.update(t=float(t), p=float(2 * stats.t.sf(abs(t), df)))
    return out


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of a family of p-values (NaN entries stay NaN and do not count): the rule's
    own (:func:`lapheads.study.verdicts.holm_steps`), without the alphas."""
    return holm_steps(p_values)[0]


def _final(run: Any, metric: Metric) -> float | None:
    """One finished cell's value of ``metric``, or None where the run has not produced it."""
    if metric.source == "metrics":
        return run.last_metric(metric.path[0])
    value: Any = run.read_report(metric.source)
    for key in metric.path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


#: what follows a revision in a report's code revisions when a cell's code was not that commit
UNCOMMITTED_MARK = "+uncommitted"


def code_revisions(study: RecordSet) -> dict[str, list[str]]:
    """The lapheads revisions that trained the cells (``environment.git_revision``, which the training process wrote
    into config.json and a record copies), each with its cells' names; {} where no cell says. A cell whose code had
    uncommitted changes (``environment.git_uncommitted``) is listed under ``<revision>+uncommitted``: it was trained
    by no commit."""
    by_revision: dict[str, list[str]] = {}
    for cell in study.cells:
        env = cell.data.get("environment") or {}
        revision = env.get("git_revision")
        if revision:
            key = f"{revision}{UNCOMMITTED_MARK}" if env.get("git_uncommitted") else str(revision)
            by_revision.setdefault(key, []).append(cell.name)
    return by_revision


def collect(cells: RecordSet, metric: Metric) -> dict[str, dict[int, float]]:
    """{spec: {seed: value of metric}} over the study's finished cells."""
    values: dict[str, dict[int, float]] = {spec: {} for spec in cells.specs}
    for cell in cells.cells:
        value = _final(cell, metric)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SweepError(
                    f"cell {cell.spec} seed {cell.seed}: {metric.label} is {value!r}; allowed: a finite number "
                    "(a run that diverged has no value to compare: rerun it or leave its arm out)"
                )
            if metric.label.endswith("(%)") and not 0 <= value <= 100:  # a hand-edited or corrupt record
                raise SweepError(
                    f"cell {cell.spec} seed {cell.seed}: {metric.label} is {value!r}; allowed: a percentage in [0, 100]"
                )
            values[cell.spec][cell.seed] = value
    return values


def _series(cells: RecordSet, metric: Metric) -> dict[str, dict[int, dict[int, float]]]:
    """{spec: {step: {seed: value}}} of a metric logged in metrics.jsonl at every evaluation ({} for others)."""
    if metric.source != "metrics":
        return {}
    key = metric.path[0]
    series: dict[str, dict[int, dict[int, float]]] = {spec: {} for spec in cells.specs}
    for cell in cells.cells:
        for entry in cell.read_metrics():
            if key in entry and "step" in entry:
                series[cell.spec].setdefault(int(entry["step"]), {})[cell.seed] = float(entry[key])
    return series


def late_change(cells: RecordSet, metric: Metric, fraction: float = 0.25) -> dict[str, LateChange]:
    """Is the metric still moving at the end? Per spec, each seed's change over the last ``fraction`` of training
    (last evaluation minus the first evaluation at or after (1 - fraction) of the last step), its mean over seeds,
    t-based 95% interval, and "still improving" when that interval excludes 0 in the metric's better direction."""
    better = metric.better
    out: dict[str, LateChange] = {}
    for spec, by_step in _series(cells, metric).items():
        steps = sorted(by_step)
        if len(steps) < 2:
            continue
        start = next(step for step in steps if step >= (1 - fraction) * steps[-1])
        start = start if start != steps[-1] else steps[-2]
        change = {
            seed: by_step[steps[-1]][seed] - v for seed, v in by_step[start].items() if seed in by_step[steps[-1]]
        }
        if not change:
            continue
        test = paired_test(change, dict.fromkeys(change, 0.0))
        improving = (  # None: one seed, no interval to decide it
            None if math.isnan(test["ci_low"]) else (test["ci_low"] > 0 if better > 0 else test["ci_high"] < 0)
        )
        out[spec] = {"from_step": start, "to_step": steps[-1], **test, "still_improving": improving}
    return out


_FIT, _TEST = logged("fit_top1"), logged("eval_top1")


# against the baseline: a regularising bias fits less (fit top-1 down, fit loss up) and generalises better (test
# loss down); at a fit top-1 near 100% only the losses can still show it
AGAINST_BASELINE = {
    "fit top-1": _FIT,
    "fit loss": logged("fit_loss"),
    "test loss": logged("eval_loss"),
}


def fit_against_test(cells: RecordSet, baseline: str = "0") -> dict[str, FitRow]:
    """Per spec, the final top-1 on training images without augmentation (``--fit-subset``) and on the test set,
    their paired difference over seeds (fit - test; near 0: the model does not even fit its training data), and
    under "against_baseline" the paired differences from the baseline spec of the fit top-1, the fit loss and the
    test loss (None for the baseline itself, or without baseline cells). {} when no finished cell logged a fit
    score."""
    fit, test = collect(cells, _FIT), collect(cells, _TEST)
    others = {name: collect(cells, metric) for name, metric in AGAINST_BASELINE.items()}
    out: dict[str, FitRow] = {}
    for spec, by_seed in fit.items():
        if by_seed:
            against = None
            if spec != baseline and fit.get(baseline):
                against = {name: paired_test(values[spec], values[baseline]) for name, values in others.items()}
            mean = float(np.mean(list(by_seed.values())))
            out[spec] = {"fit_top1": mean, **paired_test(by_seed, test[spec]), "against_baseline": against}
    return out


def gap_over_training(cells: RecordSet, metric: Metric, baseline: str = "0") -> dict[str, list[dict]]:
    """{spec: [paired_test of spec - baseline at one step, with "step"], ...} for a metric logged in metrics.jsonl
    at every evaluation; a step is listed where at least one seed has both arms."""
    series = _series(cells, metric)
    if baseline not in series:
        return {}
    gaps = {}
    for spec, by_step in series.items():
        if spec == baseline:
            continue
        rows = []
        for step in sorted(set(by_step) & set(series[baseline])):
            test = paired_test(by_step[step], series[baseline][step])
            if test["n_pairs"]:
                rows.append({"step": step, **test})
        if rows:
            gaps[spec] = rows
    return gaps


def mechanism_over_training(cells: RecordSet) -> dict[str, dict[str, list[dict]]]:
    """When do heads turn diffusive? {"diffusion score, Laplacian heads" / "... ordinary heads": {spec: [the
    seeds' mean score over blocks at one step, tested against 0 (``paired_test`` against a zero arm), with
    "step"], ...}} at every checkpoint the finished cells kept. Read from the weights alone (no data), so each
    kept step costs one model load."""
    scores: dict[str, dict[str, dict[int, dict[int, float]]]] = {}
    for cell in cells.cells:
        by_step = cell.checkpoint_heads  # a record keeps every kept checkpoint's scores
        for step, blocks in sorted(by_step.items()):
            heads = [head for block in blocks for head in block]
            for kind in ("Laplacian", "ordinary"):
                kind_scores = [_diffusion_of(head) for head in heads if _kind_of(head) == kind.lower()]
                if kind_scores:
                    series = scores.setdefault(f"diffusion score, {kind} heads", {}).setdefault(cell.spec, {})
                    series.setdefault(step, {})[cell.seed] = float(np.mean(kind_scores))

    def against_zero(by_seed: dict[int, float]) -> dict[str, Any]:
        return paired_test(by_seed, dict.fromkeys(by_seed, 0.0))

    return {
        label: {
            spec: [{"step": step, **against_zero(by_seed)} for step, by_seed in sorted(by_step.items())]
            for spec, by_step in scores[label].items()
        }
        for label in sorted(scores, key=lambda label: "ordinary" in label)  # Laplacian heads first
    }


def settled_from(rows: list[dict]) -> tuple[int, int] | None:
    """(side, step): the first step from which on every step's 95% interval lies on one side of 0 (+1 above,
    -1 below), that side being the last step's; None when the last step's interval includes 0 (or is undefined)."""
    settled = None
    for row in rows:
        side = 0 if math.isnan(row["ci_low"]) else (1 if row["ci_low"] > 0 else -1 if row["ci_high"] < 0 else 0)
        if side == 0:  # the interval holds 0 (or there is none): whatever came before does not count
            settled = None
        elif settled is None or settled[0] != side:
            settled = (side, row["step"])
    return settled


def summarize(values: dict[str, dict[int, float]], baseline: str = "0") -> dict[str, Comparison]:
    """Per spec: n, mean, std, and (if the baseline spec is present) the paired test against it (Welch's unpaired
    test as well, used in its place when fewer than two seeds pair up)."""
    out = {}
    for spec, by_seed in values.items():
        xs = list(by_seed.values())
        row = Comparison(
            n=len(xs),
            mean=float(np.mean(xs)) if xs else math.nan,
            std=float(np.std(xs, ddof=1)) if len(xs) > 1 else math.nan,
            values=by_seed,
            baseline=baseline,
        )
        if spec != baseline and baseline in values:
            row.paired = paired_test(by_seed, values[baseline])
            row.welch = welch_t_test(xs, list(values[baseline].values()))
            baseline_values = list(values[baseline].values())
            row.baseline_mean = float(np.mean(baseline_values)) if baseline_values else math.nan
            row.test = "paired" if row.paired["n_pairs"] >= 2 else "welch"
        out[spec] = row
    return out


Values = dict[str, dict[str, dict[int, float]]]  # row label -> spec -> seed -> value


def geometry_values(study: RecordSet) -> tuple[Values, Values]:
    """(geometry rows, mechanism rows) from every finished cell's analysis (its record's ``lapheads analyze``)."""
    task = get_task(study.task)
    metrics, where = task.geometry, task.geometry_layers
    out: Values = {f"{m.label} ({w})": {s: {} for s in study.specs} for w in where for m in metrics}
    mechanism: Values = {}
    twins: dict[tuple[str, int], dict[tuple[str, int], dict[str, Any]]] = {}
    cells = study.cells
    missing = [cell.name for cell in cells if cell.analysis is None]
    if missing and len(missing) < len(cells):  # some analysed, some not: the rows would drop seeds without a word
        raise SweepError(
            f"{len(missing)} of {len(cells)} cells have no analysis ({', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}); allowed: every cell analysed (rebuild its record from its run) "
            "or none (--no-geometry)"
        )
    for cell in cells:
        analysis = cell.analysis
        if analysis is None:
            continue
        for label, value in _diffusion_scores(analysis).items():
            mechanism.setdefault(label, {s: {} for s in study.specs})[cell.spec][cell.seed] = value
        twins[(cell.spec, cell.seed)] = _measured_heads(analysis)
        layers = {"last block": [n for n in analysis["layers"] if n.isdigit()][-1], "after the final norm": "norm"}
        for w in where:
            for metric in metrics:
                value: Any = analysis["per_layer"].get(layers[w], {})
                for key in metric.path:
                    value = value.get(key) if isinstance(value, dict) else None
                if value is not None:
                    out[f"{metric.label} ({w})"][cell.spec][cell.seed] = float(value)
    _against_k0(mechanism)
    _against_twins(mechanism, twins)
    # a metric no cell's analysis holds (an analysis version before it: the LM's within-sequence fraction before
    # version 6) is no row, not a row of empty cells; a report of older records restates as it was built
    return {label: by_spec for label, by_spec in out.items() if any(by_spec.values())}, mechanism


NULL_ROW = "null: ordinary heads read as Laplacian (mean over blocks)"


EXCESS_ROW = "Laplacian excess over ordinary heads (same block)"


AGAINST_K0_ROW = "Laplacian excess over ordinary heads (k = 0 run, paired by seed)"


def _diffusion_scores(analysis: dict[str, Any]) -> dict[str, float]:
    """Mean diffusion score of a run's Laplacian and of its ordinary heads over every analysed block, the
    Laplacian heads' per block, the null (ordinary heads' circuits read as if Laplacian) and the Laplacian heads'
    excess over the null of their own blocks; a kind absent from the run gives no row."""
    rows: dict[str, float] = {}
    layers = [(block, layer.get("mechanism") or {}) for block, layer in analysis["per_layer"].items()]
    for kind, key in (("Laplacian", "laplacian_diffusion"), ("ordinary", "ordinary_diffusion")):
        heads = [_diffusion_of(h) for _, m in layers for h in m.get("heads", []) if _kind_of(h) == kind.lower()]
        if heads:
            rows[f"diffusion score, {kind} heads (mean over blocks)"] = float(np.mean(heads))
        if kind == "Laplacian":
            for block, mechanism in layers:
                if mechanism.get(key) is not None:
                    rows[f"diffusion score, Laplacian heads (block {block})"] = float(mechanism[key])
    null = [
        h["as_laplacian"]
        for _, m in layers
        for h in m.get("heads", [])
        if _kind_of(h) == "ordinary" and "as_laplacian" in h
    ]
    if null:
        rows[NULL_ROW] = float(np.mean(null))
    excess = [
        m["laplacian_diffusion"] - m["ordinary_as_laplacian"]
        for _, m in layers
        if m.get("laplacian_diffusion") is not None and m.get("ordinary_as_laplacian") is not None
    ]
    if excess:
        rows[EXCESS_ROW] = float(np.mean(excess))
    return rows


def _diffusion_of(head: dict[str, Any]) -> float:
    """A Laplacian or ordinary head's diffusion score by the kind-aware convention (analysis version 5: both kinds
    lower the within-sequence variance when their circuit is -c P, so both score -alignment). Analyses before it
    stored +alignment for ordinary heads; they are read by the same convention, so every run of a report agrees."""
    return head["diffusion"] if "expected_sign" in head else -head["alignment"]


def _kind_of(head: dict[str, Any]) -> str:
    """A head's kind as analyze recorded it (older analyses: Laplacian or ordinary); only ordinary heads are
    ordinary here, and only Laplacian heads Laplacian."""
    if "kind" in head:
        return head["kind"]
    return "laplacian" if head["laplacian"] else "ordinary"


def _against_k0(mechanism: Values) -> None:
    """Add each spec's Laplacian heads minus the k = 0 run's null, seed by seed (the same initialisation and data
    order: what an ordinary head's circuit would have scored as a Laplacian head in the same training)."""
    laplacian = mechanism.get("diffusion score, Laplacian heads (mean over blocks)", {})
    null = mechanism.get(NULL_ROW, {}).get("0", {})
    rows = {
        spec: {seed: value - null[seed] for seed, value in by_seed.items() if seed in null}
        for spec, by_seed in laplacian.items()
        if spec != "0"
    }
    if any(rows.values()):
        mechanism[AGAINST_K0_ROW] = {spec: by_seed for spec, by_seed in rows.items() if by_seed}


#: the scores measured on data (analysis version 5) that the twin rows compare, and their row names
TWIN_SCORES = (("fraction_drop", "within-sequence fraction drop"), ("p_diffusion", "P-aware diffusion"))


def _measured_heads(analysis: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """(block, head) -> the head's scores, for heads an analysis measured on data (version 5 on)."""
    return {
        (block, h): head
        for block, layer in analysis["per_layer"].items()
        for h, head in enumerate((layer.get("mechanism") or {}).get("heads", []))
        if "fraction_drop" in head
    }


def _against_twins(mechanism: Values, twins: dict[tuple[str, int], dict[tuple[str, int], dict[str, Any]]]) -> None:
    """Each arm's changed heads (every head not ordinary) against their twins: the head at the same (block, head)
    of the k = 0 run of the same seed, which started from the same weights (the kinds add no parameters to W_Q, W_K,
    W_V, W_O) and saw the same data; per seed the mean over changed heads of score - twin's score, one row per
    score, named by the changed heads' kind ("changed" when an arm mixes kinds)."""
    for (spec, seed), heads in twins.items():
        twin = twins.get(("0", seed))
        changed = {where: head for where, head in heads.items() if _kind_of(head) != "ordinary"}
        if spec == "0" or not twin or not changed:
            continue
        kinds = {_kind_of(head) for head in changed.values()}
        name = "Laplacian" if kinds == {"laplacian"} else kinds.pop() if len(kinds) == 1 else "changed"
        for key, quantity in TWIN_SCORES:
            pairs = [
                head[key] - twin[where][key]
                for where, head in changed.items()
                if where in twin and head.get(key) is not None and twin[where].get(key) is not None
            ]
            if pairs:
                label = f"{quantity}, {name} heads minus their k = 0 twins"
                mechanism.setdefault(label, {})[spec] = {
                    **mechanism.get(label, {}).get(spec, {}),
                    seed: float(np.mean(pairs)),
                }


def diffusion_against_zero(mechanism: Values) -> dict[str, dict[str, Comparison]]:
    """Each row's specs tested against 0 (a one-sample t-test = the paired test against a zero arm)."""
    family: dict[str, dict[str, Comparison]] = {}
    for label, by_spec in sorted(mechanism.items(), key=lambda item: "ordinary" in item[0]):  # Laplacian rows first
        rows = {}
        for spec, by_seed in by_spec.items():
            if by_seed:
                rows[spec] = summarize({"zero": dict.fromkeys(by_seed, 0.0), spec: by_seed}, baseline="zero")[spec]
        family[label] = rows
    for spec in {spec for rows in family.values() for spec in rows}:
        raw = {label: rows[spec].paired["p"] for label, rows in family.items() if spec in rows}
        adjusted, faced = holm_steps(raw)
        for label, p_holm in adjusted.items():
            row = family[label][spec]
            values = np.array(list(row.values.values()), dtype=float)
            se = float(values.std(ddof=1)) / math.sqrt(len(values)) if len(values) > 1 else math.nan
            alpha = faced[label] if not math.isnan(faced[label]) else ALPHA
            row.zero_test = ZeroTest(p_holm=p_holm, alpha=alpha, mde_at_alpha=mde(se, len(values) - 1, alpha))
            row.verdict = mechanism_verdict(
                row.paired["mean_difference"], p_holm, row.zero_test.mde_at_alpha, claim(label), len(values)
            )
    return family


def _least_squares_slope(x: list[float], y: list[float]) -> float:
    """The slope of y on x by least squares (NaN where x does not vary)."""
    x_, y_ = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    spread = float(((x_ - x_.mean()) ** 2).sum())
    return float(((x_ - x_.mean()) * (y_ - y_.mean())).sum() / spread) if spread > 0 else math.nan


def _dose_levels(rows: dict[str, Comparison]) -> dict[int, dict[int, float]]:
    """k -> seed -> value of a metric's dose arms: the specs that put the same k Laplacian heads in every block
    ("0", "1", "2", "3"; a per-layer schedule or a head kind is no dose)."""
    return {
        int(spec): {int(seed): float(v) for seed, v in row.values.items()}
        for spec, row in rows.items()
        if spec.isdigit()
    }


def _slopes_over_seeds(slopes: dict[int, float], direction: int | None) -> dict[str, Any]:
    """Per-seed slopes tested against 0 over seeds: mean, t-based 95% interval, p, MDE at alpha 0.05, sign count."""
    finite = {seed: s for seed, s in slopes.items() if not math.isnan(s)}
    test = paired_test(finite, dict.fromkeys(finite, 0.0))
    towards = sum(1 for s in finite.values() if s * (direction or 1) > 0)
    return {**test, "values": finite, "direction": direction, "signs": f"{towards}/{len(finite)}"}


def dose_response(
    table: dict[str, dict[str, Comparison]], labels: list[str], headline: str, geometry: list[str]
) -> dict[str, Any]:
    """The dose arms' slopes (k = 0, 1, 2, 3 Laplacian heads per block), seed by seed, and whether the headline
    follows the geometry across them.

    Each seed's least-squares slope of a metric against k over the dose arms it has all of; the slopes' mean, t-based
    95% interval and one-sample t-test over seeds (secondary: raw p, uncorrected). "Follows": each seed's slope of
    ``headline`` against a geometry row across the same arms; the paper's reading ("Laplacian heads improve accuracy
    by smoothing the tokens of a sequence") predicts the sign claim(headline) x claim(geometry): top-1 rising as the
    within-sequence fraction falls is a negative slope. Empty where the sweep has fewer than 2 dose levels.

    Args:
        table: label -> spec -> ``summarize`` row (each keeps its per-seed ``values``).
        labels: the rows to fit against k.
        headline: the headline metric's label (the y of "follows").
        geometry: the geometry labels it is fitted against.
    """
    out: dict[str, Any] = {"slopes": {}, "follows": {}}
    for label in labels:
        by_k = _dose_levels(table.get(label, {}))
        if len(by_k) < 2:
            continue
        levels = sorted(by_k)
        seeds = sorted(set.intersection(*(set(by_k[k]) for k in levels)))
        slopes = {s: _least_squares_slope(levels, [by_k[k][s] for k in levels]) for s in seeds}
        out["levels"] = levels
        out["slopes"][label] = {**_slopes_over_seeds(slopes, claim(label)), "span": levels[-1] - levels[0]}
    y_by_k = _dose_levels(table.get(headline, {}))
    for label in geometry:
        x_by_k = _dose_levels(table.get(label, {}))
        levels = sorted(set(x_by_k) & set(y_by_k))
        if len(levels) < 2:
            continue
        seeds = sorted(set.intersection(*(set(x_by_k[k]) & set(y_by_k[k]) for k in levels)))
        slopes = {
            s: _least_squares_slope([x_by_k[k][s] for k in levels], [y_by_k[k][s] for k in levels]) for s in seeds
        }
        predicted = None if claim(headline) is None or claim(label) is None else claim(headline) * claim(label)
        out["follows"][label] = {**_slopes_over_seeds(slopes, predicted), "headline": headline}
    return out if out["slopes"] else {}
