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

One module per half: ``layout`` (every file name), ``directory`` (``RunDir``: paths, config.json, metrics.jsonl,
``latest``), ``checkpoints`` (atomic save and load), ``models`` (``load_model``: the model from its record),
``sweep`` (sweep.json). The layout itself is documented in docs/design.md ("The run directory").
"""

from typing import TYPE_CHECKING

from lapheads.submodules import public_getattr

if TYPE_CHECKING:  # for readers and type checkers; at run time __getattr__ imports each name on first use, so a
    # reader of the layout alone (a config's --help) loads no torch
    from lapheads.runs.directory import RunDir, checkpoint_folder, checkpoint_steps, latest_checkpoint, read_jsonl
    from lapheads.runs.layout import SWEEP_FILE, WEIGHTS
    from lapheads.runs.models import (
        FACTORIES,
        build_model,
        load_gpt_run,
        load_model,
        load_nanochat_model,
        load_run_tokenizer,
        load_token_shards,
        load_weights,
        model_record,
        trained_on_conversations,
    )
    from lapheads.runs.sweep import SweepError, load_sweep, spec_dir_name

_PUBLIC = {
    **dict.fromkeys(
        ("RunDir", "checkpoint_folder", "checkpoint_steps", "latest_checkpoint", "read_jsonl"), "directory"
    ),
    **dict.fromkeys(("SWEEP_FILE", "WEIGHTS"), "layout"),
    **dict.fromkeys(
        (
            "FACTORIES",
            "build_model",
            "load_gpt_run",
            "load_model",
            "load_nanochat_model",
            "load_run_tokenizer",
            "load_token_shards",
            "load_weights",
            "model_record",
            "trained_on_conversations",
        ),
        "models",
    ),
    **dict.fromkeys(("SweepError", "load_sweep", "spec_dir_name"), "sweep"),
}

__all__ = [
    "FACTORIES",
    "RunDir",
    "read_jsonl",
    "latest_checkpoint",
    "checkpoint_folder",
    "checkpoint_steps",
    "load_weights",
    "model_record",
    "build_model",
    "load_model",
    "load_nanochat_model",
    "load_run_tokenizer",
    "load_gpt_run",
    "load_token_shards",
    "load_sweep",
    "SWEEP_FILE",
    "spec_dir_name",
    "SweepError",
    "WEIGHTS",
    "trained_on_conversations",
]

__getattr__ = public_getattr(__name__, _PUBLIC)
