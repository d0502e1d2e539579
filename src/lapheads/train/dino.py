"""Self-supervised DINO training with Laplacian heads (after facebookresearch/dino ``main_dino.py``).

Design choices:

* **Student and teacher** are ``MultiCropWrapper(create_vit(..., num_classes=0, dynamic_img_size=True), DINOHead)``
  with the same Laplacian spec; the teacher starts as a copy of the student, takes no gradients, and follows it by
  EMA with a cosine momentum schedule (0.996 -> 1).
* **DINO's defaults**: multi-crop (2 global + N local), centring and sharpening (student 0.1, teacher temperature
  with linear warm-up), AdamW with cosine lr (linear warm-up, scaled by batch/256) and cosine weight decay
  (0.04 -> 0.4, not on biases and norms), per-parameter gradient clipping at 3.0, the last layer frozen during the
  first epoch.
* **One step = one global batch** from ``GlobalBatchSampler`` (DDP: each rank its share; the centre is averaged
  over ranks). Checkpoints hold student, teacher, the loss centre, optimizer and RNG states, so a resumed run
  continues the same trajectory (augmentations draw from the saved RNG; exact with ``num_workers=0``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lapheads.config import FRACTION, NON_NEGATIVE, POSITIVE, RATE, ConfigError, Domain, one_of, option, validate_config
from lapheads.data.images import DATASETS, build_image_data, check_data_root
from lapheads.data.multicrop import MultiCropAugmentation, collate_crops
from lapheads.distributed import StopRequests, setup_distributed
from lapheads.errors import InputError
from lapheads.hardware import activation_bytes, check_fits, training_bytes
from lapheads.models.dino import (
    DINOHead,
    DINOLoss,
    MultiCropWrapper,
    cancel_last_layer_gradients,
    cosine_schedule,
    teacher_temperatures,
    update_teacher,
)
from lapheads.models.vit import vit_head_kinds, vit_laplacian_masks
from lapheads.runs import RunDir, model_record
from lapheads.runs import build_model as build_from_record
from lapheads.runs.layout import CONFIG_FILE
from lapheads.train.runtime import (
    GlobalBatchSampler,
    RunConfig,
    StepClock,
    check_finite_loss,
    optimizer_step,
    run_precision,
    save_checkpoint,
    seed_everything,
    start_or_resume,
    wrap_for_training,
)

__all__ = ["DINOConfig", "build_backbone", "train_dino"]


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
    num_workers: int = option(0, "data-loader worker processes", NON_NEGATIVE)
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
    from lapheads.data.images import DATASETS

    build_backbone(cfg, DATASETS.get(cfg.dataset, (3,))[0])


def build_student_teacher(
    cfg: DINOConfig, in_chans: int, drop_path: bool = True
) -> tuple[MultiCropWrapper, MultiCropWrapper]:
    def wrapper(rate: float) -> MultiCropWrapper:
        backbone = build_backbone(
            dataclasses.replace(cfg, model_kwargs={**cfg.model_kwargs, "drop_path_rate": rate}), in_chans
        )
        head = DINOHead(
            backbone.num_features,
            cfg.out_dim,
            cfg.head_hidden_dim,
            cfg.head_bottleneck_dim,
            norm_last_layer=cfg.norm_last_layer,
        )
        return MultiCropWrapper(backbone, head)

    student = wrapper(cfg.drop_path if drop_path else 0.0)
    teacher = wrapper(0.0)  # DINO's teacher has no drop-path
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    return student, teacher


def check_training_fits(cfg: DINOConfig, in_chans: int, device: str, batch: int) -> None:
    """Refuse, before anything is allocated (the crops included), a step that cannot fit, by a lower bound
    (:func:`lapheads.hardware.training_bytes`): student and teacher built on the meta device (the DINO head with its
    ``out_dim`` prototypes), the student's activations for 2 global and ``local_crops`` local crops of each image,
    and the prototype scores of every crop."""
    with torch.device("meta"):
        student, _ = build_student_teacher(cfg, in_chans)
    backbone = student.backbone
    blocks = list(backbone.blocks)
    patch = backbone.patch_embed.patch_size[0]
    width, depth, heads = int(backbone.embed_dim), len(blocks), int(getattr(blocks[0].attn, "num_heads", 1))
    params = sum(p.numel() for p in student.parameters())
    maps = device == "cpu"
    need = 4 * params  # the teacher's weights (no gradients, no moments)
    for crops, size in ((2, cfg.img_size), (cfg.local_crops, cfg.local_crop_size)):
        tokens = (size // patch) ** 2 + 1
        # each crop: activations through the backbone, and its out_dim scores (logits, softmax, gradient)
        need += training_bytes(
            0,
            batch * crops,
            tokens,
            width,
            depth,
            heads,
            attention_maps=maps,
            activation_bytes=activation_bytes(cfg.amp, device),
        )
        need += 4 * batch * crops * cfg.out_dim * 2  # one copy of the student's and of the teacher's scores
    need += training_bytes(params, 0, 0, width, depth, heads)
    check_fits(f"training DINO ({params:,} student parameters, out_dim {cfg.out_dim:,}) on {batch} images of 2 + "
               f"{cfg.local_crops} crops", need, device)  # fmt: skip


def _param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """DINO's groups: weight decay on matrices, none on biases and norms (1-D parameters)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _clip_per_parameter(model: torch.nn.Module, clip: float) -> None:
    """DINO clips each parameter's gradient norm separately."""
    for p in model.parameters():
        if p.grad is not None:
            norm = p.grad.norm(2)
            p.grad.mul_(torch.clamp(clip / (norm + 1e-6), max=1.0))


