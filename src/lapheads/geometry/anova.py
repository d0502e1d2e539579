"""ANOVA of token variance: within-sequence, between-sequence-within-class and between-class scatter (paper §3).

Tokens h[s, t] of sequence (image) s with class c(s); sequence mean mu_s, class mean mu_c, global mean mu_G. The
token-weighted mean squared distance to mu_G splits exactly as

    total = Avg ||h - mu_s||^2  +  Avg ||mu_s - mu_c||^2  +  Avg ||mu_c - mu_G||^2
            (within_seq)          (between_seq)             (between_class)

where every average runs over tokens. ``total`` is computed independently, so the identity is a check, not a
definition. The paper's claim: Laplacian heads shrink ``within_seq`` and grow ``between_class``.
"""

from __future__ import annotations

import torch

from lapheads.errors import InputError
from lapheads.geometry.moments import ClassMoments

__all__ = ["AnovaAccumulator", "anova", "within_sequence_fraction"]

PARTS = ("within_seq", "between_seq", "between_class")


def _with_fractions(parts: dict[str, float], total: float, mean_sq_norm: float) -> dict[str, float]:
    """The parts, their fractions of the total (which sum to 1, so they are one finding, not three), the
    within-sequence / between-class ratio, and the scale-free within-sequence variance (÷ mean ‖h‖²), which a
    change of the stream's overall scale leaves alone."""
    out = {**parts, "total": total}
    out.update({f"{name}_fraction": (value / total if total > 0 else 0.0) for name, value in parts.items()})
    separated = parts["between_class"] > 1e-12 * total  # one class: the part is rounding error, no ratio
    out["within_to_between_class"] = parts["within_seq"] / parts["between_class"] if separated else None
    out["within_seq_scale_free"] = parts["within_seq"] / mean_sq_norm if mean_sq_norm > 0 else 0.0
    return out


def _check(h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    if h.ndim != 3:
        raise InputError(f"h must be (N_seq, T, D); got shape {tuple(h.shape)}")
    if labels is None:
        return torch.zeros(len(h), dtype=torch.long)
    if labels.shape != (len(h),):
        raise InputError(f"labels must be (N_seq,) = ({len(h)},); got shape {tuple(labels.shape)}")
    labels = labels.to("cpu", torch.long)
    if len(labels) and int(labels.min()) < 0:
        raise InputError(f"labels must be class indices >= 0; got {int(labels.min())}")
    return labels


def anova(h: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, float]:
    """The variance decomposition of tokens ``h`` (N_seq, T, D) with sequence ``labels`` (N_seq,), in one shot.

    Returns ``within_seq``, ``between_seq``, ``between_class``, ``total`` and each part's ``*_fraction`` of the
    total. Without labels every sequence is one class (``between_class`` = 0).
    """
    labels = _check(h, labels)
    h = h.detach().to("cpu", torch.float64)
    seq_means = h.mean(1)
    classes, index = labels.unique(return_inverse=True)
    class_means = torch.zeros(len(classes), h.shape[2], dtype=torch.float64).index_add_(0, index, seq_means)
    class_means /= torch.bincount(index, minlength=len(classes))[:, None]
    global_mean = h.mean((0, 1))
    parts = {  # equal T per sequence, so token-weighted averages of per-sequence terms are plain means
        "within_seq": float((h - seq_means[:, None]).square().sum(-1).mean()),
        "between_seq": float((seq_means - class_means[index]).square().sum(-1).mean()),
        "between_class": float((class_means[index] - global_mean).square().sum(-1).mean()),
    }
    return _with_fractions(parts, float((h - global_mean).square().sum(-1).mean()), float(h.square().sum(-1).mean()))


def within_sequence_fraction(h: torch.Tensor) -> torch.Tensor:
    """The within-sequence fraction of a batch's tokens ``h`` (B, T, D), differentiable: the sum of squared distances
    to each sequence's mean over the sum of squared distances to the batch's mean (the report's ``anova``
    ``within_seq_fraction`` with the batch as the data). A training penalty on it moves the geometry directly, without
    Laplacian heads (``lapheads train classify --within-seq-penalty``); computed in fp32 at least."""
    h = h.float() if h.dtype in (torch.float16, torch.bfloat16) else h
    within = (h - h.mean(1, keepdim=True)).square().sum()
    total = (h - h.mean((0, 1), keepdim=True)).square().sum()
    return within / total.clamp_min(torch.finfo(h.dtype).tiny)


class AnovaAccumulator:
    """Streaming :func:`anova`: feed batches of whole sequences; memory O(C*D)."""

    def __init__(self) -> None:
        self.within_sum = 0.0
        self.tokens = ClassMoments()  # all tokens, one class: the independent total
        self.seq_means = ClassMoments()  # sequence means weighted by their token count, per class

    def update(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        labels = _check(h, labels)
        h = h.detach().to("cpu", torch.float64)
        seq_means = h.mean(1)
        self.within_sum += float((h - seq_means[:, None]).square().sum())
        self.tokens.update(h.reshape(-1, h.shape[2]))
        self.seq_means.update(seq_means, labels, weight=torch.full((len(h),), float(h.shape[1])))

    def compute(self) -> dict[str, float]:
        n = self.tokens.total
        seq = self.seq_means
        keep = seq.present()
        weights = seq.count[keep]
        parts = {
            "within_seq": self.within_sum / n,
            "between_seq": float((weights * seq.class_variances()).sum()) / n,
            "between_class": float((weights * (seq.means() - seq.global_mean()).square().sum(1)).sum()) / n,
        }
        total = self.tokens.total_variance()  # mean ‖h‖² = variance about the mean + ‖mean‖²
        return _with_fractions(parts, total, total + float(self.tokens.global_mean().square().sum()))
