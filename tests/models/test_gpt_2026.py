"""The 2026 nanochat family (the authors' fork) as options of lapheads' GPT, and nanochat checkpoints.

Each option is tested by its defining property; the fork's own architecture tests (parameter count unchanged by
Laplacian heads, no-op at initialisation, trailing heads, per-layer lists) hold in both families.
"""

from __future__ import annotations

import json

import pytest
import torch

from lapheads import laplacian_attention_reference, load_nanochat
from lapheads.core.masks import SlidingWindow
from lapheads.errors import CheckpointError, InputError
from lapheads.models.gpt import GPT, GPTConfig

TINY = dict(depth=4, vocab_size=40, sequence_len=32, aspect_ratio=16, head_dim=16)  # 64 wide, 4 heads
EVERY_OPTION = dict(TINY, arch="nanochat-2026", short_window=5, n_kv_head=2, laplacian_heads="0,1,2,4")
FAMILIES = ["nanochat-2025", "nanochat-2026"]


def _random_weights(model: GPT, seed: int = 0) -> GPT:
    """Non-zero weights everywhere (at init the output projections are zero and every block is the identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def test_parameter_counts_of_both_families_on_the_meta_device():
    with torch.device("meta"):
        d20_2025 = GPT(GPTConfig(depth=20, vocab_size=65536))
        d20_2026 = GPT(GPTConfig(depth=20, vocab_size=32768, arch="nanochat-2026"))
        d20_2026_lap = GPT(GPTConfig(depth=20, vocab_size=32768, arch="nanochat-2026", laplacian_heads=5))
    assert d20_2025.num_params() == 560_988_160
    assert d20_2026.num_params() == d20_2026_lap.num_params() == 896_533_746  # the fork's own count


def test_the_family_sets_every_unset_option_and_an_explicit_option_wins():
    c = GPTConfig(arch="nanochat-2026")
    assert (c.use_ve, c.use_smear, c.window_pattern, c.qk_scale, c.rope_base, c.pad_vocab_size_to, c.init) == (
        True,
        True,
        "SSSL",
        1.2,
        100000.0,
        64,
        "nanochat-2026",
    )
    assert GPTConfig(arch="nanochat-2026", use_smear=False, window_pattern="l").window_pattern == "L"
    assert not GPTConfig(arch="nanochat-2026", use_smear=False).use_smear
    assert GPTConfig().rope_base == 10000.0 and not GPTConfig().use_ve
    # the fork's width rule: depth x aspect rounded up to whole heads of head_dim
    assert GPTConfig(depth=5, aspect_ratio=64, head_dim=128, arch="nanochat-2026").n_embd == 384
    assert GPTConfig(depth=5, aspect_ratio=64, head_dim=128).n_embd == 320
    with pytest.raises(InputError, match="arch='nanochat-2027'"):
        GPTConfig(arch="nanochat-2027")
    with pytest.raises(InputError, match="window_pattern='SXL'"):
        GPT(GPTConfig(**TINY, window_pattern="SXL"))
    assert GPTConfig(**GPTConfig(arch="nanochat-2026").to_dict()) == GPTConfig(arch="nanochat-2026")


@pytest.mark.parametrize("arch", FAMILIES)
def test_fork_properties_laplacian_heads_add_no_parameters_and_are_a_no_op_at_init(arch):
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**TINY, arch=arch))
    torch.manual_seed(0)
    laplacian = GPT(GPTConfig(**TINY, arch=arch, laplacian_heads=4))
    assert plain.num_params() == laplacian.num_params()
    idx = torch.randint(0, 40, (2, 16))
    torch.testing.assert_close(plain(idx), laplacian(idx), rtol=0, atol=0)  # zero output projections at init
    assert laplacian.laplacian_masks() == [[True] * 4] * 4
    trailing = GPT(GPTConfig(**TINY, arch=arch, laplacian_heads=[0, 1, 3, 4]))
    assert [sum(m) for m in trailing.laplacian_masks()] == [0, 1, 3, 4]
    assert trailing.laplacian_masks()[2] == [False, True, True, True]


def test_sliding_window_mask_is_flash_attention_window_semantics():
    mask = SlidingWindow(2).dense(1, 6, 6, "cpu")[0, 0]
    assert mask[5].tolist() == [False, False, False, True, True, True]  # itself and 2 before it
    assert SlidingWindow(2).dense(1, 1, 6, "cpu")[0, 0].tolist() == mask[5:].tolist()  # decoding: bottom row
    windows = GPTConfig(depth=5, sequence_len=2048, arch="nanochat-2026").window_sizes()
    assert windows == [512, 512, 512, None, None]  # SSSL tiled, the last layer always long; 2048 / 4 -> 512


def test_a_token_beyond_an_s_layers_window_has_no_influence():
    model = _random_weights(GPT(GPTConfig(**dict(EVERY_OPTION, use_smear=False, window_pattern="S"))))
    outputs = {}
    model.blocks[0].register_forward_hook(lambda m, i, o: outputs.__setitem__("block0", o))
    idx = torch.randint(0, 40, (1, 16))
    query, window = 12, 5
    with torch.no_grad():
        model(idx)
        base = outputs["block0"][0, query].clone()
        for position, influences in ((query - window - 1, False), (query - window, True)):
            changed = idx.clone()
            changed[0, position] = (changed[0, position] + 1) % 40
            model(changed)
            moved = not torch.allclose(outputs["block0"][0, query], base, atol=1e-6)
            assert moved == influences, position


def _one_token_attention(config: GPTConfig, gate_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer output of a single token whose own value is zero: all that remains is the gated value embedding."""
    model = GPT(config)
    attn = model.blocks[-1].attn  # the last layer always has a value embedding
    with torch.no_grad():
        attn.c_v.weight.zero_()
        attn.c_proj.weight.copy_(torch.eye(attn.c_proj.weight.shape[0]))
        attn.ve_gate.weight.fill_(gate_weight)
    x = torch.ones(1, 1, config.n_embd)
    ve = torch.randn(1, 1, attn.n_kv_head * attn.head_dim)
    cos_sin = model.cos[:, :1], model.sin[:, :1]
    with torch.no_grad():
        return attn(x, cos_sin, None, ve), ve


