"""``LaplacianHeadsMixin``: one attention layer's heads (host truth and device buffers) and the op on them, for any
attention module: timm's drop-in (``lapheads.core.modules``), the converted EVA and Swin modules, and the GPT.

It does not import timm, so the GPT (and ``lapheads train lm --help``) loads without it. The op is one leaf of FX and
TorchScript (``fused_leaf``, ``reference_leaf``); timm's feature extraction learns them in ``core.modules``.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import List, Optional, Tuple  # TorchScript reads typing.Optional / Tuple in string annotations

import torch
from torch import Tensor

from lapheads.core.attention import laplacian_attention, laplacian_attention_reference, scripted_attention
from lapheads.core.heads import HeadSpec, HeadSpecError, LayerHeads, parse_heads
from lapheads.core.kinds import KIND_COEFFICIENTS, PROJECTING_KINDS, gate_heads

__all__ = ["LaplacianHeadsMixin"]


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
        # the gated heads' indices (the columns of head_gate), rebuilt with the mask
        self.register_buffer("head_gate_index", torch.zeros(0, dtype=torch.long, device=device), persistent=False)
        self.head_gate: Optional[torch.nn.Linear] = None
        self.set_laplacian_heads(laplacian_heads)

    def set_laplacian_heads(self, laplacian_heads: LayerHeads | HeadSpec | Sequence[str]) -> None:
        """Choose which heads are Laplacian (no parameters change), or give every head a kind
        (:data:`HEAD_KINDS`): "mix" heads gain their learnable (a, b) (``mix_a`` = 0, ``mix_b`` = 1: ordinary at
        the start), "local" and "untied" heads the module's untied local term (:meth:`_make_local`), gated heads
        the module's gate (:meth:`_make_gates`).

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
        self._kinds: tuple[str, ...] | None = None if heads.plain_kinds else heads.kinds
        self._op_heads: int | None = heads.trailing
        device = self.laplacian_mask.device
        if "mix" in heads.kinds:
            dtype = self._weights_dtype()  # a half-precision model's new parameters are half too
            self.mix_a = torch.nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))  # 1-D: no decay
            self.mix_b = torch.nn.Parameter(torch.ones(num_heads, device=device, dtype=dtype))
        else:
            self.mix_a = self.mix_b = None
        self._make_local(heads.kinds.count("local"), [h for h, kind in enumerate(heads.kinds) if kind == "untied"])
        self._make_gates(len(heads.gated_heads))
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
        self._buffers["head_gate_index"] = torch.tensor(self._heads.gated_heads, dtype=torch.long, device=device)

    def _weights_dtype(self) -> torch.dtype:
        """The dtype of the module's own weights, which the head kinds' parameters take (an fp16 model whose
        kinds are set, or reloaded with them, keeps fp16 mix and local parameters)."""
        for name, parameter in self.named_parameters():
            if parameter.is_floating_point() and not name.startswith(("mix_", "local_", "untied_", "head_gate")):
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

    def _gate_input_features(self) -> int | None:
        """The width of the layer's input, which gated heads' gates read; None where the module's forward does not
        apply gates (then gated heads are refused)."""
        return None

    def _make_gates(self, num_gated: int) -> None:
        """Gated heads' gate: ``head_gate``, a Linear from the layer's input to one logit per gated head, without
        bias and at zero, so each new gate is the fixed scale sigmoid(0) = 1/2 (the gated-attention papers' init)."""
        if not num_gated:
            self.head_gate = None
            return
        features = self._gate_input_features()
        if features is None:
            raise HeadSpecError(
                f"{type(self).__name__} does not apply head gates; allowed kinds here: all without 'gated-' "
                "(gated heads: lapheads' ViT and GPT, Hugging Face models)"
            )
        device = self.laplacian_mask.device
        self.head_gate = torch.nn.Linear(features, num_gated, bias=False, device=device, dtype=self._weights_dtype())
        torch.nn.init.zeros_(self.head_gate.weight)

    def _gate(self, out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The op's output (B, H, T, D) with each gated head scaled by its gate on ``tokens`` (the layer's input)."""
        if self.head_gate is not None:  # on the attribute itself: TorchScript drops the branch where it is None
            out = gate_heads(out, self.head_gate(tokens), self.head_gate_index)
        return out

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
            out = fused_leaf(
                q, k, v, self.laplacian_mask, trailing, attn_mask, is_causal, dropout_p, self.scale, blend, kinds, mix
            )
            return out, None
        out, attn = reference_leaf(
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


@torch.jit.ignore
def fused_leaf(
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
def reference_leaf(
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
    """``laplacian_attention_reference`` with P, as :func:`fused_leaf`."""
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
    LaplacianHeadsMixin._attend,
    LaplacianHeadsMixin._attend_eager,
    fused_leaf,
    reference_leaf,
    scripted_attention,
):
    _fn.__annotations__ = typing.get_type_hints(_fn)

# FX calls the op as one node (its argument checks branch on shapes); wrap() names the callers' global, so it is here
torch.fx.wrap("fused_leaf")
torch.fx.wrap("reference_leaf")
