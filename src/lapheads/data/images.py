"""Image datasets for classification: Fashion-MNIST, CIFAR-10/100, ImageFolder (ImageNet).

* Fashion-MNIST is read from its idx files (``.gz`` or plain), found in a user-given root, in the Debian package's
  folder ``/usr/share/datasets/fashion-mnist``, or in torchvision's layout ``ROOT/FashionMNIST/raw``; torchvision
  downloads it when asked and online. It is small, so it is held as one uint8 tensor.
* CIFAR-10/100 are read from the python-pickle batches of the official tarball (torchvision's layout and
  download) through a restricted unpickler: data only, never code. ImageNet and any other folder-per-class tree
  are torchvision ``ImageFolder`` with ``train/`` and ``val/`` sub-folders.
* Transforms come from timm (``create_transform``: random-resized crop, 3-Augment, colour jitter, normalisation)
  for the big datasets, and a light pad-and-crop + flip for the 28-32 px CPU recipes.

Every failure to find or read data raises ``DataError`` with one line naming the path and how to get the data.
"""

from __future__ import annotations

import gzip
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lapheads.data.catalog import DATASETS
from lapheads.errors import InputError, LapheadsError

__all__ = [
    "DataError",
    "ImageData",
    "IdxDataset",
    "build_image_data",
    "fetch_fashion_mnist",
    "find_fashion_mnist",
    "read_idx",
]

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


class DataError(LapheadsError, RuntimeError):
    """Missing or unreadable data; the message names the path and what to do."""


# ----------------------------------------------------------------------------------------------------------------
# Fashion-MNIST (idx format)

_IDX_DTYPES = {0x08: np.uint8}


