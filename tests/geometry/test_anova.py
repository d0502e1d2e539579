"""ANOVA of token variance: the exact decomposition, hand cases, and streaming == one shot."""

from __future__ import annotations

import pytest
import torch

from lapheads.geometry import AnovaAccumulator, anova, within_sequence_fraction
from tests.geometry.conftest import random_splits


def _tokens(n_seq=40, t=7, d=5, classes=4, offset=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n_seq,), generator=gen)
    class_part = 2 * torch.randn(classes, d, generator=gen, dtype=torch.float64)[labels]
    seq_part = torch.randn(n_seq, d, generator=gen, dtype=torch.float64)
    h = class_part[:, None] + seq_part[:, None] + 0.5 * torch.randn(n_seq, t, d, generator=gen, dtype=torch.float64)
    return h + offset, labels


def test_hand_computed_case():
    # two classes, one sequence each, two 1-D tokens: {0, 2} (class 0) and {4, 4} (class 1)
    h = torch.tensor([[[0.0], [2.0]], [[4.0], [4.0]]])
    out = anova(h, torch.tensor([0, 1]))
    # means: seq 1, 4; global 2.5. within = (1 + 1 + 0 + 0)/4; between_class = (1.5^2 * 2 + 1.5^2 * 2)/4
    assert out["within_seq"] == pytest.approx(0.5)
    assert out["between_seq"] == pytest.approx(0.0)
    assert out["between_class"] == pytest.approx(2.25)
    assert out["total"] == pytest.approx((2.5**2 + 0.5**2 + 1.5**2 * 2) / 4)


def test_parts_sum_to_total_and_fractions_to_one():
    h, labels = _tokens()
    out = anova(h, labels)
    assert out["within_seq"] + out["between_seq"] + out["between_class"] == pytest.approx(out["total"], rel=1e-12)
    assert sum(out[f"{p}_fraction"] for p in ("within_seq", "between_seq", "between_class")) == pytest.approx(1.0)
    assert min(out["within_seq"], out["between_seq"], out["between_class"]) > 0


def test_zero_within_sequence_variance_gives_zero_within_fraction():
    h, labels = _tokens()
    flat = h.mean(1, keepdim=True).expand_as(h)  # every token equals its sequence mean
    for out in (anova(flat, labels), _stream(flat, labels)):
        assert out["within_seq_fraction"] == pytest.approx(0.0, abs=1e-14)
        assert out["between_seq"] + out["between_class"] == pytest.approx(out["total"], rel=1e-12)


def test_identical_sequences_within_a_class_have_no_between_sequence_part():
    h, labels = _tokens()
    means = torch.stack([h[labels == c].mean(0) for c in range(4)])
    out = anova(means[labels], labels)
    assert out["between_seq_fraction"] == pytest.approx(0.0, abs=1e-14)


def test_without_labels_there_is_no_between_class_part():
    h, _ = _tokens()
    out = anova(h)
    assert out["between_class"] == pytest.approx(0.0, abs=1e-20)
    assert out["within_seq"] + out["between_seq"] == pytest.approx(out["total"])


def _stream(h, labels, seed=0):
    acc = AnovaAccumulator()
    for part in random_splits(len(h), seed):
        acc.update(h[part].float() if h.dtype == torch.float32 else h[part], labels[part])
    return acc.compute()


@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_equals_one_shot(offset, seed):
    """Random batch splits, also with a large common offset (the shifted sums keep the digits)."""
    h, labels = _tokens(offset=offset, seed=seed)
    one_shot, streamed = anova(h, labels), _stream(h, labels, seed)
    for key, value in one_shot.items():
        assert streamed[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_bad_shapes_are_one_line_errors():
    with pytest.raises(ValueError, match=r"h must be \(N_seq, T, D\)"):
        anova(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="labels must be"):
        anova(torch.zeros(4, 3, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=">= 0"):
        anova(torch.zeros(2, 3, 2), torch.tensor([0, -1]))


def test_ratio_and_scale_free_within_variance():
    h = torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(3)) + 2.0
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    parts = anova(h, labels)
    assert parts["within_to_between_class"] == pytest.approx(parts["within_seq"] / parts["between_class"])
    assert parts["within_seq_scale_free"] == pytest.approx(parts["within_seq"] / float(h.square().sum(-1).mean()))
    scaled = anova(3 * h, labels)  # a change of scale moves the raw variance, not the scale-free one or the ratio
    assert scaled["within_seq_scale_free"] == pytest.approx(parts["within_seq_scale_free"])
    assert scaled["within_to_between_class"] == pytest.approx(parts["within_to_between_class"])
    stream = AnovaAccumulator()
    stream.update(h[:3], labels[:3])
    stream.update(h[3:], labels[3:])
    assert stream.compute()["within_seq_scale_free"] == pytest.approx(parts["within_seq_scale_free"])
    assert anova(h)["within_to_between_class"] is None  # one class: no between-class part to compare with


def test_the_differentiable_fraction_is_the_reports_and_its_gradient_is_the_hand_derived_one():
    from lapheads.geometry.anova import within_sequence_fraction

    h = torch.randn(5, 7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    fraction = within_sequence_fraction(h)
    assert float(fraction) == pytest.approx(anova(h.detach())["within_seq_fraction"], rel=1e-12)
    fraction.backward()
    # f = W / T with W = sum ||h - mu_s||^2, T = sum ||h - mu_G||^2: the mean terms' derivatives sum to zero, so
    # df/dh = 2 [(h - mu_s) - f (h - mu_G)] / T
    x = h.detach()
    within, total = x - x.mean(1, keepdim=True), x - x.mean((0, 1), keepdim=True)
    by_hand = 2 * (within - float(fraction) * total) / total.square().sum()
    assert torch.allclose(h.grad, by_hand, atol=1e-12)


def test_the_language_model_layer_measures_the_within_sequence_fraction_of_windows_by_hand():
    """Issue 71: the LM analysis's within-sequence fraction, each window one class, on a case worked by hand. Two
    windows of two tokens in one dimension: [0, 2] and [4, 6]. Window means 1 and 5, global mean 3. Within: each
    token is 1 from its window's mean, so 1; total: (9 + 1 + 1 + 9) / 4 = 5; fraction 1/5."""
    from lapheads.geometry.layers import LMLayerGeometry

    layer = LMLayerGeometry(0.99)
    h = torch.tensor([[[0.0], [2.0]], [[4.0], [6.0]]])
    layer.update(h[:1], torch.tensor([[0, 1]]))  # two batches: the accumulator streams
    layer.update(h[1:], torch.tensor([[1, 0]]))
    parts = layer.compute()["anova"]
    assert parts["within_seq"] == pytest.approx(1.0) and parts["total"] == pytest.approx(5.0)
    assert parts["within_seq_fraction"] == pytest.approx(0.2) and parts["between_class"] == 0
    assert parts["within_seq_fraction"] == pytest.approx(float(within_sequence_fraction(h)))
