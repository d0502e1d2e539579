"""Every metric lapheads reports, by its label: where a task's headline numbers are read, the geometry rows and
layers a report states, which way a metric improves, and which way the paper claims it moves with Laplacian heads.

Readers (report, demo, analyze) import these facts from here instead of matching labels among themselves; the task
table (:mod:`lapheads.tasks`) names each task's rows from here.
"""

from __future__ import annotations

__all__ = [
    "CLAIMS",
    "LM_GEOMETRY",
    "LOWER_IS_BETTER",
    "Metric",
    "VISION_FIGURES",
    "VISION_GEOMETRY",
    "VISION_LAYERS",
    "VISION_OVER_TRAINING",
    "better_direction",
    "claim",
]

#: (label, source, path): source "metrics" = the last logged value in metrics.jsonl; otherwise the name of a JSON
#: file in the run's report/ folder ("eval_dino.json", "eval_chat.json") and the keys down to the value
Metric = tuple[str, str, tuple[str, ...]]

VISION_GEOMETRY = (
    ("within-sequence fraction", ("anova", "within_seq_fraction")),
    ("between-class fraction", ("anova", "between_class_fraction")),
    ("within / between-class variance", ("anova", "within_to_between_class")),
    ("within-sequence variance / mean |h|^2", ("anova", "within_seq_scale_free")),
    ("NC1, sequence means", ("collapse_seq", "nc1")),
    ("ETF distance, sequence means", ("collapse_seq", "etf_distance")),
    ("components for 99%, pooled", ("spectrum", "n_components")),
    ("components for 99%, per sequence", ("spectrum", "n_components_per_seq")),
    ("token cosine similarity", ("similarity",)),
)
LM_GEOMETRY = (
    ("CDNV, next-token classes", ("linguistic", "cdnv")),
    ("NC1, next-token classes", ("linguistic", "nc1")),
    ("components for 99%, pooled", ("spectrum", "n_components")),
    ("components for 99%, per sequence", ("spectrum", "n_components_per_seq")),
    ("token cosine similarity", ("similarity",)),
)
VISION_LAYERS = ("last block", "after the final norm")
VISION_FIGURES = ("anova", "collapse", "spectrum", "similarity", "mechanism")
VISION_OVER_TRAINING = (
    "within-sequence fraction",
    "components for 99%, pooled",
    "token cosine similarity",
)

#: The direction the paper reports for a metric with Laplacian heads (+1 rises, -1 falls); absent = no claim.
CLAIMS: dict[str, int] = {
    "test top-1 (%)": +1,
    "validation bits per byte": -1,
    "k-NN top-1, k = 20 (%)": +1,
    "linear probe top-1 (%)": +1,
    "segmentation mIoU (%)": +1,
    "PCA foreground IoU (%)": +1,
    "within-sequence fraction": -1,
    "between-class fraction": +1,
    "within / between-class variance": -1,
    "within-sequence variance / mean |h|^2": -1,
    "NC1, sequence means": -1,
    "ETF distance, sequence means": -1,
    "components for 99%, pooled": -1,
    "components for 99%, per sequence": -1,
    "CDNV, next-token classes": -1,
    "NC1, next-token classes": -1,
    "ChatCORE": +1,
    "diffusion score, Laplacian heads": +1,  # the heat-diffusion reading: a Laplacian head smooths
    "Laplacian excess over ordinary heads": +1,  # ... more than an ordinary head's circuit would in its place
    # ... and, measured on data, more than the same head of the k = 0 run of the same seed (analysis version 5)
    "within-sequence fraction drop, Laplacian heads minus their k = 0 twins": +1,
    "P-aware diffusion, Laplacian heads minus their k = 0 twins": +1,
}
#: Headline metrics where a fall is an improvement (the rest improve by rising).
LOWER_IS_BETTER = frozenset({"validation bits per byte", "validation loss (nats)"})


def claim(label: str) -> int | None:
    """The direction the paper reports for ``label`` (+1 rises, -1 falls), None where it makes no claim; a row's
    qualifier in parentheses (the layer it was measured at; "diffusion score, Laplacian heads (block 3)") does not
    change the claim."""
    for where in VISION_LAYERS:  # every layer a report names: "last block", "after the final norm"
        label = label.removesuffix(f" ({where})")
    if label in CLAIMS:
        return CLAIMS[label]
    return CLAIMS.get(label.rsplit(" (", 1)[0])


def better_direction(label: str) -> int:
    """+1 where a metric improves by rising, -1 where it improves by falling (losses, bits per byte)."""
    return -1 if label in LOWER_IS_BETTER else +1
