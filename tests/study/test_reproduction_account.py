"""docs/reproduction.md against its record-based reports (issues 56, 57): every number the account quotes from the
decomposition, patch-4, intervention, fair-tuning and LM reports equals the report's stats.json (the cross-lr reading:
its across.json) at the printed precision, and every decimal in the parts built on those reports is either such a
quote or a constant named here with where it comes from.

A number is quoted by the string the document prints (``interval(row, 3)`` -> "-0.090 [-0.114, -0.067]"), so a
CI rounded the wrong way, a count miscopied or a p from another row fails here with the two strings side by side.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from lapheads.study.verdicts import holm_steps, mde

ROOT = Path(__file__).resolve().parents[2]
#: the document with its line breaks read as spaces: a quote may wrap
DOC = " ".join((ROOT / "docs" / "reproduction.md").read_text().split())


def _report(study: str) -> dict:
    return json.loads((ROOT / "docs" / "reproduction" / study / "cells" / "report" / "stats.json").read_text())


DEC, P4, IV = _report("decomposition"), _report("patch4"), _report("intervention")
#: the language-model study (issue 56): k = 2 and k = 4 of 4 Laplacian heads against k = 0, 8 seeds
LM = _report("lm")
#: the fair-tuning folders by learning-rate factor, and the plans' cross-lr reading over them and the decomposition
FAIR = {factor: _report(f"fair-tuning/lr-{factor}") for factor in ("0.5x", "2x")}
ACROSS = json.loads((ROOT / "docs" / "reproduction" / "fair-tuning" / "across" / "across.json").read_text())
#: the fair tuning's stage B (issue 70): each arm at its own bracketed best lr, fresh seeds, read with --baseline
BEST = json.loads(
    (ROOT / "docs" / "reproduction" / "best-lr" / "cells" / "report-vs-L0+lr=1.2e-2" / "stats.json").read_text()
)
#: stage A's bracket (lapheads across over 0.5x-32x, seeds 0-4): the means the selection rule read
BRACKET = json.loads((ROOT / "docs" / "reproduction" / "fair-tuning" / "bracket" / "across.json").read_text())
TUNED, PLAIN = "3+lr=6e-3", "0+lr=1.2e-2"
#: the intervention at the tuned lr (issue 70, part 2): k = 0 at 1.2e-2, plain against penalised, read with --baseline
IVT = json.loads(
    (
        ROOT / "docs" / "reproduction" / "intervention-tuned" / "cells" / "report-vs-L0+lr=1.2e-2" / "stats.json"
    ).read_text()
)
PENALISED = "0+lr=1.2e-2+within_seq_penalty=0.0001"
#: appendix D's exploratory pilot of gated heads (issue 73): 2 seeds, no plan
GATED = _report("gated-pilot")
#: the intervention study's penalised arm (its plan's one contrast against plain k = 0)
PENALTY = "0+within_seq_penalty=0.0015"
FINAL = "(after the final norm)"


def geometry(report: dict, metric: str, key: str) -> dict:
    return report["geometry"][f"{metric} {FINAL}"][key]


def top1(report: dict, key: str) -> dict:
    return report["metrics"]["test top-1 (%)"][key]


def signed(value: float, digits: int) -> str:
    return f"{value:+.{digits}f}"


def difference(row: dict, digits: int) -> str:
    """A paired difference as printed: "+0.24"."""
    return signed((row.get("paired") or row)["mean_difference"], digits)


def interval(row: dict, digits: int) -> str:
    """A paired difference and its 95 % CI as printed: "-0.090 [-0.114, -0.067]"."""
    paired = row.get("paired") or row
    low, high = signed(paired["ci_low"], digits), signed(paired["ci_high"], digits)
    return f"{signed(paired['mean_difference'], digits)} [{low}, {high}]"


def magnitude(row: dict, digits: int) -> str:
    """A negative difference printed as a size: "0.44 [0.27, 0.61]"."""
    paired = row.get("paired") or row
    size, low, high = (-paired[key] for key in ("mean_difference", "ci_high", "ci_low"))
    return f"{size:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def plain(row: dict, digits: int) -> str:
    """A positive difference printed without signs: "0.0015 [0.0011, 0.0019]"."""
    paired = row.get("paired") or row
    low, high = paired["ci_low"], paired["ci_high"]
    return f"{paired['mean_difference']:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def p(value: float) -> str:
    """A p-value as printed: two significant digits, never in exponent form ("0.000066", "0.045")."""
    return f"{value:.{max(0, 1 - math.floor(math.log10(value)))}f}"


def _holm_over_top1(report: dict) -> dict[str, float]:
    rows = {key: row["paired"]["p"] for key, row in report["metrics"]["test top-1 (%)"].items() if row.get("paired")}
    return holm_steps(rows)[0]


def _leave_one_seed_out_p(row: dict, baseline: dict) -> dict[str, float]:
    differences = {seed: value - baseline["values"][seed] for seed, value in row["values"].items()}
    return {
        seed: float(stats.ttest_1samp([d for s, d in differences.items() if s != seed], 0.0).pvalue)
        for seed in differences
    }


def _equivalence_after_holm(report: dict, arms: tuple[str, ...]) -> dict[str, dict[str, bool]]:
    """Holm across ``arms`` of each TOST (both halves: its p is the larger), by t and by exact sign flips."""
    out: dict[str, dict[str, bool]] = {arm: {} for arm in arms}
    for test, keys in (
        ("t", ("tost_p", "tost_lower_p")),
        ("sign flips", ("tost_sign_flip_p", "tost_lower_sign_flip_p")),
    ):
        adjusted = holm_steps({arm: max(top1(report, arm)[k] for k in keys) for arm in arms})[0]
        for arm in arms:
            out[arm][test] = adjusted[arm] < 0.05
    return out


def _quotes() -> dict[str, str]:
    """What the account prints, by where it comes from."""
    fraction, scale_free = "within-sequence fraction", "within-sequence variance / mean |h|^2"
    per_seq, pooled = "components for 99%, per sequence", "components for 99%, pooled"
    between, nc1, cosine = "between-class fraction", "NC1, sequence means", "token cosine similarity"
    mech = DEC["mechanism"]
    laplacian = mech["diffusion score, Laplacian heads (mean over blocks)"]
    excess = mech["Laplacian excess over ordinary heads (k = 0 run, paired by seed)"]
    ordinary = mech["diffusion score, ordinary heads (mean over blocks)"]["0"]
    holm_top1 = _holm_over_top1(DEC)
    centring = _leave_one_seed_out_p(geometry(DEC, fraction, "centring:1 vs 1"), geometry(DEC, fraction, "1"))
    p4_mech = P4["mechanism"]
    p4_fit = P4["fit"]["3"]["against_baseline"]
    p4_top1 = top1(P4, "3")
    half_width = (p4_top1["paired"]["ci_high"] - p4_top1["paired"]["ci_low"]) / 2
    quotes = {
        # decomposition: the primary family
        "k=3 fraction": interval(geometry(DEC, fraction, "3"), 3),
        "k=1 fraction": interval(geometry(DEC, fraction, "1"), 3),
        "k=3, k=1 fraction Holm": f"Holm p {p(geometry(DEC, fraction, '3')['p_holm'])}, "
        f"{p(geometry(DEC, fraction, '1')['p_holm'])}",
        **{f"primary table: {name}": _primary_row(name, key) for name, key in PRIMARY_ROWS.items()},
        "primary MDEs": "MDE at the observed SD "
        + "-".join(sorted(f"{geometry(DEC, fraction, k)['mde_at_alpha']:.3f}" for k in ("1", "3")))
        + " at alpha / 6",
        "dose fraction p": f"(p {p(DEC['dose']['slopes'][f'{fraction} {FINAL}']['p'])}, 6/6)",
        "follows at the k=3 shift": _follows_at_shift(),
        "decomposition wall times": "Cell wall times " + "-".join(f"{m:.1f}" for m in _wall_minutes("decomposition")),
        "patch-4 wall times": "(" + "-".join(f"{m:.1f}" for m in _wall_minutes("patch4")) + " min a cell)",
        "sum-k3 fraction": interval(geometry(DEC, fraction, "sum:3 vs 3"), 3),
        "sum-k3 fraction, short": difference(geometry(DEC, fraction, "sum:3 vs 3"), 3),
        "XSA-k3 fraction": difference(geometry(DEC, fraction, "exclusive:3 vs 3"), 3),
        "untied-k3 fraction": difference(geometry(DEC, fraction, "untied:3 vs 3"), 3),
        "centring-L1 fraction": interval(geometry(DEC, fraction, "centring:1 vs 1"), 3),
        "centring-L1 Holm": f"Holm p {p(geometry(DEC, fraction, 'centring:1 vs 1')['p_holm'])}",
        "centring-L1 leave one out, low": f"{min(v for s, v in centring.items() if s in '2345'):.3f} to",
        "centring-L1 leave one out, high": f"to {max(v for s, v in centring.items() if s in '2345'):.3f}",
        "sum-k0 fraction": interval(geometry(DEC, fraction, "sum:3"), 3),
        "sum-k0 fraction p": f"raw p {p(geometry(DEC, fraction, 'sum:3')['paired']['p'])}",
        "XSA-k0 fraction": interval(geometry(DEC, fraction, "exclusive:3"), 3),
        "untied-k0 fraction": interval(geometry(DEC, fraction, "untied:3"), 3),
        "untied-k0 fraction p": f"raw p {p(geometry(DEC, fraction, 'untied:3')['paired']['p'])}",
        "centring-k0 fraction": interval(geometry(DEC, fraction, "centring:1"), 3),
        "centring-k0 fraction p": f"p\n  {p(geometry(DEC, fraction, 'centring:1')['paired']['p'])}",
        "k=1 fraction, short": difference(geometry(DEC, fraction, "1"), 3),
        "k=3 shift": f"{-geometry(DEC, fraction, '3')['paired']['mean_difference']:.3f}",
        "k=3 scale-free": interval(geometry(DEC, scale_free, "3"), 3),
        # decomposition: the other geometry rows
        "k=3 between": interval(geometry(DEC, between, "3"), 3),
        "k=1 between": difference(geometry(DEC, between, "1"), 3),
        "k=3 NC1": interval(geometry(DEC, nc1, "3"), 2),
        "k=1 NC1": difference(geometry(DEC, nc1, "1"), 2),
        "k=1 per-seq": interval(geometry(DEC, per_seq, "1"), 2),
        "k=2 per-seq": interval(geometry(DEC, per_seq, "2"), 2),
        "k=3 per-seq": interval(geometry(DEC, per_seq, "3"), 2),
        "k=3 per-seq MDE": f"MDE {geometry(DEC, per_seq, '3')['mde_at_alpha']:.2f}",
        "k=3 pooled": interval(geometry(DEC, pooled, "3"), 2),
        "k=3 pooled p": f"p {p(geometry(DEC, pooled, '3')['paired']['p'])}",
        "k=1 pooled": difference(geometry(DEC, pooled, "1"), 2),
        "sum scale-free": interval(geometry(DEC, scale_free, "sum:3"), 3),
        "sum cosine": interval(geometry(DEC, cosine, "sum:3"), 3),
        "sum-k3 scale-free": difference(geometry(DEC, scale_free, "sum:3 vs 3"), 3),
        "sum-k3 cosine": difference(geometry(DEC, cosine, "sum:3 vs 3"), 3),
        # decomposition: top-1
        "margin": f"{DEC['rule']['margin']['test top-1 (%)']:.3f}",
        "k=0 error": f"{100 - top1(DEC, '0')['mean']:.2f} %",
        "k=1 top-1": interval(top1(DEC, "1"), 2),
        "k=2 top-1": interval(top1(DEC, "2"), 2),
        "k=3 top-1": interval(top1(DEC, "3"), 2),
        "k=1..3 top-1, short": ", ".join(difference(top1(DEC, k), 2) for k in "123"),
        "TOST by t": ", ".join(p(top1(DEC, k)["tost_p"]) for k in "123"),
        "TOST by sign flips": ", ".join(p(top1(DEC, k)["tost_sign_flip_p"]) for k in "123"),
        "Holm x3 by sign flips": _holm_step("1", 3),
        "Holm x2 by sign flips": _holm_step("2", 2),
        "sum top-1": interval(top1(DEC, "sum:3"), 2),
        "sum top-1 short": difference(top1(DEC, "sum:3"), 2),
        "sum top-1 p": f"raw p {p(top1(DEC, 'sum:3')['paired']['p'])}",
        "sum top-1 sign flip": f"sign-flip {p(top1(DEC, 'sum:3')['permutation_p'])}",
        "sum-k3 top-1": interval(top1(DEC, "sum:3 vs 3"), 2),
        "sum-k3 top-1 p": f"raw p\n  {p(top1(DEC, 'sum:3 vs 3')['paired']['p'])}",
        "top-1 rows": f"{len(holm_top1)} top-1 rows",
        "Holm over top-1 rows": f"{holm_top1['sum:3']:.2f} and {holm_top1['sum:3 vs 3']:.2f}",
        "Holm over top-1 rows, table": f"Holm over the report's {len(holm_top1)} top-1 rows {holm_top1['sum:3']:.2f}",
        "sum late change": interval(DEC["late_change"]["test top-1 (%)"]["sum:3"], 2),
        "sum fit": f"{DEC['fit']['sum:3']['fit_top1']:.2f} against k = 0's {DEC['fit']['0']['fit_top1']:.2f}",
        # decomposition: the dose
        "dose fraction": f"{DEC['dose']['slopes'][f'{fraction} {FINAL}']['mean_difference']:+.4f} per head",
        "dose fraction CI": interval(DEC["dose"]["slopes"][f"{fraction} {FINAL}"], 3).split(" ", 1)[1],
        "dose top-1": interval(DEC["dose"]["slopes"]["test top-1 (%)"], 3).replace(" [", " per head ["),
        "follows": interval(DEC["dose"]["follows"][f"{fraction} {FINAL}"], 1).replace(" [", " points per unit\n  ["),
        "follows, table": interval(DEC["dose"]["follows"][f"{fraction} {FINAL}"], 1).replace(" [", " per unit ["),
        # decomposition: the mechanism
        "diffusion k=1..3": " / ".join(interval(laplacian[k], 3) for k in "12"),
        "diffusion k=3": interval(laplacian["3"], 3),
        "diffusion k=1..3, table": " / ".join(difference(laplacian[k], 3) for k in "123"),
        "ordinary heads": interval(ordinary, 3),
        "ordinary heads, table": f"score {difference(ordinary, 3)} themselves",
        "excess range": " to ".join(sorted({difference(excess[k], 3) for k in "123"})),
        # patch 4
        "p4 k=0": f"k = 0 {top1(P4, '0')['mean']:.2f} +- {top1(P4, '0')['std']:.2f}",
        "p4 k=3": f"{top1(P4, '3')['mean']:.2f} +- {top1(P4, '3')['std']:.2f}",
        "p4 top-1": interval(p4_top1, 2),
        "p4 top-1 p": f"p {p(p4_top1['paired']['p'])}",
        "p4 sign flip": f"sign-flip {p(p4_top1['permutation_p'])}",
        "p4 TOST": f"TOST p {p(p4_top1['tost_p'])} by t, {p(p4_top1['tost_sign_flip_p'])}",
        "p4 MDE": f"{p4_top1['mde_at_alpha']:.2f} points",
        "p4 margin": f"{P4['rule']['margin']['test top-1 (%)']:.3f}",
        "p4 SD": f"{np.std(list(_p4_differences().values()), ddof=1):.3f}",
        "p4 half width": f"{half_width:.3f} x {math.sqrt(6):.3f} / {stats.t.ppf(0.975, 5):.3f}",
        "p4 fraction": interval(geometry(P4, fraction, "3"), 3),
        "p4 fraction p": f"p {p(geometry(P4, fraction, '3')['paired']['p'])}",
        "p4 between": interval(geometry(P4, between, "3"), 3),
        "p4 NC1": interval(geometry(P4, nc1, "3"), 2),
        "p4 pooled": interval(geometry(P4, pooled, "3"), 2),
        "p4 pooled, table": f"({difference(geometry(P4, pooled, '3'), 2)}, 6/6)",
        "p4 per-seq": interval(geometry(P4, per_seq, "3"), 2),
        "p4 per-seq MDE": "{signs} seeds, MDE {mde_at_alpha:.2f}".format(**geometry(P4, per_seq, "3")),
        "p4 gap epoch 3": interval(P4["over_training"]["test top-1 (%)"]["3"][0], 2),
        "p4 gap epoch 9": interval(P4["over_training"]["test top-1 (%)"]["3"][2], 2),
        "p4 late k=3": interval(P4["late_change"]["test top-1 (%)"]["3"], 3),
        "p4 late k=0": interval(P4["late_change"]["test top-1 (%)"]["0"], 2),
        "p4 fit": f"{P4['fit']['0']['fit_top1']:.2f} % and {P4['fit']['3']['fit_top1']:.2f} %",
        "p4 fit gap": magnitude(p4_fit["fit top-1"], 2),
        "p4 test loss": interval(p4_fit["test loss"], 3),
        "p4 diffusion": interval(p4_mech["diffusion score, Laplacian heads (mean over blocks)"]["3"], 3),
        "p4 ordinary": "ordinary heads "
        + difference(p4_mech["diffusion score, ordinary heads (mean over blocks)"]["0"], 3),
        "p4 excess": interval(p4_mech["Laplacian excess over ordinary heads (k = 0 run, paired by seed)"]["3"], 3),
        "p4 twin drop": plain(
            p4_mech["within-sequence fraction drop, Laplacian heads minus their k = 0 twins"]["3"], 4
        ),
        # intervention
        **_intervention_quotes(),
        # fair tuning
        **{key: quote for factor in FAIR for key, quote in _fair_tuning_quotes(factor).items()},
        **_across_quotes(),
        **_intervention_tuned_quotes(),
        # the language-model study
        **_lm_quotes(),
    }
    return quotes


def _intervention_quotes() -> dict[str, str]:
    fraction = geometry(IV, "within-sequence fraction", PENALTY)
    k3 = geometry(DEC, "within-sequence fraction", "3")
    top = top1(IV, PENALTY)
    between = geometry(IV, "between-class fraction", PENALTY)
    return {
        "iv fraction": interval(fraction, 3),
        "iv fraction p": f"p {p(fraction['p_holm'])}, {fraction['signs']} seeds",
        "iv ratio": f"{fraction['paired']['mean_difference'] / k3['paired']['mean_difference']:.2f} times",
        "iv k=0": f"plain {top1(IV, '0')['mean']:.2f} +- {top1(IV, '0')['std']:.2f}",
        "iv penalised": f"penalised {top['mean']:.2f} +- {top['std']:.2f}",
        "iv top-1": interval(top, 2),
        "iv top-1 p": f"p {p(top['paired']['p'])}, sign-flip {p(top['permutation_p'])}, {top['signs']} seeds",
        "iv TOST": f"TOST p {p(top['tost_p'])} by t, {p(top['tost_sign_flip_p'])} by sign flips",
        "iv TOST lower": f"lower half {p(top['tost_lower_p'])} by t, {p(top['tost_lower_sign_flip_p'])}",
        "iv MDE": f"MDE {top['mde_at_alpha']:.2f} points at the observed SD",
        **_intervention_reach(top),
        "iv margin": f"margin {IV['rule']['margin']['test top-1 (%)']:.3f}",
        "iv verdict": top["verdict"],
        "iv between": f"{interval(between, 3)} ({between['signs']})",
        "iv wall times": "(" + "-".join(f"{m:.1f}" for m in _wall_minutes("intervention")) + " min a cell)",
    }


def _intervention_tuned_quotes() -> dict[str, str]:
    """The intervention at the tuned lr (its section, the claims row, the short answer), as printed: the check, the
    primary with both TOST halves, and the plan's sharper reading, the 95 % CI's upper end against stage B's gain,
    with the power against that gain at the observed SD."""
    fraction = geometry(IVT, "within-sequence fraction", PENALISED)
    k3 = geometry(BEST, "within-sequence fraction", TUNED)
    top = top1(IVT, PENALISED)
    stage_b = top1(BEST, TUNED)["paired"]["mean_difference"]
    pairs = top["paired"]["n_pairs"]
    se = (top["paired"]["ci_high"] - top["paired"]["ci_low"]) / 2 / stats.t.ppf(0.975, pairs - 1)
    critical = stats.t.ppf(0.975, pairs - 1)
    power = stats.nct.sf(critical, pairs - 1, stage_b / se) + stats.nct.cdf(-critical, pairs - 1, stage_b / se)
    between = geometry(IVT, "between-class fraction", PENALISED)
    assert top["paired"]["ci_high"] > stage_b  # the account says the upper end is not below stage B's gain
    return {
        "ivt fraction": interval(fraction, 3),
        "ivt fraction p": f"p {p(fraction['p_holm'])}, {fraction['signs']} seeds",
        "ivt ratio": f"{fraction['paired']['mean_difference'] / k3['paired']['mean_difference']:.2f} times",
        "ivt fraction means": f"plain {geometry(IVT, 'within-sequence fraction', PLAIN)['mean']:.3f}, penalised "
        f"{fraction['mean']:.3f}",
        "ivt means": f"plain {top1(IVT, PLAIN)['mean']:.2f} +- {top1(IVT, PLAIN)['std']:.2f}, penalised "
        f"{top['mean']:.2f} +- {top['std']:.2f}",
        "ivt top-1": interval(top, 2),
        "ivt top-1 p": f"p {p(top['paired']['p'])}, sign-flip {p(top['permutation_p'])}, {top['signs']} seeds",
        "ivt TOST": f"TOST p {p(top['tost_p'])} by t, {p(top['tost_sign_flip_p'])} by sign flips",
        "ivt TOST lower": f"lower half {p(top['tost_lower_p'])} by t, {p(top['tost_lower_sign_flip_p'])}",
        "ivt margin": f"margin {top['margin']:.3f}",
        "ivt MDE": f"MDE {top['mde_at_alpha']:.2f} points at the observed SD",
        "ivt upper end": f"upper end, {top['paired']['ci_high']:+.3f}, is not below stage B's {stage_b:+.3f}",
        "ivt power": f"power {power:.2f} against stage B's {stage_b:+.2f}",
        "ivt fraction SDs": f"SD {geometry(IVT, 'within-sequence fraction', PLAIN)['std']:.3f} and "
        f"{fraction['std']:.3f} across seeds, against {geometry(BEST, 'within-sequence fraction', PLAIN)['std']:.3f}",
        "ivt verdict": top["verdict"],
        "ivt fraction verdict": fraction["verdict"],
        "ivt between": f"{interval(between, 3)} ({between['signs']})",
        "ivt wall times": "(" + "-".join(f"{m:.1f}" for m in _wall_minutes("intervention-tuned")) + " min a cell)",
    }


def _intervention_reach(top: dict) -> dict[str, str]:
    """What the intervention's primary rules out (the one-sided 95 % bound on the gain) and its power, at its observed
    SD, against the k = 3 gaps this preset showed: +0.22 at 1x (decomposition), +0.52 at 2x (fair tuning)."""
    pairs = top["paired"]["n_pairs"]
    df = pairs - 1
    se = (top["paired"]["ci_high"] - top["paired"]["ci_low"]) / 2 / stats.t.ppf(0.975, df)
    bound = top["paired"]["mean_difference"] + stats.t.ppf(0.95, df) * se
    critical = stats.t.ppf(0.975, df)

    def power(effect: float) -> float:
        return stats.nct.sf(critical, df, effect / se) + stats.nct.cdf(-critical, df, effect / se)

    at_1x, at_2x = (top1(report, "3")["paired"]["mean_difference"] for report in (DEC, FAIR["2x"]))
    return {
        "iv rules out": f"a gain of {bound:+.2f} points or more (the one-sided 95 % bound)",
        "iv power": f"power {power(at_1x):.2f} against k = 3's {at_1x:+.2f} at 1x and {power(at_2x):.2f} against "
        f"k = 3's {at_2x:+.2f} at 2x",
    }


def _lm_quotes() -> dict[str, str]:
    """The LM study's rows as the account prints them: components to 2 decimals, CDNV and cosine to 3, bits per byte
    to 4 (its margin is 0.0187), NC1 to 2; the k = 0 level, the relative size, the MDE and both TOST halves only where
    the account prints them (the primary, the declared family and the whole-split bpb, which have margins)."""
    per_seq, pooled, cdnv = "components for 99%, per sequence", "components for 99%, pooled", "CDNV, next-token classes"
    digits = {per_seq: 2, pooled: 2, cdnv: 3, "NC1, next-token classes": 2, "token cosine similarity": 3}
    quotes: dict[str, str] = {}

    def tost(row: dict) -> str:
        return (
            f"TOST p {p(row['tost_p'])} / {p(row['tost_lower_p'])} by t, "
            f"{p(row['tost_sign_flip_p'])} / {p(row['tost_lower_sign_flip_p'])} by sign flips"
        )

    for metric, d in digits.items():
        base = geometry(LM, metric, "0")
        if metric in (per_seq, pooled, cdnv):
            quotes[f"lm {metric} k=0"] = f"{base['mean']:.{d}f} +- {base['std']:.{d}f}"
        for arm in ("2", "4"):
            row = geometry(LM, metric, arm)
            tested = (
                f"Holm p {p(row['p_holm'])}" if row["role"] in ("primary", "declared") else f"p {p(row['paired']['p'])}"
            )
            quotes[f"lm {metric} k={arm}"] = f"{interval(row, d)} ({row['signs']}, {tested})"
            if metric in (per_seq, cdnv):
                quotes[f"lm {metric} k={arm} MDE"] = f"MDE {row['mde_at_alpha']:.{d + 1}f}"
                quotes[f"lm {metric} k={arm} TOST"] = tost(row)
            if metric == per_seq:
                quotes[f"lm {metric} k={arm} relative"] = (
                    f"{100 * row['paired']['mean_difference'] / base['mean']:+.1f} %"
                )
    whole = LM["metrics"]["validation bits per byte, whole split"]
    quotes["lm validation bits per byte, whole split k=0"] = f"{whole['0']['mean']:.4f} +- {whole['0']['std']:.4f}"
    for metric in ("validation bits per byte", "validation bits per byte, whole split"):
        for arm in ("2", "4"):
            row = LM["metrics"][metric][arm]
            quotes[f"lm {metric} k={arm}"] = f"{interval(row, 4)} ({row['signs']}, p {p(row['paired']['p'])})"
    for arm in ("2", "4"):
        quotes[f"lm validation bits per byte, whole split k={arm} TOST"] = tost(whole[arm])
        quotes[f"lm validation bits per byte, whole split k={arm} verdict"] = whole[arm]["verdict"]
    for arm, change in LM["late_change"]["validation bits per byte"].items():
        quotes[f"lm late change k={arm}"] = interval(change, 3)
    first = LM["over_training"]["validation bits per byte"]["4"][0]
    quotes["lm first gap k=4"] = f"step {first['step']}: {interval(first, 3)}"
    for metric in (f"{per_seq} {FINAL}", f"{cdnv} {FINAL}", "validation bits per byte, whole split"):
        row = LM["dose"]["slopes"][metric]
        quotes[f"lm dose {metric}"] = f"{interval(row, 4)} per head ({row['signs']}, p {p(row['p'])})"
    for metric, row in LM["dose"]["follows"].items():
        quotes[f"lm follows {metric}"] = f"{interval(row, 4)} ({row['signs']}, p {p(row['p'])})"
    mech = LM["mechanism"]
    for arm in ("2", "4"):
        quotes[f"lm diffusion k={arm}"] = interval(mech["diffusion score, Laplacian heads (mean over blocks)"][arm], 3)
        excess = mech["Laplacian excess over ordinary heads (k = 0 run, paired by seed)"][arm]
        quotes[f"lm excess k={arm}"] = f"{interval(excess, 4)} ({excess['verdict']})"
        twin = mech["within-sequence fraction drop, Laplacian heads minus their k = 0 twins"][arm]
        quotes[f"lm twin drop k={arm}"] = f"{interval(twin, 5)} ({twin['verdict']})"
    quotes["lm ordinary heads"] = interval(mech["diffusion score, ordinary heads (mean over blocks)"]["0"], 3)
    for label, margin in LM["rule"]["margin"].items():  # fixed in the plan before the data
        quotes[f"lm margin {label}"] = f"margin {margin}"
    quotes["lm wall times"] = "(" + "-".join(f"{m:.1f}" for m in _wall_minutes("lm")) + " min a cell)"
    side_by_side = [  # seeds 4-7: two cells side by side and nothing else training
        json.loads((ROOT / "docs" / "reproduction" / "lm" / "cells" / f"L{k}-s{s}.json").read_text())["wall_seconds"]
        for k in (0, 2, 4)
        for s in (4, 5, 6, 7)
    ]
    quotes["lm wall times, seeds 4-7"] = f"({min(side_by_side) / 60:.0f}-{max(side_by_side) / 60:.0f} min in seeds 4-7"
    return quotes


def _fair_tuning_quotes(factor: str) -> dict[str, str]:
    """One fair-tuning folder's primary, read at its plan's alpha (0.05) and at the summary's Bonferroni 0.025."""
    report = FAIR[factor]
    top = top1(report, "3")
    pairs = top["paired"]["n_pairs"]
    se = (top["paired"]["ci_high"] - top["paired"]["ci_low"]) / 2 / stats.t.ppf(0.975, pairs - 1)
    fraction = geometry(report, "within-sequence fraction", "3")
    pooled = geometry(report, "components for 99%, pooled", "3")
    between = geometry(report, "between-class fraction", "3")
    return {
        f"{factor} k=0": f"k = 0 {top1(report, '0')['mean']:.2f} +- {top1(report, '0')['std']:.2f}",
        f"{factor} k=3": f"k = 3 {top['mean']:.2f} +- {top['std']:.2f}",
        f"{factor} top-1": interval(top, 2),
        f"{factor} top-1 p": f"p {p(top['paired']['p'])}, sign-flip {p(top['permutation_p'])}, {top['signs']} seeds",
        f"{factor} TOST": f"TOST p {p(top['tost_p'])} by t, {p(top['tost_sign_flip_p'])} by sign flips",
        f"{factor} margin": f"margin {report['rule']['margin']['test top-1 (%)']:.3f}",
        f"{factor} MDE": f"MDE {top['mde_at_alpha']:.2f} at alpha 0.05, {mde(se, pairs - 1, 0.025):.2f} at 0.025",
        f"{factor} fraction": f"{interval(fraction, 3)} ({fraction['signs']})",
        f"{factor} pooled": f"{interval(pooled, 2)} ({pooled['signs']})",
        f"{factor} between": f"{interval(between, 3)} ({between['signs']})",
        f"{factor} wall times": "("
        + "-".join(f"{m:.1f}" for m in _wall_minutes(f"fair-tuning/lr-{factor}"))
        + " min a cell)",
    }


