"""DINO's multi-crop augmentation (Caron et al. 2021), built from torchvision transforms.

Two global crops (random resized crop of ``global_scale`` of the image, flip, colour jitter 0.4/0.4/0.2/0.1 with
p = 0.8, grayscale p = 0.2, Gaussian blur p = 1.0 for the first and 0.1 for the second, solarisation p = 0.2 for
the second) and ``local_crops`` small crops (``local_scale``, blur p = 0.5), each normalised. Works on float tensors
(C, H, W) in [0, 1] (Fashion-MNIST, CIFAR) and PIL images (ImageFolder); colour operations are no-ops on one channel.
The blur's sigma range scales with the crop size (DINO's 0.1-2.0 is for 224 px).
"""

from __future__ import annotations

import torch
import torchvision.transforms as T
from PIL import Image

__all__ = ["MultiCropAugmentation", "collate_crops"]


def _blur(size: int, p: float) -> T.RandomApply:
    sigma_max = max(0.2, 2.0 * size / 224)
    kernel = 2 * int(3 * sigma_max) + 1
    return T.RandomApply([T.GaussianBlur(kernel, sigma=(0.1 * size / 224 + 1e-3, sigma_max))], p=p)


class _Clamp01:
    """Bicubic resizing overshoots [0, 1]; jitter and solarisation expect the range."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(0.0, 1.0)


class MultiCropAugmentation:
    """Args:
    global_size, local_size: output sizes of the global and local crops.
    local_crops: number of local crops.
    global_scale, local_scale: area ranges of RandomResizedCrop.
    mean, std: normalisation.
    """

    def __init__(
        self,
        global_size: int,
        local_size: int,
        local_crops: int,
        mean,
        std,
        global_scale: tuple[float, float] = (0.4, 1.0),
        local_scale: tuple[float, float] = (0.05, 0.4),
    ) -> None:
        flip_and_color = T.Compose(
            [
                T.RandomHorizontalFlip(p=0.5),
                T.RandomApply([T.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1)], p=0.8),
                T.RandomGrayscale(p=0.2),
            ]
        )
        normalize = T.Normalize(mean, std)
        bicubic = T.InterpolationMode.BICUBIC
        self.global_1 = T.Compose(
            [
                T.RandomResizedCrop(global_size, scale=tuple(global_scale), interpolation=bicubic, antialias=True),
                _Clamp01(),
                flip_and_color,
                _blur(global_size, 1.0),
                normalize,
            ]
        )
        self.global_2 = T.Compose(
            [
                T.RandomResizedCrop(global_size, scale=tuple(global_scale), interpolation=bicubic, antialias=True),
                _Clamp01(),
                flip_and_color,
                _blur(global_size, 0.1),
                T.RandomSolarize(0.5, p=0.2),
                normalize,
            ]
        )
        self.local = T.Compose(
            [
                T.RandomResizedCrop(local_size, scale=tuple(local_scale), interpolation=bicubic, antialias=True),
                _Clamp01(),
                flip_and_color,
                _blur(local_size, 0.5),
                normalize,
            ]
        )
        self.local_crops = local_crops

    def __call__(self, image) -> list[torch.Tensor]:
        if isinstance(image, Image.Image):
            image = T.functional.to_tensor(image.convert("RGB"))
        crops = [self.global_1(image), self.global_2(image)]
        crops += [self.local(image) for _ in range(self.local_crops)]
        return crops


def collate_crops(items: list[tuple[list[torch.Tensor], int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """[(crops, label), ...] -> ([crop_0 batch, crop_1 batch, ...], labels)."""
    crops = [torch.stack([item[0][i] for item in items]) for i in range(len(items[0][0]))]
    return crops, torch.tensor([item[1] for item in items])