def train_dino(
    cfg: DINOConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    stop_at_step: int | None = None,
    preset: str | None = None,
) -> dict[str, Any]:
    """Train (or resume) a DINO run into ``run_dir``; returns the final metrics.

    Args:
        cfg: the resolved config (written to config.json).
        run_dir: the run directory.
        resume: continue from the latest checkpoint (config.json must match ``cfg``).
        preset: the preset name the config came from, recorded in config.json (``--resume`` checks it).
        stop_at_step: stop after this many steps as if killed (for testing resume).
    """
    validate_config(cfg)  # before anything is written
    run = RunDir(run_dir)
    dist_ = setup_distributed(cfg.device)
    if cfg.batch_size % dist_.world_size:
        raise InputError(f"batch_size={cfg.batch_size} is not divisible by the {dist_.world_size} processes")
    chans, _, _, mean, std = DATASETS[cfg.dataset]
    check_training_fits(cfg, chans, dist_.device.type, cfg.batch_size // dist_.world_size)
    augment = MultiCropAugmentation(
        cfg.img_size, cfg.local_crop_size, cfg.local_crops, mean, std, tuple(cfg.global_scale), tuple(cfg.local_scale)
    )
    data = build_image_data(cfg.dataset, cfg.data_root, cfg.img_size, download=cfg.download, train_transform=augment)
    train_set = (
        data.train
        if cfg.train_subset is None
        else torch.utils.data.Subset(data.train, range(min(cfg.train_subset, len(data.train))))
    )

    seed_everything(cfg.seed)  # the same initial weights on every rank
    student, teacher = build_student_teacher(cfg, data.in_chans)
    seed_everything(cfg.seed + dist_.rank)  # but independent augmentations per rank
    student.to(dist_.device)
    teacher.to(dist_.device)
    sampler = GlobalBatchSampler(
        len(train_set), cfg.batch_size // dist_.world_size, 1, dist_.rank, dist_.world_size, cfg.seed
    )
    per_epoch = sampler.steps_per_epoch
    total_steps = cfg.epochs * per_epoch
    lr_schedule = cosine_schedule(cfg.lr * cfg.batch_size / 256, cfg.min_lr, cfg.epochs, per_epoch, cfg.warmup_epochs)
    wd_schedule = cosine_schedule(cfg.weight_decay, cfg.weight_decay_end, cfg.epochs, per_epoch)
    momentum_schedule = cosine_schedule(cfg.momentum_teacher, 1.0, cfg.epochs, per_epoch)
    loss_fn = DINOLoss(
        cfg.out_dim,
        2 + cfg.local_crops,
        teacher_temperatures(cfg.warmup_teacher_temp, cfg.teacher_temp, cfg.warmup_teacher_temp_epochs, cfg.epochs),
        cfg.student_temp,
        cfg.center_momentum,
    ).to(dist_.device)
    optimizer = torch.optim.AdamW(_param_groups(student))
    extra = {"teacher": teacher, "dino_loss": loss_fn}
    num_params = sum(p.numel() for p in student.backbone.parameters())

    precision = run_precision(run, cfg.amp, dist_, resume)
    start_step = start_or_resume(
        run,
        "dino",
        dataclasses.asdict(cfg),
        dist_,
        student,
        optimizer,
        resume=resume,
        extra_models=extra,
        config_type=DINOConfig,
        extra_record={
            "precision": precision.record(),
            "preset": preset,
            "num_params": num_params,
            "laplacian_masks": vit_laplacian_masks(student.backbone),
            "head_kinds": vit_head_kinds(student.backbone),
            "in_chans": data.in_chans,
            "num_classes": data.num_classes,
            "steps": total_steps,
            "embed_dim": student.backbone.num_features,
            "model": backbone_spec(cfg, data.in_chans),
        },
    )
    _, forward_model = wrap_for_training(student, dist_, cfg.compile)
    steps_per_checkpoint = max(1, round(cfg.checkpoint_every_epochs * per_epoch))
    clock = StepClock(total_steps, start_step, "train dino", main=dist_.is_main, stop_at_step=stop_at_step)
    progress = clock.progress
    batches = sampler.step_batches(start_step)
    mean_loss = math.nan
    student.train()
    step = start_step
    with StopRequests(active=not dist_.enabled) as stop:
        while step < total_steps:
            if not clock.begin(step):
                return {"step": step, "stopped": True}
            step, (indices,) = next(batches)
            epoch = step // per_epoch
            for i, group in enumerate(optimizer.param_groups):
                group["lr"] = float(lr_schedule[step])
                if i == 0:
                    group["weight_decay"] = float(wd_schedule[step])
            crops, _ = collate_crops([train_set[i] for i in indices])
            crops = [c.to(dist_.device, non_blocking=True) for c in crops]
            with torch.autocast(dist_.device.type, dtype=torch.bfloat16, enabled=precision.autocast):
                with torch.no_grad():
                    teacher_output = teacher(crops[:2])  # only the global crops pass through the teacher
                student_output = forward_model(crops)
                loss = loss_fn(student_output.float(), teacher_output.float(), epoch)
            mean_loss = dist_.all_reduce_sum(loss.detach().clone()).item() / dist_.world_size
            hint = "lower --lr or --clip-grad" if cfg.clip_grad else "lower --lr or set --clip-grad 3.0"
            check_finite_loss(mean_loss, step, run, hint, progress)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip_grad:
                _clip_per_parameter(student, cfg.clip_grad)
            cancel_last_layer_gradients(epoch, student, cfg.freeze_last_layer)
            optimizer_step([optimizer], step, run, hint, progress)
            update_teacher(student, teacher, float(momentum_schedule[step]))
            step += 1
            clock.end(len(indices) * dist_.world_size)
            if clock.due(step, cfg.log_every):
                _, rate = clock.lap()
                progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr_schedule[step - 1]:.2e}", img_s=f"{rate:.0f}")
                if dist_.is_main:
                    run.log(
                        {
                            "step": step,
                            "epoch": step / per_epoch,
                            "loss": mean_loss,
                            "lr": float(lr_schedule[step - 1]),
                            "weight_decay": float(wd_schedule[step - 1]),
                            "teacher_momentum": float(momentum_schedule[step - 1]),
                            "images_per_s": rate,
                        }
                    )
            if clock.due(step, cfg.checkpoint_every, steps_per_checkpoint) or stop.requested:
                save_checkpoint(
                    run, step, dist_, student, optimizer, {"epoch": step / per_epoch}, extra, keep=cfg.keep_checkpoints
                )
            stop.stop_if_requested(step, run.path, progress)
    clock.close()
    return {"step": step, "num_params": num_params, "loss": mean_loss}