def _across_quotes() -> dict[str, str]:
    """The plans' cross-lr reading (fair-tuning/across/across.json), as the account prints it."""
    means = ACROSS["means"]
    quotes = {
        f"across means {arm}": ", ".join(f"{means[arm][label]:.2f} at {label}" for label in ("0.5x", "1x", "2x"))
        for arm in ("0", "3")
    }
    for test in ACROSS["tests"]:
        quotes[f"across {test['recipe']}"] = (
            f"{test['mean_difference']:+.2f} (one-sided p {p(test['p_one_sided'])}, MDE {test['mde']:.2f})"
        )
    quotes["across best"] = f"k = 3's best lr is {ACROSS['best']['3']}, k = 0's {ACROSS['best']['0']}"
    quotes["across reading"] = "handicapped" if ACROSS["handicapped"] else "not handicapped within the lrs tried"
    for row in ACROSS["interactions"]:
        at = row["recipe"]
        change = row["interaction"]
        quotes[f"across interaction {at}"] = f"{_change(change)} at {at} (p {p(change['p'])}" + (
            f", MDE {change['mde']:.2f})" if at == "0.5x" else ""
        )
        quotes[f"across interaction {at} MDE"] = f"p {p(change['p'])}, MDE {change['mde']:.2f}"
        quotes[f"across gap {at}"] = _change(row["gap"])
        quotes[f"across 1x gap on seeds {at}"] = f"was already {_change(row['reference_gap'])}"
    two = next(row for row in ACROSS["interactions"] if row["recipe"] == "2x")  # what 2x did to each arm
    quotes["across lift k=0 2x"] = f"k = 0 {_change(two['baseline_lift'])} ({two['baseline_lift']['moved_up']}/5"
    quotes["across lift k=3 2x"] = f"k = 3 {_change(two['arm_lift'])} ({two['arm_lift']['moved_up']}/5)"
    quotes["across specific"] = (
        "**No k = 3-specific handicap is detected**"
        if not any(row["detected"] for row in ACROSS["interactions"])
        else "a k = 3-specific handicap is detected"
    )
    quotes.update(_gated_pilot_quotes())
    quotes.update(_best_lr_quotes())
    return quotes


