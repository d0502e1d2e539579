"""Capture the residual stream of a lapheads model, batch by batch, with forward hooks.

Layers are named ``embed`` (the input of the first block: embeddings plus positions), ``1`` .. ``L`` (the output
of each block) and ``norm`` (the output of the final norm), in that order. Any model with a ``blocks`` list
(ModuleList or Sequential) and a ``norm`` module works: timm Vision Transformers (so every ``create_vit`` model)
and ``lapheads.GPT``. Each forward pass overwrites the captured tensors, so a caller that consumes them per batch holds
one batch of tokens at a time, never the whole dataset.
"""

from __future__ import annotations

import torch

from lapheads.errors import InputError

__all__ = ["ResidualStream", "layer_names", "select_layers"]


def _blocks(model: torch.nn.Module) -> torch.nn.Module:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential)) or len(blocks) == 0:
        raise InputError(f"{type(model).__name__} has no `blocks` list of modules; allowed: timm ViTs and lapheads.GPT")
    return blocks


def layer_names(model: torch.nn.Module) -> list[str]:
    """All capturable layers of ``model``: embed, 1..L, norm (when the model has a final norm)."""
    names = ["embed", *(str(i + 1) for i in range(len(_blocks(model))))]
    return names + ["norm"] if isinstance(getattr(model, "norm", None), torch.nn.Module) else names


def select_layers(model: torch.nn.Module, spec: str = "all") -> list[str]:
    """Layers named by ``spec``: "all", or a comma list of names/indices such as "embed,3,6,norm"."""
    available = layer_names(model)
    if spec in ("all", "", None):
        return available
    chosen = [part.strip() for part in str(spec).split(",") if part.strip()]
    unknown = [name for name in chosen if name not in available]
    if unknown or not chosen:
        raise InputError(
            f"unknown layers {', '.join(unknown) or repr(spec)}; allowed: all, or a comma list of "
            f"{', '.join(available)}"
        )
    return [name for name in available if name in chosen]


class ResidualStream:
    """Context manager: while active, every forward of ``model`` fills ``self.tokens[layer]`` with (B, T, D).

    Args:
        model: a model with ``blocks`` (and ``norm``).
        layers: names from :func:`layer_names` (default: all).
        head_input: also capture the classifier's input (the pooled pre-logits vector) as ``self.head_input``,
            when the model has a ``head`` module.
    """

    def __init__(self, model: torch.nn.Module, layers: list[str] | None = None, head_input: bool = False) -> None:
        self.model = model
        self.layers = layers or layer_names(model)
        self.head_input_wanted = head_input
        self.tokens: dict[str, torch.Tensor] = {}
        self.head_input: torch.Tensor | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _store(self, name: str):
        def hook(_module, _inputs, output):
            self.tokens[name] = output.detach()

        return hook

    def __enter__(self) -> "ResidualStream":
        blocks = _blocks(self.model)
        if "embed" in self.layers:
            self._handles.append(
                blocks[0].register_forward_pre_hook(
                    lambda _m, inputs: self.tokens.__setitem__("embed", inputs[0].detach())
                )
            )
        for i, block in enumerate(blocks):
            if str(i + 1) in self.layers:
                self._handles.append(block.register_forward_hook(self._store(str(i + 1))))
        if "norm" in self.layers:
            self._handles.append(self.model.norm.register_forward_hook(self._store("norm")))
        head = getattr(self.model, "head", None)
        if self.head_input_wanted and isinstance(head, torch.nn.Module):
            self._handles.append(
                head.register_forward_pre_hook(lambda _m, inputs: setattr(self, "head_input", inputs[0].detach()))
            )
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
