"""Supervised image classification with Laplacian heads (DeiT-III style recipes, and small CPU ones).

Design choices:

* **The recipe parts are timm's**: ``create_vit`` (timm ViT + LaplacianAttention), ``create_optimizer_v2`` (AdamW or
  LAMB, no weight decay on norms/biases/position embeddings), ``CosineLRScheduler`` stepped per optimizer update
  with linear warm-up, ``Mixup`` (Mixup/CutMix + label smoothing), ``BinaryCrossEntropy`` / soft-target CE,
  ``ModelEmaV3``, drop-path and LayerScale through the model arguments.
* **One step = one global batch**, split by ``GlobalBatchSampler`` into world_size x accum_steps micro-batches, so
  the trajectory depends on the global batch only, and a resumed run continues with the exact next batch;
  ``--aug-repeats`` makes it DeiT's repeated augmentation (each drawn image several times in a global batch, each
  copy its own random transform, as timm's ``RepeatAugSampler``). The ranks start from one seed (the same weights),
  then each draws its own transforms, drop-path masks and Mixup (seed + rank, as timm's and DeiT's trainers).
* **Nothing already written is lost**: a non-finite loss stops the run before the optimizer step, naming the step;
  checkpoints are atomic, so the last good one stays.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Subset

from lapheads.config import ConfigError, validate_config
from lapheads.core.kinds import decisiveness_penalty
from lapheads.data.images import build_image_data
from lapheads.distributed import StopRequests, setup_distributed
from lapheads.errors import InputError
from lapheads.evals.classify import evaluate_classifier, evaluate_fit, fit_images
from lapheads.geometry.anova import within_sequence_fraction
from lapheads.hardware import activation_bytes, check_fits, training_bytes
from lapheads.models.vit import vit_head_kinds, vit_laplacian_masks
from lapheads.runs import RunDir, latest_checkpoint
from lapheads.runs.checkpoints import save_checkpoint
from lapheads.train.configs.classify import (
    ClassifyConfig,
    build_model,
    model_spec,
)
from lapheads.train.runtime import (
    GlobalBatchSampler,
    StepClock,
    check_finite_loss,
    grad_sync,
    optimizer_step,
    run_precision,
    seed_everything,
    start_or_resume,
    step_loader,
    wrap_for_training,
)

__all__ = ["train_classify"]


def _micro_batch(cfg: ClassifyConfig, world_size: int) -> tuple[int, int]:
    """(samples per forward pass per rank, micro-batches per step); with ``micro_batch`` set, the accumulation
    follows from the global batch. The config is left as it was given (it is what config.json records)."""
    accum_steps = cfg.accum_steps
    if cfg.micro_batch is not None:
        if cfg.batch_size % (cfg.micro_batch * world_size):
            raise InputError(
                f"batch_size={cfg.batch_size} is not divisible by micro_batch x world_size = "
                f"{cfg.micro_batch * world_size}; allowed: a micro_batch that divides {cfg.batch_size // world_size}"
            )
        accum_steps = cfg.batch_size // (cfg.micro_batch * world_size)
    per_step = world_size * accum_steps
    if cfg.batch_size % per_step:
        raise InputError(
            f"batch_size={cfg.batch_size} is not divisible by world_size x accum_steps = {per_step}; allowed: a "
            f"multiple of {per_step}"
        )
    return cfg.batch_size // per_step, accum_steps


def check_training_fits(cfg: ClassifyConfig, num_classes: int, in_chans: int, device: str, world_size: int = 1) -> None:
    """Refuse, before anything is allocated, a step that cannot fit, by a lower bound: the model built on the meta
    device gives its parameters, tokens per image, width, depth and heads (lapheads.hardware.training_bytes)."""
    probe, depth, params = _meta_probe(cfg, num_classes, in_chans)
    blocks = list(getattr(probe, "blocks", []) or [])
    if not blocks or not hasattr(probe, "patch_embed"):
        return  # not a ViT-like model: its build's own check stands
    tokens = int(probe.patch_embed.num_patches) + int(getattr(probe, "num_prefix_tokens", 0))
    heads = int(getattr(blocks[0].attn, "num_heads", 1))
    batch = _micro_batch(cfg, world_size)[0]  # images per forward pass on this process
    width, per_value = int(probe.embed_dim), activation_bytes(cfg.amp, device)
    need = training_bytes(params, batch, tokens, width, depth, heads, attention_maps=device == "cpu",
                          activation_bytes=per_value)  # fmt: skip
    check_fits(f"training {cfg.model} ({params:,} parameters, {tokens:,} tokens an image at img_size {cfg.img_size}) "
               f"on micro-batches of {batch}", need, device)  # fmt: skip


#: deeper than this, the fit check counts a 1- and a 2-block probe and extrapolates: building every block, even on
#: the meta device, takes minutes at depth 100,000 (the red team's trial) before the check can refuse it
PROBE_MAX_DEPTH = 64


def _meta_probe(cfg: ClassifyConfig, num_classes: int, in_chans: int) -> tuple[torch.nn.Module, int, int]:
    """(a probe of the model on the meta device, the model's depth in blocks, its parameter count)."""

    def built(config: ClassifyConfig) -> torch.nn.Module:
        with torch.device("meta"):
            return build_model(config, num_classes, in_chans)

    def count(model: torch.nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    depth = cfg.model_kwargs.get("depth")
    if isinstance(depth, int) and depth > PROBE_MAX_DEPTH:
        try:
            one, two = (built(dataclasses.replace(cfg, model_kwargs={**cfg.model_kwargs, "depth": d})) for d in (1, 2))
        except InputError:  # a spec that names every layer does not build at depth 1: count the real one
            pass
        else:  # every block of a ViT has the same parameters: the rest is the stem and the head
            per_block = count(two) - count(one)
            return two, depth, count(one) + (depth - 1) * per_block
    probe = built(cfg)
    return probe, len(list(getattr(probe, "blocks", []) or [])), count(probe)


class FinalNormTokens:
    """The output of ``model.norm`` (the tokens the report's "after the final norm" rows measure) of the last training
    forward pass, kept with its graph for a penalty on the geometry; evaluation passes (no grad) are not kept."""

    def __init__(self, model: torch.nn.Module) -> None:
        norm = getattr(model, "norm", None)
        if not isinstance(norm, torch.nn.Module) or isinstance(norm, torch.nn.Identity):
            raise ConfigError(
                f"--within-seq-penalty needs a model with a final norm over its tokens; {type(model).__name__} has "
                "none; allowed: 0 for this model"
            )
        self._tokens: torch.Tensor | None = None
        norm.register_forward_hook(self._keep)

    def _keep(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if module.training and torch.is_grad_enabled():
            self._tokens = output

    def pop(self) -> torch.Tensor:
        tokens, self._tokens = self._tokens, None
        if tokens is None or tokens.ndim != 3:
            raise RuntimeError("the final norm gave no (B, T, D) tokens in this training step")
        return tokens


def _loss_fn(cfg: ClassifyConfig):
    from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    if cfg.bce:
        return BinaryCrossEntropy(smoothing=cfg.smoothing if not (cfg.mixup or cfg.cutmix) else 0.0)
    if cfg.mixup or cfg.cutmix:
        return SoftTargetCrossEntropy()
    if cfg.smoothing:
        return LabelSmoothingCrossEntropy(cfg.smoothing)
    return torch.nn.CrossEntropyLoss()


def collate_images(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, labels) of a micro-batch's (image, label) items."""
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def _param_groups(cfg: ClassifyConfig):
    """None (timm's own weight-decay groups), or with ``mix_lr_scale`` != 1 those groups plus one for the mix
    heads' (a, b) at lr x the scale (timm's schedulers honour a group's ``lr_scale``), without weight decay."""
    if cfg.mix_lr_scale == 1.0:
        return None

    def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
        from timm.optim import param_groups_weight_decay

        mix = [p for name, p in model.named_parameters() if name.endswith(("mix_a", "mix_b"))]
        if not mix:
            return param_groups_weight_decay(model, cfg.weight_decay)
        ids = {id(p) for p in mix}
        plain = param_groups_weight_decay(model, cfg.weight_decay)
        for group in plain:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        return [*plain, {"params": mix, "weight_decay": 0.0, "lr_scale": cfg.mix_lr_scale}]

    return groups


def train_classify(
    cfg: ClassifyConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    stop_at_step: int | None = None,
    preset: str | None = None,
) -> dict[str, Any]:
    """Train (or resume) a classification run into ``run_dir``; returns the final metrics.

    Args:
        cfg: the resolved config (written to config.json).
        run_dir: the run directory.
        resume: continue from the run directory's latest checkpoint (its config.json must match ``cfg``).
        preset: the preset name the config came from, recorded in config.json (``--resume`` checks it).
        stop_at_step: stop after this many steps without finishing, as if the process were killed (for testing
            resume); checkpoints written so far stay.
    """
    validate_config(cfg)  # before anything is written
    run = RunDir(run_dir)
    dist_ = setup_distributed(cfg.device)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    micro_batch, accum_steps = _micro_batch(cfg, dist_.world_size)
    data = build_image_data(
        cfg.dataset,
        cfg.data_root,
        cfg.img_size,
        download=cfg.download,
        three_augment=cfg.three_augment,
        color_jitter=cfg.color_jitter,
        hflip=cfg.hflip,
        augment=cfg.augment,
    )
    train_set = (
        data.train if cfg.train_subset is None else Subset(data.train, range(min(cfg.train_subset, len(data.train))))
    )
    eval_set = data.eval if cfg.eval_subset is None else Subset(data.eval, range(min(cfg.eval_subset, len(data.eval))))
    fit_set = (
        None
        if cfg.fit_subset is None
        else fit_images(cfg.dataset, cfg.data_root, cfg.img_size, cfg.fit_subset, cfg.train_subset)
    )

    check_training_fits(cfg, data.num_classes, data.in_chans, dist_.device.type, dist_.world_size)
    seed_everything(cfg.seed)  # the same initial weights on every rank
    model = build_model(cfg, data.num_classes, data.in_chans).to(dist_.device)
    if dist_.rank:  # each rank its own drop-path masks and Mixup draws (timm's and DINO's seed + rank; its transforms:
        seed_everything(cfg.seed + dist_.rank)  # step_loader); rank 0 keeps the stream of a one-process run
    num_params = sum(p.numel() for p in model.parameters())

    from timm.data import Mixup
    from timm.optim import create_optimizer_v2
    from timm.scheduler import CosineLRScheduler
    from timm.utils import ModelEmaV3

    optimizer = create_optimizer_v2(
        model, opt=cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, param_group_fn=_param_groups(cfg)
    )
    sampler = GlobalBatchSampler(
        len(train_set), micro_batch, accum_steps, dist_.rank, dist_.world_size, cfg.seed, repeats=cfg.aug_repeats
    )
    total_steps = max(1, math.ceil(cfg.epochs * sampler.steps_per_epoch))
    warmup_steps = min(total_steps - 1, round(cfg.warmup_epochs * sampler.steps_per_epoch))
    cosine_log = logging.getLogger("timm.scheduler.cosine_lr")
    level = cosine_log.level
    cosine_log.setLevel(logging.ERROR)  # a one-step cosine (a run that ends right after warm-up) is what was asked
    try:
        scheduler = CosineLRScheduler(
            optimizer,
            t_initial=total_steps - warmup_steps,  # with warmup_prefix the cosine starts after warm-up, ends at the end
            lr_min=cfg.min_lr,
            warmup_t=warmup_steps,
            warmup_lr_init=cfg.min_lr,
            warmup_prefix=True,
            t_in_epochs=False,
        )
    finally:
        cosine_log.setLevel(level)
    mixup = None
    if cfg.mixup or cfg.cutmix:
        mixup = Mixup(
            mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.smoothing, num_classes=data.num_classes
        )
    ema = ModelEmaV3(model, decay=cfg.ema_decay) if cfg.ema_decay > 0 else None
    extra = {"ema": ema.module} if ema is not None else {}
    loss_fn = _loss_fn(cfg)

    precision = run_precision(run, cfg.amp, dist_, resume)
    start_step = start_or_resume(
        run,
        "classify",
        dataclasses.asdict(cfg),
        dist_,
        model,
        optimizer,
        resume=resume,
        extra_models=extra,
        config_type=ClassifyConfig,
        extra_record={
            "precision": precision.record(),
            "preset": preset,
            "num_params": num_params,
            "laplacian_masks": vit_laplacian_masks(model),
            "head_kinds": vit_head_kinds(model),
            "num_classes": data.num_classes,
            "model": model_spec(cfg, data.num_classes, data.in_chans),
            "in_chans": data.in_chans,
            "steps": total_steps,
        },
    )
    if cfg.checkpoint_at_start and start_step == 0 and latest_checkpoint(run) is None:  # the weights as built
        save_checkpoint(run, 0, dist_, model, optimizer, {"epoch": 0.0}, extra, keep=cfg.keep_checkpoints)
    train_model, forward_model = wrap_for_training(model, dist_, cfg.compile)
    final_tokens = FinalNormTokens(model) if cfg.within_seq_penalty else None  # none at 0: the run as before

    steps_per_eval = max(1, round(cfg.eval_every_epochs * sampler.steps_per_epoch))
    clock = StepClock(total_steps, start_step, "train", main=dist_.is_main, stop_at_step=stop_at_step)
    progress = clock.progress
    pin = dist_.device.type == "cuda"
    batches = step_loader(train_set, sampler, start_step, collate_images, num_workers=cfg.num_workers, pin_memory=pin)
    last_eval: dict[str, float] = {}
    model.train()
    step = start_step
    with StopRequests(active=not dist_.enabled) as stop:
        while step < total_steps:
            if not clock.begin(step):
                return {"step": step, "stopped": True}
            step, micro_batches = next(batches)
            loss_sum, seen = torch.zeros((), device=dist_.device), 0
            fraction_sum = torch.zeros((), device=dist_.device)
            for a, (images, labels) in enumerate(micro_batches):
                images, labels = images.to(dist_.device, non_blocking=True), labels.to(dist_.device, non_blocking=True)
                if mixup is not None:
                    images, labels = mixup(images, labels)
                with grad_sync(train_model, dist_, last=a == len(micro_batches) - 1):
                    with torch.autocast(dist_.device.type, dtype=torch.bfloat16, enabled=precision.autocast):
                        loss = loss_fn(forward_model(images), labels)
                    # the logged loss stays the task's; the optional penalty only joins the gradient
                    objective = loss + cfg.mix_penalty * decisiveness_penalty(model) if cfg.mix_penalty else loss
                    if final_tokens is not None:  # the intervention: the report's fraction, on this batch
                        fraction = within_sequence_fraction(final_tokens.pop())
                        objective = objective + cfg.within_seq_penalty * fraction
                        fraction_sum += fraction.detach()
                    (objective / len(micro_batches)).backward()
                loss_sum += loss.detach()
                seen += len(labels) * dist_.world_size
            mean_loss = dist_.all_reduce_sum(loss_sum / len(micro_batches)).item() / dist_.world_size
            hint = "lower --lr" if cfg.clip_grad else "lower --lr or set --clip-grad 1.0"
            check_finite_loss(mean_loss, step, run, hint, progress)
            if cfg.clip_grad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
            optimizer_step([optimizer], step, run, hint, progress)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step_update(step + 1)
            if ema is not None:
                ema.update(model, step=step + 1)
            step += 1
            clock.end(seen)
            lr = optimizer.param_groups[0]["lr"]
            if clock.due(step, cfg.log_every):
                _, rate = clock.lap()
                progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", img_s=f"{rate:.0f}")
                if dist_.is_main:
                    run.log(
                        {
                            "step": step,
                            "epoch": step / sampler.steps_per_epoch,
                            "loss": mean_loss,
                            "lr": lr,
                            "images_per_s": rate,
                            # the manipulation check as it trains: this step's batch fraction
                            **(
                                {"within_seq_fraction": fraction_sum.item() / len(micro_batches)}
                                if final_tokens
                                else {}
                            ),
                        }
                    )
            if clock.due(step, steps_per_eval):
                eval_batch = micro_batch * 2
                last_eval = evaluate_classifier(model, eval_set, dist_, eval_batch, precision.autocast, cfg.num_workers)
                if ema is not None:
                    ema_eval = evaluate_classifier(
                        ema.module, eval_set, dist_, eval_batch, precision.autocast, cfg.num_workers
                    )
                    last_eval.update({f"ema_{k}": v for k, v in ema_eval.items()})
                if fit_set is not None:
                    last_eval.update(
                        evaluate_fit(model, fit_set, dist_, eval_batch, precision.autocast, cfg.num_workers)
                    )
                if dist_.is_main:
                    run.log({"step": step, "epoch": step / sampler.steps_per_epoch, **last_eval})
                    progress.write(f"step {step}: " + ", ".join(f"{k} {v:.2f}" for k, v in last_eval.items()))
            if clock.due(step, cfg.checkpoint_every, steps_per_eval) or stop.requested:
                save_checkpoint(
                    run,
                    step,
                    dist_,
                    model,
                    optimizer,
                    {"epoch": step / sampler.steps_per_epoch},
                    extra,
                    keep=cfg.keep_checkpoints,
                )
            stop.stop_if_requested(step, run.path, progress)
    clock.close()
    return {"step": step, "num_params": num_params, **last_eval}
