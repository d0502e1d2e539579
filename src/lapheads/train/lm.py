"""Language-model pre-training with Laplacian heads, after nanochat's ``base_train.py``.

Design choices:

* **Optimizers as nanochat** (:mod:`lapheads.train.optimizers`, shared with the chat stages): ``torch.optim.Muon``
  (Nesterov, momentum warmed from 0.85 to 0.95 over 300 steps, no weight decay) for every matrix inside the blocks;
  AdamW (betas 0.8/0.95, eps 1e-10) for the embedding and the head, their learning rates scaled by (width/768)^-0.5.
* **Schedule**: linear warm-up (``warmup_ratio``), constant, then a linear warm-down over the last
  ``warmdown_ratio`` of the steps to ``final_lr_frac``; steps = ``num_iterations`` or, when -1, tokens =
  ``target_param_data_ratio`` x parameters (Chinchilla-style) divided by the batch.
* **The batch is in tokens**: ``total_batch_size`` tokens per optimizer step = micro_batch x sequence_len x world
  size x accumulation steps (derived, and checked to divide).
* **Data**: token shards prepared once per (dataset, tokenizer) under DATA_ROOT/tokens/ (``TextSource`` in
  :mod:`lapheads.data.text`, which ``lapheads data prepare`` calls too), and batches that are a
  pure function of (seed, step) (``TokenBatches``), so DDP and resume need no loader state.
* **Evaluation** in bits per byte on the validation split (special tokens excluded, as nanochat), and samples from
  a prompt, both logged to the run directory (metrics.jsonl, samples.jsonl).
* **Nothing already written is lost**: a non-finite loss stops the run before the optimizer step, naming the step;
  checkpoints are atomic. The tokenizer is copied into the run directory, so evals use exactly it.
"""

from __future__ import annotations

import dataclasses
import json
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
    validate_config,
)
from lapheads.data.text import (
    TEXT_DATASETS,
    TOKENIZER_TRAIN_CHARS,
    TextSource,
    TokenBatches,
)
from lapheads.data.tokenizers import KINDS, Tokenizer
from lapheads.distributed import StopRequests, setup_distributed
from lapheads.errors import InputError
from lapheads.evals.lm import evaluate_bpb
from lapheads.hardware import activation_bytes, check_fits, training_bytes
from lapheads.models.gpt import ARCHS, GPT, GPTConfig
from lapheads.runs import RunDir, model_record
from lapheads.runs.layout import CONFIG_FILE, METRICS_FILE, SAMPLES_FILE
from lapheads.train.optimizers import (
    build_optimizers,
    lr_multiplier,
    muon_momentum,
    muon_weight_decay,
    set_learning_rates,
)
from lapheads.train.runtime import (
    RunConfig,
    StepClock,
    check_finite_loss,
    grad_sync,
    optimizer_step,
    run_precision,
    save_checkpoint,
    seed_everything,
    start_or_resume,
    wrap_for_training,
)

__all__ = ["LMConfig", "build_gpt", "text_source", "train_lm"]


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


def gpt_config(cfg: LMConfig, vocab_size: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab_size, **{name: getattr(cfg, name) for name in MODEL_FIELDS})


def build_gpt(cfg: LMConfig, vocab_size: int) -> GPT:
    return GPT(gpt_config(cfg, vocab_size))


def _check_training_fits(cfg: LMConfig, vocab_size: int, device: str) -> None:
    """Refuse, before the model is built, a step that cannot fit, by a lower bound (lapheads.hardware.training_bytes):
    weights, gradients, optimizer state, one micro-batch's activations and logits (and, on the CPU, where attention
    is not fused, its matrices)."""
    model = gpt_config(cfg, vocab_size)
    model.validate()
    need = training_bytes(model.estimated_params(), cfg.micro_batch, cfg.sequence_len, model.n_embd, model.depth,
                          model.n_head, model.padded_vocab_size, attention_maps=device == "cpu",
                          activation_bytes=activation_bytes(cfg.amp, device))  # fmt: skip
    check_fits(f"training GPT(depth={model.depth}, width={model.n_embd}) on micro-batches of {cfg.micro_batch} x "
               f"{cfg.sequence_len} tokens", need + model.estimated_bytes(), device)  # fmt: skip


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


