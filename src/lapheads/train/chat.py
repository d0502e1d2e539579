"""The LM stages after pre-training: mid-training and supervised fine-tuning (full or LoRA), after nanochat's
``mid_train.py`` and ``chat_sft.py`` (the versions of the paper's v1 runs) and the authors' ``lora_sft.py``.

Design choices:

* **Start from a run or a nanochat checkpoint**: ``--base RUN_DIR`` (an LM, mid or SFT run of lapheads) or
  ``--nanochat DIR``; the model is rebuilt from what that source recorded and its tokenizer is copied in. The
  Laplacian heads come with the weights: ``--laplacian-heads`` may be repeated but must equal the base's masks.
* **Mid-training** packs the rendered conversations of its mixture into one token stream cut into full sequences
  and trains on every token (as nanochat v1); the LRs are the pre-training ones (``init_lr_frac`` 1), warm-down
  over the last 20%.
* **SFT** trains on padded batches of whole conversations with nanochat's loss mask (assistant tokens only),
  ``examples_per_step`` conversations per step, LRs at ``init_lr_frac`` 0.02 of the pre-training ones decaying
  linearly to 0 (nanochat v1's defaults). Muon for block matrices, AdamW for the rest: pre-training's
  optimizers and schedule (:mod:`lapheads.train.optimizers`).
* **LoRA through peft** (``--lora-rank R``): adapters on ``c_q, c_k, c_v, c_proj, c_fc`` (the authors' rank 16,
  alpha 32, dropout 0.05, AdamW LR 2e-4); the base is frozen, checkpoints hold only adapter weights, the final
  adapters are also written in peft's own format (``RUN_DIR/adapter``), and ``--lora-merge true`` writes a plain
  run directory (``RUN_DIR/merged``) whose model equals the adapted one.
* **Batches are a pure function of (seed, step)**: the mixture is shuffled once with the seed, step s takes the
  next ``examples_per_step`` conversations (SFT) or sequences (mid), and each rank its slice; resume and any world
  size see the same data. Resume, NaN stop, DDP and bad-input one-liners are those of pre-training
  (:mod:`lapheads.train.runtime`).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from lapheads.config import ConfigError, validate_config
from lapheads.data.conversations import conversation_mixture, render_conversation
from lapheads.data.tokenizers import Tokenizer
from lapheads.data.turns import Conversation
from lapheads.distributed import Distributed, StopRequests, setup_distributed
from lapheads.errors import InputError
from lapheads.io import json_loads
from lapheads.models.gpt import GPT
from lapheads.models.lora import LoraAdapters, apply_lora
from lapheads.runs import RunDir, checkpoint_folder, load_gpt_run, load_nanochat_model, model_record
from lapheads.runs.checkpoints import save_checkpoint
from lapheads.runs.layout import STATE_FILE
from lapheads.train.configs.chat import ChatTrainConfig, MidConfig, SFTConfig
from lapheads.train.optimizers import build_optimizers, lr_multiplier, set_learning_rates
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

log = logging.getLogger(__name__)

__all__ = ["merge_lora", "train_mid", "train_sft"]


# ----------------------------------------------------------------------------------------------------------------
# Loading models from run directories


def _load_base(cfg: ChatTrainConfig, device: torch.device) -> tuple[GPT, Tokenizer, dict[str, Any]]:
    """The starting model (train mode), its tokenizer and what to record about it."""
    if cfg.nanochat:
        folder = Path(cfg.nanochat)
        model, tokenizer, meta = load_nanochat_model(folder, cfg.nanochat_step, device, cfg.nanochat_tokenizer or None)
        source = {"nanochat": str(folder), "nanochat_step": meta["step"]}
    else:
        record, model, tokenizer = load_gpt_run(cfg.base, str(device.type))
        source = {"base_run": str(Path(cfg.base).resolve()), "base_task": record["task"]}
    if cfg.laplacian_heads:
        from lapheads.core.heads import parse_heads

        wanted = parse_heads(cfg.laplacian_heads, [model.config.n_head] * model.config.depth)
        if [list(heads.names) for heads in wanted] != model.head_kinds():
            base = model.laplacian_masks() if all(b.attn.heads.plain for b in model.blocks) else model.head_kinds()
            raise ConfigError(
                f"--laplacian-heads {cfg.laplacian_heads!r} differs from the base's heads {base}; allowed: the "
                "base's spec, or leave it out (a base's heads cannot change during fine-tuning)"
            )
    return model.to(device).train(), tokenizer, source


# ----------------------------------------------------------------------------------------------------------------
# Batches


def sft_batch(
    rendered: list[tuple[list[int], list[int]]], pad_id: int, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of whole conversations, right-padded to the longest (at most ``max_len`` inputs);
    targets are -1 (ignored) where the mask is 0 and on padding."""
    length = min(max(len(ids) for ids, _ in rendered) - 1, max_len)
    x = torch.full((len(rendered), length), pad_id, dtype=torch.long)
    y = torch.full((len(rendered), length), -1, dtype=torch.long)
    for row, (ids, mask) in enumerate(rendered):
        ids, mask = ids[: length + 1], mask[: length + 1]
        n = len(ids) - 1
        x[row, :n] = torch.tensor(ids[:-1])
        targets = torch.tensor(ids[1:])
        y[row, :n] = torch.where(torch.tensor(mask[1:], dtype=torch.bool), targets, -1)
    return x, y


