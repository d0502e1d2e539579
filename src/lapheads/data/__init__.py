"""Datasets: images (Fashion-MNIST, CIFAR, ImageFolder/ImageNet), text corpora and token shards (``text``),
tokenizers, DINO's multi-crop, and segmentation scenes and ADE20K (``segmentation``)."""

from lapheads.data.images import DataError, ImageData, build_image_data, fetch_fashion_mnist, find_fashion_mnist

__all__ = ["DataError", "ImageData", "build_image_data", "fetch_fashion_mnist", "find_fashion_mnist"]
