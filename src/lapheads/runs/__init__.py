"""The run directory: the one contract between training and everything that reads a run.

Design choices:

* **One owner.** Paths, config.json, metrics.jsonl, checkpoints/latest, the report/ cache and the rebuilt model all
  come from here; only ``lapheads.train`` writes runs, and readers (evals, analyze, sweep, report, demo, chat) never
  open a run's files by path or import training code to read one.
* **The model rebuilds from its own constructor arguments.** Training writes ``"model": {"factory": "vit"|"gpt",
  "kwargs": {...}}`` into config.json (as nanochat writes its model config into checkpoint metadata);
  :func:`load_model` needs nothing else, so a reader never re-derives a model from a training config. A run written
  before lapheads recorded it fails with a one-line error naming ``lapheads upgrade RUN_DIR``.
* **Safe loading.** Weights are safetensors with strict key and shape checks; JSON everything else; a ``latest``
  pointer is never followed out of the run directory.

The layout itself is documented in docs/design.md ("The run directory").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

import lapheads
from lapheads.runs.layout import (
    CHECKPOINTS,
    CONFIG_FILE,
    LATEST,
    METRICS_FILE,
    SAMPLES_FILE,
    STEP_PREFIX,
    SWEEP_FILE,
    TEMPORARY_PREFIX,
    TOKENIZER,
    WEIGHTS,
    report_folder,
    step_name,
)
from lapheads.distributed import resolve_device
from lapheads.errors import CheckpointError, InputError, LapheadsError
from lapheads.io import atomic_write_text, load_safetensors, state_dict_mismatch

__all__ = [
    "CONVERSATIONAL_TASKS",
    "GPT_TASKS",
    "RunDir",
    "read_jsonl",
    "latest_checkpoint",
    "checkpoint_folder",
    "checkpoint_steps",
    "load_weights",
    "model_record",
    "build_model",
    "load_model",
    "load_run_tokenizer",
    "load_gpt_run",
    "load_token_shards",
    "load_sweep",
    "notice",
    "SWEEP_FILE",
    "spec_dir_name",
    "SweepError",
    "WEIGHTS",
]



def notice(message: str) -> None:
    """One line for the user on stderr (repairs, restarts), outside tqdm's bar."""
    print(f"lapheads: {message}", file=sys.stderr, flush=True)


def _git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


