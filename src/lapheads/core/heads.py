"""The one head-spec parser and the value it builds: which kind each head of each layer is.

Every model, config, sweep and integration reads head specs through :func:`parse_heads`, so a spec means the same
thing and fails with the same one-line error everywhere, and every layer keeps what it returns, a
:class:`LayerHeads`. Design choices:

* **Trailing heads.** An integer k makes the *last* k heads of every layer Laplacian, the paper's convention.
* **One grammar, one value.** ``parse_heads`` turns every written spec (an int k, "0,2,2,0" per layer, a kind name,
  "kind:k+kind:j", "a/b/c" per head, per-layer lists, bool masks) into one frozen ``LayerHeads`` per layer; its
  mask, its trailing k (what the op takes with no device work) and whether it is only ordinary and Laplacian heads
  are read from that value, never re-parsed. The grammar as text (``HEAD_SPEC_PATTERN``, ``HEAD_SPEC``) is
  ``lapheads.core.vocabulary``'s, without torch, so a config can be checked before a model exists.
* **The op checks its own arguments.** ``laplacian_attention`` takes k, a mask or kinds per call and validates them
  with :func:`check_count` and :func:`check_mask_tensor` (plain functions: no value built per call).
* **Masks are host truth.** A ``LayerHeads``' mask is a CPU bool tensor; a module keeps its device copy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Union

import torch
from torch import Tensor

from lapheads.core.kinds import is_plain_laplacian
from lapheads.core.vocabulary import GATE_PREFIX, GATEABLE_KINDS, HEAD_KINDS
from lapheads.errors import LapheadsError

__all__ = [
    "HeadSpec",
    "HeadSpecError",
    "LayerHeads",
    "check_count",
    "check_mask_tensor",
    "parse_heads",
]


class HeadSpecError(LapheadsError, ValueError):
    """A Laplacian-head spec that cannot be applied; the message names the value and what is allowed."""


@dataclass(frozen=True)
class LayerHeads:
    """One attention layer's heads: each head's kind (:data:`HEAD_KINDS`), in order, and whether it is gated.

    Built by :func:`parse_heads` from any written spec; a model, module or integration keeps this value for the
    layer and reads everything else from it (each answer computed once: the attention call reads them per step).

    Args:
        kinds: one kind per head.
        gated: per head, whether its output is scaled by its own sigmoid gate (written "gated-<kind>"; the module
            owns the gate's weights, :func:`lapheads.core.kinds.gate_heads` applies it). Left out: none.
    """

    kinds: tuple[str, ...]
    gated: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kinds, tuple) or not self.kinds or any(kind not in HEAD_KINDS for kind in self.kinds):
            raise HeadSpecError(f"head kinds {self.kinds!r}; allowed: a non-empty tuple of {', '.join(HEAD_KINDS)}")
        gated = tuple(self.gated) if self.gated else (False,) * len(self.kinds)
        if len(gated) != len(self.kinds) or not all(isinstance(flag, bool) for flag in gated):
            raise HeadSpecError(f"gated {self.gated!r}; allowed: {len(self.kinds)} bools, one per head")
        refused = sorted({kind for kind, flag in zip(self.kinds, gated) if flag and kind not in GATEABLE_KINDS})
        if refused:
            raise HeadSpecError(
                f"head kind {GATE_PREFIX}{refused[0]}: a gate scales a head's output before the output projection, "
                f"and a {refused[0]} head's token-local term is added after it; allowed gated kinds: "
                + ", ".join(GATE_PREFIX + kind for kind in GATEABLE_KINDS)
            )
        object.__setattr__(self, "gated", gated)  # one value per head: equal specs compare equal

    @classmethod
    def of_flags(cls, flags: Sequence[bool]) -> LayerHeads:
        """Ordinary heads, Laplacian where ``flags`` is True."""
        return cls(tuple("laplacian" if flag else "ordinary" for flag in flags))

    @classmethod
    def of_names(cls, names: Sequence[str]) -> LayerHeads:
        """Heads from their written names: a kind, or "gated-" and a kind (what :attr:`names` gives back)."""
        gated = tuple(name.startswith(GATE_PREFIX) for name in names)
        return cls(tuple(name[len(GATE_PREFIX) :] if flag else name for name, flag in zip(names, gated)), gated)

    @cached_property
    def names(self) -> tuple[str, ...]:
        """Each head's written name: its kind, "gated-" before it where the head is gated (what configs save)."""
        return tuple(GATE_PREFIX + kind if flag else kind for kind, flag in zip(self.kinds, self.gated))

    @cached_property
    def gated_heads(self) -> tuple[int, ...]:
        """The indices of the gated heads, in order (the columns of the module's gate)."""
        return tuple(h for h, flag in enumerate(self.gated) if flag)

    @property
    def num_heads(self) -> int:
        return len(self.kinds)

    @cached_property
    def flags(self) -> tuple[bool, ...]:
        """Per head, whether it is Laplacian."""
        return tuple(kind == "laplacian" for kind in self.kinds)

    @property
    def mask(self) -> Tensor:
        """A new bool CPU tensor of shape (num_heads,), True for Laplacian heads (on the CPU even under ``with
        torch.device("meta")``: a mask must hold its values)."""
        return torch.tensor(self.flags, dtype=torch.bool, device="cpu")

    @cached_property
    def num_laplacian(self) -> int:
        return sum(self.flags)

    @cached_property
    def plain(self) -> bool:
        """Only ordinary and Laplacian heads, none gated: what every model runs, and a blend converts."""
        return self.plain_kinds and not any(self.gated)

    @cached_property
    def plain_kinds(self) -> bool:
        """Only ordinary and Laplacian kinds, gated or not: what the op sees (a gate is the module's) and where its
        Laplacian fast paths apply."""
        return is_plain_laplacian(self.kinds)

    @cached_property
    def trailing(self) -> int | None:
        """k when the kinds are ordinary but the trailing k Laplacian (what the op takes as an int, with no device
        work per call), else None."""
        k = self.num_laplacian
        return k if self.plain_kinds and all(self.flags[self.num_heads - k :]) else None

    def for_op(self, device_mask: Tensor) -> int | tuple[str, ...] | Tensor:
        """What a module hands the op for this layer, the one rule every model and integration follows: the kinds
        where there are others than ordinary and Laplacian, else k where the Laplacian heads are the trailing k (no
        device work per call), else ``device_mask``, the module's (H,) bool buffer on its device (no host copy).
        Gates are not the op's: the module applies them to what the op returns."""
        if not self.plain_kinds:
            return self.kinds
        return self.trailing if self.trailing is not None else device_mask

    @property
    def op_spec(self) -> int | tuple[str, ...]:
        """What the op reads for this layer with no device work: k where the Laplacian heads are the trailing k, else
        the kinds (a module that runs scattered Laplacian heads on a GPU hands the op its device mask instead).

        Raises:
            HeadSpecError: where a head is gated: its gate reads the layer's input, which the op never sees (a
                module applies it, :func:`lapheads.core.kinds.gate_heads`); the op would run it ungated.
        """
        if any(self.gated):
            raise HeadSpecError(
                f"{self} are gated; the op alone would run them ungated (a gate reads the layer's input); allowed: "
                "a module with the spec (lapheads' ViT, GPT, a Hugging Face model), or the heads' kinds without "
                "'gated-' and lapheads.core.kinds.gate_heads on the op's output"
            )
        return self.trailing if self.trailing is not None else self.kinds

    def __str__(self) -> str:
        """``'3/6 Laplacian: [3, 4, 5]'``, or the kinds where there are others (or gates)."""
        if not self.plain:
            return f"head kinds {list(self.names)}"
        laplacian = [h for h, flag in enumerate(self.flags) if flag]
        return f"{len(laplacian)}/{self.num_heads} Laplacian: {laplacian}"


#: What the op's ``laplacian_heads`` accepts for one layer: k trailing Laplacian heads, a bool mask of length
#: num_heads (a sequence or a tensor), one kind per head (:data:`HEAD_KINDS`), or the layer's :class:`LayerHeads`.
HeadSpec = Union[int, Sequence[bool], Sequence[str], Tensor, LayerHeads]


def check_count(k: object, num_heads: int, where: str = "") -> int:
    """Validate one per-layer head count and return it as an int."""
    # bool is an int subclass; True would silently mean "1 head", which is never what the user meant.
    if isinstance(k, bool) or not isinstance(k, int):
        raise HeadSpecError(
            f"laplacian_heads{where}={k!r} is a {type(k).__name__}; allowed: an int from 0 to {num_heads}"
        )
    if not 0 <= k <= num_heads:
        raise HeadSpecError(f"laplacian_heads{where}={k} is out of range; allowed: 0 to {num_heads} (num_heads)")
    return k


def check_mask_tensor(mask: Tensor, num_heads: int) -> None:
    """Validate one layer's mask given as a tensor: bool, of shape (num_heads,)."""
    if mask.dtype != torch.bool or mask.shape != (num_heads,):
        raise HeadSpecError(
            f"laplacian_heads mask has dtype {mask.dtype} and shape {tuple(mask.shape)}; "
            f"allowed: a bool tensor of shape ({num_heads},) or an int from 0 to {num_heads}"
        )


_INT_RE = re.compile(r"^\s*\d+\s*$")


def _short(seq: Sequence) -> str:
    text = repr([x.tolist() if isinstance(x, Tensor) else x for x in seq])
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------------------------------------------
# Head kinds written as text (their vocabulary and arithmetic: lapheads.core.kinds)


_KIND_ITEM = re.compile(r"^[a-z-]+(:\d+)?(\+[a-z-]+:\d+)*$")


def _layer_heads(item: object, num_heads: int, where: str) -> LayerHeads:
    """One layer's heads from an int k, a kind name, "kind:k+kind:j" (the trailing heads, in that order; the rest
    ordinary), "a/b/c" (one per head), a ``LayerHeads``, or a sequence of names / bools / a bool tensor. Any kind
    may be written "gated-<kind>"."""
    allowed = (
        f"allowed: an int 0..{num_heads}, a kind ({', '.join(HEAD_KINDS)}; each but local and untied also as "
        f"{GATE_PREFIX}<kind>), kind:k[+kind:j] for the trailing heads, or {num_heads} kinds joined by '/'"
    )
    if isinstance(item, LayerHeads):
        if item.num_heads != num_heads:
            raise HeadSpecError(f"laplacian_heads{where} has {item.num_heads} heads; allowed: {num_heads}")
        return item
    if isinstance(item, Tensor):
        check_mask_tensor(item, num_heads)
        if item.device.type == "meta":  # no values to read: never guess them
            raise HeadSpecError(
                f"laplacian_heads{where} is a meta-device tensor, which holds no values; allowed: k or a mask"
            )
        return LayerHeads.of_flags(item.tolist())
    if isinstance(item, Sequence) and not isinstance(item, str):
        values = list(item)
        if values and all(isinstance(x, str) for x in values):
            item = "/".join(values)
        elif len(values) == num_heads and all(isinstance(x, bool) for x in values):
            return LayerHeads.of_flags(values)
        else:
            raise HeadSpecError(
                f"laplacian_heads{where} mask {_short(values)} is not {num_heads} bools; allowed: a bool sequence "
                f"of length {num_heads} or an int from 0 to {num_heads}"
            )
    if isinstance(item, int) and not isinstance(item, bool):
        k = check_count(item, num_heads, where)
        return LayerHeads(("ordinary",) * (num_heads - k) + ("laplacian",) * k)
    text = item.strip().lower() if isinstance(item, str) else None
    if text is None:
        raise HeadSpecError(f"laplacian_heads{where}={item!r} is a {type(item).__name__}; {allowed}")
    if _INT_RE.match(text):
        return _layer_heads(int(text), num_heads, where)
    if "/" in text:
        kinds = tuple(part.strip() for part in text.split("/"))
        if len(kinds) != num_heads:
            raise HeadSpecError(f"laplacian_heads{where}={item!r} names {len(kinds)} heads; {allowed}")
    elif _KIND_ITEM.match(text):
        if ":" not in text:
            kinds = (text,) * num_heads
        else:
            trailing = []
            for part in text.split("+"):
                kind, count = part.split(":")
                trailing += [kind] * int(count)
            if len(trailing) > num_heads:
                raise HeadSpecError(
                    f"laplacian_heads{where}={item!r} asks for {len(trailing)} heads of {num_heads}; {allowed}"
                )
            kinds = ("ordinary",) * (num_heads - len(trailing)) + tuple(trailing)
    else:
        raise HeadSpecError(f"laplacian_heads{where}={item!r} is not a head spec; {allowed}")
    unknown = sorted({k for k in kinds if k.removeprefix(GATE_PREFIX) not in HEAD_KINDS})
    if unknown:
        raise HeadSpecError(f"laplacian_heads{where}={item!r}: unknown kind {unknown[0]!r}; {allowed}")
    try:
        return LayerHeads.of_names(kinds)
    except HeadSpecError as err:
        raise HeadSpecError(f"laplacian_heads{where}={item!r}: {err}") from None


def parse_heads(spec: object, heads_per_layer: Sequence[int]) -> list[LayerHeads]:
    """Parse any head spec into each layer's heads: the one parser.

    Args:
        spec: one of
            * an int k: the trailing k heads of every layer are Laplacian ("kL" in the paper); ``"3"`` the same;
            * a kind name, every head of every layer: ``"mix"``, ``"negated"``; any kind but local and untied may
              be gated, ``"gated-laplacian"`` (each such head's output scaled by its own sigmoid gate);
            * ``"kind:k"`` or ``"kind:k+kind:j"``: the trailing heads of every layer, in that order, the rest
              ordinary (``"negated:3"``; ``"laplacian:1+local:1"``);
            * ``"a/b/c"``: one kind per head (``"ordinary/negated/laplacian"``);
            * a comma-separated list of such items, one per layer (``"0,2,2,0"``,
              ``"0,0,0,negated:3,negated:3,negated:3"``);
            * a sequence with one item per layer: ints, bool masks (sequences or tensors), kind lists or
              ``LayerHeads``; or a bool tensor of shape (num_layers, num_heads).
        heads_per_layer: each attention layer's number of (query) heads (Swin's stages differ). One item for all
            layers is read against each layer's own count.

    Returns:
        one :class:`LayerHeads` per layer.

    Raises:
        HeadSpecError: naming the bad value and what is allowed.
    """
    counts = list(heads_per_layer)
    num_layers = len(counts)
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise HeadSpecError("laplacian_heads is an empty string; allowed: an int, a kind or a per-layer list")
        items = [p.strip() for p in text.split(",")]
        if len(items) == num_layers and num_layers > 1:
            try:
                return [_layer_heads(item, n, f"[layer {i}]") for i, (item, n) in enumerate(zip(items, counts))]
            except HeadSpecError as err:  # name the whole spec the user wrote, then the bad item
                raise HeadSpecError(f"laplacian_heads={spec!r}: {err}") from None
        spec = items[0] if len(items) == 1 else items
    if isinstance(spec, Tensor) and spec.dim() != 1:  # a (layers, heads) bool tensor: its rows
        if spec.dtype != torch.bool or spec.dim() != 2:
            raise HeadSpecError(
                f"laplacian_heads tensor has dtype {spec.dtype} and shape {tuple(spec.shape)}; allowed: a bool "
                f"tensor of shape ({num_layers}, heads)"
            )
        spec = list(spec.unbind(0))
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        if len(spec) != num_layers:
            raise HeadSpecError(
                f"laplacian_heads has {len(spec)} entries {_short(spec)} but the model has {num_layers} layers; "
                "allowed: one item per layer, or one item for all"
            )
        # (a one-layer model, or a module setting its own heads, has no layer to name)
        return [
            _layer_heads(item, n, f"[layer {i}]" if num_layers > 1 else "")
            for i, (item, n) in enumerate(zip(spec, counts))
        ]
    if len(set(counts)) == 1:  # one value for all layers (frozen: shared safely)
        return [_layer_heads(spec, counts[0], "")] * num_layers
    return [_layer_heads(spec, n, f"[layer {i}]") for i, n in enumerate(counts)]
