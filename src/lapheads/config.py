"""Configs: plain dataclasses, resolved from a preset, a preset file and ``--key value`` overrides.

No exec-based configs: a preset is a dataclass instance in ``lapheads.tasks.presets`` or a JSON file holding a subset of
the fields; overrides are typed by the dataclass fields, and an unknown key or a bad value is a one-line error.

Every field is declared with :func:`option`: a default, a one-line description and a :class:`Domain` (the values it
allows). :func:`validate_config` checks every field's type and domain, then the config's own cross-field ``check()``,
before a run writes anything; :func:`config_help` turns the same declarations into ``--help`` text.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lapheads.errors import LapheadsError

__all__ = [
    "ConfigError",
    "Domain",
    "add_options",
    "apply_overrides",
    "config_from_args",
    "config_from_dict",
    "config_help",
    "load_preset_file",
    "option",
    "validate_config",
]

C = TypeVar("C")


class ConfigError(LapheadsError, ValueError):
    """A bad preset, key or value; the message names it and what is allowed."""


# ----------------------------------------------------------------------------------------------------------------
# Declaring fields: default, description, allowed values


@dataclasses.dataclass(frozen=True)
class Domain:
    """The values a config field allows: a predicate and the words for it (used in errors and ``--help``)."""

    allowed: str
    test: Callable[[Any], bool]


def greater(lo: float) -> Domain:
    return Domain(f"> {lo}", lambda v: v > lo)


def at_least(lo: float) -> Domain:
    return Domain(f">= {lo}", lambda v: v >= lo)


def interval(lo: float, hi: float, *, open_lo: bool = False, open_hi: bool = False) -> Domain:
    words = f"in {'(' if open_lo else '['}{lo}, {hi}{')' if open_hi else ']'}"
    return Domain(words, lambda v: (v > lo if open_lo else v >= lo) and (v < hi if open_hi else v <= hi))


def one_of(*choices: Any) -> Domain:
    return Domain("one of " + ", ".join(map(str, choices)), lambda v: v in choices)


POSITIVE, NON_NEGATIVE = greater(0), at_least(0)
#: a probability-like rate that must stay below 1 (momenta, decays, drop rates)
RATE = interval(0, 1, open_hi=True)
FRACTION = interval(0, 1)


def option(
    default: Any, help: str, domain: Domain | None = None, *, flags: tuple[str, ...] = (), metavar: str | None = None
) -> Any:
    """A dataclass field with its description and allowed values; lists and dicts are copied per instance.

    ``flags`` (other spellings of its command-line option) and ``metavar`` are read where options become an argparse
    parser (:func:`add_options`: the ``lapheads eval NAME`` options)."""
    metadata = {"help": help, "domain": domain, "flags": flags, "metavar": metavar}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: json.loads(json.dumps(default)), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _options(annotation: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(annotation)
    return typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)


def _type_ok(value: Any, annotation: Any) -> bool:
    for option_ in _options(annotation):
        origin = typing.get_origin(option_) or option_
        if option_ is Any:
            return True
        if origin is typing.Literal:
            if any(value == choice and type(value) is type(choice) for choice in typing.get_args(option_)):
                return True
            continue
        if option_ is type(None) and value is None:
            return True
        if option_ is bool and isinstance(value, bool):
            return True
        if option_ is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option_ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return math.isfinite(value)
        if option_ is str and isinstance(value, str):
            return True
        if origin is dict and isinstance(value, dict):
            return True
        if origin in (list, tuple) and isinstance(value, (list, tuple)):
            element = (typing.get_args(option_) or (Any,))[0]
            return all(_type_ok(item, element) for item in value)
    return False


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string", type(None): "none"}


def _type_words(annotation: Any) -> str:
    words = []
    for option_ in _options(annotation):
        origin = typing.get_origin(option_) or option_
        if origin is typing.Literal:
            words.extend(str(choice) for choice in typing.get_args(option_))
        elif origin is dict:
            words.append("a JSON object")
        elif origin in (list, tuple):
            element = (typing.get_args(option_) or (Any,))[0]
            words.append(f"a list of {_TYPE_WORDS.get(element, 'values').split(' ', 1)[-1]}s")
        else:
            words.append(_TYPE_WORDS.get(option_, str(option_)))
    return " or ".join(words)


def _allowed(field: dataclasses.Field, annotation: Any) -> str:
    domain = field.metadata.get("domain")
    words = _type_words(annotation)
    if domain is None:
        return words
    none = " (or none)" if type(None) in _options(annotation) else ""
    return f"{words.replace(' or none', '')}, {domain.allowed}{none}"


def validate_config(config: Any, source: str = "") -> None:
    """Check every field's type and allowed values, then ``config.check()`` (cross-field rules).

    Raises:
        ConfigError: one line naming the field (as its ``--flag``), the value and what is allowed.
    """
    where = f" ({source})" if source else ""
    types_ = _field_types(type(config))
    for field in dataclasses.fields(config):
        value, annotation = getattr(config, field.name), types_[field.name]
        domain = field.metadata.get("domain")
        ok = _type_ok(value, annotation)
        if ok and domain is not None and value is not None:
            try:
                ok = bool(domain.test(value))
            except TypeError:
                ok = False
        if not ok:
            raise ConfigError(f"{_flag(field.name)} {value!r}{where}: allowed: {_allowed(field, annotation)}")
    check = getattr(config, "check", None)
    if check is not None:
        check()


def config_help(cls: type, base: Any = None) -> str:
    """``--help`` text for every field of ``cls``: flag, type, default (``base``'s value: a preset's), allowed values,
    description."""
    types_ = _field_types(cls)
    defaults = base if base is not None else cls()
    lines = []
    for field in dataclasses.fields(cls):
        if field.name == "description":
            continue
        annotation = types_[field.name]
        domain = field.metadata.get("domain")
        default = json.dumps(getattr(defaults, field.name))
        allowed = f"; {domain.allowed}" if domain is not None else ""
        lines.append(
            f"  {_flag(field.name):28s} {field.metadata.get('help', '')} "
            f"[{_type_words(annotation)}{allowed}; {'preset' if base is not None else 'default'} {default}]"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Reading configs


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(key: str, text: str, annotation: Any) -> Any:
    """Parse a command-line string into the field's type."""
    from lapheads.io import json_loads  # here, not at the top: io loads torch, and `lapheads --help` reads this module

    origin = typing.get_origin(annotation)
    options = typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)
    if type(None) in options and text.lower() in ("none", "null"):
        return None
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            if typing.get_origin(option) is typing.Literal:
                if text in typing.get_args(option):
                    return text
                raise ValueError("not one of the words")
            if option is bool:
                if text.lower() in ("1", "true", "yes", "on"):
                    return True
                if text.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError("not a boolean")
            if option in (int, float, str):
                return option(text)
            if option is dict or typing.get_origin(option) is dict:
                value = json_loads(text)
                if not isinstance(value, dict):
                    raise ValueError("not a JSON object")
                return value
            if option in (list, tuple) or typing.get_origin(option) in (list, tuple):
                items = json_loads(text) if text.startswith("[") else [p.strip() for p in text.split(",")]
                element = (typing.get_args(option) or (None,))[0]
                return [element(item) for item in items] if element in (int, float, str) else items
        except ValueError as err:
            errors.append(str(err))
    shown = repr(text) if len(text) <= 80 else f"{text[:40]!r}...({len(text):,} characters)"
    why = f" ({errors[-1]})" if errors and "levels deep" in errors[-1] else ""  # the one reason a reader can't guess
    raise ConfigError(f"--{key.replace('_', '-')} {shown}{why}: allowed: {_type_words(annotation)}")


