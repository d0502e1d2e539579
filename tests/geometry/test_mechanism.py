"""The diffusion diagnostic on heads whose behaviour is known by construction."""

from __future__ import annotations

import math

import pytest
import torch

from lapheads import GPT, GPTConfig, create_vit, laplacian_attention
from lapheads.geometry.anova import anova
from lapheads.geometry.mechanism import circuit_scores, expected_sign, head_effects, ov_circuits


def test_scores_of_plus_and_minus_identity_and_a_random_circuit():
    assert circuit_scores(-torch.eye(8), "laplacian") == pytest.approx(
        {
            "alignment": -1.0,
            "alignment_full": -1.0,
            "expected_sign": 1,
            "diffusion": 1.0,
            "as_laplacian": 1.0,
            "size": 1.0,
            "laplacian": True,
            "kind": "laplacian",
        }
    )
    assert circuit_scores(torch.eye(8), "laplacian")["diffusion"] == pytest.approx(
        -1.0
    )  # a Laplacian head that sharpens
    # an ordinary head with +I copies what it attends to: it can only raise the within-sequence variance
    assert circuit_scores(torch.eye(8) * 2, "ordinary") == pytest.approx(
        {
            "alignment": 1.0,
            "alignment_full": 1.0,
            "expected_sign": 1,
            "diffusion": -1.0,
            "as_laplacian": -1.0,
            "size": 2.0,
            "laplacian": False,
            "kind": "ordinary",
        }
    )
    random = circuit_scores(torch.randn(400, 400, generator=torch.Generator().manual_seed(0)), "ordinary")
    assert abs(random["alignment"]) < 0.05


@pytest.mark.parametrize(
    "kind, mix, sign",
    [
        ("ordinary", None, 1),  # tau = tau(P) in [0, 1]
        ("laplacian", None, 1),  # 1 - tau(P)
        ("negated", None, -1),
        ("sum", None, 1),  # 1 + tau(P)
        ("centring", None, 1),  # the token itself minus the mean: tau = 1
        ("exclusive", None, None),  # not linear in P V
        ("local", None, None),  # a second, untied circuit
        ("untied", None, None),
        ("mix", (0.0, 1.0), 1),  # started as an ordinary head
        ("mix", (-1.0, 1.0), -1),  # -(V - P V): a Laplacian head with W_O negated
        ("mix", (0.5, -1.0), 0),  # a + b tau(P) changes sign with P
        ("mix", (0.0, 0.0), 0),  # off
    ],
)
def test_each_kind_has_the_sign_its_token_operator_has_for_every_p(kind, mix, sign):
    assert expected_sign(kind, mix) == sign
    scores = circuit_scores(-torch.eye(4), kind, mix=mix)
    assert scores["diffusion"] == (None if not sign else pytest.approx(sign))
    if kind == "mix":
        assert scores["mix_angle"] == pytest.approx(math.degrees(math.atan2(mix[1], mix[0])))


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
    # both lower the within-sequence variance: the Laplacian head by a heat step, the ordinary one by shrinking
    # what it attends to (how much each does is P's business: p_diffusion)
    assert heads[1]["diffusion"] == pytest.approx(1.0) and heads[0]["diffusion"] == pytest.approx(1.0)
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
    assert heads[0]["diffusion"] >= 0.9  # the same circuit in an ordinary head shrinks the tokens it attends to
    assert heads[0]["as_laplacian"] >= 0.9  # and would read diffusive in a Laplacian head: the null
    # the old score (no LayerScale) is scrambled by the mixed signs: nowhere near the attainable
    block = vit.blocks[0]
    with torch.no_grad():
        saved = block.ls1.gamma.clone()
        block.ls1.gamma.fill_(1.0)
        old = ov_circuits(vit)[0][2]["diffusion"]
        block.ls1.gamma.copy_(saved)
    assert old < 0.5


