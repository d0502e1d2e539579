"""lapheads.integrations.hf: Laplacian heads in transformers models built from tiny configs (no downloads)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
import lapheads.integrations.hf as lhf  # noqa: E402
from lapheads.core.convert import attention_modules  # noqa: E402
from lapheads.errors import InputError  # noqa: E402

#: the small decoder both Llama and Mistral are built at (GQA: 4 query heads over 2 key/value heads)
SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=4))


def _gpt2():
    config = transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def _vit():
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    return transformers.ViTModel(config)


MODELS = {"llama": _llama, "mistral": _mistral, "gpt2": _gpt2, "vit": _vit}


def _build(name: str, attn: str = "sdpa"):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    model.set_attn_implementation(attn)
    return model


def _run(model, name: str, **kwargs):
    torch.manual_seed(1)
    with torch.no_grad():
        if name == "vit":
            return model(pixel_values=torch.randn(2, 3, 16, 16), **kwargs).last_hidden_state
        return model(torch.randint(0, 100, (2, 12)), **kwargs).logits


@pytest.mark.parametrize("name", list(MODELS))
def test_zero_heads_equal_sdpa_and_k_heads_equal_the_textbook_per_head(name):
    plain = _build(name)
    reference = _run(plain, name)
    model = lhf.enable(copy.deepcopy(plain), 0)
    assert model.config._attn_implementation == "lapheads"
    torch.testing.assert_close(_run(model, name), reference, rtol=0, atol=1e-6)
    lhf.enable(model, "1,3")
    fused = _run(model, name)
    textbook = _run(model, name, output_attentions=True)  # the reference path: P materialised, I - P per head
    torch.testing.assert_close(fused, textbook, rtol=1e-5, atol=1e-5)
    assert (fused - reference).abs().max() > 1e-3  # the heads changed something
    assert model.config.laplacian_heads == [[False, False, False, True], [False, True, True, True]]


def test_the_op_gets_what_the_timm_module_hands_it(monkeypatch):
    """Trailing heads reach the op as the int k (no device mask per call; on every device the one-node training
    path), any other mask as the mask; a model loaded from its config the same."""
    seen = []
    op = lhf.laplacian_attention

    def recording(q, k, v, heads, **options):
        seen.append(heads if isinstance(heads, int) else heads.tolist())
        return op(q, k, v, heads, **options)

    monkeypatch.setattr(lhf, "laplacian_attention", recording)
    model = lhf.enable(_build("llama"), [[False, False, True, True], [True, False, False, False]])
    _run(model, "llama")
    assert seen == [2, [True, False, False, False]]
    model.train()
    ids = torch.randint(0, 100, (2, 12))
    out = model(ids).logits
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2"])
def test_cached_decoding_equals_the_full_forward_and_generate_agrees_across_caches(name):
    model = lhf.enable(_build(name), 2)
    torch.manual_seed(2)
    ids = torch.randint(0, 100, (1, 10))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for i in range(6, 10):
            out = model(ids[:, i : i + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    prompt = ids[:, :5]
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    dynamic = model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, use_cache=False, **kwargs), dynamic)
    if name != "gpt2":
        assert torch.equal(model.generate(prompt, cache_implementation="static", **kwargs), dynamic)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_a_left_padded_row_equals_the_unpadded_sequence(name):
    model = lhf.enable(_build(name), "2,1")
    torch.manual_seed(3)
    ids = torch.randint(1, 100, (1, 9))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    batch = torch.cat([padded, torch.randint(1, 100, (1, 12))])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    with torch.no_grad():
        alone = model(ids).logits
        together = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(together[0, 3:], alone[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2], ids=["one row", "every row right-padded"])
def test_a_right_padded_row_equals_the_unpadded_sequence(rows):
    """Trailing padding hides the last keys from every query; each real token must still read its own value (the
    rule once took hidden trailing keys for a static cache's empty slots and shifted every identity by the pad)."""
    model = lhf.enable(_build("llama"), "2,1")
    torch.manual_seed(4)
    ids = torch.randint(1, 100, (rows, 9))
    batch = torch.cat([ids, torch.zeros(rows, 3, dtype=torch.long)], 1)
    mask = torch.ones_like(batch)
    mask[:, 9:] = 0
    with torch.no_grad():
        alone = model(ids).logits
        together = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(together[:, :9], alone, rtol=1e-4, atol=1e-4)


def test_a_config_with_laplacian_heads_runs_them_however_the_model_is_built_or_loaded(tmp_path):
    """transformers does not save the attn_implementation a config was built with: a model built straight from a
    config with Laplacian heads, saved and loaded with transformers' own from_pretrained, runs them (it ran SDPA,
    silently, before); asking for another implementation is a one-line error."""
    config = transformers.LlamaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=37, attn_implementation="lapheads",
    )  # fmt: skip
    config.laplacian_heads = [[False, False, False, True]] * 2
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 99, (2, 7))
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation == "lapheads"
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    for other in ("sdpa", "flash_attention_2"):
        with pytest.raises(InputError, match=f"attn_implementation='{other}' on a model whose config has Laplacian"):
            transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation=other)
        with pytest.raises(InputError, match="would run plain attention and drop them"):
            loaded.set_attn_implementation(other)
    eager = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert eager.config._attn_implementation == lhf.EAGER_NAME  # the textbook path: the same Laplacian heads
    with torch.no_grad():
        torch.testing.assert_close(eager(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_spec_survives_saving_and_plain_loading_refuses_it(tmp_path):
    model = lhf.enable(_build("llama"), "0,2")
    model.save_pretrained(tmp_path)
    loaded = lhf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path).eval()
    assert loaded.config.laplacian_heads == model.config.laplacian_heads
    assert [m.laplacian_mask.tolist() for m in lhf.attention_modules(loaded)] == model.config.laplacian_heads
    torch.testing.assert_close(_run(loaded, "llama"), _run(model, "llama"))
    with pytest.raises(InputError, match="attn_implementation='sdpa' would load it as plain attention"):
        lhf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path, attn_implementation="sdpa")


