"""Token similarity: hand cases and streaming (no T x T matrix) == the definition."""

from __future__ import annotations

import pytest
import torch

from lapheads.geometry import SimilarityAccumulator, token_similarity
from tests.geometry.conftest import random_splits


def test_identical_and_orthogonal_tokens():
    same = torch.ones(3, 5, 4) * torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert token_similarity(same) == pytest.approx(1.0)
    orthogonal = torch.eye(4).expand(2, 4, 4)
    assert token_similarity(orthogonal) == pytest.approx(0.0)
    opposite = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]])
    assert token_similarity(opposite) == pytest.approx(-1.0)


def test_streaming_equals_one_shot():
    h = torch.randn(50, 12, 16, generator=torch.Generator().manual_seed(0)) + 0.5
    acc = SimilarityAccumulator()
    for part in random_splits(len(h)):
        acc.update(h[part])
    assert acc.compute() == pytest.approx(token_similarity(h), rel=1e-12)


def test_needs_two_tokens():
    with pytest.raises(ValueError, match="T >= 2"):
        token_similarity(torch.randn(3, 1, 4))
