"""Linguistic collapse: CDNV against the closed form, top-K next-token classes, streaming == one shot."""

from __future__ import annotations

import pytest
import torch

from lapheads.geometry import CDNVAccumulator, cdnv, top_k_classes
from tests.geometry.conftest import random_splits


def test_cdnv_of_two_gaussians_matches_the_closed_form():
    # N(mu_0, s^2 I_D), N(mu_1, s^2 I_D): sigma_c^2 = D s^2, CDNV = (2 D s^2) / (2 ||mu_0 - mu_1||^2)
    d, s, n = 4, 0.8, 100_000
    gen = torch.Generator().manual_seed(0)
    mu = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    labels = torch.arange(2).repeat_interleave(n)
    features = mu[labels] + s * torch.randn(2 * n, d, dtype=torch.float64, generator=gen)
    out = cdnv(features, labels)
    expected = d * s**2 / 9.0
    assert out["cdnv"] == pytest.approx(expected, rel=0.02)
    assert out["matrix"].shape == (2, 2) and out["matrix"][0, 0] == 0
    assert out["matrix"][0, 1] == out["matrix"][1, 0] == pytest.approx(out["cdnv"])


def test_streaming_equals_one_shot_and_ignores_negative_labels():
    gen = torch.Generator().manual_seed(2)
    labels = torch.randint(-1, 6, (400,), generator=gen)
    features = torch.randn(400, 8, dtype=torch.float64, generator=gen) + labels[:, None].clamp_min(0)
    acc = CDNVAccumulator()
    for part in random_splits(400, 2):
        acc.update(features[part], labels[part])
    streamed, one_shot = acc.compute(), cdnv(features, labels)
    assert streamed["num_classes"] == one_shot["num_classes"] == 6
    assert torch.allclose(streamed["matrix"], one_shot["matrix"], rtol=1e-9)
    kept = labels >= 0
    assert torch.allclose(cdnv(features[kept], labels[kept])["matrix"], one_shot["matrix"], rtol=1e-9)


def test_top_k_classes_rank_next_tokens_by_frequency():
    counts = torch.tensor([5, 50, 0, 20, 1])
    assert top_k_classes(torch.tensor([1, 3, 0, 4, 2, 1]), counts, k=3).tolist() == [0, 1, 2, -1, -1, 0]
    with pytest.raises(ValueError, match="top_k must be >= 2"):
        top_k_classes(torch.tensor([0]), counts, k=1)
