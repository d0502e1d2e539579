"""Models with Laplacian heads: timm ViTs (``vit``), timm's EVA and Swin converted (``eva``, ``swin``), the nanochat
GPT (``gpt``) and nanochat checkpoints (``nanochat``). Importing it registers lapheads' timm names."""

from lapheads.models import eva, swin  # noqa: F401 - registers eva02_tiny_kL_* and swin_tiny_kL_* with timm
from lapheads.models.gpt import GPT, GPTConfig
from lapheads.models.nanochat import load_nanochat
from lapheads.models.vit import create_vit

__all__ = ["GPT", "GPTConfig", "create_vit", "load_nanochat"]