#: each plain load a user of transformers might try, in a process that never imported lapheads: what it did
_PLAIN_LOADS = """
import json, sys, warnings
import transformers
d, out = sys.argv[1], {}
def attempt(name, load):
    try:
        load()
        out[name] = "loaded"
    except Exception as err:
        out[name] = f"refused: {type(err).__name__}: {err}"
attempt("config round trip", lambda: transformers.AutoConfig.from_pretrained(d).save_pretrained(d + "-copy"))
for implementation in (None, "sdpa", "eager"):
    kwargs = {} if implementation is None else {"attn_implementation": implementation}
    attempt(f"auto {implementation}", lambda: transformers.AutoModelForCausalLM.from_pretrained(d, **kwargs))
    attempt(f"class {implementation}", lambda: transformers.LlamaForCausalLM.from_pretrained(d, **kwargs))
attempt("pipeline", lambda: transformers.pipeline("text-generation", model=d, tokenizer="gpt2"))
print(json.dumps(out))
"""


def test_every_plain_load_of_a_laplacian_checkpoint_refuses_except_the_named_class_case(tmp_path):
    """Issue 76 (red team, high): a plain config round trip dropped the only marker transformers read, and a plain
    load with attn_implementation="sdpa" ran plain attention, logits off by 0.17, nothing said. The saved model type
    is now lapheads_<type>: every Auto load refuses, whatever implementation is asked for, and a config round trip
    cannot happen without lapheads. What stays uncovered is exactly what docs/integrations.md says: the family's
    class called by name, which transformers only warns about."""
    import json

    model = lhf.enable(_llama(), "0,2")
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["model_type"] == "lapheads_llama" and saved["architectures"] == ["LaplacianLlamaForCausalLM"]
    run = subprocess.run(
        [sys.executable, "-c", _PLAIN_LOADS, str(tmp_path / "saved")], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    unknown_type = re.compile(r"model type .?lapheads_llama.? but Transformers does not recognize this architecture")
    for name in ("config round trip", "auto None", "auto sdpa", "auto eager", "pipeline"):
        assert outcome[name].startswith("refused") and unknown_type.search(outcome[name]), (name, outcome[name])
    assert not (tmp_path / "saved-copy").exists()
    assert outcome["class None"].startswith("refused") and 'attn_implementation="lapheads"' in outcome["class None"]
    # the uncovered case, as documented: the named class with an explicit implementation loads after a warning
    assert outcome["class sdpa"] == "loaded" and outcome["class eager"] == "loaded"
    assert re.search(r"model of type .?lapheads_llama.? to instantiate a model of type .?llama", run.stderr)


def test_with_lapheads_a_laplacian_checkpoint_round_trips_through_autoconfig_and_automodel(tmp_path):
    import json
    import shutil

    model = lhf.enable(_llama(), "0,2").eval()
    model.save_pretrained(tmp_path / "saved")
    shutil.copytree(tmp_path / "saved", tmp_path / "copy")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "copy")
    assert config.model_type == "lapheads_llama" and isinstance(config, transformers.LlamaConfig)
    config.save_pretrained(tmp_path / "copy")  # the round trip that dropped the marker keeps it now
    saved = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert saved["model_type"] == "lapheads_llama" and saved["laplacian_heads"] == model.config.laplacian_heads
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "copy").eval()
    assert isinstance(loaded, transformers.LlamaForCausalLM) and loaded.config._attn_implementation == lhf.NAME
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    with pytest.raises(InputError, match="would run plain attention and drop them"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "copy", attn_implementation="sdpa")
    loaded.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["model_type"] == "lapheads_llama" and again["architectures"] == ["LaplacianLlamaForCausalLM"]
    with pytest.raises(ValueError, match="lapheads_nosuchfamily"):  # only a family transformers knows is taught
        transformers.AutoConfig.for_model("lapheads_nosuchfamily")