class RunDir:
    """A run directory: config.json, metrics.jsonl, checkpoints/, report/."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.checkpoints = self.path / CHECKPOINTS
        self.metrics_file = self.path / METRICS_FILE
        self.samples_file = self.path / SAMPLES_FILE  # lm: a sample per evaluation
        self.tokenizer_dir = self.path / TOKENIZER  # lm, mid, sft: the tokenizer the model was trained with
        self.config_file = self.path / CONFIG_FILE
        self.report_dir = report_folder(self.path)  # readers' caches: eval_*.json, analysis*.json, plots
        self.trackers: list[Any] = []  # TensorBoard / W&B mirrors of metrics.jsonl (lapheads.integrations.tracking), rank 0

    def exists(self) -> bool:
        """Whether a run was started here (config.json is written before anything else)."""
        return self.config_file.is_file()

    def check_is_directory(self) -> None:
        """A run directory is a directory (or does not exist yet); anything else is a one-line error."""
        if self.path.exists() and not self.path.is_dir():
            raise CheckpointError(f"--out {self.path} is a file; allowed: a new directory or a run directory")

    def write_config(self, task: str, config: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        self.check_is_directory()
        self.path.mkdir(parents=True, exist_ok=True)
        record = {
            "task": task,
            "config": config,
            "lapheads_version": lapheads.__version__,
            "torch_version": torch.__version__,
            "git_revision": _git_revision(),
            **(extra or {}),
        }
        atomic_write_text(self.config_file, json.dumps(record, indent=2) + "\n")

    def read_config(self) -> dict[str, Any]:
        try:
            record = json.loads(self.config_file.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{self.path} is not a run directory: no config.json") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{self.config_file} is corrupt: {err}") from None
        if not isinstance(record, dict) or not isinstance(record.get("config", {}), dict):
            raise CheckpointError(
                f"{self.config_file} holds {type(record).__name__ if not isinstance(record, dict) else 'a config'} "
                "that is not a lapheads run record; allowed: a JSON object with task and config"
            )
        return record

    def settings(self) -> SimpleNamespace:
        """The run's training config as attributes (``run.settings().dataset``), without importing training code."""
        return SimpleNamespace(**self.read_config().get("config", {}))

    def task(self, *allowed: str) -> str:
        """The run's task; with ``allowed``, anything else is a one-line error."""
        task = self.read_config().get("task")
        if allowed and task not in allowed:
            raise CheckpointError(f"{self.path} holds a {task!r} run; allowed here: {', '.join(allowed)}")
        return task

    def log(self, record: dict[str, Any]) -> None:
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(record) + "\n")
        for tracker in self.trackers:
            tracker.log(record)

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_file)[0]

    def last_metric(self, name: str) -> Any:
        """The last value of ``name`` in metrics.jsonl, or None where the run has not logged it."""
        values = [r[name] for r in self.read_metrics() if name in r]
        return values[-1] if values else None

    def finished(self) -> bool:
        """Whether the run reached its last step: ``latest`` names the step config.json records as the last."""
        try:
            folder = latest_checkpoint(self)
            steps = self.read_config().get("steps")
        except CheckpointError:
            return False
        return folder is not None and steps is not None and folder.name == step_name(steps)

    def read_report(self, name: str) -> dict[str, Any] | None:
        """A reader's cached JSON in report/ (eval_chat.json, eval_dino.json, analysis.json, ...), None if absent."""
        file = self.report_dir / name
        if not file.is_file():
            return None
        try:
            return json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{file} is corrupt ({err}); delete it to measure again") from None

    def write_report(self, name: str, value: Any) -> Path:
        """Write a reader's cache into report/ atomically."""
        self.report_dir.mkdir(parents=True, exist_ok=True)
        file = self.report_dir / name
        atomic_write_text(file, json.dumps(value, indent=1) + "\n")
        return file

    def truncate_log(self, name: str, after_step: int) -> None:
        """Drop records of the JSONL log ``name`` written after ``after_step`` (a resumed run writes them again)."""
        path = self.path / name
        if not path.exists():
            return
        records, _ = read_jsonl(path)
        kept = [r for r in records if r.get("step", 0) <= after_step]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))

    def repair(self, logs: tuple[str, ...]) -> None:
        """Undo what a kill can leave behind, saying so in one line each: half-written checkpoint folders (never
        published, so never loaded) and a torn last line in a JSONL log."""
        for partial in sorted(self.checkpoints.glob(TEMPORARY_PREFIX + "*")):
            shutil.rmtree(partial, ignore_errors=True)
            notice(f"removed the half-written checkpoint {partial}")
        for name in logs:
            path = self.path / name
            records, torn = read_jsonl(path)
            if torn:
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
                notice(f"dropped a torn last line of {path}")


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """(records, whether a torn last line was skipped) of a JSONL log; a missing file has no records.

    A last line cut off by a kill is skipped (it is rewritten on resume); a bad line before it is corruption and a
    one-line error naming the file and line.
    """
    if not path.exists():
        return [], False
    lines = path.read_text().split("\n")
    records, torn = [], False
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: the write was interrupted
                torn = True
                continue
            raise CheckpointError(
                f"{path} line {number} is corrupt ({err}); allowed: one JSON object per line"
            ) from None
    return records, torn


def _within_run(run: RunDir, path: Path) -> Path:
    """``path`` itself, if neither it nor anything above it inside the run directory is a symlink leading out."""
    if path.is_symlink() or run.checkpoints.is_symlink() or not path.resolve().is_relative_to(run.path.resolve()):
        raise CheckpointError(
            f"{path} is a symlink or leads out of {run.path}; allowed: files inside the run directory"
        )
    return path


def latest_checkpoint(run: RunDir) -> Path | None:
    pointer = run.checkpoints / LATEST
    if not pointer.is_file():
        return None
    _within_run(run, pointer)
    name = pointer.read_text().strip()
    if not re.fullmatch(re.escape(STEP_PREFIX) + r"\d+", name):  # never follow a pointer out of the run directory
        raise CheckpointError(f"{pointer} holds {name[:60]!r}; allowed: the name of a step-<N> folder beside it")
    folder = run.checkpoints / name
    if not folder.is_dir():
        raise CheckpointError(f"{pointer} points at {folder}, which does not exist")
    return _within_run(run, folder)


