"""Frozen-feature probes: weighted k-NN, a grid of linear probes trained in one pass, a segmentation probe, mIoU.

Design choices:

* **k-NN as DINO's ``eval_knn``**: L2-normalised features, cosine similarity, the k nearest training samples vote
  with weight exp(sim / T) (T = 0.07); top-1 accuracy for several k from one similarity pass.
* **Linear probes as DINOv2's ``eval_linear``**: one linear head per learning rate, all trained together on the same
  (precomputed, frozen) features with SGD + momentum and a cosine schedule; the learning rate is chosen on a
  held-out part of the training set (not the test set), then its test accuracy is reported.
* **Segmentation probe** (DINOv2's "linear" setting): frozen patch tokens -> BatchNorm -> 1x1 convolution ->
  bilinear upsampling to the mask; cross-entropy with an ignore index; mIoU from a confusion matrix over the whole
  test set (classes absent from both prediction and ground truth are left out of the mean).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["confusion_matrix", "knn_accuracy", "linear_probe", "mean_iou", "segmentation_probe"]


@torch.no_grad()
def knn_accuracy(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    ks: tuple[int, ...] = (10, 20, 100, 200),
    temperature: float = 0.07,
    num_classes: int | None = None,
    chunk: int = 1024,
) -> dict[int, float]:
    """Weighted k-NN top-1 accuracy (%) for each k in ``ks`` (k larger than the training set is clipped)."""
    train = F.normalize(train_features.float(), dim=1)
    test = F.normalize(test_features.float(), dim=1)
    num_classes = num_classes or int(max(train_labels.max(), test_labels.max())) + 1
    k_max = min(max(ks), len(train))
    correct = {k: 0 for k in ks}
    for start in range(0, len(test), chunk):
        sims, idx = (test[start : start + chunk] @ train.T).topk(k_max, dim=1)
        weights = (sims / temperature).exp()
        neighbours = F.one_hot(train_labels[idx], num_classes).float() * weights[..., None]  # (n, k, C)
        truth = test_labels[start : start + chunk]
        for k in ks:
            votes = neighbours[:, : min(k, k_max)].sum(1)
            correct[k] += int((votes.argmax(1) == truth).sum())
    return {k: 100.0 * c / len(test) for k, c in correct.items()}


def linear_probe(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    num_classes: int,
    lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3),
    epochs: int = 20,
    batch_size: int = 256,
    val_fraction: float = 0.1,
    seed: int = 0,
) -> dict[str, object]:
    """Linear heads for every lr in ``lrs``, trained in one pass; the lr is chosen on held-out training data.

    Returns the chosen ``lr``, its ``val_accuracy`` and ``test_accuracy`` (%), and every lr's accuracies.
    """
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train_features), generator=gen)
    n_val = max(1, int(len(order) * val_fraction))
    val_idx, fit_idx = order[:n_val], order[n_val:]
    x_fit, y_fit = train_features[fit_idx].float(), train_labels[fit_idx]
    dim = train_features.shape[1]
    heads = nn.ModuleList([nn.Linear(dim, num_classes) for _ in lrs])
    for head in heads:  # DINO's LinearClassifier init
        nn.init.normal_(head.weight, std=0.01)
        nn.init.zeros_(head.bias)
    optimizer = torch.optim.SGD([{"params": h.parameters(), "lr": lr} for h, lr in zip(heads, lrs)], momentum=0.9)
    steps = epochs * math.ceil(len(x_fit) / batch_size)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in range(epochs):
        perm = torch.randperm(len(x_fit), generator=gen)
        for start in range(0, len(x_fit), batch_size):
            idx = perm[start : start + batch_size]
            loss = sum(F.cross_entropy(head(x_fit[idx]), y_fit[idx]) for head in heads)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()

    @torch.no_grad()
    def accuracy(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        return 100.0 * float((head(x.float()).argmax(1) == y).double().mean())

    x_val, y_val = train_features[val_idx], train_labels[val_idx]
    results = {lr: (accuracy(h, x_val, y_val), accuracy(h, test_features, test_labels)) for h, lr in zip(heads, lrs)}
    best = max(results, key=lambda lr: results[lr][0])
    return {
        "lr": best,
        "val_accuracy": results[best][0],
        "test_accuracy": results[best][1],
        "grid": {str(lr): {"val": v, "test": t} for lr, (v, t) in results.items()},
    }


def confusion_matrix(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int = 255
) -> torch.Tensor:
    """(C, C) counts, rows = ground truth, columns = prediction; pixels with ``ignore_index`` are left out."""
    keep = target != ignore_index
    index = target[keep].long() * num_classes + pred[keep].long()
    return torch.bincount(index, minlength=num_classes * num_classes).view(num_classes, num_classes)


def mean_iou(confusion: torch.Tensor) -> dict[str, object]:
    """mIoU (%) and per-class IoU from a confusion matrix; classes never seen nor predicted are left out."""
    confusion = confusion.double()
    tp = confusion.diagonal()
    union = confusion.sum(0) + confusion.sum(1) - tp
    present = union > 0
    iou = torch.where(present, tp / union.clamp_min(1), torch.full_like(tp, float("nan")))
    return {
        "miou": 100.0 * float(iou[present].mean()),
        "per_class": [None if math.isnan(v) else 100 * v for v in iou.tolist()],
        "pixel_accuracy": 100.0 * float(tp.sum() / confusion.sum().clamp_min(1)),
    }


class SegmentationHead(nn.Module):
    """BatchNorm + 1x1 convolution over a (B, D, h, w) grid of frozen patch tokens."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(dim)
        self.conv = nn.Conv2d(dim, num_classes, kernel_size=1)

    def forward(self, tokens: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return F.interpolate(self.conv(self.bn(tokens)), size=size, mode="bilinear", align_corners=False)


def segmentation_probe(
    train_tokens: torch.Tensor,
    train_masks: torch.Tensor,
    test_tokens: torch.Tensor,
    test_masks: torch.Tensor,
    num_classes: int,
    epochs: int = 10,
    lr: float = 1e-3,
    batch_size: int = 64,
    ignore_index: int = 255,
    seed: int = 0,
) -> dict[str, object]:
    """Train the segmentation head on frozen patch grids (N, D, h, w) -> masks (N, H, W); test mIoU."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = SegmentationHead(train_tokens.shape[1], num_classes)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    size = tuple(train_masks.shape[-2:])
    for _ in range(epochs):
        perm = torch.randperm(len(train_tokens), generator=gen)
        for start in range(0, len(perm), batch_size):
            idx = perm[start : start + batch_size]
            loss = F.cross_entropy(head(train_tokens[idx].float(), size), train_masks[idx], ignore_index=ignore_index)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    head.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)
    with torch.no_grad():
        for start in range(0, len(test_tokens), batch_size):
            logits = head(test_tokens[start : start + batch_size].float(), tuple(test_masks.shape[-2:]))
            confusion += confusion_matrix(
                logits.argmax(1), test_masks[start : start + batch_size], num_classes, ignore_index
            )
    return mean_iou(confusion)