def read_idx(path: Path) -> np.ndarray:
    """Read an idx file (``.gz`` or plain): magic 0x0000 <dtype> <ndim>, big-endian dims, then the data.

    The header is read first and the data read to exactly its size: a file (a gzip bomb, say) holding more than its
    header says is refused after one byte more, never decompressed whole, and a header naming more data than the
    machine holds is refused before any is read."""
    from lapheads.hardware import check_fits

    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES:
                raise DataError(f"{path} is not an idx file (bad magic {head.hex()}); expected an MNIST-style idx file")
            shape = f.read(4 * head[3])
            dims = [int.from_bytes(shape[4 * i : 4 + 4 * i], "big") for i in range(len(shape) // 4)]
            expected = math.prod(dims) if dims else 0  # Python ints: dims whose product overflows int64 stay wrong
            try:
                check_fits(f"the idx file {path} (header: {dims})", expected)
            except InputError:
                raise DataError(
                    f"{path} is truncated or corrupt: header says {dims} ({expected:,} values), more than this "
                    "machine's memory holds; expected an MNIST-style idx file"
                ) from None
            raw = f.read(expected + 1)  # one byte past the header's size tells a longer file
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise DataError(f"cannot read {path}: {err}") from None
    if len(dims) != head[3] or len(raw) != expected:
        held = f"more than {expected}" if len(raw) > expected else str(len(raw))
        raise DataError(f"{path} is truncated or corrupt: header says {dims} ({expected} values), file holds {held}")
    return np.frombuffer(raw, dtype=_IDX_DTYPES[head[2]]).reshape(dims)


def _idx_file(folder: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def find_fashion_mnist(root: str | os.PathLike | None = None, system: bool = True) -> Path | None:
    """The first folder holding all four Fashion-MNIST idx files: ``root``, ``root/FashionMNIST/raw``, and (with
    ``system``) Debian's."""
    candidates = []
    if root is not None:
        candidates += [Path(root), Path(root) / "FashionMNIST" / "raw"]
    if system:
        candidates.append(DEBIAN_FASHION_MNIST)
    for folder in candidates:
        if all(_idx_file(folder, stem) for pair in FASHION_MNIST_FILES.values() for stem in pair):
            return folder
    return None


def fetch_fashion_mnist(root: str | os.PathLike) -> tuple[Path, str]:
    """Get Fashion-MNIST by what this OS allows; returns (folder, what was done).

    Order: already present; ``apt-get install dataset-fashion-mnist`` when root on Debian/Ubuntu; torchvision's
    download into ``root``.
    """
    found = find_fashion_mnist(root)
    if found is not None:
        return found, f"already present in {found}"
    notes = []
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        done = subprocess.run(
            ["apt-get", "install", "-y", "-q", "dataset-fashion-mnist"],
            capture_output=True,
            text=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        if done.returncode != 0:  # the package lists may be stale on a fresh machine
            subprocess.run(["apt-get", "update", "-q"], capture_output=True)
            done = subprocess.run(
                ["apt-get", "install", "-y", "-q", "dataset-fashion-mnist"],
                capture_output=True,
                text=True,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
        found = find_fashion_mnist(root)
        if found is not None:
            return found, "installed the Debian package dataset-fashion-mnist with apt-get"
        notes.append(f"apt-get install dataset-fashion-mnist failed ({done.stderr.strip().splitlines()[-1:] or '?'})")
    try:
        import torchvision  # here, not at the top: presets and --help read this module's names (~1 s of import)

        torchvision.datasets.FashionMNIST(str(root), download=True)
        found = find_fashion_mnist(root)
        if found is not None:
            return found, f"downloaded with torchvision into {found}"
    except Exception as err:  # noqa: BLE001 - any network failure means "could not download"
        notes.append(f"torchvision download failed ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
    raise DataError(
        f"Fashion-MNIST not found in {root} or {DEBIAN_FASHION_MNIST} and could not be fetched: {'; '.join(notes)}. "
        "Get it with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu) or copy the four *-ubyte.gz "
        f"files into {root}"
    )


class IdxDataset(Dataset):
    """An in-memory uint8 image tensor (N, H, W) with labels; items are (transformed image, label)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform=None) -> None:
        if len(images) != len(labels):
            raise DataError(f"{len(images)} images but {len(labels)} labels")
        self.images = torch.from_numpy(np.array(images))  # a writable copy of the read-only file buffer
        self.targets = torch.from_numpy(labels.astype(np.int64))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        image = self.images[i].unsqueeze(0).float().div_(255)  # (1, H, W) in [0, 1]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[i])


def load_fashion_mnist(root: str | os.PathLike | None, split: str, transform=None) -> IdxDataset:
    # a --data-root given is where the data must be: never another copy found elsewhere without a word
    folder = find_fashion_mnist(root, system=root is None)
    if folder is None:
        where = f"{root} or {root}/FashionMNIST/raw" if root is not None else str(DEBIAN_FASHION_MNIST)
        raise DataError(
            f"Fashion-MNIST not found in {where} (the four idx files); run `lapheads data fetch fashion-mnist"
            f"{f' --root {root}' if root is not None else ''}`, `sudo apt-get install dataset-fashion-mnist`, or "
            "leave --data-root out to use the system copy"
        )
    image_stem, label_stem = FASHION_MNIST_FILES[split]
    images, labels = read_idx(_idx_file(folder, image_stem)), read_idx(_idx_file(folder, label_stem))
    if images.ndim != 3 or labels.ndim != 1:
        raise DataError(f"{folder}: expected images (N, H, W) and labels (N,), got {images.shape} and {labels.shape}")
    if images.shape[1:] != (28, 28):
        raise DataError(f"{folder}: {split} images are {images.shape[1]} x {images.shape[2]}; allowed: 28 x 28 "
                        "(Fashion-MNIST)")  # fmt: skip
    if len(images) != len(labels):
        raise DataError(f"{folder}: {len(images)} {split} images but {len(labels)} labels")
    if labels.size and int(labels.max()) > 9:
        bad = int(np.argmax(labels > 9))
        raise DataError(f"{folder}: label {int(labels[bad])} of {split} image {bad}; allowed: 0 to 9 (Fashion-MNIST)")
    return IdxDataset(images, labels, transform)


# ----------------------------------------------------------------------------------------------------------------
# Transforms and the dataset factory


def small_image_transforms(size: int, native: int, mean, std, train: bool, hflip: bool):
    """Tensor-in transforms for 28-32 px images: resize if needed, pad-and-crop + flip for training, normalise."""
    from torchvision import transforms as T  # noqa: N812 - torchvision's own alias

    steps: list = []
    if size != native:
        steps.append(T.Resize(size, antialias=True))
    if train:
        steps.append(T.RandomCrop(size, padding=size // 8, padding_mode="reflect"))
        if hflip:
            steps.append(T.RandomHorizontalFlip())
    steps.append(T.Normalize(mean, std))
    return T.Compose(steps)


class CIFAR(Dataset):
    """CIFAR-10 or CIFAR-100 from the official python-pickle batches, read without running code from them.

    The layout and download address are torchvision's (``torchvision.datasets.CIFAR10/100`` class attributes, and
    its ``download_and_extract_archive``); the batches are unpickled by :func:`lapheads.io.restricted_unpickle`,
    which admits only numpy arrays, lists, dicts, bytes and strings, so a batch carrying a ``__reduce__`` payload is
    refused before any of it runs. File presence is checked, not md5 sums, so re-packed and generated files in the
    same format work. Items are (transform(float image (3, 32, 32) in [0, 1]), label).
    """

    def __init__(self, root: str | os.PathLike, name: str, train: bool, transform=None, download: bool = False) -> None:
        import torchvision

        spec = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
        folder = Path(root) / spec.base_folder
        files = [file for file, _ in (spec.train_list if train else spec.test_list)]
        if download and not all((folder / file).is_file() for file in files):
            from torchvision.datasets.utils import download_and_extract_archive

            download_and_extract_archive(spec.url, str(root), filename=spec.filename, md5=spec.tgz_md5)
        arrays, labels = [], []
        for file in files:
            entry = _read_batch(folder / file)
            data = np.asarray(_field(entry, "data", folder / file))
            if data.dtype != np.uint8:  # the format's pixels are bytes: a cast would zero or wrap other values
                raise DataError(f"{folder / file}: pixels of dtype {data.dtype}; allowed: uint8 (CIFAR's batches)")
            arrays.append(data)
            labels += list(_field(entry, "labels" if name == "cifar10" else "fine_labels", folder / file))
        pixels = np.concatenate(arrays)
        if pixels.size % (3 * 32 * 32):
            raise DataError(f"{folder}: {pixels.size} pixel values, not a whole number of 3 x 32 x 32 images")
        self.data = pixels.reshape(-1, 3, 32, 32)
        if len(self.data) != len(labels):
            raise DataError(f"{folder}: {len(self.data)} images but {len(labels)} labels")
        num_classes = 10 if name == "cifar10" else 100
        bad = next(
            (
                i
                for i, c in enumerate(labels)
                if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c < num_classes
            ),
            None,
        )
        if bad is not None:
            raise DataError(
                f"{folder}: label {labels[bad]!r} of image {bad}; allowed: integers 0 to {num_classes - 1} ({name})"
            )
        self.targets = [int(label) for label in labels]
        meta = _read_batch(folder / spec.meta["filename"])
        self.classes = [str(c) for c in _field(meta, spec.meta["key"], folder / spec.meta["filename"])]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        image = torch.from_numpy(self.data[i]).float().div_(255)
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[i]


def _read_batch(path: Path) -> dict:
    from lapheads.io import restricted_unpickle

    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    with open(path, "rb") as f:
        entry = restricted_unpickle(f)
    if not isinstance(entry, dict):
        raise ValueError(f"{path} holds a {type(entry).__name__}, not a dict")
    return entry


def _field(entry: dict, key: str, path: Path):
    """A batch's field by str or bytes key (python-2 pickles decode either way)."""
    for candidate in (key, key.encode()):
        if candidate in entry:
            return entry[candidate]
    raise KeyError(f"{path} has no {key!r} entry")


@dataclass
class ImageData:
    """Train and eval datasets with what the model needs to know about them."""

    train: Dataset
    eval: Dataset
    num_classes: int
    in_chans: int
    img_size: int


def build_image_data(
    dataset: str,
    root: str | None,
    img_size: int,
    *,
    download: bool = False,
    three_augment: bool = False,
    color_jitter: float = 0.0,
    auto_augment: str | None = None,
    hflip: bool = True,
    augment: bool = True,
    train_transform=None,
) -> ImageData:
    """Build train/eval datasets for a classification recipe.

    Args:
        dataset: fashion-mnist, cifar10, cifar100, imagefolder (ImageNet layout: root/train/<class>/*, root/val/...).
        root: data folder (None: the default search locations for Fashion-MNIST).
        img_size: the model's input size; images are resized/cropped to it.
        download: let torchvision download CIFAR / Fashion-MNIST when missing (needs the network).
        three_augment, color_jitter, auto_augment: timm training transforms for ImageFolder datasets.
        hflip: random horizontal flips in training (never for Fashion-MNIST).
        augment: random training transforms at all; False gives the eval transforms (deterministic runs, tests).
        train_transform: replaces the training transform (e.g. DINO's multi-crop); it receives a float tensor
            (C, H, W) in [0, 1] for Fashion-MNIST and CIFAR, a PIL image for ImageFolder.
    """
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset {dataset!r}; allowed: {', '.join(DATASETS)}")
    chans, native, num_classes, mean, std = DATASETS[dataset]
    if dataset == "fashion-mnist":
        if download and find_fashion_mnist(root) is None:
            fetch_fashion_mnist(root or "data")
        train = load_fashion_mnist(
            root, "train", train_transform or small_image_transforms(img_size, native, mean, std, augment, False)
        )
        test = load_fashion_mnist(root, "test", small_image_transforms(img_size, native, mean, std, False, False))
        return ImageData(train, test, num_classes, chans, img_size)
    if dataset in ("cifar10", "cifar100"):
        if root is None:
            raise DataError(f"{dataset} needs a data root (--data-root); add --download to fetch it when online")
        try:
            train = CIFAR(
                root,
                dataset,
                train=True,
                download=download,
                transform=train_transform or small_image_transforms(img_size, native, mean, std, augment, hflip),
            )
            test = CIFAR(
                root,
                dataset,
                train=False,
                download=download,
                transform=small_image_transforms(img_size, native, mean, std, False, hflip),
            )
        except DataError:
            raise  # already names the file, the item and what is allowed
        except Exception as err:  # noqa: BLE001 - unpickling, a refused global, a download: all mean "no usable data"
            import torchvision

            folder = (
                torchvision.datasets.CIFAR10 if dataset == "cifar10" else torchvision.datasets.CIFAR100
            ).base_folder
            raise DataError(
                f"{dataset} not found or corrupt in {root} ({type(err).__name__}: {str(err).splitlines()[0][:100]}); "
                f"expected the official python batches in {root}/{folder}/ (add --download when online)"
            ) from None
        return ImageData(train, test, num_classes, chans, img_size)
    # ImageFolder / ImageNet
    import torchvision
    from timm.data import create_transform

    if root is None or not (Path(root) / "train").is_dir() or not (Path(root) / "val").is_dir():
        raise DataError(f"imagefolder needs {root}/train/<class>/* and {root}/val/<class>/*; not found")
    train_tf = create_transform(
        img_size,
        is_training=augment,
        color_jitter=color_jitter or None,
        hflip=0.5 if hflip else 0.0,
        auto_augment="3a" if three_augment else auto_augment,
        mean=mean,
        std=std,
    )
    eval_tf = create_transform(img_size, is_training=False, mean=mean, std=std)
    try:
        train = torchvision.datasets.ImageFolder(str(Path(root) / "train"), transform=train_transform or train_tf)
        test = torchvision.datasets.ImageFolder(str(Path(root) / "val"), transform=eval_tf)
    except (FileNotFoundError, OSError) as err:
        raise DataError(f"cannot read ImageFolder data in {root}: {err}") from None
    if train.classes != test.classes:
        raise DataError(f"{root}/train has {len(train.classes)} classes but {root}/val has {len(test.classes)}")
    return ImageData(train, test, len(train.classes), chans, img_size)
