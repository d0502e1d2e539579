"""Every metric lapheads reports, by its label: where a task's headline numbers are read, the geometry rows and
layers a report states, which way a metric improves, and which way the paper claims it moves with Laplacian heads.

Readers (report, demo, analyze) import these facts from here instead of matching labels among themselves; the task
table (:mod:`lapheads.tasks`) names each task's rows from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = [
    "LM_GEOMETRY",
    "MECHANISM",
    "METRICS",
    "Metric",
    "VISION_FIGURES",
    "VISION_GEOMETRY",
    "VISION_LAYERS",
    "VISION_OVER_TRAINING",
    "claim",
    "logged",
]


@dataclass(frozen=True)
class Metric:
    """One number a report compares across arms.

    Args:
        label: the row's words in reports ("test top-1 (%)"); a geometry row adds its layer in parentheses.
        source: where a run holds it: "metrics" (the last value logged in metrics.jsonl), a JSON file of the run's
            report/ folder ("eval_dino.json", "eval_chat.json"), "analysis" (one layer's entry of ``lapheads
            analyze``) or "heads" (the report's reading of the analysis's heads: the mechanism rows).
        path: the keys down to the value (for "metrics": the one logged key; for "heads": none).
        claim: the direction the paper reports with Laplacian heads: +1 rises, -1 falls, None no claim.
        lower_is_better: a fall is an improvement (losses, bits per byte); a report's "still improving" reads it.
    """

    label: str
    source: str
    path: tuple[str, ...] = ()
    claim: int | None = None
    lower_is_better: bool = False

    @property
    def better(self) -> int:
        """+1 where the metric improves by rising, -1 where it improves by falling."""
        return -1 if self.lower_is_better else +1


# Headline metrics (a task's ``Task.headline``)
TEST_TOP1 = Metric("test top-1 (%)", "metrics", ("eval_top1",), claim=+1)
VAL_BPB = Metric("validation bits per byte", "metrics", ("val_bpb",), claim=-1, lower_is_better=True)
#: on the whole held-out split, once after the last step (``lapheads train lm --eval-whole-split``)
VAL_BPB_WHOLE = Metric(
    "validation bits per byte, whole split", "metrics", ("val_bpb_whole",), claim=-1, lower_is_better=True
)
VAL_LOSS = Metric("validation loss (nats)", "metrics", ("val_loss",), lower_is_better=True)
DINO_HEADLINE = (
    Metric("k-NN top-1, k = 20 (%)", "eval_dino.json", ("knn", "20"), claim=+1),
    Metric("k-NN top-1 at random init, k = 20 (%)", "eval_dino.json", ("knn_random_init", "20")),
    Metric("linear probe top-1 (%)", "eval_dino.json", ("linear", "test_accuracy"), claim=+1),
    Metric("segmentation mIoU (%)", "eval_dino.json", ("segmentation", "miou"), claim=+1),
    Metric("PCA foreground IoU (%)", "eval_dino.json", ("pca_foreground_iou",), claim=+1),
)
SFT_HEADLINE = (
    VAL_LOSS,
    Metric("held-out arith accuracy", "eval_chat.json", ("tasks", "arith", "accuracy")),
    Metric("held-out letters accuracy", "eval_chat.json", ("tasks", "letters", "accuracy")),
    Metric("ChatCORE", "eval_chat.json", ("chatcore",), claim=+1),
)

# Geometry rows (a task's ``Task.geometry``): read from one layer's analysis, stated at each of the task's layers
WITHIN_SEQUENCE_FRACTION = Metric("within-sequence fraction", "analysis", ("anova", "within_seq_fraction"), claim=-1)
COMPONENTS_POOLED = Metric("components for 99%, pooled", "analysis", ("spectrum", "n_components"), claim=-1)
COMPONENTS_PER_SEQUENCE = Metric(
    "components for 99%, per sequence", "analysis", ("spectrum", "n_components_per_seq"), claim=-1
)
TOKEN_SIMILARITY = Metric("token cosine similarity", "analysis", ("similarity",))
VISION_GEOMETRY = (
    WITHIN_SEQUENCE_FRACTION,
    Metric("between-class fraction", "analysis", ("anova", "between_class_fraction"), claim=+1),
    Metric("within / between-class variance", "analysis", ("anova", "within_to_between_class"), claim=-1),
    Metric("within-sequence variance / mean |h|^2", "analysis", ("anova", "within_seq_scale_free"), claim=-1),
    Metric("NC1, sequence means", "analysis", ("collapse_seq", "nc1"), claim=-1),
    Metric("ETF distance, sequence means", "analysis", ("collapse_seq", "etf_distance"), claim=-1),
    COMPONENTS_POOLED,
    COMPONENTS_PER_SEQUENCE,
    TOKEN_SIMILARITY,
)
LM_GEOMETRY = (
    Metric("CDNV, next-token classes", "analysis", ("linguistic", "cdnv"), claim=-1),
    WITHIN_SEQUENCE_FRACTION,  # each window one class (analysis version 6; absent from older records: no row)
    Metric("NC1, next-token classes", "analysis", ("linguistic", "nc1"), claim=-1),
    COMPONENTS_POOLED,
    COMPONENTS_PER_SEQUENCE,
    TOKEN_SIMILARITY,
)
VISION_LAYERS = ("last block", "after the final norm")
VISION_FIGURES = ("anova", "collapse", "spectrum", "similarity", "mechanism")
VISION_OVER_TRAINING = (
    "within-sequence fraction",
    "components for 99%, pooled",
    "token cosine similarity",
)

#: The mechanism rows a report reads off the analysis's heads (lapheads.study.report.statistics): the rows of other
#: head kinds ("diffusion score, sum heads", "..., ordinary heads minus their k = 0 twins") carry no claim
MECHANISM = (
    Metric(
        "diffusion score, Laplacian heads", "heads", claim=+1
    ),  # the heat-diffusion reading: a Laplacian head smooths
    Metric("Laplacian excess over ordinary heads", "heads", claim=+1),  # ... more than an ordinary head's circuit would
    # ... and, measured on data, more than the same head of the k = 0 run of the same seed (analysis version 5)
    Metric("within-sequence fraction drop, Laplacian heads minus their k = 0 twins", "heads", claim=+1),
    Metric("P-aware diffusion, Laplacian heads minus their k = 0 twins", "heads", claim=+1),
)

#: Every declared metric by its label: what a report row's label names
METRICS: dict[str, Metric] = {
    m.label: m
    for m in (
        TEST_TOP1,
        VAL_BPB,
        VAL_BPB_WHOLE,
        *DINO_HEADLINE,
        *SFT_HEADLINE,
        *VISION_GEOMETRY,
        *LM_GEOMETRY,
        *MECHANISM,
    )
}


def claim(label: str) -> int | None:
    """The direction the paper reports for a report row's ``label`` (+1 rises, -1 falls), None where it makes no
    claim; a row's qualifier in parentheses (the layer it was measured at; "diffusion score, Laplacian heads (block
    3)") does not change the claim."""
    for where in VISION_LAYERS:  # every layer a report names: "last block", "after the final norm"
        label = label.removesuffix(f" ({where})")
    metric = METRICS.get(label) or METRICS.get(label.rsplit(" (", 1)[0])
    return None if metric is None else metric.claim


def logged(key: str) -> Metric:
    """The metric logged in metrics.jsonl under ``key`` (``lapheads report --metric KEY``), labelled by the key: a
    declared one keeps its claim and direction (``val_bpb`` improves by falling), any other key has neither."""
    for metric in METRICS.values():
        if metric.source == "metrics" and metric.path == (key,):
            return dataclasses.replace(metric, label=key)
    return Metric(key, "metrics", (key,))
