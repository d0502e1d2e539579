"""Gated heads (issue 73): "gated-<kind>" scales a head's output by sigmoid(x w_h), one scalar per head and token
from the layer's input, before the output projection. The ViT and GPT layers against a hand-written reference
(explicit softmax, no lapheads code), the gate's zero start, the spec's grammar and refusals, and round trips."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lapheads
from lapheads.core import HeadSpecError, LayerHeads, laplacian_attention, parse_heads
from lapheads.core.kinds import gate_heads
from lapheads.core.vocabulary import GATEABLE_KINDS, HEAD_KINDS
from lapheads.models.vit import vit_head_kinds

SPEC = "ordinary/gated-laplacian/gated-exclusive/laplacian"  # gated and ungated heads of two kinds side by side


def _vit(spec, seed=0, **kwargs):
    torch.manual_seed(seed)
    options = dict(patch_size=7, embed_dim=32, num_heads=4, depth=2, **kwargs)
    return lapheads.create_vit("vit_fmnist_patch4", spec, **options).double().eval()


def _layer_by_hand(attn, x, kinds, gated):
    """timm's Attention with each head's output written out: softmax(q k^T / sqrt(D)) by hand, the kind's output
    (v - P v for Laplacian, P v minus its component along v for exclusive), times sigmoid(x w_h) where gated."""
    b, n, c = x.shape
    h, d = attn.num_heads, attn.head_dim
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    p = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, -1)
    y = p @ v
    heads = []
    for i, kind in enumerate(kinds):
        out = {"ordinary": y[:, i], "laplacian": v[:, i] - y[:, i]}.get(kind)
        if kind == "exclusive":
            own = v[:, i] / v[:, i].norm(dim=-1, keepdim=True)
            out = y[:, i] - (y[:, i] * own).sum(-1, keepdim=True) * own
        if i in gated:
            w = attn.head_gate.weight[gated.index(i)]
            out = out * torch.sigmoid(x @ w).unsqueeze(-1)
        heads.append(out)
    return torch.stack(heads, 1).transpose(1, 2).reshape(b, n, c) @ attn.proj.weight.T + attn.proj.bias


def test_the_spec_writes_a_gate_on_any_kind_and_reads_back_what_it_saves():
    layers = parse_heads("gated-laplacian:2,ordinary/gated-mix/gated-ordinary/centring", [4, 4])
    assert layers[0].kinds == ("ordinary", "ordinary", "laplacian", "laplacian")
    assert layers[0].gated == (False, False, True, True) and layers[0].gated_heads == (2, 3)
    assert layers[1].names == ("ordinary", "gated-mix", "gated-ordinary", "centring")
    assert [LayerHeads.of_names(heads.names) for heads in layers] == layers  # what configs save reads back
    assert not layers[0].plain and layers[0].plain_kinds and layers[0].trailing == 2  # the op still gets k = 2
    assert LayerHeads(("laplacian",)) == LayerHeads(("laplacian",), (False,))  # no gates written: none
    assert str(layers[0]) == "head kinds ['ordinary', 'ordinary', 'gated-laplacian', 'gated-laplacian']"
    assert set(GATEABLE_KINDS) == set(HEAD_KINDS) - {"local", "untied"}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gated-local:1", "head kind gated-local: a gate scales a head's output before the output projection"),
        ("gated-untied", "allowed gated kinds: gated-ordinary, gated-laplacian"),
        ("gated", "unknown kind 'gated'"),
        ("gated-gated-laplacian", "unknown kind 'gated-gated-laplacian'"),
    ],
)
def test_a_gate_on_a_kind_it_cannot_scale_or_a_bad_name_is_one_line(spec, message):
    with pytest.raises(HeadSpecError, match=message):
        parse_heads(spec, [4])


def test_the_op_refuses_gated_heads_it_would_run_ungated():
    q = k = v = torch.randn(1, 4, 5, 8)
    with pytest.raises(HeadSpecError, match="the op alone would run them ungated"):
        laplacian_attention(q, k, v, parse_heads("gated-laplacian:2", [4])[0])


def test_gate_heads_scales_only_the_gated_heads_token_by_token():
    out = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    logits = torch.randn(2, 5, 2, dtype=torch.float64)
    gated = gate_heads(out, logits, torch.tensor([1, 3]))
    expected = out.clone()
    for j, h in enumerate((1, 3)):
        for b in range(2):
            for t in range(5):
                expected[b, h, t] = out[b, h, t] / (1 + torch.exp(-logits[b, t, j]))
    torch.testing.assert_close(gated, expected, rtol=1e-14, atol=0)
    logits = torch.randn(2, 5, 4, dtype=torch.float64)
    every = gate_heads(out, logits, torch.arange(4))  # the all-gated path: no scale tensor built
    torch.testing.assert_close(every, out * torch.sigmoid(logits).transpose(1, 2).unsqueeze(-1), rtol=1e-14, atol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_a_gated_laplacian_vit_layer_equals_its_hand_written_reference(fused):
    model = _vit(SPEC)
    attn = model.blocks[0].attn
    attn.fused_attn = fused  # the op's fused path, and its textbook path
    with torch.no_grad():
        attn.head_gate.weight.normal_(0, 0.5)  # gates away from their start
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    expected = _layer_by_hand(attn, x, ["ordinary", "laplacian", "exclusive", "laplacian"], [1, 2])
    torch.testing.assert_close(attn(x), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.jit.script(attn)(x), expected, rtol=1e-10, atol=1e-12)  # TorchScript's form


def test_a_new_gate_is_the_fixed_scale_one_half_and_then_trains():
    gated = _vit("gated-laplacian:2")
    plain = _vit(2)  # the same seed: the same weights but the gate
    assert set(gated.state_dict()) - set(plain.state_dict()) == {f"blocks.{i}.attn.head_gate.weight" for i in (0, 1)}
    assert all(block.attn.head_gate.weight.abs().sum() == 0 for block in gated.blocks)  # after timm's init pass
    with torch.no_grad():
        for block in plain.blocks:  # the gated heads' columns of W_O halved: sigmoid(0) = 1/2
            block.attn.proj.weight[:, 16:] *= 0.5
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    torch.testing.assert_close(gated(x), plain(x), rtol=1e-12, atol=1e-12)
    gated.train()
    gated(x).sum().backward()
    assert gated.blocks[0].attn.head_gate.weight.grad.abs().sum() > 0


def test_a_gated_vit_scripts_reports_its_kinds_and_reloads_from_them():
    model = _vit(SPEC)
    assert vit_head_kinds(model) == [["ordinary", "gated-laplacian", "gated-exclusive", "laplacian"]] * 2
    with torch.no_grad():
        model.blocks[1].attn.head_gate.weight.normal_(0, 0.5)
    rebuilt = _vit(",".join("/".join(layer) for layer in vit_head_kinds(model)), seed=1)  # from the saved names
    rebuilt.load_state_dict(model.state_dict())  # strict: the same parameters, gates included
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    torch.testing.assert_close(rebuilt(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(torch.jit.script(model)(x), model(x), rtol=1e-12, atol=1e-12)


def test_a_gated_gpt_equals_halved_output_columns_at_the_start_and_decodes_as_its_full_forward():
    config = lapheads.GPTConfig(depth=2, vocab_size=50, sequence_len=32, aspect_ratio=16, head_dim=8, n_kv_head=2)
    torch.manual_seed(0)
    gated = lapheads.GPT(dataclasses.replace(config, laplacian_heads="ordinary/gated-laplacian/gated-ordinary/mix"))
    gated.init_weights()
    torch.manual_seed(0)
    plain = lapheads.GPT(dataclasses.replace(config, laplacian_heads="ordinary/laplacian/ordinary/mix"))
    plain.init_weights()
    with torch.no_grad():
        for a, b in zip(gated.blocks, plain.blocks):  # output projections away from their zero start
            a.attn.c_proj.weight.normal_(0, 0.1)
            b.attn.c_proj.weight.copy_(a.attn.c_proj.weight)
            b.attn.c_proj.weight[:, 8:24] *= 0.5  # heads 1 and 2, gated at 1/2
    ids = torch.randint(0, 50, (2, 12))
    torch.testing.assert_close(gated(ids), plain(ids), rtol=1e-5, atol=1e-6)
    assert gated.head_kinds() == [["ordinary", "gated-laplacian", "gated-ordinary", "mix"]] * 2
    with torch.no_grad():
        for block in gated.blocks:
            block.attn.head_gate.weight.normal_(0, 0.5)
    full = gated(ids)
    cache = gated.new_kv_cache(2, 12)
    stepped = torch.cat([gated(ids[:, :7], kv_cache=cache)] + [gated(ids[:, t : t + 1], kv_cache=cache)
                                                              for t in range(7, 12)], 1)  # fmt: skip
    torch.testing.assert_close(stepped, full, rtol=1e-4, atol=1e-5)
    rebuilt = lapheads.GPT(lapheads.GPTConfig(**gated.constructor_kwargs()))
    rebuilt.load_state_dict(gated.state_dict())
    torch.testing.assert_close(rebuilt(ids), full, rtol=0, atol=0)


def test_a_module_that_does_not_apply_gates_refuses_them():
    with pytest.raises(HeadSpecError, match="does not apply head gates"):
        lapheads.create_vit("eva02_tiny_1L_patch14_224", "gated-laplacian:1", img_size=56)


def test_the_mechanism_analysis_refuses_gated_heads_it_cannot_take_apart():
    from lapheads.errors import InputError
    from lapheads.geometry.mechanism import head_circuits

    with pytest.raises(InputError, match="has gated heads .*allowed: models without gates"):
        head_circuits(_vit(SPEC))
