"""Converting a pretrained model's heads to Laplacian heads: the initialisations shared by timm ViTs
(:func:`lapheads.create_vit`) and Hugging Face models (:mod:`lapheads.integrations.hf`).

* ``"switch"``: the chosen heads output V - P V from the start (their output changes).
* ``"signflip"``: also negate those heads' columns of the output projection W_O, so W_O P V is kept exactly and
  only -W_O V is added.
* ``"blend"``: the heads output lambda V + (1 - 2 lambda) P V (the op's ``blend``), lambda a buffer starting at 0 -
  exactly the pretrained function - and moved to 1 by :class:`BlendSchedule` / :func:`set_blend` while fine-tuning.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lapheads.errors import InputError

__all__ = ["INITS", "BlendSchedule", "attention_modules", "init_heads", "set_blend"]

INITS = ("switch", "signflip", "blend")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The innermost modules whose class name ends in "Attention", in layer order (one per layer)."""
    found = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    return [m for m in found if not any(c is not m and type(c).__name__.endswith("Attention") for c in m.modules())]


def init_heads(
    module: nn.Module,
    mask: torch.Tensor,
    init: str,
    output_columns: Callable[[int], tuple[torch.Tensor, slice, int]] | None = None,
) -> None:
    """Apply ``init`` to one attention module whose Laplacian heads are ``mask``.

    Args:
        output_columns: head -> (weight, slice, axis) of that head's input channels in the output projection
            (needed by "signflip").
    """
    if init not in INITS:
        raise InputError(f"init={init!r}; allowed: {', '.join(INITS)}")
    device = mask.device
    if init == "blend":
        module.register_buffer("laplacian_blend", torch.zeros((), device=device), persistent=False)
    elif "laplacian_blend" in module._buffers:
        del module._buffers["laplacian_blend"]
    if init == "signflip":
        if output_columns is None:
            raise InputError(
                f"init='signflip' does not know the output projection of {type(module).__name__}; "
                "allowed: init='switch' or 'blend'"
            )
        with torch.no_grad():
            for head in torch.nonzero(mask.cpu()).flatten().tolist():
                weight, cols, axis = output_columns(head)
                weight[:, cols].neg_() if axis == 1 else weight[cols].neg_()


def set_blend(model: nn.Module, value: float) -> None:
    """Set lambda of every Laplacian head converted with ``init="blend"`` (0: plain attention, 1: V - P V)."""
    if not 0.0 <= value <= 1.0:
        raise InputError(f"blend {value}; allowed: a number in [0, 1]")
    buffers = [m.laplacian_blend for m in attention_modules(model) if getattr(m, "laplacian_blend", None) is not None]
    if not buffers:
        raise InputError("the model was not converted with init='blend'")
    for buffer in buffers:
        buffer.fill_(value)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "laplacian_heads"):  # a transformers model: saved with the weights
        config.laplacian_blend = float(value)


class BlendSchedule:
    """lambda rising linearly from 0 to 1 over ``steps`` optimizer steps: call ``schedule(step)`` each step."""

    def __init__(self, model: nn.Module, steps: int) -> None:
        if steps < 1:
            raise InputError(f"BlendSchedule steps {steps}; allowed: >= 1")
        self.model, self.steps = model, steps

    def __call__(self, step: int) -> float:
        value = min(max(step / self.steps, 0.0), 1.0)
        set_blend(self.model, value)
        return value