def test_blend_starts_at_the_pretrained_function_and_signflip_keeps_the_attention_term():
    pretrained = _build("llama")
    reference = _run(pretrained, "llama")
    blended = lhf.enable(copy.deepcopy(pretrained), 2, init="blend")
    assert torch.equal(_run(blended, "llama"), reference)
    schedule = lhf.BlendSchedule(blended, steps=4)
    assert schedule(2) == 0.5 and schedule(10) == 1.0
    torch.testing.assert_close(_run(blended, "llama"), _run(lhf.enable(copy.deepcopy(pretrained), 2), "llama"))

    flipped = lhf.enable(copy.deepcopy(pretrained), 2, init="signflip")
    x = torch.randn(1, 7, 64)
    position_ids = torch.arange(7)[None]
    rotary = pretrained.model.rotary_emb(x, position_ids)
    attention = pretrained.model.layers[0].self_attn
    with torch.no_grad():
        plain_out = attention(x, position_embeddings=rotary, attention_mask=None)[0]
        flip_out = flipped.model.layers[0].self_attn(x, position_embeddings=rotary, attention_mask=None)[0]
        v = attention.v_proj(x).view(1, 7, 2, 16).repeat_interleave(2, 2)  # (B, T, H, D), GQA expanded
        w = attention.o_proj.weight.view(64, 4, 16)
        identity_term = torch.einsum("bthd,ohd->bto", v[:, :, 2:], w[:, 2:])
    # (-W_O)(V - P V) = W_O P V - W_O V: the pretrained attention term exactly, minus the identity term
    torch.testing.assert_close(flip_out, plain_out - identity_term, rtol=1e-5, atol=1e-5)


def test_lora_wraps_an_enabled_model_and_merges_exactly():
    peft = pytest.importorskip("peft")
    model = lhf.enable(_build("llama"), 2)
    reference = _run(model, "llama")
    adapted = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    )
    torch.testing.assert_close(_run(adapted, "llama"), reference, rtol=0, atol=0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    moved = _run(adapted, "llama")
    merged = adapted.merge_and_unload()
    torch.testing.assert_close(_run(merged, "llama"), moved, rtol=1e-5, atol=1e-5)


def test_unsupported_input_is_one_line():
    with pytest.raises(InputError, match="init='warm'; allowed: switch, signflip, blend"):
        lhf.enable(_build("llama"), 1, init="warm")
    with pytest.raises(Exception, match="laplacian_heads=9 is out of range"):
        lhf.enable(_build("llama"), 9)
    with pytest.raises(InputError, match="uses a logit soft cap"):
        lhf.lapheads_attention(torch.nn.Module(), *(torch.randn(1, 2, 3, 4) for _ in range(3)), None, softcap=50.0)
    with pytest.raises(InputError, match="was not converted with init='blend'"):
        lhf.set_blend(lhf.enable(_build("llama"), 1), 0.5)


@pytest.mark.slow
def test_importing_lapheads_hf_is_enough_to_load_a_saved_model_and_a_mid_schedule_blend_round_trips(tmp_path):
    model = lhf.enable(_build("llama"), 2, init="blend")
    lhf.set_blend(model, 0.5)
    model.save_pretrained(tmp_path)
    expected = _run(model, "llama")
    assert transformers.AutoConfig.from_pretrained(tmp_path).laplacian_blend == 0.5
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no register() call: the import did
    torch.testing.assert_close(_run(plain, "llama"), expected)
    ours = lhf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path).eval()
    torch.testing.assert_close(_run(ours, "llama"), expected)
    assert all(float(m.laplacian_blend) == 0.5 for m in lhf.attention_modules(ours))