def checkpoint_folder(run: RunDir, step: int | None = None) -> Path:
    """The latest checkpoint (``step`` None) or the one of ``step``; a one-line error naming what exists."""
    if step is None:
        folder = latest_checkpoint(run)
        if folder is None:
            raise CheckpointError(f"{run.path} has no checkpoint yet")
        return folder
    folder = run.checkpoints / step_name(step)
    if not folder.is_dir():
        kept = ", ".join(str(s) for s in checkpoint_steps(run)) or "none"
        raise CheckpointError(
            f"{run.path} has no checkpoint of step {step}; allowed: {kept} (train with "
            "--keep-checkpoints 0 to keep them all)"
        )
    return _within_run(run, folder)


def checkpoint_steps(run: RunDir) -> list[int]:
    """The steps of the checkpoints a run directory holds, ascending."""
    return sorted(int(p.name.split("-")[1]) for p in run.checkpoints.glob(STEP_PREFIX + "*") if p.name[len(STEP_PREFIX) :].isdigit())


def load_weights(module: torch.nn.Module, path: Path, prefix: str = "") -> None:
    """Load a safetensors state dict with strict key and shape checks and a one-line error on mismatch.

    With ``prefix`` only the tensors under it are loaded, the prefix removed (a DINO checkpoint's ``backbone.``).
    """
    tensors = load_safetensors(path)
    if prefix:
        tensors = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    detail = state_dict_mismatch(module.state_dict(), tensors)
    if detail:
        raise CheckpointError(f"{path} does not match the model ({detail}); was it written by a different config?")
    module.load_state_dict(tensors, strict=True)


# ----------------------------------------------------------------------------------------------------------------
# The model of a run


def _vit(**kwargs: Any) -> torch.nn.Module:
    from lapheads.models.vit import create_vit

    return create_vit(**kwargs)


def _gpt(**kwargs: Any) -> torch.nn.Module:
    from lapheads.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(**kwargs))


#: how a recorded model is rebuilt: ``factory(**kwargs)``
FACTORIES = {"vit": _vit, "gpt": _gpt}


