"""The accumulators of one layer: every metric ``lapheads analyze`` reports, fed batch by batch.

Tensors in, numbers out: a supervised layer (:class:`LayerGeometry`: ANOVA, Neural Collapse on sequence means and
tokens, spectra, similarity) and a language-model layer (:class:`LMLayerGeometry`: the ANOVA with each window one
class, spectra, similarity, CDNV and NC1 with next-token classes).
"""

from __future__ import annotations

from typing import Any

import torch

from lapheads.geometry.anova import AnovaAccumulator
from lapheads.geometry.collapse import NeuralCollapseAccumulator, neural_collapse
from lapheads.geometry.linguistic import CDNVAccumulator
from lapheads.geometry.similarity import SimilarityAccumulator
from lapheads.geometry.spectrum import SpectrumAccumulator

__all__ = ["LayerGeometry", "LMLayerGeometry"]


class LayerGeometry:
    """The accumulators of one layer of a supervised run."""

    def __init__(self, fraction: float) -> None:
        self.anova = AnovaAccumulator()
        self.collapse_tokens = NeuralCollapseAccumulator()
        self.spectrum = SpectrumAccumulator(fraction)
        self.similarity = SimilarityAccumulator()
        self.seq_means: list[torch.Tensor] = []

    def update(self, h: torch.Tensor, labels: torch.Tensor) -> None:
        h = h.float().cpu()
        self.anova.update(h, labels)
        self.collapse_tokens.update(h.reshape(-1, h.shape[-1]), labels.repeat_interleave(h.shape[1]))
        self.spectrum.update(h)
        self.similarity.update(h)
        self.seq_means.append(h.mean(1))

    def compute(self, labels: torch.Tensor, predictions: torch.Tensor) -> dict[str, Any]:
        return {
            "anova": self.anova.compute(),
            "collapse_seq": neural_collapse(torch.cat(self.seq_means), labels, predictions=predictions),
            "collapse_tokens": self.collapse_tokens.compute(),
            "spectrum": self.spectrum.compute(),
            "similarity": self.similarity.compute(),
        }


class LMLayerGeometry:
    """The accumulators of one layer of a language model: classes are the next token (top K), no sequence labels.

    The ANOVA treats every window as one class (a text has no label), so its within-sequence fraction is the share
    of the tokens' variance about their window's mean, the quantity the paper's smoothing argument rests on, computed
    as the vision analysis computes it (``between_class`` is 0 here)."""

    def __init__(self, fraction: float) -> None:
        self.anova = AnovaAccumulator()
        self.spectrum = SpectrumAccumulator(fraction)
        self.similarity = SimilarityAccumulator()
        self.cdnv = CDNVAccumulator()
        self.collapse = NeuralCollapseAccumulator()

    def update(self, h: torch.Tensor, next_token_classes: torch.Tensor) -> None:
        h = h.float().cpu()
        flat, classes = h.reshape(-1, h.shape[-1]), next_token_classes.reshape(-1)
        self.anova.update(h)
        self.spectrum.update(h)
        self.similarity.update(h)
        self.cdnv.update(flat, classes)
        self.collapse.update(flat, classes)

    def compute(self) -> dict[str, Any]:
        cdnv = self.cdnv.compute()
        return {
            "anova": self.anova.compute(),
            "spectrum": self.spectrum.compute(),
            "similarity": self.similarity.compute(),
            "linguistic": {
                "cdnv": cdnv["cdnv"],
                "num_classes": cdnv["num_classes"],
                "nc1": self.collapse.compute()["nc1"],
            },
        }
