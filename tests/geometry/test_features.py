"""Residual-stream capture: the hooked tensors are the model's own intermediate tokens, and hooks go away."""

from __future__ import annotations

import pytest
import torch

import lapheads
from lapheads.geometry import ResidualStream, layer_names, select_layers


@pytest.fixture
def vit():
    torch.manual_seed(0)
    return lapheads.create_vit(
        "vit_fmnist_patch4", laplacian_heads="0,1", depth=2, embed_dim=32, num_heads=2, patch_size=7
    ).eval()


def test_captured_tokens_are_the_blocks_inputs_and_outputs(vit):
    x = torch.randn(3, 1, 28, 28)
    assert layer_names(vit) == ["embed", "1", "2", "norm"]
    with ResidualStream(vit, head_input=True) as stream, torch.no_grad():
        logits = vit(x)
    with torch.no_grad():
        embed = vit.norm_pre(vit._pos_embed(vit.patch_embed(x)))
        first = vit.blocks[0](embed)
        second = vit.blocks[1](first)
        final = vit.norm(second)
    for name, expected in (("embed", embed), ("1", first), ("2", second), ("norm", final)):
        assert stream.tokens[name].shape == (3, 17, 32)
        torch.testing.assert_close(stream.tokens[name], expected)
    torch.testing.assert_close(vit.head(stream.head_input), logits)


def test_hooks_are_removed_on_exit(vit):
    with ResidualStream(vit, ["2"]) as stream, torch.no_grad():
        vit(torch.randn(1, 1, 28, 28))
    assert list(stream.tokens) == ["2"]
    before = stream.tokens["2"]
    with torch.no_grad():
        vit(torch.randn(1, 1, 28, 28))
    assert stream.tokens["2"] is before
    assert all(not block._forward_hooks and not block._forward_pre_hooks for block in vit.blocks)


def test_layer_selection(vit):
    assert select_layers(vit, "all") == ["embed", "1", "2", "norm"]
    assert select_layers(vit, "norm,1") == ["1", "norm"]
    with pytest.raises(ValueError, match="unknown layers 7; allowed: all, or a comma list of embed, 1, 2, norm"):
        select_layers(vit, "1,7")
    with pytest.raises(ValueError, match="no `blocks`"):
        layer_names(torch.nn.Linear(2, 2))
