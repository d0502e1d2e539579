"""Laplacian heads in Hugging Face transformers models (``pip install 'lapheads[hf]'``).

    import lapheads.integrations.hf
    model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M")
    lapheads.integrations.hf.enable(model, laplacian_heads=2, init="blend")     # any Llama/Qwen/Mistral/GPT-2/ViT model
    schedule = lapheads.integrations.hf.BlendSchedule(model, steps=500)         # lambda 0 -> 1 while fine-tuning
    model.save_pretrained("out/")                                  # the per-layer heads go into config.json
    model = lapheads.integrations.hf.from_pretrained(AutoModelForCausalLM, "out/")

Design choices:

* **One registered attention function**, ``"lapheads"`` in ``transformers.AttentionInterface`` (and the same name
  in ``AttentionMaskInterface``, so padding and sliding-window masks are built as for SDPA; without it they would be
  dropped silently). It calls :func:`lapheads.laplacian_attention`, the one op; nothing is re-implemented here.
* **Whose own value**: each query's own position, whatever the mask's shape (causal, sliding window, padding,
  prefix-LM, bidirectional segments as in PaliGemma and Gemma-3): the queries are the last T of the keys that any
  query may attend to, which is the last T keys of a dynamic cache and the filled slots of a static one (the op's
  ``identity="filled"``, computed on the device). Without a mask the queries are the last keys or, for an empty
  static cache's prefill, the first ones, where the keys are cut to the queries as transformers' SDPA path does.
* **FlexAttention masks too**: ``"flex_attention"`` on a Laplacian config is ``"lapheads_flex"``, the same function
  with transformers' BlockMasks (sliding windows and padding without a T x S tensor); without a cache the op runs
  them through FlexAttention (``lapheads.core.masks``), under one each query's own key is read off the mask.
* **Heads live in the config**: ``enable`` writes ``config.laplacian_heads`` (one bool list per layer, from the one
  spec parser) and ``config.attn_implementation = "lapheads"``, and keeps each layer's mask as a non-persistent
  buffer; :func:`from_pretrained` refuses any other implementation.
* **A saved Laplacian model names a model type no plain transformers knows**: ``lapheads_<type>``
  ("lapheads_llama"), and architectures ``Laplacian<name>``. Without lapheads, ``AutoConfig`` (so a config round
  trip), every ``AutoModel*``, pipelines and lm-eval's "hf" model refuse it whatever ``attn_implementation`` is
  asked for, and engines that pick a class by either name (vLLM, llama.cpp's converter) find none. With ``import
  lapheads.hf``, each ``lapheads_<type>`` is taught to transformers the first time it is read: a subclass of the
  family's config whose only change is the model type, mapped to the family's own model and tokenizer classes.
  Not covered: a family's class called by name without lapheads (``LlamaForCausalLM.from_pretrained``) only warns
  ("a model of type lapheads_llama ... not supported"); without an ``attn_implementation`` it then fails on the
  unknown "lapheads", with one it loads plain attention after that warning.
* **Head kinds**, every one, through the same op: ``config.laplacian_head_kinds`` per layer; a mix head's (a, b)
  are ``mix_a`` / ``mix_b`` parameters of its attention module (ordinary at the start); "local" and "untied" heads
  add their token-local term W_O' W_V' x, which needs the layer's input (the attention interface never sees it), by
  a forward hook on the module (:func:`_add_local_terms`; Llama-style ``v_proj`` / ``o_proj``). Their parameters
  are saved with the model and restored by :func:`from_pretrained`. Gated heads ("gated-laplacian") the same way:
  their gate ``head_gate`` reads the layer's input, which a forward pre-hook hands to the attention function
  (:func:`_note_gate_input`), and scales each gated head's output there, before ``o_proj``
  (:func:`lapheads.core.kinds.gate_heads`).
* **Converting a pretrained model**: ``init="switch"`` turns the heads Laplacian as they are (their output
  changes); ``"signflip"`` also negates those heads' columns of the output projection, so the P V term is exact and
  only -W_O V is added; ``"blend"`` starts at lambda = 0, exactly the pretrained function, and
  :class:`BlendSchedule` / :func:`set_blend` move lambda to 1 (lambda V + (1 - 2 lambda) P V, the op's ``blend``).
* **What is refused**, in one line: attention with a logit soft cap (Gemma-2) or a position bias (T5), and models
  whose attention modules cannot be found.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn

from lapheads.core.attention import laplacian_attention, laplacian_attention_reference
from lapheads.core.convert import INITS, BlendSchedule, init_heads, set_blend
from lapheads.core.convert import attention_modules as _named_attention_modules
from lapheads.core.heads import HeadSpecError, LayerHeads, parse_heads
from lapheads.core.kinds import gate_heads
from lapheads.core.masks import is_pattern, tensor_mask
from lapheads.errors import InputError

__all__ = ["BlendSchedule", "NAME", "attention_modules", "enable", "from_pretrained", "register", "set_blend"]

NAME = "lapheads"
#: what "eager" means on a config with Laplacian heads: the textbook path (P materialised, attention maps returned),
#: the same heads; transformers' own eager would silently run ordinary ones
EAGER_NAME = "lapheads_eager"
#: the same heads with transformers' FlexAttention masks (BlockMasks, no (T, S) mask tensor): the op runs them through
#: FlexAttention (lapheads.core.masks), as ``attn_implementation="flex_attention"`` does plain heads
FLEX_NAME = "lapheads_flex"


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's attention layers, in order: the innermost modules whose class name ends in "Attention", less
    torch's own ``nn.MultiheadAttention`` (SigLIP's pooling head), which transformers' attention interface never
    reaches."""
    return [m for m in _named_attention_modules(model) if not isinstance(m, nn.MultiheadAttention)]