@torch.no_grad()
def sample(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    device: torch.device,
) -> str:
    """One continuation of ``prompt`` (after BOS), decoded."""
    was_training = model.training
    model.eval()
    ids = torch.tensor([tokenizer.encode(prompt, bos=True)], device=device)
    room = model.config.sequence_len - ids.shape[1]
    out = model.generate(
        ids,
        max(0, min(max_new_tokens, room)),
        temperature=temperature,
        top_k=top_k,
        generator=torch.Generator(device).manual_seed(seed),
    )
    model.train(was_training)
    return tokenizer.decode(out[0, 1:].tolist())


def _accum_steps(cfg: LMConfig, world_size: int) -> int:
    per_pass = cfg.micro_batch * cfg.sequence_len * world_size
    if cfg.total_batch_size % per_pass:
        raise InputError(
            f"total_batch_size={cfg.total_batch_size} tokens is not a multiple of micro_batch x "
            f"sequence_len x world_size = {per_pass}; allowed: a multiple of {per_pass}"
        )
    return cfg.total_batch_size // per_pass


def train_lm(
    cfg: LMConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    stop_at_step: int | None = None,
    preset: str | None = None,
) -> dict[str, Any]:
    """Train (or resume) a language-model run into ``run_dir``; returns the final metrics.

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
    accum_steps = _accum_steps(cfg, dist_.world_size)
    if dist_.is_main:
        tokenizer, shards = text_source(cfg).prepare()
    dist_.barrier()
    if not dist_.is_main:
        tokenizer, shards = text_source(cfg).prepare()  # prepared by rank 0: loads from the cache
    token_bytes = tokenizer.token_bytes()

    _check_training_fits(cfg, tokenizer.vocab_size, dist_.device.type)
    seed_everything(cfg.seed)
    model = build_gpt(cfg, tokenizer.vocab_size).to(dist_.device)
    num_params = model.num_params()
    batches = TokenBatches(
        shards.train, cfg.sequence_len, cfg.micro_batch, accum_steps, dist_.rank, dist_.world_size, cfg.seed
    )
    total_steps = (
        cfg.num_iterations
        if cfg.num_iterations > 0
        else max(1, round(cfg.target_param_data_ratio * num_params / cfg.total_batch_size))
    )
    optimizers = build_optimizers(model, cfg, dist_)

    precision = run_precision(run, cfg.amp, dist_, resume)
    start_step = start_or_resume(
        run,
        "lm",
        dataclasses.asdict(cfg),
        dist_,
        model,
        optimizers,
        resume=resume,
        logs=(METRICS_FILE, SAMPLES_FILE),
        config_type=LMConfig,
        extra_record={
            "precision": precision.record(),
            "preset": preset,
            "num_params": num_params,
            "laplacian_masks": model.laplacian_masks(),
            "head_kinds": model.head_kinds(),
            "vocab_size": tokenizer.vocab_size,
            "n_embd": model.config.n_embd,
            "n_head": model.config.n_head,
            "steps": total_steps,
            "model": model_record("gpt", model.constructor_kwargs()),
            "tokens": str(text_source(cfg).tokens_dir),
            "accum_steps": accum_steps,
            "train_tokens": len(shards.train),
        },
    )
    if not resume and dist_.is_main:
        tokenizer.save(run.tokenizer_dir)
    train_model, forward_model = wrap_for_training(model, dist_, cfg.compile)

    def evaluate(step: int) -> dict[str, float]:
        bpb = evaluate_bpb(
            model,
            shards.val,
            token_bytes,
            dist_,
            seq_len=cfg.sequence_len,
            max_tokens=cfg.eval_tokens,
            batch_size=cfg.micro_batch,
            amp=precision.autocast,
        )
        if dist_.is_main:
            run.log({"step": step, "val_bpb": bpb})
            text = sample(
                model,
                tokenizer,
                cfg.sample_prompt,
                cfg.sample_tokens,
                cfg.sample_temperature,
                cfg.sample_top_k,
                cfg.seed + step,
                dist_.device,
            )
            with open(run.samples_file, "a") as f:
                f.write(json.dumps({"step": step, "prompt": cfg.sample_prompt, "text": text}) + "\n")
            progress.write(f"step {step}: val_bpb {bpb:.4f}\n--- sample ---\n{text}\n--------------")
        return {"val_bpb": bpb}

    clock = StepClock(total_steps, start_step, "train lm", main=dist_.is_main, stop_at_step=stop_at_step)
    progress = clock.progress
    warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total_steps)
    hint = "lower --matrix-lr / --embedding-lr / --unembedding-lr"
    last_eval: dict[str, float] = {}
    model.train()
    step = start_step
    with StopRequests(active=not dist_.enabled) as stop:
        while step < total_steps:
            if not clock.begin(step):
                return {"step": step, "stopped": True}
            micro_batches = batches.step(step)
            loss_sum = torch.zeros((), device=dist_.device)
            for a, (x, y) in enumerate(micro_batches):
                x, y = x.to(dist_.device, non_blocking=True), y.to(dist_.device, non_blocking=True)
                with grad_sync(train_model, dist_, last=a == len(micro_batches) - 1):
                    with torch.autocast(dist_.device.type, dtype=torch.bfloat16, enabled=precision.autocast):
                        loss = forward_model(x, y)
                    (loss / len(micro_batches)).backward()
                loss_sum += loss.detach()
            mean_loss = dist_.all_reduce_sum(loss_sum / len(micro_batches)).item() / dist_.world_size
            check_finite_loss(mean_loss, step, run, hint, progress)
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            multiplier = lr_multiplier(step, total_steps, cfg.warmdown_ratio, warmup_steps, cfg.final_lr_frac)
            set_learning_rates(optimizers, multiplier)
            for group in optimizers["muon"].param_groups:
                group["momentum"] = muon_momentum(
                    step,
                    total_steps,
                    cfg.muon_momentum_start,
                    cfg.muon_momentum_end,
                    cfg.muon_momentum_warmup,
                    cfg.muon_momentum_final,
                    cfg.warmdown_ratio,
                )
                group["weight_decay"] = muon_weight_decay(
                    step, total_steps, cfg.muon_weight_decay, cfg.muon_weight_decay_schedule
                )
            optimizer_step(list(optimizers.values()), step, run, hint, progress)
            model.zero_grad(set_to_none=True)
            step += 1
            clock.end(cfg.total_batch_size)
            if clock.due(step, cfg.log_every):
                _, rate = clock.lap()
                progress.set_postfix(loss=f"{mean_loss:.4f}", lrm=f"{multiplier:.2f}", tok_s=f"{rate:.0f}")
                if dist_.is_main:
                    run.log(
                        {
                            "step": step,
                            "loss": mean_loss,
                            "lr_multiplier": multiplier,
                            "tokens_per_s": rate,
                            "tokens": step * cfg.total_batch_size,
                        }
                    )
            if clock.due(step, cfg.eval_every):
                last_eval = evaluate(step)
            if clock.due(step, cfg.checkpoint_every, cfg.eval_every) or stop.requested:
                save_checkpoint(
                    run,
                    step,
                    dist_,
                    model,
                    optimizers,
                    {"tokens": step * cfg.total_batch_size},
                    keep=cfg.keep_checkpoints,
                )
            stop.stop_if_requested(step, run.path, progress)
    clock.close()
    if cfg.eval_whole_split:  # once, at the end: the periodic evaluations read only the first eval_tokens
        whole = evaluate_bpb(
            model,
            shards.val,
            token_bytes,
            dist_,
            seq_len=cfg.sequence_len,
            max_tokens=len(shards.val),
            batch_size=cfg.micro_batch,
            amp=precision.autocast,
        )
        if dist_.is_main:
            run.log({"step": step, "val_bpb_whole": whole, "val_tokens": len(shards.val)})
        last_eval["val_bpb_whole"] = whole
    return {"step": step, "num_params": num_params, **last_eval}
