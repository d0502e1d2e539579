"""nanochat's optimizers and schedules, in one place for pre-training (:mod:`lapheads.train.lm`) and mid-training /
SFT (:mod:`lapheads.train.chat`).

Design choices:

* **The split**: Muon (``ShardedMuon``: ``torch.optim.Muon``, Nesterov, each DDP rank orthogonalising its share) for
  every matrix inside the blocks; AdamW (eps 1e-10) for the rest, one group per kind of parameter with nanochat's
  learning rate for it (embedding and head scaled by (width/768)^-0.5).
* **Every group keeps its** ``initial_lr``: a schedule is a multiplier of it (:func:`set_learning_rates`), so a
  resumed run needs no schedule state. SFT's ``init_lr_frac`` scales the initial rates once, at construction.
* **The LR multiplier**: linear warm-up, flat, linear warm-down to ``final_lr_frac`` of the peak (the chat stages:
  no warm-up, down to 0). Muon's momentum is warmed up (and, in the 2026 fork, moved on over the warm-down); its
  weight decay is constant or follows a cosine to 0.
* The options are read off the run's config by name (:class:`OptimizerOptions`), so an lm or chat config serves.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from lapheads.distributed import Distributed
from lapheads.models.gpt import GPT
from lapheads.train.muon import ShardedMuon

__all__ = [
    "OptimizerOptions",
    "build_optimizers",
    "lr_multiplier",
    "muon_momentum",
    "muon_weight_decay",
    "set_learning_rates",
]


class OptimizerOptions(Protocol):
    """The config fields :func:`build_optimizers` reads (LMConfig's and the chat configs' options of these names)."""

    embedding_lr: float
    unembedding_lr: float
    matrix_lr: float
    scalar_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    muon_momentum_end: float
    muon_weight_decay: float


def build_optimizers(
    model: GPT, opts: OptimizerOptions, dist_: Distributed | None = None, lr_scale: float = 1.0
) -> dict[str, torch.optim.Optimizer]:
    """nanochat's split: Muon for the block matrices (value-embedding gates included, as the fork), AdamW for the
    embedding and head (LRs scaled by width) and, in the 2026 family, for value embeddings (half the embedding LR),
    residual lambdas (scalar LR x 0.01), x0 lambdas (scalar LR, beta1 0.96) and the smear/backout scalars (0.2).

    Args:
        model: the GPT to train.
        opts: the run's optimizer options.
        dist_: the process group (Muon's work is split across its ranks); none: one process.
        lr_scale: a factor on every initial learning rate (SFT's ``init_lr_frac``).

    Returns:
        ``{"adamw": ..., "muon": ...}``, every group with its ``initial_lr``.
    """
    scale = (model.config.n_embd / 768) ** -0.5
    groups = [
        dict(params=list(model.lm_head.parameters()), lr=opts.unembedding_lr * scale),
        dict(params=list(model.transformer["wte"].parameters()), lr=opts.embedding_lr * scale),
    ]
    if len(model.value_embeds):
        groups.append(dict(params=list(model.value_embeds.parameters()), lr=opts.embedding_lr * scale * 0.5))
    if model.resid_lambdas is not None:
        groups.append(dict(params=[model.resid_lambdas], lr=opts.scalar_lr * 0.01, weight_decay=0.0))
    if model.x0_lambdas is not None:
        groups.append(dict(params=[model.x0_lambdas], lr=opts.scalar_lr, betas=(0.96, 0.95), weight_decay=0.0))
    gates = [
        p
        for p in (getattr(model.smear_gate, "weight", None), model.smear_lambda, model.backout_lambda)
        if p is not None
    ]
    # mix heads' (a, b) are per-head scalars: AdamW at the scalar LR, no decay; Muon takes the block matrices
    mix = [p for p in model.blocks.parameters() if p.dim() < 2]
    if mix:
        groups.append(dict(params=mix, lr=opts.scalar_lr, weight_decay=0.0))
    if gates:
        groups.append(dict(params=gates, lr=0.2, weight_decay=0.0))
    adamw = torch.optim.AdamW(
        groups, betas=(opts.adam_beta1, opts.adam_beta2), eps=1e-10, weight_decay=opts.weight_decay
    )
    dist_ = dist_ or Distributed()
    muon = ShardedMuon(
        [p for p in model.blocks.parameters() if p.dim() >= 2],
        rank=dist_.rank,
        world_size=dist_.world_size,
        lr=opts.matrix_lr,
        momentum=opts.muon_momentum_end,
        nesterov=True,
        weight_decay=opts.muon_weight_decay,
    )
    for opt in (adamw, muon):
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] = group["lr"] * lr_scale
    return {"adamw": adamw, "muon": muon}


def set_learning_rates(optimizers: dict[str, torch.optim.Optimizer], multiplier: float) -> None:
    """Every group's learning rate = its ``initial_lr`` x ``multiplier`` (the schedule's value at this step)."""
    for opt in optimizers.values():
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier


def lr_multiplier(
    step: int, total: int, warmdown_ratio: float, warmup_steps: int = 0, final_lr_frac: float = 0.0
) -> float:
    """The LR at ``step`` (0-based) of ``total`` as a fraction of the peak: linear warm-up over ``warmup_steps``,
    flat, then linear over the last ``warmdown_ratio`` of the steps down to ``final_lr_frac``."""
    warmdown = round(warmdown_ratio * total)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step <= total - warmdown:
        return 1.0
    progress = (total - step) / warmdown
    return progress + (1 - progress) * final_lr_frac


def muon_momentum(
    step: int,
    total: int,
    start: float,
    end: float,
    warmup: int,
    final: float | None = None,
    warmdown_ratio: float = 0.0,
) -> float:
    """Muon's momentum: from ``start`` to ``end`` over ``warmup`` steps; with ``final``, moved on to it over the LR
    warm-down (the 2026 fork)."""
    frac = min(step / max(warmup, 1), 1.0)
    momentum = (1 - frac) * start + frac * end
    warmdown = round(warmdown_ratio * total)
    if final is not None and warmdown and step >= total - warmdown and step >= warmup:
        progress = (step - (total - warmdown)) / warmdown
        momentum = (1 - progress) * end + progress * final
    return momentum


def muon_weight_decay(step: int, total: int, weight_decay: float, schedule: str) -> float:
    """Muon's decoupled weight decay at ``step``: constant, or (``"cosine"``, the fork) decayed to 0 over training."""
    if schedule == "cosine":
        return weight_decay * 0.5 * (1 + math.cos(math.pi * step / total))
    return weight_decay
