"""Vision classification recipes: CPU presets on Fashion-MNIST, CIFAR ViTs, and DeiT-III on ImageNet (the
authors' and the official recipe)."""

from __future__ import annotations

import dataclasses

from lapheads.train.configs.classify import ClassifyConfig

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

_FMNIST_10K_CONVERGED = dataclasses.replace(
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
    "fmnist-10k-converged-cpu": _FMNIST_10K_CONVERGED,
    # issue 40's second study: the converged recipe with 49 tokens per image, where a head's smoothing has more
    # tokens to act on; its pilot pair fixes the margin in the plan before seed 1 (docs/reproduction.md)
    "fmnist-10k-converged-p4-cpu": dataclasses.replace(
        _FMNIST_10K_CONVERGED,
        description=(
            "fmnist-10k-converged-cpu with patch 4: 7 x 7 = 49 tokens per 28 px image (patch 7 gives 16), the rest "
            "of the recipe unchanged (the same ViT; 30 epochs of the first 10,000 training images, batch 128, AdamW "
            "lr 1.5e-3, wd 0.05, 2 warm-up epochs, cosine; the test set and the fit score every 3 epochs)"
        ),
        model_kwargs={"patch_size": 4, "no_embed_class": True},
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
                "Mixup 0.8, CutMix 1.0, no label smoothing, BCE, drop-path 0.2, LayerScale 1e-6, repeated "
                "augmentation (3 copies). The 224 px fine-tune is a separate run"
            ),
            "epochs": 800,
            "optimizer": "lamb",
            "lr": 3e-3,
            "smoothing": 0.0,
            "aug_repeats": 3,
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
