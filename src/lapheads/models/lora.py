"""LoRA adapters on a lapheads model through peft, and the adapters as a module of their own.

Checkpoints of a LoRA run hold only the adapter weights (:class:`LoraAdapters`), so a run's folder stays small and
the base it was trained on is recorded, not copied (``lapheads.runs.load_model`` rebuilds base + adapters).
"""

from __future__ import annotations

import torch

from lapheads.errors import CheckpointError, InputError

__all__ = ["LoraAdapters", "apply_lora"]


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float, targets: str) -> torch.nn.Module:
    """``model`` wrapped by peft with LoRA adapters of ``rank`` on the modules named in ``targets`` (comma list)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise InputError("--lora-rank needs peft; allowed: pip install 'lapheads[chat]'") from None
    names = [t.strip() for t in targets.split(",")]
    return get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=names, bias="none")
    )


class LoraAdapters(torch.nn.Module):
    """The adapter weights of a peft model as a module of their own, so checkpoints hold only them."""

    def __init__(self, peft_model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "peft_model", peft_model)  # not a submodule: its base weights are not ours

    def named_parameters(self, *args, **kwargs):
        return ((n, p) for n, p in self.peft_model.named_parameters() if "lora_" in n)

    def parameters(self, recurse: bool = True):
        return (p for _, p in self.named_parameters())

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.peft_model.state_dict().items() if "lora_" in n}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing = set(self.state_dict()) ^ set(state_dict)
        if missing:
            raise CheckpointError(
                f"adapter weights do not match the model ({len(missing)} keys differ, e.g. {sorted(missing)[0]})"
            )
        return self.peft_model.load_state_dict(state_dict, strict=False)
