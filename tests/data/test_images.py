"""Image loaders on small files generated in the exact on-disk formats."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from PIL import Image

import lapheads.data.images as images
from lapheads.data.images import DataError, build_image_data, find_fashion_mnist, read_idx
from tests.conftest import pattern_images, write_idx


def test_fashion_mnist_idx_gz(fmnist_root):
    data = build_image_data("fashion-mnist", str(fmnist_root), 28, augment=False)
    assert (len(data.train), len(data.eval), data.num_classes, data.in_chans) == (512, 256, 10, 1)
    image, label = data.eval[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    raw = read_idx(fmnist_root / "t10k-images-idx3-ubyte.gz")
    labels = read_idx(fmnist_root / "t10k-labels-idx1-ubyte.gz")
    assert label == labels[0]
    # Normalised with Fashion-MNIST's mean/std: undoing it gives back the stored bytes.
    torch.testing.assert_close(
        image[0] * 0.3530 + 0.2860, torch.from_numpy(np.array(raw[0])).float() / 255, atol=1e-5, rtol=0
    )


def test_fashion_mnist_torchvision_layout_and_plain_idx(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for split in ("train", "t10k"):
        images, labels = pattern_images(20)
        write_idx(raw / f"{split}-images-idx3-ubyte", images)
        write_idx(raw / f"{split}-labels-idx1-ubyte", labels)
    assert find_fashion_mnist(tmp_path) == raw
    assert len(build_image_data("fashion-mnist", str(tmp_path), 32).train) == 20  # resized to 32 px


def test_corrupt_and_missing_idx_files(tmp_path, monkeypatch):
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="cannot read"):
        read_idx(bad)
    plain = tmp_path / "x-idx3-ubyte"
    plain.write_bytes(bytes([0, 0, 8, 3]) + (5).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2 + b"\0" * 100)
    with pytest.raises(DataError, match="truncated or corrupt"):
        read_idx(plain)
    monkeypatch.setattr(images, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian-copy")
    with pytest.raises(DataError, match=r"Fashion-MNIST not found in .*nowhere.*lapheads data fetch fashion-mnist"):
        build_image_data("fashion-mnist", str(tmp_path / "nowhere"), 28)


def test_a_data_root_without_the_data_is_an_error_even_where_a_system_copy_exists(fmnist_root, tmp_path, monkeypatch):
    monkeypatch.setattr(images, "DEBIAN_FASHION_MNIST", fmnist_root)  # a system copy exists
    assert len(build_image_data("fashion-mnist", None, 28).train) > 0  # no root: the system copy
    (tmp_path / "mine").mkdir()
    with pytest.raises(DataError, match=r"Fashion-MNIST not found in .*mine or .*mine/FashionMNIST/raw"):
        build_image_data("fashion-mnist", str(tmp_path / "mine"), 28)


def write_cifar(root, name: str = "cifar-10-batches-py", n: int = 10) -> None:
    """The official python-pickle layout: data_batch_1..5, test_batch, batches.meta."""
    folder = root / name
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for batch in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, n).tolist()}
        with open(folder / batch, "wb") as f:
            pickle.dump(entry, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)


def test_cifar10_pickle_batches(tmp_path):
    write_cifar(tmp_path)
    data = build_image_data("cifar10", str(tmp_path), 32, augment=False)
    assert (len(data.train), len(data.eval), data.num_classes) == (50, 10, 10)
    image, label = data.train[0]
    assert image.shape == (3, 32, 32) and 0 <= label < 10


@pytest.mark.parametrize("victim", ["data_batch_2", "test_batch", "batches.meta"])
def test_cifar_batch_with_code_is_refused_before_it_runs(tmp_path, victim):
    import os

    from lapheads.train.classify import train_classify
    from lapheads.train.configs.classify import ClassifyConfig

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    write_cifar(tmp_path)
    with open(tmp_path / "cifar-10-batches-py" / victim, "wb") as f:
        pickle.dump({"data": Payload(), "labels": [0], "label_names": Payload()}, f)
    with pytest.raises(DataError, match="refused to load posix.system"):
        build_image_data("cifar10", str(tmp_path), 32)
    cfg = ClassifyConfig(dataset="cifar10", data_root=str(tmp_path), img_size=32, device="cpu")
    with pytest.raises(DataError, match="cifar10 not found or corrupt"):
        train_classify(cfg, tmp_path / "run")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "run").exists()


def test_cifar100_fine_labels_and_bytes_keys(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("test", 4)):
        entry = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"fine_labels": list(range(n))}
        (folder / split).write_bytes(pickle.dumps(entry, protocol=2))
    (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"c{i}" for i in range(100)]}))
    data = build_image_data("cifar100", str(tmp_path), 32, augment=False)
    assert (len(data.train), len(data.eval), data.num_classes) == (6, 4, 100)
    assert data.eval[3][1] == 3 and data.train.classes[99] == "c99"


def test_cifar_missing_or_corrupt_is_one_line(tmp_path):
    with pytest.raises(DataError, match=r"cifar10 not found or corrupt in .*cifar-10-batches-py"):
        build_image_data("cifar10", str(tmp_path), 32)
    write_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(DataError, match="cifar10 not found or corrupt"):
        build_image_data("cifar10", str(tmp_path), 32)


def test_imagefolder_tree(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("cat", "dog", "fox"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(
                    tmp_path / split / cls / f"{i}.png"
                )
    data = build_image_data("imagefolder", str(tmp_path), 32, three_augment=True, color_jitter=0.3)
    assert data.num_classes == 3 and len(data.train) == 6
    assert data.train[0][0].shape == (3, 32, 32) and data.eval[0][0].shape == (3, 32, 32)


def test_unknown_dataset():
    with pytest.raises(DataError, match="unknown dataset 'mnist3d'; allowed: fashion-mnist, cifar10"):
        build_image_data("mnist3d", None, 28)


@pytest.mark.parametrize(
    "labels, data, message",
    [
        ([0] * 9 + [10], None, r"label 10 of image 9; allowed: integers 0 to 9 \(cifar10\)"),
        ([0] * 9 + [-1], None, r"label -1 of image 9"),
        ([0] * 9 + ["cat"], None, r"label 'cat' of image 9"),
        ([0] * 10, np.zeros((10, 3000), dtype=np.uint8), r"30000 pixel values, not a whole number of 3 x 32 x 32"),
    ],
)
def test_a_cifar_batch_with_bad_labels_or_pixels_is_one_line(tmp_path, labels, data, message):
    write_cifar(tmp_path)
    entry = {"data": np.zeros((10, 3072), dtype=np.uint8) if data is None else data, "labels": labels}
    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as f:
        pickle.dump(entry, f)
    with pytest.raises(DataError, match=message):
        build_image_data("cifar10", str(tmp_path), 32)
