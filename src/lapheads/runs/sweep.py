"""A sweep directory's record (sweep.json) and the folder names of its cells."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lapheads.io import json_loads
from lapheads.errors import LapheadsError
from lapheads.runs.layout import (
    SWEEP_FILE,
)


def spec_dir_name(spec: str) -> str:
    """A head spec as it names directories: cells L<spec>-s<seed>, reports report-vs-L<spec> ("3,0" -> "L3_0",
    "negated:3" -> "Lnegated-3", "ordinary/negated/laplacian" -> "Lordinary.negated.laplacian")."""
    return "L" + spec.replace(",", "_").replace(":", "-").replace("/", ".")


class SweepError(LapheadsError, ValueError):
    """A bad sweep definition or directory; one-line message."""


def load_sweep(sweep_dir: str | os.PathLike) -> dict[str, Any]:
    """A sweep directory's sweep.json (its specs, seeds, overrides and cells with their status)."""
    file = Path(sweep_dir) / SWEEP_FILE
    try:
        record = json_loads(file.read_text())
    except FileNotFoundError:
        raise SweepError(f"{sweep_dir} holds no sweep ({SWEEP_FILE} missing); run `lapheads sweep` first") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SweepError(f"{file} is corrupt: {err}") from None
    cells = record.get("cells") if isinstance(record, dict) else None
    if not isinstance(cells, dict) or not all(isinstance(cell, dict) for cell in cells.values()):
        raise SweepError(f"{file} is corrupt: no cells object; allowed: a sweep.json lapheads wrote")
    for name, cell in cells.items():
        written = Path(str(cell.get("run_dir") or name))
        own = Path(sweep_dir) / written.name  # a sweep's cells are SWEEP_DIR/<name>, wherever it was copied or moved
        # relative (as lapheads writes them): there; an absolute path of an older sweep.json: there if it is there
        cell["run_dir"] = str(own if not written.is_absolute() or own.exists() else written)
    return record


# ----------------------------------------------------------------------------------------------------------------
# Language-model runs

#: the tasks whose model is the nanochat GPT with a tokenizer in RUN_DIR/tokenizer
