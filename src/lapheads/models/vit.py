"""timm Vision Transformers with Laplacian heads.

Design choices:

* **timm builds the model.** ``create_vit`` calls ``timm.create_model`` with ``attn_layer=LaplacianAttention``, so
  every timm VisionTransformer variant (DeiT-III, plain ViT, small CPU sizes) gets Laplacian heads with timm's own
  init, LayerScale, drop-path and QK-norm. The head masks are set per block afterwards through the one parser,
  which is how per-layer specs ("0,2,2,0") work (timm passes one attention class to all blocks).
* **State dicts are timm's.** The head mask is a non-persistent buffer, so a timm checkpoint (a local file) loads
  into a Laplacian model with ``strict=True`` and the other way round.
* **Registered names.** After ``import lapheads``, names in the spirit of the authors' code such as
  ``deit3_base_12L_patch16_192`` (DeiT-III base, 12 Laplacian heads per layer, 192 px, QK-norm) work with
  ``timm.create_model``; ``vit_fmnist_patch4`` is the small CPU ViT (6 layers, 192 dim, 3 heads, patch 4).
"""

from __future__ import annotations

from typing import Any

import timm
import torch
from timm.models import generate_default_cfgs, register_model
from timm.models.eva import Eva
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer

from lapheads.core.convert import init_heads
from lapheads.core.heads import parse_heads
from lapheads.core.mixin import LaplacianHeadsMixin
from lapheads.core.modules import LaplacianAttention
from lapheads.errors import InputError
from lapheads.hardware import check_fits
from lapheads.io import load_tensor_file
from lapheads.models.eva import convert_eva
from lapheads.models.swin import convert_swin

__all__ = ["CPU_VIT_ARGS", "create_vit", "set_laplacian_heads", "vit_head_kinds", "vit_laplacian_masks"]

#: The small CPU ViT for 28-32 px images: 6 layers, 192 dims, 3 heads, patch 4.
CPU_VIT_ARGS: dict[str, Any] = dict(patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0)


def set_laplacian_heads(model: torch.nn.Module, laplacian_heads: object) -> list[torch.Tensor]:
    """Set the Laplacian heads of every ``LaplacianAttention`` in ``model`` (in module order); returns the masks."""
    layers = [m for m in model.modules() if isinstance(m, LaplacianAttention)]
    if not layers:
        raise InputError(f"{type(model).__name__} has no LaplacianAttention layers; build it with create_vit")
    for layer, heads in zip(layers, parse_heads(laplacian_heads, [m.num_heads for m in layers])):
        layer.set_laplacian_heads(heads)
    return [layer.heads.mask for layer in layers]  # the host truth: meta-device builds too


def vit_head_kinds(model: torch.nn.Module) -> list[list[str]]:
    """Each attention layer's head kinds, for config.json."""
    return [list(m.heads.names) for m in model.modules() if isinstance(m, LaplacianAttention)]


def vit_laplacian_masks(model: torch.nn.Module) -> list[list[bool]]:
    """Each attention layer's Laplacian mask, for configs and plots."""
    return [list(m.heads.flags) for m in model.modules() if isinstance(m, LaplacianAttention)]


