"""The learned head assignment: mix heads trained, read back from every checkpoint, and the decisiveness penalty."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import lapheads
from lapheads.cli import main
from lapheads.core.kinds import NAMED_POINTS, decisiveness_penalty, nearest_kind
from lapheads.train.classify import train_classify


@pytest.mark.parametrize(
    "a, b, point, direction",
    [
        (0.0, 1.0, "ordinary", "ordinary"),
        (0.9, -1.1, "laplacian", "laplacian"),
        (2.0, -2.0, "laplacian", "laplacian"),  # twice a Laplacian head: the same kind by direction
        (0.05, -0.4, "off", "negated"),
        (0.7, 0.05, "identity", "identity"),
    ],
)
def test_each_head_is_named_by_its_nearest_point_and_direction(a, b, point, direction):
    name, distance, by_direction = nearest_kind(a, b)
    assert (name, by_direction) == (point, direction)
    assert distance == pytest.approx(min(((a - p[0]) ** 2 + (b - p[1]) ** 2) ** 0.5 for p in NAMED_POINTS.values()))


def test_the_penalty_is_zero_at_named_points_and_pulls_towards_them():
    model = lapheads.create_vit("vit_fmnist_patch4", "mix", patch_size=7, depth=2)
    assert float(decisiveness_penalty(model)) == 0.0  # every head starts ordinary
    with torch.no_grad():
        model.blocks[0].attn.mix_a.fill_(0.4)
    before = float(decisiveness_penalty(model))
    assert before == pytest.approx(3 * 0.4**2)  # (0.4, 1) is 0.4 from ordinary, per head
    optimizer = torch.optim.SGD([model.blocks[0].attn.mix_a], lr=0.1)
    decisiveness_penalty(model).backward()
    optimizer.step()
    assert float(decisiveness_penalty(model)) < before
    assert float(decisiveness_penalty(lapheads.create_vit("vit_fmnist_patch4", 1, patch_size=7))) == 0.0


def test_a_mix_run_reports_what_each_head_became_over_its_checkpoints(tiny_config, tmp_path, capsys):
    cfg = dataclasses.replace(tiny_config, laplacian_heads="mix", checkpoint_every=4, keep_checkpoints=0, lr=3e-2)
    train_classify(cfg, tmp_path / "run")
    assert main(["mix", str(tmp_path / "run")]) == 0
    out = tmp_path / "run" / "report" / "mix"
    text = (out / "mix.md").read_text()
    record = json.loads((out / "mix.json").read_text())
    assert record["steps"] == [4, 8] and len(record["final"]) == 4  # 2 blocks x 2 heads
    assert all(r["a"] != 0.0 or r["b"] != 1.0 for r in record["final"])  # they moved
    assert len([line for line in text.splitlines() if line.startswith("| 1 | ")]) == 2 and "nearest direction" in text
    assert (out / "kinds.png").stat().st_size > 3000 and (out / "trajectories.png").stat().st_size > 3000
    assert "report:" in capsys.readouterr().out


def test_a_run_without_mix_heads_is_a_one_line_error(tiny_config, tmp_path, capsys):
    train_classify(tiny_config, tmp_path / "run")
    assert main(["mix", str(tmp_path / "run")]) == 2
    assert "has no mix heads" in capsys.readouterr().err


def test_mix_scalars_can_learn_at_their_own_rate(tiny_config, tmp_path):
    """--mix-lr-scale puts the mix heads' (a, b) in an optimizer group at lr x the scale (timm's scheduler keeps the
    ratio); the same run at scale 1 moves them less. Without mix heads or at 1 the groups are timm's own."""
    from lapheads.runs import load_model
    from lapheads.train.classify import _param_groups, train_classify

    moved = {}
    for scale in (1.0, 30.0):
        cfg = dataclasses.replace(tiny_config, laplacian_heads="mix", lr=3e-3, mix_lr_scale=scale)
        train_classify(cfg, tmp_path / f"s{scale}")
        model = load_model(tmp_path / f"s{scale}")
        moved[scale] = max(
            float((m.mix_b - 1).abs().max()) for m in model.modules() if getattr(m, "mix_b", None) is not None
        )
    assert moved[30.0] > 3 * moved[1.0] > 0
    cfg = dataclasses.replace(tiny_config, laplacian_heads="mix", mix_lr_scale=30.0)
    model = lapheads.create_vit("vit_fmnist_patch4", "mix", patch_size=7, depth=2)
    groups = _param_groups(cfg)(model)
    assert groups[-1]["lr_scale"] == 30.0 and len(groups[-1]["params"]) == 4  # a and b of 2 blocks
    assert _param_groups(dataclasses.replace(cfg, mix_lr_scale=1.0)) is None
