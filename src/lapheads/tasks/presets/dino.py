"""Self-supervised DINO recipes: the CPU preset on Fashion-MNIST and ViT-S/16 on ImageNet."""

from __future__ import annotations

from lapheads.train.configs.dino import DINOConfig

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
