"""Probes recover known structure in synthetic features; mIoU on hand-made masks."""

from __future__ import annotations

import pytest
import torch

from lapheads.evals.probes import confusion_matrix, knn_accuracy, linear_probe, mean_iou, segmentation_probe


def _clusters(n_per_class=60, classes=4, dim=16, noise=0.3, seed=0):
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(100)) * 3  # shared by all splits
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(n_per_class)
    return centres[labels] + noise * torch.randn(len(labels), dim, generator=gen), labels


def test_knn_recovers_clusters_and_is_chance_on_noise():
    x, y = _clusters(seed=0)
    xt, yt = _clusters(seed=1)
    assert knn_accuracy(x, y, xt, yt, ks=(10, 20))[10] == 100.0
    gen = torch.Generator().manual_seed(2)
    noise = knn_accuracy(
        torch.randn(400, 16, generator=gen),
        torch.randint(0, 4, (400,), generator=gen),
        torch.randn(400, 16, generator=gen),
        torch.randint(0, 4, (400,), generator=gen),
        ks=(20,),
    )
    assert 10 < noise[20] < 40  # chance is 25%


def test_knn_weights_votes_by_similarity():
    train = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 1.0], [0.2, 1.0]])
    labels = torch.tensor([0, 0, 1, 1, 1])
    # k = 5: three votes for class 1, but the two class-0 neighbours are far more similar (T = 0.07)
    assert knn_accuracy(train, labels, torch.tensor([[1.0, 0.05]]), torch.tensor([0]), ks=(5,))[5] == 100.0


def test_linear_probe_grid_picks_a_working_learning_rate():
    x, y = _clusters(n_per_class=100, noise=1.0, seed=3)
    xt, yt = _clusters(n_per_class=50, noise=1.0, seed=4)
    out = linear_probe(x, y, xt, yt, num_classes=4, lrs=(1e-6, 0.1), epochs=10)
    assert out["lr"] == 0.1 and out["test_accuracy"] > 95
    assert out["grid"]["1e-06"]["val"] < out["grid"]["0.1"]["val"]


def test_miou_on_hand_made_masks():
    target = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 255, 255]])
    pred = torch.tensor([[0, 0, 1, 0], [0, 0, 1, 1], [2, 1, 2, 2]])
    confusion = confusion_matrix(pred, target, num_classes=4)
    assert int(confusion.sum()) == 10  # ignored pixels left out
    result = mean_iou(confusion)
    # class 0: tp 4, fp 1, fn 0 -> 4/5; class 1: tp 3, fp 1, fn 1 -> 3/5; class 2: tp 1, fn 1 -> 1/2; class 3 absent
    assert result["miou"] == pytest.approx(100 * (4 / 5 + 3 / 5 + 1 / 2) / 3)
    assert result["per_class"][3] is None and result["pixel_accuracy"] == pytest.approx(80.0)


def test_segmentation_probe_learns_a_linearly_separable_grid():
    gen = torch.Generator().manual_seed(0)
    masks = (torch.rand(40, 4, 4, generator=gen) > 0.5).long()
    tokens = torch.stack([masks.float() * 2 - 1, torch.randn(40, 4, 4, generator=gen)], 1)  # (N, 2, h, w)
    up = masks.repeat_interleave(2, 1).repeat_interleave(2, 2)  # masks at 8 x 8
    out = segmentation_probe(
        tokens[:30], up[:30], tokens[30:], up[30:], num_classes=2, epochs=40, lr=0.05, batch_size=10
    )
    assert out["miou"] > 60