def create_vit(
    name: str,
    laplacian_heads: object = 0,
    *,
    qk_norm: bool = False,
    pretrained_file: str | None = None,
    init: str = "switch",
    **timm_kwargs: Any,
) -> VisionTransformer:
    """Build a timm VisionTransformer whose attention layers are ``LaplacianAttention``.

    Args:
        name: a timm model name (``deit3_small_patch16_224``, ``vit_base_patch16_224``, ``vit_fmnist_patch4``...).
        laplacian_heads: k Laplacian heads in every layer, a per-layer list / "0,2,2,0" string, or per-layer masks.
        qk_norm: LayerNorm on queries and keys (the paper's baseline is the QK-norm model with 0 Laplacian heads).
        pretrained_file: a local timm checkpoint (.pth / .safetensors) to load; with a different ``num_classes``
            timm drops the classifier, as for any fine-tune.
        init: how the Laplacian heads of a pretrained model start (:mod:`lapheads.core.convert`): "switch",
            "signflip" (their W_O columns negated) or "blend" (lambda = 0: exactly the pretrained function; then
            ``lapheads.core.convert.BlendSchedule``).
        **timm_kwargs: passed to ``timm.create_model`` (num_classes, img_size, in_chans, drop_path_rate, ...).
    """
    if name not in timm.list_models():
        raise InputError(
            f"unknown model {name!r}; allowed: a timm VisionTransformer name, e.g. vit_fmnist_patch4, "
            f"deit3_small_patch16_224, deit3_base_patch16_224 (see timm.list_models('*vit*'))"
        )
    if pretrained_file is not None:
        # Read here (safetensors, or torch.load with weights_only) so a bad or unsafe file is one clear error;
        # timm then applies its own filters (classifier reset, position-embedding resize) to the state dict.
        state_dict = load_tensor_file(pretrained_file)
        overlay = {**(timm_kwargs.get("pretrained_cfg_overlay") or {}), "state_dict": state_dict}
        timm_kwargs.update(pretrained=True, pretrained_cfg_overlay=overlay)
    _check_size(name, qk_norm, timm_kwargs)
    try:
        model = timm.create_model(name, attn_layer=LaplacianAttention, qk_norm=qk_norm, **timm_kwargs)
    except TypeError as err:
        if "attn_layer" not in str(err) and "qk_norm" not in str(err):
            raise
        model = _convertible_or_none(name, qk_norm, timm_kwargs)  # EVA, Swin: no attn_layer, modules converted
        if model is None:
            raise InputError(
                f"model {name!r} takes no attn_layer; allowed: timm VisionTransformer, EVA and Swin models"
            ) from None
    # features_only=True wraps the model in timm's feature extractor (FeatureGetterNet): its heads are the inner
    # model's, set the same way
    inner = getattr(model, "model", None) if timm_kwargs.get("features_only") else model
    if isinstance(inner, Eva):
        convert_eva(model, laplacian_heads)
    elif isinstance(inner, SwinTransformer):
        convert_swin(model, laplacian_heads)
    elif isinstance(inner, VisionTransformer):
        set_laplacian_heads(model, laplacian_heads)
    else:
        allowed = "timm VisionTransformer, EVA and Swin models"
        raise InputError(f"model {name!r} is a {type(model).__name__}; allowed: {allowed}")
    for attn in (m for m in model.modules() if isinstance(m, LaplacianHeadsMixin)):
        width = attn.proj.in_features // attn.num_heads
        init_heads(
            attn,
            attn.laplacian_mask,
            init,
            lambda head, a=attn, w=width: (a.proj.weight, slice(head * w, (head + 1) * w), 1),
        )
    return model


def _convertible_or_none(name: str, qk_norm: bool, timm_kwargs: dict[str, Any]) -> torch.nn.Module | None:
    """``name`` built as timm builds it, if it is an EVA or Swin model (its attention is converted afterwards),
    else None."""
    try:
        model = timm.create_model(name, **({"qk_norm": True} if qk_norm else {}), **timm_kwargs)
    except TypeError:
        return None
    inner = getattr(model, "model", None) if timm_kwargs.get("features_only") else model
    return model if isinstance(inner, (Eva, SwinTransformer)) else None


def _check_size(name: str, qk_norm: bool, timm_kwargs: dict[str, Any]) -> None:
    """A depth or width given by the caller (a preset's model_kwargs, a config.json record) is checked against the
    machine's memory before anything is allocated: one block is built on the meta device and scaled by the depth."""
    if not ({"depth", "embed_dim"} & set(timm_kwargs)) or timm_kwargs.get("device") == "meta":
        return
    if torch.empty(0).device.type == "meta":
        return
    depth = timm_kwargs.get("depth")
    skip = ("pretrained", "pretrained_cfg_overlay", "device", "features_only", "out_indices", "feature_cfg")
    probe = {k: v for k, v in timm_kwargs.items() if k not in skip}  # the bare model: its blocks are counted
    if isinstance(depth, int) and not isinstance(depth, bool) and depth > 0:
        probe["depth"] = 1
    try:
        one = timm.create_model(name, qk_norm=qk_norm, device="meta", **probe)
    except (TypeError, ValueError, RuntimeError):
        return  # timm's own error comes with the real build below
    blocks = getattr(one, "blocks", None)
    per_block = sum(p.numel() for p in blocks[0].parameters()) if blocks is not None and len(blocks) else 0
    total = sum(p.numel() for p in one.parameters())
    if probe.get("depth") == 1:
        total += (depth - 1) * per_block
    check_fits(f"{name} with {', '.join(f'{k}={timm_kwargs[k]}' for k in ('depth', 'embed_dim') if k in timm_kwargs)}: "
               f"~{total:,} parameters", 4 * total)  # fmt: skip


