"""Neural Collapse (Papyan, Han & Donoho 2020) of features grouped by class (paper §3).

With class means mu_c, global mean mu_G, centred means M = [mu_c - mu_G], within-class covariance Sigma_W and
between-class covariance Sigma_B = M^T M / C:

* ``nc1`` = tr(Sigma_W Sigma_B^+) / C: within-class variability against the class separation (0 = collapsed).
  Sigma_B^+ is applied in the span of M through its SVD (rank <= C - 1), so no D x D pseudo-inverse with a
  fragile tolerance is formed.
* NC2: ``equinorm`` = std/mean of ||mu_c - mu_G||; ``equiangularity`` = std of the pairwise cosines of the
  centred means; ``etf_distance`` = mean |cos + 1/(C-1)| (0 for a simplex equiangular tight frame).
* ``nc3`` = || W/||W||_F - M/||M||_F ||_F with the classifier rows W (self-duality; needs ``classifier``).
* ``nc4`` = fraction of samples on which the nearest class centre agrees with the network's prediction (given
  ``predictions``, or the argmax of ``classifier``); ``ncc_accuracy`` = the nearest-centre classifier's accuracy.

Std's are population std's (no Bessel correction). Classes without samples are left out.
"""

from __future__ import annotations

import torch

from lapheads.errors import InputError
from lapheads.geometry.moments import ClassMoments

__all__ = ["NeuralCollapseAccumulator", "neural_collapse"]

# Singular values of M below this fraction of the largest count as zero (M has rank <= C - 1 by construction).
_RANK_RTOL = 1e-9


def collapse_from_moments(
    means: torch.Tensor, global_mean: torch.Tensor, sigma_w: torch.Tensor, classifier: torch.Tensor | None = None
) -> dict[str, float]:
    """NC1-NC3 from class means (C, D), the global mean (D,), Sigma_W (D, D) and an optional classifier (C, D)."""
    num_classes = len(means)
    if num_classes < 2:
        raise InputError(f"neural collapse needs at least 2 classes with samples; got {num_classes}")
    centred = means - global_mean
    _, s, vh = torch.linalg.svd(centred, full_matrices=False)
    keep = s > _RANK_RTOL * s[0]
    v, s = vh[keep].T, s[keep]
    # tr(Sigma_W Sigma_B^+) / C with Sigma_B^+ = C V diag(1/s^2) V^T
    nc1 = float(((v.T @ sigma_w @ v).diagonal() / s.square()).sum())
    norms = centred.norm(dim=1)
    unit = centred / norms.clamp_min(1e-300)[:, None]
    cosines = (unit @ unit.T)[~torch.eye(num_classes, dtype=torch.bool)]
    out = {
        "num_classes": num_classes,
        "nc1": nc1,
        "within_trace": float(sigma_w.trace()),
        "between_trace": float(centred.square().sum() / num_classes),
        "equinorm": float(norms.std(correction=0) / norms.mean()),
        "equiangularity": float(cosines.std(correction=0)),
        "etf_distance": float((cosines + 1 / (num_classes - 1)).abs().mean()),
    }
    if classifier is not None:
        w = classifier.detach().to("cpu", torch.float64)
        if w.shape != centred.shape:
            raise InputError(f"classifier must be (C, D) = {tuple(centred.shape)}; got {tuple(w.shape)}")
        out["nc3"] = float((w / w.norm() - centred / centred.norm()).norm())
    return out


def nearest_centre(features: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """Index of the nearest class mean for each feature vector."""
    return torch.cdist(features.to(means.dtype), means).argmin(1)


def neural_collapse(
    features: torch.Tensor,
    labels: torch.Tensor,
    classifier: torch.Tensor | None = None,
    predictions: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> dict[str, float]:
    """Neural Collapse metrics of ``features`` (N, D) with class ``labels`` (N,) in 0..C-1, in one shot.

    Args:
        features: one vector per sample (sequence means, CLS tokens, or tokens).
        labels: class indices.
        classifier: the last layer's weight (C, D), for ``nc3`` and (with ``bias``) for ``nc4``'s predictions.
        predictions: the network's predicted classes (N,) for ``nc4``; default: argmax of the classifier.
        bias: the classifier's bias (C,), used only to form predictions.
    """
    x = features.detach().to("cpu", torch.float64)
    y = labels.detach().to("cpu", torch.long)
    if x.ndim != 2 or y.shape != (len(x),):
        raise InputError(f"features must be (N, D) and labels (N,); got {tuple(x.shape)} and {tuple(y.shape)}")
    classes, index = y.unique(return_inverse=True)
    counts = torch.bincount(index, minlength=len(classes)).to(torch.float64)
    means = torch.zeros(len(classes), x.shape[1], dtype=torch.float64).index_add_(0, index, x) / counts[:, None]
    within = x - means[index]
    out = collapse_from_moments(
        means, x.mean(0), within.T @ within / len(x), None if classifier is None else classifier[classes]
    )
    nearest = classes[nearest_centre(x, means)]
    out["ncc_accuracy"] = float((nearest == y).double().mean())
    if predictions is None and classifier is not None:
        logits = x @ classifier.detach().to("cpu", torch.float64).T
        predictions = (logits + (0 if bias is None else bias.detach().to("cpu", torch.float64))).argmax(1)
    if predictions is not None:
        out["nc4"] = float((nearest == predictions.detach().cpu()).double().mean())
    return out


class NeuralCollapseAccumulator:
    """Streaming :func:`neural_collapse` (nc1, NC2, nc3); memory O(C*D + D^2).

    ``nc4`` needs the final class centres before the first sample can be classified, so it is left to the one-shot
    function (or a second pass with :func:`nearest_centre` on ``means()``).
    """

    def __init__(self, num_classes: int = 1) -> None:
        self.moments = ClassMoments(num_classes, scatter=True)

    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.moments.update(features, labels)

    def means(self) -> torch.Tensor:
        return self.moments.means()

    def compute(self, classifier: torch.Tensor | None = None) -> dict[str, float]:
        m = self.moments
        if classifier is not None:
            classifier = classifier[: m.num_classes][m.present()]
        return collapse_from_moments(m.means(), m.global_mean(), m.within_class_covariance(), classifier)
