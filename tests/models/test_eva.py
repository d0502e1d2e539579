"""Laplacian heads in timm's EVA family through the one op: timm's model at k = 0, (I - P) V on the chosen heads."""

from __future__ import annotations

import pytest
import torch

import lapheads
from lapheads.core.heads import HeadSpecError
from lapheads.models.eva import LaplacianEvaAttention
from tests.conftest import timm_and_lapheads

NAME, KWARGS = "eva02_tiny_patch14_224", dict(img_size=28, num_classes=10)


def _pair(spec):
    return timm_and_lapheads(NAME, spec, **KWARGS)


def test_zero_heads_are_timms_eva_exactly_and_the_state_dict_is_unchanged():
    plain, model = _pair(0)
    x = torch.randn(2, 3, 28, 28)
    assert all(isinstance(block.attn, LaplacianEvaAttention) for block in model.blocks)
    assert model.state_dict().keys() == plain.state_dict().keys()
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)


def test_laplacian_heads_output_v_minus_pv_with_rotary_q_and_k():
    _, model = _pair(2)
    attn = model.blocks[0].attn
    assert list(attn.heads.flags) == [False, True, True]
    torch.manual_seed(1)
    x = torch.randn(2, 17, attn.proj.in_features)
    q, k, v = attn._qkv(x)  # no rope: the textbook below sees the same q, k
    q, k = attn.q_norm(q), attn.k_norm(k)
    p = (q @ k.transpose(-2, -1) * attn.scale).softmax(-1)
    heads = torch.where(torch.tensor([False, True, True]).view(1, 3, 1, 1), v - p @ v, p @ v)
    expected = attn.proj(attn.norm(heads.transpose(1, 2).reshape(2, 17, -1)))
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)
    images = torch.randn(2, 3, 28, 28)  # the whole model, rotary embeddings included: fused = reference
    fused = model(images)
    for block in model.blocks:
        block.attn.fused_attn = False
    torch.testing.assert_close(model(images), fused, rtol=1e-5, atol=1e-6)


def test_head_kinds_and_their_limits():
    _, model = _pair("ordinary/negated/mix")
    assert model.blocks[0].attn.heads.kinds == ("ordinary", "negated", "mix")
    model(torch.randn(1, 3, 28, 28)).sum().backward()
    assert model.blocks[0].attn.mix_a.grad is not None  # the mix scalars train
    with pytest.raises(HeadSpecError, match="has no local term"):
        lapheads.create_vit(NAME, "local:1", **KWARGS)
