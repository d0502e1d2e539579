"""Each evaluation's options, declared as training configs are (:func:`lapheads.config.option`: a default, one line of
help, the values allowed): the ``lapheads eval NAME`` sub-parsers are generated from them
(:func:`lapheads.config.add_options`), the values are checked by the same rules before anything is read, and each
evaluation is one call with one value (``run_evals(options)``), from the CLI or from Python alike.

Design choices:

* **Torch-free.** ``lapheads eval NAME --help`` reads this module, so it imports nothing but the config helpers.
* **One field, one flag, one bound.** A bound lives in the field's domain, never again in a handler.
* **What the model is, apart from what is measured**: :class:`LMSource` (a run directory or a nanochat checkpoint)
  is shared by the LM benchmarks and the harness; ``run_dir`` / ``run_dirs`` are the RUN_DIR arguments, not flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from lapheads.config import NON_NEGATIVE, POSITIVE, at_least, option

__all__ = [
    "ChatEvalOptions",
    "ClassifyEvalOptions",
    "DinoEvalOptions",
    "HarnessOptions",
    "LMEvalOptions",
    "LMSource",
    "RUN_ARGUMENTS",
]

#: the fields that are the RUN_DIR arguments of ``lapheads eval NAME``, not ``--flags``
RUN_ARGUMENTS = ("run_dir", "run_dirs")

_DEVICE = "auto (CUDA where there is one, else the CPU), cpu, cuda, cuda:N"
_UNSAFE = (
    "humaneval where bubblewrap is not usable: run the model's code under lapheads' in-process guard, which stops "
    "accidents, not hostile code (without this flag such a run is refused; the result records it)"
)


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


@dataclass(frozen=True)
class ClassifyEvalOptions:
    """``lapheads eval classify RUN_DIR``."""

    run_dir: str = option("", "a classify run directory")
    ema: bool = option(False, "evaluate the EMA weights")
    fit_subset: int | None = option(
        None, "also score the first N training images without augmentation (fit_top1, fit_loss)", POSITIVE, metavar="N"
    )


@dataclass(frozen=True)
class LMSource:
    """Which language model: a lapheads run directory, or a nanochat checkpoint folder instead."""

    run_dir: str | None = option(None, "an lm, mid or sft run directory")
    nanochat: str | None = option(
        None, "a nanochat checkpoint folder (model_<step>.pt + meta_<step>.json) instead of RUN_DIR", metavar="DIR"
    )
    step: int | None = option(None, "--nanochat: the step (default: the last)", NON_NEGATIVE)
    nanochat_tokenizer: str | None = option(
        None, "--nanochat: the folder of its tokenizer.pkl (default: nanochat's <base>/tokenizer)", metavar="DIR"
    )


def _benchmarks(default: str, names: str) -> str:
    return option(default, f"comma list of {names} (--tasks: its 0.1 name, an alias for 0.1 only)", flags=("--tasks",))


@dataclass(frozen=True)
class _BenchmarkOptions:
    """What the LM and chat evaluations share: which benchmarks (each class its own list), their data and size."""

    benchmarks: str = _benchmarks("", "benchmarks")
    data_dir: str | None = option(None, "local <task>.jsonl/.parquet files in the hub's schema", metavar="DIR")
    max_examples: int | None = option(None, "the first N items per task", POSITIVE, metavar="N")
    num_samples: int = option(1, "HumanEval samples per problem (pass@k)", at_least(1), metavar="N")
    unsafe_code_execution: bool = option(False, _UNSAFE)
    device: str = option("auto", _DEVICE)

    @property
    def benchmark_names(self) -> list[str]:
        return _names(self.benchmarks)


@dataclass(frozen=True)
class LMEvalOptions(_BenchmarkOptions, LMSource):
    """``lapheads eval lm RUN_DIR|--nanochat DIR``: validation bits per byte and benchmarks."""

    benchmarks: str = _benchmarks("val_bpb", "val_bpb, arc_easy, arc_challenge, mmlu, gsm8k, humaneval")
    chat: bool = option(False, "wrap prompts in the chat tokens (SFT models)")


@dataclass(frozen=True)
class HarnessOptions(LMSource):
    """``lapheads eval lm RUN_DIR --harness TASKS``: lm-evaluation-harness on the run, with lm-eval's own options
    under their own names."""

    harness: str = option(
        "",
        "lm-evaluation-harness tasks (comma list); with --data-dir the shipped "
        "lapheads_{arc_easy,arc_challenge,mmlu,gsm8k,hellaswag} read <task>.jsonl there",
        metavar="TASKS",
    )
    data_dir: str | None = option(None, "local <task>.jsonl/.parquet files in the hub's schema", metavar="DIR")
    include_path: str | None = option(
        None,
        "a folder of your own task YAMLs. These are code: lm-eval imports the Python files they name (!function) and "
        "renders their prompts with an unsandboxed Jinja; use only folders you trust",
        metavar="DIR",
    )
    max_examples: int | None = option(None, "the first N items per task (lm-eval's --limit)", POSITIVE, metavar="N")
    limit: float | None = option(None, "items per task: a count, or a fraction < 1", POSITIVE)
    num_fewshot: int | None = option(None, "few-shot examples per item (task default)", NON_NEGATIVE)
    batch_size: int = option(8, "sequences scored at once", at_least(1))
    bootstrap_iters: int = option(100000, "resamples for the standard errors (0: none)", NON_NEGATIVE)
    log_samples: bool = option(False, "write every item's prompt, answer and score")
    gen_kwargs: str | None = option(None, "generation options, e.g. temperature=0,max_gen_toks=64")
    output_path: str | None = option(None, "lm-eval's own results JSON (default: RUN_DIR/report/lm_eval)")
    apply_chat_template: bool = option(
        False,
        "prompt in the run's own chat turns (<|user_start|> ... <|assistant_start|>), as mid / SFT runs were trained",
    )
    fewshot_as_multiturn: bool = option(False, "few-shot examples as chat turns")
    system_instruction: str | None = option(None, "a system prompt (leads the first user turn)")
    device: str = option("auto", _DEVICE)

    @property
    def task_names(self) -> list[str]:
        return _names(self.harness)


@dataclass(frozen=True)
class ChatEvalOptions(_BenchmarkOptions):
    """``lapheads eval chat RUN_DIR``: a chat model's benchmarks, with or without its calculator."""

    run_dir: str = option("", "a mid or sft run directory")
    benchmarks: str = _benchmarks("arith,letters", "arc_easy, arc_challenge, mmlu, gsm8k, humaneval, arith, letters")
    no_tools: bool = option(False, "no calculator (the model's own outputs)")


