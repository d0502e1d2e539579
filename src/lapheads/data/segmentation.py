"""Segmentation data: composite Fashion-MNIST scenes (embedded) and ADE20K in its real on-disk layout.

* **Composite scenes**: a ``canvas`` x ``canvas`` black image with 2-4 Fashion-MNIST items pasted at random
  positions and scales; each pixel's label is the class (1-10) of the topmost item covering it where the item's
  intensity is above ``threshold``, else 0 (background). Scene i depends only on (seed, i) and the source images,
  so any subset is reproducible.
* **ADE20K** (``ADEChallengeData2016``): ``images/{training,validation}/ADE_*.jpg`` with
  ``annotations/{training,validation}/ADE_*.png`` (uint8; 0 = "other", 1-150 = classes). As in mmsegmentation's
  ``reduce_zero_label``, 0 becomes the ignore index 255 and 1-150 become 0-149. Images are resized (shorter side)
  and centre-cropped to ``size``; masks with nearest-neighbour interpolation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from lapheads.data.images import DataError

__all__ = ["ADE20K", "IGNORE_INDEX", "CompositeScenes"]

IGNORE_INDEX = 255


class CompositeScenes(Dataset):
    """Scenes of Fashion-MNIST items with per-pixel labels (0 = background, 1 + class for items).

    Args:
        images: uint8 (N, 28, 28) source items; labels: (N,) their classes.
        num_scenes: scenes in this set.
        canvas: scene size in pixels (56 or 64).
        seed: scene i is drawn from a generator seeded with (seed, i).
        mean, std: normalisation of the returned image.
        threshold: item pixels above this (0-255) are foreground.
    """

    num_classes = 11  # background + 10 Fashion-MNIST classes

    def __init__(
        self,
        images: np.ndarray | torch.Tensor,
        labels: np.ndarray | torch.Tensor,
        num_scenes: int,
        canvas: int = 56,
        seed: int = 0,
        mean: float = 0.2860,
        std: float = 0.3530,
        threshold: int = 40,
    ) -> None:
        if canvas < 28:
            raise DataError(f"canvas={canvas} is smaller than a 28 px item; allowed: >= 28 (56 or 64 recommended)")
        self.images = torch.as_tensor(np.asarray(images), dtype=torch.uint8)
        self.labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
        self.num_scenes, self.canvas, self.seed = num_scenes, canvas, seed
        self.mean, self.std, self.threshold = mean, std, threshold

    def __len__(self) -> int:
        return self.num_scenes

    def scene(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 image (canvas, canvas), long mask (canvas, canvas)) of scene ``index``."""
        rng = np.random.default_rng([self.seed, index])
        image = torch.zeros(self.canvas, self.canvas, dtype=torch.uint8)
        mask = torch.zeros(self.canvas, self.canvas, dtype=torch.long)
        for _ in range(int(rng.integers(2, 5))):
            item = int(rng.integers(len(self.images)))
            size = int(rng.integers(20, 29))  # items at 20-28 px
            patch = (
                F.interpolate(
                    self.images[item][None, None].float(), size=(size, size), mode="bilinear", align_corners=False
                )[0, 0]
                .round()
                .clamp(0, 255)
                .to(torch.uint8)
            )
            top, left = (int(v) for v in rng.integers(0, self.canvas - size + 1, size=2))
            region = patch > self.threshold
            image[top : top + size, left : left + size][region] = patch[region]
            mask[top : top + size, left : left + size][region] = 1 + int(self.labels[item])
        return image, mask

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = self.scene(index)
        return (image[None].float() / 255 - self.mean) / self.std, mask


class ADE20K(Dataset):
    """ADE20K scene parsing (150 classes) from ``root/ADEChallengeData2016`` (or ``root`` itself).

    Args:
        root: the folder holding ``ADEChallengeData2016`` or its contents.
        split: "training" or "validation".
        size: square output size (resize shorter side, centre crop).
        mean, std: image normalisation (ImageNet's by default).
    """

    num_classes = 150

    def __init__(
        self,
        root: str | Path,
        split: str = "validation",
        size: int = 224,
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
    ) -> None:
        if split not in ("training", "validation"):
            raise DataError(f"ADE20K split {split!r}; allowed: training, validation")
        base = Path(root) / "ADEChallengeData2016"
        base = base if base.is_dir() else Path(root)
        images = sorted((base / "images" / split).glob("*.jpg"))
        if not images:
            raise DataError(
                f"no ADE20K images in {base / 'images' / split}; expected ADEChallengeData2016/images/"
                f"{split}/ADE_*.jpg and annotations/{split}/ADE_*.png"
            )
        self.pairs = []
        for image in images:
            mask = base / "annotations" / split / (image.stem + ".png")
            if not mask.is_file():
                raise DataError(f"ADE20K annotation {mask} is missing for {image.name}")
            self.pairs.append((image, mask))
        self.size = size
        self.mean, self.std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.pairs)

    def _resize_crop(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        h, w = x.shape[-2:]
        scale = self.size / min(h, w)
        new = (max(self.size, round(h * scale)), max(self.size, round(w * scale)))
        x = F.interpolate(
            x[None].float(), size=new, mode=mode, **({"align_corners": False} if mode == "bilinear" else {})
        )[0]
        top, left = (new[0] - self.size) // 2, (new[1] - self.size) // 2
        return x[:, top : top + self.size, left : left + self.size]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        image_path, mask_path = self.pairs[index]
        try:
            image = torch.from_numpy(np.array(Image.open(image_path).convert("RGB"))).permute(2, 0, 1)
            mask = torch.from_numpy(np.array(Image.open(mask_path), dtype=np.int64))
        except OSError as err:
            raise DataError(f"cannot read ADE20K pair {image_path.name}: {err}") from None
        if mask.ndim != 2 or mask.shape != image.shape[1:]:
            raise DataError(f"{mask_path.name}: mask {tuple(mask.shape)} does not match image {tuple(image.shape[1:])}")
        image = (self._resize_crop(image, "bilinear") / 255 - self.mean) / self.std
        mask = self._resize_crop(mask[None], "nearest")[0].long()
        mask = torch.where(mask == 0, IGNORE_INDEX, mask - 1)  # reduce_zero_label
        return image, mask
