"""Streaming first and second moments per class, in float64: the one accumulator every geometry metric builds on.

Design choices:

* **Shifted sums.** Variances computed as E[x^2] - E[x]^2 lose digits when the mean is large against the spread
  (residual streams often are). All sums are taken of ``x - shift``, with ``shift`` the mean of the first batch, so
  the subtraction happens on centred numbers; the result does not depend on the shift in exact arithmetic.
* **Memory O(C*D + D^2)**: per class a count, a sum and a sum of squared norms; the D x D scatter only when asked.
* **Labels < 0 are ignored** (e.g. next tokens outside the K most frequent), and the number of classes grows with
  the largest label seen, so a stream need not know C up front.
* **Weights** let a sequence mean stand for its T tokens (the token-weighted averages of the ANOVA).
"""

from __future__ import annotations

import torch

from lapheads.errors import InputError

__all__ = ["ClassMoments"]


class ClassMoments:
    """Per-class count, sum, squared norm (and optionally the pooled D x D scatter) of a stream of vectors.

    Args:
        num_classes: classes expected (more are added if larger labels arrive).
        scatter: also accumulate the pooled second moment sum (x - shift)(x - shift)^T (D x D).
    """

    def __init__(self, num_classes: int = 1, scatter: bool = False) -> None:
        self.num_classes = num_classes
        self.scatter = scatter
        self.shift: torch.Tensor | None = None
        self.count = torch.zeros(num_classes, dtype=torch.float64)
        self.sum: torch.Tensor | None = None  # (C, D)
        self.sq_norm = torch.zeros(num_classes, dtype=torch.float64)
        self.second: torch.Tensor | None = None  # (D, D)

    def _grow(self, num_classes: int, dim: int) -> None:
        if self.sum is None:
            self.sum = torch.zeros(self.num_classes, dim, dtype=torch.float64)
        if num_classes > self.num_classes:
            extra = num_classes - self.num_classes
            self.count = torch.cat([self.count, self.count.new_zeros(extra)])
            self.sq_norm = torch.cat([self.sq_norm, self.sq_norm.new_zeros(extra)])
            self.sum = torch.cat([self.sum, self.sum.new_zeros(extra, dim)])
            self.num_classes = num_classes

    def update(self, x: torch.Tensor, labels: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> None:
        """Add vectors ``x`` (N, D) with class ``labels`` (N,) (all class 0 when None) and optional ``weight`` (N,)."""
        x = x.detach().to("cpu", torch.float64)
        if x.ndim != 2:
            raise InputError(f"features must be (N, D); got shape {tuple(x.shape)}")
        labels = torch.zeros(len(x), dtype=torch.long) if labels is None else labels.detach().to("cpu", torch.long)
        if labels.shape != (len(x),):
            raise InputError(f"labels must be ({len(x)},) to match the features; got shape {tuple(labels.shape)}")
        keep = labels >= 0
        if not bool(keep.all()):
            x, labels = x[keep], labels[keep]
            weight = None if weight is None else weight.detach().cpu()[keep]
        if len(x) == 0:
            return
        w = torch.ones(len(x), dtype=torch.float64) if weight is None else weight.detach().to("cpu", torch.float64)
        if self.shift is None:
            self.shift = (w[:, None] * x).sum(0) / w.sum()
        self._grow(int(labels.max()) + 1, x.shape[1])
        centred = x - self.shift
        self.count.index_add_(0, labels, w)
        self.sum.index_add_(0, labels, w[:, None] * centred)
        self.sq_norm.index_add_(0, labels, w * centred.square().sum(1))
        if self.scatter:
            weighted = centred if weight is None else centred * w.sqrt()[:, None]
            second = weighted.T @ weighted
            self.second = second if self.second is None else self.second + second

    # -- read-outs (all float64) --------------------------------------------------------------------------------

    @property
    def total(self) -> float:
        return float(self.count.sum())

    def present(self) -> torch.Tensor:
        """Boolean (C,): classes that have at least one sample."""
        return self.count > 0

    def means(self) -> torch.Tensor:
        """(C_present, D) class means, in absolute coordinates."""
        keep = self.present()
        return self.shift + self.sum[keep] / self.count[keep, None]

    def global_mean(self) -> torch.Tensor:
        return self.shift + self.sum.sum(0) / self.total

    def class_variances(self) -> torch.Tensor:
        """(C_present,) mean squared distance of each class's samples to their class mean (trace of its covariance)."""
        keep = self.present()
        centred_means = self.sum[keep] / self.count[keep, None]
        return (self.sq_norm[keep] / self.count[keep] - centred_means.square().sum(1)).clamp_min(0)

    def total_variance(self) -> float:
        """Mean squared distance of all samples to the global mean."""
        mean = self.sum.sum(0) / self.total
        return max(float(self.sq_norm.sum() / self.total - mean.square().sum()), 0.0)

    def covariance(self) -> torch.Tensor:
        """Pooled (D, D) covariance of all samples about the global mean."""
        if self.second is None:
            raise RuntimeError("ClassMoments(scatter=True) is needed for covariances")
        mean = self.sum.sum(0) / self.total
        return self.second / self.total - torch.outer(mean, mean)

    def within_class_covariance(self) -> torch.Tensor:
        """Sigma_W = (1/N) sum_c sum_{i in c} (x_i - mu_c)(x_i - mu_c)^T."""
        if self.second is None:
            raise RuntimeError("ClassMoments(scatter=True) is needed for covariances")
        keep = self.present()
        centred_means = self.sum[keep] / self.count[keep, None]
        between = (centred_means * self.count[keep, None]).T @ centred_means
        return (self.second - between) / self.total
