"""Head kinds through the one op: every kind's fused path equals the textbook reference, and the spec parser."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lapheads
from lapheads.core import (
    HEAD_KINDS,
    HeadSpecError,
    laplacian_attention,
    laplacian_attention_reference,
    parse_heads,
)
from lapheads.models.vit import vit_head_kinds

KINDS = ("ordinary", "laplacian", "negated", "local", "untied", "sum", "centring", "exclusive", "mix")
MIXED = ("exclusive", "sum", "centring", "mix")  # one model, several kinds


def _qkv(h=4, hkv=4, t=6, s=6, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    make = lambda heads, n: torch.randn(2, heads, n, 8, generator=gen, dtype=torch.float64, requires_grad=grad)  # noqa: E731
    return make(h, t), make(hkv, s), make(hkv, s)


def _mix(h=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(h, generator=gen, dtype=torch.float64) for _ in range(2))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask", ["none", "causal", "padding", "prefix-lm"])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_every_kind_equals_the_reference(kind, mask, hkv):
    q, k, v = _qkv(hkv=hkv)
    kinds = (kind,) * 4 if hkv > 1 else MIXED
    options = {}
    if mask == "causal":
        options["is_causal"] = True
    elif mask == "padding":
        allowed = torch.ones(2, 1, 6, 6, dtype=torch.bool)
        allowed[0, ..., :2] = False  # left padding of sequence 0
        options["attn_mask"] = allowed
    elif mask == "prefix-lm":  # bidirectional over a 3-token prefix, causal after it
        allowed = torch.ones(6, 6, dtype=torch.bool).tril()
        allowed[:, :3] = True
        options["attn_mask"] = allowed
    fused = laplacian_attention(q, k, v, kinds, mix=_mix(), **options)
    reference = laplacian_attention_reference(q, k, v, kinds, mix=_mix(), **options)
    assert torch.allclose(fused, reference, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kinds", [("centring",) * 4, MIXED, ("negated",) * 4])
def test_cached_decoding_equals_the_full_forward(kinds):
    q, k, v = _qkv(t=7, s=7)
    full = laplacian_attention(q, k, v, kinds, mix=_mix(), is_causal=True)
    for t in (1, 3):  # the last t queries against every key so far (a KV cache)
        step = laplacian_attention(q[:, :, -t:], k, v, kinds, mix=_mix(), is_causal=True)
        assert torch.allclose(step, full[:, :, -t:], atol=1e-12)


@pytest.mark.parametrize("kinds", [MIXED, ("centring", "centring", "negated", "negated")])
def test_gradients_match_finite_differences(kinds):
    q, k, v = _qkv(t=4, s=4, hkv=2, grad=True)
    a, b = (x.clone().requires_grad_(True) for x in _mix())
    fn = lambda q, k, v, a, b: laplacian_attention(q, k, v, kinds, mix=(a, b), is_causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, a, b))


def test_mix_at_its_start_is_exactly_ordinary_and_at_one_minus_one_exactly_laplacian():
    q, k, v = _qkv()
    start = (torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    assert torch.equal(laplacian_attention(q, k, v, ("mix",) * 4, mix=start), laplacian_attention(q, k, v, 0))
    laplacian = (torch.ones(4, dtype=torch.float64), -torch.ones(4, dtype=torch.float64))
    assert torch.equal(laplacian_attention(q, k, v, ("mix",) * 4, mix=laplacian), laplacian_attention(q, k, v, 4))


def test_centring_removes_the_attended_mean_without_attention():
    q, k, v = _qkv()
    out = laplacian_attention(q, k, v, ("centring",) * 4, is_causal=True)
    running_mean = v.cumsum(-2) / torch.arange(1, 7, dtype=torch.float64)[:, None]
    assert torch.allclose(out, v - running_mean) and torch.allclose(
        out[..., 0, :], torch.zeros(2, 4, 8, dtype=torch.float64)
    )


@pytest.mark.slow
def test_compiled_kinds_have_no_graph_break():
    q, k, v = (x.float() for x in _qkv())
    mix = tuple(x.float() for x in _mix())
    fn = torch.compile(
        lambda q, k, v: laplacian_attention(q, k, v, list(MIXED), mix=mix, is_causal=True),
        fullgraph=True,
        backend="eager",
    )
    assert torch.allclose(fn(q, k, v), laplacian_attention(q, k, v, MIXED, mix=mix, is_causal=True), atol=1e-6)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("negated", [("negated",) * 3] * 2),
        ("negated:1+laplacian:1", [("ordinary", "negated", "laplacian")] * 2),
        ("ordinary/centring/local", [("ordinary", "centring", "local")] * 2),
        ("0,mix", [("ordinary",) * 3, ("mix",) * 3]),
        ("2", [("ordinary", "laplacian", "laplacian")] * 2),
        (1, [("ordinary", "ordinary", "laplacian")] * 2),
        (
            [[True, False, True], "negated:1"],
            [("laplacian", "ordinary", "laplacian"), ("ordinary", "ordinary", "negated")],
        ),
    ],
)
def test_the_one_parser_reads_kinds_and_counts(spec, expected):
    layers = parse_heads(spec, [3, 3])
    assert [heads.kinds for heads in layers] == expected
    assert [heads.plain for heads in layers] == [all(k in ("ordinary", "laplacian") for k in e) for e in expected]


@pytest.mark.parametrize("spec", ["2", "ordinary/laplacian/ordinary/laplacian", "negated:1+laplacian:1", "exclusive"])
def test_the_op_takes_a_layers_parsed_heads_as_it_takes_their_written_form(spec):
    q, k, v = _qkv()
    heads = parse_heads(spec, [4])[0]
    written = list(heads.kinds)
    for op in (laplacian_attention, laplacian_attention_reference):
        torch.testing.assert_close(op(q, k, v, heads, is_causal=True), op(q, k, v, written, is_causal=True))
    assert heads.op_spec == (2 if spec == "2" else heads.kinds)  # trailing heads: k, the op's one-node path


@pytest.mark.parametrize(
    "spec, message",
    [
        ("sharpen", "unknown kind 'sharpen'"),
        ("negated:4", "asks for 4 heads of 3"),
        ("ordinary/negated", "names 2 heads"),
        ("0,1,2", "has 3 entries"),
        ("neg ated", "is not a head spec"),
    ],
)
def test_bad_kind_specs_are_one_line_errors(spec, message):
    with pytest.raises(HeadSpecError, match=message):
        parse_heads(spec, [3, 3])


def test_a_vit_with_three_kinds_trains_scripts_and_reports_its_kinds():
    model = lapheads.create_vit(
        "vit_fmnist_patch4", "ordinary/negated/laplacian,mix,local:1+centring:1", patch_size=7, depth=3
    )
    assert vit_head_kinds(model) == [
        ["ordinary", "negated", "laplacian"],
        ["mix"] * 3,
        ["ordinary", "local", "centring"],
    ]
    assert model.blocks[1].attn.mix_a.shape == (3,) and model.blocks[2].attn.local_o.weight.abs().sum() == 0
    x = torch.randn(2, 1, 28, 28)
    model(x).sum().backward()
    assert model.blocks[1].attn.mix_b.grad is not None and model.blocks[2].attn.local_o.weight.grad.abs().sum() > 0
    model.eval()
    scripted = torch.jit.script(model)
    assert torch.allclose(scripted(x), model(x))


def test_a_vit_of_mix_heads_at_init_has_the_ordinary_models_logits():
    torch.manual_seed(0)
    plain = lapheads.create_vit("vit_fmnist_patch4", 0, patch_size=7).eval()
    mixed = lapheads.create_vit("vit_fmnist_patch4", "mix", patch_size=7).eval()
    mixed.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(mixed(x), plain(x))
    assert set(mixed.state_dict()) - set(plain.state_dict()) == {
        f"blocks.{i}.attn.mix_{c}" for i in range(6) for c in "ab"
    }


def test_every_kind_is_named():
    assert set(KINDS) == set(HEAD_KINDS)


def _by_hand(q, k, v, is_causal=False):
    """softmax(q k^T / sqrt(D)) v per head, with explicit loops' worth of einsum: no lapheads code."""
    logits = torch.einsum("bhtd,bhsd->bhts", q, k) / q.shape[-1] ** 0.5
    if is_causal:
        logits = logits.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhts,bhsd->bhtd", logits.softmax(-1), v)


