"""Models with Laplacian heads: timm ViTs (``vit``), the nanochat GPT (``gpt``) and nanochat checkpoints
(``nanochat``)."""

from lapheads.models.gpt import GPT, GPTConfig
from lapheads.models.nanochat import load_nanochat
from lapheads.models.vit import create_vit

__all__ = ["GPT", "GPTConfig", "create_vit", "load_nanochat"]