@pytest.mark.parametrize("k", [0, 2])
def test_attention_maps_of_a_left_padded_batch_are_finite_and_change_nothing(k):
    model = lhf.enable(_build("llama"), k)
    torch.manual_seed(3)
    batch = torch.randint(1, 100, (2, 9))
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    with torch.no_grad():
        plain = model(batch, attention_mask=mask).logits
        mapped = model(batch, attention_mask=mask, output_attentions=True)
    assert torch.isfinite(mapped.logits).all() and all(torch.isfinite(a).all() for a in mapped.attentions)
    torch.testing.assert_close(mapped.logits[0, 3:], plain[0, 3:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mapped.logits[1], plain[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fused", [True, False])
def test_a_prefix_lm_mask_takes_each_querys_own_value(fused):
    """Every head Laplacian, a 4D prefix-LM mask (PaliGemma: the prefix bidirectional, the rest causal) and one with
    a bidirectional image block inside causal text (Gemma-3): the output is (I - P) V with each query's own value."""
    model = lhf.enable(_build("llama"), 4)
    module = model.model.layers[0].self_attn
    torch.manual_seed(2)
    t = 7
    prefix = torch.ones(t, t, dtype=torch.bool).tril()
    prefix[:4, :4] = True
    image = torch.ones(t, t, dtype=torch.bool).tril()
    image[1:5, 1:5] = True
    for mask in (prefix, image):
        q = torch.randn(2, 4, t, 16)
        k, v = torch.randn(2, 2, t, 16), torch.randn(2, 2, t, 16)
        out, weights = lhf.lapheads_attention(
            module, q, k, v, mask[None, None].expand(2, 1, t, t), scaling=0.25, output_attentions=not fused
        )
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        p = ((q @ kk.transpose(-2, -1)) * 0.25).masked_fill(~mask, float("-inf")).softmax(-1)
        torch.testing.assert_close(out, (vv - p @ vv).transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_attention_maps_come_back_from_every_family(name):
    """GPT-2's attention takes output_attentions as its own parameter and never passes it on; the maps still come
    from the textbook path, one (B, H, T, T) per layer, rows summing to 1, and the first layer's P equals SDPA's
    eager maps (P does not depend on which heads are Laplacian)."""
    eager = _build(name, attn="eager")
    model = lhf.enable(copy.deepcopy(eager), 2)
    batch = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        maps = model(batch, output_attentions=True).attentions
        reference = eager(batch, output_attentions=True).attentions
    assert len(maps) == 2 and all(m is not None and m.shape == (2, 4, 6, 6) for m in maps)
    assert all(torch.allclose(m.sum(-1), torch.ones(2, 4, 6)) for m in maps)
    torch.testing.assert_close(maps[0], reference[0], rtol=1e-5, atol=1e-6)


def test_head_kinds_run_in_a_hugging_face_model_and_mix_heads_round_trip(tmp_path):
    plain = _build("llama")
    reference = _run(plain, "llama")
    mixed = lhf.enable(copy.deepcopy(plain), "mix")  # a = 0, b = 1: every head ordinary at the start
    torch.testing.assert_close(_run(mixed, "llama"), reference, rtol=0, atol=1e-6)
    laplacian = _run(lhf.enable(copy.deepcopy(plain), 4), "llama")
    with torch.no_grad():
        for module in lhf.attention_modules(mixed):
            module.mix_a.fill_(1.0), module.mix_b.fill_(-1.0)  # the Laplacian point of the plane
    torch.testing.assert_close(_run(mixed, "llama"), laplacian, rtol=1e-5, atol=1e-5)
    kinds = lhf.enable(copy.deepcopy(plain), "ordinary/negated/centring/mix")
    fused = _run(kinds, "llama")
    torch.testing.assert_close(fused, _run(kinds, "llama", output_attentions=True), rtol=1e-5, atol=1e-5)
    assert kinds.config.laplacian_head_kinds == [["ordinary", "negated", "centring", "mix"]] * 2
    with torch.no_grad():
        lhf.attention_modules(kinds)[1].mix_a.fill_(0.3)
    fused = _run(kinds, "llama")
    kinds.save_pretrained(tmp_path / "saved")
    loaded = lhf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "saved").eval()
    assert float(lhf.attention_modules(loaded)[1].mix_a[3]) == pytest.approx(0.3)
    torch.testing.assert_close(_run(loaded, "llama"), fused, rtol=0, atol=1e-6)
    # a half-precision model keeps its (a, b) in half precision, enabled or reloaded
    half = lhf.enable(copy.deepcopy(plain).half(), "mix")
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    half.save_pretrained(tmp_path / "half")
    reloaded = lhf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "half", torch_dtype=torch.float16)
    assert {p.dtype for p in reloaded.parameters()} == {torch.float16}


def test_local_and_untied_heads_run_generate_save_and_reload_in_a_hugging_face_model(tmp_path):
    """Issue 73: every head kind in transformers too. "untied" heads start as exactly the Laplacian heads (W_V',
    W_O' copies of their head's, its key/value head's under GQA); "local" heads start as ordinary ones (W_O' zero),
    their term then trained; a saved model reloads with the same logits and generates the same tokens."""
    plain = _build("llama")
    torch.manual_seed(5)
    ids = torch.randint(0, 100, (2, 12))
    laplacian = _run(lhf.enable(copy.deepcopy(plain), 2), "llama")
    untied = lhf.enable(copy.deepcopy(plain), "untied:2")
    torch.testing.assert_close(_run(untied, "llama"), laplacian, rtol=1e-5, atol=1e-5)
    local = lhf.enable(copy.deepcopy(plain), "local:1+laplacian:1")
    start = _run(local, "llama")  # the local head ordinary at the start
    torch.testing.assert_close(start, _run(lhf.enable(copy.deepcopy(plain), 1), "llama"), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        local.model.layers[0].self_attn.local_o.weight.normal_(0, 0.1)  # a term trained away from zero
        untied.model.layers[1].self_attn.untied_o.mul_(0.5)  # the tie released
    for model, name in ((local, "local"), (untied, "untied")):
        before = _run(model, "llama")
        generated = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
        model.save_pretrained(tmp_path / name)
        loaded = lhf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / name)
        torch.testing.assert_close(_run(loaded, "llama"), before, rtol=0, atol=1e-6)
        assert torch.equal(loaded.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0), generated)
    assert (_run(local, "llama") - start).abs().max() > 1e-4  # the trained local term shows


@pytest.mark.parametrize("name", ["llama", "gpt2", "vit"])
def test_gated_heads_start_at_half_scale_and_generate_save_and_reload_in_a_hugging_face_model(name, tmp_path):
    """Issue 73: "gated-<kind>" in transformers too. The gate reads the layer's input (a pre-hook hands it to the
    attention function); at the start it is sigmoid(0) = 1/2, the same as halving the gated heads' columns of the
    output projection; trained gates are saved and reloaded, and a plain from_pretrained refuses the model."""
    plain = _build(name)
    gated = lhf.enable(copy.deepcopy(plain), "gated-laplacian:1+gated-ordinary:1")
    halved = lhf.enable(copy.deepcopy(plain), "laplacian:1+ordinary:1")
    with torch.no_grad():
        for module in lhf.attention_modules(halved):
            for head in (2, 3):
                weight, columns, axis = lhf._output_columns(module, halved, head, 16)
                (weight[:, columns] if axis == 1 else weight[columns]).mul_(0.5)
    torch.testing.assert_close(_run(gated, name), _run(halved, name), rtol=1e-5, atol=1e-6)
    assert gated.config.laplacian_head_kinds[0] == ["ordinary", "ordinary", "gated-laplacian", "gated-ordinary"]
    with torch.no_grad():
        for module in lhf.attention_modules(gated):
            module.head_gate.weight.normal_(0, 0.5)  # gates trained away from their start
    before = _run(gated, name)
    assert (before - _run(halved, name)).abs().max() > 1e-4
    gated.save_pretrained(tmp_path / name)
    auto = transformers.AutoModel if name == "vit" else transformers.AutoModelForCausalLM
    loaded = lhf.from_pretrained(auto, tmp_path / name)
    torch.testing.assert_close(_run(loaded, name), before, rtol=0, atol=1e-6)
    if name != "vit":
        ids = torch.randint(0, 100, (1, 5))
        generated = gated.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(loaded.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), generated)
        cached = gated(generated[:, :-1]).logits[:, -1]  # the full forward's last step equals the cached one's
        with torch.no_grad():
            out = gated(generated[:, :-2], use_cache=True)
            step = gated(generated[:, -2:-1], past_key_values=out.past_key_values).logits[:, -1]
        torch.testing.assert_close(step, cached.detach(), rtol=1e-5, atol=1e-5)
    family = type(loaded.config).__mro__[1]  # the family's own config class, as plain transformers knows it
    config = family.from_dict({**loaded.config.to_dict(), "model_type": family.model_type})
    config.attn_implementation = "lapheads"
    bare = type(loaded)(config).eval()  # no gates: what a plain from_pretrained builds from the saved config
    refusal = "has no layer_idx" if name == "vit" else "gated heads' gates, weights a plain from_pretrained does not"
    with pytest.raises(InputError, match=refusal):
        _run(bare, name)