@pytest.mark.parametrize("op", [laplacian_attention, laplacian_attention_reference])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sum_and_exclusive_heads_equal_a_hand_computation(op, is_causal):
    q, k, v = _qkv()
    y = _by_hand(q, k, v, is_causal)
    assert torch.allclose(op(q, k, v, ("sum",) * 4, is_causal=is_causal), v + y, atol=1e-12, rtol=0)
    # XSA: z_i = y_i - (y_i . v_i / |v_i|^2) v_i, token by token
    z = torch.empty_like(y)
    for b, h, i in torch.cartesian_prod(torch.arange(2), torch.arange(4), torch.arange(6)).tolist():
        own = v[b, h, i]
        z[b, h, i] = y[b, h, i] - (y[b, h, i] @ own) / (own @ own) * own
    out = op(q, k, v, ("exclusive",) * 4, is_causal=is_causal)
    assert torch.allclose(out, z, atol=1e-12, rtol=0)
    assert torch.allclose((out * v).sum(-1), torch.zeros(2, 4, 6, dtype=v.dtype), atol=1e-12)  # orthogonal to v
    mixed = op(q, k, v, ("ordinary", "sum", "exclusive", "laplacian"), is_causal=is_causal)
    assert torch.allclose(mixed, torch.stack([y[:, 0], (v + y)[:, 1], z[:, 2], (v - y)[:, 3]], 1), atol=1e-12)


