"""Segmentation data: deterministic composite scenes and ADE20K in its real layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from lapheads.data.images import DataError
from lapheads.data.segmentation import ADE20K, IGNORE_INDEX, CompositeScenes
from tests.conftest import pattern_images


def test_composite_scenes_are_deterministic_and_labelled_per_pixel():
    images, labels = pattern_images(50)
    scenes = CompositeScenes(images, labels, num_scenes=20, canvas=56, seed=3)
    again = CompositeScenes(images, labels, num_scenes=20, canvas=56, seed=3)
    for i in (0, 7, 19):
        (a_img, a_mask), (b_img, b_mask) = scenes.scene(i), again.scene(i)
        assert torch.equal(a_img, b_img) and torch.equal(a_mask, b_mask)
    image, mask = scenes.scene(5)
    assert image.shape == mask.shape == (56, 56)
    assert set(mask.unique().tolist()) <= set(range(11)) and (mask == 0).any() and (mask > 0).any()
    assert torch.all(image[mask == 0] == 0)  # background is black; foreground pixels carry item classes
    assert torch.all(image[mask > 0] > 40)
    other = CompositeScenes(images, labels, num_scenes=20, canvas=56, seed=4)
    assert not torch.equal(other.scene(5)[1], mask)
    x, y = scenes[5]
    assert x.shape == (1, 56, 56) and x.dtype == torch.float32 and torch.equal(y, mask)
    with pytest.raises(DataError, match="canvas=20 is smaller than a 28 px item"):
        CompositeScenes(images, labels, 1, canvas=20)


def _ade_tree(root, n=3):
    base = root / "ADEChallengeData2016"
    for split in ("training", "validation"):
        (base / "images" / split).mkdir(parents=True)
        (base / "annotations" / split).mkdir(parents=True)
        for i in range(n):
            name = f"ADE_{split[:5]}_{i:08d}"
            rng = np.random.default_rng(i)
            Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(
                base / "images" / split / f"{name}.jpg"
            )
            mask = np.zeros((40, 60), dtype=np.uint8)
            mask[:, 30:] = 151 - 1  # class 150 on the right half, "other" (0) on the left
            mask[:20, 20:30] = 1  # inside the centre crop
            Image.fromarray(mask).save(base / "annotations" / split / f"{name}.png")
    return base


def test_ade20k_reads_the_real_layout_and_reduces_the_zero_label(tmp_path):
    _ade_tree(tmp_path)
    data = ADE20K(tmp_path, "validation", size=32)
    assert len(data) == 3
    image, mask = data[0]
    assert image.shape == (3, 32, 32) and mask.shape == (32, 32) and mask.dtype == torch.long
    assert set(mask.unique().tolist()) == {0, 149, IGNORE_INDEX}  # 1 -> 0, 150 -> 149, 0 -> ignore


def test_ade20k_bad_input(tmp_path):
    with pytest.raises(DataError, match="no ADE20K images in"):
        ADE20K(tmp_path, "validation")
    base = _ade_tree(tmp_path)
    next((base / "annotations" / "training").glob("*.png")).unlink()
    with pytest.raises(DataError, match="ADE20K annotation .* is missing"):
        ADE20K(tmp_path, "training")
    with pytest.raises(DataError, match="split 'test'; allowed: training, validation"):
        ADE20K(tmp_path, "test")
