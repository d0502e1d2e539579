"""Old import paths of modules that moved into the layered folders (docs/design.md, "Layers"), kept working.

``import lapheads.attention`` (or ``from lapheads.hf import enable``) still works and gives the module object at its
new home itself, so ``monkeypatch`` and ``isinstance`` see one module, not a copy. A meta-path finder serves the
old names from :data:`MOVED`; nothing in lapheads itself imports an old name (tests/test_architecture.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old module name -> its home now
MOVED = {
    "lapheads.attention": "lapheads.core",
    "lapheads.convert": "lapheads.core.convert",
    "lapheads.hf": "lapheads.integrations.hf",  # the short name stays the documented one
    "lapheads.tracking": "lapheads.integrations.tracking",
    "lapheads.chat": "lapheads.apps.chat",
    "lapheads.serve": "lapheads.apps.serve",
    "lapheads.lora": "lapheads.models.lora",
    "lapheads.analyze": "lapheads.study.analyze",
    "lapheads.sweep": "lapheads.study.sweep",
    "lapheads.demo": "lapheads.study.demo",
    "lapheads.mix": "lapheads.study.mix",
    "lapheads.verdicts": "lapheads.study.verdicts",
    "lapheads.report": "lapheads.study.report",
    "lapheads.presets": "lapheads.tasks.presets",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of moved modules and loads them as the moved module."""

    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return importlib.import_module(MOVED[spec.name])  # the module itself: one object under both names

    def exec_module(self, module) -> None:  # type: ignore[no-untyped-def]
        pass  # already executed at its new home


def install() -> None:
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
