"""The task table: everything the CLI, sweeps, presets, ``analyze`` and ``report`` need to know about a task.

A task is a training paradigm (classify, lm, dino, mid, sft). Each is one :class:`Task` entry; nothing else in
lapheads dispatches on a task's name. Adding a task = its own modules (a config, a train function, presets) plus one
entry here (docs/design.md, "Adding a task").

Design choices:

* **Entry points by name, as timm's registry and console_scripts do**: the table names ``module:attribute`` and
  imports them on first use, so reading the table (``--help``, a sweep's dry run) imports no training code.
* **Numbers are declared, not scraped**: a headline metric says which file of the run directory holds it
  (metrics.jsonl, report/eval_dino.json, report/eval_chat.json) and the path to the value.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from lapheads.errors import InputError
from lapheads.tasks.metrics import (
    DINO_HEADLINE,
    LM_GEOMETRY,
    SFT_HEADLINE,
    TEST_TOP1,
    VAL_BPB,
    VAL_BPB_WHOLE,
    VAL_LOSS,
    VISION_FIGURES,
    VISION_GEOMETRY,
    VISION_LAYERS,
    VISION_OVER_TRAINING,
    Metric,
)

__all__ = ["EVALUATIONS", "Evaluation", "Metric", "Task", "TASKS", "get_evaluation", "get_task", "upgrade_run"]


def _load(reference: str) -> Any:
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Task:
    """One training paradigm.

    Args:
        name: the CLI word (``lapheads train NAME``) and config.json's ``"task"``.
        help: one line for ``lapheads train --help``.
        config: ``module:Class`` of its config dataclass (fields declared with ``lapheads.config.option``).
        train: ``module:function``, called as ``train(cfg, run_dir, resume=, preset=)``.
        presets: ``module:dict`` of named configs.
        check_model: ``module:function(cfg)`` that builds the model once (a head spec that does not fit fails in one
            line before a sweep starts); None = nothing to check before the run.
        from_run: the task starts from another run or a nanochat checkpoint (``--from`` / ``--nanochat``).
        analyzer: ``module:function(run, options)`` for ``lapheads analyze``; None = not supported.
        analyzed_weights: the weights of a checkpoint that ``analyze`` and ``report`` read ("model", or DINO's
            "teacher").
        headline: the metrics ``lapheads report`` compares first (the first is the primary without a plan).
        geometry: the rows read from a layer's analysis, stated at each of ``geometry_layers``.
        geometry_layers: the layers whose geometry the report states.
        figures: ``lapheads analyze``'s per-layer figures for this task.
        over_training: the summary rows ``analyze --over-training`` plots against step (at the summary layer; the
            heads' diffusion scores are plotted for every block beside them).
        pictures: ``lapheads report`` draws the cells' attention maps and PCA pictures (they need the weights).
        upgrade: ``module:function(record)`` -> the config.json entries a run written by an older lapheads lacks
            (``lapheads upgrade``); None = nothing to add.
    """

    name: str
    help: str
    config: str
    train: str
    presets: str
    check_model: str | None = None
    from_run: bool = False
    analyzer: str | None = None
    analyzed_weights: str = "model"
    headline: tuple[Metric, ...] = ()
    geometry: tuple[Metric, ...] = ()
    geometry_layers: tuple[str, ...] = ()
    figures: tuple[str, ...] = ()
    over_training: tuple[str, ...] = ()
    pictures: bool = False
    upgrade: str | None = None

    def config_type(self) -> type:
        return _load(self.config)

    def train_function(self) -> Callable[..., dict[str, Any]]:
        """The task's trainer, holding its run folder for the call (one writer per run folder:
        ``lapheads.runs.owning_runs``)."""
        from lapheads.runs.directory import owning_runs

        train = _load(self.train)

        @functools.wraps(train)
        def owning(*args: Any, **kwargs: Any) -> dict[str, Any]:
            with owning_runs():
                return train(*args, **kwargs)

        return owning

    def preset_table(self) -> dict[str, Any]:
        return _load(self.presets)

    def check(self, cfg: Any) -> None:
        if self.check_model is not None:
            _load(self.check_model)(cfg)

    def analyze(self, run: Any, options: Any) -> dict[str, Any]:
        if self.analyzer is None:
            raise InputError(
                f"{run.path} holds a {self.name!r} run; analyze supports: "
                f"{', '.join(t.name for t in TASKS.values() if t.analyzer)}"
            )
        return _load(self.analyzer)(run, options)


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            name="classify",
            help="supervised image classification (ViT)",
            config="lapheads.train.configs.classify:ClassifyConfig",
            train="lapheads.train.classify:train_classify",
            presets="lapheads.tasks.presets.classify:CLASSIFY_PRESETS",
            check_model="lapheads.train.configs.classify:check_model",
            analyzer="lapheads.evals.geometry:analyze_classify",
            headline=(TEST_TOP1,),
            geometry=VISION_GEOMETRY,
            geometry_layers=VISION_LAYERS,
            figures=VISION_FIGURES,
            over_training=VISION_OVER_TRAINING,
            upgrade="lapheads.train.configs.classify:recorded_model",
        ),
        Task(
            name="lm",
            help="language-model pre-training (nanochat GPT)",
            config="lapheads.train.configs.lm:LMConfig",
            train="lapheads.train.lm:train_lm",
            presets="lapheads.tasks.presets.lm:LM_PRESETS",
            check_model="lapheads.train.configs.lm:check_model",
            analyzer="lapheads.evals.geometry:analyze_lm",
            headline=(VAL_BPB, VAL_BPB_WHOLE),  # the second only where --eval-whole-split ran
            # at the LM head's input (after the final norm), where linguistic-collapse studies measure them
            geometry=LM_GEOMETRY,
            geometry_layers=("after the final norm",),
            figures=("linguistic", "spectrum", "similarity", "mechanism"),
            over_training=(
                "CDNV, top-K next tokens",
                "components for 99%, pooled",
                "token cosine similarity",
            ),
            upgrade="lapheads.train.configs.lm:recorded_model",
        ),
        Task(
            name="dino",
            help="self-supervised DINO (ViT)",
            config="lapheads.train.configs.dino:DINOConfig",
            train="lapheads.train.dino:train_dino",
            presets="lapheads.tasks.presets.dino:DINO_PRESETS",
            check_model="lapheads.train.configs.dino:check_model",
            analyzer="lapheads.evals.geometry:analyze_dino",
            analyzed_weights="teacher",
            pictures=True,
            headline=DINO_HEADLINE,
            geometry=VISION_GEOMETRY,
            geometry_layers=VISION_LAYERS,
            figures=VISION_FIGURES,
            over_training=VISION_OVER_TRAINING,
            upgrade="lapheads.train.configs.dino:recorded_model",
        ),
        Task(
            name="mid",
            help="LM mid-training on packed conversations (from an LM run or nanochat)",
            config="lapheads.train.configs.chat:MidConfig",
            train="lapheads.train.chat:train_mid",
            presets="lapheads.tasks.presets.chat:MID_PRESETS",
            from_run=True,
            headline=(VAL_LOSS,),
        ),
        Task(
            name="sft",
            help="supervised fine-tuning on conversations, full or LoRA (from an LM/mid run or nanochat)",
            config="lapheads.train.configs.chat:SFTConfig",
            train="lapheads.train.chat:train_sft",
            presets="lapheads.tasks.presets.chat:SFT_PRESETS",
            from_run=True,
            headline=SFT_HEADLINE,
        ),
    )
}


@dataclass(frozen=True)
class Evaluation:
    """One ``lapheads eval NAME`` command: its options and the function that measures them.

    Args:
        name: the CLI word (``lapheads eval NAME``).
        options: ``module:Class`` of its options (``lapheads.evals.options``): the sub-parser's flags are generated
            from its fields, and a parsed command line becomes one checked value of it.
        run: ``module:function(options) -> results``: measures ``options.run_dir`` (or ``options.run_dirs``) and
            returns the results (a JSON-able dict, which the command prints as one line; a human summary goes to the
            function's logger).
        many_runs: takes one or more run directories (compared); else exactly one.
        nanochat: also takes a nanochat checkpoint folder (``--nanochat DIR``) instead of a run directory.
        harness: ``module:function(options)`` that runs instead when ``--harness`` is given (lm-evaluation-harness),
            with its own options (``harness_options``; the sub-parser holds both classes' flags).
        harness_needs: the one line shown when the harness integration is not installed.
    """

    name: str
    options: str
    run: str
    many_runs: bool = False
    nanochat: bool = False
    harness: str | None = None
    harness_options: str | None = None
    harness_needs: str = ""

    def option_classes(self) -> list[type]:
        """The options classes whose fields are this command's flags (the evaluation's, then the harness's)."""
        return [_load(ref) for ref in (self.options, self.harness_options) if ref]

    def __call__(self, args: Any) -> dict[str, Any]:
        """Run the evaluation on a parsed command line: its RUN_DIR arguments checked, its options built and checked
        (:func:`lapheads.config.config_from_args`), then the results with where they came from."""
        from lapheads.config import config_from_args

        run_dirs = list(args.run_dirs)
        nanochat = self.nanochat and getattr(args, "nanochat", None)
        if not run_dirs and not nanochat:
            raise InputError(f"eval {self.name} needs a RUN_DIR{' (or --nanochat DIR)' if self.nanochat else ''}")
        if nanochat and run_dirs:
            raise InputError(f"eval {self.name} takes a RUN_DIR or --nanochat DIR, not both")
        if not self.many_runs and not nanochat and len(run_dirs) != 1:
            raise InputError(f"eval {self.name} takes one RUN_DIR; got {len(run_dirs)}")
        harness = bool(self.harness and getattr(args, "harness", None))
        if self.many_runs:
            options = config_from_args(_load(self.options), args, run_dirs=tuple(run_dirs))
            return self._function(harness)(options)
        where = {"run_dir": None if nanochat else run_dirs[0]}
        options = config_from_args(_load(self.harness_options if harness else self.options), args, **where)
        results = self._function(harness)(options)
        source = {"nanochat": nanochat} if nanochat else where
        return {**source, "harness": results} if harness else {**source, **results}

    def _function(self, harness: bool) -> Any:
        reference = self.harness if harness else self.run
        try:
            return _load(reference)
        except ImportError:
            if not harness:
                raise
            raise InputError(self.harness_needs) from None


EVALUATIONS: dict[str, Evaluation] = {
    evaluation.name: evaluation
    for evaluation in (
        Evaluation("classify", "lapheads.evals.options:ClassifyEvalOptions", "lapheads.evals.classify:evaluate"),
        Evaluation(
            "lm",
            "lapheads.evals.options:LMEvalOptions",
            "lapheads.evals.lm:run_evals",
            nanochat=True,
            harness="lapheads.integrations.lm_eval:evaluate_harness",
            harness_options="lapheads.evals.options:HarnessOptions",
            harness_needs="--harness needs lm-evaluation-harness; allowed: pip install 'lapheads[lm-eval]'",
        ),
        Evaluation("dino", "lapheads.evals.options:DinoEvalOptions", "lapheads.evals.dino:eval_dino", many_runs=True),
        Evaluation("chat", "lapheads.evals.options:ChatEvalOptions", "lapheads.evals.chat:run_chat_evals"),
    )
}


def get_evaluation(name: str) -> Evaluation:
    """The evaluation called ``name``; anything else is a one-line error naming the evaluations."""
    try:
        return EVALUATIONS[name]
    except KeyError:
        raise InputError(f"evaluation {name!r}; allowed: {', '.join(EVALUATIONS)}") from None


def upgrade_run(run_dir: Any) -> list[str]:
    """Add what an older lapheads did not write to a run's config.json (the model's constructor arguments, an lm
    run's token folder), atomically; returns the added keys (none: already current). Checkpoints are untouched."""
    from lapheads.runs import RunDir, model_record

    run = RunDir(run_dir)
    record = run.read_config()
    task = get_task(record.get("task"))
    added: dict[str, Any] = {}
    model = record.get("model")
    if isinstance(model, dict) and "factory" not in model:  # chat runs of lapheads 0.1: GPTConfig's fields only
        added["model"] = model_record("gpt", model)
    elif model is None and task.upgrade is not None:
        added = _load(task.upgrade)(record)
    if added:
        import json

        from lapheads.io import atomic_write_text

        atomic_write_text(run.config_file, json.dumps(record | added, indent=2) + "\n")
    return sorted(added)


def get_task(name: str) -> Task:
    """The task called ``name``; anything else is a one-line error naming the tasks."""
    try:
        return TASKS[name]
    except KeyError:
        raise InputError(f"task {name!r}; allowed: {', '.join(TASKS)}") from None
