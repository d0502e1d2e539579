"""Spectral decay of token representations: how many principal components explain a fraction of the variance.

The paper's headline statistic is the number of components explaining 99% of the variance (LM: 547.7 baseline
-> 430.4 all-Laplacian). Its pooling is not stated, so both are reported:

* ``n_components``: eigen-spectrum of the covariance of all tokens pooled (about the global mean);
* ``n_components_per_seq``: the same count for each sequence's own token covariance (about its mean), averaged
  over sequences;
* ``eigenvalues``: the pooled spectrum, descending, normalised to sum 1.

A faster decay (fewer components) means tokens occupy a lower-dimensional subspace.
"""

from __future__ import annotations

import torch

from lapheads.errors import InputError
from lapheads.geometry.moments import ClassMoments

__all__ = ["SpectrumAccumulator", "components_for", "spectral_decay"]

# Cumulative sums that reach the fraction up to rounding count as reaching it.
_ROUNDING = 1e-12


def components_for(eigenvalues: torch.Tensor, fraction: float) -> torch.Tensor:
    """Number of leading eigenvalues whose sum reaches ``fraction`` of the total, along the last dimension.

    ``eigenvalues`` need not be sorted; an all-zero spectrum needs 0 components.
    """
    ev = eigenvalues.clamp_min(0).sort(dim=-1, descending=True).values
    total = ev.sum(-1, keepdim=True)
    cumulative = ev.cumsum(-1) / total.clamp_min(1e-300)
    count = (cumulative < fraction - _ROUNDING).sum(-1) + 1
    return torch.where(total.squeeze(-1) > 0, count.clamp_max(ev.shape[-1]), torch.zeros_like(count))


def _per_sequence_eigenvalues(h: torch.Tensor) -> torch.Tensor:
    """(N_seq, min(T, D)) eigenvalues of each sequence's token covariance, through the smaller Gram matrix."""
    centred = h - h.mean(1, keepdim=True)
    gram = centred @ centred.transpose(1, 2) if h.shape[1] <= h.shape[2] else centred.transpose(1, 2) @ centred
    return torch.linalg.eigvalsh(gram) / h.shape[1]


def _check_fraction(fraction: float) -> None:
    if not 0 < fraction <= 1:
        raise InputError(f"fraction must be in (0, 1]; got {fraction}")


def spectral_decay(h: torch.Tensor, fraction: float = 0.99) -> dict[str, object]:
    """Components explaining ``fraction`` of the variance of tokens ``h`` (N_seq, T, D) or (N, D), in one shot."""
    _check_fraction(fraction)
    h = h.detach().to("cpu", torch.float64)
    tokens = h.reshape(-1, h.shape[-1])
    centred = tokens - tokens.mean(0)
    eigenvalues = torch.linalg.eigvalsh(centred.T @ centred / len(tokens)).flip(0).clamp_min(0)
    out: dict[str, object] = {
        "fraction": fraction,
        "n_components": int(components_for(eigenvalues, fraction)),
        "eigenvalues": (eigenvalues / eigenvalues.sum()).tolist(),
    }
    if h.ndim == 3:
        out["n_components_per_seq"] = float(components_for(_per_sequence_eigenvalues(h), fraction).double().mean())
    return out


class SpectrumAccumulator:
    """Streaming :func:`spectral_decay` over batches of whole sequences; memory O(D^2)."""

    def __init__(self, fraction: float = 0.99) -> None:
        _check_fraction(fraction)
        self.fraction = fraction
        self.moments = ClassMoments(scatter=True)
        self.per_seq_sum = 0.0
        self.sequences = 0

    def update(self, h: torch.Tensor) -> None:
        h = h.detach().to("cpu", torch.float64)
        self.moments.update(h.reshape(-1, h.shape[-1]))
        if h.ndim == 3:
            self.per_seq_sum += float(components_for(_per_sequence_eigenvalues(h), self.fraction).double().sum())
            self.sequences += len(h)

    def compute(self) -> dict[str, object]:
        eigenvalues = torch.linalg.eigvalsh(self.moments.covariance()).flip(0).clamp_min(0)
        out: dict[str, object] = {
            "fraction": self.fraction,
            "n_components": int(components_for(eigenvalues, self.fraction)),
            "eigenvalues": (eigenvalues / eigenvalues.sum()).tolist(),
        }
        if self.sequences:
            out["n_components_per_seq"] = self.per_seq_sum / self.sequences
        return out