def _best_lr_quotes() -> dict[str, str]:
    """The fair tuning's stage B (the short answer, the claims row, its section), as printed."""
    primary = top1(BEST, TUNED)
    fraction = geometry(BEST, "within-sequence fraction", TUNED)
    quotes = {
        "stage B top-1": interval(primary, 2),
        "stage B top-1 tests": f"(p {p(primary['paired']['p'])}, sign-flip {p(primary['permutation_p'])}, "
        f"{primary['signs']} seeds",
        "stage B MDE": f"MDE {primary['mde_at_alpha']:.2f} at the observed SD",
        "stage B TOST upper": f"upper p {p(primary['tost_p'])} by t, {p(primary['tost_sign_flip_p'])} by sign flips",
        "stage B TOST lower": f"lower p {p(primary['tost_lower_p'])}, {p(primary['tost_lower_sign_flip_p'])}",
        "stage B margin": f"{primary['margin']:.3f}",
        "stage B means": f"k = 0 at 1.2e-2 {top1(BEST, PLAIN)['mean']:.2f} +- {top1(BEST, PLAIN)['std']:.2f}, k = 3 "
        f"at 6e-3 {primary['mean']:.2f} +- {primary['std']:.2f}",
        "stage B fraction": f"{interval(fraction, 3)} (p {p(fraction['paired']['p'])}, {fraction['signs']} seeds)",
        "stage B fraction, short": f"{interval(fraction, 3)}, {fraction['signs']}",
        "stage B fraction means": f"k = 0 {geometry(BEST, 'within-sequence fraction', PLAIN)['mean']:.3f}, k = 3 "
        f"{fraction['mean']:.3f}",
        "stage B between": interval(geometry(BEST, "between-class fraction", TUNED), 3),
        "stage B NC1": interval(geometry(BEST, "NC1, sequence means", TUNED), 2),
        "stage B per-seq": interval(geometry(BEST, "components for 99%, per sequence", TUNED), 2),
        "stage B pooled": interval(geometry(BEST, "components for 99%, pooled", TUNED), 2),
        "stage B fit": f"{interval(BEST['fit'][TUNED]['against_baseline']['fit top-1'], 2)} over k = 0's "
        f"{BEST['fit'][PLAIN]['fit_top1']:.2f}",
        "stage B late k=3": interval(BEST["late_change"]["test top-1 (%)"][TUNED], 2),
        "stage B late k=0": interval(BEST["late_change"]["test top-1 (%)"][PLAIN], 2),
        "stage A best means": f"({BRACKET['means']['0']['8x']:.2f} on seeds 0-4) and k = 3 above its "
        f"({BRACKET['means']['3']['4x']:.2f})",
        "stage A best lrs": f"k = 0's best at {BRACKET['best']['0']} and k = 3's at {BRACKET['best']['3']}",
    }
    assert fraction["verdict"] == primary["verdict"] == "held"  # the words the account prints with them
    assert BEST["late_change"]["test top-1 (%)"][TUNED]["still_improving"]
    assert not BEST["late_change"]["test top-1 (%)"][PLAIN]["still_improving"]
    return quotes


