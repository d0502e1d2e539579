"""Models with Laplacian heads: timm ViTs (``vit``) and the nanochat-style GPT (``gpt``)."""

from lapheads.models.gpt import GPT, GPTConfig
from lapheads.models.vit import create_vit

__all__ = ["GPT", "GPTConfig", "create_vit"]
