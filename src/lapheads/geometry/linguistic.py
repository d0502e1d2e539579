"""Linguistic collapse (Wu & Papyan 2024): separability of representations that share the same next token.

Classes are next-token ids, restricted to the K most frequent next tokens (:func:`top_k_classes`). For classes
c, c' with means mu_c and within-class variances sigma_c^2 (mean squared distance to mu_c),

    CDNV(c, c') = (sigma_c^2 + sigma_c'^2) / (2 ||mu_c - mu_c'||^2)      (lower = more separable)

and NC1 with next-token classes comes from :mod:`lapheads.geometry.collapse`.
"""

from __future__ import annotations

import torch

from lapheads.errors import InputError
from lapheads.geometry.moments import ClassMoments

__all__ = ["CDNVAccumulator", "cdnv", "cdnv_from_moments", "top_k_classes"]


def cdnv_from_moments(moments: ClassMoments) -> dict[str, object]:
    means, variances = moments.means(), moments.class_variances()
    num_classes = len(means)
    if num_classes < 2:
        raise InputError(f"CDNV needs at least 2 classes with samples; got {num_classes}")
    distances = torch.cdist(means, means).square()
    matrix = (variances[:, None] + variances[None, :]) / (2 * distances)
    off_diagonal = ~torch.eye(num_classes, dtype=torch.bool)
    matrix[~off_diagonal] = 0.0
    return {"num_classes": num_classes, "cdnv": float(matrix[off_diagonal].mean()), "matrix": matrix}


def cdnv(features: torch.Tensor, labels: torch.Tensor) -> dict[str, object]:
    """Mean off-diagonal CDNV and the (C, C) matrix (zero diagonal) of ``features`` (N, D) grouped by ``labels``.

    Labels < 0 are left out (tokens whose next token is not among the K most frequent).
    """
    if features.ndim != 2 or labels.shape != (len(features),):
        raise InputError(
            f"features must be (N, D) and labels (N,); got {tuple(features.shape)} and {tuple(labels.shape)}"
        )
    moments = ClassMoments()
    moments.update(features, labels)
    return cdnv_from_moments(moments)


class CDNVAccumulator:
    """Streaming :func:`cdnv`; memory O(C*D)."""

    def __init__(self, num_classes: int = 1) -> None:
        self.moments = ClassMoments(num_classes)

    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.moments.update(features, labels)

    def compute(self) -> dict[str, object]:
        return cdnv_from_moments(self.moments)


def top_k_classes(next_tokens: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """Map next-token ids to classes 0..k-1 by frequency rank in ``counts`` (vocab,), and the rest to -1."""
    if k < 2:
        raise InputError(f"top_k must be >= 2; got {k}")
    top = counts.topk(min(k, len(counts))).indices
    rank = torch.full((len(counts),), -1, dtype=torch.long)
    rank[top] = torch.arange(len(top))
    return rank[next_tokens.long()]
