"""Cell records: what outlives a machine. One small, typed, versioned JSON file per finished sweep cell.

A sweep cell's run directory holds checkpoints (megabytes) and lives on one machine; its record holds everything a
report reads (the config and seed, the environment, every logged evaluation, the analysis, the per-head mechanism
scores at every kept checkpoint, the wall time) in a few hundred KB, so it can be committed or synced and the sweep
continued, and reported, anywhere. Design choices:

* **Typed and versioned**: ``format`` and ``version`` are checked on every read; a file that is not a record, or
  of another version, is a one-line error, never a half-read.
* **Written once, atomically, when the cell has finished** (temp file, then rename): a folder of records never
  holds a half-done cell. An existing record is never overwritten: a cell whose record is there is skipped when its
  config is the same, and refused (one line naming the first differing key) when it is not.
* **The reader interface of a run directory**: :class:`CellRecord` answers ``read_metrics``, ``last_metric`` and
  ``read_report`` as :class:`lapheads.runs.RunDir` does, so ``lapheads report`` reads records and run directories
  through one path.
* **A plan's hash in every record**: the sha256 of the plan file the sweep ran under (None without one), so a
  report can say whether its family was declared before the data.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lapheads.errors import LapheadsError
from lapheads.io import atomic_write_text, json_loads, read_regular_text
from lapheads.runs.layout import PLAN_FILE, record_file

__all__ = [
    "RECORD_FORMAT",
    "RECORD_VERSION",
    "CellRecord",
    "RecordError",
    "accelerator",
    "config_difference",
    "environment",
    "environment_key",
    "file_sha256",
    "record_in_memory",
    "load_records",
    "read_record",
    "write_record",
]

RECORD_FORMAT = "lapheads cell record"
RECORD_VERSION = 1
#: the CPU flags that decide which kernels (and so which rounding) a CPU runs: kept in every record
_KERNEL_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "neon", "sve")


class RecordError(LapheadsError, ValueError):
    """A record or records folder that cannot be used; one-line message."""


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def accelerator(device: Any = None) -> dict[str, Any] | None:
    """The GPU a run computes on and what decides its rounding there (its fp32 matmul and convolution precision:
    IEEE or TF32), or None on the CPU.

    Args:
        device: the run's torch.device (or its type); None or a CPU device: no accelerator.
    """
    import torch

    if device is None or getattr(device, "type", device) != "cuda":
        return None
    index = getattr(device, "index", None)
    index = torch.cuda.current_device() if index is None else index
    return {
        "name": torch.cuda.get_device_name(index),
        "capability": ".".join(str(part) for part in torch.cuda.get_device_capability(index)),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "fp32_matmul": torch.backends.cuda.matmul.fp32_precision,
        "fp32_conv": torch.backends.cudnn.conv.fp32_precision,
    }


def environment(threads: int, device: Any = None) -> dict[str, Any]:
    """Where a cell ran: versions, git revision, CPU model and kernel flags, threads, the GPU if it trained on one
    (the CPU kind varies between machines, and results move with it: a report pairs seeds within one
    environment)."""
    import torch

    import lapheads
    from lapheads.hardware import cpu_flags, cpu_kernels, kernel_pins_in_force
    from lapheads.runs.directory import git_revision, uncommitted_changes

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    pins = kernel_pins_in_force()
    capability = str(torch.backends.cpu.get_cpu_capability())
    kernel_flags = sorted(flag for flag in _KERNEL_FLAGS if flag in flags)
    return {
        "lapheads_version": lapheads.__version__,
        "git_revision": git_revision(),
        "git_uncommitted": uncommitted_changes(),  # [] clean; paths: the code was not that commit; None: unknown
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_model": model,
        "cpu_flags": kernel_flags,
        "torch_cpu_capability": capability,
        "cpu_kernel_pins": pins,
        "cpu_kernels": cpu_kernels(kernel_flags, capability, pins),
        "threads": threads,
        "accelerator": accelerator(device),
    }


def environment_key(env: dict[str, Any]) -> tuple:
    """What decides a cell's numbers beyond its config: torch, the instruction set each CPU kernel library runs
    (ATen, MKL, oneDNN: derived from the CPU flags for a record older than ``cpu_kernels``), the architecture,
    threads, precision and the GPU with its fp32 matmul / convolution precision (None on the CPU, and in a record
    older than ``accelerator``). The CPU model is recorded, but two CPUs running the same kernels agree bit for
    bit."""
    from lapheads.hardware import cpu_kernels

    precision = env.get("precision") or {}
    kernels = env.get("cpu_kernels") or cpu_kernels(env.get("cpu_flags") or [], env.get("torch_cpu_capability"))
    gpu = env.get("accelerator")
    return (
        env.get("torch_version"),
        tuple(sorted(kernels.items())),
        env.get("machine"),
        env.get("threads"),
        precision.get("autocast_bf16") if isinstance(precision, dict) else precision,
        (gpu["name"], gpu["fp32_matmul"], gpu["fp32_conv"]) if gpu else None,
    )


@dataclass(frozen=True)
class CellRecord:
    """One finished cell, read from its record file (or built in memory from its run directory)."""

    data: dict[str, Any]
    path: Path | None = None

    @property
    def name(self) -> str:
        return self.data["cell"]["name"]

    @property
    def spec(self) -> str:
        return self.data["cell"]["spec"]

    @property
    def seed(self) -> int:
        return int(self.data["cell"]["seed"])

    @property
    def analysis(self) -> dict[str, Any] | None:
        return self.data.get("analysis")

    @property
    def checkpoint_heads(self) -> dict[int, list[list[dict[str, Any]]]]:
        """{step: per block, per head: the mechanism scores read from that kept checkpoint's weights}."""
        return {int(step): blocks for step, blocks in (self.data.get("checkpoint_heads") or {}).items()}

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(self.data["metrics"])

    def last_metric(self, name: str) -> Any:
        values = [entry[name] for entry in self.data["metrics"] if name in entry]
        return values[-1] if values else None

    def read_report(self, name: str) -> dict[str, Any] | None:
        return (self.data.get("reports") or {}).get(name)


def _check(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
        raise RecordError(f"{where} is not a lapheads cell record (no format {RECORD_FORMAT!r})")
    if data.get("version") != RECORD_VERSION:
        raise RecordError(
            f"{where} is a cell record of version {data.get('version')!r}; allowed: version {RECORD_VERSION}"
        )
    for key in ("cell", "sweep", "config", "metrics", "environment"):
        if key not in data:
            raise RecordError(f"{where} lacks {key!r}; allowed: a complete cell record (lapheads sweep --records)")
    _check_cell_against_its_config(data, where)
    return data


def _check_cell_against_its_config(data: dict[str, Any], where: str) -> None:
    """A record's cell (name, arm, seed, task) is what the config that trained it says: a record copied under another
    seed, relabelled to another arm or given a fractional seed is refused before it counts (issue 60)."""
    from lapheads.runs.sweep import arm_mismatch, spec_dir_name

    cell, trained = data["cell"], data["config"]
    config = trained.get("config") if isinstance(trained, dict) else None
    if not isinstance(cell, dict) or not isinstance(config, dict):
        raise RecordError(f"{where}: its cell or config is not an object; allowed: a record lapheads sweep wrote")
    seed, spec = cell.get("seed"), cell.get("spec")
    if type(seed) is not int or seed != config.get("seed"):
        raise RecordError(
            f"{where}: cell seed {seed!r}, trained with seed {config.get('seed')!r}; allowed: the same int"
        )
    mismatch = arm_mismatch(spec, config) if isinstance(spec, str) else "no arm"
    if mismatch:
        raise RecordError(f"{where}: cell arm {spec!r}, trained with {mismatch}; allowed: the same arm")
    if cell.get("name") != f"{spec_dir_name(spec)}-s{seed}" or cell.get("config") != config:
        raise RecordError(f"{where}: cell {cell.get('name')!r} does not match the config that trained it (arm {spec}, "
                          f"seed {seed}); allowed: a record lapheads sweep wrote")  # fmt: skip
    if data["sweep"].get("task") != trained.get("task"):
        raise RecordError(
            f"{where}: a {data['sweep'].get('task')!r} sweep's record of a {trained.get('task')!r} run; allowed: "
            "one task"
        )


def read_record(path: str | os.PathLike) -> CellRecord:
    path = Path(path)
    try:
        data = json_loads(read_regular_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecordError(f"{path} cannot be read as a cell record ({type(err).__name__}: {err})") from None
    record = CellRecord(_check(data, str(path)), path)
    if path.stem != record.name:
        raise RecordError(f"{path} holds the record of cell {record.name}; allowed: {record.name}.json (records keep "
                          "their names)")  # fmt: skip
    return record


def record_in_memory(data: dict[str, Any], where: str) -> CellRecord:
    """A record built in memory from a run directory (``lapheads report SWEEP_DIR``): checked as a record file is
    (its cell against the config that trained it), never written."""
    return CellRecord(_check({"format": RECORD_FORMAT, "version": RECORD_VERSION, **data}, where))


def write_record(records_dir: str | os.PathLike, data: dict[str, Any]) -> Path:
    """Write a finished cell's record into ``records_dir`` atomically; an existing record is never overwritten."""
    data = _check({"format": RECORD_FORMAT, "version": RECORD_VERSION, **data}, "the record to write")
    path = Path(records_dir) / record_file(data["cell"]["name"])
    if path.exists():
        raise RecordError(f"{path} exists; a record is written once (remove it yourself to redo the cell)")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=None, separators=(",", ":"), default=str) + "\n")
    return path


def load_records(records_dir: str | os.PathLike) -> list[CellRecord]:
    """Every record in ``records_dir`` (the plan and other files beside them are not records), by name."""
    folder = Path(records_dir)
    if not folder.is_dir():
        raise RecordError(f"{folder} is not a folder of cell records")
    records = [read_record(p) for p in sorted(folder.glob("*.json")) if p.name != PLAN_FILE]
    by_log: dict[str, CellRecord] = {}
    for record in records:  # two cells never train to the same log: one is a copy, relabelled as a seed or an arm
        log = hashlib.sha256(json.dumps(record.data["metrics"], sort_keys=True).encode()).hexdigest()
        first = by_log.setdefault(log, record)
        if first is not record:
            raise RecordError(
                f"{record.path} holds the same training log as {first.path.name} (cell {record.name} vs "
                f"{first.name}): a copied record, or two arms that are one experiment; allowed: one record per "
                "trained cell"
            )
    return records


def config_difference(recorded: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """The first key whose value differs between two cell configs ("key: recorded -> wanted"), None when equal."""
    for key in sorted(set(recorded) | set(wanted)):
        if recorded.get(key, "<absent>") != wanted.get(key, "<absent>"):
            return f"{key}: {recorded.get(key, '<absent>')!r} recorded, {wanted.get(key, '<absent>')!r} now"
    return None
