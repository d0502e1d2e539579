"""lapheads: Laplacian heads for transformers (Zhang & Papyan, arXiv 2602.09297).

A Laplacian head outputs (I - P) V = V - P V instead of P V. This package provides the op
(:func:`laplacian_attention`), a drop-in for ``timm.layers.Attention`` (:class:`LaplacianAttention`) and the one
head-spec parser every model and the CLI share (:func:`parse_heads`, one :class:`LayerHeads` per layer); models are
timm ViTs (:func:`create_vit`) and a nanochat-style GPT (:class:`GPT`).
"""

import os as _os
import sys as _sys
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from lapheads.log import configure_library as _configure_logging

_configure_logging()  # lapheads' messages: warnings for a library user, everything for the command (lapheads.log)

_COMMAND = bool(_sys.argv) and _os.path.basename(_sys.argv[0]) in ("lapheads", "-m")
# `lapheads`, `lapheads --help` and `lapheads --version` answer from the parser alone: no torch, no busy probe
_ANSWERS_ALONE = _COMMAND and (_sys.argv[1:] in ([], ["-h"], ["--help"], ["--version"]))

# The lapheads command (not a library import) picks its threads and OpenMP wait policy from the free CPUs, which
# only takes effect before torch loads OpenMP: see lapheads.hardware.
if _COMMAND and not _ANSWERS_ALONE and "torch" not in _sys.modules:
    from lapheads.hardware import apply_cli_thread_policy

    apply_cli_thread_policy(_sys.argv[1:])

if TYPE_CHECKING:  # the public names, for readers and type checkers; at run time __getattr__ imports them on use
    from lapheads.core import (
        HeadSpec,
        HeadSpecError,
        LaplacianAttention,
        LayerHeads,
        laplacian_attention,
        laplacian_attention_reference,
        parse_heads,
    )
    from lapheads.log import enable_propagation, get_verbosity, set_verbosity
    from lapheads.models import GPT, GPTConfig, create_vit, load_nanochat

_PUBLIC = {
    "HeadSpec": "lapheads.core",
    "HeadSpecError": "lapheads.core",
    "LaplacianAttention": "lapheads.core",
    "laplacian_attention": "lapheads.core",
    "laplacian_attention_reference": "lapheads.core",
    "LayerHeads": "lapheads.core",
    "parse_heads": "lapheads.core",
    "GPT": "lapheads.models",
    "GPTConfig": "lapheads.models",
    "create_vit": "lapheads.models",
    "load_nanochat": "lapheads.models",
    "set_verbosity": "lapheads.log",
    "get_verbosity": "lapheads.log",
    "enable_propagation": "lapheads.log",
}


def __getattr__(name: str):
    """The public names, imported when first used: ``import lapheads`` alone loads neither torch's model stack nor
    timm and torchvision (issue 61: 5.2 s before); ``lapheads.GPT`` or ``from lapheads import create_vit`` loads
    what that name needs, and a subpackage named by attribute (``lapheads.runs.load_model`` after ``import
    lapheads``) is imported on that use."""
    import importlib

    from lapheads.submodules import submodule_getattr

    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    return submodule_getattr("lapheads")(name)  # a subpackage used by attribute: lapheads.runs.load_model


class _RegisterWithTimm:
    """lapheads' timm names (``deit3_small_3L_patch16_224``, EVA-02, Swin) resolve in ``timm.create_model`` as soon as
    timm is imported, whichever is imported first, without ``import lapheads`` importing timm: registered right
    away where timm is loaded already, else as timm finishes loading (a one-shot finder on ``sys.meta_path``)."""

    looking = False  # while the real finders are asked for timm: this one answers nothing

    def find_spec(self, name, path=None, target=None):  # importlib.abc.MetaPathFinder
        if name != "timm" or self.looking:
            return None
        import importlib.util

        self.looking = True
        try:
            spec = importlib.util.find_spec("timm")  # the real finders' spec
        finally:
            self.looking = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            # only an import executes a module: a probe (transformers' is_timm_available asks find_spec("timm")
            # and imports nothing) leaves this finder in place for the real import
            if self in _sys.meta_path:
                _sys.meta_path.remove(self)
            exec_module(module)
            # a lapheads module whose own import loaded timm must be whole before the names register (registering
            # imports it): the outermost such import (sys.modules keeps import order) runs it when it is done
            waiting = [m for n, m in list(_sys.modules.items()) if n in _WAIT_FOR_ME and _is_initializing(m)]
            if waiting:
                waiting[0].WHEN_LOADED.append(_register_timm_names)
            elif not _is_initializing(_sys.modules.get("lapheads.models.vit")):  # vit registers every name itself
                _register_timm_names()

        loader.exec_module = exec_then_register
        return spec


#: the modules that import timm and keep a WHEN_LOADED list (the timm drop-in, the converted EVA and Swin)
_WAIT_FOR_ME = ("lapheads.core.modules", "lapheads.models.eva", "lapheads.models.swin")


def _is_initializing(module) -> bool:
    """Whether ``module`` is being imported now (partly executed)."""
    return getattr(getattr(module, "__spec__", None), "_initializing", False)


def _register_timm_names() -> None:
    import lapheads.models.vit  # noqa: F401 - it and the two modules it imports register the names with timm


if not _ANSWERS_ALONE:
    if "timm" in _sys.modules:
        _register_timm_names()
    elif not any(isinstance(f, _RegisterWithTimm) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _RegisterWithTimm())


try:
    __version__ = version("lapheads")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "GPT",
    "GPTConfig",
    "HeadSpec",
    "HeadSpecError",
    "LaplacianAttention",
    "LayerHeads",
    "__version__",
    "create_vit",
    "enable_propagation",
    "get_verbosity",
    "laplacian_attention",
    "laplacian_attention_reference",
    "load_nanochat",
    "parse_heads",
    "set_verbosity",
]