class ConversationBatches:
    """The micro-batches of a step, a pure function of the step (see the module docstring).

    Args:
        conversations: the shuffled mixture.
        tokenizer: renders them.
        packed: True (mid): one token stream cut into ``sequence_len + 1`` windows, every token a target;
            False (SFT): whole conversations, padded and masked.
        per_step: sequences (mid) or conversations (SFT) per optimizer step over all processes.
    """

    def __init__(
        self,
        conversations: list[Conversation],
        tokenizer: Tokenizer,
        *,
        packed: bool,
        sequence_len: int,
        micro_batch: int,
        per_step: int,
        rank: int,
        world_size: int,
    ) -> None:
        self.tokenizer, self.packed, self.sequence_len = tokenizer, packed, sequence_len
        self.micro_batch, self.rank, self.world_size = micro_batch, rank, world_size
        self.accum = per_step // (micro_batch * world_size)
        self.rendered = [render_conversation(tokenizer, c, sequence_len + 1) for c in conversations]
        if packed:
            stream = [t for ids, _ in self.rendered for t in ids]
            n = len(stream) // (sequence_len + 1)
            if n == 0:
                raise InputError(f"the mixture has {len(stream)} tokens, fewer than one sequence of {sequence_len}")
            self.windows = torch.tensor(stream[: n * (sequence_len + 1)]).view(n, sequence_len + 1)
        self.items = len(self.windows) if packed else len(self.rendered)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.items // (self.micro_batch * self.accum * self.world_size))

    def step(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        per_step = self.micro_batch * self.accum * self.world_size
        out = []
        for a in range(self.accum):
            first = step * per_step + (a * self.world_size + self.rank) * self.micro_batch
            index = [(first + i) % self.items for i in range(self.micro_batch)]
            if self.packed:
                rows = self.windows[index]
                out.append((rows[:, :-1], rows[:, 1:]))
            else:
                pad = self.tokenizer.special_id("<|assistant_end|>")
                out.append(sft_batch([self.rendered[i] for i in index], pad, self.sequence_len))
        return out


@torch.no_grad()
def conversation_loss(
    model: GPT,
    rendered: list[tuple[list[int], list[int]]],
    tokenizer: Tokenizer,
    dist_: Distributed,
    sequence_len: int,
    batch_size: int,
) -> float:
    """Mean loss (nats) over the trained tokens of ``rendered``, all ranks together."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=dist_.device)
    pad = tokenizer.special_id("<|assistant_end|>")
    mine = rendered[dist_.rank :: dist_.world_size]
    for start in range(0, len(mine), batch_size):
        x, y = sft_batch(mine[start : start + batch_size], pad, sequence_len)
        nats = model(x.to(dist_.device), y.to(dist_.device), loss_reduction="sum")
        totals += torch.stack([nats.double(), (y >= 0).sum().double().to(dist_.device)])
    dist_.all_reduce_sum(totals)
    model.train(was_training)
    return float(totals[0] / totals[1].clamp_min(1))


# ----------------------------------------------------------------------------------------------------------------
# Training


def _optimizers(model: GPT, peft_model, cfg: ChatTrainConfig, dist_: Distributed) -> dict[str, torch.optim.Optimizer]:
    """Pre-training's optimizers at ``init_lr_frac`` of its rates; with LoRA, one AdamW over the adapters."""
    if peft_model is None:
        return build_optimizers(model, cfg, dist_, lr_scale=cfg.init_lr_frac)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lora_lr * cfg.init_lr_frac, weight_decay=cfg.weight_decay)
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]
    return {"adamw": opt}


