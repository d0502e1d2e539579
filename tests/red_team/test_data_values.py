"""Red team, data values (issue 44): files in their true formats whose values are wrong are refused where they are
read, in one line naming the value and what is allowed, never as an IndexError mid-training or a silent cast."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from lapheads.data.images import DataError, build_image_data
from lapheads.data.text import TokenShards
from tests.conftest import pattern_images, write_idx
from tests.data.test_images import write_cifar


def _fashion_mnist(root, images=None, labels=None, header=None):
    """The four idx files, with the training images or labels replaced (or a hand-written image header)."""
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 64), ("t10k", 32)):
        base_images, base_labels = pattern_images(n, seed=1)
        if split == "train":
            base_images = base_images if images is None else images
            base_labels = base_labels if labels is None else labels
        write_idx(root / f"{split}-images-idx3-ubyte.gz", base_images)
        write_idx(root / f"{split}-labels-idx1-ubyte.gz", base_labels)
    if header is not None:
        (root / "train-images-idx3-ubyte.gz").unlink()
        (root / "train-images-idx3-ubyte").write_bytes(header)


def _cifar_with(root, data):
    write_cifar(root)
    batch = root / "cifar-10-batches-py" / "data_batch_1"
    entry = pickle.loads(batch.read_bytes())
    entry["data"] = data
    batch.write_bytes(pickle.dumps(entry))


def _shards(root, ids, vocab=100):
    folder = root / "tokens"
    folder.mkdir()
    array = np.asarray(ids, dtype=np.uint16)
    array.tofile(folder / "train.bin")
    array[:4].tofile(folder / "val.bin")
    meta = {"vocab_size": vocab, "dtype": "uint16", "train_tokens": len(array), "val_tokens": 4}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


_images, _labels = pattern_images(64, seed=1)
DIMS_WRAP = bytes([0, 0, 8, 3]) + (2**32 - 1).to_bytes(4, "big") * 2 + (2**16).to_bytes(4, "big") + b"\0" * 16

CASES = {
    "Fashion-MNIST: a label of 200": (
        lambda tmp: _fashion_mnist(tmp, labels=np.where(np.arange(64) == 5, 200, _labels).astype(np.uint8)),
        lambda tmp: build_image_data("fashion-mnist", str(tmp), 28),
        "label 200 of train image 5; allowed: 0 to 9",
    ),
    "Fashion-MNIST: 32 x 32 images": (
        lambda tmp: _fashion_mnist(tmp, images=pattern_images(64, size=32, seed=1)[0]),
        lambda tmp: build_image_data("fashion-mnist", str(tmp), 28),
        "train images are 32 x 32; allowed: 28 x 28",
    ),
    "Fashion-MNIST: more labels than images": (
        lambda tmp: _fashion_mnist(tmp, labels=np.zeros(65, dtype=np.uint8)),
        lambda tmp: build_image_data("fashion-mnist", str(tmp), 28),
        "64 train images but 65 labels",
    ),
    "Fashion-MNIST: idx dimensions whose product wraps": (
        lambda tmp: _fashion_mnist(tmp, header=DIMS_WRAP),
        lambda tmp: build_image_data("fashion-mnist", str(tmp), 28),
        "is truncated or corrupt: header says [4294967295, 4294967295, 65536]",
    ),
    "CIFAR: float64 pixels": (
        lambda tmp: _cifar_with(tmp, np.random.default_rng(0).random((10, 3072))),
        lambda tmp: build_image_data("cifar10", str(tmp), 32),
        "pixels of dtype float64; allowed: uint8",
    ),
    "CIFAR: int64 pixels past 255": (
        lambda tmp: _cifar_with(tmp, np.full((10, 3072), 300, dtype=np.int64)),
        lambda tmp: build_image_data("cifar10", str(tmp), 32),
        "pixels of dtype int64; allowed: uint8",
    ),
    "token shards: an id past the vocabulary": (
        lambda tmp: _shards(tmp, [1, 2, 3, 4, 5, 150, 6, 7]),
        lambda tmp: TokenShards.open(tmp / "tokens"),
        "token id 150 at position 5; allowed: ids below the tokenizer's vocabulary of 100",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_value_is_refused_where_it_is_read(name, tmp_path):
    write, read, says = CASES[name]
    write(tmp_path)
    with pytest.raises(DataError) as refused:
        read(tmp_path)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_values_in_range_still_load(tmp_path):
    _fashion_mnist(tmp_path / "fm")
    assert len(build_image_data("fashion-mnist", str(tmp_path / "fm"), 28).train) == 64
    assert TokenShards.open(_shards(tmp_path, [0, 1, 99, 98, 2, 3])).train.tolist() == [0, 1, 99, 98, 2, 3]
