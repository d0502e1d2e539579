"""Models with Laplacian heads: timm ViTs (``vit``); more arrive with the LM and DINO pipelines."""

from lapheads.models.vit import create_vit

__all__ = ["create_vit"]