def train_chat(
    task: str,
    cfg: ChatTrainConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    stop_at_step: int | None = None,
    preset: str | None = None,
) -> dict[str, Any]:
    """Mid-train (``task`` "mid") or SFT (``task`` "sft") into ``run_dir``; returns the final metrics."""
    validate_config(cfg)
    run = RunDir(run_dir)
    dist_ = setup_distributed(cfg.device)
    seed_everything(cfg.seed)
    model, tokenizer, source = _load_base(cfg, dist_.device)
    sequence_len = cfg.sequence_len or model.config.sequence_len
    if sequence_len > model.config.sequence_len:
        raise ConfigError(f"--sequence-len {sequence_len}; allowed: at most the base's {model.config.sequence_len}")
    try:
        tokenizer.special_id("<|assistant_start|>")
    except Exception:
        raise InputError(
            f"{cfg.base or cfg.nanochat} has a tokenizer without chat tokens; allowed: a lapheads or nanochat tokenizer"
        ) from None
    data_dir = cfg.data_dir or None
    conversations = conversation_mixture(cfg.data, data_dir, cfg.seed)
    packed = type(cfg).packed
    window = _window_words(sequence_len, model.config.sequence_len)
    if not packed:
        _check_trained_tokens(conversations, tokenizer, sequence_len, window)
    if packed:
        per_pass = cfg.micro_batch * sequence_len * dist_.world_size
        if cfg.total_batch_size % per_pass:
            raise ConfigError(
                f"--total-batch-size {cfg.total_batch_size} is not a multiple of micro_batch x "
                f"sequence_len x world_size = {per_pass}; allowed: a multiple of {per_pass}"
            )
        per_step = cfg.total_batch_size // sequence_len
    else:
        per_pass = cfg.micro_batch * dist_.world_size
        if cfg.examples_per_step % per_pass:
            raise ConfigError(
                f"--examples-per-step {cfg.examples_per_step} is not a multiple of micro_batch x "
                f"world_size = {per_pass}; allowed: a multiple of {per_pass}"
            )
        per_step = cfg.examples_per_step
    batches = ConversationBatches(
        conversations,
        tokenizer,
        packed=packed,
        sequence_len=sequence_len,
        micro_batch=cfg.micro_batch,
        per_step=per_step,
        rank=dist_.rank,
        world_size=dist_.world_size,
    )
    val = (
        [
            render_conversation(tokenizer, c, sequence_len + 1)
            for c in conversation_mixture(cfg.val_data, data_dir, 0)[: cfg.eval_examples]
        ]
        if cfg.val_data
        else []
    )
    total_steps = cfg.num_iterations if cfg.num_iterations > 0 else batches.steps_per_epoch

    peft_model = (
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets) if cfg.lora_rank else None
    )
    if dist_.rank:  # each rank its own LoRA dropout masks (seed + rank, as timm's trainers); rank 0 keeps the stream
        seed_everything(cfg.seed + dist_.rank)  # of a one-process run
    trained = LoraAdapters(peft_model) if peft_model is not None else model
    optimizers = _optimizers(model, peft_model, cfg, dist_)
    precision = run_precision(run, cfg.amp, dist_, resume)
    start_step = start_or_resume(
        run,
        task,
        dataclasses.asdict(cfg),
        dist_,
        trained,
        optimizers,
        resume=resume,
        config_type=type(cfg),
        extra_record={
            "precision": precision.record(),
            "preset": preset,
            **source,
            "model": model_record("gpt", model.constructor_kwargs()),
            "laplacian_masks": model.laplacian_masks(),
            "vocab_size": tokenizer.vocab_size,
            "steps": total_steps,
            "conversations": len(conversations),
            "trainable_params": sum(p.numel() for p in trained.parameters()),
            "num_params": model.num_params(),
        },
    )
    if not resume and dist_.is_main:
        tokenizer.save(run.tokenizer_dir)
    train_model, forward_model = wrap_for_training(peft_model if peft_model is not None else model, dist_, cfg.compile)
    hint = "lower --lora-lr" if peft_model is not None else "lower --init-lr-frac"
    clock = StepClock(total_steps, start_step, f"train {task}", main=dist_.is_main, stop_at_step=stop_at_step)
    progress = clock.progress

    def evaluate(step: int) -> dict[str, float]:
        if not val:
            return {}
        loss = conversation_loss(
            model if peft_model is None else peft_model, val, tokenizer, dist_, sequence_len, cfg.micro_batch
        )
        if dist_.is_main:
            run.log({"step": step, "val_loss": loss})
            progress.write(f"step {step}: val_loss {loss:.4f}")
        return {"val_loss": loss}

    last_eval: dict[str, float] = evaluate(0) if start_step == 0 else {}
    clock.lap()  # the first log line's seconds start after the step-0 evaluation
    step = start_step
    with StopRequests(active=not dist_.enabled) as stop:
        while step < total_steps:
            if not clock.begin(step):
                return {"step": step, "stopped": True}
            micro_batches = batches.step(step)
            loss_sum, tokens = torch.zeros((), device=dist_.device), 0
            for a, (x, y) in enumerate(micro_batches):
                x, y = x.to(dist_.device), y.to(dist_.device)
                trained_here = int((y >= 0).sum())
                if not trained_here:  # the mean over no tokens is NaN: say why instead of "non-finite loss"
                    raise ConfigError(
                        f"step {step + 1}: a micro-batch of {len(x)} conversations has no trained tokens (their "
                        f"assistant turns start after {window}); allowed: a longer sequence length or shorter "
                        "conversations"
                    )
                tokens += trained_here
                with grad_sync(train_model, dist_, last=a == len(micro_batches) - 1):
                    with torch.autocast(dist_.device.type, dtype=torch.bfloat16, enabled=precision.autocast):
                        loss = forward_model(x, y)
                    (loss / len(micro_batches)).backward()
                loss_sum += loss.detach()
            mean_loss = dist_.all_reduce_sum(loss_sum / len(micro_batches)).item() / dist_.world_size
            check_finite_loss(mean_loss, step, run, hint, progress)
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(trained.parameters(), cfg.grad_clip)
            multiplier = lr_multiplier(step, total_steps, cfg.warmdown_ratio)  # no warm-up, down to 0
            set_learning_rates(optimizers, multiplier)
            optimizer_step(list(optimizers.values()), step, run, hint, progress)
            (peft_model or model).zero_grad(set_to_none=True)
            step += 1
            clock.end()
            if clock.due(step, cfg.log_every):
                elapsed, _ = clock.lap()
                progress.set_postfix(loss=f"{mean_loss:.4f}", lrm=f"{multiplier:.2f}")
                if dist_.is_main:
                    run.log(
                        {
                            "step": step,
                            "loss": mean_loss,
                            "lr_multiplier": multiplier,
                            "trained_tokens": tokens,
                            "seconds": elapsed,
                        }
                    )
            if clock.due(step, cfg.eval_every):
                last_eval = evaluate(step)
            if clock.due(step, cfg.checkpoint_every, cfg.eval_every) or stop.requested:
                save_checkpoint(run, step, dist_, trained, optimizers, {}, keep=cfg.keep_checkpoints)
            stop.stop_if_requested(step, run.path, progress)
    clock.close()
    if peft_model is not None and dist_.is_main:
        peft_model.save_pretrained(str(run.path / "adapter"))  # peft's own format: PeftModel.from_pretrained reads it
        if cfg.lora_merge:
            merge_lora(run.path, run.path / "merged")
    tasks = [t.strip() for t in cfg.eval_tasks.split(",") if t.strip()]
    done_before = start_step == total_steps and (run.report_dir / "eval_chat.json").is_file()
    if tasks and dist_.is_main and not done_before:  # nanochat's chat_sft ends with its chat evals too
        from lapheads.evals.chat import run_chat_evals
        from lapheads.evals.options import ChatEvalOptions

        max_examples = cfg.eval_max_examples
        if total_steps < cfg.eval_every:  # a short run (a try-out): a short look, not 16 minutes of evals after 2
            max_examples = min(max_examples or SHORT_RUN_EVAL_ITEMS, SHORT_RUN_EVAL_ITEMS)
            log.warning(  # the evaluation is partial: said as a warning, so a library user sees it too
                f"lapheads: a run of {total_steps} steps, shorter than --eval-every {cfg.eval_every}: chat evals on "
                f"the first {max_examples} items per task; all of them: lapheads eval chat {run.path} --benchmarks "
                f"{','.join(tasks)}" + (f" --max-examples {cfg.eval_max_examples}" if cfg.eval_max_examples else "")
            )
        options = ChatEvalOptions(
            run_dir=str(run.path), benchmarks=",".join(tasks), data_dir=data_dir, max_examples=max_examples,
            device=cfg.device,
        )  # fmt: skip
        summary = run_chat_evals(options)
        last_eval |= {f"{t}_accuracy": r["accuracy"] for t, r in summary["tasks"].items()}
        last_eval["chatcore"] = summary["chatcore"]
    return {"step": step, **last_eval}