def test_value_embedding_gate_lies_in_0_3():
    config = GPTConfig(**dict(TINY, arch="nanochat-2026"))
    for weight, factor in ((100.0, 3.0), (-100.0, 0.0), (0.0, 1.5)):
        out, ve = _one_token_attention(config, weight)
        torch.testing.assert_close(out.flatten(), factor * ve.flatten(), atol=1e-5, rtol=0)


def test_laplacian_heads_use_the_value_after_the_value_embedding_mix():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(TINY, arch="nanochat-2026", laplacian_heads=4, window_pattern="L")))
    attn = model.blocks[-1].attn
    with torch.no_grad():
        attn.c_v.weight.zero_()  # v = 0 before the mix: only the value embedding gives the heads anything
        attn.c_proj.weight.copy_(torch.eye(64))
    x, ve = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    cos_sin = model.cos[:, :5], model.sin[:, :5]
    with torch.no_grad():
        out = attn(x, cos_sin, None, ve)
        gate = 3 * torch.sigmoid(attn.ve_gate(x[..., :12]))
        v = (gate.unsqueeze(-1) * ve.view(1, 5, 4, 16)).transpose(1, 2)
        q = torch.nn.functional.rms_norm(model_rotary(model, attn.c_q(x).view(1, 5, 4, 16), 5), (16,)) * 1.2
        k = torch.nn.functional.rms_norm(model_rotary(model, attn.c_k(x).view(1, 5, 4, 16), 5), (16,)) * 1.2
        expected, _ = laplacian_attention_reference(
            q.transpose(1, 2), k.transpose(1, 2), v, 4, is_causal=True, return_attn=True
        )
    assert out.abs().max() > 0.01
    torch.testing.assert_close(out, expected.transpose(1, 2).reshape(1, 5, 64), atol=1e-5, rtol=1e-5)


def model_rotary(model: GPT, x: torch.Tensor, t: int) -> torch.Tensor:
    from lapheads.models.gpt import apply_rotary

    return apply_rotary(x, model.cos[:, :t], model.sin[:, :t])


