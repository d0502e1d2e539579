"""Datasets: images (Fashion-MNIST, CIFAR, ImageFolder/ImageNet); text and segmentation arrive later."""

from lapheads.data.images import DataError, ImageData, build_image_data, fetch_fashion_mnist, find_fashion_mnist

__all__ = ["DataError", "ImageData", "build_image_data", "fetch_fashion_mnist", "find_fashion_mnist"]
