"""The one head-spec parser: which heads of which layer are Laplacian, or of another head kind.

Every model, config, sweep and integration reads head specs through this module, so a spec means the same thing
and fails with the same one-line error everywhere. Design choices:

* **Trailing heads.** An integer k makes the *last* k heads of every layer Laplacian, the paper's convention.
* **One grammar, two readers.** ``parse_head_kinds`` turns every written spec (an int k, "0,2,2,0" per layer, a
  kind name, "kind:k+kind:j", "a/b/c" per head, per-layer lists, bool masks) into each layer's head kinds;
  ``parse_laplacian_heads`` reads its Laplacian heads from it and refuses kinds a model cannot run.
  :data:`HEAD_SPEC_PATTERN` is that grammar as text, so a config can be checked before a model exists
  (:data:`HEAD_SPEC`), and :func:`parse_spec_arms` splits a sweep's arms with it.
* **Masks are host truth.** A parsed mask is a CPU bool tensor; handed back in, it is accepted as it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Union

import torch
from torch import Tensor

from lapheads.config import Domain
from lapheads.core.kinds import HEAD_KINDS
from lapheads.errors import LapheadsError

__all__ = [
    "HEAD_SPEC",
    "HEAD_SPEC_PATTERN",
    "HeadSpec",
    "HeadSpecError",
    "check_count",
    "check_mask_tensor",
    "format_head_mask",
    "kind_tuple",
    "laplacian_head_mask",
    "parse_head_kinds",
    "parse_head_kinds_per_layer",
    "parse_laplacian_heads",
    "parse_spec_arms",
    "trailing_count",
]

#: What ``laplacian_heads`` accepts for one layer: k trailing heads, or a bool mask of length num_heads.
HeadSpec = Union[int, Sequence[bool], Tensor]


class HeadSpecError(LapheadsError, ValueError):
    """A Laplacian-head spec that cannot be applied; the message names the value and what is allowed."""


# ----------------------------------------------------------------------------------------------------------------
# Head specs


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
    if mask.dtype != torch.bool or mask.shape != (num_heads,):
        raise HeadSpecError(
            f"laplacian_heads mask has dtype {mask.dtype} and shape {tuple(mask.shape)}; "
            f"allowed: a bool tensor of shape ({num_heads},) or an int from 0 to {num_heads}"
        )


def laplacian_head_mask(laplacian_heads: HeadSpec, num_heads: int) -> Tensor:
    """Turn one layer's spec into a bool mask of shape (num_heads,), True for Laplacian heads.

    Args:
        laplacian_heads: an int k (the trailing k heads are Laplacian) or a bool tensor / sequence of length
            num_heads.
        num_heads: the layer's number of (query) heads.

    Returns:
        A bool CPU tensor of shape (num_heads,).
    """
    if isinstance(laplacian_heads, Tensor):
        check_mask_tensor(laplacian_heads, num_heads)
        return laplacian_heads.detach().to("cpu").clone()
    if isinstance(laplacian_heads, Sequence) and not isinstance(laplacian_heads, str):
        if len(laplacian_heads) != num_heads or not all(isinstance(b, bool) for b in laplacian_heads):
            raise HeadSpecError(
                f"laplacian_heads mask {list(laplacian_heads)!r} is not {num_heads} bools; "
                f"allowed: a bool sequence of length {num_heads} or an int from 0 to {num_heads}"
            )
        return torch.tensor(list(laplacian_heads), dtype=torch.bool, device="cpu")
    k = check_count(laplacian_heads, num_heads)
    # Explicitly on the CPU: under ``with torch.device("meta")`` a mask must still hold its values.
    mask = torch.zeros(num_heads, dtype=torch.bool, device="cpu")
    mask[num_heads - k :] = True
    return mask


_INT_RE = re.compile(r"^\s*\d+\s*$")


def parse_laplacian_heads(spec: object, num_heads: int, num_layers: int) -> list[Tensor]:
    """Parse any Laplacian-head spec into one bool mask per layer.

    Args:
        spec: one of
            * an int k: the trailing k heads of every layer are Laplacian ("kL" in the paper);
            * a string: ``"3"`` (same as 3) or a comma-separated per-layer list ``"0,2,2,0"``;
            * a sequence of ints, one per layer;
            * a sequence of per-layer masks (bool sequences or tensors of length num_heads), or a bool tensor of
              shape (num_layers, num_heads).
        num_heads: heads per layer.
        num_layers: number of attention layers.

    Returns:
        ``num_layers`` bool tensors of shape (num_heads,).

    Raises:
        HeadSpecError: naming the bad value and what is allowed.
    """
    if isinstance(spec, str) and re.search("[a-zA-Z]", spec):  # head kinds: their Laplacian heads
        layers = parse_head_kinds(spec, num_heads, num_layers)
        others = sorted({kind for kinds in layers for kind in kinds} - {"ordinary", "laplacian"})
        if others:  # never drop a kind silently where a model can only tell ordinary from Laplacian heads
            raise HeadSpecError(
                f"laplacian_heads={spec!r} names head kinds ({', '.join(others)}) this model cannot run; allowed "
                "here: ordinary and Laplacian heads (the other kinds: lapheads' timm ViTs, create_vit)"
            )
        return [torch.tensor([kind == "laplacian" for kind in kinds]) for kinds in layers]
    allowed = (
        f"allowed: an int 0..{num_heads}, a comma-separated list of {num_layers} such ints (e.g. "
        f"{','.join(['0'] * min(num_layers, 4))}{',...' if num_layers > 4 else ''}), or {num_layers} bool masks "
        f"of length {num_heads}"
    )
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise HeadSpecError(f"laplacian_heads is an empty string; {allowed}")
        parts = text.split(",")
        if not all(_INT_RE.match(p) for p in parts):
            raise HeadSpecError(f"laplacian_heads={spec!r} is not an int or a comma-separated int list; {allowed}")
        counts = [int(p) for p in parts]
        spec = counts[0] if len(counts) == 1 else counts
    spec = _per_layer(spec, num_heads, num_layers, allowed)
    if isinstance(spec, Sequence):
        masks = []
        for layer, item in enumerate(spec):
            if isinstance(item, (Tensor, Sequence)) and not isinstance(item, str):
                masks.append(laplacian_head_mask(item, num_heads))
            else:
                masks.append(laplacian_head_mask(check_count(item, num_heads, f"[layer {layer}]"), num_heads))
        return masks
    if isinstance(spec, bool) or not isinstance(spec, int):
        raise HeadSpecError(f"laplacian_heads={spec!r} is a {type(spec).__name__}; {allowed}")
    mask = laplacian_head_mask(check_count(spec, num_heads), num_heads)
    return [mask.clone() for _ in range(num_layers)]


def _per_layer(spec: object, num_heads: int, num_layers: int, allowed: str) -> object:
    """A (layers, heads) bool tensor as a list of rows; a sequence of the wrong length refused; else ``spec``."""
    if isinstance(spec, Tensor):
        if spec.dtype != torch.bool or spec.dim() != 2:
            raise HeadSpecError(
                f"laplacian_heads tensor has dtype {spec.dtype} and shape {tuple(spec.shape)}; "
                f"allowed: a bool tensor of shape ({num_layers}, {num_heads})"
            )
        spec = list(spec.unbind(0))
    if isinstance(spec, Sequence) and not isinstance(spec, str) and len(spec) != num_layers:
        raise HeadSpecError(
            f"laplacian_heads has {len(spec)} entries {_short(spec)} but the model has {num_layers} layers; {allowed}"
        )
    return spec


def _short(seq: Sequence) -> str:
    text = repr([x.tolist() if isinstance(x, Tensor) else x for x in seq])
    return text if len(text) <= 60 else text[:57] + "..."


def trailing_count(mask: Tensor) -> int | None:
    """k when a host mask makes exactly the trailing k heads Laplacian (what the op takes as an int, with no
    device work per call), else None."""
    k = int(mask.sum())
    return k if bool(mask[len(mask) - k :].all()) else None


def format_head_mask(mask: Tensor) -> str:
    """Human-readable head mask, e.g. ``'3/6 Laplacian: [3, 4, 5]'``."""
    idx = mask.nonzero().flatten().tolist()
    return f"{len(idx)}/{mask.numel()} Laplacian: {idx}"


# ----------------------------------------------------------------------------------------------------------------
# Head kinds written as text (their vocabulary and arithmetic: lapheads.core.kinds)


_KIND_ITEM = re.compile(r"^[a-z]+(:\d+)?(\+[a-z]+:\d+)*$")
_KIND_NAME = "(" + "|".join(HEAD_KINDS) + ")"
_SPEC_ITEM = rf"\s*(\d+|{_KIND_NAME}(:\d+)?(\+{_KIND_NAME}:\d+)*|{_KIND_NAME}(/{_KIND_NAME})+)\s*"
#: The written form of every head spec ``parse_head_kinds`` reads as text: items (a k, a kind, kind:k+kind:j or
#: kind/kind/...) separated by commas. Configs check it before a model exists; the counts are checked at build.
HEAD_SPEC_PATTERN = re.compile(rf"{_SPEC_ITEM}(,{_SPEC_ITEM})*")


def _layer_kinds(item: object, num_heads: int, where: str) -> tuple[str, ...]:
    """One layer's kinds from an int k, a kind name, "kind:k+kind:j" (the trailing heads, in that order; the rest
    ordinary), "a/b/c" (one per head), or a sequence of names / bools."""
    allowed = (
        f"allowed: an int 0..{num_heads}, a kind ({', '.join(HEAD_KINDS)}), kind:k[+kind:j] for the trailing "
        f"heads, or {num_heads} kinds joined by '/'"
    )
    if isinstance(item, (Tensor, Sequence)) and not isinstance(item, str):
        values = list(item.tolist() if isinstance(item, Tensor) else item)
        if values and all(isinstance(x, str) for x in values):
            item = "/".join(values)
        else:
            return tuple("laplacian" if m else "ordinary" for m in laplacian_head_mask(item, num_heads).tolist())
    if isinstance(item, int) and not isinstance(item, bool):
        k = check_count(item, num_heads, where)
        return ("ordinary",) * (num_heads - k) + ("laplacian",) * k
    text = str(item).strip().lower() if isinstance(item, str) else None
    if text is None:
        raise HeadSpecError(f"laplacian_heads{where}={item!r} is a {type(item).__name__}; {allowed}")
    if _INT_RE.match(text):
        return _layer_kinds(int(text), num_heads, where)
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
    unknown = sorted({k for k in kinds if k not in HEAD_KINDS})
    if unknown:
        raise HeadSpecError(f"laplacian_heads{where}={item!r}: unknown kind {unknown[0]!r}; {allowed}")
    return kinds


def parse_head_kinds(spec: object, num_heads: int, num_layers: int) -> list[tuple[str, ...]]:
    """Parse any head spec into each layer's head kinds (the one parser: ``parse_laplacian_heads`` reads its
    Laplacian heads from this).

    Args:
        spec: everything ``parse_laplacian_heads`` accepts (an int k, "0,2,2,0", per-layer ints or masks), and kinds:
            * a kind name, every head of every layer: ``"mix"``, ``"negated"``;
            * ``"kind:k"`` or ``"kind:k+kind:j"``: the trailing heads of every layer, in that order, the rest
              ordinary (``"negated:3"``; ``"laplacian:1+local:1"``);
            * ``"a/b/c"``: one kind per head (``"ordinary/negated/laplacian"``);
            * a comma-separated list of such items, one per layer (``"0,0,0,negated:3,negated:3,negated:3"``), or a
              sequence of per-layer items (names, masks or kind lists).
        num_heads: heads per layer.
        num_layers: attention layers.

    Returns:
        ``num_layers`` tuples of ``num_heads`` kinds.

    Raises:
        HeadSpecError: naming the bad value and what is allowed.
    """
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise HeadSpecError("laplacian_heads is an empty string; allowed: an int, a kind or a per-layer list")
        items = [p.strip() for p in text.split(",")]
        if len(items) == 1:
            return [_layer_kinds(items[0], num_heads, "")] * num_layers
        if len(items) == num_layers:
            try:
                return [_layer_kinds(item, num_heads, f"[layer {i}]") for i, item in enumerate(items)]
            except HeadSpecError as err:  # name the whole spec the user wrote, then the bad item
                raise HeadSpecError(f"laplacian_heads={spec!r}: {err}") from None
        spec = items
    spec = _per_layer(spec, num_heads, num_layers, "allowed: one item per layer, or one item for all")
    if isinstance(spec, Sequence):
        return [_layer_kinds(item, num_heads, f"[layer {i}]") for i, item in enumerate(spec)]
    return [_layer_kinds(spec, num_heads, "")] * num_layers


def parse_head_kinds_per_layer(spec: object, heads_per_layer: Sequence[int]) -> list[tuple[str, ...]]:
    """:func:`parse_head_kinds` for models whose layers have different numbers of heads (Swin's stages): one item
    for every layer is read against each layer's own head count; one item per layer against that layer's."""
    num_layers = len(heads_per_layer)
    if len(set(heads_per_layer)) == 1:
        return parse_head_kinds(spec, heads_per_layer[0], num_layers)
    if isinstance(spec, str):
        items = [p.strip() for p in spec.strip().split(",")]
        spec = items[0] if len(items) == 1 else items
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        if len(spec) != num_layers:
            raise HeadSpecError(
                f"laplacian_heads has {len(spec)} entries {_short(spec)} but the model has {num_layers} layers; "
                "allowed: one item per layer, or one item for all"
            )
        return [_layer_kinds(item, heads, f"[layer {i}]") for i, (item, heads) in enumerate(zip(spec, heads_per_layer))]
    return [_layer_kinds(spec, heads, f"[layer {i}]") for i, heads in enumerate(heads_per_layer)]


def kind_tuple(kinds: Sequence[str], num_heads: int) -> tuple[str, ...]:
    """``kinds`` as a tuple, if it names ``num_heads`` known kinds."""
    kinds = tuple(kinds)
    if len(kinds) != num_heads or any(kind not in HEAD_KINDS for kind in kinds):
        raise HeadSpecError(f"head kinds {list(kinds)!r}; allowed: {num_heads} of {', '.join(HEAD_KINDS)}")
    return kinds


#: ``--laplacian-heads`` in a config: k, one k per layer ("0,2,2,0"), or head kinds ("negated:3", "mix",
#: "ordinary/negated/laplacian", per layer too); the counts are checked against the model when it is built
HEAD_SPEC = Domain(
    "k, a comma list of per-layer k (3 or 0,2,2,0), or head kinds (negated:3, mix, ordinary/negated/laplacian; "
    "kinds: " + ", ".join(HEAD_KINDS) + ")",
    lambda v: bool(HEAD_SPEC_PATTERN.fullmatch(v)),
)


def parse_spec_arms(text: str) -> list[str]:
    """A sweep's arms: "0,1,3,6" -> ["0", "1", "3", "6"]; "0;2,2,0,0" -> ["0", "2,2,0,0"] (per-layer specs need
    ";"); head kinds: "0;3;negated:3;mix" -> ["0", "3", "negated:3", "mix"]. Each arm is one written spec."""
    plain_ks = re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", text) is not None
    items = [item.strip() for item in (text.split(";") if ";" in text or not plain_ks else text.split(","))]
    bad = [item for item in items if not HEAD_SPEC_PATTERN.fullmatch(item)]
    if not text.strip() or bad:
        raise HeadSpecError(
            f"malformed --laplacian-heads {text!r}; allowed: k values like 0,1,3,6, or specs separated by ';' "
            "like 0;2,2,0,0 or 0;3;negated:3;mix (head kinds)"
        )
    if len(set(items)) < len(items):
        raise HeadSpecError(f"--laplacian-heads {text!r} repeats a spec")
    return items
