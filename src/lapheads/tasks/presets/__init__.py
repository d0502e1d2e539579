"""Named recipes, one module per task. Each preset is a config instance with a description saying whose recipe
it follows.

``lapheads train classify --preset NAME`` starts from one of these; ``--preset path/to/file.json`` starts from the
defaults updated by a JSON object of config fields; ``--key value`` overrides either.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from lapheads.config import ConfigError, apply_overrides, config_from_dict, load_preset_file, validate_config
from lapheads.tasks import TASKS
from lapheads.train.configs.classify import ClassifyConfig

__all__ = [
    "CLASSIFY_PRESETS",
    "DINO_PRESETS",
    "LM_PRESETS",
    "MID_PRESETS",
    "PRESETS",
    "SFT_PRESETS",
    "fork_scaling",
    "resolve_classify_config",
    "resolve_config",
    "resume_config",
]

if TYPE_CHECKING:  # the names below, for readers and type checkers; at run time __getattr__ loads them on use
    from lapheads.tasks.presets.chat import MID_PRESETS, SFT_PRESETS
    from lapheads.tasks.presets.classify import CLASSIFY_PRESETS
    from lapheads.tasks.presets.dino import DINO_PRESETS
    from lapheads.tasks.presets.lm import LM_PRESETS, fork_scaling

    PRESETS: dict[str, dict[str, object]]
    CONFIG_TYPES: dict[str, type]

#: the per-task preset tables this package re-exports, each from its own module (imported when first asked for, so
#: ``train classify --help`` imports classification's presets, not the language models' and their GPT)
_TABLES = {
    "CLASSIFY_PRESETS": "classify",
    "DINO_PRESETS": "dino",
    "LM_PRESETS": "lm",
    "MID_PRESETS": "chat",
    "SFT_PRESETS": "chat",
    "fork_scaling": "lm",
}


def __getattr__(name: str):
    """``PRESETS`` (task -> its presets) and ``CONFIG_TYPES`` (task -> its config type) for every task, and the
    per-task tables, loaded on first use; one task's are ``TASKS[name].preset_table()`` / ``.config_type()``."""
    import importlib

    if name == "PRESETS":
        return {task_name: task.preset_table() for task_name, task in TASKS.items()}
    if name == "CONFIG_TYPES":
        return {task_name: task.config_type() for task_name, task in TASKS.items()}
    if name in _TABLES:
        return getattr(importlib.import_module(f"lapheads.tasks.presets.{_TABLES[name]}"), name)
    raise AttributeError(f"module 'lapheads.tasks.presets' has no attribute {name!r}")


def resolve_config(task: str, preset: str, laplacian_heads: str | None, overrides: list[str]):
    """Preset name or JSON file -> the task's config, then ``--laplacian-heads`` and ``--key value`` overrides."""
    presets, cls = TASKS[task].preset_table(), TASKS[task].config_type()
    if preset in presets:
        config = presets[preset]
    elif preset.endswith(".json") or Path(preset).is_file():
        config = config_from_dict(cls, load_preset_file(preset), source=preset)
    else:
        raise ConfigError(f"unknown {task} preset {preset!r}; allowed: {', '.join(presets)} or a .json preset file")
    config = apply_overrides(config, overrides)
    if laplacian_heads is not None:
        config = config_from_dict(cls, {"laplacian_heads": laplacian_heads}, base=config)
    validate_config(config, source=preset if preset not in presets else "")
    return config


def resume_config(
    task: str, run_dir: str | Path, preset: str | None, laplacian_heads: str | None, overrides: list[str]
):
    """The stored config of the run in ``run_dir``, for ``--resume``.

    Repeating the options of the original command is allowed, not required: each one given (``--laplacian-heads``,
    ``--key value``, a preset name recorded in config.json) must equal the stored value, else a one-line error.
    """
    from lapheads.errors import CheckpointError
    from lapheads.runs import RunDir

    run = RunDir(run_dir)
    if not run.config_file.is_file():
        raise CheckpointError(
            f"--resume: {run.path} holds no run (no config.json); allowed: the --out of an earlier "
            "run, or drop --resume to start one"
        )
    record = run.read_config()
    if record.get("task") != task:
        raise CheckpointError(
            f"--resume: {run.path} holds a {record.get('task')!r} run; allowed: "
            f"lapheads train {record.get('task')} ... --resume"
        )
    cls = TASKS[task].config_type()
    stored = config_from_dict(cls, record["config"], source=str(run.config_file))
    if preset is not None and record.get("preset") not in (None, preset):
        raise ConfigError(
            f"--resume: --preset {preset!r} differs from the run's {record['preset']!r} "
            f"({run.config_file}); allowed: the same preset, or leave --preset out"
        )
    given = apply_overrides(stored, overrides)
    if laplacian_heads is not None:
        given = config_from_dict(cls, {"laplacian_heads": laplacian_heads}, base=given)
    from lapheads.train.configs.run import RESUME_FREE

    changed = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in RESUME_FREE and getattr(given, f.name) != getattr(stored, f.name)
    ]
    if changed:
        detail = ", ".join(
            f"--{k.replace('_', '-')} {getattr(given, k)!r} (run: {getattr(stored, k)!r})" for k in changed
        )
        raise ConfigError(
            f"--resume continues the run as it was configured; differs from {run.config_file}: "
            f"{detail}; allowed: the stored values, or leave those options out"
        )
    free = [k for k in RESUME_FREE if hasattr(given, k)]  # a task's config has those it uses (num_workers: images)
    return dataclasses.replace(stored, **{k: getattr(given, k) for k in free})  # e.g. add --log on resume


def resolve_classify_config(preset: str, laplacian_heads: str | None, overrides: list[str]) -> ClassifyConfig:
    """:func:`resolve_config` for classification."""
    return resolve_config("classify", preset, laplacian_heads, overrides)
