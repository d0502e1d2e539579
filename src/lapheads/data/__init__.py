"""Datasets: images (Fashion-MNIST, CIFAR, ImageFolder/ImageNet), text corpora and token shards (``text``),
tokenizers, DINO's multi-crop, and segmentation scenes and ADE20K (``segmentation``).

Names are imported on first use, so a config (and ``--help``) reads the image catalog (``catalog``) without torch."""

from typing import TYPE_CHECKING

from lapheads.submodules import public_getattr

if TYPE_CHECKING:  # for readers and type checkers; at run time __getattr__ imports them on use
    from lapheads.data.images import DataError, ImageData, build_image_data, fetch_fashion_mnist, find_fashion_mnist

__all__ = ["DataError", "ImageData", "build_image_data", "fetch_fashion_mnist", "find_fashion_mnist"]

__getattr__ = public_getattr(__name__, dict.fromkeys(__all__, "images"))
