"""A language-model run's config, the GPT it describes and its token source. No training code: presets, ``--help``
and a sweep's dry run import this, never the trainer."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lapheads.config import (
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    RATE,
    ConfigError,
    Domain,
    at_least,
    greater,
    one_of,
    option,
)
from lapheads.data.text import (
    TEXT_DATASETS,
    TOKENIZER_TRAIN_CHARS,
    TextSource,
)
from lapheads.data.tokenizers import KINDS
from lapheads.models.gpt import ARCHS, GPT, GPTConfig
from lapheads.runs import model_record
from lapheads.runs.layout import CONFIG_FILE
from lapheads.train.configs.run import RunConfig

__all__ = ["LMConfig", "MODEL_FIELDS", "gpt_config", "build_gpt", "recorded_model", "check_model", "text_source"]


@dataclass
class LMConfig(RunConfig):
    """Every option of a language-model run (``lapheads train lm --key value`` sets any of them); the shared run
    options come from RunConfig."""

    # data and tokenizer
    dataset: str = option("shakespeare", "the text corpus", one_of(*TEXT_DATASETS))
    data_root: str = option("data", "folder for corpora and token shards (created when missing; not a file)")
    download_shards: int = option(0, "fineweb-edu: download the first N parquet shards when missing", NON_NEGATIVE)
    max_shards: int | None = option(None, "fineweb-edu: tokenise at most N shards", POSITIVE)
    tokenizer: str = option("char", "characters, a BPE trained on the corpus, or GPT-2's BPE", one_of(*KINDS))
    tokenizer_vocab: int = option(4096, "BPE vocabulary size", at_least(256))
    tokenizer_train_chars: int = option(
        TOKENIZER_TRAIN_CHARS, "characters of training text to fit the BPE on", POSITIVE
    )
    # model (depth is the dial; see lapheads.models.gpt)
    depth: int = option(4, "number of blocks; the width is depth x aspect ratio", POSITIVE)
    aspect_ratio: int = option(64, "width per block of depth", POSITIVE)
    head_dim: int = option(64, "target head dimension", POSITIVE)
    n_kv_head: int | None = option(None, "key/value heads (GQA); none = as many as query heads", POSITIVE)
    sequence_len: int = option(256, "tokens per training sequence", POSITIVE)
    softcap: float = option(15.0, "logit soft cap (0: off)", NON_NEGATIVE)
    arch: str = option("nanochat-2025", "architecture family; every option below left unset follows it", one_of(*ARCHS))
    use_ve: bool | None = option(None, "value embeddings with a per-head gate on alternating layers")
    use_resid_lambdas: bool | None = option(None, "a learned residual scale before each block")
    use_x0: bool | None = option(None, "a learned share of the embedding re-injected before each block")
    use_smear: bool | None = option(None, "the previous token's embedding mixed in by a learned gate")
    use_backout: bool | None = option(None, "a learned share of the mid-depth stream subtracted before the head")
    window_pattern: str | None = option(
        None,
        "S (sliding window) / L (full) per layer, tiled; the last layer is L",
        Domain("letters S and L, e.g. SSSL", lambda v: bool(re.fullmatch("[SLsl]+", v))),
    )
    short_window: int | None = option(
        None, "keys before a query an S layer sees (none: sequence_len / 4, to 128s)", POSITIVE
    )
    qk_scale: float | None = option(None, "factor on q and k after the QK-norm", POSITIVE)
    rope_base: float | None = option(None, "rotary base frequency", greater(1))
    pad_vocab_size_to: int | None = option(None, "round the embedding rows up to a multiple of this", POSITIVE)
    document_masking: bool = option(
        False,
        "each document of a packed row attends only to itself (a document starts at each BOS token; FlexAttention "
        "or T x W bands, no T x T mask where they run); evaluations of the run keep it",
    )
    # optimisation
    total_batch_size: int = option(8192, "tokens per optimizer step, over all processes", POSITIVE)
    micro_batch: int = option(32, "sequences per forward pass per process", POSITIVE)
    num_iterations: int = option(
        -1, "optimizer steps; -1 = from --target-param-data-ratio", Domain("-1 or > 0", lambda v: v == -1 or v > 0)
    )
    target_param_data_ratio: float = option(20.0, "training tokens per parameter when --num-iterations is -1", POSITIVE)
    embedding_lr: float = option(0.2, "AdamW learning rate of the embedding (scaled by (width/768)^-0.5)", POSITIVE)
    unembedding_lr: float = option(0.004, "AdamW learning rate of the LM head (scaled likewise)", POSITIVE)
    matrix_lr: float = option(0.02, "Muon learning rate of the block matrices", POSITIVE)
    scalar_lr: float = option(0.5, "AdamW learning rate of the x0 lambdas (residual lambdas: x 0.01)", POSITIVE)
    weight_decay: float = option(0.0, "AdamW weight decay", NON_NEGATIVE)
    muon_weight_decay: float = option(0.0, "Muon decoupled weight decay of the block matrices", NON_NEGATIVE)
    muon_weight_decay_schedule: str = option(
        "constant", "constant, or cosine from muon_weight_decay to 0", one_of("constant", "cosine")
    )
    adam_beta1: float = option(0.8, "AdamW beta1", RATE)
    adam_beta2: float = option(0.95, "AdamW beta2", RATE)
    warmup_ratio: float = option(0.0, "fraction of the steps in linear warm-up", FRACTION)
    warmup_steps: int | None = option(None, "linear warm-up in steps (overrides --warmup-ratio)", NON_NEGATIVE)
    warmdown_ratio: float = option(0.2, "fraction of the steps in the final linear warm-down", FRACTION)
    final_lr_frac: float = option(0.0, "learning rate at the end, as a fraction of the peak", FRACTION)
    muon_momentum_start: float = option(0.85, "Muon momentum at step 0", RATE)
    muon_momentum_end: float = option(0.95, "Muon momentum after the warm-up", RATE)
    muon_momentum_warmup: int = option(300, "steps to move Muon's momentum from start to end", NON_NEGATIVE)
    muon_momentum_final: float | None = option(
        None, "Muon momentum reached at the end of the warm-down (none: stays at end)", RATE
    )
    grad_clip: float = option(1.0, "gradient-norm clip (0: off)", NON_NEGATIVE)
    # runtime
    eval_every: int = option(250, "steps between validation bpb, samples and checkpoints", POSITIVE)
    eval_tokens: int = option(524_288, "validation tokens per evaluation", POSITIVE)
    eval_whole_split: bool = option(
        False, "after the last step, bits per byte on the whole held-out split as well (logged as val_bpb_whole)"
    )
    sample_prompt: str = option("", "prompt of the sample written at each evaluation")
    sample_tokens: int = option(200, "tokens per sample", NON_NEGATIVE)
    sample_temperature: float = option(0.8, "sampling temperature (0: greedy)", NON_NEGATIVE)
    sample_top_k: int = option(50, "sample from the top k tokens (0: all)", NON_NEGATIVE)

    def check(self) -> None:
        """Rules that tie fields together; ``validate_config`` calls it after the per-field checks."""
        if Path(self.data_root).is_file():
            raise ConfigError(f"--data-root {self.data_root!r} is a file; allowed: a directory (created if missing)")
        if self.warmup_ratio + self.warmdown_ratio > 1:
            raise ConfigError(
                f"--warmup-ratio {self.warmup_ratio} + --warmdown-ratio {self.warmdown_ratio} > 1; allowed: a sum <= 1"
            )
        per_pass = self.micro_batch * self.sequence_len
        if self.total_batch_size % per_pass:
            raise ConfigError(
                f"--total-batch-size {self.total_batch_size} is not a multiple of micro_batch x "
                f"sequence_len = {per_pass}; allowed: a multiple of {per_pass}"
            )


#: LMConfig fields that are GPTConfig fields of the same name and meaning
MODEL_FIELDS = (
    "depth",
    "sequence_len",
    "aspect_ratio",
    "head_dim",
    "n_kv_head",
    "laplacian_heads",
    "softcap",
    "arch",
    "use_ve",
    "use_resid_lambdas",
    "use_x0",
    "use_smear",
    "use_backout",
    "window_pattern",
    "short_window",
    "qk_scale",
    "rope_base",
    "pad_vocab_size_to",
)


def gpt_config(cfg: LMConfig, vocab_size: int, bos_id: int | None = None) -> GPTConfig:
    """The GPT ``cfg`` describes; with ``--document-masking`` its documents start at ``bos_id`` (the tokenizer's)."""
    document_bos = bos_id if cfg.document_masking else None
    return GPTConfig(vocab_size=vocab_size, document_bos=document_bos, **{n: getattr(cfg, n) for n in MODEL_FIELDS})


def build_gpt(cfg: LMConfig, vocab_size: int, bos_id: int | None = None) -> GPT:
    return GPT(gpt_config(cfg, vocab_size, bos_id))


def recorded_model(record: dict[str, Any]) -> dict[str, Any]:
    """config.json's ``"model"`` and ``"tokens"`` for a run written before lapheads recorded them (``lapheads
    upgrade``)."""
    from lapheads.config import config_from_dict

    cfg = config_from_dict(LMConfig, record["config"], source=CONFIG_FILE)
    with torch.device("meta"):
        model = build_gpt(cfg, record["vocab_size"])
    return {"model": model_record("gpt", model.constructor_kwargs()), "tokens": str(text_source(cfg).tokens_dir)}


def check_model(cfg: LMConfig) -> None:
    """Build the GPT once on the meta device (d20 would not be cheap otherwise): a head spec that does not fit fails
    in one line."""
    with torch.device("meta"):
        build_gpt(cfg, 256)


def text_source(cfg: LMConfig) -> TextSource:
    """The corpus and tokenizer ``cfg`` trains on (``TextSource.prepare`` builds them once)."""
    return TextSource(
        cfg.dataset,
        cfg.tokenizer,
        cfg.data_root,
        cfg.tokenizer_vocab,
        cfg.tokenizer_train_chars,
        cfg.max_shards,
        cfg.download_shards,
    )
