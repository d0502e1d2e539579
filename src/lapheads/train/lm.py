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
from pathlib import Path
from typing import Any

import torch

from lapheads.config import (
    validate_config,
)
from lapheads.data.text import (
    TokenBatches,
)
from lapheads.data.tokenizers import Tokenizer
from lapheads.distributed import StopRequests, setup_distributed
from lapheads.errors import InputError
from lapheads.evals.lm import evaluate_bpb
from lapheads.hardware import activation_bytes, check_fits, training_bytes
from lapheads.models.gpt import GPT
from lapheads.runs import RunDir, model_record
from lapheads.runs.checkpoints import save_checkpoint
from lapheads.runs.layout import METRICS_FILE, SAMPLES_FILE
from lapheads.train.configs.lm import (
    LMConfig,
    build_gpt,
    gpt_config,
    text_source,
)
from lapheads.train.optimizers import (
    build_optimizers,
    lr_multiplier,
    muon_momentum,
    muon_weight_decay,
    set_learning_rates,
)
from lapheads.train.runtime import (
    StepClock,
    check_finite_loss,
    grad_sync,
    optimizer_step,
    run_precision,
    seed_everything,
    start_or_resume,
    wrap_for_training,
)

__all__ = ["train_lm"]


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
    model = build_gpt(cfg, tokenizer.vocab_size, tokenizer.bos_id).to(dist_.device)
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