def _gated_pilot_quotes() -> dict[str, str]:
    """Appendix D: the gated pilot's means and paired differences, as printed."""
    arms = {"3": "Laplacian", "gated-ordinary:3": "gated ordinary", "gated-laplacian:3": "gated Laplacian"}
    means = {arm: f"{top1(GATED, arm)['mean']:.2f}" for arm in ("0", *arms)}
    quotes = {"gated pilot top-1": f"k = 0 {means['0']}, Laplacian {means['3']}, gated ordinary "
              f"{means['gated-ordinary:3']}, gated Laplacian {means['gated-laplacian:3']}"}  # fmt: skip
    for arm, name in arms.items():
        quotes[f"gated pilot top-1 {arm}"] = f"{name} {interval(top1(GATED, arm), 2)}"
        for metric in ("within-sequence fraction", "between-class fraction"):
            quotes[f"gated pilot {metric} {arm}"] = f"{name} {interval(geometry(GATED, metric, arm), 4)}"
    return quotes


def _change(row: dict) -> str:
    """An across.json paired change as printed: "+0.13 [-0.20, +0.45]"."""
    return f"{row['mean_difference']:+.2f} [{row['ci_low']:+.2f}, {row['ci_high']:+.2f}]"


def _p4_differences() -> dict[str, float]:
    row, base = top1(P4, "3"), top1(P4, "0")
    return {seed: value - base["values"][seed] for seed, value in row["values"].items()}