def _registered(base: str, laplacian_heads: int, **fixed: Any):
    """A timm entry point: ``base`` with k Laplacian heads per layer, QK-norm, and fixed arguments."""

    def build(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
        if pretrained and "state_dict" not in (kwargs.get("pretrained_cfg_overlay") or {}):
            raise InputError(
                f"pretrained=True: lapheads' {base.replace('_patch16_224', '')} names have no published weights "
                "(their QK-norm layers are not in timm's checkpoints); allowed: "
                f"lapheads.create_vit({base!r}, k, qk_norm=False, pretrained=True, init='switch'|'signflip'|'blend') "
                "to convert timm's weights, or pretrained_file= a checkpoint of this architecture"
            )
        kwargs = {**fixed, **kwargs}
        heads = kwargs.pop("laplacian_heads", laplacian_heads)
        _say_input_size(kwargs, channels=3)
        return create_vit(base, heads, qk_norm=kwargs.pop("qk_norm", True), pretrained=pretrained, **kwargs)

    return build


def _default_cfg(input_size: tuple[int, int, int], num_classes: int, imagenet: bool = False) -> dict[str, Any]:
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    mean, std = (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD) if imagenet else ((0.5,) * input_size[0],) * 2
    # fixed_input_size: learned position embeddings for one grid, as timm's own ViT configs say
    return dict(
        url="",
        num_classes=num_classes,
        input_size=input_size,
        mean=mean,
        std=std,
        first_conv="patch_embed.proj",
        classifier="head",
        fixed_input_size=True,
    )


# timm's register_model reads the registering module's ``default_cfgs``; untrained names need one too.
default_cfgs = generate_default_cfgs(
    {
        "vit_fmnist_patch4": _default_cfg((1, 28, 28), 10),
        "vit_lite_7_patch4_32": _default_cfg((3, 32, 32), 10),
        **{
            f"deit3_{size}_{k}L_patch16_192": _default_cfg((3, 192, 192), 1000, imagenet=True)
            for size, heads in (("small", 6), ("base", 12), ("large", 16))
            for k in range(heads + 1)
        },
        **{
            f"deit3_{size}_{k}L_patch16_224": _default_cfg((3, 224, 224), 1000, imagenet=True)
            for size, heads in (("small", 6), ("base", 12))
            for k in range(heads + 1)
        },
    }
)


def _say_input_size(kwargs: dict[str, Any], channels: int) -> None:
    """Make the pretrained_cfg say the size the model is built at (what timm's data config and transforms read):
    an ``img_size`` argument goes into ``pretrained_cfg_overlay``'s ``input_size``, unless the caller set one."""
    if "img_size" not in kwargs:
        return
    size = kwargs["img_size"]
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    kwargs["pretrained_cfg_overlay"] = {
        "input_size": (kwargs.get("in_chans", channels), height, width),
        **(kwargs.get("pretrained_cfg_overlay") or {}),
    }


def _small_vit(name: str, args: dict[str, Any], pretrained: bool, kwargs: dict[str, Any]) -> VisionTransformer:
    """A lapheads-registered small ViT: LaplacianAttention in every block (timm's numbers and state dict at k = 0),
    and ``laplacian_heads=SPEC`` accepted by ``timm.create_model`` like the deit3_*_kL names."""
    from timm.models.vision_transformer import _create_vision_transformer  # noqa: PLC2701 - timm builds its ViTs only through it

    heads = kwargs.pop("laplacian_heads", 0)
    kwargs.setdefault("attn_layer", LaplacianAttention)
    _say_input_size(kwargs, channels=args.get("in_chans", 3))
    model = _create_vision_transformer(name, pretrained=pretrained, **dict(args, **kwargs))
    if kwargs["attn_layer"] is LaplacianAttention:
        set_laplacian_heads(model, heads)
    return model


def _register_all() -> None:
    @register_model
    def vit_fmnist_patch4(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
        """Small CPU ViT for 28-32 px images: 6 layers, 192 dim, 3 heads, patch 4."""
        args = dict(CPU_VIT_ARGS, img_size=28, in_chans=1, num_classes=10)
        return _small_vit("vit_fmnist_patch4", args, pretrained, kwargs)

    @register_model
    def vit_lite_7_patch4_32(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
        """ViT-Lite-7/4 (Hassani et al. 2021) for 32 px: 7 layers, 256 dim, 4 heads, MLP ratio 2, patch 4."""
        args = dict(img_size=32, patch_size=4, embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0, num_classes=10)
        return _small_vit("vit_lite_7_patch4_32", args, pretrained, kwargs)

    # DeiT-III with k Laplacian heads per layer, QK-norm and LayerScale 1e-6, as in the authors' timm fork: their
    # small and base models are registered at 224 px (deit3_small_3L_patch16_224), their large ones at 192 px;
    # lapheads' own 192-px names stay for every size.
    sizes = (("small", 6, (192, 224)), ("base", 12, (192, 224)), ("large", 16, (192,)))
    for size, heads, resolutions in sizes:
        for px in resolutions:
            for k in range(heads + 1):
                fn = _registered(f"deit3_{size}_patch16_224", k, img_size=px)
                fn.__name__ = f"deit3_{size}_{k}L_patch16_{px}"
                fn.__doc__ = f"DeiT-III {size}, {k} of {heads} heads Laplacian in every layer, QK-norm, {px} px."
                fn.__module__ = __name__
                register_model(fn)


_register_all()
