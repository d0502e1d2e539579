"""Configs: plain dataclasses, resolved from a preset, a preset file and ``--key value`` overrides.

No exec-based configs: a preset is a dataclass instance in ``lapheads.presets`` or a JSON file holding a subset of
the fields; overrides are typed by the dataclass fields, and an unknown key or a bad value is a one-line error.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from lapheads.errors import LapheadsError

__all__ = ["ConfigError", "apply_overrides", "config_from_dict", "load_preset_file"]

C = TypeVar("C")


class ConfigError(LapheadsError, ValueError):
    """A bad preset, key or value; the message names it and what is allowed."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(key: str, text: str, annotation: Any) -> Any:
    """Parse a command-line string into the field's type."""
    origin = typing.get_origin(annotation)
    options = typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)
    if type(None) in options and text.lower() in ("none", "null"):
        return None
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            if option is bool:
                if text.lower() in ("1", "true", "yes", "on"):
                    return True
                if text.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError("not a boolean")
            if option in (int, float, str):
                return option(text)
            if option is dict or typing.get_origin(option) is dict:
                value = json.loads(text)
                if not isinstance(value, dict):
                    raise ValueError("not a JSON object")
                return value
            if option in (list, tuple) or typing.get_origin(option) in (list, tuple):
                items = json.loads(text) if text.startswith("[") else [p.strip() for p in text.split(",")]
                element = (typing.get_args(option) or (None,))[0]
                return [element(item) for item in items] if element in (int, float, str) else items
        except ValueError as err:
            errors.append(str(err))
    raise ConfigError(f"--{key.replace('_', '-')}={text!r} is not a valid {annotation}")


def config_from_dict(cls: type[C], data: dict[str, Any], base: C | None = None, source: str = "config") -> C:
    """A ``cls`` instance from ``base`` (or defaults) updated by ``data``; unknown keys are an error."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(types_))}")
    base = base if base is not None else cls()
    return dataclasses.replace(base, **data)


def load_preset_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON preset file (a dict of config fields)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read preset file {path}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"preset file {path} must hold a JSON object of config fields, got {type(data).__name__}")
    return data


def apply_overrides(config: C, pairs: list[str]) -> C:
    """Apply ``["--lr", "1e-3", "--epochs=2", ...]`` to a dataclass config, typed by its fields."""
    types_ = _field_types(type(config))
    updates: dict[str, Any] = {}
    i = 0
    while i < len(pairs):
        item = pairs[i]
        if not item.startswith("--"):
            raise ConfigError(f"unexpected argument {item!r}; overrides look like --key value or --key=value")
        key, eq, value = item[2:].partition("=")
        key = key.replace("-", "_")
        if key not in types_:
            raise ConfigError(f"unknown option --{key.replace('_', '-')}; allowed: "
                              + ", ".join("--" + k.replace("_", "-") for k in sorted(types_)))
        if not eq:
            if i + 1 >= len(pairs):
                raise ConfigError(f"--{key.replace('_', '-')} needs a value")
            i += 1
            value = pairs[i]
        updates[key] = _coerce(key, value, types_[key])
        i += 1
    return dataclasses.replace(config, **updates)
