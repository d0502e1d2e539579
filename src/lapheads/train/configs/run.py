"""The options every training run has (:class:`RunConfig`), which each task's config extends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lapheads.config import NON_NEGATIVE, POSITIVE, Domain, one_of, option
from lapheads.core.vocabulary import HEAD_SPEC

__all__ = ["RunConfig", "RESUME_FREE"]


@dataclass
class RunConfig:
    """The options every training run has; ClassifyConfig, LMConfig and DINOConfig extend it."""

    description: str = option("", "what this recipe is (free text, shown in reports)")
    laplacian_heads: str = option(
        "0",
        "Laplacian heads: k trailing heads per layer, one k per layer, or head kinds",
        HEAD_SPEC,
    )
    seed: int = option(
        0,
        "seed of the weights and the data order (arms with the same seed are paired)",
        Domain("0 <= seed < 2^63", lambda v: 0 <= v < 2**63),  # torch.manual_seed's range
    )
    device: str = option("auto", "where to train (auto = cuda when available)", one_of("auto", "cpu", "cuda"))
    amp: bool | Literal["auto"] = option(
        "auto", "bf16 autocast: auto = where the hardware computes bf16 natively and faster (lapheads.hardware)"
    )
    compile: bool = option(False, "torch.compile the model")
    log_every: int = option(10, "steps between metrics.jsonl records", POSITIVE)
    checkpoint_every: int = option(0, "steps between extra checkpoints (0: only at evals and the end)", NON_NEGATIVE)
    keep_checkpoints: int = option(2, "newest checkpoints kept (0: all, e.g. for geometry over training)", NON_NEGATIVE)
    log: str = option(
        "",
        "mirror metrics.jsonl to trackers: tensorboard and/or wandb, comma list (empty: none)",
        Domain(
            "empty or a comma list of tensorboard, wandb",
            lambda v: all(t.strip() in ("tensorboard", "wandb") for t in v.split(",") if t.strip()),
        ),
    )


#: fields a --resume may change: they do not touch the trajectory (where metrics are mirrored; a preset's wording;
#: how many processes load the batches, each seeded by its step)
RESUME_FREE = ("log", "description", "num_workers")
