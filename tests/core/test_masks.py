"""Attention patterns (lapheads.core.masks): every backend against the dense reference, the backend each call takes,
and bad patterns refused in one line. FlexAttention is compiled once per pattern kind and dtype: a few seconds each."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from lapheads.core.attention import laplacian_attention, laplacian_attention_reference
from lapheads.core.masks import BANDED_CHUNK, Documents, PrefixLM, SlidingWindow, attention_backend
from lapheads.errors import InputError

B, H, HKV, T, D = 2, 4, 2, 300, 16  # T > BANDED_CHUNK: a window of 40 takes FlexAttention without a gradient


def _documents() -> Documents:
    ids = torch.repeat_interleave(torch.tensor([0, 1, 2]), torch.tensor([100, 120, 80])).repeat(B, 1)
    ids[1, :50] = 7  # the rows differ: the mask has B rows
    return Documents(ids)


PATTERNS = {
    "window": lambda: SlidingWindow(40),
    "documents": _documents,
    "prefix": lambda: PrefixLM(37),
    "window & documents": lambda: SlidingWindow(40) & _documents(),
}


def _qkv(dtype=torch.float32, t=T, s=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, t, D, generator=g).to(dtype)
    return q, torch.randn(B, HKV, s, D, generator=g).to(dtype), torch.randn(B, HKV, s, D, generator=g).to(dtype)


@pytest.mark.parametrize("name", PATTERNS)
def test_each_pattern_runs_through_flex_attention_with_laplacian_heads_as_the_dense_reference(name):
    pattern = PATTERNS[name]()
    q, k, v = _qkv()
    with torch.no_grad():
        assert attention_backend(q, k, pattern) == "flex"
        out = laplacian_attention(q, k, v, 2, attn_mask=pattern)
    torch.testing.assert_close(out, laplacian_attention_reference(q, k, v, 2, attn_mask=pattern), atol=2e-6, rtol=0)


def test_bf16_flex_attention_agrees_with_bf16_dense_attention():
    pattern = SlidingWindow(40)
    q, k, v = _qkv(torch.bfloat16)
    with torch.no_grad():
        out = laplacian_attention(q, k, v, 2, attn_mask=pattern)
        dense = laplacian_attention(q, k, v, 2, attn_mask=pattern.dense(B, T, T, "cpu"))
    reference = laplacian_attention_reference(q.float(), k.float(), v.float(), 2, attn_mask=pattern)
    # each within bf16 rounding of the fp32 reference, and of each other
    assert (out.float() - reference).abs().max() <= 2 * (dense.float() - reference).abs().max() + 1e-2


@pytest.mark.parametrize("name", PATTERNS)
def test_a_cpu_gradient_through_a_pattern_is_the_references(name):
    pattern = PATTERNS[name]()
    inputs = [x.requires_grad_() for x in _qkv()]
    twins = [x.detach().clone().requires_grad_() for x in inputs]
    out = laplacian_attention(*inputs, [False, True, False, True], attn_mask=pattern)
    assert attention_backend(inputs[0], inputs[1], pattern) == ("banded" if pattern.band is not None else "dense")
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    reference = laplacian_attention_reference(*twins, [False, True, False, True], attn_mask=pattern)
    (reference * weights).sum().backward()
    torch.testing.assert_close(out, reference, atol=2e-6, rtol=0)
    for ours, theirs in zip(inputs, twins):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("t", [1, 5, 200])
def test_a_kv_cache_aligns_the_window_bottom_right(t):
    """Decoding (1 query), a short chunk and a long prefill after a cache: the queries are the last T keys."""
    pattern = SlidingWindow(40)
    q, k, v = _qkv(t=t, s=T)
    with torch.no_grad():
        assert attention_backend(q, k, pattern) == ("banded" if t <= BANDED_CHUNK else "flex")
        out = laplacian_attention(q, k, v, 3, attn_mask=pattern)
    torch.testing.assert_close(out, laplacian_attention_reference(q, k, v, 3, attn_mask=pattern), atol=2e-6, rtol=0)


@pytest.mark.parametrize("t", [1, 5])
def test_decoding_through_a_pattern_without_a_band_takes_its_small_dense_mask(t):
    """Batched decoding keeps each row's padding apart with Documents over every key (lapheads.apps.batching): one
    query against the cache through a small mask, no FlexAttention compile per key length (inductor's CPU template
    failed to compile a one-query block mask)."""
    pattern = _documents()
    q, k, v = _qkv(t=t, s=T)
    with torch.no_grad():
        assert attention_backend(q, k, pattern) == "dense"
        out = laplacian_attention(q, k, v, 3, attn_mask=pattern)
    torch.testing.assert_close(out, laplacian_attention_reference(q, k, v, 3, attn_mask=pattern), atol=2e-6, rtol=0)


def test_the_layers_of_one_forward_build_a_patterns_dense_mask_once(monkeypatch):
    """A pattern keeps its last dense mask: the layers of a step (sharing the step's documents pattern) build it once,
    and a call of another shape builds its own (the mask equal to the pattern's, either way)."""
    pattern, built = _documents(), []
    dense = Documents.dense
    monkeypatch.setattr(Documents, "dense", lambda self, *args: built.append(args) or dense(self, *args))
    q, k, v = _qkv(t=1, s=T)
    with torch.no_grad():
        outs = [laplacian_attention(q, k, v, 3, attn_mask=pattern) for _ in range(4)]  # four layers' calls
        assert len(built) == 1 and all(torch.equal(out, outs[0]) for out in outs)
        laplacian_attention(*_qkv(t=2, s=T), 3, attn_mask=pattern)
    assert len(built) == 2


def test_head_kinds_with_a_pattern_take_its_backend_for_the_attended_mean_too():
    pattern = SlidingWindow(40)
    kinds = ["ordinary", "centring", "exclusive", "laplacian"]
    q, k, v = _qkv()
    with torch.no_grad():
        out = laplacian_attention(q, k, v, kinds, attn_mask=pattern)
    torch.testing.assert_close(out, laplacian_attention_reference(q, k, v, kinds, attn_mask=pattern), atol=2e-6, rtol=0)


def test_a_flex_attention_block_mask_built_elsewhere_is_accepted_and_differentiated_densely():
    """transformers' flex masks arrive as BlockMasks: FlexAttention without a gradient, their dense form with one."""
    block_mask = create_block_mask(lambda b, h, q, k: (k <= q) & (q - k <= 40), None, None, T, T, device="cpu")
    q, k, v = _qkv()
    expected = laplacian_attention_reference(q, k, v, 2, attn_mask=SlidingWindow(40))
    with torch.no_grad():
        assert attention_backend(q, k, block_mask) == "flex"
        torch.testing.assert_close(laplacian_attention(q, k, v, 2, attn_mask=block_mask), expected, atol=2e-6, rtol=0)
    q.requires_grad_()
    assert attention_backend(q, k, block_mask) == "dense"
    out = laplacian_attention(q, k, v, 2, attn_mask=block_mask)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=0)


def test_the_banded_path_reads_only_the_keys_a_window_reaches():
    """What makes it T x W: a key further back than the window changes nothing, and it is never read (NaN there)."""
    pattern = SlidingWindow(8)
    q, k, v = (x.requires_grad_() for x in _qkv(t=T, s=T))
    out = laplacian_attention(q, k, v, 2, attn_mask=pattern)
    poisoned_k, poisoned_v = k.detach().clone(), v.detach().clone()
    poisoned_k[..., :100, :] = poisoned_v[..., :100, :] = float("nan")  # query 299 is 191 keys past them
    tail = laplacian_attention(q[..., -BANDED_CHUNK:, :], poisoned_k, poisoned_v, 2, attn_mask=pattern)
    torch.testing.assert_close(tail, out[..., -BANDED_CHUNK:, :], atol=2e-6, rtol=0)


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: SlidingWindow(-1), "SlidingWindow(window=-1); allowed: an integer >= 0"),
        (lambda: SlidingWindow(True), "SlidingWindow(window=True); allowed: an integer >= 0"),
        (lambda: PrefixLM(2.5), "PrefixLM(prefix=2.5); allowed: an integer >= 0"),
        (lambda: Documents(torch.zeros(B, T)), "allowed: an integer tensor (B, S)"),
    ],
)
def test_a_bad_pattern_is_refused_in_one_line(build, words):
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"attn_mask": Documents(torch.zeros(B, T + 1, dtype=torch.long))}, "allowed: (B, S) = (2, 300)"),
        ({"attn_mask": SlidingWindow(4), "dropout_p": 0.1}, "dropout_p=0.1 with an attention pattern"),
        ({"attn_mask": SlidingWindow(4), "identity": "filled"}, "identity='filled' with an attention pattern"),
        ({"attn_mask": SlidingWindow(4), "is_causal": True}, "cannot be combined"),
        ({"attn_mask": [[True]]}, "attn_mask of type list; allowed: a bool or float tensor, an attention pattern"),
    ],
)
def test_the_op_refuses_what_a_pattern_cannot_do_in_one_line(kwargs, words):
    q, k, v = _qkv()
    with pytest.raises(InputError) as caught:
        laplacian_attention(q, k, v, 2, **kwargs)
    assert words in str(caught.value) and "\n" not in str(caught.value)
