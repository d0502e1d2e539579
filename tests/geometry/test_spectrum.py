"""Spectral decay: isotropic tokens need ~0.99 D components, low-rank tokens few; streaming == one shot."""

from __future__ import annotations

import pytest
import torch

from lapheads.geometry import SpectrumAccumulator, components_for, spectral_decay
from tests.geometry.conftest import random_splits


@pytest.mark.parametrize(
    "eigenvalues, fraction, expected",
    [
        ([1.0, 0.0, 0.0], 0.99, 1),
        ([1.0, 1.0], 0.5, 1),
        ([1.0, 1.0], 0.99, 2),
        ([0.0, 0.0], 0.99, 0),
        ([1.0, 3.0, 6.0], 0.9, 2),
        ([1.0] * 100, 0.99, 99),
    ],
)
def test_components_for_hand_cases(eigenvalues, fraction, expected):
    assert int(components_for(torch.tensor(eigenvalues, dtype=torch.float64), fraction)) == expected


def test_isotropic_gaussian_has_a_flat_spectrum():
    d = 100
    h = torch.randn(500, 100, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = spectral_decay(h)
    assert abs(out["n_components"] - 0.99 * d) <= 1.5
    eigenvalues = torch.tensor(out["eigenvalues"])
    assert eigenvalues.max() / eigenvalues.min() < 1.25 and eigenvalues.sum() == pytest.approx(1.0)
    # long sequences in few dimensions: each sequence's own spectrum is flat too
    per_seq = spectral_decay(torch.randn(100, 400, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    assert per_seq["n_components"] == 20 and 19 <= per_seq["n_components_per_seq"] <= 20


def test_low_rank_tokens_need_few_components():
    gen = torch.Generator().manual_seed(0)
    basis = torch.randn(3, 64, dtype=torch.float64, generator=gen)
    h = torch.randn(50, 20, 3, dtype=torch.float64, generator=gen) @ basis + 5.0
    out = spectral_decay(h)
    assert out["n_components"] <= 3 and out["n_components_per_seq"] <= 3
    assert sum(out["eigenvalues"][3:]) < 1e-12


def test_streaming_equals_one_shot():
    gen = torch.Generator().manual_seed(1)
    scales = torch.logspace(0, -3, 32, dtype=torch.float64)
    h = torch.randn(60, 9, 32, dtype=torch.float64, generator=gen) * scales + 100.0
    acc = SpectrumAccumulator(0.95)
    for part in random_splits(len(h), 1):
        acc.update(h[part])
    streamed, one_shot = acc.compute(), spectral_decay(h, 0.95)
    assert streamed["n_components"] == one_shot["n_components"]
    assert streamed["n_components_per_seq"] == pytest.approx(one_shot["n_components_per_seq"])
    assert torch.allclose(torch.tensor(streamed["eigenvalues"]), torch.tensor(one_shot["eigenvalues"]), atol=1e-12)


def test_fraction_is_checked():
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]; got 1.5"):
        spectral_decay(torch.randn(2, 3, 4), 1.5)
