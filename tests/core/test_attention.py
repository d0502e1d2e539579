"""The Laplacian-head op, its reference path and the timm-compatible module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from timm.layers import Attention

from lapheads import LaplacianAttention, laplacian_attention, laplacian_attention_reference
from lapheads.core.heads import HeadSpecError
from tests.conftest import node_name

B, H, T, D = 2, 4, 7, 8


def qkv(h: int = H, hkv: int = H, t: int = T, s: int | None = None, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    s = t if s is None else s
    q = torch.randn(B, h, t, D, generator=gen, dtype=dtype)
    k = torch.randn(B, hkv, s, D, generator=gen, dtype=dtype)
    v = torch.randn(B, hkv, s, D, generator=gen, dtype=dtype)
    return q, k, v


def dense_heads(q, k, v, lap_mask, causal=False, allowed=None, sinks=None):
    """Independent per-head formula: P from its definition, (I - P) with an explicit identity matrix. ``allowed``
    (T, S) bool, True = attend; ``sinks`` (H,): one more logit per head in the softmax, its column then dropped."""
    h, hkv, t, s = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    outs = []
    for i in range(h):
        kv = i // (h // hkv)
        logits = q[:, i] @ k[:, kv].transpose(-1, -2) / q.shape[-1] ** 0.5
        if causal:
            allowed = torch.tensor([[j <= s - t + r for j in range(s)] for r in range(t)])
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            p = torch.cat([logits, sinks[i].expand(*logits.shape[:-1], 1)], dim=-1).softmax(-1)[..., :-1]
        else:
            p = logits.softmax(-1)
        if lap_mask[i]:
            eye = torch.zeros(t, s, dtype=q.dtype)
            eye[torch.arange(t), torch.arange(s - t, s)] = 1
            p = eye - p
        outs.append(p @ v[:, kv])
    return torch.stack(outs, 1)


def as_mask(spec, h=H):
    if isinstance(spec, int):
        return [i >= h - spec for i in range(h)]
    return list(spec)


SPECS = [0, 1, H - 1, H, [True, False, True, False], [False, True, True, False]]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [H, 2, 1], ids=["mha", "gqa", "mqa"])
def test_fused_equals_reference_equals_dense(spec, causal, hkv):
    q, k, v = qkv(hkv=hkv)
    expected = dense_heads(q, k, v, as_mask(spec), causal)
    fused = laplacian_attention(q, k, v, spec, is_causal=causal)
    reference = laplacian_attention_reference(q, k, v, spec, is_causal=causal)
    torch.testing.assert_close(fused, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(reference, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spec", [1, H, [True, False, True, False]], ids=str)
def test_bf16_matches_float64_loosely(spec):
    q, k, v = qkv()
    expected = dense_heads(q, k, v, as_mask(spec), causal=True)
    for fn in (laplacian_attention, laplacian_attention_reference):
        out = fn(q.bfloat16(), k.bfloat16(), v.bfloat16(), spec, is_causal=True)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), expected, rtol=0.05, atol=0.05)


def test_tensor_mask_and_sequence_mask_agree_with_int():
    q, k, v = qkv()
    by_int = laplacian_attention(q, k, v, 2)
    torch.testing.assert_close(laplacian_attention(q, k, v, [False, False, True, True]), by_int, rtol=0, atol=0)
    torch.testing.assert_close(laplacian_attention(q, k, v, torch.tensor([False, False, True, True])), by_int)


@settings(max_examples=25, deadline=None)
@given(mask=st.lists(st.booleans(), min_size=6, max_size=6), causal=st.booleans(), hkv=st.sampled_from([1, 2, 3, 6]))
def test_random_masks_match_dense(mask, causal, hkv):
    q, k, v = qkv(h=6, hkv=hkv)
    torch.testing.assert_close(
        laplacian_attention(q, k, v, mask, is_causal=causal), dense_heads(q, k, v, mask, causal), rtol=1e-10, atol=1e-10
    )


def test_constant_sequence_is_annihilated():
    """(I - P) 1 = 0: equal tokens get zero from a Laplacian head (up to the rounding of P's row sums, ~1e-16 in
    float64) and themselves from an ordinary one."""
    q, k, _ = qkv()
    v = torch.randn(B, H, 1, D, dtype=torch.float64).expand(B, H, T, D)
    for fn in (laplacian_attention, laplacian_attention_reference):
        out = fn(q, k, v, 2)
        assert out[:, 2:].abs().max() < 1e-14 * v.abs().max()
        torch.testing.assert_close(out[:, :2], v[:, :2], rtol=1e-14, atol=0)


def test_causal_first_token_of_laplacian_head_is_zero():
    q, k, v = qkv()
    for fn in (laplacian_attention, laplacian_attention_reference):
        out = fn(q, k, v, 2, is_causal=True)
        assert torch.equal(out[:, 2:, 0], torch.zeros_like(out[:, 2:, 0]))
        torch.testing.assert_close(out[:, :2, 0], v[:, :2, 0])  # an ordinary head copies the first value


@pytest.mark.parametrize("fn", [laplacian_attention, laplacian_attention_reference])
def test_causality_of_outputs_and_gradients(fn):
    q, k, v = qkv()
    t0 = 3
    base = [x.clone().requires_grad_() for x in (q, k, v)]
    perturbed = [x.clone() for x in (q, k, v)]
    for x in perturbed:
        x[:, :, t0 + 1 :] += torch.randn_like(x[:, :, t0 + 1 :])
    perturbed = [x.requires_grad_() for x in perturbed]
    out_a, out_b = fn(*base, 2, is_causal=True), fn(*perturbed, 2, is_causal=True)
    torch.testing.assert_close(out_a[:, :, : t0 + 1], out_b[:, :, : t0 + 1], rtol=0, atol=1e-12)
    # A loss on positions <= t0 gives the same gradients, and none at all to later positions.
    out_a[:, :, : t0 + 1].sum().backward()
    out_b[:, :, : t0 + 1].sum().backward()
    for a, b in zip(base, perturbed):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
        assert torch.equal(a.grad[:, :, t0 + 1 :], torch.zeros_like(a.grad[:, :, t0 + 1 :]))


@pytest.mark.parametrize("hkv", [H, 2])
@pytest.mark.parametrize("new_tokens", [1, 3])
def test_kv_cache_form_equals_last_rows_of_full(hkv, new_tokens):
    q, k, v = qkv(hkv=hkv, t=T)
    full = laplacian_attention(q, k, v, [True, False, True, True], is_causal=True)
    for fn in (laplacian_attention, laplacian_attention_reference):
        cached = fn(q[:, :, -new_tokens:], k, v, [True, False, True, True], is_causal=True)
        torch.testing.assert_close(cached, full[:, :, -new_tokens:], rtol=1e-10, atol=1e-10)


def test_dropout_acts_on_p():
    q, k, v = qkv()
    # drop(P) = 0 with p = 1: a Laplacian head computes (I - 0) V = V, an ordinary head 0.
    out = laplacian_attention(q, k, v, 2, dropout_p=1.0)
    torch.testing.assert_close(out[:, 2:], v[:, 2:], rtol=0, atol=0)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    # Inverted dropout is unbiased, so the mean over draws approaches (I - P) V, not some other operator.
    torch.manual_seed(0)
    mean = torch.stack([laplacian_attention(q, k, v, 2, dropout_p=0.3) for _ in range(3000)]).mean(0)
    torch.testing.assert_close(mean, laplacian_attention(q, k, v, 2), rtol=0, atol=0.1)


def test_reference_returns_softmax_matrix():
    q, k, v = qkv()
    _, attn = laplacian_attention_reference(q, k, v, 2, is_causal=True, return_attn=True)
    assert attn.shape == (B, H, T, T)
    torch.testing.assert_close(attn.sum(-1), torch.ones(B, H, T, dtype=attn.dtype))
    assert torch.equal(attn.triu(1), torch.zeros_like(attn))


@pytest.mark.parametrize("spec", [1, [True, False, True, False], H], ids=str)
@pytest.mark.parametrize("hkv", [H, 2])
def test_gradcheck(spec, hkv):
    q, k, v = (x[:1, :, :4, :3].clone().requires_grad_() for x in qkv(hkv=hkv))
    assert torch.autograd.gradcheck(lambda a, b, c: laplacian_attention(a, b, c, spec, is_causal=True), (q, k, v))


def _grads(fn, inputs, spec, grad_out, **kwargs):
    leaves = [x.clone().requires_grad_(needs) for x, needs in inputs]
    out = fn(*leaves, spec, **kwargs)
    out.backward(grad_out, retain_graph=True)
    first = [None if x.grad is None else x.grad.clone() for x in leaves]
    out.backward(grad_out)  # retain_graph: a second backward through the same graph accumulates the same again
    return out, first, [None if x.grad is None else x.grad - g for x, g in zip(leaves, first)]


@pytest.mark.parametrize(
    "spec, hkv",
    [
        (1, H),
        (H - 1, H),
        ([True, False, True, False], H),
        ([False, True, True, False], H),
        (2, 2),  # GQA, the last kv group Laplacian
        ([True, True, False, False], 2),
        (1, 2),  # GQA with a group of both kinds: the general combine
    ],
    ids=str,
)
@pytest.mark.parametrize(
    "case", ["plain", "causal", "kv-cache", "mask", "frozen-kv", "dropout-all"], ids=lambda case: case
)
def test_training_gradients_of_the_fused_op_equal_the_reference(spec, hkv, case):
    """Partial specs whose blocks do not split a kv group take the one-node SDPA + combine path in training (its
    backward fixes SDPA's gradients in place); q, k, v and every input's gradient equal the textbook path's, also
    with a second backward."""
    t = 3 if case == "kv-cache" else T
    q, k, v = qkv(hkv=hkv, t=t, s=T)
    kwargs = {
        "plain": {},
        "causal": {"is_causal": True},
        "kv-cache": {"is_causal": True},
        "mask": {"attn_mask": torch.rand(B, 1, T, T, generator=torch.Generator().manual_seed(1)) > 0.3},
        "frozen-kv": {},
        "dropout-all": {"dropout_p": 1.0},  # drop(P) = 0: deterministic, and the math kernel's backward
    }[case]
    needs = (True, case != "frozen-kv", case != "frozen-kv")
    inputs = list(zip((q, k, v), needs))
    grad_out = torch.randn(B, H, t, D, dtype=q.dtype, generator=torch.Generator().manual_seed(2))
    out, first, second = _grads(laplacian_attention, inputs, spec, grad_out, **kwargs)
    one_node = all(
        start % (H // hkv) == 0 for start in range(H) if start == 0 or as_mask(spec)[start] != as_mask(spec)[start - 1]
    )
    assert ("LaplacianSDPA" in node_name(out.grad_fn)) == one_node  # the Python or the compiled node
    ref_out, ref_first, ref_second = _grads(laplacian_attention_reference, inputs, spec, grad_out, **kwargs)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for ours, theirs in zip(first + second, ref_first + ref_second):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("causal, mask", [(False, None), (True, None), (False, "bool"), (False, "float")])
def test_training_path_calls_sdpas_own_kernels_and_matches_sdpa_through_autograd_bit_for_bit(kernel, causal, mask):
    """Where SDPA's dispatcher picks its CPU flash kernel, the training path calls that kernel and its backward
    directly (no re-entrant autograd call); output and gradients equal SDPA differentiated by autograd with the
    combine written out, bit for bit. Under ``sdpa_kernel(MATH)`` the dispatcher's choice is respected. This is the
    Python node (the compiled one, where built, equals it bit for bit: tests/core/test_native.py)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lapheads.core import _autograd, native

    calls = []
    direct = _autograd._CPU_FLASH

    def counting(*args, **kwargs):
        calls.append(1)
        return direct(*args, **kwargs)

    q, k, v = (x.float() for x in qkv(t=T, s=T, seed=3))
    grad_out = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(4))
    attn_mask = None
    if mask is not None:  # padding-like, with one query that may see no key at all
        attn_mask = torch.rand(B, 1, T, T, generator=torch.Generator().manual_seed(5)) > 0.4
        attn_mask[0, 0, 2] = False
        if mask == "float":
            attn_mask = torch.zeros(attn_mask.shape).masked_fill_(~attn_mask, float("-inf"))
    lap = torch.tensor([False, False, True, True]).view(1, H, 1, 1)
    backend = SDPBackend.FLASH_ATTENTION if kernel == "flash" else SDPBackend.MATH
    results = []
    for form in ("ours", "autograd"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with sdpa_kernel(backend), pytest.MonkeyPatch.context() as patch, native.disabled():
            patch.setattr(_autograd, "_CPU_FLASH", counting)
            if form == "ours":
                out = laplacian_attention(*leaves, 2, is_causal=causal, attn_mask=attn_mask)
            else:
                y = F.scaled_dot_product_attention(*leaves, is_causal=causal, attn_mask=attn_mask)
                out = torch.where(lap, leaves[2] - y, y)
            out.backward(grad_out)
        results.append([out.detach(), *(x.grad for x in leaves)])
    assert len(calls) == (1 if kernel == "flash" else 0)
    for ours, theirs in zip(*results):
        if kernel == "flash":
            assert torch.equal(ours, theirs)
        else:
            torch.testing.assert_close(ours, theirs)


def test_the_training_path_frees_what_it_saved_after_backward():
    """As any autograd node: after a backward without retain_graph its saved tensors (and SDPA's inner graph) are
    gone even while the caller still holds the output, so a held loss does not keep a step's attention alive."""
    q, k, v = (x.requires_grad_() for x in qkv())
    out = laplacian_attention(q, k, v, 1)
    out.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()


#: (name, spec, options, H, Hkv, T, S, whether q, k, v want a gradient) -> the path the op's plan gives that call
PLANNED_CALLS = [
    ("no Laplacian head", 0, {}, 4, 4, 7, 7, True, "sdpa"),
    ("an all-False mask", [False] * 4, {}, 4, 4, 7, 7, True, "sdpa"),
    ("head kinds", ["ordinary", "negated", "sum", "laplacian"], {}, 4, 4, 7, 7, True, "kinds"),
    ("trailing heads in training", 2, {}, 4, 4, 7, 7, True, "node"),
    ("a mask of blocks in training", [True, False, True, False], {"is_causal": True}, 4, 4, 7, 7, True, "node"),
    ("GQA blocks on group boundaries", 2, {}, 4, 2, 7, 7, True, "node"),
    ("every head Laplacian", 4, {}, 4, 4, 7, 7, True, "all_laplacian"),
    ("every head Laplacian, decoding", 4, {"is_causal": True}, 4, 4, 1, 7, False, "all_laplacian"),
    ("decoding with a cache", 2, {"is_causal": True}, 4, 4, 2, 7, False, "in_place"),
    ("a blend", 2, {"blend": 0.3}, 4, 4, 7, 7, True, "combine"),
    ("a GQA group of both kinds", [False, True, True, True], {}, 4, 2, 7, 7, True, "combine"),
    ("every head Laplacian under GQA", 4, {}, 4, 2, 7, 7, True, "combine"),
]


@pytest.mark.parametrize(
    "name, spec, options, h, hkv, t, s, grad, path", PLANNED_CALLS, ids=[c[0] for c in PLANNED_CALLS]
)
def test_each_call_takes_its_planned_path_and_gives_the_references_numbers(
    name, spec, options, h, hkv, t, s, grad, path
):
    """The module docstring's table of paths, pinned call by call: ``explain_attention`` names the path the call
    takes (the op runs it: recorded), and the op's output and gradients on it equal the textbook reference's."""
    import lapheads.core.attention as attention

    q, k, v = (x.requires_grad_(grad) for x in qkv(h, hkv, t, s))
    plan = attention.explain_attention(q, k, v, spec, **options)
    assert plan == (path, None, False) and str(plan).startswith(f"path {path}: ")
    taken = []
    recorded = {
        name: (lambda *a, name=name, run=run: taken.append(name) or run(*a)) for name, run in attention._PATHS.items()
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "_PATHS", recorded)
        out = laplacian_attention(q, k, v, spec, **options)
    assert taken == [path]
    reference = laplacian_attention_reference(q, k, v, spec, **options)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-10)
    if grad:
        cotangent = torch.randn_like(out)
        ours = torch.autograd.grad(out, (q, k, v), cotangent)
        theirs = torch.autograd.grad(reference, (q, k, v), cotangent)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_transforms_take_the_traced_path():
    """Under a torch.func transform the plan is the plain-autograd expression (an autograd.Function has no
    functorch rule); torch.compile takes it too (test_module_compiles_and_matches_eager)."""
    from lapheads.core.attention import _plan, _prepare

    q, k, v = qkv()
    paths = []

    def loss(q_):
        call = _prepare(q_, k, v, 2, None, False, 0.0, None, "aligned", None, None)
        paths.append(_plan(q_, k, v, call))
        return laplacian_attention(q_, k, v, 2).sum()

    grad = torch.func.grad(loss)(q)
    assert paths == ["traced"]
    q.requires_grad_()
    torch.testing.assert_close(grad, torch.autograd.grad(laplacian_attention_reference(q, k, v, 2).sum(), q)[0])


