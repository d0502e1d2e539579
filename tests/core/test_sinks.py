"""Learned attention sinks in the op (GPT-OSS's form): against an independent per-head formula, with gradients."""

from __future__ import annotations

import pytest
import torch

from lapheads import laplacian_attention, laplacian_attention_reference
from lapheads.core.masks import SlidingWindow
from lapheads.errors import InputError
from tests.core.test_attention import H, as_mask, dense_heads, qkv


def _causal(t, s):
    return torch.ones(t, s, dtype=torch.bool).tril(s - t)


@pytest.mark.parametrize("spec", [0, 1, H, [True, False, True, False]], ids=str)
@pytest.mark.parametrize("hkv", [H, 2])
@pytest.mark.parametrize(("t", "s", "mask"), [(7, 7, "causal"), (7, 7, None), (3, 9, "causal"), (7, 7, "bool")])
def test_sinks_give_the_per_head_formula_and_its_gradients(spec, hkv, t, s, mask):
    q, k, v = (x.requires_grad_() for x in qkv(hkv=hkv, t=t, s=s))
    sinks = torch.randn(H, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    allowed = _causal(t, s) if mask == "causal" else None
    options = {"is_causal": mask == "causal"}
    if mask == "bool":  # a padded batch row: keys 0-1 hidden from every query of it
        allowed = torch.ones(t, s, dtype=torch.bool)
        allowed[:, :2] = False
        options = {"attn_mask": allowed}
    expected = dense_heads(q, k, v, as_mask(spec), allowed=allowed, sinks=sinks)
    weights = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    wanted = torch.autograd.grad((expected * weights).sum(), (q, k, v, sinks))
    for fn in (laplacian_attention, laplacian_attention_reference):
        out = fn(q, k, v, spec, sinks=sinks, **options)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
        for got, want in zip(torch.autograd.grad((out * weights).sum(), (q, k, v, sinks)), wanted):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_a_sink_takes_mass_from_every_head_and_zero_sinks_at_minus_infinity_change_nothing():
    q, k, v = qkv()
    plain = laplacian_attention(q, k, v, 2, is_causal=True)
    silent = torch.full((H,), float("-inf"), dtype=torch.float64)
    torch.testing.assert_close(laplacian_attention(q, k, v, 2, is_causal=True, sinks=silent), plain)
    loud = laplacian_attention(q, k, v, 0, is_causal=True, sinks=torch.full((H,), 30.0, dtype=torch.float64))
    assert loud.abs().max() < 1e-6  # nearly all the mass on the sink, whose value is zero


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"sinks": torch.zeros(H + 1)}, f"sinks of ({H + 1},); allowed: a float tensor of shape ({H},)"),
        ({"sinks": torch.zeros(H, dtype=torch.long)}, "allowed: a float tensor of shape"),
        ({"sinks": [0.0] * H}, "sinks of list; allowed"),
        ({"sinks": torch.zeros(H), "attn_mask": SlidingWindow(2)}, "sinks with an attention pattern; allowed"),
    ],
)
def test_bad_sinks_are_refused_in_one_line(kwargs, words):
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(InputError) as caught:
        laplacian_attention(q, k, v, 1, **kwargs)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_centring_heads_refuse_sinks_whose_key_their_mean_would_count():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(InputError, match="sinks with centring heads; allowed"):
        laplacian_attention(q, k, v, ["centring"] + ["ordinary"] * (H - 1), sinks=torch.zeros(H))
