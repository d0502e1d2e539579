"""The timm-compatible module: ``LaplacianAttention`` (a drop-in for ``timm.layers.Attention``) and
``LaplacianHeadsMixin``, which keeps one layer's head mask and kinds for any attention module.

TorchScript scripts the module and FX traces it: the op is one leaf of both (``_fused_leaf``, ``_reference_leaf``),
registered below with torch.fx and timm's feature extraction.
"""

from __future__ import annotations

#: callables to run once this module has loaded: the front door (lapheads/__init__.py) registers lapheads' timm
#: names here where this module's import of timm is what loaded timm (registering needs this module whole)
WHEN_LOADED: list = []

# ruff: noqa: E402 - the list above must exist before the import of timm below
import typing
from collections.abc import Sequence
from typing import List, Optional, Tuple  # TorchScript reads typing.Optional / Tuple in string annotations

import torch
from timm.layers import Attention
from torch import Tensor

from lapheads.core.attention import laplacian_attention, laplacian_attention_reference, scripted_attention
from lapheads.core.heads import HeadSpec, HeadSpecError, LayerHeads, parse_heads
from lapheads.core.kinds import KIND_COEFFICIENTS, PROJECTING_KINDS

__all__ = ["LaplacianAttention", "LaplacianHeadsMixin", "convert_attention"]


