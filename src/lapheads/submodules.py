"""A package's modules by attribute: ``lapheads.study.verdicts`` after ``import lapheads`` alone, as the docs write
them, without the package importing every module up front (which would load torch, timm or transformers for a name
that needs none of them)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


def submodule_getattr(package: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: a name that is one of its modules is imported on first use."""

    def __getattr__(name: str) -> Any:
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def public_getattr(package: str, public: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` whose public names live in its modules (``public``: name -> module,
    relative to the package): each is imported on first use, so importing the package (or one torch-free module of
    it) loads nothing else; any other name may be one of its modules (:func:`submodule_getattr`)."""
    modules = submodule_getattr(package)

    def __getattr__(name: str) -> Any:
        if name in public:
            return getattr(importlib.import_module(f"{package}.{public[name]}"), name)
        return modules(name)

    return __getattr__