# ---------------------------------------------------------------------------------------------------------------
# The module


DIM, HEADS = 32, 4


def make_pair(k: int, **kwargs) -> tuple[Attention, LaplacianAttention]:
    torch.manual_seed(0)
    timm_attn = Attention(DIM, num_heads=HEADS, qkv_bias=True, **kwargs).double()
    lap = LaplacianAttention(DIM, num_heads=HEADS, qkv_bias=True, laplacian_heads=k, **kwargs).double()
    lap.load_state_dict(timm_attn.state_dict(), strict=True)
    return timm_attn, lap


def test_module_state_dict_and_parameters_equal_timm():
    timm_attn, lap = make_pair(2, qk_norm=True, norm_layer=torch.nn.LayerNorm)
    assert list(lap.state_dict()) == list(timm_attn.state_dict())
    assert sum(p.numel() for p in lap.parameters()) == sum(p.numel() for p in timm_attn.parameters())


@pytest.mark.parametrize("fused", [True, False])
def test_module_without_laplacian_heads_equals_timm(fused):
    timm_attn, lap = make_pair(0, qk_norm=True, norm_layer=torch.nn.LayerNorm)
    timm_attn.fused_attn = lap.fused_attn = fused
    x = torch.randn(3, 9, DIM, dtype=torch.float64)
    torch.testing.assert_close(lap(x), timm_attn(x), rtol=1e-12, atol=1e-12)


