"""Convert a pretrained timm ViT to Laplacian heads and fine-tune it on Fashion-MNIST, once per ``init``.

The "pretrained" model is timm's own ``vit_fmnist_patch4`` with plain attention, trained here for
--pretrain-steps on Fashion-MNIST and saved as a local timm checkpoint (or given with --pretrained-file). From that
file, with the same batches, ``lapheads.create_vit(..., pretrained_file=..., init=...)`` builds:

* ``control``  k = 0 (plain attention, fine-tuned the same way);
* ``switch``   k heads per layer turned Laplacian as they are;
* ``signflip`` k heads Laplacian with their W_O columns negated (the P V term kept exactly);
* ``blend``    k heads moved from plain attention (lambda = 0) to Laplacian (lambda = 1) over --blend-steps.

    python examples/timm_convert_finetune.py --out runs/timm-convert     # ~6 minutes on 2 CPU cores

Writes OUT/pretrained.safetensors, OUT/curves.json (loss per step, test accuracy at conversion and at the end per
init) and OUT/curves.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import lapheads
from lapheads.core.convert import BlendSchedule
from lapheads.data.images import load_fashion_mnist

NORMALISE = (0.2860, 0.3530)  # Fashion-MNIST's pixel mean and std


def batches(dataset, batch: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield from DataLoader(dataset, batch_size=batch, shuffle=True, generator=generator, drop_last=True)


def train(model, data, steps: int, lr: float, on_step=None) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    model.train()
    losses = []
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        x, y = next(data)
        loss = F.cross_entropy(model((x - NORMALISE[0]) / NORMALISE[1]), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@torch.no_grad()
def accuracy(model, dataset, limit: int) -> float:
    model.eval()
    x = dataset.images[:limit].unsqueeze(1).float().div(255)
    predictions = torch.cat([model((chunk - NORMALISE[0]) / NORMALISE[1]).argmax(-1) for chunk in x.split(500)])
    return float((predictions == dataset.targets[:limit]).float().mean())


def main() -> None:
    from lapheads.hardware import apply_thread_policy

    apply_thread_policy("auto")  # the CPUs other processes leave free, as the CLI picks them
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pretrained-file",
        default=None,
        help="a timm vit_fmnist_patch4 checkpoint (default: train one with plain attention first)",
    )
    parser.add_argument("--laplacian-heads", default="1", help="of 3 heads per layer")
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--steps", type=int, default=200, help="fine-tuning steps per init")
    parser.add_argument("--blend-steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--test-images", type=int, default=5000)
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--out", default="runs/timm-convert")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_set, test_set = load_fashion_mnist(args.data_root, "train"), load_fashion_mnist(args.data_root, "test")
    pretrained_file = args.pretrained_file
    results: dict[str, dict] = {}
    if pretrained_file is None:
        torch.manual_seed(0)
        model = timm.create_model("vit_fmnist_patch4")  # timm's plain attention
        losses = train(model, batches(train_set, args.batch, seed=0), args.pretrain_steps, 1e-3)
        pretrained_file = str(out / "pretrained.safetensors")
        save_file(model.state_dict(), pretrained_file)
        results["pretrain"] = {"loss": losses, "test_accuracy": accuracy(model, test_set, args.test_images)}
    for init in ("control", "switch", "signflip", "blend"):
        spec = 0 if init == "control" else args.laplacian_heads
        model = lapheads.create_vit(
            "vit_fmnist_patch4", spec, pretrained_file=pretrained_file, init="switch" if init == "control" else init
        )
        start = accuracy(model, test_set, args.test_images)
        schedule = BlendSchedule(model, args.blend_steps) if init == "blend" else None
        torch.manual_seed(1)
        losses = train(model, batches(train_set, args.batch, seed=1), args.steps, args.lr, schedule)
        results[init] = {
            "loss": losses,
            "test_accuracy_at_conversion": start,
            "test_accuracy": accuracy(model, test_set, args.test_images),
        }
        print(
            f"{init:9s} test accuracy at conversion {start:.4f}, after {args.steps} steps "
            f"{results[init]['test_accuracy']:.4f}"
        )
    (out / "curves.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for init in ("control", "switch", "signflip", "blend"):
        ax.plot(results[init]["loss"], label=f"{init} (test acc {results[init]['test_accuracy']:.3f})")
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("training loss")
    ax.set_title(f"timm ViT converted to {args.laplacian_heads} of 3 Laplacian heads per layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    print(f"curves: {out / 'curves.json'}, {out / 'curves.png'}")


if __name__ == "__main__":
    main()