#: a module's forward arguments that make a call cross-attention (queries from one sequence, keys from another)
_CROSS_INPUTS = ("key_value_states", "encoder_hidden_states")


def _note_cross_attention(module: nn.Module, args, kwargs) -> None:
    module.laplacian_cross = any(kwargs.get(name) is not None for name in _CROSS_INPUTS)


def _layer_heads(module: nn.Module, num_heads: int) -> LayerHeads | None:
    """The layer's heads: those ``enable`` gave it, else (a model loaded with plain from_pretrained after import
    lapheads.integrations.hf) read once from its config; None for a model without Laplacian heads."""
    heads = getattr(module, "laplacian_heads", None)
    if heads is None:
        config = getattr(module, "config", None)
        masks, kinds = config_masks(config), getattr(config, "laplacian_head_kinds", None)
        if masks is None and kinds is None:
            return None
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise InputError(
                f"{type(module).__name__} has no layer_idx to find its Laplacian heads; allowed: load "
                "with lapheads.integrations.hf.from_pretrained (or call lapheads.integrations.hf.enable)"
            )
        heads = LayerHeads.of_names(tuple(kinds[layer])) if kinds is not None else LayerHeads.of_flags(masks[layer])
        unloaded = [
            what
            for what, needed, weight in (("mix heads' (a, b)", "mix" in heads.kinds, "mix_a"),
                                         ("gated heads' gates", any(heads.gated), "head_gate"))
            if needed and getattr(module, weight, None) is None
        ]  # fmt: skip
        if unloaded:
            raise InputError(
                f"{type(module).__name__} has {unloaded[0]}, weights a plain from_pretrained does not load; "
                "allowed: lapheads.hf.from_pretrained(model_class, path)"
            )
        _set_layer_heads(module, heads, next(module.parameters()).device)
        blend = getattr(config, "laplacian_blend", None)
        if blend is not None and getattr(module, "laplacian_blend", None) is None:  # saved mid-schedule
            module.register_buffer("laplacian_blend", torch.tensor(float(blend)), persistent=False)
    if heads.num_heads != num_heads:
        raise InputError(f"{type(module).__name__} has {num_heads} query heads but {heads.num_heads} head kinds")
    return heads


def _set_layer_heads(module: nn.Module, heads: LayerHeads, device: torch.device) -> None:
    """Give a layer its heads (host truth) and their Laplacian mask as a non-persistent buffer on ``device`` (what
    the op gets where the Laplacian heads are not the trailing k)."""
    module.laplacian_heads = heads
    module.register_buffer("laplacian_mask", heads.mask.to(device), persistent=False)


#: the parameters lapheads adds to an attention module (saved with the model, restored by :func:`from_pretrained`)
HEAD_PARAMETERS = (
    ".mix_a",
    ".mix_b",
    ".local_v.weight",
    ".local_o.weight",
    ".untied_v",
    ".untied_o",
    ".untied_b",
    ".head_gate.weight",
)