@dataclass(frozen=True)
class DinoEvalOptions:
    """``lapheads eval dino RUN_DIR [RUN_DIR ...]``: k-NN (of the teacher and of the same architecture at random
    initialisation), linear probe, segmentation mIoU and pictures, for runs compared side by side."""

    run_dirs: tuple[str, ...] = option((), "one or more DINO run directories, compared")
    max_examples: int | None = option(None, "the first N test images", POSITIVE, metavar="N")
    max_train: int | None = option(None, "the first N training images (k-NN, linear)", POSITIVE, metavar="N")
    seg_train: int = option(2000, "images the segmentation probe trains on", at_least(1), metavar="N")
    seg_test: int = option(500, "images the segmentation probe is scored on", at_least(1), metavar="N")
    seg_epochs: int = option(10, "epochs of the segmentation probe", at_least(1))
    linear_epochs: int = option(20, "epochs of the linear probe", at_least(1))
    ade20k: str | None = option(None, "ADE20K root for the segmentation probe (non-FMNIST runs)", metavar="DIR")
    num_pictures: int = option(6, "images in attention.png and pca.png", at_least(1), metavar="N")
    out: str | None = option(None, "where pca.png goes (default: the first run's report/)", metavar="DIR")
    reuse: bool = option(
        False, "keep a run's eval_dino.json measured on the same checkpoint with the same options (pictures redrawn)"
    )
    device: str = option("auto", _DEVICE)