#: the primary table's rows (decomposition section): its label, the stats key
PRIMARY_ROWS = {
    "k = 3 minus k = 0": "3",
    "k = 1 minus k = 0": "1",
    "`sum:3` minus k = 3": "sum:3 vs 3",
    "`exclusive:3` minus k = 3": "exclusive:3 vs 3",
    "`untied:3` minus k = 3": "untied:3 vs 3",
    "`centring:1` minus k = 1": "centring:1 vs 1",
}


def _primary_row(name: str, key: str) -> str:
    row = geometry(DEC, "within-sequence fraction", key)
    if row["direction"] == -1:  # a claimed contrast: the seeds that moved the paper's way
        signs, moved = row["signs"], "fall"
    else:  # an ablation, two-sided: the seeds on the side of the mean
        higher = row["paired"]["mean_difference"] > 0
        signs = f"{sum((d > 0) == higher for d in _differences(row))}/6"
        moved = "higher" if higher else "lower"
    return f"| {name} | {interval(row, 3)} | {p(row['p_holm'])} | {signs} {moved} |"


def _holm_step(arm: str, factor: int) -> str:
    """One step of Holm over the three arms' sign-flip TOST p, as printed: "0.016 x 3 = 0.047"."""
    value = top1(DEC, arm)["tost_sign_flip_p"]
    return f"{p(value)} x {factor} = {factor * value:.3f}"


