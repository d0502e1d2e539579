"""``lapheads.hf``: the public name of the Hugging Face transformers integration (:mod:`lapheads.integrations.hf`).

Importing it registers lapheads' attention implementation with transformers, so ``import lapheads.hf`` is all a
pipeline or lm-eval's "hf" model needs to load a saved model with Laplacian heads.
"""

from lapheads.integrations.hf import (
    NAME,
    BlendSchedule,
    attention_modules,
    enable,
    from_pretrained,
    register,
    set_blend,
)

__all__ = ["BlendSchedule", "NAME", "attention_modules", "enable", "from_pretrained", "register", "set_blend"]