def dense_update(module: LaplacianAttention, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """X + sum_A P X Wv Wo + sum_L (I - P) X Wv Wo, from the module's own weights, one head at a time."""
    n, hd = x.shape[1], module.head_dim
    wq, wk, wv = module.qkv.weight.chunk(3)
    bq, bk, bv = module.qkv.bias.chunk(3)
    update = module.proj.bias.expand_as(x).clone()
    for i, laplacian in enumerate(module.laplacian_mask.tolist()):
        rows = slice(i * hd, (i + 1) * hd)
        q = x @ wq[rows].T + bq[rows]
        k = x @ wk[rows].T + bk[rows]
        logits = q @ k.transpose(-1, -2) * hd**-0.5
        if causal:
            logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        p = logits.softmax(-1)
        op = torch.eye(n, dtype=x.dtype) - p if laplacian else p
        update = update + op @ (x @ wv[rows].T + bv[rows]) @ module.proj.weight[:, rows].T
    return x + update


@pytest.mark.parametrize("spec", [0, 1, HEADS - 1, HEADS, [True, False, False, True]], ids=str)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_module_matches_dense_update(spec, fused, causal):
    _, lap = make_pair(spec if isinstance(spec, int) else 0)
    lap.set_laplacian_heads(spec)
    lap.fused_attn = fused
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    torch.testing.assert_close(x + lap(x, is_causal=causal), dense_update(lap, x, causal), rtol=1e-10, atol=1e-10)


def test_module_fused_flag_parity_in_training_and_bf16():
    _, lap = make_pair(3)
    x = torch.randn(2, 9, DIM)
    lap.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lap.fused_attn = True
        fused = lap(x)
        lap.fused_attn = False
        manual = lap(x)
    torch.testing.assert_close(fused.float(), manual.float(), rtol=0.05, atol=0.05)


def test_module_returns_attention_maps_and_repr_names_heads():
    _, lap = make_pair(2)
    x = torch.randn(2, 9, DIM, dtype=torch.float64)
    out, attn = lap.forward_with_attn(x)  # forward itself keeps timm's signature (TorchScript, FX)
    torch.testing.assert_close(out, lap(x))
    assert attn.shape == (2, HEADS, 9, 9)
    assert "laplacian_heads=2/4 Laplacian: [2, 3]" in repr(lap)
    assert lap.heads.num_laplacian == 2 and lap.heads.trailing == 2


def test_module_rejects_bad_spec():
    with pytest.raises(HeadSpecError, match="laplacian_heads=7 is out of range; allowed: 0 to 4"):
        LaplacianAttention(DIM, num_heads=HEADS, laplacian_heads=7)


def test_module_compiles_and_matches_eager():
    _, lap = make_pair(2)
    lap.float()
    x = torch.randn(2, 9, DIM, requires_grad=True)
    eager = lap(x)
    eager.sum().backward()
    eager_grad = x.grad.clone()
    x.grad = None
    compiled = torch.compile(lap)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, eager_grad, rtol=1e-5, atol=1e-5)


