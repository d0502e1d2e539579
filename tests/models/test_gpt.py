"""The nanochat-style GPT: parameter count, causality with Laplacian heads, KV cache, generation, the one op."""

from __future__ import annotations

import math

import pytest
import torch

import lapheads
from lapheads.models import gpt as gpt_module
from lapheads.models.gpt import GPT, GPTConfig

TINY = dict(depth=2, vocab_size=40, sequence_len=48, aspect_ratio=32, head_dim=16)  # 64 dim, 4 heads


def _random_weights(model: GPT, seed: int = 0) -> GPT:
    """Non-zero everywhere (the real init zeroes output projections, which would make causality trivial)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_d20_has_the_papers_parameter_count():
    with torch.device("meta"):
        model = GPT(GPTConfig(depth=20, vocab_size=65536, laplacian_heads=5))
    assert model.num_params() == 560_988_160
    assert (model.config.n_embd, model.config.n_head) == (1280, 10)
    assert model.laplacian_masks()[0] == [False] * 5 + [True] * 5


def test_state_dict_uses_nanochat_names_and_no_mask_buffers():
    keys = set(GPT(GPTConfig(**TINY, laplacian_heads=2)).state_dict())
    assert {
        "transformer.wte.weight",
        "transformer.h.0.attn.c_q.weight",
        "transformer.h.1.mlp.c_proj.weight",
        "lm_head.weight",
    } <= keys
    assert not any("laplacian" in k or "cos" in k for k in keys)


def test_init_starts_every_block_as_identity_and_predicts_uniformly():
    model = GPT(GPTConfig(**TINY, laplacian_heads=4))
    idx = torch.randint(0, 40, (2, 10))
    loss = model(idx, idx)
    assert loss.item() == pytest.approx(math.log(40), abs=1e-5)
    for block in model.blocks:
        assert block.attn.c_proj.weight.abs().sum() == 0 and block.mlp.c_proj.weight.abs().sum() == 0


@pytest.mark.parametrize("spec, kv", [("0,2", None), (4, 2), ("3,1", 1)])
def test_perturbing_future_tokens_changes_nothing_before(spec, kv):
    model = _random_weights(GPT(GPTConfig(**TINY, laplacian_heads=spec, n_kv_head=kv)))
    idx = torch.randint(0, 40, (3, 20))
    t = 11
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, 40, (3, 20 - t - 1))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=0)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


@pytest.mark.parametrize("kv", [None, 2, 1])
def test_kv_cache_logits_equal_the_full_forward(kv):
    model = _random_weights(GPT(GPTConfig(**TINY, laplacian_heads="1,3", n_kv_head=kv)))
    idx = torch.randint(0, 40, (2, 17))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_kv_cache(2, 17)
        parts = [model(idx[:, :9], kv_cache=cache)] + [model(idx[:, i : i + 1], kv_cache=cache) for i in range(9, 13)]
        parts.append(model(idx[:, 13:], kv_cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_step_by_step_argmax_of_the_full_forward():
    model = _random_weights(GPT(GPTConfig(**TINY, laplacian_heads=2)))
    prompt = torch.randint(0, 40, (2, 5))
    out = model.generate(prompt, 8, temperature=0)
    with torch.no_grad():
        ids = prompt
        for _ in range(8):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)
    sampled = model.generate(prompt, 8, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    again = model.generate(prompt, 8, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, again) and sampled.shape == (2, 13)


def test_every_attention_goes_through_the_one_op(monkeypatch):
    calls = []
    real = gpt_module.laplacian_attention

    def spy(*args, **kwargs):
        k = kwargs["laplacian_heads"]  # the op gets an int k for trailing heads
        calls.append([h >= 4 - k for h in range(4)])
        return real(*args, **kwargs)

    monkeypatch.setattr(gpt_module, "laplacian_attention", spy)
    GPT(GPTConfig(**TINY, laplacian_heads="0,3"))(torch.randint(0, 40, (1, 6)))
    assert calls == [[False] * 4, [False, True, True, True]]


def test_bad_input_is_a_one_line_error():
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="sequence of 49 tokens is longer than the model's sequence_len 48"):
        model(torch.zeros(1, 49, dtype=torch.long))
    with pytest.raises(lapheads.HeadSpecError):
        GPT(GPTConfig(**TINY, laplacian_heads=5))
    with pytest.raises(ValueError, match="n_kv_head=3 must divide the 4 query heads"):
        GPT(GPTConfig(**TINY, n_kv_head=3))


def test_random_tokens_leave_nothing_to_learn_about_the_future():
    """A leak of future tokens would let the model copy its target; on random tokens it must stay >= ln(V)."""
    torch.manual_seed(0)
    vocab = 16
    model = GPT(GPTConfig(depth=2, vocab_size=vocab, sequence_len=32, aspect_ratio=32, head_dim=16, laplacian_heads=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        x = torch.randint(0, vocab, (16, 33))
        loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    held_out = torch.randint(0, vocab, (64, 33), generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        loss = model(held_out[:, :-1], held_out[:, 1:]).item()
    assert loss > math.log(vocab) - 0.02


def test_generation_stops_and_pads_with_the_stop_token():
    model = _random_weights(GPT(GPTConfig(**TINY)))
    prompt = torch.randint(0, 40, (1, 4))
    first = int(model.generate(prompt, 1, temperature=0)[0, -1])
    out = model.generate(prompt, 6, temperature=0, stop_token=first)
    assert out.shape == (1, 10) and out[0, 4:].tolist() == [first] * 6


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-6])
def test_a_nucleus_below_float32_resolution_keeps_the_likeliest_token(top_p):
    """Issue 76: top_p 1e-300 is 0 in float32, so every token was masked and sampling raised (HTTP 500 through the
    server). The likeliest token is always kept: a tiny nucleus samples greedily."""
    from lapheads.models.gpt import sample_token

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    picked = sample_token(logits, 1.0, None, torch.Generator().manual_seed(1), top_p)
    assert torch.equal(picked, logits.argmax(-1, keepdim=True))


def test_the_draw_is_torch_multinomials_own():
    """The written-out exponential race draws what torch.multinomial draws from the same generator state (so a
    seed samples what it sampled through torch.multinomial)."""
    from lapheads.models.gpt import sample_token

    logits = torch.randn(3, 97, generator=torch.Generator().manual_seed(0))
    for seed in range(20):
        ours = sample_token(logits, 0.9, None, torch.Generator().manual_seed(seed))
        theirs = torch.multinomial((logits / 0.9).softmax(-1), 1, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(ours, theirs)


def test_sample_rows_gives_each_row_the_token_it_samples_alone():
    """The batched sampler (the server's step) against the textbook one a row at a time: greedy and sampled rows,
    top-k (one past the vocabulary), top-p (one below float32's resolution), both, rows that share a setting (and
    are filtered together), each its own generator, over many steps of the same generators."""
    from lapheads.models.gpt import sample_rows, sample_token

    settings = [(0.0, None, None, None), (1.0, None, None, None), (0.8, 5, None, None), (1.2, None, 0.9, None),
                (0.7, 3, 0.5, None), (1.0, 500, None, None), (1.0, None, 1e-300, None), (1e-6, 4, 0.5, None),
                (0.6, 0, 1.0, None), (0.8, 5, None, None), (1.0, None, None, 0.3), (0.8, 5, None, 0.3),
                (1.2, None, 0.9, 0.05), (1.0, None, None, 0.3), (0.9, None, None, 0.0)]  # fmt: skip
    batch, alone = ([torch.Generator().manual_seed(seed) for seed in range(len(settings))] for _ in range(2))
    temperatures, top_ks, top_ps, min_ps = (list(column) for column in zip(*settings))
    logits = torch.randn(len(settings), 97, generator=torch.Generator().manual_seed(0)) * 0.5  # flat: tails get drawn
    for _ in range(50):
        together = sample_rows(logits, temperatures, top_ks, top_ps, batch, min_ps)
        one_by_one = [int(sample_token(logits[row : row + 1], *settings[row][:2], alone[row], *settings[row][2:]))
                      for row in range(len(settings))]  # fmt: skip
        assert together == one_by_one
    greedy = sample_rows(logits[:2], [0.0, 0.0], [None, None], [None, None], [None, None])
    assert greedy == logits[:2].argmax(-1).tolist()


@pytest.mark.parametrize("min_p", [0.02, 0.1, 0.5, 1.0])
def test_min_p_keeps_what_transformers_keeps_and_comes_before_top_k_and_top_p_as_in_vllm(min_p):
    """min-p alone at a temperature: the tokens kept are transformers' TemperatureLogitsWarper then MinPLogitsWarper
    (the draws from one generator state agree); with top-k and top-p it comes first, as vLLM's sampler applies it
    (written out: min-p, then top-k, then the nucleus of what is left), which differs from transformers' order."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    from lapheads.models.gpt import _filtered, sample_token

    logits = torch.randn(6, 97, generator=torch.Generator().manual_seed(3)) * 2
    theirs = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(0.7)(None, logits.clone()))
    assert torch.equal(_filtered(logits, 0.7, None, None, min_p).isinf(), theirs.isinf())
    for seed in range(10):
        ours = sample_token(logits, 0.7, None, torch.Generator().manual_seed(seed), None, min_p)
        drawn = torch.multinomial(theirs.softmax(-1), 1, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(ours, drawn)
    probs = (logits / 0.7).softmax(-1)
    kept = probs >= min_p * probs.amax(-1, keepdim=True)  # vLLM: min-p first
    kept &= probs >= probs.masked_fill(~kept, 0).topk(5).values[:, -1:]  # then top-k among what is left
    left = probs.masked_fill(~kept, 0)
    left = left / left.sum(-1, keepdim=True)
    ordered, order = left.sort(-1, descending=True)
    beyond = ordered.cumsum(-1) - ordered >= 0.6  # then the nucleus of what is left
    beyond[:, 0] = False
    kept &= ~torch.zeros_like(beyond).scatter(-1, order, beyond)
    assert torch.equal(~_filtered(logits, 0.7, 5, 0.6, min_p).isinf(), kept)