def test_backout_subtracts_the_mid_depth_stream_before_the_final_norm():
    model = _random_weights(GPT(GPTConfig(**dict(TINY, arch="nanochat-2026"))))
    seen = {}
    model.blocks[TINY["depth"] // 2].register_forward_hook(lambda m, i, o: seen.__setitem__("mid", o))
    model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("final", i[0]))
    idx = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        model.backout_lambda.fill_(0.0)
        model(idx)
        without = seen["final"].clone()
        model.backout_lambda.fill_(0.7)
        model(idx)
    torch.testing.assert_close(seen["final"], without - 0.7 * seen["mid"], atol=1e-5, rtol=1e-5)


def test_scalars_start_as_the_fork_initialises_them_and_the_vocab_is_padded():
    model = GPT(GPTConfig(**dict(TINY, arch="nanochat-2026")))
    torch.testing.assert_close(model.resid_lambdas, torch.tensor([1.15, 1.15 - 0.1 / 3, 1.15 - 0.2 / 3, 1.05]))
    torch.testing.assert_close(model.x0_lambdas, torch.tensor([0.20, 0.15, 0.10, 0.05]))
    assert float(model.smear_lambda.detach()) == 0.0 and float(model.backout_lambda.detach()) == pytest.approx(0.2)
    assert model.transformer["wte"].weight.shape[0] == 64 and model(torch.randint(0, 40, (1, 3))).shape == (1, 3, 40)
    assert sorted(model.value_embeds) == ["1", "3"]  # alternating, the last layer included


def test_the_smear_mixes_the_previous_token_only():
    model = _random_weights(GPT(GPTConfig(**dict(TINY, arch="nanochat-2026", use_x0=False))))
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0]))
    idx = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        model(idx)
        smeared = seen["x"].clone()
        model.smear_lambda.fill_(0.0)
        model(idx)
    torch.testing.assert_close(smeared[:, 0], seen["x"][:, 0])  # the first token has nobody before it
    assert not torch.allclose(smeared[:, 1:], seen["x"][:, 1:])


@pytest.mark.parametrize("arch", FAMILIES)
def test_kv_cache_decoding_equals_the_full_forward_with_every_option_on(arch):
    model = _random_weights(GPT(GPTConfig(**dict(EVERY_OPTION, arch=arch))))
    idx = torch.randint(0, 40, (2, 20))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_kv_cache(2, 20)
        pieces = [model(idx[:, :7], kv_cache=cache), model(idx[:, 7:11], kv_cache=cache)]  # prefill, then a chunk
        pieces += [model(idx[:, t : t + 1], kv_cache=cache) for t in range(11, 20)]  # then token by token
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=2e-4, rtol=1e-4)
    out = model.generate(idx[:, :5], 6, temperature=0)
    with torch.no_grad():
        ids = idx[:, :5]
        for _ in range(6):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


@pytest.mark.parametrize("arch", FAMILIES)
def test_rows_of_their_own_lengths_decode_the_logits_each_has_alone(arch):
    """GPT.prefill of prompts of three lengths (one longer than the 2026 family's window of 5), then steps at each
    row's own position, a row that joins with a longer prompt, and the longest row leaving: every row's logits are
    its full forward's, with every option on (windows, smear, value embeddings, GQA, Laplacian heads)."""
    model = _random_weights(GPT(GPTConfig(**dict(EVERY_OPTION, arch=arch))))
    seqs = [torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 6, 9, 16)]
    lengths = [9, 3, 6]  # the prompts; then tokens follow one a step
    with torch.no_grad():
        cache, last = model.prefill([s[:n] for s, n in zip(seqs, lengths)])
        assert cache.lengths.tolist() == lengths and cache.pos == 9
        alone = lambda row, n: model(torch.tensor([seqs[row][:n]]))[0, -1]  # noqa: E731
        for row, n in enumerate(lengths):
            torch.testing.assert_close(last[row], alone(row, n), atol=2e-4, rtol=1e-4)
        rows = [0, 1, 2]
        for step in range(3):
            if step == 1:  # a longer prompt joins
                joining, joined = model.prefill([seqs[3][:12]], 12)
                cache.join(joining)
                rows, lengths, last = rows + [3], lengths + [12], torch.cat([last, joined])
            if step == 2:  # the longest row leaves: the rest attend over fewer keys
                cache.keep(torch.tensor([1, 2, 3]))
                rows, lengths, last = rows[1:], lengths[1:], last[1:]
            tokens = torch.tensor([[seqs[row][n]] for row, n in zip(rows, lengths)])
            lengths = [n + 1 for n in lengths]
            last = model(tokens, kv_cache=cache)[:, -1]
            for slot, (row, n) in enumerate(zip(rows, lengths)):
                torch.testing.assert_close(last[slot], alone(row, n), atol=2e-4, rtol=1e-4)
        assert cache.lengths.tolist() == lengths
    with pytest.raises(InputError, match="logits_at with targets; allowed: one of them"):
        model(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), logits_at=torch.tensor([2]))