@functools.cache
def _output_collector():
    """transformers' output collector (a context variable), or None where this transformers has none; looked up
    once, not on every attention call."""
    try:
        from transformers.utils.output_capturing import _active_collector  # noqa: PLC2701 - the only hook for output_attentions
    except ImportError:  # a transformers without output capturing hands the flag on
        return None
    return _active_collector


def _maps_wanted(kwargs: dict) -> bool:
    """Whether the caller asked for attention maps: ``output_attentions`` handed on to the interface (Llama), or
    transformers' output collector recording "attentions" (models whose attention never sees the flag: GPT-2)."""
    if kwargs.get("output_attentions"):
        return True
    collector = _output_collector()
    collected = None if collector is None else collector.get()
    return collected is not None and "attentions" in collected


def lapheads_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention interface: query (B, H, T, D), key/value (B, Hkv, S, D) -> ((B, T, H, D), P or None)."""
    module.laplacian_reached = True  # the first call's check (_check_the_interface_is_used) reads it
    if kwargs.get("softcap") is not None:
        raise InputError(
            f"{type(module).__name__} uses a logit soft cap; allowed: attention without one (Gemma-2's "
            "soft cap is not supported by lapheads)"
        )
    if kwargs.get("position_bias") is not None:
        raise InputError(f"{type(module).__name__} adds a position bias (T5-style); allowed: models without one")
    t = query.shape[2]
    causal_module = getattr(module, "is_causal", True)
    causal = bool((causal_module if is_causal is None else is_causal) and attention_mask is None and t > 1)
    if causal and key.shape[2] > t:  # an empty static cache's prefill: the keys so far are the first T slots
        key, value = key[:, :, :t], value[:, :, :t]
    heads = _layer_heads(module, query.shape[1])
    if getattr(module, "laplacian_cross", False) and heads is not None and (heads.num_laplacian or not heads.plain):
        raise InputError(
            f"{type(module).__name__} is cross-attention here (queries and keys from different sequences), where "
            "I - P has no meaning; allowed: Laplacian heads in self-attention only (a per-layer laplacian_heads "
            "with 0 at the cross-attention layers)"
        )
    # what the op gets, as the timm module hands it: k when the Laplacian heads are the trailing k (no device work
    # per call, and the op's one-node path on every device), else the device mask; other kinds as themselves
    spec = 0 if heads is None else heads.for_op(module.laplacian_mask.to(query.device))
    mix = (module.mix_a, module.mix_b) if heads is not None and "mix" in heads.kinds else None
    identity = "filled" if attention_mask is not None else "aligned"
    if attention_mask is not None and is_pattern(attention_mask):  # "flex_attention": transformers' BlockMask
        if key.shape[2] == t:  # no cache: the queries are the keys; FlexAttention runs the mask (lapheads.core.masks)
            identity = "aligned"
        else:  # under a cache (dynamic or static) each query's own key is read off the mask, as for SDPA's masks
            attention_mask = tensor_mask(attention_mask, query.shape[0], t, key.shape[2], query.device)
    options = dict(
        attn_mask=attention_mask,
        is_causal=causal,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        identity=identity,
        blend=getattr(module, "laplacian_blend", None),
        mix=mix,
        sinks=kwargs.get("s_aux"),  # GPT-OSS's learned sinks: one more logit per head, carried by the op
    )
    weights = None
    if _maps_wanted(kwargs) or kwargs.get("_lapheads_textbook"):  # the textbook path materialises P for maps
        out, weights = laplacian_attention_reference(query, key, value, spec, return_attn=True, **options)
    else:
        out = laplacian_attention(query, key, value, spec, **options)
    if heads is not None and heads.gated_heads:  # the layer's input, from the pre-hook (the interface never sees it)
        x, module.laplacian_gate_input = module.laplacian_gate_input, None
        out = gate_heads(out, module.head_gate(x), module.head_gate_index)
    return out.transpose(1, 2).contiguous(), weights


def _textbook_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """ "eager" on a Laplacian config: lapheads' textbook path, always with P (what eager attention returns)."""
    return lapheads_attention(module, query, key, value, attention_mask, _lapheads_textbook=True, **kwargs)