def _differences(row: dict) -> list[float]:
    base = geometry(DEC, "within-sequence fraction", row["baseline"])
    return [value - base["values"][seed] for seed, value in row["values"].items()]


def _follows_at_shift() -> str:
    """The within-seed slope of top-1 on the fraction, times the k = 3 shift: the top-1 change it implies."""
    follows = DEC["dose"]["follows"]["within-sequence fraction (after the final norm)"]
    shift = -geometry(DEC, "within-sequence fraction", "3")["paired"]["mean_difference"]
    scaled = {key: -follows[key] * shift for key in ("mean_difference", "ci_high", "ci_low")}
    return f"{scaled['mean_difference']:+.2f} [{scaled['ci_high']:+.2f}, {scaled['ci_low']:+.2f}] points"


def _wall_minutes(study: str) -> tuple[float, float]:
    folder = ROOT / "docs" / "reproduction" / study / "cells"
    minutes = [json.loads(f.read_text())["wall_seconds"] / 60 for f in folder.glob("*.json") if f.name != "plan.json"]
    return min(minutes), max(minutes)


QUOTES = _quotes()


@pytest.mark.parametrize("what", sorted(QUOTES))
def test_each_quoted_number_is_its_reports_stats_at_the_printed_precision(what):
    quoted = " ".join(QUOTES[what].split())
    assert quoted in DOC, f"{what}: the report says {quoted!r}; docs/reproduction.md does not"


