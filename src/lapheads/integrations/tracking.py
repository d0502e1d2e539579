"""Experiment trackers beside ``metrics.jsonl``: TensorBoard and Weights & Biases, and a replay of the record.

Design choices:

* **metrics.jsonl stays the record**: every tracker only mirrors what :meth:`RunDir.log` writes there, on rank 0,
  so a run without trackers loses nothing and ``lapheads export-tb`` can rebuild the TensorBoard view of any run or
  sweep afterwards.
* **Optional packages, clear errors**: ``--log tensorboard`` needs ``tensorboard`` (``torch.utils.tensorboard``
  writes the events), ``--log wandb`` needs ``wandb``; a missing one is a one-line error before training starts.
* **Resume rewrites, never duplicates**: the TensorBoard writer is opened with ``purge_step`` just after the
  resumed step, so events a killed run logged after its last checkpoint are dropped, as the JSONL records are;
  W&B resumes the run id stored in the run directory.
* **Exact values**: TensorBoard scalars are written as float64 tensors (``new_style``, ``double_precision``), so an
  event holds the number metrics.jsonl holds, not its float32 rounding; NaN and infinities are written as they are
  (a diverging run shows where it diverged). W&B keeps Python floats.
* **A replay shows more than scalars**: ``export_tensorboard`` adds each run's samples (samples.jsonl) as text,
  its report figures as images and, for a sweep, one HParams entry per cell (spec, seed; final metrics), so
  TensorBoard's HParams view compares the arms.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lapheads.errors import InputError

__all__ = ["TRACKERS", "Tracker", "check_trackers", "export_tensorboard", "open_trackers", "parse_trackers"]

TRACKERS = ("tensorboard", "wandb")


def parse_trackers(spec: str) -> list[str]:
    """``"tensorboard,wandb"`` -> the names; one-line error for an unknown one."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise InputError(
            f"--log {spec!r}; allowed: a comma list of {', '.join(TRACKERS)} (metrics.jsonl is always written)"
        )
    return names


def check_trackers(spec: str) -> None:
    """Fail in one line, before a run writes anything, when a named tracker's package is missing."""
    import importlib.util

    for name in parse_trackers(spec):
        module = "tensorboard" if name == "tensorboard" else "wandb"
        if importlib.util.find_spec(module) is None:
            extra = "'lapheads[tensorboard]'" if name == "tensorboard" else "wandb"
            raise InputError(f"--log {name} needs the {module} package; allowed: pip install {extra}")


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """Every number of a record but its step, non-finite ones included."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _add_scalars(writer: Any, record: dict[str, Any]) -> None:
    step = int(record.get("step", 0))
    for key, value in _scalars(record).items():
        writer.add_scalar(key, value, step, new_style=True, double_precision=True)  # float64: the JSONL's value


class Tracker:
    """One sink: ``log(record)`` with a ``step`` key, ``close()``."""

    def __init__(self, kind: str, run_path: Path, config: dict[str, Any], start_step: int) -> None:
        self.kind = kind
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise InputError(
                    "--log tensorboard needs the tensorboard package; allowed: pip install 'lapheads[tensorboard]'"
                ) from None
            # records after the resumed checkpoint's step are logged again (metrics.jsonl drops them likewise): every
            # session starts with a SessionLog.START, and TensorBoard drops what a later START's step supersedes (its
            # first START only opens the run, so a fresh run writes one at step 0)
            self.writer = SummaryWriter(str(run_path / "tensorboard"), purge_step=start_step + 1 if start_step else 0)
            if not start_step:
                self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)
        else:
            try:
                import wandb
            except ImportError:
                raise InputError("--log wandb needs the wandb package; allowed: pip install wandb") from None
            id_file = run_path / "wandb_id.txt"
            run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
            id_file.write_text(run_id + "\n")
            self.writer = wandb.init(
                project="lapheads", name=run_path.name, id=run_id, resume="allow", dir=str(run_path), config=config
            )

    def log(self, record: dict[str, Any]) -> None:
        step, values = int(record.get("step", 0)), _scalars(record)
        if self.kind == "tensorboard":
            _add_scalars(self.writer, record)
            self.writer.flush()
        elif values:
            self.writer.log(values, step=step)

    def close(self) -> None:
        if self.kind == "tensorboard":
            self.writer.close()
        else:
            self.writer.finish()


def open_trackers(spec: str, run_path: Path, config: dict[str, Any], start_step: int) -> list[Tracker]:
    """The trackers named in ``spec`` for a run directory (call on rank 0 only)."""
    return [Tracker(kind, run_path, config, start_step) for kind in parse_trackers(spec)]


def _final_metrics(records: list[dict[str, Any]]) -> dict[str, float]:
    """The last finite value of every metric of a run (HParams' metric columns)."""
    last: dict[str, float] = {}
    for record in records:
        last.update({f"final/{k}": v for k, v in _scalars(record).items() if math.isfinite(v)})
    return last


def _add_samples_and_figures(writer: Any, run: Any) -> None:
    """A run's generated samples as text at their steps, and its report figures as images."""
    from lapheads.runs import read_jsonl

    samples, _ = read_jsonl(run.samples_file)
    for sample in samples:
        text = f"**prompt:** {sample.get('prompt', '')}\n\n{sample.get('text', '')}"
        writer.add_text("samples", text, int(sample.get("step", 0)))
    if run.report_dir.is_dir():
        import matplotlib.image

        for figure in sorted(run.report_dir.glob("*.png")):
            image = matplotlib.image.imread(figure)  # (H, W, 3 or 4), floats in [0, 1]
            writer.add_image(f"figures/{figure.stem}", image[..., :3], 0, dataformats="HWC")


def export_tensorboard(path: str | Path, out: str | Path | None = None) -> list[Path]:
    """Replay ``metrics.jsonl`` of a run directory, or of every cell of a sweep directory, into TensorBoard event
    files under ``out`` (default: ``path/tensorboard-export``), one folder per run, with its samples and report
    figures, and for a sweep one HParams entry per cell; returns the folders."""
    from torch.utils.tensorboard import SummaryWriter

    from lapheads.runs import SWEEP_FILE, RunDir, load_sweep

    path = Path(path)
    cells: dict[str, Any] = {}
    if (path / SWEEP_FILE).is_file():
        cells = load_sweep(path).get("cells", {})
        runs = {name: Path(cell["run_dir"]) for name, cell in cells.items()}
    elif RunDir(path).metrics_file.is_file():
        runs = {path.name: path}
    else:
        raise InputError(f"{path} holds neither metrics.jsonl nor sweep.json; allowed: a run or sweep directory")
    out = Path(out) if out is not None else path / "tensorboard-export"
    written = []
    for name, run in runs.items():
        records = RunDir(run).read_metrics()
        if not records:
            continue
        folder = out / name
        writer = SummaryWriter(str(folder), purge_step=0)  # a second export replaces the first
        for record in records:
            _add_scalars(writer, record)
        _add_samples_and_figures(writer, RunDir(run))
        if name in cells:  # HParams: one row per cell, its arm and seed against its final metrics
            cell = cells[name]
            arm = {"spec": str(cell.get("spec", name)), "seed": int(cell.get("seed", 0))}
            writer.add_hparams(arm, _final_metrics(records), run_name=".")
        writer.close()
        written.append(folder)
    return written