def test_the_2026_family_builds_on_meta_like_a_direct_build():
    torch.manual_seed(0)
    direct = GPT(GPTConfig(**EVERY_OPTION))
    with torch.device("meta"):
        meta = GPT(GPTConfig(**EVERY_OPTION))
    meta.to_empty(device="cpu")
    meta.init_weights()
    meta.load_state_dict(_random_weights(direct).state_dict(), strict=True)
    idx = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(meta.eval()(idx), direct(idx), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# nanochat checkpoints


def _write_nanochat(folder, model: GPT, model_config: dict, step: int = 1200, compiled: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    prefix = "_orig_mod." if compiled else ""
    torch.save({prefix + k: v for k, v in model.state_dict().items()}, folder / f"model_{step:06d}.pt")
    (folder / f"meta_{step:06d}.json").write_text(json.dumps({"step": step, "model_config": model_config}))


def test_load_nanochat_2025_and_2026_key_sets_strictly(tmp_path):
    old = _random_weights(GPT(GPTConfig(**TINY)))
    _write_nanochat(
        tmp_path / "d4-2025",
        old,
        {"sequence_len": 32, "vocab_size": 40, "n_layer": 4, "n_head": 4, "n_kv_head": 4, "n_embd": 64},
    )
    new_config = GPTConfig(**dict(TINY, arch="nanochat-2026", laplacian_heads=[0, 1, 2, 0], window_pattern="SL"))
    new = _random_weights(GPT(new_config))
    _write_nanochat(
        tmp_path / "d4-2026",
        new,
        {
            "sequence_len": 32,
            "vocab_size": 40,
            "n_layer": 4,
            "n_head": 4,
            "n_kv_head": 4,
            "n_embd": 64,
            "use_ve": True,
            "use_resid_lambdas": True,
            "use_x0": True,
            "use_smear": True,
            "use_backout": True,
            "window_pattern": "SL",
            "laplacian_heads": [0, 1, 2, 0],
        },
        compiled=True,
    )
    idx = torch.randint(0, 40, (2, 12))
    for folder, reference in (("d4-2025", old), ("d4-2026", new)):
        model, meta = load_nanochat(tmp_path / folder)
        assert meta["step"] == 1200
        with torch.no_grad():
            torch.testing.assert_close(model(idx), reference(idx), rtol=0, atol=0)
    loaded, meta = load_nanochat(tmp_path / "d4-2026")
    assert meta["model_config"]["arch"] == "nanochat-2026" and loaded.laplacian_masks()[2] == [False, False, True, True]
    assert load_nanochat(tmp_path / "d4-2025")[1]["model_config"]["arch"] == "nanochat-2025"


def test_load_nanochat_refuses_code_missing_steps_and_mismatched_weights(tmp_path):
    class Payload:
        def __reduce__(self):
            import os

            return os.system, (f"touch {tmp_path / 'ran'}",)

    import pickle

    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "model_000010.pt").write_bytes(pickle.dumps({"transformer.wte.weight": Payload()}))
    (folder / "meta_000010.json").write_text(json.dumps({"model_config": {}}))
    with pytest.raises(CheckpointError, match="never runs code"):
        load_nanochat(folder)
    assert not (tmp_path / "ran").exists()
    with pytest.raises(CheckpointError, match="holds no nanochat checkpoint"):
        load_nanochat(tmp_path)
    good = tmp_path / "good"
    _write_nanochat(
        good,
        GPT(GPTConfig(**TINY)),
        {"sequence_len": 32, "vocab_size": 40, "n_layer": 4, "n_head": 4, "n_kv_head": 4, "n_embd": 64},
    )
    with pytest.raises(CheckpointError, match="no step 5; allowed: 1200"):
        load_nanochat(good, step=5)
    (good / "meta_001200.json").write_text(
        json.dumps(
            {
                "model_config": {
                    "sequence_len": 32,
                    "vocab_size": 40,
                    "n_layer": 4,
                    "n_head": 4,
                    "n_kv_head": 4,
                    "n_embd": 128,
                }
            }
        )
    )
    with pytest.raises(CheckpointError, match="does not match its own model_config"):
        load_nanochat(good)


@pytest.mark.parametrize(("key", "value"), [("n_head", 0), ("n_layer", -1), ("n_embd", "64"), ("n_kv_head", 0)])
def test_a_nanochat_model_config_with_a_size_below_one_is_one_line(key, value):
    """Issue 76 (red team, low): n_head 0 divided by zero in the loader."""
    from lapheads.errors import InputError
    from lapheads.models.nanochat import nanochat_gpt_config

    config = {"n_layer": 2, "n_head": 4, "n_kv_head": 4, "n_embd": 64, "sequence_len": 32, "vocab_size": 99}
    with pytest.raises(InputError, match=f"nanochat model_config {key} {value!r}; allowed: an integer >= 1"):
        nanochat_gpt_config({**config, key: value})


def test_a_nanochat_model_config_key_the_loader_does_not_read_is_said(capsys):
    from lapheads.models.nanochat import nanochat_gpt_config

    config = {"n_layer": 2, "n_head": 4, "n_embd": 64, "sequence_len": 32, "vocab_size": 99, "softcap": 15}
    nanochat_gpt_config(config)
    assert "keys this loader does not read: softcap" in capsys.readouterr().err


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_packed_batch_with_document_ids_gives_each_document_the_logits_it_has_alone(arch):
    """Issue 75: packed sequences without a T x T mask: Documents (and window & Documents in the S layers) keep
    attention and the smear within each document; rotary positions are relative, so each document's logits are
    those it has alone, Laplacian heads included."""
    model = _random_weights(GPT(GPTConfig(**dict(EVERY_OPTION, arch=arch))))
    first, second = torch.randint(0, 40, (2, 11)), torch.randint(0, 40, (2, 9))
    packed = torch.cat([first, second], dim=1)
    ids = torch.tensor([[0] * 11 + [1] * 9, [3] * 11 + [5] * 9])
    with torch.no_grad():
        together = model(packed, document_ids=ids)
        torch.testing.assert_close(together[:, :11], model(first), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(together[:, 11:], model(second), rtol=1e-4, atol=1e-4)
        assert (model(packed)[:, 11:] - model(second)).abs().max() > 1e-2  # without the ids the documents mix
    model.train()
    model(packed, packed, document_ids=ids).backward()  # the CPU's differentiable backends: dense and banded
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():  # under a KV cache the ids name every key, the cached ones too: decoding as one forward
        cache = model.new_kv_cache(2)
        prefill = model(packed[:, :15], kv_cache=cache, document_ids=ids[:, :15])
        decoded = [model(packed[:, i : i + 1], kv_cache=cache, document_ids=ids[:, : i + 1]) for i in range(15, 20)]
        torch.testing.assert_close(torch.cat([prefill, *decoded], dim=1), together, rtol=1e-4, atol=1e-4)
    with pytest.raises(InputError, match="document_ids of 3 tokens with a KV cache of 4 keys; allowed: one id per key"):
        cache = model.new_kv_cache(2)
        model(packed[:, :1], kv_cache=cache)
        model(packed[:, 1:4], kv_cache=cache, document_ids=ids[:, 1:4])