def test_an_exclusive_head_of_a_zero_value_outputs_its_attention():
    q, k, v = _qkv()
    v[0, :, 2] = 0.0  # token 2 of sequence 0 has a zero value: nothing to project out
    out = laplacian_attention(q, k, v, ("exclusive",) * 4)
    assert torch.isfinite(out).all() and torch.allclose(out[0, :, 2], _by_hand(q, k, v)[0, :, 2], atol=1e-12)


def test_untied_heads_start_as_the_laplacian_model_of_the_same_seed_and_then_untie():
    torch.manual_seed(0)
    laplacian = lapheads.create_vit("vit_fmnist_patch4", 3, patch_size=7, depth=2).eval()
    torch.manual_seed(0)
    untied = lapheads.create_vit("vit_fmnist_patch4", "untied:3", patch_size=7, depth=2).eval()
    shared = laplacian.state_dict()
    own = untied.state_dict()
    assert set(own) - set(shared) == {f"blocks.{i}.attn.untied_{n}" for i in range(2) for n in ("v", "v_bias", "o")}
    assert all(torch.equal(own[name], value) for name, value in shared.items())  # no random draw: same weights
    x = torch.randn(2, 1, 28, 28)
    assert torch.allclose(untied(x), laplacian(x), atol=1e-5, rtol=0)  # -W_O P V + W_O W_V x = W_O (V - P V)
    for fused in (True, False):  # the reference path too
        for model in (untied, laplacian):
            for block in model.blocks:
                block.attn.fused_attn = fused
        assert torch.allclose(untied(x), laplacian(x), atol=1e-5, rtol=0)
    untied.train()
    untied(x).sum().backward()
    assert untied.blocks[0].attn.untied_o.grad.abs().sum() > 0 and untied.blocks[0].attn.untied_v.grad.abs().sum() > 0
    assert torch.allclose(torch.jit.script(untied.eval())(x), untied(x))


def test_untied_heads_are_refused_where_a_model_has_no_local_term():
    config = lapheads.GPTConfig(depth=2, vocab_size=64, sequence_len=16, aspect_ratio=32, head_dim=32)
    with pytest.raises(HeadSpecError, match="untied"):
        lapheads.GPT(dataclasses.replace(config, laplacian_heads="untied:1"))


def test_the_kinds_parameters_take_the_modules_dtype():
    """Kinds set on a half-precision model (as a reload does) give half-precision (a, b) and local terms."""
    model = lapheads.create_vit(
        "vit_small_patch16_224", 0, img_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=2
    )
    model = model.half()
    attn = model.blocks[0].attn
    attn.set_laplacian_heads(["mix", "laplacian"])
    assert attn.mix_a.dtype == attn.mix_b.dtype == torch.float16
    attn.set_laplacian_heads(["local", "untied"])
    assert {p.dtype for p in attn.parameters()} == {torch.float16}
