"""Token similarity: the mean pairwise cosine similarity of the tokens of a sequence (the oversmoothing measure).

For unit tokens u_1..u_T, the mean over pairs t != t' of u_t . u_t' equals (||sum_t u_t||^2 - T) / (T (T - 1)),
so the streaming form costs O(T D) per sequence and never builds the T x T matrix; the one-shot form builds it,
as the definition reads, and the tests hold the two equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lapheads.errors import InputError

__all__ = ["SimilarityAccumulator", "token_similarity"]


def _unit(h: torch.Tensor) -> torch.Tensor:
    if h.ndim != 3 or h.shape[1] < 2:
        raise InputError(f"h must be (N_seq, T >= 2, D); got shape {tuple(h.shape)}")
    return F.normalize(h.detach().to("cpu", torch.float64), dim=-1)


def token_similarity(h: torch.Tensor) -> float:
    """Mean over sequences of the mean pairwise (t != t') cosine similarity of the tokens of ``h`` (N_seq, T, D)."""
    unit = _unit(h)
    cosines = unit @ unit.transpose(1, 2)
    off_diagonal = ~torch.eye(h.shape[1], dtype=torch.bool)
    return float(cosines[:, off_diagonal].mean())


class SimilarityAccumulator:
    """Streaming :func:`token_similarity`; memory O(1)."""

    def __init__(self) -> None:
        self.sum = 0.0
        self.sequences = 0

    def update(self, h: torch.Tensor) -> None:
        unit = _unit(h)
        t = h.shape[1]
        self.sum += float(((unit.sum(1).square().sum(-1) - t) / (t * (t - 1))).sum())
        self.sequences += len(h)

    def compute(self) -> float:
        return self.sum / max(self.sequences, 1)
