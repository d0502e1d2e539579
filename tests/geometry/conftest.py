"""Helpers for the geometry tests: data with known answers, and random batch splits for streaming checks."""

from __future__ import annotations

import torch


def random_splits(n: int, seed: int = 0) -> list[slice]:
    """Cut range(n) into consecutive batches of random sizes (1 .. n/3)."""
    gen = torch.Generator().manual_seed(seed)
    cuts, start = [], 0
    while start < n:
        size = int(torch.randint(1, max(2, n // 3), (1,), generator=gen))
        cuts.append(slice(start, min(n, start + size)))
        start += size
    return cuts


def simplex_etf(num_classes: int, dim: int, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    """(C, D) rows forming a simplex equiangular tight frame in a random orientation, centred at the origin."""
    assert dim >= num_classes
    eye = torch.eye(num_classes, dtype=torch.float64)
    frame = eye - 1 / num_classes
    rotation, _ = torch.linalg.qr(
        torch.randn(dim, num_classes, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    )
    return scale * frame @ rotation.T
