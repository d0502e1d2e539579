"""DINO parts: loss and centring on hand-computed cases, the head, the wrapper, EMA, schedules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lapheads
from lapheads.models.dino import (
    DINOHead,
    DINOLoss,
    MultiCropWrapper,
    cosine_schedule,
    teacher_temperatures,
    update_teacher,
)


def test_loss_and_centre_on_a_hand_computed_case():
    # 2 global + 1 local crop, batch 1, 2 prototypes; temperatures 1 and 1, centre 0 at first
    loss_fn = DINOLoss(out_dim=2, num_crops=3, teacher_temps=np.array([1.0]), student_temp=1.0, center_momentum=0.5)
    student = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])  # crops 0, 1, 2
    teacher = torch.tensor([[2.0, 0.0], [0.0, 0.0]])  # global crops 0, 1
    loss = loss_fn(student, teacher, epoch=0)
    t0, t1 = F.softmax(teacher[0], 0), F.softmax(teacher[1], 0)
    ce = lambda t, s: float(-(t * F.log_softmax(s, 0)).sum())  # noqa: E731
    # teacher crop 0 against student crops 1, 2; teacher crop 1 against student crops 0, 2
    expected = (ce(t0, student[1]) + ce(t0, student[2]) + ce(t1, student[0]) + ce(t1, student[2])) / 4
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    # centre <- 0.5 * 0 + 0.5 * mean(teacher outputs) = [0.5, 0]
    assert loss_fn.center.tolist() == [[0.5, 0.0]]
    # the next call subtracts the centre from the teacher before its softmax
    loss_fn(student, teacher, epoch=0)
    assert loss_fn.center.tolist() == [[0.75, 0.0]]


def test_sharpening_and_centring_change_the_teacher_target():
    student = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    teacher = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    sharp = DINOLoss(5, 3, np.array([0.04]))(student, teacher, 0)
    soft = DINOLoss(5, 3, np.array([1.0]))(student, teacher, 0)
    assert not math.isclose(float(sharp), float(soft))


def test_head_normalises_the_bottleneck_and_fixes_the_prototype_norm():
    head = DINOHead(16, out_dim=32, hidden_dim=24, bottleneck_dim=8)
    g = head.last_layer.parametrizations.weight.original0
    assert not g.requires_grad and torch.all(g == 1)
    norms = head.last_layer.weight.norm(dim=1)
    torch.testing.assert_close(norms, torch.ones(32))  # every prototype has unit norm
    out = head(torch.randn(3, 16))
    assert out.shape == (3, 32) and out.abs().max() <= 1.0 + 1e-5  # unit input x unit prototypes


def test_wrapper_runs_each_resolution_once_and_keeps_crop_order():
    backbone = lapheads.create_vit(
        "vit_fmnist_patch4", 1, num_classes=0, dynamic_img_size=True, depth=1, embed_dim=32, num_heads=2
    )
    calls = []
    backbone.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    wrapper = MultiCropWrapper(backbone, torch.nn.Identity()).eval()
    crops = [torch.randn(2, 1, 28, 28), torch.randn(2, 1, 28, 28), torch.randn(2, 1, 12, 12), torch.randn(2, 1, 12, 12)]
    with torch.no_grad():
        out = wrapper(crops)
        alone = backbone(crops[2])
    assert [tuple(s) for s in calls[:2]] == [(4, 1, 28, 28), (4, 1, 12, 12)]
    assert out.shape == (8, 32)
    torch.testing.assert_close(out[4:6], alone)


def test_teacher_ema_update():
    student, teacher = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = [p.clone() for p in teacher.parameters()]
    update_teacher(student, teacher, momentum=0.9)
    for p_t, p_b, p_s in zip(teacher.parameters(), before, student.parameters()):
        torch.testing.assert_close(p_t, 0.9 * p_b + 0.1 * p_s)


def test_schedules():
    lr = cosine_schedule(1.0, 0.0, epochs=4, iters_per_epoch=10, warmup_epochs=1)
    assert len(lr) == 40 and lr[0] == 0.0 and lr[9] == pytest.approx(1.0) and lr[10] == pytest.approx(1.0)
    assert lr[-1] < 0.01 and all(np.diff(lr[10:]) <= 1e-12)
    temps = teacher_temperatures(0.04, 0.07, warmup_epochs=3, epochs=5)
    assert temps.tolist() == pytest.approx([0.04, 0.055, 0.07, 0.07, 0.07])
