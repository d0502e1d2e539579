"""The diffusion diagnostic on heads whose behaviour is known by construction."""

from __future__ import annotations

import pytest
import torch

from lapheads import GPT, GPTConfig, create_vit, laplacian_attention
from lapheads.geometry.mechanism import circuit_scores, ov_circuits, smoothing_indices


def test_scores_of_plus_and_minus_identity_and_a_random_circuit():
    assert circuit_scores(-torch.eye(8), laplacian=True) == pytest.approx(
        {
            "alignment": -1.0,
            "alignment_full": -1.0,
            "diffusion": 1.0,
            "as_laplacian": 1.0,
            "size": 1.0,
            "laplacian": True,
        }
    )
    assert circuit_scores(torch.eye(8), laplacian=True)["diffusion"] == pytest.approx(
        -1.0
    )  # a Laplacian head that sharpens
    assert circuit_scores(torch.eye(8) * 2, laplacian=False) == pytest.approx(
        {
            "alignment": 1.0,
            "alignment_full": 1.0,
            "diffusion": 1.0,
            "as_laplacian": -1.0,
            "size": 2.0,
            "laplacian": False,
        }
    )
    random = circuit_scores(torch.randn(400, 400, generator=torch.Generator().manual_seed(0)), laplacian=False)
    assert abs(random["alignment"]) < 0.05


def test_a_laplacian_head_with_minus_identity_circuit_pulls_tokens_together():
    """The defining behaviour behind the score: with W_O W_V = -I a Laplacian head moves each token toward the
    attention-weighted mean of the others (less spread after the residual update); with +I it spreads them."""
    x = torch.randn(1, 1, 12, 8, generator=torch.Generator().manual_seed(1))
    spread = lambda t: float((t - t.mean(2, keepdim=True)).norm())  # noqa: E731
    for sign, shrinks in ((-1.0, True), (+1.0, False)):
        update = sign * laplacian_attention(x, x, x, 1)  # W_O W_V = sign * I, v = x
        assert (spread(x + 0.5 * update) < spread(x)) == shrinks


def _set_circuit(w_o_block: torch.Tensor, w_v_block: torch.Tensor, sign: float) -> None:
    with torch.no_grad():
        w_v_block.copy_(torch.eye(*w_v_block.shape))
        w_o_block.copy_(sign * torch.eye(*w_o_block.shape))


def test_ov_circuits_read_the_heads_of_a_vit_and_a_gpt():
    vit = create_vit("vit_small_patch16_224", 1, img_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=2)
    attn = vit.blocks[0].attn  # 2 heads of 4 dims; head 1 is Laplacian
    with torch.no_grad():
        attn.qkv.weight.zero_()
        attn.proj.weight.zero_()
        attn.qkv.weight[16:24].copy_(torch.eye(8))  # W_V = I for both heads
        attn.proj.weight.copy_(-torch.eye(8))  # W_O = -I
    heads = ov_circuits(vit)[0]
    # each head's circuit is -I on its own 4 of the 8 dims: the attainable -1 (the full-identity cosine: -1/sqrt 2)
    assert [h["laplacian"] for h in heads] == [False, True]
    assert heads[1]["diffusion"] == pytest.approx(1.0) and heads[0]["diffusion"] == pytest.approx(-1.0)
    assert heads[1]["alignment_full"] == pytest.approx(-(0.5**0.5))
    gpt = GPT(GPTConfig(depth=1, vocab_size=10, aspect_ratio=8, head_dim=4, laplacian_heads=1, n_kv_head=1))
    attn = gpt.blocks[0].attn  # 2 query heads share 1 kv head
    with torch.no_grad():
        attn.c_v.weight.copy_(torch.eye(4, 8))
        attn.c_proj.weight.copy_(torch.cat([torch.eye(8, 4), -torch.eye(8, 4)], dim=1))
    heads = ov_circuits(gpt)[0]
    # head 0's circuit is +I on the first 4 of 8 dims (attainable: 1; full-identity cosine 1/sqrt 2), head 1's -I
    assert heads[0]["alignment"] == pytest.approx(1.0) and heads[1]["alignment"] == pytest.approx(-1.0)
    assert heads[1]["laplacian"] and heads[1]["diffusion"] == pytest.approx(1.0)
    assert heads[0]["alignment_full"] == pytest.approx(0.5**0.5)


def _layerscale_vit(seed: int = 0):
    """A ViT block (3 heads of 4 dims, 12 channels, LayerScale of mixed signs) whose whole circuit for head 2
    (Laplacian) is -c P on its subspace and for head 0 (ordinary) the same -c P on another subspace."""
    vit = create_vit(
        "vit_small_patch16_224", 1, img_size=16, patch_size=8, embed_dim=12, depth=1, num_heads=3, init_values=1e-6
    )
    block, attn = vit.blocks[0], vit.blocks[0].attn
    gen = torch.Generator().manual_seed(seed)
    gain = torch.randn(12, generator=gen)  # ~half negative, as AdamW leaves LayerScale
    gamma = 0.5 + torch.rand(12, generator=gen)
    basis, _ = torch.linalg.qr(torch.randn(12, 12, generator=gen, dtype=torch.float64))
    c = 0.3
    with torch.no_grad():
        block.ls1.gamma.copy_(gain)
        block.norm1.weight.copy_(gamma)
        attn.qkv.weight[24:].zero_()
        attn.proj.weight.zero_()
        for h in (0, 2):
            u = basis[:, 4 * h : 4 * h + 4]  # (C, D) orthonormal: P = u u^T
            attn.qkv.weight[24 + 4 * h : 24 + 4 * h + 4].copy_((u.T / gamma.double()).float())  # W_V = u^T diag(1/γ)
            attn.proj.weight[:, 4 * h : 4 * h + 4].copy_((-c * u / gain.double()[:, None]).float())  # diag(1/g)(-c u)
        attn.proj.weight[:, 4:8].copy_(torch.randn(12, 4, generator=gen))
        attn.qkv.weight[28:32].copy_(torch.randn(4, 12, generator=gen))
    return vit


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_whole_circuit_sees_through_layerscale_of_mixed_sign(seed):
    vit = _layerscale_vit(seed)
    assert [h["laplacian"] for h in ov_circuits(vit)[0]] == [False, False, True]
    heads = ov_circuits(vit)[0]
    assert heads[2]["diffusion"] >= 0.9  # Laplacian head, circuit -c P: diffusive, at the attainable
    assert heads[0]["diffusion"] <= -0.9  # the same circuit in an ordinary head pushes tokens apart
    assert heads[0]["as_laplacian"] >= 0.9  # and would read diffusive in a Laplacian head: the null
    # the old score (no LayerScale) is scrambled by the mixed signs: nowhere near the attainable
    block = vit.blocks[0]
    with torch.no_grad():
        saved = block.ls1.gamma.clone()
        block.ls1.gamma.fill_(1.0)
        old = ov_circuits(vit)[0][2]["diffusion"]
        block.ls1.gamma.copy_(saved)
    assert old < 0.5


def test_the_smoothing_index_from_data_follows_the_circuit():
    torch.manual_seed(0)
    vit = _layerscale_vit(0)
    images = [torch.randn(4, 3, 16, 16) for _ in range(2)]
    index = smoothing_indices(vit, images)[0]
    assert index[2] > 0  # the Laplacian head with a -c P circuit lowers the within-sequence variance
    with torch.no_grad():  # flip its circuit to +c P: it sharpens
        vit.blocks[0].attn.proj.weight[:, 8:12].neg_()
    assert smoothing_indices(vit, images)[0][2] < 0