def test_a_head_kind_conversion_that_is_not_a_switch_is_refused_in_one_line():
    with pytest.raises(InputError, match="init='blend' converts Laplacian heads only"):
        lhf.enable(_build("llama"), "negated:2", init="blend")


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_eager_on_a_laplacian_config_is_lapheads_textbook_path_with_maps_and_generates_alike_on_every_cache(name):
    model = lhf.enable(_build(name), 2)
    fused = _run(model, name)
    model.set_attn_implementation("eager")  # what transformers' own tests ask for to get attention maps
    assert model.config._attn_implementation == lhf.EAGER_NAME
    torch.manual_seed(1)
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    torch.testing.assert_close(out.logits, fused, rtol=1e-5, atol=1e-5)  # the same Laplacian heads
    maps = out.attentions
    assert len(maps) == 2 and maps[0].shape == (2, 4, 12, 12)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 4, 12), rtol=0, atol=1e-5)  # P, row-stochastic
    assert torch.equal(maps[0].triu(1), torch.zeros_like(maps[0]))  # causal
    prompt = ids[:1, :5]
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    dynamic = model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, use_cache=False, **kwargs), dynamic)
    assert torch.equal(model.generate(prompt, cache_implementation="static", **kwargs), dynamic)
    model.set_attn_implementation("lapheads")
    assert torch.equal(model.generate(prompt, **kwargs), dynamic)  # the fused path generates the same tokens
    with pytest.raises(InputError, match="allowed: 'lapheads', 'eager'"):
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_flex_attention_on_a_laplacian_config_runs_the_same_heads_through_transformers_block_masks(name):
    """Issue 75: attn_implementation="flex_attention" on a Laplacian config is lapheads' heads with transformers'
    FlexAttention masks (BlockMasks: causal, Mistral's sliding window), FlexAttention running them where there is
    no cache (T = 150 > one chunk); the same logits as "lapheads" (SDPA's masks), and the same greedy tokens under
    a dynamic and a static cache."""
    big = dict(SMALL, max_position_embeddings=256)
    if name == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**big, sliding_window=40))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**big))
    model = lhf.enable(model.eval(), 2)
    torch.manual_seed(4)
    ids = torch.randint(0, 100, (2, 150))
    prompt, kwargs = ids[:1, :20], dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < lhf.FLEX_MASKS_FROM:  # the floor's run
        with pytest.raises(InputError, match="allowed: transformers >= 5.25, or 'lapheads'"):
            model.set_attn_implementation("flex_attention")
        return
    with torch.no_grad():
        sdpa = model(ids).logits
        dynamic = model.generate(prompt, **kwargs)
        model.set_attn_implementation("flex_attention")
        assert model.config._attn_implementation == lhf.FLEX_NAME
        torch.testing.assert_close(model(ids).logits, sdpa, rtol=1e-4, atol=1e-4)
        assert torch.equal(model.generate(prompt, **kwargs), dynamic)
        assert torch.equal(model.generate(prompt, cache_implementation="static", **kwargs), dynamic)


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_export_saves_and_reloads_a_laplacian_hugging_face_model_with_its_outputs(name, tmp_path):
    """torch.export (TorchScript's successor) of every family with two Laplacian heads a layer: the exported
    program, saved and loaded back, gives the eager model's outputs (decoders without their cache object, which
    is transformers' own type, not a tensor)."""
    model = lhf.enable(_build(name), 2)
    torch.manual_seed(1)
    args = (torch.randn(2, 3, 16, 16),) if name == "vit" else (torch.randint(0, 100, (2, 12)),)
    kwargs = {} if name == "vit" else {"use_cache": False}
    with torch.no_grad():
        eager = model(*args, **kwargs)
    torch.export.save(torch.export.export(model, args, kwargs=kwargs), tmp_path / "model.pt2")
    loaded = torch.export.load(tmp_path / "model.pt2").module()
    with torch.no_grad():
        out = loaded(*args, **kwargs)
    key = "last_hidden_state" if name == "vit" else "logits"
    torch.testing.assert_close(out[key], eager[key], rtol=0, atol=1e-6)


