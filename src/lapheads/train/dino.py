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
  continues the same trajectory (the crops of a step are seeded by it, ``step_loader``, so the worker processes
  that cut them ahead, ``num_workers``, change nothing).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from lapheads.config import validate_config
from lapheads.data.catalog import DATASETS
from lapheads.data.images import build_image_data
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
from lapheads.runs import RunDir
from lapheads.runs.checkpoints import save_checkpoint
from lapheads.train.configs.dino import (
    DINOConfig,
    backbone_spec,
    build_backbone,
)
from lapheads.train.runtime import (
    GlobalBatchSampler,
    StepClock,
    check_finite_loss,
    optimizer_step,
    run_precision,
    seed_everything,
    start_or_resume,
    step_loader,
    wrap_for_training,
)

__all__ = ["train_dino"]


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
    seed_everything(cfg.seed + dist_.rank)  # but each rank its own drop-path masks (its crops: step_loader)
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
    pin = dist_.device.type == "cuda"
    batches = step_loader(train_set, sampler, start_step, collate_crops, num_workers=cfg.num_workers, pin_memory=pin)
    mean_loss = math.nan
    student.train()
    step = start_step
    with StopRequests(active=not dist_.enabled) as stop:
        while step < total_steps:
            if not clock.begin(step):
                return {"step": step, "stopped": True}
            step, ((crops, labels),) = next(batches)
            epoch = step // per_epoch
            for i, group in enumerate(optimizer.param_groups):
                group["lr"] = float(lr_schedule[step])
                if i == 0:
                    group["weight_decay"] = float(wd_schedule[step])
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
            clock.end(len(labels) * dist_.world_size)
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