def _uniform_attention(vit) -> None:
    """W_Q = W_K = 0: every head's P is uniform, so tau(P) = (tr P - 1) / (T - 1) = 0 exactly."""
    with torch.no_grad():
        for block in vit.blocks:
            block.attn.qkv.weight[: 2 * block.attn.qkv.weight.shape[1]].zero_()
            if block.attn.qkv.bias is not None:
                block.attn.qkv.bias.zero_()


def test_tau_is_the_kinds_token_gain_and_p_diffusion_weighs_the_circuit_by_it():
    torch.manual_seed(0)
    vit = _layerscale_vit(0)
    vit.blocks[0].attn.set_laplacian_heads(["ordinary", "sum", "laplacian"])
    _uniform_attention(vit)
    images = [torch.randn(4, 3, 16, 16) for _ in range(2)]
    heads = head_effects(vit, images)[0]
    circuits = ov_circuits(vit)[0]
    # uniform P: an ordinary head adds one vector to every token (tau 0), sum and Laplacian heads keep the token
    assert [h["tau"] for h in heads] == pytest.approx([0.0, 1.0, 1.0], abs=1e-6)  # P in float32
    assert heads[2]["p_diffusion"] == pytest.approx(-circuits[2]["alignment"]) and heads[2]["p_diffusion"] > 0.9
    assert heads[0]["p_diffusion"] == pytest.approx(0.0, abs=1e-6)


def test_fraction_drop_is_the_fraction_change_when_only_that_head_writes():
    """An independent path: the block's own attention with every other head's W_O columns (and the projection's
    bias) zeroed writes exactly that head's whole write through LayerScale; its within-sequence fraction change
    is the index, for heads of every kind, local and untied terms included."""
    torch.manual_seed(0)
    vit = create_vit(
        "vit_small_patch16_224", 1, img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=4, init_values=0.5
    )
    attn = vit.blocks[0].attn
    attn.set_laplacian_heads(["ordinary", "local", "untied", "mix"])
    with torch.no_grad():
        for parameter in attn.parameters():  # every parameter non-trivial, local W_O' and mix (a, b) included
            parameter.add_(0.1 * torch.randn_like(parameter))
    vit.eval()
    images = [torch.randn(3, 3, 16, 16) for _ in range(2)]
    heads = head_effects(vit, images)[0]
    dim = attn.head_dim
    for h in range(4):
        trial = create_vit(
            "vit_small_patch16_224", 1, img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=4, init_values=0.5
        )
        trial.blocks[0].attn.set_laplacian_heads(["ordinary", "local", "untied", "mix"])
        trial.load_state_dict(vit.state_dict())
        trial.eval()
        t_attn = trial.blocks[0].attn
        with torch.no_grad():
            keep = torch.zeros_like(t_attn.proj.weight)
            keep[:, h * dim : (h + 1) * dim] = 1
            t_attn.proj.weight.mul_(keep)
            t_attn.proj.bias.zero_()
            if h != 1:
                t_attn.local_o.weight.zero_()
            if h != 2:
                t_attn.untied_o.zero_()
        before, after = [], []
        for batch in images:
            x = trial.patch_embed(batch)
            x = trial._pos_embed(x)
            x = trial.norm_pre(trial.patch_drop(x))
            before.append(x)
            after.append(x + trial.blocks[0].ls1(t_attn(trial.blocks[0].norm1(x))))
        expected = anova(torch.cat(before))["within_seq_fraction"] - anova(torch.cat(after))["within_seq_fraction"]
        assert heads[h]["fraction_drop"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert heads[1]["tau"] is None and heads[2]["tau"] is None  # two circuits: one tau cannot speak for them
    assert heads[3]["tau"] is not None


def test_head_effects_of_a_gpt_read_the_data_without_p():
    gpt = GPT(GPTConfig(depth=2, vocab_size=10, aspect_ratio=8, head_dim=4, laplacian_heads=1))
    gpt.init_weights()
    tokens = [torch.randint(0, 10, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    effects = head_effects(gpt, tokens)
    assert len(effects) == 2 and all(h["tau"] is None and math.isfinite(h["fraction_drop"]) for h in effects[0])
