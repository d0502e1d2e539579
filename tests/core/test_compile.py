"""torch.compile: the op and whole models trace as one graph, and the combine keeps SDPA's output layout."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from lapheads import GPT, GPTConfig, create_vit, laplacian_attention

Q = torch.randn(2, 4, 16, 8)
KV = torch.randn(2, 2, 16, 8)
TRIL = torch.ones(16, 16, dtype=torch.bool).tril()
OP_CASES = {
    "int": (lambda q, k, v: laplacian_attention(q, k, v, 2), (Q, Q, Q)),
    "all heads": (lambda q, k, v: laplacian_attention(q, k, v, 4), (Q, Q, Q)),
    "mask tensor": (lambda q, k, v: laplacian_attention(q, k, v, torch.tensor([True, False, True, False])), (Q, Q, Q)),
    "bool list": (lambda q, k, v: laplacian_attention(q, k, v, [False, True, True, False]), (Q, Q, Q)),
    "causal": (lambda q, k, v: laplacian_attention(q, k, v, 2, is_causal=True), (Q, Q, Q)),
    "gqa": (lambda q, k, v: laplacian_attention(q, k, v, 1), (Q, KV, KV)),
    "kv cache": (lambda q, k, v: laplacian_attention(q, k, v, 3, is_causal=True), (Q[:, :, -1:], Q, Q)),
    "attn_mask": (lambda q, k, v: laplacian_attention(q, k, v, 2, attn_mask=TRIL), (Q, Q, Q)),
}


@pytest.mark.parametrize("name", list(OP_CASES))
def test_the_op_has_no_graph_break_and_compiles_to_the_same_numbers(name):
    fn, args = OP_CASES[name]
    assert dynamo.explain(fn)(*args).graph_break_count == 0
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(*args), fn(*args))


def _vit():
    return create_vit(
        "vit_small_patch16_224", "0,1,3", img_size=16, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=5
    )


@pytest.mark.parametrize("arch", ["nanochat-2025", "nanochat-2026"])
@pytest.mark.parametrize("spec", ["1,2", [[True, False, True, False], [False, False, False, True]]], ids=["k", "masks"])
def test_whole_gpt_forward_backward_is_one_graph(arch, spec):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            depth=2,
            vocab_size=40,
            sequence_len=32,
            aspect_ratio=32,
            head_dim=16,
            laplacian_heads=spec,
            arch=arch,
            short_window=4,
            n_kv_head=2,
        )
    )
    idx = torch.randint(0, 40, (2, 16))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(idx, idx)
    loss.backward()
    torch.testing.assert_close(loss, model(idx, idx))


def test_whole_vit_forward_backward_is_one_graph():
    model = _vit()
    x = torch.randn(2, 3, 16, 16)
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("spec", [2, [True, False, True, False], torch.tensor([False, True, False, True])])
def test_the_combine_keeps_the_layout_of_a_packed_qkv_projection(spec):
    qkv = torch.randn(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)  # (3, B, H, T, D) views of a (B, T, 3, H, D) tensor
    q, k, v = qkv.unbind(0)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = laplacian_attention(q, k, v, spec)
    assert out.stride() == plain.stride()  # so transpose(1, 2).reshape(B, T, H * D) is a view, as without it
    assert out.transpose(1, 2).is_contiguous()