#: the items per chat-eval task after a run shorter than one --eval-every period (its evals would dwarf it)
SHORT_RUN_EVAL_ITEMS = 20


def _window_words(sequence_len: int, base_len: int) -> str:
    """How an error names the token window: the --sequence-len, and the base's when that is the limit."""
    if sequence_len == base_len:
        return f"the first {sequence_len} tokens, the base's sequence_len"
    return f"the first {sequence_len} tokens (--sequence-len; the base's: {base_len})"


#: conversations of the shuffled mixture rendered before SFT starts, to refuse a window that holds no answer
TRAINED_TOKEN_PROBE = 256


def _check_trained_tokens(
    conversations: list[Conversation], tokenizer: Tokenizer, sequence_len: int, window: str
) -> None:
    """Refuse, before a run is written, SFT whose window holds no trained token of the first conversations of the
    shuffled mixture: every step would average a loss over no tokens."""
    probe = conversations[:TRAINED_TOKEN_PROBE]
    if probe and not any(any(render_conversation(tokenizer, c, sequence_len + 1)[1][1:]) for c in probe):
        raise ConfigError(
            f"none of the first {len(probe)} conversations has an assistant token within {window}; allowed: a base "
            "with a longer sequence_len, or shorter conversations"
        )


def merge_lora(run_dir: str | Path, out: str | Path) -> Path:
    """Write ``out``: a plain sft run directory whose model is ``run_dir``'s base with its LoRA adapters merged."""
    run = RunDir(run_dir)
    record = run.read_config()
    if not record.get("config", {}).get("lora_rank"):
        raise InputError(f"{run.path} is not a LoRA run; allowed: an sft run trained with --lora-rank > 0")
    _, model, tokenizer = load_gpt_run(run_dir, "cpu")
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    merged = RunDir(out)
    config = dict(record["config"], lora_rank=0, lora_merge=False)
    merged.write_config(
        "sft",
        config,
        {k: v for k, v in record.items() if k not in ("task", "config")} | {"merged_from": str(run.path.resolve())},
    )
    tokenizer.save(merged.tokenizer_dir)
    step = int(json_loads((checkpoint_folder(run) / STATE_FILE).read_text())["step"])
    save_checkpoint(merged, step, Distributed(), model, {}, {})
    return out


def train_mid(cfg: MidConfig, run_dir: str | Path, **kwargs) -> dict[str, Any]:
    """Mid-training; see :func:`train_chat`."""
    return train_chat("mid", cfg, run_dir, **kwargs)


def train_sft(cfg: SFTConfig, run_dir: str | Path, **kwargs) -> dict[str, Any]:
    """SFT (full or LoRA); see :func:`train_chat`."""
    return train_chat("sft", cfg, run_dir, **kwargs)
