"""Models built on the meta device (as nanochat and every large-model user does) keep their Laplacian heads.

``with torch.device("meta"): model = ...`` then ``model.to_empty(device=...)`` re-allocates every buffer without
initialising it; the head masks must come back as configured, and survive deepcopy, EMA, ``to`` and a state-dict
round trip.
"""

from __future__ import annotations

import copy

import pytest
import torch
from timm.utils import ModelEmaV3

from lapheads import LaplacianAttention, create_vit
from lapheads.models.gpt import GPT, GPTConfig
from lapheads.models.vit import vit_laplacian_masks

TINY_GPT = dict(depth=4, vocab_size=40, sequence_len=32, aspect_ratio=16, head_dim=16)  # 64 dim, 4 heads
SMALL_VIT = dict(img_size=16, patch_size=8, embed_dim=48, depth=4, num_heads=3, num_classes=5)

GPT_SPECS = [2, "0,1,2,0", [[True, False, True, False], [False] * 4, [True] * 4, [False, True, False, False]]]


def _gpt_masks(model: GPT) -> list[list[bool]]:
    return [block.attn.laplacian_mask.tolist() for block in model.blocks]


def _poison_buffers(model: torch.nn.Module) -> None:
    """What uninitialised memory may hold: every bool buffer all True."""
    for buf in model.buffers():
        if buf.dtype == torch.bool:
            buf.fill_(True)


@pytest.mark.parametrize("spec", GPT_SPECS, ids=["int", "per-layer", "masks"])
def test_gpt_built_on_meta_equals_direct_build(spec):
    torch.manual_seed(0)
    direct = GPT(GPTConfig(**TINY_GPT, laplacian_heads=spec))
    with torch.device("meta"):
        meta = GPT(GPTConfig(**TINY_GPT, laplacian_heads=spec))
    assert meta.laplacian_masks() == direct.laplacian_masks()
    meta.to_empty(device="cpu")
    meta.init_weights()
    assert _gpt_masks(meta) == direct.laplacian_masks() == _gpt_masks(direct)
    meta.load_state_dict(direct.state_dict(), strict=True)
    for p in direct.parameters():  # non-zero weights everywhere, so every head matters
        p.data.normal_(0, 0.1)
    meta.load_state_dict(direct.state_dict(), strict=True)
    idx = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(meta(idx), direct(idx), rtol=0, atol=0)


def test_gpt_masks_are_rebuilt_whatever_memory_to_empty_returns():
    with torch.device("meta"):
        model = GPT(GPTConfig(**TINY_GPT, laplacian_heads="0,1,2,0"))
    model.to_empty(device="cpu")
    _poison_buffers(model)  # as if to_empty had handed back garbage
    model.to_empty(device="cpu")  # the next move restores the configured heads
    assert _gpt_masks(model) == model.laplacian_masks()
    assert _gpt_masks(model)[0] == [False] * 4


def test_gpt_masks_survive_deepcopy_ema_to_and_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    model = GPT(GPTConfig(**TINY_GPT, laplacian_heads="0,1,2,0"))
    expected = model.laplacian_masks()
    assert _gpt_masks(copy.deepcopy(model)) == expected
    assert _gpt_masks(ModelEmaV3(model, decay=0.9).module) == expected
    assert _gpt_masks(model.to(torch.float64).to("cpu")) == expected
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    assert not any("laplacian_mask" in key for key in model.state_dict())  # non-persistent: plain nanochat keys
    other = GPT(GPTConfig(**TINY_GPT, laplacian_heads="0,1,2,0"))
    other.load_state_dict(load_file(str(tmp_path / "m.safetensors")), strict=True)
    assert _gpt_masks(other) == expected


def test_laplacian_attention_on_meta():
    with torch.device("meta"):
        layer = LaplacianAttention(48, num_heads=3, laplacian_heads=[True, False, True])
    layer.to_empty(device="cpu")
    assert layer.laplacian_mask.tolist() == [True, False, True]
    assert list(layer.heads.flags) == [True, False, True]
    assert "2/3 Laplacian: [0, 2]" in repr(layer)


@pytest.mark.parametrize("spec", [1, "0,3,1,2"])
def test_create_vit_on_meta_equals_direct_build(spec):
    torch.manual_seed(0)
    direct = create_vit("vit_small_patch16_224", spec, **SMALL_VIT).eval()
    with torch.device("meta"):
        meta = create_vit("vit_small_patch16_224", spec, **SMALL_VIT)
    assert vit_laplacian_masks(meta) == vit_laplacian_masks(direct)
    meta = meta.to_empty(device="cpu").eval()
    _poison_buffers(meta)
    meta.to_empty(device="cpu")
    meta.load_state_dict(direct.state_dict(), strict=True)
    assert [
        m.laplacian_mask.tolist() for m in meta.modules() if isinstance(m, LaplacianAttention)
    ] == vit_laplacian_masks(direct)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(meta(x), direct(x), rtol=0, atol=0)
    ema = ModelEmaV3(meta, decay=0.9).module
    assert vit_laplacian_masks(ema) == vit_laplacian_masks(direct)


def test_dino_student_teacher_on_meta():
    from lapheads.train.configs.dino import DINOConfig
    from lapheads.train.dino import build_student_teacher

    cfg = DINOConfig(
        model="vit_fmnist_patch4",
        model_kwargs={"depth": 2, "embed_dim": 32, "num_heads": 4},
        img_size=28,
        laplacian_heads="1,3",
        out_dim=16,
        head_hidden_dim=16,
        head_bottleneck_dim=8,
    )
    with torch.device("meta"):
        student, teacher = build_student_teacher(cfg, in_chans=1)
    teacher.to_empty(device="cpu")
    _poison_buffers(teacher)
    teacher.to_empty(device="cpu")
    expected = [[False, False, False, True], [False, True, True, True]]
    assert vit_laplacian_masks(student.backbone) == expected
    assert [m.laplacian_mask.tolist() for m in teacher.modules() if isinstance(m, LaplacianAttention)] == expected