def test_module_trains_with_laplacian_heads():
    """Gradients reach every parameter and a few Adam steps fit another Laplacian module's outputs."""
    _, lap = make_pair(2)
    lap.float()
    torch.manual_seed(1)
    teacher = LaplacianAttention(DIM, num_heads=HEADS, qkv_bias=True, laplacian_heads=2)
    x = torch.randn(8, 9, DIM)
    with torch.no_grad():
        target = teacher(x)
    opt = torch.optim.Adam(lap.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = F.mse_loss(lap(x), target)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lap.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_the_filled_identity_reads_each_querys_own_position_under_cache_and_padding_masks():
    from lapheads.core.attention import _causal_mask

    torch.manual_seed(0)
    b, h, hkv, t, s, d = 2, 4, 2, 3, 8, 16
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    # a static cache: the 3 queries sit at positions 2, 3, 4 of 8 slots; row 1 is also left-padded by one
    positions = torch.tensor([2, 3, 4])
    allowed = torch.arange(s)[None, :] <= positions[:, None]
    mask = allowed[None, None].repeat(b, 1, 1, 1)
    mask[1, :, :, 0] = False
    fused = laplacian_attention(q, k, v, 2, attn_mask=mask, identity="filled")
    reference = laplacian_attention_reference(q, k, v, 2, attn_mask=mask, identity="filled")
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    plain = laplacian_attention(q, k, v, 0, attn_mask=mask)
    v_own = v.repeat_interleave(2, 1)[:, :, positions]  # each query's own value, by hand
    torch.testing.assert_close(fused[:, 2:], v_own[:, 2:] - plain[:, 2:], rtol=1e-5, atol=1e-5)
    # with the plain bottom-right causal mask both rules agree; an additive float mask reads the same
    causal = _causal_mask(t, s, q.device)
    aligned = laplacian_attention(q, k, v, 2, attn_mask=causal)
    torch.testing.assert_close(laplacian_attention(q, k, v, 2, attn_mask=causal, identity="filled"), aligned)
    additive = torch.zeros(t, s).masked_fill(~causal, torch.finfo(torch.float32).min)
    torch.testing.assert_close(
        laplacian_attention(q, k, v, 2, attn_mask=additive, identity="filled"), aligned, rtol=1e-5, atol=1e-5
    )
    # without a mask "filled" has nothing to read: the queries are the last T keys, as "aligned" says
    torch.testing.assert_close(
        laplacian_attention(q, k, v, 2, is_causal=True, identity="filled"),
        laplacian_attention(q, k, v, 2, is_causal=True),
    )


def test_blend_moves_from_plain_attention_to_the_laplacian():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    plain = laplacian_attention(q, k, v, 0, is_causal=True)
    assert torch.equal(laplacian_attention(q, k, v, 2, is_causal=True, blend=torch.tensor(0.0)), plain)
    torch.testing.assert_close(
        laplacian_attention(q, k, v, 2, is_causal=True, blend=1.0), laplacian_attention(q, k, v, 2, is_causal=True)
    )
    half = laplacian_attention(q, k, v, 2, is_causal=True, blend=0.3)
    torch.testing.assert_close(
        half, laplacian_attention_reference(q, k, v, 2, is_causal=True, blend=0.3), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(half[:, 2:], 0.3 * v[:, 2:] + 0.4 * plain[:, 2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(half[:, :2], plain[:, :2])


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(reentrant):
    """timm's set_grad_checkpointing / torch.utils.checkpoint recompute the op in backward; the one-node training
    path must give the gradients of the plain run."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    attn = LaplacianAttention(32, num_heads=4, laplacian_heads=[False, True, False, True])
    x = torch.randn(2, 9, 32, requires_grad=True)
    checkpoint(attn, x, use_reentrant=reentrant).square().sum().backward()
    recomputed = [x.grad.clone()] + [p.grad.clone() for p in attn.parameters()]
    x.grad = None
    attn.zero_grad()
    attn(x).square().sum().backward()
    for ours, plain in zip(recomputed, [x.grad] + [p.grad for p in attn.parameters()]):
        torch.testing.assert_close(ours, plain, rtol=0, atol=0)


def test_saved_tensor_hooks_that_copy_what_is_saved_give_the_same_gradients():
    """Activation offloading (``torch.autograd.graph.saved_tensors_hooks`` / ``save_on_cpu`` on a GPU) hands backward
    copies of what forward saved; the one-node training path must still give the textbook gradients."""
    inputs = [(x, True) for x in qkv()]
    grad_out = torch.randn(B, H, T, D, dtype=torch.float64)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t):
        out, grads, _ = _grads(laplacian_attention, inputs, [True, False, False, True], grad_out)
    _, expected, _ = _grads(laplacian_attention_reference, inputs, [True, False, False, True], grad_out)
    assert "LaplacianSDPA" in node_name(out.grad_fn)  # the Python or the compiled node
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------------------------------
# Fully masked rows agree on both paths (bad arguments: the op table of tests/red_team/test_op_api.py, both paths)


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_the_same_documented_value_on_both_paths(k, kind):
    q, key, v = (torch.randn(2, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    allowed = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    allowed[0, :, 2, :] = False  # query 2 of sequence 0 may attend to nothing
    mask = (
        allowed if kind == "bool" else torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
    )
    fused = laplacian_attention(q, key, v, k, attn_mask=mask)
    reference, attn = laplacian_attention_reference(q, key, v, k, attn_mask=mask, return_attn=True)
    assert torch.isfinite(reference).all() and torch.allclose(fused, reference, atol=1e-10)
    assert (attn[0, :, 2] == 0).all()  # P = 0: ordinary heads output 0, Laplacian heads their own value
    lap = torch.arange(2) >= 2 - k
    assert torch.equal(fused[0, lap, 2], v[0, lap, 2]) and (fused[0, ~lap, 2] == 0).all()


def _prefix_lm_mask(t: int, prefix: int) -> torch.Tensor:
    """Bool (T, T): the first ``prefix`` tokens see each other (bidirectional), the rest are causal."""
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    mask[:prefix, :prefix] = True
    return mask


def _gemma3_mask(t: int, image: slice) -> torch.Tensor:
    """Causal text with one block of image tokens that see each other (Gemma-3 style)."""
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    mask[image, image] = True
    return mask


def _own_value_textbook(q, k, v, mask, own):
    """(I - P) V with P = softmax over the allowed keys and I picking each query's own key ``own[i]``."""
    logits = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    p = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    return v[..., own, :] - p @ v


@pytest.mark.parametrize("name", ["prefix-lm", "gemma3", "causal", "bidirectional"])
@pytest.mark.parametrize("fused", [True, False])
def test_the_filled_identity_is_each_querys_own_value_under_any_mask(name, fused):
    torch.manual_seed(0)
    t = 8
    mask = {
        "prefix-lm": _prefix_lm_mask(t, 5),
        "gemma3": _gemma3_mask(t, slice(2, 6)),
        "causal": torch.ones(t, t, dtype=torch.bool).tril(),
        "bidirectional": torch.ones(t, t, dtype=torch.bool),
    }[name]
    q, k, v = (torch.randn(2, 3, t, 4, dtype=torch.float64) for _ in range(3))
    op = laplacian_attention if fused else laplacian_attention_reference
    out = op(q, k, v, 3, attn_mask=mask, identity="filled")
    torch.testing.assert_close(out, _own_value_textbook(q, k, v, mask, torch.arange(t)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
def test_the_filled_identity_finds_the_queries_in_a_static_cache(fused):
    """A static cache of 10 slots holding 6 tokens: the 2 new queries sit at slots 4 and 5, under a prefix-LM mask
    whose prefix (slots 0-4) is bidirectional; slots 6-9 are empty, so no query sees them."""
    torch.manual_seed(1)
    s, t, filled = 10, 2, 6
    full = _prefix_lm_mask(filled, 5)
    mask = torch.zeros(t, s, dtype=torch.bool)
    mask[:, :filled] = full[filled - t :]
    q = torch.randn(1, 2, t, 4, dtype=torch.float64)
    k, v = (torch.randn(1, 2, s, 4, dtype=torch.float64) for _ in range(2))
    op = laplacian_attention if fused else laplacian_attention_reference
    out = op(q, k, v, 2, attn_mask=mask, identity="filled")
    torch.testing.assert_close(out, _own_value_textbook(q, k, v, mask, torch.arange(4, 6)), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "spec", [0, 1, 2, 4, [False, True, False, True], ("ordinary", "laplacian", "sum", "exclusive")]
)
def test_torch_func_grad_and_vmap_run_through_the_op(spec):
    """torch.func's transforms take the op's plain-autograd expression (an autograd.Function without functorch
    rules cannot run under them): the same gradients as autograd, the same outputs batched by vmap."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, dtype=torch.float64), *torch.randn(2, 2, 2, 5, 8, dtype=torch.float64)

    def loss(q):
        return laplacian_attention(q, k, v, spec, is_causal=True).square().sum()

    leaf = q.clone().requires_grad_()
    loss(leaf).backward()
    torch.testing.assert_close(torch.func.grad(loss)(q), leaf.grad)
    batched = torch.func.vmap(lambda one: laplacian_attention(one[None], k[:1], v[:1], spec)[0])(q)
    torch.testing.assert_close(
        batched, laplacian_attention(q, k[:1].expand(2, -1, -1, -1), v[:1].expand(2, -1, -1, -1), spec)
    )


@pytest.mark.parametrize(
    "t, grad, backend",
    [(512, False, "flex"), (512, True, "banded"), (96, False, "banded"), (1, False, "banded")],
    ids=["a long forward", "a CPU gradient", "one chunk", "decoding"],
)
def test_explain_names_the_backend_of_a_pattern_mask(t, grad, backend):
    """A sliding window's backend as ``lapheads.core.masks`` chooses it: FlexAttention for a long forward, T x W
    bands for a CPU gradient (FlexAttention has none there) and for a chunk or fewer queries (no compile)."""
    from lapheads.core import explain_attention
    from lapheads.core.masks import Documents, SlidingWindow

    q, k, v = qkv(4, 4, t, 512)
    q.requires_grad_(grad)
    plan = explain_attention(q, k, v, 2, attn_mask=SlidingWindow(64))
    assert plan.mask_backend == backend and f"; mask {backend}: " in str(plan)
    documents = Documents(torch.zeros(2, 512, dtype=torch.long))  # no band: a small or differentiable call is dense
    assert explain_attention(q, k, v, 2, attn_mask=documents).mask_backend == ("flex" if t > 128 and not grad
                                                                               else "dense")  # fmt: skip