@pytest.mark.parametrize("written", ["false", 0, None, "true"])
def test_a_config_whose_heads_are_not_booleans_is_refused(tmp_path, written):
    """Issue 60: ``"laplacian_heads": [["false", ...]]`` read as True (``bool("false")``); every entry must be a JSON
    boolean, or loading is one line naming it."""
    import json

    model = lhf.enable(_llama(), "0,2")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["laplacian_heads"][1][0] = written
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=f"config.laplacian_heads layer 1 holds {written!r}; allowed: true / false"):
        lhf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)


@pytest.mark.parametrize(
    ("field", "layer", "written", "says"),
    [
        ("laplacian_blend", None, "0.5", "config.laplacian_blend '0.5'; allowed: a number in [0, 1]"),
        ("laplacian_blend", None, True, "config.laplacian_blend True; allowed: a number in [0, 1]"),
        ("laplacian_blend", None, 2.0, "config.laplacian_blend 2.0; allowed"),
        ("laplacian_head_kinds", 1, True, "config.laplacian_head_kinds layer 1 holds True; allowed: kind names"),
    ],
)
def test_a_config_whose_blend_or_kinds_have_the_wrong_type_is_refused(tmp_path, field, layer, written, says):
    """Issue 76 (red team, low): laplacian_blend "0.5" or true was read as a number while laplacian_heads refuses
    strings, and a boolean among laplacian_head_kinds raised a TypeError. Each is one line naming the value."""
    import json

    model = lhf.enable(_llama(), "0,2") if field == "laplacian_blend" else lhf.enable(_llama(), "0,negated:1")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    if layer is None:
        config[field] = written
    else:
        config[field][layer][0] = written
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=re.escape(says)):
        lhf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)


def test_gpt_oss_attention_sinks_are_carried_by_the_op():
    """Issue 73: GPT-OSS's learned sinks (one more logit per head) were refused. Carried now: at k = 0 its own eager
    logits, sliding-window layers and GQA included; at k = 1 the Laplacian heads run and keep their sinks (which
    learn); cached decoding gives the full forward's logits."""
    config = transformers.GptOssConfig(
        vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64,
        sliding_window=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    for module in lhf.attention_modules(model):
        torch.nn.init.normal_(module.sinks, std=1.0)  # sinks that matter (the init's are near 0)
    model.set_attn_implementation("eager")
    ids = torch.tensor([[1, 5, 7, 9, 3, 8, 4, 6, 2, 11]])
    with torch.no_grad():
        eager = model(ids).logits
        lhf.enable(model, 0)
        torch.testing.assert_close(model(ids).logits, eager, rtol=1e-5, atol=1e-5)
        lhf.enable(model, 1)
        laplacian = model(ids).logits
        assert (laplacian - eager).abs().max() > 1e-2
        prefix = model(ids[:, :6], use_cache=True)
        step = model(ids[:, 6:7], past_key_values=prefix.past_key_values)
        torch.testing.assert_close(step.logits[:, -1], model(ids[:, :7]).logits[:, -1], rtol=1e-4, atol=1e-4)
    model.train()
    model(ids, labels=ids).loss.backward()
    assert all(m.sinks.grad is not None and m.sinks.grad.abs().sum() > 0 for m in lhf.attention_modules(model))


def test_a_saved_laplacian_model_names_an_architecture_no_engine_serves_as_plain_attention(tmp_path):
    """Issue 58: a saved Laplacian Llama said architectures ["LlamaForCausalLM"], so an engine that reads only that
    (vLLM, llama.cpp's converter) would serve it with the heads dropped. Its saved name is one no engine knows;
    lapheads loads it back as before, and a model without Laplacian heads keeps its own name."""
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model = lhf.enable(_llama(), "0,2")
    model.save_pretrained(tmp_path / "laplacian")
    saved = json.loads((tmp_path / "laplacian" / "config.json").read_text())
    assert saved["architectures"] == ["LaplacianLlamaForCausalLM"] and saved["model_type"] == "lapheads_llama"
    assert "LaplacianLlamaForCausalLM" not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    loaded = lhf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "laplacian").eval()
    assert [m.laplacian_mask.tolist() for m in lhf.attention_modules(loaded)] == model.config.laplacian_heads
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits)
    _llama().save_pretrained(tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


#: causal-LM families transformers ships, each as a tiny config: at k = 0 the one op must give the family's own
#: output (SDPA, or eager where the family has no SDPA path), or the family is refused in one line before any change
_COMMON = dict(SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_VERSION = tuple(int(x) for x in transformers.__version__.split(".")[:2])
FAMILIES = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}, None),
    "Mistral (sliding window)": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}, None),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, None),
    "Qwen3 (q/k norm)": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, None),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}, None),
    "Gemma-3 (local and global layers)": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}, None),
    "Phi-3": ("Phi3Config", "Phi3ForCausalLM", {}, None),
    "OLMo-2": ("Olmo2Config", "Olmo2ForCausalLM", {}, None),
    "Granite (attention multiplier)": ("GraniteConfig", "GraniteForCausalLM", {}, None),
    "Cohere": ("CohereConfig", "CohereForCausalLM", {}, None),
    "Starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}, None),
    # Falcon computed attention inline (outside the interface) before 5.25: refused at its first call there
    "Falcon": ("FalconConfig", "FalconForCausalLM", {}, None if _VERSION >= (5, 25) else "computed its attention"),
    "Gemma-2 (logit soft cap)": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}, "uses a logit soft cap"),
    "GPT-OSS (attention sinks)": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1, "intermediate_size": 64},
        None,
    ),  # fmt: skip
}