def config_from_dict(cls: type[C], data: dict[str, Any], base: C | None = None, source: str = "config") -> C:
    """A ``cls`` instance from ``base`` (or defaults) updated by ``data``; unknown keys are an error."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(types_))}")
    base = base if base is not None else cls()
    # A JSON number where the field is text (e.g. "laplacian_heads": 3) means the same thing as its string.
    data = {
        k: str(v) if types_[k] is str and isinstance(v, int) and not isinstance(v, bool) else v for k, v in data.items()
    }
    return dataclasses.replace(base, **data)


def load_preset_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON preset file (a dict of config fields)."""
    from lapheads.io import json_loads

    try:
        data = json_loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
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
            raise ConfigError(
                f"unknown option --{key.replace('_', '-')}; allowed: "
                + ", ".join("--" + k.replace("_", "-") for k in sorted(types_))
            )
        if not eq:
            if i + 1 >= len(pairs):
                raise ConfigError(f"--{key.replace('_', '-')} needs a value")
            i += 1
            value = pairs[i]
        updates[key] = _coerce(key, value, types_[key])
        i += 1
    return dataclasses.replace(config, **updates)


# ----------------------------------------------------------------------------------------------------------------
# Options as command-line flags (the evaluations' options: lapheads.evals.options)


def _argument(key: str, annotation: Any, text: str) -> Any:
    try:
        return _coerce(key, text, annotation)
    except ConfigError as err:  # argparse says "argument --key: 'x': allowed: ..." in its one-line error
        raise argparse.ArgumentTypeError(str(err).removeprefix(_flag(key) + " ")) from None


_METAVARS = {int: "N", float: "X"}


def add_options(parser: Any, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One argparse option per field of the dataclass ``cls`` (but ``skip``): ``--name-with-dashes`` (and the
    field's ``flags``); a bool field that defaults to False is a switch, any other takes a value typed by the field
    (the same one-line errors as config overrides). The help is the field's description, allowed values and default.

    Args:
        parser: an ``argparse.ArgumentParser`` or argument group.
        cls: a dataclass declared with :func:`option`.
        skip: fields that are not flags (positional arguments the caller declares).
    """
    types_ = _field_types(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        annotation, meta = types_[field.name], field.metadata
        flags = [_flag(field.name), *meta.get("flags", ())]
        if annotation is bool and field.default is False:
            parser.add_argument(*flags, dest=field.name, action="store_true", help=meta.get("help", ""))
            continue
        domain = meta.get("domain")
        allowed = f" ({domain.allowed})" if domain is not None else ""
        default = "" if field.default in (None, "") else f" [default {field.default}]"
        parser.add_argument(
            *flags,
            dest=field.name,
            default=field.default,
            type=functools.partial(_argument, field.name, annotation),
            metavar=meta.get("metavar") or _METAVARS.get(_options(annotation)[0], field.name.upper()),
            help=f"{meta.get('help', '')}{allowed}{default}",
        )


def config_from_args(cls: type[C], args: Any, **values: Any) -> C:
    """A ``cls`` instance from the parsed ``args`` (the attributes named as its fields) and ``values``, checked by
    :func:`validate_config` (a value outside a field's domain: one line naming its flag)."""
    taken = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    config = cls(**{**taken, **values})
    validate_config(config)
    return config
