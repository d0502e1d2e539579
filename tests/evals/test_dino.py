"""DINO pictures as measurements: the PCA foreground rule and its IoU against true masks."""

from __future__ import annotations

import pytest
import torch

from lapheads.evals.dino import foreground_iou, pca_foreground, pca_pictures


def _scenes(b: int = 4, d: int = 16, h: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch grids whose foreground patches (a random box per image) sit far from the background ones."""
    g = torch.Generator().manual_seed(seed)
    grid = 0.05 * torch.randn(b, d, h, h, generator=g)
    truth = torch.zeros(b, h, h, dtype=torch.bool)
    for i in range(b):
        top, left = torch.randint(1, 4, (2,), generator=g).tolist()
        truth[i, top : top + 3, left : left + 4] = True
    grid += truth.unsqueeze(1) * torch.linspace(1, 2, d).view(1, d, 1, 1)
    return grid, truth


def test_pca_foreground_recovers_objects_whatever_the_sign_of_the_component():
    grid, truth = _scenes()
    assert torch.equal(pca_foreground(grid), truth)
    assert torch.equal(pca_foreground(-grid), truth)  # the border decides the sign, not the SVD
    rgb = pca_pictures(grid)
    assert rgb.shape == (4, 8, 8, 3) and rgb[~truth].abs().sum() == 0 and rgb[truth].max() == pytest.approx(1.0)


def test_foreground_iou_pools_pixel_masks_to_patches():
    _, truth = _scenes()
    masks = truth.repeat_interleave(4, 1).repeat_interleave(4, 2).long() * 3  # 4 px patches, class 3 = an item
    assert foreground_iou(truth, masks) == 100.0
    assert foreground_iou(~truth, masks) == 0.0
    half = truth.clone()
    half[:, :, :] = False
    half[truth.nonzero()[::2].unbind(1)] = True  # every other true patch
    expected = 100.0 * half.sum().item() / truth.sum().item()
    assert foreground_iou(half, masks) == pytest.approx(expected)