def register() -> None:
    """Register ``"lapheads"`` as an attention implementation and its mask (SDPA's) with transformers, and make a
    model whose config has Laplacian heads run them: built or loaded without an ``attn_implementation`` it gets
    "lapheads" (transformers does not save the one a config was built with), and any other one is a one-line
    error instead of plain attention that silently drops the heads. Saving such a config writes the model type and
    architectures only lapheads resolves, and each ``lapheads_<type>`` read is taught to transformers' Auto classes
    (module docstring)."""
    from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask, sdpa_mask
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    AttentionInterface.register(NAME, lapheads_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    AttentionInterface.register(EAGER_NAME, _textbook_attention)
    AttentionMaskInterface.register(EAGER_NAME, sdpa_mask)
    AttentionInterface.register(FLEX_NAME, lapheads_attention)
    AttentionMaskInterface.register(FLEX_NAME, flex_attention_mask)
    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if check is None:  # a transformers without the hook: say so rather than fail the import
        import warnings

        warnings.warn(
            "lapheads: this transformers has no PreTrainedModel._check_and_adjust_attn_implementation, so a config "
            "with Laplacian heads loaded without attn_implementation='lapheads' may run plain attention",
            stacklevel=2,
        )
    elif not getattr(check, "_lapheads", False):  # once, however often register() is called
        PreTrainedModel._check_and_adjust_attn_implementation = _keep_laplacian_heads(check)
    if not getattr(PretrainedConfig.save_pretrained, "_lapheads", False):
        PretrainedConfig.save_pretrained = _save_as_laplacian(PretrainedConfig.save_pretrained)
    registered = CONFIG_MAPPING._extra_content  # transformers' own dict of registered model types
    if not isinstance(registered, _LaplacianModelTypes):
        CONFIG_MAPPING._extra_content = _LaplacianModelTypes(registered)


def _per_layer(config, field: str, entry: type, allowed: str) -> list[list] | None:
    """``config.<field>`` as per-layer lists whose every entry is of type ``entry`` (None: the config has none),
    refused in one line naming the first entry that is not."""
    layers = getattr(config, field, None)
    if layers is None:
        return None
    if not isinstance(layers, list) or not all(isinstance(layer, list) for layer in layers):
        raise InputError(f"config.{field} {layers!r:.80}; allowed: a list per layer of {allowed}")
    for index, layer in enumerate(layers):
        bad = [value for value in layer if not isinstance(value, entry)]
        if bad:
            raise InputError(f"config.{field} layer {index} holds {bad[0]!r}; allowed: {allowed}")
    return layers


def config_masks(config) -> list[list[bool]] | None:
    """``config.laplacian_heads`` as per-layer bool lists (None: the config has none), refused in one line unless
    every entry is a JSON boolean: ``"false"`` is a string, and ``bool("false")`` would make that head Laplacian."""
    return _per_layer(config, "laplacian_heads", bool, "true / false (JSON booleans) per head")


def _config_kinds(config) -> list[list[str]] | None:
    """``config.laplacian_head_kinds`` as per-layer lists of kind names (None: the config has none), refused in one
    line unless every entry is a string (a boolean there once raised a TypeError deep in the load)."""
    return _per_layer(config, "laplacian_head_kinds", str, "kind names such as 'ordinary', 'laplacian' (strings)")


def _has_laplacian_heads(config) -> bool:
    layers = config_masks(config) or []
    kinds = _config_kinds(config) or []
    return any(any(layer) for layer in layers) or any(k != "ordinary" for layer in kinds for k in layer)


#: what a saved Laplacian model's ``architectures`` entries start with: engines that pick the model class by this
#: name alone (vLLM, llama.cpp's converter) find no such class and refuse, instead of serving it as plain attention
ARCHITECTURE_PREFIX = "Laplacian"
#: what a saved Laplacian model's ``model_type`` starts with: plain transformers knows no such type, so AutoConfig and
#: every AutoModel refuse it; :func:`register` teaches it each ``lapheads_<type>`` when first read
MODEL_TYPE_PREFIX = "lapheads_"


def _save_as_laplacian(save):
    """transformers' config ``save_pretrained`` (which a model's own save calls, after setting ``architectures``
    from its class name), then, for a config with Laplacian heads, its saved model type ``lapheads_<type>`` and its
    architectures ``Laplacian<name>``: names only lapheads resolves (module docstring)."""
    from transformers.utils import CONFIG_NAME

    @functools.wraps(save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        result = save(self, save_directory, *args, **kwargs)
        path = Path(save_directory) / CONFIG_NAME  # transformers' own config file, not a lapheads run's
        if _has_laplacian_heads(self) and path.is_file():
            saved = json.loads(path.read_text())
            saved["model_type"] = _prefixed(MODEL_TYPE_PREFIX, saved.get("model_type") or self.model_type)
            if saved.get("architectures"):
                saved["architectures"] = [_prefixed(ARCHITECTURE_PREFIX, name) for name in saved["architectures"]]
            path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        return result

    save_pretrained._lapheads = True
    return save_pretrained


def _prefixed(prefix: str, name: str) -> str:
    return name if name.startswith(prefix) else prefix + name


class _LaplacianModelTypes(dict):
    """transformers' registered config classes (``CONFIG_MAPPING``'s own extra entries), answering any
    ``lapheads_<type>`` of a known ``<type>`` by making its config class once (:func:`_laplacian_config_class`)."""

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or _base_model_type(key) is not None

    def __missing__(self, key: str):
        base = _base_model_type(key)
        if base is None:
            raise KeyError(key)
        self[key] = config_class = _laplacian_config_class(base)
        return config_class


def _base_model_type(model_type: object) -> str | None:
    """The family a saved model type names: "llama" for "lapheads_llama" where transformers knows "llama"; else None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if not (isinstance(model_type, str) and model_type.startswith(MODEL_TYPE_PREFIX)):
        return None
    base = model_type.removeprefix(MODEL_TYPE_PREFIX)
    return base if base in CONFIG_MAPPING_NAMES else None


def _laplacian_config_class(base: str):
    """The config class of ``lapheads_<base>``: the family's own with only its model type changed, registered in each
    of transformers' Auto mappings that hold the family (models of every task, tokenizers) to the family's class."""
    from transformers.models.auto import modeling_auto, tokenization_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = CONFIG_MAPPING[base]
    config_class = type(f"{ARCHITECTURE_PREFIX}{family.__name__}", (family,), {"model_type": MODEL_TYPE_PREFIX + base})
    lazy_mapping = type(modeling_auto.MODEL_MAPPING)  # the class of every Auto mapping (model type -> class)
    for module in (modeling_auto, tokenization_auto):
        for mapping in vars(module).values():
            if isinstance(mapping, lazy_mapping) and family in mapping:
                mapping.register(config_class, mapping[family], exist_ok=True)
    return config_class


#: the oldest transformers whose FlexAttention masks lapheads' heads are tested with (5.4's BlockMasks fail inside
#: torch's flex_attention, a shape it cannot unpack: tests/integrations/test_floors.py runs the HF tests there)
FLEX_MASKS_FROM = (5, 25)


def _check_flex_masks() -> None:
    import transformers

    found = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if found < FLEX_MASKS_FROM:
        raise InputError(
            f"attn_implementation='flex_attention' with Laplacian heads on transformers {transformers.__version__}; "
            f"allowed: transformers >= {'.'.join(map(str, FLEX_MASKS_FROM))}, or 'lapheads' (SDPA's masks)"
        )


def _keep_laplacian_heads(check):
    """transformers' attention-implementation check, first asking: does this config have Laplacian heads?"""

    @functools.wraps(check)
    def checked(self, attn_implementation, *args, **kwargs):
        if _has_laplacian_heads(getattr(self, "config", None)):
            if attn_implementation in ("eager", EAGER_NAME):  # the same heads on the textbook path, P returned
                return check(self, EAGER_NAME, *args, **kwargs)
            if attn_implementation in ("flex_attention", FLEX_NAME):  # the same heads through FlexAttention
                _check_flex_masks()
                return check(self, FLEX_NAME, *args, **kwargs)
            if attn_implementation not in (None, NAME):
                raise InputError(
                    f"attn_implementation={attn_implementation!r} on a model whose config has Laplacian heads would "
                    f"run plain attention and drop them; allowed: {NAME!r}, 'eager' (lapheads' textbook path, "
                    "attention maps returned), 'flex_attention' (lapheads' heads through FlexAttention), or none (it "
                    "is chosen)"
                )
            attn_implementation = NAME
        return check(self, attn_implementation, *args, **kwargs)

    checked._lapheads = True
    return checked


def _num_heads(model: nn.Module) -> int:
    config = model.config
    for name in ("num_attention_heads", "n_head", "num_heads"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise InputError(f"{type(model).__name__}'s config names no number of attention heads")


def _output_columns(module: nn.Module, model: nn.Module, head: int, head_dim: int):
    """(weight, slice, axis) of this head's input channels in the attention's output projection."""
    cols = slice(head * head_dim, (head + 1) * head_dim)
    if hasattr(module, "o_proj"):  # Llama, Mistral, Qwen, ...
        return module.o_proj.weight, cols, 1
    if type(module).__name__ == "GPT2Attention":
        return module.c_proj.weight, cols, 0  # Conv1D: weight (in, out)
    parent = next((p for p in model.modules() if any(c is module for c in p.children())), None)
    dense = getattr(getattr(parent, "output", None), "dense", None)  # ViT: attention.output.dense
    if isinstance(dense, nn.Linear):
        return dense.weight, cols, 1
    raise InputError(
        f"init='signflip' does not know the output projection of {type(module).__name__}; allowed: "
        "init='switch' or 'blend'"
    )


def enable(model: nn.Module, laplacian_heads=1, init: str = "switch") -> nn.Module:
    """Make ``model``'s attention Laplacian per ``laplacian_heads`` (k, "0,2,2,0", per-layer lists or masks).

    Args:
        model: a transformers ``PreTrainedModel`` whose attention goes through the attention interface.
        laplacian_heads: any spec :func:`lapheads.core.heads.parse_heads` reads (k, "0,2,2,0", per-layer
            masks, every head kind, gated ones too; local and untied: Llama-style attention).
        init: "switch", "signflip" or "blend" (see the module docstring).

    Returns:
        the same model, now running ``attn_implementation="lapheads"``.
    """
    if init not in INITS:
        raise InputError(f"init={init!r}; allowed: {', '.join(INITS)}")
    register()
    modules = attention_modules(model)
    if not modules:
        raise InputError(
            f"no attention modules found in {type(model).__name__}; allowed: transformers models "
            "whose attention classes end in 'Attention'"
        )
    if getattr(model.config, "attn_logit_softcapping", None) is not None:  # Gemma-2: the same, at call time too
        raise InputError(
            f"{type(modules[0]).__name__} uses a logit soft cap; allowed: attention without one (Gemma-2's soft cap "
            "is not supported by lapheads)"
        )
    num_heads = _num_heads(model)
    layers = parse_heads(laplacian_heads, [num_heads] * len(modules))
    plain = all(heads.plain for heads in layers)
    if not plain and init != "switch":
        raise InputError(f"init={init!r} converts Laplacian heads only; allowed with other head kinds: 'switch'")
    for module, heads in zip(modules, layers):
        if "mix" in heads.kinds and getattr(module, "mix_a", None) is None:
            weight = next(module.parameters())  # the model's device and dtype (an fp16 model keeps fp16 (a, b))
            like = {"device": weight.device, "dtype": weight.dtype}
            module.mix_a = nn.Parameter(torch.zeros(num_heads, **like))  # a = 0, b = 1: ordinary at the start
            module.mix_b = nn.Parameter(torch.ones(num_heads, **like))
        _make_local_terms(module, heads, model.config.hidden_size // num_heads if not hasattr(module, "head_dim")
                          else module.head_dim)  # fmt: skip
        _make_gates(module, heads, model.config.hidden_size)
    if plain:
        if hasattr(model.config, "laplacian_head_kinds"):
            del model.config.laplacian_head_kinds
    else:
        model.config.laplacian_head_kinds = [list(heads.names) for heads in layers]
    for module, heads in zip(modules, layers):
        device = next(module.parameters()).device
        _set_layer_heads(module, heads, device)
        head_dim = getattr(module, "head_dim", None) or model.config.hidden_size // num_heads
        init_heads(module, heads.mask.to(device), init, lambda h, m=module: _output_columns(m, model, h, head_dim))
    model.config.laplacian_heads = [list(heads.flags) for heads in layers]
    if init == "blend":
        model.config.laplacian_blend = 0.0  # the schedule's lambda, saved with the model (set_blend updates it)
    elif hasattr(model.config, "laplacian_blend"):
        del model.config.laplacian_blend
    model.config.attn_implementation = NAME  # saved: plain transformers then refuses to load it as SDPA
    model.set_attn_implementation(NAME)
    for module in modules:
        _check_the_interface_is_used(module)
        if not hasattr(module, "laplacian_cross"):  # once per module, however often enable is called
            module.register_forward_pre_hook(_note_cross_attention, with_kwargs=True)
            module.laplacian_cross = False
    return model


def _make_local_terms(module: nn.Module, heads: LayerHeads, head_dim: int) -> None:
    """The token-local term W_O' W_V' x of a layer's "local" and "untied" heads, as lapheads' own models have it:
    "local" heads their own W_V', W_O' (W_O' zero: an ordinary head at the start), "untied" heads copies of their
    head's rows of v_proj (its key/value head's under GQA, with its bias) and columns of o_proj (the Laplacian head
    at the start, only the tie released). Added to the module's output by a forward hook that reads the layer's
    input (the attention interface never sees it)."""
    local = [h for h, kind in enumerate(heads.kinds) if kind == "local"]
    untied = [h for h, kind in enumerate(heads.kinds) if kind == "untied"]
    if getattr(module, "laplacian_local_terms", None) is not None:
        if module.laplacian_local_terms == (local, untied):
            return  # enable() again with the same heads: the trained terms stay
        raise HeadSpecError(f"{type(module).__name__} already has local/untied heads {module.laplacian_local_terms}; "
                            "allowed: the same ones, or a fresh model")  # fmt: skip
    if not local and not untied:
        return
    v_proj, o_proj = getattr(module, "v_proj", None), getattr(module, "o_proj", None)
    if not isinstance(v_proj, nn.Linear) or not isinstance(o_proj, nn.Linear):
        raise HeadSpecError(f"{type(module).__name__} has no v_proj / o_proj Linear; allowed for 'local' and "
                            "'untied' heads: Llama-style attention (Llama, Qwen, Mistral, ...)")  # fmt: skip
    like = {"device": o_proj.weight.device, "dtype": o_proj.weight.dtype}
    hidden = o_proj.out_features
    if local:
        module.local_v = nn.Linear(v_proj.in_features, len(local) * head_dim, bias=False, **like)
        module.local_o = nn.Linear(len(local) * head_dim, hidden, bias=False, **like)
        nn.init.normal_(module.local_v.weight, std=0.02)
        nn.init.zeros_(module.local_o.weight)
    if untied:
        group = len(heads.kinds) // (v_proj.out_features // head_dim)  # query heads per key/value head
        rows = torch.cat([torch.arange(h // group * head_dim, (h // group + 1) * head_dim) for h in untied])
        columns = torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in untied])
        with torch.no_grad():
            module.untied_v = nn.Parameter(v_proj.weight[rows].clone())
            module.untied_o = nn.Parameter(o_proj.weight[:, columns].clone())
            module.untied_b = nn.Parameter(v_proj.bias[rows].clone()) if v_proj.bias is not None else None
    module.laplacian_local_terms = (local, untied)
    module.register_forward_hook(_add_local_terms, with_kwargs=True)


def _make_gates(module: nn.Module, heads: LayerHeads, hidden: int) -> None:
    """Gated heads' gate, as lapheads' own models have it: ``head_gate``, a Linear from the layer's input (width
    ``hidden``) to one logit per gated head, without bias and at zero (each gate the scale 1/2 at the start), and
    ``head_gate_index``, the gated heads (a non-persistent buffer). A forward pre-hook hands the layer's input to
    the attention function, which applies the gates."""
    gated = heads.gated_heads
    current = getattr(module, "laplacian_gated", None)
    if current is not None:
        if current == gated:
            return  # enable() again with the same heads: the trained gates stay
        raise HeadSpecError(f"{type(module).__name__} already has gated heads {list(current)}; allowed: the same ones, "
                            "or a fresh model")  # fmt: skip
    if not gated:
        return
    weight = next(module.parameters())
    module.head_gate = nn.Linear(hidden, len(gated), bias=False, device=weight.device, dtype=weight.dtype)
    nn.init.zeros_(module.head_gate.weight)
    module.register_buffer("head_gate_index", torch.tensor(gated, device=weight.device), persistent=False)
    module.laplacian_gated = gated
    module.register_forward_pre_hook(_note_gate_input, with_kwargs=True)


def _note_gate_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Keep the layer's input for this call's gates (the attention function reads it once and lets it go)."""
    module.laplacian_gate_input = args[0] if args else kwargs["hidden_states"]


def _add_local_terms(module: nn.Module, args: tuple, kwargs: dict, output):
    """The attention module's output plus its local and untied heads' W_O' W_V' x (x: the layer's input)."""
    x = args[0] if args else kwargs["hidden_states"]
    extra = 0
    if getattr(module, "local_v", None) is not None:
        extra = module.local_o(module.local_v(x))
    if getattr(module, "untied_v", None) is not None:
        values = nn.functional.linear(x, module.untied_v, module.untied_b)
        extra = extra + nn.functional.linear(values, module.untied_o)
    if isinstance(output, tuple):
        return (output[0] + extra, *output[1:])
    return output + extra


def _check_the_interface_is_used(module: nn.Module) -> None:
    """Refuse, at a module's first forward, attention that never called transformers' attention interface: its
    Laplacian heads would silently be ordinary ones (T5 at transformers 5.4 computes its attention inline). The
    error is raised before the module's output reaches the rest of the model; both hooks go after the first call
    that did reach lapheads' function, so later calls pay nothing."""
    import transformers

    def before(mod: nn.Module, args) -> None:
        mod.laplacian_reached = False

    def after(mod: nn.Module, args, output) -> None:
        if not mod.laplacian_reached:
            raise InputError(
                f"{type(mod).__name__} computed its attention without transformers' attention interface "
                f"(transformers {transformers.__version__}), so its Laplacian heads would be ordinary ones; "
                "allowed: models whose attention goes through the interface (docs/integrations.md's family table)"
            )
        for handle in handles:
            handle.remove()

    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def from_pretrained(model_class, path, *args, **kwargs):
    """``model_class.from_pretrained(path)`` that keeps a Laplacian checkpoint Laplacian (and refuses otherwise).

    A checkpoint without ``laplacian_heads`` in its config loads as it is; one with them loads with the lapheads
    attention and its per-layer masks, and asking for another ``attn_implementation`` is a one-line error.
    """
    from transformers import AutoConfig

    register()
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    spec = config_masks(config)
    wanted = kwargs.pop("attn_implementation", None)
    if spec is None:
        return model_class.from_pretrained(path, *args, config=config, attn_implementation=wanted, **kwargs)
    if wanted not in (None, NAME, "eager", EAGER_NAME, "flex_attention", FLEX_NAME):
        raise InputError(
            f"{path} has Laplacian heads; attn_implementation={wanted!r} would load it as plain "
            f"attention; allowed: {NAME!r}, 'eager' (lapheads' textbook path) or leave it out"
        )
    implementation = {"eager": EAGER_NAME, EAGER_NAME: EAGER_NAME, "flex_attention": FLEX_NAME}.get(wanted, wanted)
    implementation = implementation or NAME
    model = model_class.from_pretrained(path, *args, config=config, attn_implementation=implementation, **kwargs)
    kinds = _config_kinds(config)
    if kinds is not None:  # other head kinds; their parameters ((a, b), local terms) transformers does not know
        enable(model, ["/".join(layer) for layer in kinds])
        _load_head_weights(model, path)
        return model
    blend = getattr(config, "laplacian_blend", None)  # a model saved mid-schedule keeps its lambda
    if blend is not None and (type(blend) not in (int, float) or not 0 <= blend <= 1):  # "0.5" and true are no lambda
        raise InputError(f"config.laplacian_blend {blend!r}; allowed: a number in [0, 1] (JSON, not a string)")
    model = enable(model, spec, init="switch" if blend is None else "blend")
    if blend is not None:
        set_blend(model, float(blend))
    return model


def _load_head_weights(model: nn.Module, path) -> None:
    """Load the head kinds' own parameters (mix heads' (a, b), local and untied heads' W_V', W_O', gates) from a
    saved model's safetensors files (transformers drops keys it does not expect, so ``from_pretrained`` leaves them
    at their initial values). Each is looked up under the name ``save_pretrained`` wrote it with, which a family's
    checkpoint conversion may rename (ViT's ``layers.0`` is saved as ``encoder.layer.0``)."""
    from pathlib import Path

    from lapheads.io import load_safetensors

    wanted = {name: p for name, p in model.named_parameters() if name.endswith(HEAD_PARAMETERS)}
    saved_as = _saved_names(model, wanted)
    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors = load_safetensors(file)
        found.update({name: tensors[saved] for name, saved in saved_as.items() if saved in tensors})
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise InputError(
            f"{path} holds no head-kind weights {missing[0]!r} (and {len(missing) - 1} more); saved by enable?"
        )
    with torch.no_grad():
        for name, value in found.items():
            wanted[name].copy_(value)


def _saved_names(model: nn.Module, parameters: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each parameter's name in the files ``save_pretrained`` writes: transformers' own reverse of the family's
    checkpoint conversion, asked one name at a time (a transformers without conversions saves names as they are)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {name: name for name in parameters}
    return {name: next(iter(revert_weight_conversion(model, {name: p.detach()}))) for name, p in parameters.items()}


try:  # importing lapheads.hf is enough for transformers (pipelines, lm-eval's "hf" model) to load a saved model
    register()
except ImportError:  # transformers missing: enable() / from_pretrained() say so when called
    pass
