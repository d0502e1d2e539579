"""Token geometry (paper §3): ANOVA of token variance, Neural Collapse, spectral decay, linguistic collapse, token
similarity, and the residual-stream capture that feeds them.

Every metric is a plain function on tensors (one shot, written as the definition reads) and a streaming
accumulator (float64 sums, memory O(D^2 + C*D)); the tests hold the two equal. ``lapheads analyze`` runs them over
run directories (:mod:`lapheads.study.analyze`); this package only ever sees tensors.
"""

from lapheads.geometry.anova import AnovaAccumulator, anova, within_sequence_fraction
from lapheads.geometry.collapse import NeuralCollapseAccumulator, nearest_centre, neural_collapse
from lapheads.geometry.features import ResidualStream, layer_names, select_layers
from lapheads.geometry.layers import LayerGeometry, LMLayerGeometry
from lapheads.geometry.linguistic import CDNVAccumulator, cdnv, top_k_classes
from lapheads.geometry.moments import ClassMoments
from lapheads.geometry.similarity import SimilarityAccumulator, token_similarity
from lapheads.geometry.spectrum import SpectrumAccumulator, components_for, spectral_decay

__all__ = [
    "AnovaAccumulator",
    "CDNVAccumulator",
    "ClassMoments",
    "LayerGeometry",
    "LMLayerGeometry",
    "NeuralCollapseAccumulator",
    "ResidualStream",
    "SimilarityAccumulator",
    "SpectrumAccumulator",
    "anova",
    "cdnv",
    "components_for",
    "layer_names",
    "nearest_centre",
    "neural_collapse",
    "select_layers",
    "spectral_decay",
    "token_similarity",
    "top_k_classes",
    "within_sequence_fraction",
]

from lapheads.submodules import submodule_getattr  # noqa: E402 - after the docstring and names above

__getattr__ = submodule_getattr(__name__)  # its modules by attribute: lapheads.geometry.<module>
