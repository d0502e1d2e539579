"""A sweep directory's record (sweep.json) and the folder names of its cells."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lapheads.errors import SweepError
from lapheads.io import json_loads, read_regular_text
from lapheads.runs.layout import (
    SWEEP_FILE,
)


def spec_dir_name(spec: str) -> str:
    """A head spec as it names directories: cells L<spec>-s<seed>, reports report-vs-L<spec> ("3,0" -> "L3_0",
    "negated:3" -> "Lnegated-3", "ordinary/negated/laplacian" -> "Lordinary.negated.laplacian")."""
    return "L" + spec.replace(",", "_").replace(":", "-").replace("/", ".")


#: an arm is a head spec, optionally followed by training settings of its own after "+", each KEY=VALUE (a config
#: field): "0+within_seq_penalty=0.5" is k = 0 trained with the geometry penalty, paired by seed like any arm
ARM_SETTING = "+"


def arm_parts(arm: str) -> tuple[str, dict[str, str]]:
    """(head spec, settings) of an arm: "0+within_seq_penalty=0.5" -> ("0", {"within_seq_penalty": "0.5"}). The
    settings start at the first "+" item with a "=": a spec's own "+" ("laplacian:1+local:1") stays in the spec."""
    parts = arm.split(ARM_SETTING)
    first = next((i for i, part in enumerate(parts) if "=" in part), len(parts))
    spec, items = ARM_SETTING.join(parts[:first]), parts[first:]
    settings: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key or not value.strip() or key in settings or key in ("seed", "laplacian_heads"):
            raise SweepError(
                f"arm {arm!r}: setting {item!r}; allowed: a head spec, then +KEY=VALUE settings (config fields other "
                "than seed and laplacian_heads, each once), e.g. 0+within_seq_penalty=0.5"
            )
        settings[key] = value.strip()
    return spec.strip(), settings


def arm_overrides(arm: str) -> list[str]:
    """An arm's settings as command-line overrides: "0+within_seq_penalty=0.5" -> ["--within-seq-penalty", "0.5"]."""
    return [word for key, value in arm_parts(arm)[1].items() for word in (f"--{key.replace('_', '-')}", value)]


def arm_mismatch(arm: str, config: dict[str, Any]) -> str | None:
    """What the config that trained a cell holds where ``arm`` says otherwise ("laplacian_heads '3'"), None where
    the config is that arm's."""
    spec, settings = arm_parts(arm)
    if spec != str(config.get("laplacian_heads")):
        return f"laplacian_heads {config.get('laplacian_heads')!r}"
    for key, text in settings.items():
        value = config.get(key, "<absent>")
        if not _written_as(value, text):
            return f"{key} {value!r}"
    return None


def _written_as(value: Any, text: str) -> bool:
    """Whether a config value is what ``text`` wrote on the command line (0.5 and "5e-1" alike)."""
    if isinstance(value, bool):
        return text.lower() in (("1", "true", "yes", "on") if value else ("0", "false", "no", "off"))
    if isinstance(value, (int, float)):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return str(value) == text


def load_sweep(sweep_dir: str | os.PathLike) -> dict[str, Any]:
    """A sweep directory's sweep.json (its specs, seeds, overrides and cells with their status)."""
    file = Path(sweep_dir) / SWEEP_FILE
    try:
        record = json_loads(read_regular_text(file))
    except FileNotFoundError:
        raise SweepError(f"{sweep_dir} holds no sweep ({SWEEP_FILE} missing); run `lapheads sweep` first") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SweepError(f"{file} is corrupt or unreadable: {err}") from None
    cells = record.get("cells") if isinstance(record, dict) else None
    if not isinstance(cells, dict) or not all(isinstance(cell, dict) for cell in cells.values()):
        raise SweepError(f"{file} is corrupt: no cells object; allowed: a sweep.json lapheads wrote")
    for name, cell in cells.items():
        written = Path(str(cell.get("run_dir") or name))
        own = Path(sweep_dir) / written.name  # a sweep's cells are SWEEP_DIR/<name>, wherever it was copied or moved
        # relative (as lapheads writes them): there; an absolute path of an older sweep.json: there if it is there
        cell["run_dir"] = str(own if not written.is_absolute() or own.exists() else written)
    return record