class LaplacianHeadsMixin:
    """Holds one attention layer's Laplacian head mask for an ``nn.Module``: host truth plus a device buffer.

    The mask's truth is a CPU tensor kept beside the module; ``laplacian_mask`` is a non-persistent buffer (state
    dicts stay those of the plain model) that is rewritten from it whenever the module's tensors are moved or
    re-allocated (``_apply``: ``to``, ``cuda``, ``to_empty``). So a model built on the meta device and then
    ``to_empty``-ed runs with the heads it was configured with, not with uninitialised memory.
    """

    # (no class-level annotation of the buffer: TorchScript would read it as an unresolvable string)
    __jit_unused_properties__ = ["laplacian_heads_for_op", "heads"]

    def _init_laplacian_heads(self, num_heads: int, laplacian_heads: LayerHeads | HeadSpec, device=None) -> None:
        # on the factory device (timm's create_model(device="meta") puts every tensor there)
        self.register_buffer(
            "laplacian_mask", torch.zeros(num_heads, dtype=torch.bool, device=device), persistent=False
        )
        # what the scripted op reads (TorchScript keeps tensors, not head-kind names); rebuilt with the mask
        self.register_buffer("head_coefficients", torch.zeros(3, num_heads, device=device), persistent=False)
        self.register_buffer(
            "head_exclusive", torch.zeros(num_heads, dtype=torch.bool, device=device), persistent=False
        )
        self.register_buffer("head_is_mix", torch.zeros(num_heads, dtype=torch.bool, device=device), persistent=False)
        self.set_laplacian_heads(laplacian_heads)

    def set_laplacian_heads(self, laplacian_heads: LayerHeads | HeadSpec | Sequence[str]) -> None:
        """Choose which heads are Laplacian (no parameters change), or give every head a kind
        (:data:`HEAD_KINDS`): "mix" heads gain their learnable (a, b) (``mix_a`` = 0, ``mix_b`` = 1: ordinary at
        the start), "local" and "untied" heads the module's untied local term (:meth:`_make_local`).

        Args:
            laplacian_heads: this layer's :class:`LayerHeads`, or any one-layer spec :func:`parse_heads` reads (k,
                a bool mask, kind names, "negated:2").
        """
        num_heads = len(self.laplacian_mask)
        heads = parse_heads([laplacian_heads], [num_heads])[0]
        self._heads = heads
        # what forward hands the op: TorchScript-readable attributes, set once here (no per-call work):
        # the kinds where there are others than ordinary and Laplacian heads, else an int k when the Laplacian heads
        # are the trailing k (no device work to build a mask), else None (the on-device buffer)
        self._kinds: tuple[str, ...] | None = None if heads.plain else heads.kinds
        self._op_heads: int | None = heads.trailing
        device = self.laplacian_mask.device
        if "mix" in heads.kinds:
            dtype = self._weights_dtype()  # a half-precision model's new parameters are half too
            self.mix_a = torch.nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))  # 1-D: no decay
            self.mix_b = torch.nn.Parameter(torch.ones(num_heads, device=device, dtype=dtype))
        else:
            self.mix_a = self.mix_b = None
        self._make_local(heads.kinds.count("local"), [h for h, kind in enumerate(heads.kinds) if kind == "untied"])
        self._sync_laplacian_mask()

    def _sync_laplacian_mask(self) -> None:
        device = self.laplacian_mask.device
        # A new tensor, not an in-place copy: on the meta device there is nothing to copy into.
        self._buffers["laplacian_mask"] = self._heads.mask.to(device) if device.type != "meta" else self.laplacian_mask
        if device.type == "meta":
            return
        kinds = self._heads.kinds
        self._buffers["head_coefficients"] = torch.tensor(
            [KIND_COEFFICIENTS[kind] for kind in kinds], dtype=torch.float32, device=device
        ).T.contiguous()
        self._buffers["head_exclusive"] = torch.tensor([k in PROJECTING_KINDS for k in kinds], device=device)
        self._buffers["head_is_mix"] = torch.tensor([k == "mix" for k in kinds], device=device)

    def _weights_dtype(self) -> torch.dtype:
        """The dtype of the module's own weights, which the head kinds' parameters take (an fp16 model whose
        kinds are set, or reloaded with them, keeps fp16 mix and local parameters)."""
        for name, parameter in self.named_parameters():
            if parameter.is_floating_point() and not name.startswith(("mix_", "local_", "untied_")):
                return parameter.dtype
        return torch.get_default_dtype()

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        module = super()._apply(fn, recurse)  # type: ignore[misc]
        self._sync_laplacian_mask()  # to_empty() leaves buffers uninitialised; the host copy is the truth
        return module

    def _make_local(self, num_local: int, untied_heads: list[int]) -> None:
        """The untied token-local term of "local" and "untied" heads; a module without one refuses such heads."""
        if num_local or untied_heads:
            raise HeadSpecError(
                f"{type(self).__name__} has no local term; allowed kinds here: all but 'local' and 'untied'"
            )

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor],
        is_causal: bool,
        return_attn: bool,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The op on this layer's heads: eagerly (and under FX, torch.compile, torch.export) ``laplacian_attention``
        or its reference path; under TorchScript its scriptable form (``scripted_attention``), so a scripted model
        saves with ``torch.jit.save`` and reloads without lapheads' Python."""
        if torch.jit.is_scripting():
            coefficients = self.head_coefficients.to(q.dtype)
            if self.mix_a is not None and self.mix_b is not None:  # learned (a, b) of the mix heads
                is_mix = self.head_is_mix
                alpha = torch.where(is_mix, self.mix_a.to(q.dtype), coefficients[0])
                beta = torch.where(is_mix, self.mix_b.to(q.dtype), coefficients[1])
                coefficients = torch.stack([alpha, beta, coefficients[2]])
            if hasattr(self, "laplacian_blend"):  # a blend conversion: lambda V + (1 - 2 lambda) P V
                lap = self.laplacian_mask.to(q.dtype) * self.laplacian_blend.to(q.dtype)
                coefficients = torch.stack([lap, 1 - 2 * lap, coefficients[2]])
            dropout_p = self.attn_drop.p if self.training else 0.0
            out = scripted_attention(
                q, k, v, coefficients, self.head_exclusive, attn_mask, is_causal, dropout_p, self.scale
            )
            return out, None
        return self._attend_eager(q, k, v, attn_mask, is_causal, return_attn)

    @torch.jit.unused
    def _attend_eager(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor],
        is_causal: bool,
        return_attn: bool,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The op (fused, or the reference path when timm's ``fused_attn`` is off or P is wanted), for any timm
        attention class with ``attn_drop``, ``scale`` and ``fused_attn``; traced as one call by FX."""
        # not the property: under TorchScript ``self`` is the scripted module, which keeps attributes only
        trailing = -1 if self._op_heads is None else self._op_heads
        dropout_p = self.attn_drop.p if self.training else 0.0
        blend = getattr(self, "laplacian_blend", None)  # lambda of a blend conversion (lapheads.core.convert)
        kinds_of_heads = self._kinds  # attributes, not methods: under TorchScript self keeps attributes only
        kinds = None if kinds_of_heads is None else list(kinds_of_heads)
        mix = None if self.mix_a is None else (self.mix_a, self.mix_b)
        if self.fused_attn and not return_attn:
            out = _fused_leaf(
                q, k, v, self.laplacian_mask, trailing, attn_mask, is_causal, dropout_p, self.scale, blend, kinds, mix
            )
            return out, None
        out, attn = _reference_leaf(
            q, k, v, self.laplacian_mask, trailing, attn_mask, is_causal, dropout_p, self.scale, blend, kinds, mix
        )
        return out, attn

    @property
    def heads(self) -> LayerHeads:
        """This layer's heads (works on any device, meta included: the value is host truth)."""
        return self._heads

    @property
    def laplacian_heads_for_op(self) -> HeadSpec:
        """The spec to hand ``laplacian_attention`` (:meth:`LayerHeads.for_op`: the kinds, else k trailing heads,
        else the device mask); the FX / TorchScript leaf below takes the same three as positional arguments."""
        return self._heads.for_op(self.laplacian_mask)


class LaplacianAttention(LaplacianHeadsMixin, Attention):
    """``timm.layers.Attention`` with Laplacian heads: same arguments, parameters and state dict, plus a head spec.

    A timm Attention state dict loads with ``strict=True`` (the head mask is a non-persistent buffer), and with
    ``laplacian_heads=0`` the output equals timm's for the same weights. timm's ``fused_attn`` flag picks the fused
    op (``laplacian_attention``) or the reference path (``laplacian_attention_reference``).

    Args:
        dim: input dimension of the tokens.
        num_heads: number of attention heads.
        *args, **kwargs: every other ``timm.layers.Attention`` argument (qkv_bias, qk_norm, attn_drop, ...).
        laplacian_heads: int k (trailing k heads) or a bool mask of length num_heads.
    """

    def __init__(self, dim: int, num_heads: int = 8, *args, laplacian_heads: HeadSpec = 0, **kwargs) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        if not hasattr(self, "gate"):  # timm before gated attention
            self.gate = None
        self.local_v = self.local_o = None
        self.untied_v = self.untied_v_bias = self.untied_o = None
        self._untied_heads: list[int] = []
        self._init_laplacian_heads(num_heads, laplacian_heads, kwargs.get("device"))

    def _make_local(self, num_local: int, untied_heads: list[int]) -> None:
        """ "local" heads: their own value (W_V', initialised as timm's ViT initialises a Linear) and output
        (W_O', zero, like the model's output projections at the start) weights, untied from W_V and W_O.
        "untied" heads: W_V', W_O' (and W_V's bias) that start as copies of their head's W_V and W_O, so the head
        starts as exactly the Laplacian head (-W_O P V + W_O W_V x) and training only releases the tie. They are
        plain Parameters filled by copying (no random draw), so a model with untied heads starts from the same
        weights as the Laplacian model of the same seed."""
        device, dtype = self.qkv.weight.device, self.qkv.weight.dtype
        if num_local:
            width = num_local * self.head_dim
            self.local_v = torch.nn.Linear(
                self.qkv.in_features, width, bias=self.qkv.bias is not None, device=device, dtype=dtype
            )
            self.local_o = torch.nn.Linear(width, self.proj.out_features, bias=False, device=device, dtype=dtype)
        else:
            self.local_v = self.local_o = None
        self._untied_heads = list(untied_heads)
        if untied_heads:
            if not isinstance(self.norm, torch.nn.Identity):  # proj(norm(heads)) is no sum over heads to copy
                raise HeadSpecError("'untied' heads need scale_norm=False (a norm before proj mixes the heads)")
            width = len(untied_heads) * self.head_dim
            empty = lambda *shape: torch.nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))  # noqa: E731
            self.untied_v = empty(width, self.qkv.in_features)
            self.untied_v_bias = empty(width) if self.qkv.bias is not None else None
            self.untied_o = empty(self.proj.out_features, width)
        else:
            self.untied_v = self.untied_v_bias = self.untied_o = None
        if (num_local or untied_heads) and device.type != "meta":
            self.init_weights()

    def init_weights(self) -> None:
        """The head kinds' own parameters at their start: mix heads ordinary (a = 0, b = 1), local heads' W_V' as
        timm initialises a Linear and W_O' zero, untied heads' W_V', W_O' copies of their head's W_V, W_O. timm's
        ``init_weights`` calls this after its own pass over the module's Linears (so a model built on the meta
        device, ``to_empty``-ed and re-initialised starts right); qkv and proj are timm's business and untouched."""
        with torch.no_grad():
            if self.mix_a is not None:
                self.mix_a.zero_()
                self.mix_b.fill_(1.0)
            if self.local_v is not None:
                torch.nn.init.trunc_normal_(self.local_v.weight, std=0.02)
                if self.local_v.bias is not None:
                    torch.nn.init.zeros_(self.local_v.bias)
                torch.nn.init.zeros_(self.local_o.weight)
            if self.untied_v is not None:
                hd, start = self.head_dim, 2 * self.attn_dim  # qkv's rows: (q, k, v) x heads x head_dim
                v_rows = [slice(start + h * hd, start + (h + 1) * hd) for h in self._untied_heads]
                self.untied_v.copy_(torch.cat([self.qkv.weight[rows] for rows in v_rows]))
                if self.untied_v_bias is not None:
                    self.untied_v_bias.copy_(torch.cat([self.qkv.bias[rows] for rows in v_rows]))
                columns = [self.proj.weight[:, h * hd : (h + 1) * hd] for h in self._untied_heads]
                self.untied_o.copy_(torch.cat(columns, dim=1))

    def forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> torch.Tensor:
        """Args:
            x: tokens (B, N, C).
            attn_mask: optional mask broadcastable to (B, H, N, N) (bool: True = attend).
            is_causal: causal attention.

        The same signature as timm's Attention, so TorchScript scripts it and FX traces it (the op is a leaf of
        both); :meth:`forward_with_attn` also returns P for attention maps.
        """
        return self._forward(x, attn_mask, is_causal, False)[0]

    @torch.jit.ignore
    def forward_with_attn(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``forward`` and P (B, H, N, N) from the reference path, for attention maps."""
        out, attn = self._forward(x, attn_mask, is_causal, True)
        return out, attn

    def _forward(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool, return_attn: bool
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        b, n, _ = x.shape
        tokens = x
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x, attn = self._attend(q, k, v, attn_mask, is_causal, return_attn)
        x = x.transpose(1, 2).reshape(b, n, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        out = self.proj(x)
        if self.local_v is not None:  # "local" heads: their untied token-local term, W_O' W_V' x
            out = out + self.local_o(self.local_v(tokens))
        if self.untied_o is not None:  # "untied" heads: W_O' W_V' x, started as the Laplacian head's W_O W_V x
            out = out + torch.nn.functional.linear(
                torch.nn.functional.linear(tokens, self.untied_v, self.untied_v_bias), self.untied_o
            )
        return self.proj_drop(out), attn

    def extra_repr(self) -> str:
        if not self._heads.plain:
            return f"head_kinds={list(self._heads.kinds)}"
        return f"laplacian_heads={self._heads}"


def convert_attention(
    modules: Sequence[torch.nn.Module], laplacian_class: type, heads_per_layer: Sequence[LayerHeads]
) -> None:
    """Turn timm attention modules of a family without ``attn_layer`` (EVA, Swin) into ``laplacian_class`` in
    place: the class gains only behaviour (the mixin's heads and the op), so parameters and state dict stay the
    family's own; each module then gets its layer's heads."""
    for module, heads in zip(modules, heads_per_layer):
        if not isinstance(module, laplacian_class):
            module.__class__ = laplacian_class
            device = next(module.parameters()).device
            module._init_laplacian_heads(module.num_heads, heads, device)
        else:
            module.set_laplacian_heads(heads)


@torch.jit.ignore
def _fused_leaf(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    trailing: int,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    dropout_p: float,
    scale: float,
    blend: Optional[Tensor] = None,
    kinds: Optional[List[str]] = None,
    mix: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tensor:
    """``laplacian_attention`` with positional arguments (``kinds`` when given, else k trailing heads when
    ``trailing`` >= 0, else ``mask``): the one node FX records and the one call TorchScript leaves to Python."""
    heads: HeadSpec = kinds if kinds is not None else (trailing if trailing >= 0 else mask)
    return laplacian_attention(
        q,
        k,
        v,
        heads,
        attn_mask=attn_mask,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
        blend=blend,
        mix=mix,
    )


@torch.jit.ignore
def _reference_leaf(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    trailing: int,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    dropout_p: float,
    scale: float,
    blend: Optional[Tensor] = None,
    kinds: Optional[List[str]] = None,
    mix: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """``laplacian_attention_reference`` with P, as :func:`_fused_leaf`."""
    heads: HeadSpec = kinds if kinds is not None else (trailing if trailing >= 0 else mask)
    out, attn = laplacian_attention_reference(
        q,
        k,
        v,
        heads,
        attn_mask=attn_mask,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
        blend=blend,
        mix=mix,
        return_attn=True,
    )
    return out, attn


# TorchScript cannot resolve the string annotations of ``from __future__ import annotations`` on methods it leaves
# to Python: give them their evaluated types
for _fn in (
    *(getattr(LaplacianAttention, m) for m in ("forward", "forward_with_attn", "_forward", "_attend", "_attend_eager")),
    _fused_leaf,
    _reference_leaf,
    scripted_attention,
):
    _fn.__annotations__ = typing.get_type_hints(_fn)

# FX (torch.fx and timm's feature extraction) calls the op as one node: its argument checks branch on shapes
torch.fx.wrap("_fused_leaf")
torch.fx.wrap("_reference_leaf")
_register_notrace = getattr(
    __import__("timm.layers", fromlist=["register_notrace_function"]), "register_notrace_function", None
)
if _register_notrace is not None:
    _register_notrace(_fused_leaf)
    _register_notrace(_reference_leaf)


for _then in WHEN_LOADED:  # what waited for this module to be whole (timm's names: see WHEN_LOADED)
    _then()
WHEN_LOADED.clear()
