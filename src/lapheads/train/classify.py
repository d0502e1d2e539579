"""Supervised image classification with Laplacian heads (DeiT-III style recipes, and small CPU ones).

Design choices:

* **The recipe parts are timm's**: ``create_vit`` (timm ViT + LaplacianAttention), ``create_optimizer_v2`` (AdamW or
  LAMB, no weight decay on norms/biases/position embeddings), ``CosineLRScheduler`` stepped per optimizer update
  with linear warm-up, ``Mixup`` (Mixup/CutMix + label smoothing), ``BinaryCrossEntropy`` / soft-target CE,
  ``ModelEmaV3``, drop-path and LayerScale through the model arguments.
* **One step = one global batch**, split by ``GlobalBatchSampler`` into world_size x accum_steps micro-batches, so
  the trajectory depends on the global batch only, and a resumed run continues with the exact next batch.
* **Nothing already written is lost**: a non-finite loss stops the run before the optimizer step, naming the step;
  checkpoints are atomic, so the last good one stays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

from lapheads.data.images import DATASETS, build_image_data
from lapheads.errors import InputError
from lapheads.models.vit import create_vit, vit_laplacian_masks
from lapheads.train.runtime import (
    Distributed,
    GlobalBatchSampler,
    RunConfig,
    RunDir,
    check_finite_loss,
    latest_checkpoint,
    save_checkpoint,
    seed_everything,
    setup_distributed,
    start_or_resume,
    wrap_for_training,
)

__all__ = ["ClassifyConfig", "evaluate_classifier", "train_classify"]


@dataclass
class ClassifyConfig(RunConfig):
    """Every option of a classification run (``lapheads train classify --key value`` sets any of them); the shared run options come from RunConfig."""

    # model
    model: str = "vit_fmnist_patch4"
    qk_norm: bool = True
    img_size: int = 28
    drop_path: float = 0.0
    layer_scale: float | None = None
    model_kwargs: dict = dataclasses.field(default_factory=dict)
    # data
    dataset: str = "fashion-mnist"
    data_root: str | None = None
    download: bool = False
    train_subset: int | None = None
    eval_subset: int | None = None
    augment: bool = True
    three_augment: bool = False
    color_jitter: float = 0.0
    hflip: bool = True
    mixup: float = 0.0
    cutmix: float = 0.0
    smoothing: float = 0.0
    bce: bool = False
    # optimisation
    epochs: float = 1.0
    batch_size: int = 128
    accum_steps: int = 1
    micro_batch: int | None = None
    optimizer: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-6
    warmup_epochs: float = 0.05
    weight_decay: float = 0.05
    clip_grad: float | None = 1.0
    ema_decay: float = 0.0
    # runtime
    num_workers: int = 0
    eval_every_epochs: float = 1.0
    deterministic: bool = False


def _micro_batch(cfg: ClassifyConfig, world_size: int) -> int:
    """Samples per forward pass per rank; with ``micro_batch`` set, accum_steps follows from the global batch."""
    if cfg.micro_batch is not None:
        if cfg.batch_size % (cfg.micro_batch * world_size):
            raise InputError(
                f"batch_size={cfg.batch_size} is not divisible by micro_batch x world_size = "
                f"{cfg.micro_batch * world_size}; allowed: a micro_batch that divides {cfg.batch_size // world_size}"
            )
        cfg.accum_steps = cfg.batch_size // (cfg.micro_batch * world_size)
    per_step = world_size * cfg.accum_steps
    if cfg.batch_size % per_step:
        raise InputError(
            f"batch_size={cfg.batch_size} is not divisible by world_size x accum_steps = {per_step}; allowed: a "
            f"multiple of {per_step}"
        )
    return cfg.batch_size // per_step


def build_model(cfg: ClassifyConfig, num_classes: int, in_chans: int) -> torch.nn.Module:
    kwargs = dict(cfg.model_kwargs)
    if cfg.layer_scale is not None:
        kwargs["init_values"] = cfg.layer_scale
    patch = kwargs.get("patch_size") or _model_patch_size(cfg.model)
    if patch and cfg.img_size % patch:
        raise InputError(f"img_size={cfg.img_size} is not a multiple of the patch size {patch} of {cfg.model}")
    return create_vit(
        cfg.model, cfg.laplacian_heads, qk_norm=cfg.qk_norm, num_classes=num_classes, in_chans=in_chans,
        img_size=cfg.img_size, drop_path_rate=cfg.drop_path, **kwargs,
    )


def _model_patch_size(name: str) -> int | None:
    import re

    match = re.search(r"patch(\d+)", name)
    return int(match.group(1)) if match else None


def _loss_fn(cfg: ClassifyConfig):
    from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    if cfg.bce:
        return BinaryCrossEntropy(smoothing=cfg.smoothing if not (cfg.mixup or cfg.cutmix) else 0.0)
    if cfg.mixup or cfg.cutmix:
        return SoftTargetCrossEntropy()
    if cfg.smoothing:
        return LabelSmoothingCrossEntropy(cfg.smoothing)
    return torch.nn.CrossEntropyLoss()


def _collate(dataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    items = [dataset[i] for i in indices]
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


@torch.no_grad()
def evaluate_classifier(
    model: torch.nn.Module, dataset, dist_: Distributed, batch_size: int, amp: bool, num_workers: int = 0
) -> dict[str, float]:
    """Top-1 / top-5 accuracy and mean cross-entropy over ``dataset``, summed across ranks."""
    model.eval()
    shard = Subset(dataset, range(dist_.rank, len(dataset), dist_.world_size))
    loader = DataLoader(shard, batch_size=batch_size, num_workers=num_workers)
    totals = torch.zeros(4, dtype=torch.float64, device=dist_.device)
    for images, labels in loader:
        images, labels = images.to(dist_.device), labels.to(dist_.device)
        with torch.autocast(dist_.device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(images)
        logits = logits.float()
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        totals += torch.stack([
            (top5[:, 0] == labels).sum(), (top5 == labels[:, None]).any(1).sum(),
            F.cross_entropy(logits, labels, reduction="sum"), torch.tensor(len(labels), device=dist_.device),
        ]).to(totals)
    dist_.all_reduce_sum(totals)
    model.train()
    n = max(totals[3].item(), 1)
    return {"eval_top1": 100 * totals[0].item() / n, "eval_top5": 100 * totals[1].item() / n, "eval_loss": totals[2].item() / n}


def train_classify(
    cfg: ClassifyConfig, run_dir: str | Path, *, resume: bool = False, stop_at_step: int | None = None
) -> dict[str, Any]:
    """Train (or resume) a classification run into ``run_dir``; returns the final metrics.

    Args:
        cfg: the resolved config (written to config.json).
        run_dir: the run directory.
        resume: continue from the run directory's latest checkpoint (its config.json must match ``cfg``).
        stop_at_step: stop after this many steps without finishing, as if the process were killed (for testing
            resume); checkpoints written so far stay.
    """
    run = RunDir(run_dir)
    dist_ = setup_distributed(cfg.device)
    if cfg.dataset not in DATASETS:
        raise InputError(f"unknown dataset {cfg.dataset!r}; allowed: {', '.join(DATASETS)}")
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    micro_batch = _micro_batch(cfg, dist_.world_size)
    data = build_image_data(
        cfg.dataset, cfg.data_root, cfg.img_size, download=cfg.download, three_augment=cfg.three_augment,
        color_jitter=cfg.color_jitter, hflip=cfg.hflip, augment=cfg.augment,
    )
    train_set = data.train if cfg.train_subset is None else Subset(data.train, range(min(cfg.train_subset, len(data.train))))
    eval_set = data.eval if cfg.eval_subset is None else Subset(data.eval, range(min(cfg.eval_subset, len(data.eval))))

    seed_everything(cfg.seed)  # the same initial weights on every rank
    model = build_model(cfg, data.num_classes, data.in_chans).to(dist_.device)
    num_params = sum(p.numel() for p in model.parameters())

    from timm.data import Mixup
    from timm.optim import create_optimizer_v2
    from timm.scheduler import CosineLRScheduler
    from timm.utils import ModelEmaV3

    optimizer = create_optimizer_v2(model, opt=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sampler = GlobalBatchSampler(len(train_set), micro_batch, cfg.accum_steps, dist_.rank, dist_.world_size, cfg.seed)
    total_steps = max(1, math.ceil(cfg.epochs * sampler.steps_per_epoch))
    warmup_steps = min(total_steps - 1, round(cfg.warmup_epochs * sampler.steps_per_epoch))
    scheduler = CosineLRScheduler(
        optimizer, t_initial=total_steps, lr_min=cfg.min_lr, warmup_t=warmup_steps, warmup_lr_init=cfg.min_lr,
        warmup_prefix=True, t_in_epochs=False,
    )
    mixup = None
    if cfg.mixup or cfg.cutmix:
        mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.smoothing,
                      num_classes=data.num_classes)
    ema = ModelEmaV3(model, decay=cfg.ema_decay) if cfg.ema_decay > 0 else None
    extra = {"ema": ema.module} if ema is not None else {}
    loss_fn = _loss_fn(cfg)

    start_step = start_or_resume(
        run, "classify", dataclasses.asdict(cfg), dist_, model, optimizer, resume=resume, extra_models=extra,
        extra_record={
            "num_params": num_params, "laplacian_masks": vit_laplacian_masks(model), "num_classes": data.num_classes,
            "in_chans": data.in_chans, "steps": total_steps,
        },
    )
    train_model, forward_model = wrap_for_training(model, dist_, cfg.compile)

    steps_per_eval = max(1, round(cfg.eval_every_epochs * sampler.steps_per_epoch))
    progress = tqdm(total=total_steps, initial=start_step, disable=not dist_.is_main, desc="train", dynamic_ncols=True)
    batches = sampler.step_batches(start_step)
    last_eval: dict[str, float] = {}
    tick, seen = time.perf_counter(), 0
    model.train()
    step = start_step
    while step < total_steps:
        if stop_at_step is not None and step >= stop_at_step:
            progress.close()
            return {"step": step, "stopped": True}
        step, micro_batches = next(batches)
        loss_sum = torch.zeros((), device=dist_.device)
        for a, indices in enumerate(micro_batches):
            images, labels = _collate(train_set, indices)
            images, labels = images.to(dist_.device, non_blocking=True), labels.to(dist_.device, non_blocking=True)
            if mixup is not None:
                images, labels = mixup(images, labels)
            sync = a == len(micro_batches) - 1 or not dist_.enabled
            with (contextlib.nullcontext() if sync else train_model.no_sync()):
                with torch.autocast(dist_.device.type, dtype=torch.bfloat16, enabled=cfg.amp):
                    loss = loss_fn(forward_model(images), labels)
                (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
            seen += len(indices) * dist_.world_size
        mean_loss = dist_.all_reduce_sum(loss_sum / len(micro_batches)).item() / dist_.world_size
        check_finite_loss(mean_loss, step, run, "lower --lr or enable --clip-grad", progress)
        if cfg.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step_update(step + 1)
        if ema is not None:
            ema.update(model, step=step + 1)
        step += 1
        progress.update(1)
        lr = optimizer.param_groups[0]["lr"]
        if step % cfg.log_every == 0 or step == total_steps:
            elapsed = time.perf_counter() - tick
            rate = seen / elapsed if elapsed > 0 else 0.0
            tick, seen = time.perf_counter(), 0
            progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", img_s=f"{rate:.0f}")
            if dist_.is_main:
                run.log({"step": step, "epoch": step / sampler.steps_per_epoch, "loss": mean_loss, "lr": lr,
                         "images_per_s": rate})
        if step % steps_per_eval == 0 or step == total_steps:
            last_eval = evaluate_classifier(model, eval_set, dist_, micro_batch * 2, cfg.amp, cfg.num_workers)
            if ema is not None:
                ema_eval = evaluate_classifier(ema.module, eval_set, dist_, micro_batch * 2, cfg.amp, cfg.num_workers)
                last_eval.update({f"ema_{k}": v for k, v in ema_eval.items()})
            if dist_.is_main:
                run.log({"step": step, "epoch": step / sampler.steps_per_epoch, **last_eval})
                progress.write(f"step {step}: " + ", ".join(f"{k} {v:.2f}" for k, v in last_eval.items()))
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step % steps_per_eval == 0 or step == total_steps:
            save_checkpoint(run, step, dist_, model, optimizer, {"epoch": step / sampler.steps_per_epoch}, extra)
    progress.close()
    return {"step": step, "num_params": num_params, **last_eval}


def evaluate_run(run_dir: Path, use_ema: bool = False) -> dict[str, Any]:
    """Evaluate the latest checkpoint of a classification run directory on its eval split."""
    from lapheads.config import config_from_dict
    from lapheads.train.runtime import CheckpointError, load_weights

    run = RunDir(run_dir)
    record = run.read_config()
    if record.get("task") != "classify":
        raise CheckpointError(f"{run.path} holds a {record.get('task')!r} run; allowed here: classify")
    cfg = config_from_dict(ClassifyConfig, record["config"], source=str(run.config_file))
    dist_ = setup_distributed(cfg.device)
    data = build_image_data(cfg.dataset, cfg.data_root, cfg.img_size)
    eval_set = data.eval if cfg.eval_subset is None else Subset(data.eval, range(min(cfg.eval_subset, len(data.eval))))
    model = build_model(cfg, data.num_classes, data.in_chans).to(dist_.device)
    folder = latest_checkpoint(run)
    if folder is None:
        raise CheckpointError(f"{run.path} has no checkpoint yet")
    load_weights(model, folder / ("ema.safetensors" if use_ema else "model.safetensors"))
    metrics = evaluate_classifier(model, eval_set, dist_, 256, cfg.amp, cfg.num_workers)
    return {"run_dir": str(run.path), "checkpoint": folder.name, **metrics}
