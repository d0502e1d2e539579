"""The image datasets lapheads knows, and the check of a data root: what a config and ``--help`` read, without
torch (``lapheads.data.images`` builds the datasets)."""

from __future__ import annotations

from pathlib import Path

from lapheads.config import ConfigError

__all__ = ["DATASETS", "check_data_root"]

#: name -> (channels, native image size, number of classes, mean, std)
DATASETS = {
    "fashion-mnist": (1, 28, 10, (0.2860,), (0.3530,)),
    "cifar10": (3, 32, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": (3, 32, 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagefolder": (3, 224, None, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def check_data_root(data_root: str | None, download: bool) -> None:
    """An image data root must be an existing directory, or one to create with --download."""
    if data_root is None:
        return
    path = Path(data_root)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--data-root {data_root!r} is a file; allowed: a directory")
    if not path.exists() and not download:
        raise ConfigError(
            f"--data-root {data_root!r} does not exist; allowed: an existing directory (or add "
            "--download to fetch the data into it)"
        )
