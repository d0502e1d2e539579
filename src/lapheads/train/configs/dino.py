"""A DINO run's config and the backbone it describes. No training code: presets, ``--help`` and a sweep's dry run
import this, never the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lapheads.config import FRACTION, NON_NEGATIVE, POSITIVE, RATE, ConfigError, Domain, one_of, option
from lapheads.data.catalog import DATASETS, check_data_root
from lapheads.runs import build_model as build_from_record
from lapheads.runs import model_record
from lapheads.runs.layout import CONFIG_FILE
from lapheads.train.configs.run import RunConfig

__all__ = ["SCALE_RANGE", "DINOConfig", "backbone_spec", "build_backbone", "recorded_model", "check_model"]


#: DINO's crop scales: [low, high] with 0 < low <= high <= 1
SCALE_RANGE = Domain("[low, high] with 0 < low <= high <= 1", lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1)


@dataclass
class DINOConfig(RunConfig):
    """Every option of a DINO run (``lapheads train dino --key value`` sets any of them); the shared run options
    come from RunConfig."""

    # model
    model: str = option("vit_small_patch16_224", "a timm VisionTransformer name")
    qk_norm: bool = option(False, "LayerNorm on queries and keys")
    drop_path: float = option(0.1, "stochastic-depth rate of the student", RATE)
    model_kwargs: dict = option({}, "extra timm model arguments as JSON")
    out_dim: int = option(65536, "prototypes (the DINO head's output size)", POSITIVE)
    head_hidden_dim: int = option(2048, "hidden width of the DINO head's MLP", POSITIVE)
    head_bottleneck_dim: int = option(256, "bottleneck width before the prototypes", POSITIVE)
    norm_last_layer: bool = option(True, "weight-normalised last layer with a fixed norm")
    # data and multi-crop
    dataset: str = option("imagefolder", "the image dataset", one_of(*DATASETS))
    data_root: str | None = option(None, "data folder (an existing directory; none: Fashion-MNIST's default places)")
    download: bool = option(False, "let torchvision download the dataset into --data-root (needs the network)")
    train_subset: int | None = option(None, "train on the first N images", POSITIVE)
    img_size: int = option(224, "global crop size in pixels", POSITIVE)
    local_crop_size: int = option(96, "local crop size in pixels", POSITIVE)
    local_crops: int = option(8, "local crops per image", NON_NEGATIVE)
    global_scale: list[float] = option([0.4, 1.0], "area range of the global crops", SCALE_RANGE)
    local_scale: list[float] = option([0.05, 0.4], "area range of the local crops", SCALE_RANGE)
    # optimisation
    epochs: int = option(100, "training epochs", POSITIVE)
    batch_size: int = option(512, "global batch over all processes", POSITIVE)
    lr: float = option(0.0005, "peak learning rate per 256 images (scaled by batch/256)", POSITIVE)
    min_lr: float = option(1e-6, "learning rate at the end of the cosine", NON_NEGATIVE)
    warmup_epochs: float = option(10, "linear warm-up length in epochs", NON_NEGATIVE)
    weight_decay: float = option(0.04, "weight decay at the start (cosine schedule)", NON_NEGATIVE)
    weight_decay_end: float = option(0.4, "weight decay at the end", NON_NEGATIVE)
    momentum_teacher: float = option(0.996, "teacher EMA momentum at the start (cosine to 1)", FRACTION)
    teacher_temp: float = option(0.04, "teacher temperature after its warm-up", POSITIVE)
    warmup_teacher_temp: float = option(0.04, "teacher temperature at the start", POSITIVE)
    warmup_teacher_temp_epochs: int = option(0, "epochs of teacher-temperature warm-up", NON_NEGATIVE)
    student_temp: float = option(0.1, "student temperature", POSITIVE)
    center_momentum: float = option(0.9, "momentum of the teacher-output centre", RATE)
    freeze_last_layer: int = option(1, "epochs with the head's last layer frozen", NON_NEGATIVE)
    clip_grad: float = option(3.0, "per-parameter gradient-norm clip (0: off)", NON_NEGATIVE)
    # runtime
    num_workers: int = option(
        0,
        "data-loader worker processes that cut the crops ahead (seeded by seed, rank and step: results do not depend "
        "on it; 0: in the trainer)",
        NON_NEGATIVE,
    )
    checkpoint_every_epochs: float = option(1.0, "epochs between checkpoints", POSITIVE)

    def check(self) -> None:
        """Rules that tie fields together; ``validate_config`` calls it after the per-field checks."""
        check_data_root(self.data_root, self.download)
        if self.min_lr > self.lr * self.batch_size / 256:
            raise ConfigError(f"--min-lr {self.min_lr} is above the scaled peak lr {self.lr * self.batch_size / 256}")
        if self.warmup_teacher_temp_epochs > self.epochs:
            raise ConfigError(
                f"--warmup-teacher-temp-epochs {self.warmup_teacher_temp_epochs} > --epochs "
                f"{self.epochs}; allowed: at most the training length"
            )


def backbone_spec(cfg: DINOConfig, in_chans: int) -> dict[str, Any]:
    """The backbone's constructor arguments as config.json records them; the weight files hold it under
    ``backbone.`` (student: model.safetensors, teacher: teacher.safetensors)."""
    kwargs = {
        "img_size": cfg.img_size,
        "in_chans": in_chans,
        "num_classes": 0,
        "dynamic_img_size": True,
        **cfg.model_kwargs,
    }
    return model_record(
        "vit",
        {"name": cfg.model, "laplacian_heads": cfg.laplacian_heads, "qk_norm": cfg.qk_norm, **kwargs},
        prefix="backbone.",
    )


def build_backbone(cfg: DINOConfig, in_chans: int) -> torch.nn.Module:
    """The ViT without classifier; any crop size (positions interpolated per forward)."""
    return build_from_record(backbone_spec(cfg, in_chans))


def recorded_model(record: dict[str, Any]) -> dict[str, Any]:
    """config.json's ``"model"`` for a run written before lapheads recorded it (``lapheads upgrade``)."""
    from lapheads.config import config_from_dict

    return {
        "model": backbone_spec(config_from_dict(DINOConfig, record["config"], source=CONFIG_FILE), record["in_chans"])
    }


def check_model(cfg: DINOConfig) -> None:
    """Build the backbone once (a sweep does, before its first cell): a head spec that does not fit fails in one
    line."""
    from lapheads.data.catalog import DATASETS

    build_backbone(cfg, DATASETS.get(cfg.dataset, (3,))[0])
