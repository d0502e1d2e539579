"""A classification run's config and the ViT it describes (built once by a sweep to check its head spec; recorded in
config.json). No training code: presets, ``--help`` and a sweep's dry run import this, never the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lapheads.config import NON_NEGATIVE, POSITIVE, RATE, ConfigError, interval, one_of, option
from lapheads.data.catalog import DATASETS, check_data_root
from lapheads.errors import InputError
from lapheads.runs.layout import CONFIG_FILE
from lapheads.train.configs.run import RunConfig

if TYPE_CHECKING:
    import torch

__all__ = ["ClassifyConfig", "model_spec", "build_model", "recorded_model", "check_model"]


@dataclass
class ClassifyConfig(RunConfig):
    """Every option of a classification run (``lapheads train classify --key value`` sets any of them); the shared
    run options come from RunConfig."""

    # model
    model: str = option("vit_fmnist_patch4", "a timm VisionTransformer name (timm.list_models('*vit*'))")
    qk_norm: bool = option(True, "LayerNorm on queries and keys (the paper's baseline has it)")
    img_size: int = option(28, "model input size in pixels (a multiple of the patch size)", POSITIVE)
    drop_path: float = option(0.0, "stochastic-depth rate", RATE)
    layer_scale: float | None = option(None, "LayerScale init value (DeiT-III: 1e-6); none = no LayerScale", POSITIVE)
    model_kwargs: dict = option({}, 'extra timm model arguments as JSON, e.g. {"patch_size": 7}')
    # data
    dataset: str = option("fashion-mnist", "the image dataset", one_of(*DATASETS))
    data_root: str | None = option(None, "data folder (an existing directory; none: Fashion-MNIST's default places)")
    download: bool = option(False, "let torchvision download the dataset into --data-root (needs the network)")
    train_subset: int | None = option(None, "train on the first N training images", POSITIVE)
    eval_subset: int | None = option(None, "evaluate on the first N test images", POSITIVE)
    fit_subset: int | None = option(
        None,
        "also evaluate on the first N training images without augmentation, logged as fit_top1 / fit_loss: "
        "how well the model fits its training set (underfit when fit_top1 is near eval_top1)",
        POSITIVE,
    )
    augment: bool = option(True, "random training transforms (crop, flip)")
    three_augment: bool = option(False, "DeiT-III's 3-Augment (ImageFolder data)")
    color_jitter: float = option(0.0, "colour-jitter strength (ImageFolder data)", NON_NEGATIVE)
    hflip: bool = option(True, "random horizontal flips (never for Fashion-MNIST)")
    aug_repeats: int = option(
        1,
        "repeated augmentation (DeiT's RASampler, timm's --aug-repeats): each image an epoch draws comes this many "
        "times in a row, each copy augmented on its own, and an epoch keeps its length (1: off; DeiT-III: 3)",
        POSITIVE,
    )
    mixup: float = option(0.0, "Mixup alpha (0: off)", NON_NEGATIVE)
    cutmix: float = option(0.0, "CutMix alpha (0: off)", NON_NEGATIVE)
    smoothing: float = option(0.0, "label smoothing", RATE)
    bce: bool = option(False, "binary cross-entropy loss (DeiT-III)")
    mix_penalty: float = option(
        0.0,
        "weight of the decisiveness penalty on mix heads' (a, b): towards a named kind (lapheads.study.mix; 0: off)",
        NON_NEGATIVE,
    )
    within_seq_penalty: float = option(
        0.0,
        "a geometry intervention: lambda x the within-sequence fraction of each batch's tokens after the final norm "
        "joins the loss (> 0 lowers the fraction, < 0 raises it), moving the geometry without Laplacian heads (0: off)",
        interval(-100, 100),
    )
    mix_lr_scale: float = option(
        1.0,
        "mix heads' (a, b) learn at lr x this (two scalars per head move slowly at a matrix LR; the GPT gives them "
        "nanochat's scalar LR)",
        POSITIVE,
    )
    # optimisation
    epochs: float = option(1.0, "training length in epochs (fractions allowed)", POSITIVE)
    batch_size: int = option(128, "global batch: images per optimizer step, over all processes", POSITIVE)
    accum_steps: int = option(1, "micro-batches per optimizer step (derived when --micro-batch is set)", POSITIVE)
    micro_batch: int | None = option(None, "images per forward pass per process; sets --accum-steps", POSITIVE)
    optimizer: str = option("adamw", "a timm optimizer name (adamw, lamb, ...)")
    lr: float = option(1e-3, "peak learning rate", POSITIVE)
    min_lr: float = option(1e-6, "learning rate at the end of the cosine and at the start of warm-up", NON_NEGATIVE)
    warmup_epochs: float = option(0.05, "linear warm-up length in epochs", NON_NEGATIVE)
    weight_decay: float = option(0.05, "AdamW/LAMB weight decay", NON_NEGATIVE)
    clip_grad: float | None = option(1.0, "gradient-norm clip; none = no clipping", POSITIVE)
    ema_decay: float = option(0.0, "EMA of the weights (0: off), evaluated beside the model", RATE)
    # runtime
    num_workers: int = option(
        0,
        "data-loader worker processes that read and augment batches ahead (training and evaluation; each micro-batch's "
        "transforms are seeded by seed, rank and step, so results do not depend on it; 0: in the trainer)",
        NON_NEGATIVE,
    )
    eval_every_epochs: float = option(1.0, "epochs between test-set evaluations (and checkpoints)", POSITIVE)
    checkpoint_at_start: bool = option(
        False, "also keep the initial weights as checkpoint step 0 (the geometry over training from its start)"
    )
    deterministic: bool = option(False, "torch.use_deterministic_algorithms")

    def check(self) -> None:
        """Rules that tie fields together; ``validate_config`` calls it after the per-field checks."""
        check_data_root(self.data_root, self.download)
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} is above --lr {self.lr}; allowed: min_lr <= lr")
        if self.micro_batch is not None and self.batch_size % self.micro_batch:
            raise ConfigError(
                f"--micro-batch {self.micro_batch} does not divide --batch-size {self.batch_size}; "
                "allowed: a divisor of the batch size"
            )
        if self.micro_batch is None and self.batch_size % self.accum_steps:
            raise ConfigError(
                f"--accum-steps {self.accum_steps} does not divide --batch-size {self.batch_size}; "
                "allowed: a divisor of the batch size"
            )
        if self.aug_repeats > 1 and not self.augment:
            raise ConfigError(
                f"--aug-repeats {self.aug_repeats} with --augment false: the copies would be the same image; "
                "allowed: --aug-repeats 1, or --augment true"
            )
        from timm.optim import list_optimizers

        if self.optimizer.lower() not in list_optimizers():
            raise ConfigError(
                f"--optimizer {self.optimizer!r}: allowed: a timm optimizer, e.g. adamw, lamb, sgd, "
                "lion (timm.optim.list_optimizers())"
            )


def model_spec(cfg: ClassifyConfig, num_classes: int, in_chans: int) -> dict[str, Any]:
    """The ViT's constructor arguments as config.json records them (``lapheads.runs.model_record``)."""
    from lapheads.runs.models import model_record  # with torch: only when a model is described

    kwargs = dict(cfg.model_kwargs)
    if cfg.layer_scale is not None:
        kwargs["init_values"] = cfg.layer_scale
    patch = kwargs.get("patch_size") or _model_patch_size(cfg.model)
    if patch and cfg.img_size % patch:
        raise InputError(f"img_size={cfg.img_size} is not a multiple of the patch size {patch} of {cfg.model}")
    return model_record(
        "vit",
        {
            "name": cfg.model,
            "laplacian_heads": cfg.laplacian_heads,
            "qk_norm": cfg.qk_norm,
            "num_classes": num_classes,
            "in_chans": in_chans,
            "img_size": cfg.img_size,
            "drop_path_rate": cfg.drop_path,
            **kwargs,
        },
    )


def build_model(cfg: ClassifyConfig, num_classes: int, in_chans: int) -> torch.nn.Module:
    from lapheads.runs.models import build_model as build_from_record

    return build_from_record(model_spec(cfg, num_classes, in_chans))


def recorded_model(record: dict[str, Any]) -> dict[str, Any]:
    """config.json's ``"model"`` for a run written before lapheads recorded it (``lapheads upgrade``)."""
    from lapheads.config import config_from_dict

    cfg = config_from_dict(ClassifyConfig, record["config"], source=CONFIG_FILE)
    return {"model": model_spec(cfg, record["num_classes"], record["in_chans"])}


def check_model(cfg: ClassifyConfig) -> None:
    """Build the model once (a sweep does, before its first cell): a head spec that does not fit fails in one line."""
    build_model(cfg, 10, DATASETS.get(cfg.dataset, (3,))[0])


def _model_patch_size(name: str) -> int | None:
    import re

    match = re.search(r"patch(\d+)", name)
    return int(match.group(1)) if match else None
