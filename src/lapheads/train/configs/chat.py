"""The configs of chat training (mid-training and SFT). No training code: presets, ``--help`` and a sweep's dry run
import this, never the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lapheads.config import FRACTION, NON_NEGATIVE, POSITIVE, RATE, ConfigError, Domain, option
from lapheads.core.vocabulary import HEAD_SPEC
from lapheads.data.conversations import parse_mixture
from lapheads.train.configs.run import RunConfig

__all__ = ["LORA_TARGETS", "ChatTrainConfig", "MidConfig", "SFTConfig"]


LORA_TARGETS = "c_q,c_k,c_v,c_proj,c_fc"

_SPEC_OR_BASE = Domain("empty (the base's heads) or " + HEAD_SPEC.allowed, lambda v: v == "" or HEAD_SPEC.test(v))


@dataclass
class ChatTrainConfig(RunConfig):
    """Options shared by mid-training and SFT (``lapheads train mid|sft --key value``)."""

    laplacian_heads: str = option(
        "", "must equal the base's Laplacian heads (empty: take them from the base)", _SPEC_OR_BASE
    )
    base: str = option("", "the lapheads run directory (lm, mid or sft) to start from (or --nanochat)")
    nanochat: str = option("", "a nanochat checkpoint folder to start from instead of --base")
    nanochat_step: int | None = option(None, "--nanochat: the checkpoint step (default: the last)", NON_NEGATIVE)
    nanochat_tokenizer: str = option("", "--nanochat: the folder of tokenizer.pkl (default: nanochat's layout)")
    data: str = option(
        "smoltalk,mmlu_aux*3,gsm8k*4",
        "the conversation mixture, NAME[*EPOCHS],... (sources: smoltalk, mmlu_aux, gsm8k, identity, arith, letters)",
    )
    val_data: str = option("", "conversations for the validation loss (e.g. arith_test); empty: none")
    data_dir: str = option("", "local <source>.jsonl/.parquet files in the hub's schema (empty: the hub)")
    sequence_len: int | None = option(None, "longest sequence (default: the base's)", POSITIVE)
    micro_batch: int = option(4, "sequences per forward pass per process", POSITIVE)
    num_iterations: int = option(
        -1, "optimizer steps; -1 = one pass over the mixture", Domain("-1 or > 0", lambda v: v == -1 or v > 0)
    )
    embedding_lr: float = option(0.2, "AdamW learning rate of the embedding (scaled by (width/768)^-0.5)", POSITIVE)
    unembedding_lr: float = option(0.004, "AdamW learning rate of the LM head (scaled likewise)", POSITIVE)
    matrix_lr: float = option(0.02, "Muon learning rate of the block matrices", POSITIVE)
    scalar_lr: float = option(0.5, "AdamW learning rate of the 2026 family's scalars", POSITIVE)
    init_lr_frac: float = option(1.0, "every learning rate starts at this fraction of the above", POSITIVE)
    warmdown_ratio: float = option(0.2, "fraction of the steps in the final linear decay to 0", FRACTION)
    weight_decay: float = option(0.0, "AdamW weight decay", NON_NEGATIVE)
    adam_beta1: float = option(0.8, "AdamW beta1", RATE)
    adam_beta2: float = option(0.95, "AdamW beta2", RATE)
    grad_clip: float = option(0.0, "gradient-norm clip (0: off)", NON_NEGATIVE)
    lora_rank: int = option(0, "LoRA rank (0: train every weight)", NON_NEGATIVE)
    lora_alpha: float = option(32.0, "LoRA alpha (the update is scaled by alpha / rank)", POSITIVE)
    lora_dropout: float = option(0.05, "dropout on the LoRA input", FRACTION)
    lora_lr: float = option(2e-4, "AdamW learning rate of the LoRA adapters", POSITIVE)
    lora_targets: str = option(LORA_TARGETS, "comma list of the Linear layers that get adapters")
    lora_merge: bool = option(False, "after training, write RUN_DIR/merged: a plain run with the adapters merged")
    eval_every: int = option(100, "steps between validation losses and checkpoints", POSITIVE)
    eval_examples: int = option(200, "validation conversations per evaluation", POSITIVE)
    eval_tasks: str = option(
        "", "chat evals run after the last step into report/eval_chat.json (e.g. arith,letters; empty: none)"
    )
    eval_max_examples: int | None = option(None, "--eval-tasks: the first N items per task", POSITIVE)

    # muon settings that build_optimizers reads; fixed here (no warm-up after pre-training)
    muon_momentum_end = 0.95
    muon_weight_decay = 0.0

    def check(self) -> None:
        if bool(self.base) == bool(self.nanochat):
            raise ConfigError(
                f"--base {self.base!r} --nanochat {self.nanochat!r}: allowed: exactly one of them (a "
                "lapheads LM run directory or a nanochat checkpoint folder)"
            )
        parse_mixture(self.data)
        if self.val_data:
            parse_mixture(self.val_data)
        from lapheads.evals.chat import CHAT_BENCHMARKS as EVALS

        unknown = [t for t in self.eval_tasks.split(",") if t.strip() and t.strip() not in EVALS]
        if unknown:
            raise ConfigError(f"--eval-tasks {self.eval_tasks!r}; allowed: a comma list of {', '.join(EVALS)}")
        if self.lora_merge and not self.lora_rank:
            raise ConfigError("--lora-merge true needs --lora-rank > 0")
        unknown = [t for t in self.lora_targets.split(",") if t.strip() not in LORA_TARGETS.split(",")]
        if unknown or not self.lora_targets.strip():
            raise ConfigError(f"--lora-targets {self.lora_targets!r}; allowed: a comma list of {LORA_TARGETS}")


@dataclass
class MidConfig(ChatTrainConfig):
    """Mid-training: packed conversations, every token trained (nanochat v1's mid_train defaults)."""

    packed: ClassVar[bool] = True  # rows of sequence_len tokens, conversations end to end (not a field: fixed)

    data: str = option("smoltalk,mmlu_aux,gsm8k,identity", "the conversation mixture, NAME[*EPOCHS],...")
    total_batch_size: int = option(524_288, "tokens per optimizer step, over all processes", POSITIVE)

    def check(self) -> None:
        super().check()
        if self.lora_rank:
            raise ConfigError("--lora-rank: LoRA is for SFT; allowed here: 0")


@dataclass
class SFTConfig(ChatTrainConfig):
    """SFT: padded, masked conversations (nanochat v1's chat_sft defaults)."""

    packed: ClassVar[bool] = False  # one conversation per row, padded, only assistant tokens trained

    examples_per_step: int = option(32, "conversations per optimizer step, over all processes", POSITIVE)
    init_lr_frac: float = option(0.02, "every learning rate starts at this fraction of the above", POSITIVE)
    warmdown_ratio: float = option(1.0, "fraction of the steps in the final linear decay to 0", FRACTION)
    eval_every: int = option(100, "steps between validation losses and checkpoints", POSITIVE)