def model_record(factory: str, kwargs: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """What training writes as config.json's ``"model"``: the factory, its keyword arguments (JSON) and the prefix
    under which the weight files hold the model (DINO's ``backbone.``)."""
    if factory not in FACTORIES:
        raise InputError(f"model factory {factory!r}; allowed: {', '.join(FACTORIES)}")
    record = {"factory": factory, "kwargs": json.loads(json.dumps(kwargs))}
    return record | ({"prefix": prefix} if prefix else {})


def build_model(record: dict[str, Any]) -> torch.nn.Module:
    """The untrained model of a ``model_record``; arguments its constructor does not take are a one-line error."""
    factory = record.get("factory") if isinstance(record, dict) else None
    if factory not in FACTORIES or not isinstance(record.get("kwargs"), dict):
        raise CheckpointError(f"model record {str(record)[:80]}; allowed: factory one of {', '.join(FACTORIES)}")
    try:
        return FACTORIES[factory](**record["kwargs"])
    except TypeError as err:  # an unknown or misspelt constructor argument
        raise CheckpointError(f"the recorded model arguments do not build a {factory} model: {err}") from None


def _record_of(run: RunDir, record: dict[str, Any]) -> dict[str, Any]:
    model = record.get("model")
    if isinstance(model, dict) and "factory" not in model and record.get("task") in CONVERSATIONAL_TASKS:
        model = {"factory": "gpt", "kwargs": model}  # chat runs of lapheads 0.1 recorded GPTConfig's fields only
    if not isinstance(model, dict) or model.get("factory") not in FACTORIES:
        raise CheckpointError(
            f"{run.path} was written before lapheads recorded its model's constructor arguments; "
            f"convert it with: lapheads upgrade {run.path}"
        )
    return model


def load_model(
    run_dir: str | os.PathLike | RunDir,
    weights: str = "model",
    step: int | None = None,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """A run's trained model in eval mode, rebuilt from config.json's ``"model"`` alone.

    Args:
        run_dir: a run directory (any task).
        weights: "model" (the trained weights), "ema" (classify with --ema-decay) or "teacher" (DINO).
        step: a kept checkpoint's step; None = the latest.
        device: "cpu", "cuda", "auto", ...
    LoRA runs (sft --lora-rank) are rebuilt on the base they were trained from, their adapters merged.
    """
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    if weights not in WEIGHTS:
        raise InputError(f"weights {weights!r}; allowed: {', '.join(WEIGHTS)}")
    record = run.read_config()
    spec = _record_of(run, record)
    folder = checkpoint_folder(run, step)
    file = folder / WEIGHTS[weights]
    if not file.is_file():
        raise CheckpointError(
            f"{file} does not exist; allowed weights of this run: "
            f"{', '.join(w for w, f in WEIGHTS.items() if (folder / f).is_file())}"
        )
    config = record.get("config", {})
    if config.get("lora_rank"):
        from lapheads.models.lora import LoraAdapters, apply_lora

        base = _load_source(record, device)  # the adapters were trained on it
        peft_model = apply_lora(
            base, config["lora_rank"], config["lora_alpha"], config["lora_dropout"], config["lora_targets"]
        )
        load_weights(LoraAdapters(peft_model), file)
        return peft_model.merge_and_unload().to(resolve_device(device)).eval()
    model = build_model(spec)
    load_weights(model, file, spec.get("prefix", ""))
    return model.to(resolve_device(device)).eval()


def _load_source(record: dict[str, Any], device: str | torch.device) -> torch.nn.Module:
    """The model a chat run recorded it started from: another run (``base_run``) or a nanochat checkpoint."""
    if record.get("nanochat"):
        from lapheads.models.nanochat import load_nanochat

        return load_nanochat(record["nanochat"], record["nanochat_step"], resolve_device(device))[0]
    return load_model(record["base_run"], device=device)


def load_run_tokenizer(run_dir: str | os.PathLike | RunDir, vocab_size: int | None = None):
    """The tokenizer an lm / mid / sft run was trained with (RUN_DIR/tokenizer); with ``vocab_size`` a tokenizer of
    another size is a one-line error."""
    from lapheads.data.tokenizers import load_tokenizer

    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    tokenizer = load_tokenizer(run.tokenizer_dir)
    if vocab_size is not None and tokenizer.vocab_size != vocab_size:
        raise CheckpointError(
            f"{run.path}/tokenizer has {tokenizer.vocab_size} tokens but the model was trained with "
            f"{vocab_size}; allowed: the run's own tokenizer"
        )
    return tokenizer


# ----------------------------------------------------------------------------------------------------------------
# The sweep directory (written by lapheads.study.sweep, read by lapheads.study.report)



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
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise SweepError(f"{sweep_dir} holds no sweep ({SWEEP_FILE} missing); run `lapheads sweep` first") from None
    except json.JSONDecodeError as err:
        raise SweepError(f"{file} is corrupt: {err}") from None


# ----------------------------------------------------------------------------------------------------------------
# Language-model runs

#: the tasks whose model is the nanochat GPT with a tokenizer in RUN_DIR/tokenizer
GPT_TASKS = ("lm", "mid", "sft")  # the tasks whose runs hold a GPT (config.json "task")
CONVERSATIONAL_TASKS = ("mid", "sft")  # trained on conversations: chat, serve and the chat evals read them


def load_gpt_run(run_dir: str | os.PathLike, device: str = "auto", step: int | None = None):
    """(config.json's record, model in eval mode, tokenizer) of an lm, mid or sft run; LoRA adapters are merged."""
    run = RunDir(run_dir)
    run.task(*GPT_TASKS)
    record = run.read_config()
    model = load_model(run, step=step, device=device)
    return record, model, load_run_tokenizer(run, record.get("vocab_size"))


def load_token_shards(run_dir: str | os.PathLike | RunDir):
    """The token shards an lm run trained on (config.json's ``"tokens"``), or None where they are not here (a run
    directory copied without its data, a chat run): evaluations that need no shards still work."""
    from lapheads.data.images import DataError
    from lapheads.data.text import TokenShards

    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    folder = run.read_config().get("tokens")
    if not folder:
        return None
    try:
        return TokenShards.open(folder)
    except DataError:
        return None
