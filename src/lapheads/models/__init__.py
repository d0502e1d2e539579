"""Models with Laplacian heads: timm ViTs (``vit``), timm's EVA and Swin converted (``eva``, ``swin``), the nanochat
GPT (``gpt``) and nanochat checkpoints (``nanochat``).

Each name is imported when first used (module ``__getattr__``), so the GPT (and ``lapheads train lm --help``) loads
without timm. lapheads' timm names (``deit3_small_3L_patch16_224``, EVA-02, Swin) register as timm loads (see
lapheads/__init__.py): whichever of ``vit``, ``eva`` and ``swin`` is imported first, the three families register
together (``vit`` imports the other two; ``eva`` or ``swin`` whose import loaded timm has ``vit`` imported once it is
whole, through its ``WHEN_LOADED``); ``registry`` imports timm only when used."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the public names, for readers and type checkers; at run time __getattr__ imports them on use
    from lapheads.models.gpt import GPT, GPTConfig
    from lapheads.models.nanochat import load_nanochat
    from lapheads.models.vit import create_vit

#: each public name's module
_PUBLIC = {"GPT": "gpt", "GPTConfig": "gpt", "create_vit": "vit", "load_nanochat": "nanochat"}

__all__ = ["GPT", "GPTConfig", "create_vit", "load_nanochat"]


def __getattr__(name: str):
    """A public name from its module, or one of the package's modules by attribute (``lapheads.models.eva``)."""
    import importlib

    from lapheads.submodules import submodule_getattr

    if name in _PUBLIC:
        return getattr(importlib.import_module(f"lapheads.models.{_PUBLIC[name]}"), name)
    return submodule_getattr(__name__)(name)