def _tiny_config(name: str, **fields):
    """The family's config, or a skip where this transformers cannot build its own defaults (transformers 5.4, the
    floor, refuses OLMo-2's and T5's: "tie_word_embeddings expected int, got bool")."""
    try:
        return getattr(transformers, name)(**fields)
    except Exception as err:  # noqa: BLE001 - huggingface_hub's StrictDataclassFieldValidationError, version-bound
        if "StrictDataclass" not in type(err).__name__:
            raise
        pytest.skip(f"transformers {transformers.__version__} refuses its own {name}: {str(err).splitlines()[0]}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_its_own_model_at_k_0_or_refused_before_any_change(family):
    """Issue 58: every attention feature of the families transformers ships, checked the same way (the table in
    docs/integrations.md): k = 0 through the one op equals the family's own attention (and reached lapheads'
    function), or enable refuses, or (attention outside the interface) the first call does."""
    config_name, model_name, extra, refused = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(_tiny_config(config_name, **{**_COMMON, **extra})).eval()
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:  # no SDPA path in this family: its eager attention is the reference
        model.set_attn_implementation("eager")
    ids = torch.tensor([[1, 5, 7, 9, 3, 8, 4, 6]])
    with torch.no_grad():
        reference = model(ids).logits
    if refused == "computed its attention":  # attention outside the interface: refused at the first call
        with pytest.raises(InputError, match="Attention computed its attention without transformers' attention"):
            model = lhf.enable(model, 0)
            model(ids)
        return
    if refused:
        before = copy.deepcopy(model.config.to_dict())
        with pytest.raises(InputError, match=refused):
            lhf.enable(model, 0)
        assert model.config.to_dict() == before
        return
    lhf.enable(model, 0)
    with torch.no_grad():  # the first call also checks every attention module called lapheads' function
        torch.testing.assert_close(model(ids).logits, reference, rtol=1e-5, atol=1e-5)


#: encoder and vision families: at k = 0 the one op gives the family's own hidden states (checked as the causal-LM
#: families are), and at k = 1 the Laplacian heads run (the hidden states change); a last entry (major, minor) is
#: the transformers version from which the family's attention goes through the interface (before: refused)
_ENCODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
ENCODER_FAMILIES = {
    "BERT": ("BertConfig", "BertModel", {"vocab_size": 100}, "text"),
    "RoBERTa": ("RobertaConfig", "RobertaModel", {"vocab_size": 100}, "text"),
    "ELECTRA": ("ElectraConfig", "ElectraModel", {"vocab_size": 100, "embedding_size": 64}, "text"),
    "DistilBERT": (
        "DistilBertConfig",
        "DistilBertModel",
        {"vocab_size": 100, "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128},
        "text",
    ),
    "ModernBERT (local and global layers)": (
        "ModernBertConfig",
        "ModernBertModel",
        {
            "vocab_size": 100,
            "global_attn_every_n_layers": 2,
            "local_attention": 4,
            "cls_token_id": 1,
            "sep_token_id": 2,
            **_IDS,
        },
        "text",
        (5, 5),
    ),
    "ViT": ("ViTConfig", "ViTModel", {"image_size": 32, "patch_size": 8}, "image"),
    "DeiT": ("DeiTConfig", "DeiTModel", {"image_size": 32, "patch_size": 8}, "image"),
    "DINOv2": ("Dinov2Config", "Dinov2Model", {"image_size": 32, "patch_size": 8}, "image"),
    "CLIP vision": ("CLIPVisionConfig", "CLIPVisionModel", {"image_size": 32, "patch_size": 8}, "image"),
    "SigLIP vision (a torch MultiheadAttention pooling head)": (
        "SiglipVisionConfig",
        "SiglipVisionModel",
        {"image_size": 32, "patch_size": 8},
        "image",
    ),
    "BEiT (relative position bias as the mask)": (
        "BeitConfig",
        "BeitModel",
        {"image_size": 32, "patch_size": 8, "use_relative_position_bias": True},
        "image",
        (5, 9),
    ),
}


def _encoder_inputs(kind: str) -> dict[str, torch.Tensor]:
    if kind == "text":
        return {"input_ids": torch.tensor([[1, 5, 7, 9, 3, 8]])}
    return {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))}


