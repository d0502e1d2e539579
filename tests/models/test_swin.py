"""Laplacian heads in timm's Swin Transformer through the one op: timm's model at k = 0, (I - P) V per window."""

from __future__ import annotations

import torch

from lapheads.models.swin import LaplacianWindowAttention
from tests.conftest import timm_and_lapheads

NAME = "swin_tiny_patch4_window7_224"
KWARGS = dict(img_size=32, patch_size=2, window_size=4, embed_dim=24, depths=(2, 2), num_heads=(2, 4), num_classes=10)


def _pair(spec):
    return timm_and_lapheads(NAME, spec, **KWARGS)


def test_zero_heads_are_timms_swin_and_every_window_attention_is_converted():
    plain, model = _pair(0)
    x = torch.randn(2, 3, 32, 32)
    attention = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    assert len(attention) == 4 and all(isinstance(m, LaplacianWindowAttention) for m in attention)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=1e-6)


def test_a_shifted_window_block_outputs_v_minus_pv_with_its_bias_and_mask():
    _, model = _pair(1)
    block = model.layers[1].blocks[1]  # the shifted block of the 4-head stage
    attn = block.attn
    assert list(attn.heads.flags) == [False, False, False, True]
    windows, n, c = 8, 16, attn.proj.in_features
    torch.manual_seed(1)
    x = torch.randn(windows, n, c)
    mask = torch.where(torch.rand(4, n, n) < 0.3, -100.0, 0.0)  # per window, the same for every image
    q, k, v = attn.qkv(x).reshape(windows, n, 3, 4, -1).permute(2, 0, 3, 1, 4).unbind(0)
    logits = q @ k.transpose(-2, -1) * attn.scale + attn._get_rel_pos_bias()
    logits = logits.view(2, 4, 4, n, n) + mask.view(1, 4, 1, n, n)
    p = logits.view(windows, 4, n, n).softmax(-1)
    heads = torch.where(torch.tensor([False, False, False, True]).view(1, 4, 1, 1), v - p @ v, p @ v)
    expected = attn.proj(heads.transpose(1, 2).reshape(windows, n, c))
    torch.testing.assert_close(attn(x, mask), expected, rtol=1e-5, atol=1e-6)
    attn.fused_attn = False  # the textbook path agrees
    torch.testing.assert_close(attn(x, mask), expected, rtol=1e-5, atol=1e-6)


def test_a_spec_is_read_against_each_stages_own_head_count():
    """(the parser's side: tests/core/test_head_specs.py)"""
    _, model = _pair("0,0,mix,mix")
    assert [block.attn.heads.num_heads for stage in model.layers for block in stage.blocks][::2] == [2, 4]
    model(torch.randn(1, 3, 32, 32)).sum().backward()
    assert model.layers[1].blocks[0].attn.mix_a.grad is not None
