"""Neural Collapse: the simplex ETF gives the ideal values, hand cases, and streaming == one shot."""

from __future__ import annotations

import pytest
import torch

from lapheads.geometry import NeuralCollapseAccumulator, nearest_centre, neural_collapse
from tests.geometry.conftest import random_splits, simplex_etf


def _collapsed(num_classes=5, dim=8, per_class=6, noise=0.0, offset=0.0, seed=0):
    means = simplex_etf(num_classes, dim, seed=seed) + offset
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    gen = torch.Generator().manual_seed(seed)
    return means[labels] + noise * torch.randn(len(labels), dim, generator=gen, dtype=torch.float64), labels, means


def test_perfect_simplex_etf_is_fully_collapsed():
    features, labels, means = _collapsed(offset=4.0)
    classifier = (means - means.mean(0)) / 7.0  # the normalised centred means, at any scale
    bias = -classifier @ means.mean(0)  # a trained network's bias absorbs the offset of the features
    out = neural_collapse(features, labels, classifier=classifier, bias=bias)
    assert out["nc1"] == pytest.approx(0.0, abs=1e-20)
    assert out["etf_distance"] == pytest.approx(0.0, abs=1e-12)
    assert out["equinorm"] == pytest.approx(0.0, abs=1e-12)
    assert out["equiangularity"] == pytest.approx(0.0, abs=1e-12)
    assert out["nc3"] == pytest.approx(0.0, abs=1e-12)
    assert out["nc4"] == 1.0 and out["ncc_accuracy"] == 1.0


def test_hand_computed_nc1_two_classes_in_one_dimension():
    # class 0 at {-1 - a, -1 + a}, class 1 at {1 - a, 1 + a}: Sigma_W = a^2, Sigma_B = 1, nc1 = a^2 / 2
    a = 0.3
    features = torch.tensor([[-1 - a], [-1 + a], [1 - a], [1 + a]], dtype=torch.float64)
    out = neural_collapse(features, torch.tensor([0, 0, 1, 1]))
    assert out["nc1"] == pytest.approx(a**2 / 2)
    assert out["etf_distance"] == pytest.approx(0.0)  # two opposite means are the 2-class simplex


def test_distortions_move_the_metrics_away_from_zero():
    features, labels, means = _collapsed(noise=0.5)
    noisy = neural_collapse(features, labels)
    assert noisy["nc1"] > 0.01 and noisy["ncc_accuracy"] > 0.9
    stretched = features.clone()
    stretched[labels == 0] *= 3  # one class farther out: unequal norms and angles
    out = neural_collapse(stretched, labels)
    assert out["equinorm"] > 0.3 and out["etf_distance"] > 0.05


def test_nc4_counts_disagreement_with_the_given_predictions():
    features, labels, _ = _collapsed()
    predictions = labels.clone()
    predictions[:3] = (labels[:3] + 1) % 5
    assert neural_collapse(features, labels, predictions=predictions)["nc4"] == pytest.approx(1 - 3 / len(labels))


def test_wrong_classifier_breaks_self_duality():
    features, labels, means = _collapsed()
    assert neural_collapse(features, labels, classifier=means.flip(0))["nc3"] > 0.5


@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_equals_one_shot(seed):
    features, labels, _ = _collapsed(noise=0.7, offset=1e3, per_class=30, seed=seed)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    features, labels = features[order], labels[order]
    classifier = torch.randn(5, 8, dtype=torch.float64)
    acc = NeuralCollapseAccumulator()
    for part in random_splits(len(labels), seed):
        acc.update(features[part], labels[part])
    streamed = acc.compute(classifier=classifier)
    one_shot = neural_collapse(features, labels, classifier=classifier)
    for key in ("nc1", "equinorm", "equiangularity", "etf_distance", "nc3", "within_trace", "between_trace"):
        assert streamed[key] == pytest.approx(one_shot[key], rel=1e-8), key
    # a second pass with the streamed centres gives the one-shot nearest-centre accuracy
    ncc = (nearest_centre(features, acc.means()) == labels).double().mean()
    assert float(ncc) == pytest.approx(one_shot["ncc_accuracy"])


def test_needs_two_classes():
    with pytest.raises(ValueError, match="at least 2 classes"):
        neural_collapse(torch.randn(5, 3), torch.zeros(5, dtype=torch.long))