@pytest.mark.parametrize("family", sorted(ENCODER_FAMILIES))
def test_each_encoder_family_is_its_own_model_at_k_0_and_runs_laplacian_heads_at_k_1(family):
    """Issue 58's table beyond causal LMs: bidirectional text encoders, ViT-style vision encoders, BEiT's relative
    position bias (handed to the op as an additive mask); SigLIP's pooling head is torch's own attention, not one of
    the model's layers, and keeps ordinary attention."""
    config_name, model_name, extra, kind, *since = ENCODER_FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(_tiny_config(config_name, **{**_ENCODER, **extra})).eval()
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:
        model.set_attn_implementation("eager")
    inputs = _encoder_inputs(kind)
    if since and _VERSION < since[0]:  # its attention was computed inline before: refused at the first call
        with pytest.raises(InputError, match="Attention computed its attention without transformers' attention"):
            lhf.enable(model, 0)(**inputs)
        return
    with torch.no_grad():
        reference = model(**inputs).last_hidden_state
        laplacian = copy.deepcopy(model)
        torch.testing.assert_close(lhf.enable(model, 0)(**inputs).last_hidden_state, reference, rtol=1e-5, atol=1e-5)
        assert len(lhf.attention_modules(laplacian)) == 2  # the layers, never a pooling head
        changed = lhf.enable(laplacian, 1)(**inputs).last_hidden_state
    assert (changed - reference).abs().max() > 1e-3


def test_cross_attention_takes_no_laplacian_heads():
    """Whisper's decoder attends to the encoder's states: I - P needs queries and keys from the same tokens, so a
    Laplacian head there is a one-line error at its call; self-attention layers take them (a per-layer spec)."""
    fields = dict(vocab_size=100, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                  max_source_positions=16, decoder_start_token_id=1, **_IDS)  # fmt: skip
    model = transformers.WhisperModel(_tiny_config("WhisperConfig", **fields)).eval()
    inputs = {"input_features": torch.randn(1, 8, 32), "decoder_input_ids": torch.tensor([[1, 2]])}
    names = [type(m).__name__ for m in lhf.attention_modules(model)]
    assert names == ["WhisperAttention"] * 3  # encoder self, decoder self, decoder cross
    with torch.no_grad():
        with pytest.raises(InputError, match="WhisperAttention is cross-attention here"):
            lhf.enable(copy.deepcopy(model), 1)(**inputs)
        lhf.enable(model, [1, 1, 0])(**inputs)  # self-attention only: runs


def test_a_position_bias_model_is_refused_at_its_first_call():
    """T5 adds a position bias the op does not take: its first forward after enable is a one-line error (the row of
    docs/integrations.md's family table), never attention without the bias. At the transformers floor (5.4) T5
    computes its attention inline, never through the interface: refused as such (issue 58)."""
    config = _tiny_config(
        "T5Config", vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    model = lhf.enable(transformers.T5ForConditionalGeneration(config).eval(), 2)
    ids = torch.tensor([[1, 5, 7, 9]])
    refused = "T5Attention (adds a position bias|computed its attention without transformers' attention interface)"
    with pytest.raises(InputError, match=refused):
        model(input_ids=ids, decoder_input_ids=ids)


def test_attention_that_bypasses_the_interface_is_refused_at_its_first_call():
    """A model whose attention never calls lapheads' function (here: its config's implementation set behind
    enable's back, as T5 at transformers 5.4 computes attention inline) is a one-line error at its first forward,
    never output with ordinary heads; a model that does call it pays the check once."""
    model = lhf.enable(_llama().eval(), 1)
    ids = torch.tensor([[1, 5, 7, 9]])
    model.config._attn_implementation = "sdpa"
    with pytest.raises(InputError, match="LlamaAttention computed its attention without transformers' attention"):
        model(ids)
    model = lhf.enable(_llama().eval(), 1)
    with torch.no_grad():
        model(ids)
    # the first call's check is gone; the one pre-hook left notes whether a call is cross-attention
    assert all(not m._forward_hooks and len(m._forward_pre_hooks) == 1 for m in attention_modules(model))