def test_the_equivalence_sentence_says_what_survives_holm_across_the_three_arms():
    survives = _equivalence_after_holm(DEC, ("1", "2", "3"))
    assert all(survives[arm]["t"] for arm in "123")
    assert [arm for arm in "123" if survives[arm]["sign flips"]] == ["1"]
    assert "at k = 1 alone once the three arms are corrected" in DOC


def _record_based_parts() -> str:
    """The claims table's rows that cite a record-based report, and the record-based studies' sections."""
    table = DOC[DOC.index("## Claims at a glance") : DOC.index("## What in a Laplacian head")]
    rows = [row for row in table.split("| ") if "cells/report" in row or "same" in row]
    short = DOC[DOC.index("## The short answer") : DOC.index("## The verdict rule")]  # every number a quote, too
    return short + " ".join(rows) + DOC[DOC.index("## What in a Laplacian head") : DOC.index("## Studies in progress")]


#: decimals in those parts that no report computes, each with where it comes from
CONSTANTS = {
    "4.69": "the paper's ImageNet effect (81.45 -> 82.32 top-1) as a share of the error rate",
    "0.066": "the decomposition plan's design MDE, from the earlier sweeps' paired SD of 0.03 (plan.json)",
    "0.975": "the t quantile's level in the patch-4 stop formula",
    "14.41": "the patch-4 pilot's k = 0 error (100 - 85.59; patch4/pilot/L0-s100.json, outside the study)",
    "99.6": "the patch-4 pilot's k = 0 fit (patch4/pilot/L0-s100.json, outside the study)",
    "0.0025": "appendix B's exploratory per-head reading (decomposition/mechanism/mechanism.md)",
    "0.0015": "the intervention plan's LAMBDA (plan.json, fixed from pilots outside the study)",
    "7.5": "the lr 0.5x plan's learning rate, 7.5e-4 (fair-tuning/lr-0.5x/cells/plan.json)",
    "1.5": "the preset's learning rate, 1.5e-3 (fmnist-10k-converged-cpu)",
    "0.40": "the fair-tuning plans' paired SD of top-1, from the committed sweeps (plan.json notes)",
    "0.67": "the fair-tuning plans' design MDE at alpha 0.05 (plan.json notes)",
    "0.82": "the fair-tuning plans' design MDE at alpha 0.025 (plan.json notes)",
    "0.025": "the fair-tuning plans' per-lr alpha in the summary, 0.05 / 2 (Bonferroni; plan.json notes)",
    "0.125": "the exact sign-flip floor 1/2^n with 3 pairs",
    "0.031": "the exact sign-flip floor 1/2^n with 5 pairs",
    "547.7": "the paper's LM baseline count of components for 99 % (nanochat d20; paper.md)",
    "430.4": "the paper's all-Laplacian LM count of components for 99 % (paper.md)",
    "21.4": "the paper's relative spectral effect, 547.7 -> 430.4 (the LM plan's notes: 21.42 %)",
    "11.2": "nanochat d20's 11.2B training tokens in the paper (paper.md)",
    "0.45": "the stage-B plan's design MDE at the committed paired SD 0.39 (best-lr/cells/plan.json notes)",
    "0.0078": "the exact two-sided sign-flip floor 2/2^n with 8 pairs",
    "0.0001": "the tuned intervention plan's LAMBDA (intervention-tuned/cells/plan.json, fixed from its pilot)",
    "0.083": "the tuned intervention pilot's move of the fraction at LAMBDA 0.0001 (intervention-tuned/pilot)",
    "0.5831": "stage B's k = 0 mean fraction the tuned intervention pilot was read against (its plan's notes)",
    "0.5005": "the tuned intervention pilot's penalised fraction at LAMBDA 0.0001 (intervention-tuned/pilot/README.md)",
}


def test_every_decimal_in_the_record_based_parts_is_a_quote_or_a_named_constant():
    quoted = " ".join(" ".join(q.split()) for q in QUOTES.values())
    found = re.findall(r"(?<![\w.])[-+]?\d+\.\d+", _record_based_parts())
    unknown = sorted(
        {n for n in found if not {n, n.lstrip("+-")} & ({*quoted.split()} | set(CONSTANTS))}
        - {n for n in found if n in quoted or n.lstrip("+-") in quoted}
    )
    assert not unknown, f"decimals neither quoted from a stats.json nor named in CONSTANTS: {unknown}"
